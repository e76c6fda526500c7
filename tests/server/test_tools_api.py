"""Tool calls and structured output through the real server and the openai client, in both modes, streamed and
not: forced tool calls always parse and validate, json_schema output always validates, json_object is an object,
and a history with tool calls and tool results renders."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest

MODES = ["server", "colocated_server"]
# Both modes unstreamed (disaggregated hands the grammar's state from the prefill device to the decode device);
# streamed only in one: how the deltas are framed does not depend on the mode (and each case costs ~10 s of CI).
CASES = [("server", False), ("colocated_server", False), ("server", True)]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "reason": {"type": "string", "maxLength": 30}},
          "required": ["answer", "confidence", "reason"]}
# Sampled, three choices a request: "always" is checked on several draws, not only the greedy one.
SAMPLED = {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 64}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _assert_pools_whole(server, timeout=20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(server.url + "/debug/kv") as r:
            pools = json.load(r)["pools"]
        if all(p["num_free"] == p["num_pages"] for p in pools):
            return
        assert time.monotonic() < deadline, f"KV pages leaked: {pools}"
        time.sleep(0.1)


def _collect_stream(stream) -> dict[int, dict]:
    """Per choice: its content, finish reason, and tool calls assembled from the deltas as OpenAI streams them."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "finish": None, "calls": []})
            o["content"] += c.delta.content or ""
            o["finish"] = c.finish_reason or o["finish"]
            for tc in c.delta.tool_calls or []:
                if tc.index == len(o["calls"]):  # the first delta of a call: its id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name
                    o["calls"].append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
                else:
                    assert tc.id is None and tc.function.name is None
                    o["calls"][tc.index]["arguments"] += tc.function.arguments or ""
    return out


def _calls(server, stream: bool, **kwargs) -> list[tuple[str, list[dict]]]:
    """(finish_reason, [{"name", "arguments"}]) per choice."""
    client = _client(server)
    if not stream:
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, **kwargs)
        return [(c.finish_reason, [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                                   for t in c.message.tool_calls or []]) for c in r.choices]
    out = _collect_stream(client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, stream=True,
                                                         **kwargs))
    assert all(o["content"] == "" for o in out.values())
    return [(out[i]["finish"], out[i]["calls"]) for i in sorted(out)]


@pytest.mark.slow
@pytest.mark.parametrize(("which", "stream"), CASES)
def test_named_tool_choice_always_returns_a_valid_call(which, stream, request):
    server = request.getfixturevalue(which)
    for kwargs in ({"temperature": 0.0, "max_tokens": 64}, SAMPLED):
        choices = _calls(server, stream, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         **kwargs)
        assert len(choices) == kwargs.get("n", 1)
        for finish, calls in choices:
            assert finish == "tool_calls" and len(calls) == 1
            assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
            jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS)
    _assert_pools_whole(server)


@pytest.mark.parametrize(("which", "stream"), CASES)
def test_required_tool_choice_returns_a_call_to_one_of_the_tools(which, stream, request):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for finish, calls in _calls(request.getfixturevalue(which), stream, tool_choice="required", **SAMPLED):
        assert finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])


@pytest.mark.parametrize(("which", "stream"), CASES)
def test_json_schema_output_always_validates(which, stream, request):
    client = _client(request.getfixturevalue(which))
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    for kwargs in ({"temperature": 0.0, "max_tokens": 64}, SAMPLED):
        if stream:
            out = _collect_stream(client.chat.completions.create(model="smollm2", messages=ask, response_format=fmt,
                                                                 stream=True, **kwargs))
            texts = [(out[i]["finish"], out[i]["content"]) for i in sorted(out)]
        else:
            r = client.chat.completions.create(model="smollm2", messages=ask, response_format=fmt, **kwargs)
            texts = [(c.finish_reason, c.message.content) for c in r.choices]
        assert len(texts) == kwargs.get("n", 1)
        for finish, text in texts:
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
    _assert_pools_whole(request.getfixturevalue(which))


@pytest.mark.parametrize("which", MODES)
def test_json_object_output_is_an_object(which, request):
    client = _client(request.getfixturevalue(which))
    ask = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model="smollm2", messages=ask, response_format={"type": "json_object"},
                                       temperature=0.0, max_tokens=96)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # Unconstrained, the same request does not answer in JSON: the grammar is what made it one.
    free = client.chat.completions.create(model="smollm2", messages=ask, temperature=0.0, max_tokens=96)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_tool_history_renders_and_auto_may_answer_in_text(server):
    client = _client(server)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0.0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The same history through /tokenize: the tool call and its result are in the prompt.
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"messages": history}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        ids = json.load(resp)["tokens"]
    req = urllib.request.Request(server.url + "/detokenize", data=json.dumps({"tokens": ids}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        text = json.load(resp)["prompt"]
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text


def test_bad_schema_and_tool_choice_are_400s_naming_the_field(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}})
    assert info.value.body["param"] == "response_format.json_schema.schema"
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=ASK, tools=bad_tools, tool_choice="required")
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
