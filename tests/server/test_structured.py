"""server/structured.py: which requests get which grammar, the compile cache, invalid schemas as 400s."""

from __future__ import annotations

import pytest

from nodeserve.server.protocol import APIError, Limits, parse_chat_request
from nodeserve.server.structured import Grammars, grammar_spec
from nodeserve.server.tool_parsers import HermesFormat

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"x": {"type": "integer"}}}}}


def _chat(**fields):
    return parse_chat_request({"messages": USER, **fields}, Limits())


def test_grammar_spec():
    fmt = HermesFormat()
    assert grammar_spec(_chat(), fmt) is None
    assert grammar_spec(_chat(tools=[TOOL]), fmt) is None  # auto: the model decides
    assert grammar_spec(_chat(response_format={"type": "json_object"}), fmt) == ("json", "response_format",
                                                                                {"type": "object"})
    kind, param, schema = grammar_spec(_chat(response_format={"type": "json_schema",
                                                              "json_schema": {"name": "n", "schema": {"type": "array"}}}), fmt)
    assert (kind, param, schema) == ("json", "response_format.json_schema.schema", {"type": "array"})
    kind, param, (prefix, schema, suffix) = grammar_spec(
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), fmt)
    assert (kind, param, prefix, suffix) == ("tool", "tools[0].function.parameters", "<tool_call>\n", "\n</tool_call>")
    assert schema == fmt.call_schema("f", TOOL["function"]["parameters"])
    g = {"type": "function", "function": {"name": "g"}}
    _, _, (_, schema, _) = grammar_spec(_chat(tools=[TOOL, g], tool_choice="required"), fmt)
    assert schema == {"anyOf": [fmt.call_schema("f", TOOL["function"]["parameters"]), fmt.call_schema("g", None)]}
    with pytest.raises(APIError) as info:
        grammar_spec(_chat(tools=[TOOL], tool_choice="required"), None)
    assert info.value.param == "tool_choice"


def test_compile_caches_and_names_the_bad_field(smollm2_tokenizer):
    grammars = Grammars(smollm2_tokenizer, 49152)
    spec = ("json", "response_format", {"type": "object"})
    assert grammars.compile(spec) is grammars.compile(("json", "response_format", {"type": "object"}))
    deep: dict = {"type": "integer"}
    for _ in range(100):  # llguidance takes objects nested up to about 60 deep
        deep = {"type": "object", "properties": {"c": deep}}
    for bad, reason in (({"type": "strang"}, "strang"), ({"properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
                        ({"type": "string", "pattern": "(a"}, "unclosed group"), (deep, "recursion limit"),
                        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum")):
        with pytest.raises(APIError) as info:
            grammars.compile(("json", "response_format.json_schema.schema", bad))
        assert info.value.status == 400 and info.value.param == "response_format.json_schema.schema"
        assert "'response_format.json_schema.schema'" in info.value.message and reason in info.value.message
        assert "<state>" not in info.value.message and "\n" not in info.value.message
    tool = grammar_spec(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}],
                              tool_choice="required"), HermesFormat())
    with pytest.raises(APIError) as info:
        grammars.compile(tool)
    assert info.value.status == 400 and info.value.param == "tools" and "recursion limit" in info.value.message


def _accepts(tokenizer, m, text: str) -> bool:
    """Whether matcher m takes `text` (tokenized as the model would write it) from where it is."""
    return m.ll.consume_tokens(tokenizer.encode(text, add_bos=False))


def test_forced_call_grammar_accepts_exactly_the_call(smollm2_tokenizer):
    grammars = Grammars(smollm2_tokenizer, 49152)
    fmt = HermesFormat()
    spec = grammar_spec(_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), fmt)
    m = grammars.matcher(grammars.compile(spec))
    # '<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>'
    assert _accepts(smollm2_tokenizer, m, fmt.render_call("f", {"x": 3}))
    assert m.ll.is_accepting()
    for bad in ('<tool_call>\n{"name": "g", ', '{"name"', '<tool_call>\n{"name": "f", "arguments": {"x": "3"',
                '<tool_call>\n{"name":"f"', '<tool_call>\n{"name": "f", "arguments": {"x": 3, "y": 4}}'):
        assert not _accepts(smollm2_tokenizer, grammars.matcher(grammars.compile(spec)), bad), bad


def test_schemas_mean_what_they_meant_under_xgrammar_strict_mode(smollm2_tokenizer):
    """What nodeserve's schemas allowed under xgrammar (strict mode, compact JSON), llguidance allows: no
    properties a schema with `properties` does not list, patterns anchored, `{"type": "object"}` any object,
    ", " and ": " and no other whitespace, unimplemented keywords ignored; a client's "x-guidance" does nothing."""
    grammars = Grammars(smollm2_tokenizer, 49152)

    def takes(schema, text):
        m = grammars.matcher(grammars.compile(("json", "response_format", schema)))
        return _accepts(smollm2_tokenizer, m, text) and m.ll.is_accepting()

    props = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert takes(props, '{"a": 1}') and takes(props, "{}") and not takes(props, '{"a": 1, "b": 2}')
    assert not takes(props, '{"a":1}') and not takes(props, '{ "a": 1}') and not takes(props, '{"a": 1}\n')
    assert takes({**props, "additionalProperties": True}, '{"a": 1, "b": 2}')
    assert takes({**props, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": "x"}')
    assert not takes({**props, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": 2}')
    assert takes({"type": "object"}, '{"a": [1, {"b": null}]}')  # json_object: any object
    assert takes({"type": "string"}, '"caf\\u00e9 \\n"') and takes({"type": "object"}, '{"k": "\\u00e9"}')
    nested = {"type": "array", "items": {"anyOf": [props, {"type": "null"}]}}
    assert takes(nested, '[{"a": 1}, null]') and not takes(nested, '[{"a": 1, "c": 0}]')
    assert takes({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]")
    assert not takes({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]")
    for pattern in ("ab", "^ab", "ab$", "^ab$"):
        s = {"type": "string", "pattern": pattern}
        assert takes(s, '"ab"') and not takes(s, '"xab"') and not takes(s, '"abx"'), pattern
    either = {"type": "string", "pattern": "a|b"}
    assert takes(either, '"b"') and not takes(either, '"ab"')
    # data is not schema: an enum member with "properties" or "pattern" keys is kept as it is
    data = {"enum": [{"properties": 1, "pattern": "x"}]}
    assert takes(data, '{"properties": 1, "pattern": "x"}')
    assert takes({"type": "string", "format": "no-such-format"}, '"x"') and takes({"not": {"type": "string"}}, "1")
    assert not takes({**props, "x-guidance": {"whitespace_flexible": True}}, '{ "a": 1}')


def test_the_compile_cache_is_bounded_in_count_and_bytes(smollm2_tokenizer):
    """The LRU holds at most max_cached grammars and max_cached_bytes of them (an estimate from the schema's
    size: llguidance reports no grammar's memory); llguidance itself caches no grammar."""
    from nodeserve.server import structured as S

    specs = [("json", "response_format", {"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
             for i in range(4)]
    grammars = Grammars(smollm2_tokenizer, 49152, max_cached=3)
    first = [grammars.compile(s) for s in specs]
    assert len(grammars._cache) == 3
    assert grammars.compile(specs[3]) is first[3] and grammars.compile(specs[0]) is not first[0]  # evicted, made again
    one = grammars.num_cached_bytes / 3
    assert one > S.GRAMMAR_BASE_BYTES
    small = Grammars(smollm2_tokenizer, 49152, max_cached_bytes=int(2.5 * one))
    for s in specs:
        small.compile(s)
    assert len(small._cache) == 2 and small.num_cached_bytes <= 2.5 * one


def test_hostile_schemas_are_refused_before_compiling_and_slow_ones_are_capped(smollm2_tokenizer):
    import asyncio
    import time

    from nodeserve.server import structured as S

    grammars = Grammars(smollm2_tokenizer, 49152)
    param = "response_format.json_schema.schema"
    for schema, limit in (({"type": "string", "maxLength": 10**9}, "maxLength"),
                          ({"type": "array", "items": {"type": "integer"}, "minItems": 50_000}, "minItems"),
                          ({"type": "string", "pattern": "(a|b)*" * 200}, "pattern"),
                          ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}},
                           "bytes")):
        with pytest.raises(APIError) as info:
            asyncio.run(grammars.compile_async(("json", param, schema)))
        assert info.value.status == 400 and info.value.param == param and limit in info.value.message

    slow = Grammars(smollm2_tokenizer, 49152)
    slow.compile = lambda spec: time.sleep(0.5) or "compiled"
    slow.timeout_s = 0.05

    async def main():
        with pytest.raises(APIError) as info:
            await slow.compile_async(("json", param, {"type": "object"}))
        assert info.value.status == 400 and "took longer than" in info.value.message
        # The compile thread is busy: requests queue behind it, up to MAX_QUEUED_COMPILES in all.
        slow.timeout_s = 30.0
        waiting = [asyncio.ensure_future(slow.compile_async(("json", param, {"type": "object"})))
                   for _ in range(S.MAX_QUEUED_COMPILES - 1)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await slow.compile_async(("json", param, {"type": "object"}))
        assert info.value.status == 503
        for w in waiting:
            w.cancel()

    asyncio.run(main())
