"""Fuzzing the real server (the session `server` fixture) over HTTP with hypothesis.

Mutation-based: start from a small valid body (max_tokens <= 3, n <= 2, so valid cases stay fast) and break
one field at a time with wrong types, out-of-range and huge numbers, NaN and Infinity, bad roles and content
parts, bad token ids and prompts past the context; plus malformed bytes, oversized and compressed bodies,
wrong methods and unknown paths.

Every invalid input must get a 4xx whose body is exactly OpenAI's error shape, every valid one a 200, and
nothing a 5xx; afterwards the server is healthy, still answers, and has every KV page back.

Examples are derandomized so CI is reproducible; NODESERVE_FUZZ_SCALE=10 runs 10x as many, randomly.
Each test prints and records (record_property "fuzz_inputs") how many requests it sent.
"""

from __future__ import annotations

import gzip
import http.client
import json
import math
import os
import time
import zlib
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeserve.config import ServerSection

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_BODY = ServerSection().max_body_bytes
MAX_TOKENS_LIMIT = ServerSection().max_tokens_limit
MAX_N, MAX_STOP, MAX_LOGPROBS, MAX_PROMPTS = 16, 16, 20, 64
CONTEXT = 8192                  # SmolLM2's max_model_len (checked against /v1/models below)
OUT_OF_VOCAB = 262_144          # above any vocabulary the fixture could load
ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GET_ROUTES = ("/health", "/v1/models", "/debug/kv", "/metrics", "/", "/console/console.js", "/console/console.css")
POST_ROUTES = (CHAT, COMPLETIONS)

_SCALE = float(os.environ.get("NODESERVE_FUZZ_SCALE", "1"))
TRIED: dict[str, int] = {}  # test name -> requests sent


def fuzz_settings(max_examples: int):
    return settings(max_examples=max(1, int(max_examples * _SCALE)), deadline=None, database=None,
                    derandomize=_SCALE == 1, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


# ---- HTTP -----------------------------------------------------------------------------------------------

class Client:
    """One connection per request (the server may close it after an error); counts what it sends."""

    def __init__(self, server):
        u = urlsplit(server.url)
        self.host, self.port = u.hostname, u.port
        self.sent = 0

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 120, chunked: bool = False) -> tuple[int, dict, bytes]:
        self.sent += 1
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, encode_chunked=chunked,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body, **kw) -> tuple[int, dict, bytes]:
        raw = body if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
        return self.request("POST", path, raw, **kw)


def assert_openai_error(status: int, headers: dict, data: bytes, expected: int | None = None) -> dict:
    """A 4xx whose body is exactly {"error": {"message", "type", "param", "code"}}."""
    where = f"{status} {data[:300]!r}"
    assert 400 <= status < 500, where
    if expected is not None:
        assert status == expected, where
    assert headers.get("content-type", "").startswith("application/json"), where
    body = json.loads(data)
    assert set(body) == {"error"}, where
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"], where
    assert isinstance(err["type"], str) and err["type"], where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert type(err["code"]) is int and err["code"] == status, where
    return err


def _root(param: str) -> str:
    """messages[0].content -> messages; stream_options.include_usage -> stream_options."""
    return param.split("[")[0].split(".")[0]


def assert_valid_response(path: str, body: dict, status: int, headers: dict, data: bytes) -> None:
    assert status == 200, f"{status} {data[:400]!r} for {json.dumps(body)[:400]}"
    prompts = body.get("prompt")
    num_prompts = len(prompts) if path == COMPLETIONS and isinstance(prompts, list) and \
        isinstance(prompts[0], (str, list)) else 1
    num_choices = num_prompts * int(body.get("n") or 1)
    if body.get("stream"):
        assert headers["content-type"].startswith("text/event-stream")
        frames = data.split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""], data[-300:]
        events = [json.loads(f[6:]) for f in frames[:-2]]
        assert all(f.startswith(b"data: ") for f in frames[:-1]) and b"\r" not in data
        assert not any("error" in e for e in events), data[-400:]
        finished = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert sorted(c["index"] for c in finished) == list(range(num_choices))
        assert ("usage" in events[-1]) == bool((body.get("stream_options") or {}).get("include_usage"))
    else:
        payload = json.loads(data)
        assert payload["object"] == ("chat.completion" if path == CHAT else "text_completion")
        assert [c["index"] for c in payload["choices"]] == list(range(num_choices))
        assert all(c["finish_reason"] in ("stop", "length") for c in payload["choices"])
        max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
        assert payload["usage"]["completion_tokens"] <= max_tokens * num_choices


def finish(request, record_property, client: Client, minimum: int) -> None:
    name = request.node.name
    TRIED[name] = client.sent
    record_property("fuzz_inputs", client.sent)
    print(f"\nfuzz[{name}]: tried {client.sent} inputs")
    assert client.sent >= minimum, f"only {client.sent} inputs tried, expected at least {minimum}"


@pytest.fixture(scope="module")
def model_name(server) -> str:
    status, _, data = Client(server).request("GET", "/v1/models")
    assert status == 200
    model = json.loads(data)["data"][0]
    assert model["max_model_len"] == CONTEXT
    return model["id"]


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if TRIED:
        print(f"\nfuzz: tried {sum(TRIED.values())} inputs in {len(TRIED)} tests: {TRIED}")


# ---- values ---------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


def _is_int(v) -> bool:
    return type(v) is int or (type(v) is float and math.isfinite(v) and v.is_integer())


def not_a(kind: str):
    """Any non-null JSON value that is not of `kind` (as protocol.py reads it)."""
    accept = {"int": _is_int, "number": lambda v: type(v) in (int, float), "bool": lambda v: type(v) is bool,
              "str": lambda v: type(v) is str, "list": lambda v: type(v) is list,
              "object": lambda v: type(v) is dict}[kind]
    return JSON.filter(lambda v: v is not None and not accept(v))


def bad_int(lo: int, hi: int):
    return st.one_of(
        st.integers(max_value=lo - 1), st.integers(min_value=hi + 1),
        st.sampled_from([lo - 1, hi + 1, 10**30, -10**30, 10**4000, float(hi) * 2 + 2, 1e300, -1e300]),
        st.floats().filter(lambda f: not (math.isfinite(f) and f.is_integer() and lo <= f <= hi)),  # 1.5, NaN, inf
        not_a("int"))


def bad_float(lo: float, hi: float, lo_open: bool = False):
    return st.one_of(
        st.floats(max_value=lo).filter(lambda f: f < lo or (lo_open and f == lo)),  # -0.0 is not below 0
        st.floats(min_value=hi, exclude_min=True),
        st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -10**400, int(hi) + 1, math.ceil(lo) - 1]),
        not_a("number"))


bad_bool = not_a("bool")
token_id = st.integers(0, 40_000)
text = st.text(min_size=1, max_size=24)


def _insert(items_strategy, bad_strategy):
    """A list of good items with one bad item at a random position."""
    return st.tuples(items_strategy, bad_strategy, st.integers(0, 10)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])


bad_token = st.one_of(st.integers(max_value=-1), st.integers(min_value=INT32_MAX + 1), st.floats(),
                      st.booleans(), st.none(), st.text(max_size=4), st.dictionaries(st.text(max_size=3), st.none()))
bad_stop = st.one_of(
    st.just(""), not_a("str").filter(lambda v: type(v) is not list),
    _insert(st.lists(text, max_size=4), st.just("") | not_a("str")),
    st.integers(MAX_STOP + 1, 3 * MAX_STOP).map(lambda k: ["x"] * k))
bad_stop_ids = st.one_of(not_a("list"), _insert(st.lists(token_id, max_size=3), bad_token.filter(
    lambda v: not _is_int(v) or not 0 <= v <= INT32_MAX)))


def common_bad() -> dict:
    """Patch strategies that each break one shared field; the key is the param the error must name."""
    def one(name, values):
        return values.map(lambda v: {name: v})
    return {
        "model": one("model", not_a("str")),
        "n": one("n", bad_int(1, MAX_N)),
        "temperature": one("temperature", bad_float(0, 100)),
        "top_p": one("top_p", bad_float(0, 1, lo_open=True)),
        "top_k": one("top_k", bad_int(-1, INT32_MAX)),
        "min_p": one("min_p", bad_float(0, 1)),
        "seed": one("seed", bad_int(INT64_MIN, INT64_MAX)),
        "presence_penalty": one("presence_penalty", bad_float(-2, 2)),
        "frequency_penalty": one("frequency_penalty", bad_float(-2, 2)),
        "repetition_penalty": one("repetition_penalty", bad_float(0, 10, lo_open=True)),
        "stop": one("stop", bad_stop),
        "stop_token_ids": one("stop_token_ids", bad_stop_ids),
        "ignore_eos": one("ignore_eos", bad_bool),
        "stream": one("stream", bad_bool),
        "stream_options": st.one_of(
            JSON.filter(lambda v: v is not None).map(lambda v: {"stream_options": v}),  # without stream: true
            not_a("object").map(lambda v: {"stream": True, "stream_options": v}),
            bad_bool.map(lambda v: {"stream": True, "stream_options": {"include_usage": v}})),
        "max_tokens": one("max_tokens", bad_int(1, MAX_TOKENS_LIMIT)),
    }


bad_part = st.one_of(
    not_a("object"),
    st.fixed_dictionaries({"type": JSON.filter(lambda v: v != "text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("text"), "text": JSON.filter(lambda v: type(v) is not str)}),
    st.just({"type": "text"}), st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}))
bad_message = st.one_of(
    not_a("object"),
    st.fixed_dictionaries({"role": JSON.filter(lambda v: v not in ROLES), "content": text}),
    st.just({"content": "hi"}),
    st.sampled_from([r for r in ROLES if r != "assistant"]).map(lambda r: {"role": r}),
    st.sampled_from([r for r in ROLES if r != "assistant"]).map(lambda r: {"role": r, "content": None}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                           "content": JSON.filter(lambda v: v is not None and type(v) not in (str, list))}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                           "content": _insert(st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                              "text": text}), max_size=2), bad_part)}))
good_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": text})
bad_messages = st.one_of(st.just([]), not_a("list"), _insert(st.lists(good_message, max_size=3), bad_message),
                         st.integers(9000, 12000).map(lambda k: [{"role": "user", "content": "hi " * k}]))

bad_prompt_item = st.one_of(st.just(""), st.just([]), st.none(), st.booleans(), st.floats(), st.integers(),
                            st.dictionaries(st.text(max_size=3), st.none(), max_size=2),
                            _insert(st.lists(token_id, max_size=3), bad_token))
bad_prompt = st.one_of(
    st.just(""), st.just([]), not_a("list").filter(lambda v: type(v) is not str),
    # one prompt as token ids (a string first would make it a batch, where "ab" is fine)
    _insert(st.lists(token_id, max_size=5), bad_token.filter(lambda v: type(v) is not str)),
    # a batch (an int first would make it token ids, where [5] alone is fine)
    _insert(st.lists(text | st.lists(token_id, min_size=1, max_size=4), min_size=1, max_size=3), bad_prompt_item),
    st.integers(MAX_PROMPTS + 1, 2 * MAX_PROMPTS).map(lambda k: ["a"] * k),
    # rejected by the engine, after earlier prompts of a batch were admitted (they must be aborted)
    _insert(st.lists(token_id, min_size=1, max_size=5), st.integers(OUT_OF_VOCAB, INT32_MAX)),
    st.tuples(st.lists(token_id, min_size=1, max_size=4), st.integers(OUT_OF_VOCAB, INT32_MAX)).map(
        lambda t: [t[0], t[0] + [t[1]]]),
    st.integers(CONTEXT, 20_000).map(lambda k: [5] * k),                      # past the context
    st.integers(CONTEXT, 12_000).map(lambda k: ["Hello", [5] * k]),
    st.integers(9000, 12000).map(lambda k: "hi " * k))


def chat_bad() -> dict:
    return {**common_bad(),
            "messages": bad_messages.map(lambda v: {"messages": v}),
            "max_completion_tokens": bad_int(1, MAX_TOKENS_LIMIT).map(lambda v: {"max_completion_tokens": v}),
            "logprobs": bad_bool.map(lambda v: {"logprobs": v}),
            "top_logprobs": st.one_of(
                st.integers(0, MAX_LOGPROBS).map(lambda v: {"top_logprobs": v}),  # without logprobs: true
                bad_int(0, MAX_LOGPROBS).map(lambda v: {"logprobs": True, "top_logprobs": v}))}


def completion_bad() -> dict:
    return {**common_bad(),
            "prompt": bad_prompt.map(lambda v: {"prompt": v}),
            "logprobs": bad_int(0, MAX_LOGPROBS).map(lambda v: {"logprobs": v}),
            "echo": bad_bool.map(lambda v: {"echo": v})}


def _base(path: str, model: str) -> dict:
    first = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    return {"model": model, **first, "max_tokens": 1, "temperature": 0}


def _labelled(patches: dict):
    return st.sampled_from(sorted(patches)).flatmap(lambda name: patches[name].map(lambda p: (name, p)))


# ---- invalid inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", POST_ROUTES)
def test_one_broken_field_gets_an_openai_400(server, model_name, path, request, record_property):
    client = Client(server)
    patches = chat_bad() if path == CHAT else completion_bad()
    # A model id that is not the served model: 404 naming "model".
    patches["model_unknown"] = text.filter(lambda m: m != model_name).map(lambda m: {"model": m})
    base = _base(path, model_name)

    @fuzz_settings(250)
    @given(_labelled(patches))
    def run(case):
        name, patch = case
        status, headers, data = client.post(path, {**base, **patch})
        if name == "model_unknown":
            err = assert_openai_error(status, headers, data, 404)
            assert err["param"] == "model"
            return
        err = assert_openai_error(status, headers, data, 400)
        message = err["message"]
        if err["param"] is None:  # only whole-body and engine-level errors name no field
            assert message.startswith("Request body is not valid JSON") or \
                (name == "prompt" and "vocabulary" in message), err
        else:
            assert _root(err["param"]) == name, err
        if "maximum context length" in message:
            assert err["param"] == ("messages" if path == CHAT else "prompt"), err

    run()
    finish(request, record_property, client, minimum=200)


def _surrogate_bodies():
    templates = [b'{"prompt":"%s","max_tokens":1}', b'{"prompt":["ok","a%sb"],"max_tokens":1}',
                 b'{"model":"%s","prompt":"hi","max_tokens":1}', b'{"prompt":"hi","stop":["%s"],"max_tokens":1}',
                 b'{"prompt":"hi","max_tokens":1,"x%s":1}', b'{"prompt":"hi","max_tokens":1,"user":"%s"}',
                 b'{"messages":[{"role":"user","content":"%s"}],"max_tokens":1}',
                 b'{"messages":[{"role":"user","content":[{"type":"text","text":"%s"}]}],"max_tokens":1}',
                 b'{"messages":[{"role":"user","content":"hi","name":"%s"}],"max_tokens":1}']
    # one lone surrogate: a high one not followed by a low one, or a low one alone
    lone = st.integers(0xD800, 0xDFFF).map(lambda c: b"\\u%04x" % c) | \
        st.integers(0xD800, 0xDBFF).map(lambda c: b"\\u%04X x" % c)
    return st.tuples(st.sampled_from(templates), lone).map(lambda t: t[0] % t[1])


_VALID_BYTES = [json.dumps(b, separators=(",", ":")).encode() for b in (
    {"prompt": "hi", "max_tokens": 1}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    {"prompt": [1, 2, 3], "max_tokens": 1, "stop": ["a", "b"], "temperature": 0.5, "stream": True})]

_ascii = st.text(st.characters(codec="ascii", categories=["L", "N", "Zs"]), max_size=12).map(str.encode)
malformed = st.one_of(
    st.binary(max_size=200),
    st.tuples(_ascii, st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf",
                                       b"\x80"]), _ascii).map(                   # invalid UTF-8 (or CESU-8)
        lambda t: b'{"prompt":"' + t[0] + t[1] + t[2] + b'","max_tokens":1}'),
    st.sampled_from(_VALID_BYTES).flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda k: b[:k])),  # truncated
    JSON.filter(lambda v: type(v) is not dict).map(lambda v: json.dumps(v).encode()),  # not an object
    st.sampled_from([
        b"", b" ", b"null", b"NaN", b"Infinity", b"-Infinity", b"[]", b'"prompt"', b"\xef\xbb\xbf[1]",
        b'{"prompt":"hi","temperature":NaN}', b'{"prompt":"hi","max_tokens":Infinity}',
        b'{"prompt":"hi","seed":-Infinity}', b'{"prompt":"hi","top_p":nan}', b'{"prompt":"hi","n":1e999}',
        b'{"prompt":"hi","n":-0}', b'{"prompt":"hi","prompt":""}', b"{'prompt':'hi'}", b'{"prompt":"hi",}',
        b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}",                   # past Python's int digit limit
        b'{"prompt":"hi","seed":-' + b"9" * 4000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,                                        # RecursionError in json
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"prompt":' + b"[" * 900 + b"1" + b"]" * 900 + b"}",
        b'{"messages":[{"role":"user","content":"hi"}]' + b"\x00" + b"}"]),
    _surrogate_bodies())


def test_malformed_bodies_get_an_openai_400(server, request, record_property):
    client = Client(server)

    @fuzz_settings(300)
    @given(st.sampled_from(POST_ROUTES), malformed)
    def run(path, raw):
        status, headers, data = client.post(path, raw)
        assert_openai_error(status, headers, data, 400)

    run()
    finish(request, record_property, client, minimum=250)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_prompts_over_the_context_and_token_ids_out_of_range(server, model_name, path, request, record_property):
    client = Client(server)

    @fuzz_settings(20)
    @given(st.integers(CONTEXT, 20_000), st.sampled_from(["ids", "text", "batch", "bad_id"]),
           st.integers(OUT_OF_VOCAB, INT32_MAX))
    def run(length, kind, bad_id):
        if path == CHAT:
            kind = "text"
            body = {"messages": [{"role": "user", "content": "hi " * length}], "max_tokens": 1}
        elif kind == "ids":
            body = {"prompt": [7] * length, "max_tokens": 1}
        elif kind == "text":
            body = {"prompt": "hi " * length, "max_tokens": 1}
        elif kind == "batch":  # the first prompt is admitted, then must be aborted
            body = {"prompt": [[7, 8], [7] * length], "max_tokens": 1, "n": 2}
        else:
            body = {"prompt": [[7, 8], [7, bad_id]], "max_tokens": 1}
        status, headers, data = client.post(path, body)
        err = assert_openai_error(status, headers, data, 400)
        if kind == "bad_id":
            assert "vocabulary" in err["message"], err
        else:
            assert f"maximum context length is {CONTEXT} tokens" in err["message"], err
            assert err["param"] == ("messages" if path == CHAT else "prompt"), err
        if kind == "ids":
            assert f"has {length} input tokens" in err["message"], err

    run()
    finish(request, record_property, client, minimum=15)


def test_oversized_and_encoded_bodies(server, model_name, request, record_property):
    client = Client(server)
    valid = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()

    def padded(size: int) -> bytes:  # a valid body of exactly `size` bytes (JSON allows any whitespace)
        return valid[:-1] + b" " * (size - len(valid)) + b"}"

    @fuzz_settings(3)
    @given(st.integers(1, 2 * 1024 * 1024))
    def run(extra):
        size, body = MAX_BODY + extra, padded(MAX_BODY + extra)
        for status, headers, data in (
                client.post(COMPLETIONS, b"x" * size),
                client.post(CHAT, b'{"messages":[{"role":"user","content":"' + b"a" * size + b'"}]}'),
                # no Content-Length: the limit must hold while the body streams in
                client.request("POST", COMPLETIONS, (body[i:i + 65536] for i in range(0, size, 65536)),
                               chunked=True),
                # a small gzip body that inflates past the limit
                client.post(COMPLETIONS, gzip.compress(body), headers={"Content-Encoding": "gzip"})):
            assert_openai_error(status, headers, data, 413)

    run()
    # At the limit exactly, a (whitespace-padded) valid body is accepted.
    status, headers, data = client.post(COMPLETIONS, padded(MAX_BODY))
    assert status == 200, data[:300]
    status, headers, data = client.post(COMPLETIONS, padded(MAX_BODY + 1))
    assert_openai_error(status, headers, data, 413)
    # Content-Encoding the server decodes, and bodies that are not what they claim.
    for raw, encoding, expected in ((gzip.compress(valid), "gzip", 200), (zlib.compress(valid), "deflate", 200),
                                    (b"not gzip at all", "gzip", 400), (valid, "deflate", 400),
                                    (gzip.compress(b"{not json"), "gzip", 400)):
        status, headers, data = client.post(COMPLETIONS, raw, headers={"Content-Encoding": encoding})
        if expected == 200:
            assert status == 200, data[:300]
        else:
            assert_openai_error(status, headers, data, expected)
    finish(request, record_property, client, minimum=12)


_PATH_CHARS = st.characters(codec="ascii", categories=["L", "N"], include_characters="-._~/%!$&'()*+,;=:@")


def test_wrong_methods_and_unknown_paths_get_openai_errors(server, request, record_property):
    client = Client(server)
    known = GET_ROUTES + POST_ROUTES
    unknown = st.text(_PATH_CHARS, max_size=30).map(lambda p: "/" + p).filter(
        lambda p: p.split("?")[0] not in known)

    @fuzz_settings(150)
    @given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
           st.sampled_from(known) | unknown | st.sampled_from(["/v1", "/v1/", "/v1/models/", "/V1/models",
                                                               "/v1/chat", "/v1//completions", "/health/",
                                                               "/v1/embeddings", "/v1/responses", "/docs"]),
           st.binary(max_size=30))
    def run(method, path, body):
        status, headers, data = client.request(method, path, body if method != "GET" else None)
        allowed = {p: "GET" for p in GET_ROUTES} | {p: "POST" for p in POST_ROUTES}
        if path in allowed and method == allowed[path]:
            assert status in (200, 400), (method, path, status, data[:200])  # POST with junk: 400
            if status == 400:
                assert_openai_error(status, headers, data, 400)
        elif path in allowed:
            assert_openai_error(status, headers, data, 405)
        else:
            assert_openai_error(status, headers, data, 404)

    run()
    finish(request, record_property, client, minimum=120)


# ---- valid inputs ------------------------------------------------------------------------------------------

_KNOWN_FIELDS = {"model", "messages", "prompt", "n", "temperature", "top_p", "top_k", "min_p", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "max_tokens", "max_completion_tokens", "logprobs",
                 "top_logprobs", "echo", "user"}


def common_good(model: str) -> dict:
    def one(name, values):
        return values.map(lambda v: {name: v})
    return {
        "unknown": st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in _KNOWN_FIELDS),
                                   JSON, min_size=1, max_size=3),
        "nulls": st.lists(st.sampled_from(["model", "n", "temperature", "top_p", "top_k", "min_p", "seed",
                                           "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
                                           "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
                                           "user"]), min_size=1, max_size=4).map(lambda ks: dict.fromkeys(ks)),
        "model": one("model", st.sampled_from([model, None])),
        "n": one("n", st.sampled_from([1, 2, 2.0])),
        "max_tokens": one("max_tokens", st.integers(1, 3) | st.just(3.0)),
        "temperature": one("temperature", st.floats(0, 100) | st.sampled_from([0, 100, 5e-324])),
        "top_p": one("top_p", st.floats(0, 1, exclude_min=True) | st.sampled_from([1, 5e-324])),
        "top_k": one("top_k", st.integers(-1, INT32_MAX) | st.sampled_from([-1, 0, 1, INT32_MAX])),
        "min_p": one("min_p", st.floats(0, 1)),
        "seed": one("seed", st.integers(INT64_MIN, INT64_MAX) | st.sampled_from([INT64_MIN, INT64_MAX])),
        "presence_penalty": one("presence_penalty", st.floats(-2, 2)),
        "frequency_penalty": one("frequency_penalty", st.floats(-2, 2)),
        "repetition_penalty": one("repetition_penalty", st.floats(0, 10, exclude_min=True)),
        "stop": one("stop", text | st.lists(text, max_size=MAX_STOP)),
        "stop_token_ids": one("stop_token_ids", st.lists(st.integers(0, INT32_MAX), max_size=4)),
        "ignore_eos": one("ignore_eos", st.booleans()),
        "stream": st.one_of(st.booleans().map(lambda s: {"stream": s}),
                            st.sampled_from([True, False, None]).map(
                                lambda u: {"stream": True, "stream_options": {"include_usage": u}})),
        "user": one("user", st.text(max_size=10)),
    }


good_content = st.one_of(st.text(max_size=24), st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                               "text": st.text(max_size=10)}),
                                                        max_size=2))


def chat_good(model: str) -> dict:
    message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": good_content}),
                        st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=12),
                                               "name": st.text(max_size=6)}))
    return {**common_good(model),
            "messages": st.lists(message, min_size=1, max_size=3).map(lambda m: {"messages": m}),
            "max_completion_tokens": st.integers(1, 3).map(lambda v: {"max_completion_tokens": v}),
            "logprobs": st.one_of(st.booleans().map(lambda v: {"logprobs": v}),
                                  st.integers(0, MAX_LOGPROBS).map(lambda k: {"logprobs": True, "top_logprobs": k}))}


def completion_good(model: str) -> dict:
    one_prompt = st.text(min_size=1, max_size=24) | st.lists(token_id, min_size=1, max_size=12)
    return {**common_good(model),
            "prompt": (one_prompt | st.lists(one_prompt, min_size=1, max_size=2)).map(lambda p: {"prompt": p}),
            "logprobs": st.integers(0, MAX_LOGPROBS).map(lambda v: {"logprobs": v}),
            "echo": st.booleans().map(lambda v: {"echo": v})}


@pytest.mark.parametrize("path", POST_ROUTES)
def test_valid_variations_get_200(server, model_name, path, request, record_property):
    client = Client(server)
    patches = chat_good(model_name) if path == CHAT else completion_good(model_name)
    base = _base(path, model_name)

    @fuzz_settings(12)
    @given(st.lists(st.sampled_from(sorted(patches)), min_size=1, max_size=4, unique=True).flatmap(
        lambda names: st.tuples(*(patches[n] for n in names))))
    def run(chosen):
        body = dict(base)
        for patch in chosen:
            body.update(patch)
        if body.get("stream_options") is not None and not body.get("stream"):
            body["stream"] = True  # a later patch turned stream off: keep the body valid
        status, headers, data = client.post(path, body)
        assert_valid_response(path, body, status, headers, data)

    run()
    finish(request, record_property, client, minimum=10)


_EXTREMES = [  # valid values at the edges of their ranges, where the sampler's float32 arithmetic is tested
    {"temperature": 5e-324}, {"temperature": 1e-40, "logprobs": 2}, {"temperature": 100, "top_k": INT32_MAX},
    {"top_p": 5e-324, "temperature": 1}, {"min_p": 1.0, "temperature": 1},
    {"repetition_penalty": 5e-324, "logprobs": 0}, {"repetition_penalty": 5e-324, "temperature": 1, "logprobs": 3},
    {"repetition_penalty": 10, "presence_penalty": 2, "frequency_penalty": -2, "temperature": 1, "logprobs": 20},
    {"seed": INT64_MAX, "n": 2, "temperature": 1}, {"seed": INT64_MIN, "n": 2, "temperature": 1},
    {"stop_token_ids": [0, INT32_MAX], "stop": ["\n"] * MAX_STOP},
    {"repetition_penalty": 5e-324, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_extreme_valid_values_get_200(server, model_name, path, request, record_property):
    client = Client(server)
    for patch in _EXTREMES:
        body = {**_base(path, model_name), **patch}  # max_tokens 1: the first token already shows a blow-up
        if path == CHAT and "logprobs" in patch:
            body.update(logprobs=True, top_logprobs=patch["logprobs"])
        status, headers, data = client.post(path, body)
        assert_valid_response(path, body, status, headers, data)
    finish(request, record_property, client, minimum=len(_EXTREMES))


# ---- afterwards --------------------------------------------------------------------------------------------

def test_server_is_healthy_and_whole_after_fuzzing(server, model_name, request, record_property):
    client = Client(server)
    status, _, data = client.request("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ready", data
    body = {"model": model_name, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    status, headers, data = client.post(CHAT, body)
    assert_valid_response(CHAT, body, status, headers, data)
    assert json.loads(data)["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 20
    while True:
        status, _, data = client.request("GET", "/debug/kv")
        pools = json.loads(data)["pools"]
        if status == 200 and pools and all(p["num_free"] == p["num_pages"] for p in pools):
            break
        assert time.monotonic() < deadline, f"KV pages leaked: {pools}"
        time.sleep(0.1)
    finish(request, record_property, client, minimum=3)
