"""server/tool_parsers.py: Hermes and Llama 3 tool calls found in whole answers and in streamed ones."""

from __future__ import annotations

import json
import time

import pytest

from nodeserve.server.tool_parsers import HermesFormat, Llama3Format, pick_format

HERMES = HermesFormat()
LLAMA3 = Llama3Format()


def test_hermes_parse_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = HERMES.parse(text)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].to_openai()["type"] == "function"


@pytest.mark.parametrize("text", [
    "no calls here", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ""])
def test_hermes_text_that_is_not_a_call_stays_content(text):
    assert HERMES.parse(text) == (text, [])


def test_hermes_unclosed_call_at_the_end_still_counts():
    # A model without a grammar may stop (EOS) before writing </tool_call>.
    content, calls = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}


def test_llama3_parse():
    content, calls = LLAMA3.parse('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert LLAMA3.parse('<|python_tag|>{"name": "f", "arguments": {"y": "z"}}')[1][0].arguments == '{"y": "z"}'
    for text in ("Paris is sunny.", '{"x": 1}', '{"name": "f", "parameters": {}} and then text', "{broken"):
        assert LLAMA3.parse(text) == (text, [])


def test_render_call_round_trips_through_parse():
    for fmt in (HERMES, LLAMA3):
        text = fmt.render_call("f", '{"a": [1, "é"]}')
        content, calls = fmt.parse(text)
        assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": [1, "é"]}


def test_call_schema_names_the_function_and_its_parameters():
    params = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert HERMES.call_schema("f", params)["properties"] == {"name": {"const": "f"}, "arguments": params}
    assert LLAMA3.call_schema("f", None)["properties"]["parameters"] == {"type": "object"}


def test_pick_format():
    assert pick_format("none", "") is None
    assert isinstance(pick_format("llama3", "<tool_call>"), Llama3Format)
    assert isinstance(pick_format("auto", "{{ '<tool_call>' }}"), HermesFormat)
    assert isinstance(pick_format("auto", "{{ '<|python_tag|>' }}"), Llama3Format)
    assert isinstance(pick_format("auto", "{{ messages }}"), HermesFormat)  # the fallback prompt's format


def _stream(fmt, text: str, step: int) -> list[dict]:
    s = fmt.streamer()
    deltas = []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        deltas += s.feed(piece, final=k == len(pieces) - 1)
    return deltas


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What the openai SDK's stream helpers build from the deltas."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_stream_matches_the_whole_parse(step):
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <3"}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    deltas = _stream(HERMES, text, step)
    content, calls = _assemble(deltas)
    assert content == "Sure. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris <3"}), ("g", {})]
    # No content delta carries any part of the call markup.
    assert not any("<" in d.get("content", "") for d in deltas)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call(step):
    # Seen in the one-hour soak (a forced call): the model wrote "</tool_call" inside an argument string and the
    # call was cut there, its arguments no longer JSON.
    args = {"city": "]}</tool_call</tool_call>", "note": "a \\\" quote"}
    text = ('<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": args}) + '\n</tool_call>'
            ' after <tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = HERMES.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("g", {})]
    assert content == " after "
    content, streamed = _assemble(_stream(HERMES, text, step))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", args), ("g", {})]
    assert content == " after "


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_without_calls_is_all_content(step):
    for fmt in (HERMES, LLAMA3):
        text = "The answer is <b>42</b> <tool_ and more"
        content, calls = _assemble(_stream(fmt, text, step))
        assert (content, calls) == (text, [])


def test_hermes_stream_sends_the_name_then_the_arguments_as_they_come():
    s = HERMES.streamer()
    assert s.feed("<tool_call>\n") == []
    assert s.feed('{"name": "f", "argu') == []  # the name is not known for sure yet
    header, args = s.feed('ments": {"x": "a}b')
    assert header["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert header["tool_calls"][0]["index"] == 0 and header["tool_calls"][0]["id"].startswith("call_")
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": "a}b'}}]}
    # A brace inside a string does not end the arguments; the outer object's brace is not theirs.
    assert s.feed('\\"", "y": [1]}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {
        "arguments": '\\"", "y": [1]}'}}]}]
    assert s.feed("", final=True) == []


def test_hermes_stream_with_arguments_before_the_name_sends_the_call_whole():
    deltas = _stream(HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', 4)
    assert _assemble(deltas)[1] == [{"id": deltas[0]["tool_calls"][0]["id"], "name": "f", "arguments": '{"x": 1}'}]


def test_hermes_stream_broken_call_comes_back_as_content():
    text = "<tool_call>{oops"
    assert _assemble(_stream(HERMES, text, 2)) == (text, [])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_stream(step):
    text = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [2]}}'
    content, calls = _assemble(_stream(LLAMA3, text, step))
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                         ("g", {"y": [2]})]


# Adversarial model output (issue #26): the regexes this parser used took time quadratic in these inputs, tens of
# seconds to minutes each (see each test), on the event loop. A linear scan takes milliseconds: the bound is generous,
# for a loaded CI machine, and the timeout ends a regression early.
FAST_S = 2.0


def _timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


WS = " " * 200_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, call", [
    ('<tool_call>{"name": "f",' + WS + '"arguments": {}}</tool_call>', "f"),  # was 227 s
    ("<tool_call>x" + WS + "y", None),  # was 229 s
    ("<tool_call>" + WS + "x", None),  # was fast: the regex's first \s* took the run whole
    ("<tool_call>" * 20_000, None)])  # was fast: one match to the end
def test_hermes_parse_takes_linear_time(text, call):
    (content, calls), seconds = _timed(HERMES.parse, text)
    assert [c.name for c in calls] == ([call] if call else []) and content == (None if call else text)
    assert seconds < FAST_S


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, step, call", [
    ("<tool_call>" * 20_000, 11, None),  # was 40 s: every piece went through every block
    ('<tool_call>{"name": "' + "a" * 200_000, 16, None),  # was 50 s: every piece matched the head again
    ("<tool_call>" + WS + '{"name": "f", "arguments": {"x": 1}}</tool_call>', 4, "f"),  # was 12 s
    ('<tool_call>{"name": "f",' + WS + '"arguments": {"x": 1}}</tool_call>', 4, "f")])  # was 13 s
def test_hermes_stream_takes_linear_time(text, step, call):
    (content, calls), seconds = _timed(lambda: _assemble(_stream(HERMES, text, step)))
    assert (content, [(c["name"], json.loads(c["arguments"])) for c in calls]) == (
        ("", [(call, {"x": 1})]) if call else (text, []))
    assert seconds < FAST_S


@pytest.mark.timeout(60)
def test_llama3_stream_takes_linear_time():
    # Every piece decoded all the calls so far again: 105 s for these 5,000.
    text = '{"name": "f", "parameters": {}}; ' * 5_000
    (content, calls), seconds = _timed(lambda: _assemble(_stream(LLAMA3, text, 16)))
    assert content == "" and len(calls) == 5_000 and {(c["name"], c["arguments"]) for c in calls} == {("f", "{}")}
    assert seconds < FAST_S


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("text", [
    ' {"name": "f", "parameters": {}}\n{"name": "g", "parameters": {"a": "}"}}\xa0',  # strip() drops \xa0
    '{"name": "f", "parameters": {}}; oops', '{"name": "f", "parameters": {}};{"x": 1}', "  {]", "   ",
    '{"name": "f", "parameters": {}}\xa0{"name": "g", "parameters": {}}'])  # \xa0 separates no calls
def test_llama3_stream_matches_the_whole_parse(text, step):
    content, calls = LLAMA3.parse(text)
    streamed, streamed_calls = _assemble(_stream(LLAMA3, text, step))
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]
    assert streamed == ("" if calls or not text.strip() else content)


def test_json_nested_too_deep_is_content_not_an_error():
    deep = "[" * 100_000 + "]" * 100_000
    for fmt, text in ((HERMES, "<tool_call>" + deep), (LLAMA3, '{"a": ' + deep + "}")):
        assert fmt.parse(text) == (text, [])
        assert _assemble(_stream(fmt, text, 1000)) == (text, [])


def test_hermes_stream_name_json_cannot_read_is_content_not_an_error():
    # The name is decoded alone as it streams: an invalid escape or a raw newline in it is no call (it was an error).
    for text in ('<tool_call>{"name": "a\\x", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "a\nb", "arguments": {}}'):
        assert HERMES.parse(text) == (text, []) and _assemble(_stream(HERMES, text, 4)) == (text, [])
