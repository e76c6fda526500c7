"""Tests for nodeserve.server.protocol: validation, error bodies, response shapes, SSE framing."""

import json
import math

import pytest

from nodeserve.server.protocol import (
    APIError, ChatRequest, CompletionRequest, Limits, chat_chunk, chat_choice, chat_logprobs,
    chat_response, completion_choice, completion_chunk, completion_logprobs, completion_response,
    parse_chat_request, parse_completion_request, parse_json, sse, to_json, usage, usage_chunk)

LIMITS = Limits()
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatRequest:
    return parse_chat_request({"model": "m", "messages": USER, **fields}, LIMITS)


def completion(**fields) -> CompletionRequest:
    return parse_completion_request({"model": "m", "prompt": "hi", **fields}, LIMITS)


# ---- good requests ----

def test_chat_defaults():
    req = chat()
    assert req.model == "m"
    assert req.messages == USER
    assert (req.n, req.stream, req.include_usage, req.logprobs) == (1, False, False, False)
    assert req.params.max_tokens is None  # as given: the engine resolves it (resolve_max_tokens)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ([], [], False, None)


def test_chat_params_mapped():
    req = chat(max_tokens=50, n=3, temperature=0, top_p=0.9, top_k=40, min_p=0.05, seed=-7,
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, stop="\n\n",
               stop_token_ids=[2, 3], ignore_eos=True, logprobs=True, top_logprobs=5, stream=True,
               stream_options={"include_usage": True})
    p = req.params
    assert p.max_tokens == 50
    assert (req.n, req.stream, req.include_usage, req.logprobs) == (3, True, True, True)
    assert p.greedy and isinstance(p.temperature, float)
    assert (p.top_p, p.top_k, p.min_p, p.seed) == (0.9, 40, 0.05, -7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["\n\n"], [2, 3], True, 5)


def test_chat_max_completion_tokens_wins():
    assert chat(max_tokens=10, max_completion_tokens=20).params.max_tokens == 20
    assert chat(max_completion_tokens=20).params.max_tokens == 20
    assert chat(max_tokens=10, max_completion_tokens=None).params.max_tokens == 10


def test_chat_logprobs_without_top_logprobs_is_zero():
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(logprobs=False).params.logprobs is None


def test_chat_messages_normalized():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "", "name": "bob"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant"},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    req = parse_chat_request({"messages": messages}, LIMITS)
    assert req.model is None
    assert [m["content"] for m in req.messages] == ["be brief", "a\nb", "", None, None, "42"]
    assert req.messages[2]["name"] == "bob" and req.messages[5]["tool_call_id"] == "1"
    assert messages[1]["content"][0] == {"type": "text", "text": "a"}  # the body is not mutated


@pytest.mark.parametrize("prompt, prompts", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([0], [[0]]),
])
def test_completion_prompt_forms(prompt, prompts):
    assert completion(prompt=prompt).prompts == prompts


def test_completion_defaults():
    req = completion()
    assert req.params.max_tokens is None  # as given: the engine resolves it (resolve_max_tokens)
    assert (req.n, req.stream, req.include_usage, req.echo) == (1, False, False, False)
    assert req.params.logprobs is None


def test_completion_params_mapped():
    req = completion(max_tokens=5, logprobs=3, echo=True, stream=True, top_k=-1, n=2,
                     stream_options={"include_usage": True}, stop=["a", "b"])
    assert req.params.max_tokens == 5 and req.params.logprobs == 3
    assert (req.echo, req.stream, req.include_usage, req.n) == (True, True, True, 2)
    assert req.params.top_k == 0  # -1 normalized to "off"
    assert req.params.stop == ["a", "b"]
    assert completion(logprobs=0).params.logprobs == 0


def test_nulls_count_as_absent():
    nulls = dict.fromkeys(["model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                           "stop_token_ids", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "ignore_eos", "stream", "stream_options",
                           "max_tokens", "logprobs", "echo"])
    assert completion(**nulls).params == completion().params
    assert chat(**nulls, top_logprobs=None, max_completion_tokens=None).params == chat().params


def test_unknown_fields_ignored():
    req = chat(user="u", tools=[], response_format={"type": "text"}, foo={"bar": [1]}, best_of=3)
    assert req.params == chat().params


def test_integral_float_accepted_as_int():
    assert completion(max_tokens=5.0).params.max_tokens == 5
    assert type(completion(n=2.0).n) is int


def test_floats_accept_ints_and_bounds():
    p = chat(temperature=2, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2,
             repetition_penalty=10).params
    assert (p.temperature, p.top_p, p.min_p) == (2.0, 1.0, 1.0)
    assert chat(temperature=100).params.temperature == 100.0
    assert chat(seed=2**63 - 1).params.seed == 2**63 - 1
    assert chat(n=LIMITS.max_n).n == LIMITS.max_n
    assert chat(stop=["x"] * LIMITS.max_stop).params.stop == ["x"] * LIMITS.max_stop


def test_stop_strings_are_capped_in_total_bytes_with_a_400_naming_stop():
    at_cap = ["é" * (LIMITS.max_stop_bytes // 4)] * 2  # two bytes a character: exactly the cap
    assert chat(stop=at_cap).params.stop == at_cap
    for stop in ("x" * (LIMITS.max_stop_bytes + 1), ["ab"] * 8 + ["x" * (LIMITS.max_stop_bytes - 15)],
                 "x" * 1_000_000):  # a 1 MB stop string re-copied and re-searched on every token
        with pytest.raises(APIError) as info:
            chat(stop=stop)
        assert info.value.status == 400 and info.value.param == "stop"
        assert f"at most {LIMITS.max_stop_bytes} bytes" in info.value.message


def test_greedy_with_n_allowed():
    assert chat(temperature=0, n=4).n == 4


def test_echo_with_stream_allowed():
    req = completion(echo=True, stream=True)
    assert req.echo and req.stream


# ---- bad requests ----

BAD_COMMON = [
    # (fields, param) -- applied to both routes
    ({"model": 3}, "model"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": "2"}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -math.inf}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": 0.5}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": False}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1_000_001}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": 2}, "stop_token_ids"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"stream": True, "stream_options": True}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]

BAD_CHAT = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    ({"messages": USER + [{"role": "user", "content": {}}]}, "messages[1].content"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
]

BAD_COMPLETION = [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": ["a", None]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 2.5]}, "prompt[1]"),
    ({"prompt": [True, 1]}, "prompt[0]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [1, 2**31]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": [[1, 2], [3, -4]]}, "prompt[1][1]"),
    ({"prompt": ["p"] * 65}, "prompt"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"echo": "no"}, "echo"),
]


def _expect_400(parse, body, param):
    with pytest.raises(APIError) as info:
        parse(body, LIMITS)
    err = info.value
    assert err.status == 400 and err.type == "BadRequestError"
    assert err.param == param
    assert f"'{param}'" in err.message, err.message  # the message names the field
    assert len(err.message) < 300  # huge values are not echoed back in full
    return err


@pytest.mark.parametrize("fields, param", BAD_COMMON + BAD_CHAT)
def test_chat_rejects(fields, param):
    _expect_400(parse_chat_request, {"model": "m", "messages": USER, **fields}, param)


@pytest.mark.parametrize("fields, param", BAD_COMMON + BAD_COMPLETION)
def test_completion_rejects(fields, param):
    _expect_400(parse_completion_request, {"model": "m", "prompt": "hi", **fields}, param)


# Fields nodeserve does not implement: a 400 naming the field, never a 200 that ignores them.
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
UNSUPPORTED_CHAT = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL], "tool_choice": "required"}, "response_format"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
]
UNSUPPORTED_COMPLETION = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": "2"}, "best_of"),
    ({"suffix": "return x"}, "suffix"),
    ({"suffix": ""}, "suffix"),
]
BAD_LOGIT_BIAS_AND_MIN_TOKENS = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"01": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 10**7}, "min_tokens"),
]


@pytest.mark.parametrize("fields, param", UNSUPPORTED_CHAT + BAD_LOGIT_BIAS_AND_MIN_TOKENS)
def test_chat_rejects_what_it_does_not_implement(fields, param):
    _expect_400(parse_chat_request, {"model": "m", "messages": USER, **fields}, param)


@pytest.mark.parametrize("fields, param", UNSUPPORTED_COMPLETION + BAD_LOGIT_BIAS_AND_MIN_TOKENS)
def test_completion_rejects_what_it_does_not_implement(fields, param):
    _expect_400(parse_completion_request, {"model": "m", "prompt": "hi", **fields}, param)


def test_the_values_that_ask_for_nothing_are_accepted():
    for fields in ({"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
                   {"tool_choice": "auto"}, {"tools": None, "tool_choice": None, "response_format": None},
                   {"modalities": ["text"]}, {"store": False}, {"functions": None}, {"metadata": {"a": "b"}}):
        chat(**fields)
    for fields in ({"best_of": 1}, {"suffix": None}, {"response_format": {"type": "text"}}):
        completion(**fields)


def test_logit_bias_and_min_tokens_reach_the_sampling_params():
    for parsed in (chat(logit_bias={"2": -100, "17": 5.5}, min_tokens=3),
                   completion(logit_bias={"2": -100, "17": 5.5}, min_tokens=3)):
        assert parsed.params.logit_bias == {2: -100.0, 17: 5.5}
        assert parsed.params.min_tokens == 3
    assert chat().params.logit_bias == {} and chat().params.min_tokens == 0


def test_image_part_message():
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    err = _expect_400(parse_chat_request, body, "messages[0].content[0]")
    assert "only text content is supported" in err.message


@pytest.mark.parametrize("body", [None, [], "hi", 3, True, [{"messages": USER}]])
@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
def test_non_object_body(parse, body):
    with pytest.raises(APIError) as info:
        parse(body, LIMITS)
    assert info.value.status == 400 and "JSON object" in info.value.message


def test_limits_are_configurable():
    limits = Limits(max_n=2, max_stop=1, max_logprobs=3, max_tokens=100, max_prompts=2)
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "a", "n": 3}, limits)
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "a", "stop": ["a", "b"]}, limits)
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "a", "logprobs": 4}, limits)
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "a", "max_tokens": 101}, limits)
    with pytest.raises(APIError):
        parse_completion_request({"prompt": ["a", "b", "c"]}, limits)
    assert parse_chat_request({"messages": USER, "max_tokens": 100}, limits).params.max_tokens == 100
    with pytest.raises(ValueError):
        Limits(max_n=0)


def test_long_token_prompt_is_fast_enough():
    ids = list(range(100_000))
    assert completion(prompt=ids).prompts[0] == ids


# ---- errors and JSON ----

def test_api_error_body():
    err = APIError(400, "'n' must be at least 1, got 0", param="n")
    assert err.body() == {"error": {"message": "'n' must be at least 1, got 0",
                                    "type": "BadRequestError", "param": "n", "code": 400}}
    assert str(err) == err.message


@pytest.mark.parametrize("status, type_", [
    (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"),
    (413, "BadRequestError"), (429, "RateLimitError"), (500, "InternalServerError"),
    (503, "ServiceUnavailableError"), (502, "InternalServerError"),
])
def test_api_error_default_types(status, type_):
    assert APIError(status, "x").body()["error"]["type"] == type_


def test_api_error_explicit_type():
    body = APIError(404, "The model 'x' does not exist", param="model", type="NotFoundError").body()
    assert body["error"]["param"] == "model" and body["error"]["code"] == 404


def test_parse_json():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    assert parse_json('{"a": "é"}'.encode()) == {"a": "é"}
    for raw in [b"", b"{", b"\xff\xfe\xfa", b"[" * 100_000]:
        with pytest.raises(APIError) as info:
            parse_json(raw)
        assert info.value.status == 400
    # NaN parses; validation then rejects it with the field name.
    body = parse_json(b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    _expect_400(parse_chat_request, body, "temperature")


# ---- responses ----

def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1, "b": [1, 2]}) == b'data: {"a":1,"b":[1,2]}\n\n'
    assert sse({"text": "héllo 世界\n"}) == 'data: {"text":"héllo 世界\\n"}\n\n'.encode()
    frame = sse(chat_chunk("id", "m", 1, 0, {"content": "a\r\nb"}))
    assert frame.count(b"\n") == 2 and b"\r" not in frame  # newlines inside JSON are escaped
    with pytest.raises(ValueError):
        to_json({"logprob": math.nan})


def test_usage():
    assert usage(3, 4, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_shapes():
    choice = completion_choice(0, "hi", "length")
    assert choice == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}
    resp = completion_response("cmpl-1", "m", 123, [choice], usage(1, 2))
    assert resp == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m",
                    "choices": [choice], "usage": usage(1, 2)}
    chunk = completion_chunk("cmpl-1", "m", 123, 1, "x")
    assert chunk["object"] == "text_completion" and set(chunk) == {"id", "object", "created",
                                                                   "model", "choices"}
    assert chunk["choices"] == [{"index": 1, "text": "x", "logprobs": None, "finish_reason": None}]


def test_chat_shapes():
    choice = chat_choice(0, "hello", "stop")
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "hello"},
                      "logprobs": None, "finish_reason": "stop"}
    resp = chat_response("chatcmpl-1", "m", 123, [choice], usage(1, 2))
    assert resp["object"] == "chat.completion"
    assert set(resp) == {"id", "object", "created", "model", "choices", "usage"}
    first = chat_chunk("chatcmpl-1", "m", 123, 0, {"role": "assistant", "content": ""})
    assert first == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123,
                     "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                     "content": ""}, "logprobs": None, "finish_reason": None}]}
    last = chat_chunk("chatcmpl-1", "m", 123, 0, {}, finish_reason="length")
    assert last["choices"][0]["finish_reason"] == "length"


def test_usage_chunk():
    chunk = usage_chunk("chatcmpl-1", "m", 123, "chat.completion.chunk", usage(5, 6))
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123,
                     "model": "m", "choices": [], "usage": usage(5, 6)}


def test_chat_logprobs_shape():
    lp = chat_logprobs([("é", -0.5, [("é", -0.5), ("e", -1.5)]), ("!", -math.inf, [])])
    assert lp == {"content": [
        {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9], "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
            {"token": "e", "logprob": -1.5, "bytes": [0x65]}]},
        {"token": "!", "logprob": -9999.0, "bytes": [0x21], "top_logprobs": []},
    ]}
    to_json(lp)  # -inf was clamped, so this is valid JSON


def test_completion_logprobs_shape():
    entries = [("He", -0.1, [("He", -0.1), ("A", -2.0)]), ("llo", -0.2, [("lo", -1.0)]),
               ("!", -0.3, [])]
    lp = completion_logprobs(entries, text_offset_start=5)
    assert lp == {
        "tokens": ["He", "llo", "!"],
        "token_logprobs": [-0.1, -0.2, -0.3],
        # The sampled token is always included, as in OpenAI's legacy format.
        "top_logprobs": [{"He": -0.1, "A": -2.0}, {"lo": -1.0, "llo": -0.2}, {"!": -0.3}],
        "text_offset": [5, 7, 10],
    }


def test_shapes_validate_with_openai_sdk():
    """The openai SDK's own models accept what we build (the SDK is what most clients use)."""
    openai_types = pytest.importorskip("openai.types")
    chat_types = pytest.importorskip("openai.types.chat")
    lp = [("a", -0.1, [("a", -0.1), ("b", -2.0)])]
    openai_types.Completion.model_validate(json.loads(to_json(completion_response(
        "cmpl-1", "m", 1, [completion_choice(0, "a", "stop", completion_logprobs(lp, 0))],
        usage(1, 1)))))
    # Only the final completion chunk: the SDK types finish_reason as non-null, but streams send
    # null mid-stream (as OpenAI does) and the SDK builds stream chunks without validating.
    openai_types.Completion.model_validate(completion_chunk("cmpl-1", "m", 1, 0, "a", "stop"))
    openai_types.Completion.model_validate(
        usage_chunk("cmpl-1", "m", 1, "text_completion", usage(1, 1)))
    chat_types.ChatCompletion.model_validate(chat_response(
        "chatcmpl-1", "m", 1, [chat_choice(0, "a", "length", chat_logprobs(lp))], usage(1, 1)))
    chat_types.ChatCompletionChunk.model_validate(chat_chunk(
        "chatcmpl-1", "m", 1, 0, {"role": "assistant", "content": ""}))
    chat_types.ChatCompletionChunk.model_validate(chat_chunk(
        "chatcmpl-1", "m", 1, 0, {"content": "a"}, "stop", chat_logprobs(lp)))
    chat_types.ChatCompletionChunk.model_validate(usage_chunk(
        "chatcmpl-1", "m", 1, "chat.completion.chunk", usage(1, 1)))


# A value for each refused field that asks for something nodeserve does not do.
_REFUSED_VALUES = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy"},
                   "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
                   "reasoning_effort": "low", "verbosity": "low", "moderation": {"x": 1},
                   "modalities": ["audio"], "store": True, "best_of": 2, "suffix": "x"}


@pytest.mark.parametrize("typed_dict, table, parse, base", [
    ("openai.types.chat.completion_create_params", "CHAT_FIELDS", parse_chat_request, {"messages": USER}),
    ("openai.types.completion_create_params", "COMPLETION_FIELDS", parse_completion_request, {"prompt": "hi"}),
])
def test_every_openai_sdk_field_is_implemented_ignored_or_refused(typed_dict, table, parse, base):
    """Each key of the installed openai SDK's create params is in protocol's table; each refused one is a 400
    naming it. A new SDK field fails here until someone decides what nodeserve does with it."""
    import importlib
    import typing

    from nodeserve.server import protocol
    module = importlib.import_module(typed_dict)
    keys = set(typing.get_type_hints(module.CompletionCreateParamsBase))
    fields = getattr(protocol, table)
    assert keys - set(fields) == set(), f"SDK fields {table} does not cover"
    for key in sorted(keys):
        if fields[key] == "refused":
            _expect_400(parse, {**base, key: _REFUSED_VALUES[key]}, key)
        elif fields[key] == "ignored":
            parse({**base, key: "anything"}, LIMITS)
