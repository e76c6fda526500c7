"""nodeserve.server.app in process, over a stand-in engine that plays scripted token events: the server's edges
(auth, content type, Host/Origin, prompt size and tokenization off the loop, /debug/steps paging, stream set-up
and timeout order, streamed logprob offsets, rejection counts), fast and without a model."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeserve.config import ServerSection, config_from_dict
from nodeserve.runtime.engine import PromptTooLong, RequestStream
from nodeserve.runtime.records import RecordLog
from nodeserve.runtime.transfer import CopyRecord
from nodeserve.runtime.worker import StepRecord
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.sampling_params import resolve_max_tokens
from nodeserve.server import app as app_module
from nodeserve.server.app import ServerState, create_app


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from nodeserve.model.gguf_loader import open_reader, read_metadata
    from nodeserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(open_reader(gguf_path)))


class FakeEngine:
    """What the routes use of an Engine. Each admitted request plays `script` (token ids, then "length"); with
    script None it never produces anything."""

    def __init__(self, tokenizer, script: list[int] | None = None, max_model_len: int = 8192):
        self.tokenizer, self.script, self.max_model_len = tokenizer, script, max_model_len
        self.max_tokens_limit = ServerSection().max_tokens_limit
        self.loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=49152))
        self.router = object()
        self.workers, self.transfers = [], []
        self.num_pending = 0
        self.warnings: list[str] = []
        self.added: list[RequestStream] = []
        self.aborted: list[RequestStream] = []
        self.reject: Exception | None = None
        self.profiler = None

    def pool_stats(self) -> list:
        return []

    def dead_threads(self) -> list[str]:
        return []

    def role_changes(self, since: float = 0.0) -> list[list]:
        return [c for c in getattr(self, "changes", []) if c[0] >= since]

    def add_request(self, prompt_ids, params, default_max_tokens=None) -> RequestStream:
        if self.reject is not None:
            raise self.reject
        # as Engine.add_request does, with a pool that holds the whole context
        params = replace(params, max_tokens=resolve_max_tokens(
            params.max_tokens, route_default=default_max_tokens, server_limit=self.max_tokens_limit,
            context_len=self.max_model_len, max_kv_tokens=self.max_model_len, num_prompt_tokens=len(prompt_ids)))
        stream = RequestStream(Request(f"r{len(self.added)}", list(prompt_ids), params))
        self.added.append(stream)
        if self.script is not None:
            asyncio.get_running_loop().call_soon(self._play, stream)
        return stream

    def _play(self, stream: RequestStream) -> None:
        for i, token in enumerate(self.script):
            last = i == len(self.script) - 1
            stream.put(TokenEvent(token, -0.5, [], "length" if last else None))

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        self.aborted.append(stream)
        stream.done = True


def make_state(engine=None, **server) -> ServerState:
    state = ServerState(config_from_dict({"server": server}, check_devices=False))
    if engine is not None:
        state.engine, state.status = engine, "ready"
    return state


async def _client(state: ServerState) -> TestClient:
    client = TestClient(TestServer(create_app(state), host="127.0.0.1"))
    await client.start_server()
    return client


def run(state: ServerState, body):
    """Runs body(client) against the app on a test server; returns what it returns."""
    async def main():
        client = await _client(state)
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


def rejected(state: ServerState) -> dict[str, float]:
    text = generate_latest(state.metrics.registry).decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "nodeserve:request_rejected_total"}


JSON = {"Content-Type": "application/json"}
PROMPT = {"prompt": "Hello", "max_tokens": 4}


# ---- authentication -------------------------------------------------------------------------------------

def test_a_non_utf8_authorization_header_is_a_401_not_a_500():
    state = make_state(api_key="sekrit")

    async def body(client):
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        raw = await reader.read()
        writer.close()
        return raw
    raw = run(state, body)
    assert raw.startswith(b"HTTP/1.1 401"), raw[:200]
    assert b'"type":"AuthenticationError"' in raw.replace(b" ", b"")


def test_debug_routes_need_the_key_even_when_health_and_metrics_are_open():
    state = make_state(FakeEngine(None), api_key="sekrit", open_health=True, open_metrics=True)

    async def body(client):
        out = {}
        for path in ("/debug/kv", "/debug/steps", "/health", "/metrics"):
            async with client.get(path) as r:
                out[path] = r.status
        async with client.get("/debug/steps", headers={"Authorization": "Bearer sekrit"}) as r:
            out["with key"] = r.status
        return out
    assert run(state, body) == {"/debug/kv": 401, "/debug/steps": 401, "/health": 200, "/metrics": 200,
                                "with key": 200}


def test_health_shows_the_engines_warnings(tokenizer):
    engine = FakeEngine(tokenizer)
    state = make_state(engine)

    async def body(client):
        async with client.get("/health") as r:
            quiet = await r.json()
        engine.warnings.append("flashinfer does not import, so CUDA devices run the PyTorch reference attention")
        async with client.get("/health") as r:
            return quiet, r.status, await r.json()
    quiet, status, loud = run(state, body)
    assert "warnings" not in quiet
    assert status == 200 and loud["warnings"] == engine.warnings


def test_health_without_the_key_tells_only_the_status(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.warnings.append("the disk tier at /srv/kv is full")
    state = make_state(engine, api_key="sekrit", open_health=True)

    async def body(client):
        out = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer sekrit"}):
            async with client.get("/health", headers=headers) as r:
                out.append((r.status, await r.json()))
        return out
    (anon_status, anon), (wrong_status, wrong), (keyed_status, keyed) = run(state, body)
    assert anon_status == wrong_status == keyed_status == 200
    assert anon == wrong == {"status": "ready"}  # no warnings, KV figures or failure texts for strangers
    assert keyed["warnings"] == engine.warnings and "kv" in keyed


def test_the_access_log_cannot_be_forged_through_the_path():
    import logging
    from nodeserve.server.app import AccessLogger
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("test.access")
    logger.setLevel(logging.INFO)
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)

    async def main():
        server = TestServer(create_app(make_state()), host="127.0.0.1")
        await server.start_server(access_log=logger, access_log_class=AccessLogger)
        async with TestClient(server) as client:
            for path in ("/%0Afake%20200%20OK", "/%0D%0AGET%20/admin", "/\u2028x%E2%80%A8y%1B[31m", "/" + "a" * 5000):
                async with client.get(path) as r:
                    await r.read()
            await asyncio.sleep(0.1)
    asyncio.run(main())
    logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 4
    for line in lines:
        assert line.isprintable() and line.isascii() and len(line) < 400, line  # one line, whatever the path
    assert lines[0].startswith("GET /\\nfake 200 OK ") and lines[1].startswith("GET /\\r\\nGET /admin ")
    assert "\\u2028" in lines[2] and "\\x1b" in lines[2] and lines[3].split()[1].endswith("...")


# ---- content type and cross-site requests ------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_posts_must_be_json(content_type):
    state = make_state()  # loading: a request that got past the checks would be a 503

    async def body(client):
        headers = {"Content-Type": content_type} if content_type else {}
        data = b'{"prompt": "hi"}'
        async with client.post("/v1/completions", data=data, headers=headers,
                               skip_auto_headers=["Content-Type"]) as r:
            return r.status, await r.json()
    status, err = run(state, body)
    assert status == 415 and err["error"]["message"].startswith("Content-Type must be application/json")
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_json_with_a_charset_is_json():
    state = make_state()

    async def body(client):
        async with client.post("/v1/completions", data=b'{"prompt": "hi"}',
                               headers={"Content-Type": "application/json; charset=utf-8"}) as r:
            return r.status
    assert run(state, body) == 503  # past the content-type check: the model is loading


@pytest.mark.parametrize("headers, status", [
    ({"Host": "evil.example"}, 403),                       # DNS rebinding: a foreign name for 127.0.0.1
    ({"Host": "evil.example:8000"}, 403),
    ({"Host": "localhost:8000"}, 503),
    ({"Host": "127.0.0.1"}, 503),
    ({"Host": "[::1]:8000"}, 503),
    ({"Origin": "http://evil.example"}, 403),              # a page elsewhere posting to the API
    ({"Origin": "null"}, 403),
    ({"Origin": "http://localhost:3000"}, 503),
])
def test_a_loopback_server_answers_only_loopback_hosts_and_origins(headers, status):
    state = make_state()

    async def body(client):
        async with client.post("/v1/completions", json=PROMPT, headers=headers) as r:
            return r.status
    assert run(state, body) == status


def test_a_server_on_another_address_takes_any_host():
    state = make_state(host="0.0.0.0")

    async def body(client):
        async with client.post("/v1/completions", json=PROMPT, headers={"Host": "gpu-node-7:8000"}) as r:
            return r.status
    assert run(state, body) == 503


# ---- prompts: size first, tokenization off the loop --------------------------------------------------------

class SlowTokenizer:
    """The real tokenizer, but encode holds its thread for `delay` seconds (a long prompt)."""

    def __init__(self, tokenizer, delay: float):
        self.inner, self.delay, self.num_encodes = tokenizer, delay, 0
        self.encoded_chars: list[int] = []

    def encode(self, text, *args, **kwargs):
        self.num_encodes += 1
        self.encoded_chars.append(len(text))
        time.sleep(self.delay)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}),
])
def test_tokenizing_a_prompt_does_not_stall_the_event_loop(tokenizer, path, body):
    tok = SlowTokenizer(tokenizer, delay=1.5)
    state = make_state(FakeEngine(tok, script=[42, 43]))

    async def run_body(client):
        start = time.monotonic()  # client and server share this loop: a stalled loop delays everything below
        post = asyncio.create_task(client.post(path, json=body))
        await asyncio.sleep(0.2)  # the request is being tokenized now
        async with client.get("/health") as r:
            health = (r.status, time.monotonic() - start)
        resp = await post
        status = resp.status
        resp.release()
        return health, status, time.monotonic() - start
    (health_status, health_seconds), status, total = run(state, run_body)
    assert status == 200 and tok.num_encodes == 1 and total >= 1.5
    assert health_status == 200 and health_seconds < 1.0, health_seconds  # answered while tokenizing


def test_tokenization_jobs_are_bounded_before_admission_with_a_503(tokenizer, monkeypatch):
    monkeypatch.setattr(app_module, "MAX_TOKENIZE_JOBS", 3)
    tok = SlowTokenizer(tokenizer, delay=0.5)
    state = make_state(FakeEngine(tok, script=[42, 43]))

    async def run_body(client):
        async def post():
            async with client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2}) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()
        first = await asyncio.gather(*(post() for _ in range(5)))
        again = await post()  # the jobs are done: room again
        return first, again
    first, again = run(state, run_body)
    statuses = sorted(s for s, _, _ in first)
    assert statuses == [200, 200, 200, 503, 503] and again[0] == 200
    busy = [(retry, body) for s, retry, body in first if s == 503]
    assert all(retry == "1" and body["error"]["type"] == "ServiceUnavailableError" and
               "being tokenized" in body["error"]["message"] for retry, body in busy)
    assert tok.num_encodes == 4 and state.offload_jobs.num_jobs == 0
    assert rejected(state)["queue_full"] == 2


@pytest.mark.parametrize("path, field, make", [
    ("/v1/completions", "prompt", lambda text: {"prompt": text}),
    ("/v1/completions", "prompt", lambda text: {"prompt": ["short", text]}),
    ("/v1/chat/completions", "messages", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_text_too_long_for_any_tokenization_is_refused_untokenized(tokenizer, path, field, make):
    tok = SlowTokenizer(tokenizer, delay=0.0)
    engine = FakeEngine(tok, script=[42], max_model_len=64)
    state = make_state(engine)
    text = "a" * (64 * tokenizer.max_token_chars + 1)

    async def body(client):
        async with client.post(path, json=make(text)) as r:
            return r.status, await r.json()
    status, err = run(state, body)
    assert status == 400 and err["error"]["param"] == field
    assert "maximum context length is 64 tokens" in err["error"]["message"]
    assert tok.num_encodes == 0 and engine.added == []
    assert rejected(state)["too_large"] == 1 and rejected(state)["bad_request"] == 0


@pytest.mark.parametrize("path, field, make", [
    ("/v1/completions", "prompt", lambda text: {"prompt": text}),
    ("/v1/chat/completions", "messages", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_text_far_past_the_context_is_refused_from_a_prefix(tokenizer, path, field, make):
    """Within max_token_chars per token, but ~3 characters a token: only a prefix is tokenized before the 400."""
    tok = SlowTokenizer(tokenizer, delay=0.0)
    engine = FakeEngine(tok, script=[42], max_model_len=64)
    state = make_state(engine)
    text = "word " * (64 * tokenizer.max_token_chars // 6)
    assert len(text) > 64 * app_module.PROBE_CHARS_PER_TOKEN

    async def body(client):
        async with client.post(path, json=make(text)) as r:
            return r.status, await r.json()
    status, err = run(state, body)
    assert status == 400 and err["error"]["param"] == field
    assert "maximum context length is 64 tokens" in err["error"]["message"] and "more than" in err["error"]["message"]
    assert tok.encoded_chars == [64 * app_module.PROBE_CHARS_PER_TOKEN] and engine.added == []
    # a text under the probe's length is tokenized once, whole
    tok.encoded_chars.clear()
    state2 = make_state(FakeEngine(tok, script=[42], max_model_len=64))
    status, _ = run(state2, lambda client: _status(client, path, make("word " * 20)))
    assert status == 200 and len(tok.encoded_chars) == 1


@pytest.mark.parametrize("path, body, max_tokens", [
    ("/v1/completions", {"prompt": "Hello"}, 16),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 40}, 40),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}, 100),  # default_max_tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40}, 40),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                              "max_completion_tokens": 50}, 50),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 500}, None),
])
def test_each_route_hands_its_default_max_tokens_to_the_engine(tokenizer, path, body, max_tokens):
    """The routes pass the client's value and their default; the engine resolves them (resolve_max_tokens):
    None here is the context (256) minus the prompt."""
    engine = FakeEngine(tokenizer, script=[42], max_model_len=256)
    state = make_state(engine, default_max_tokens=100)
    status, _ = run(state, lambda client: _status(client, path, body))
    [stream] = engine.added
    assert status == 200
    assert stream.request.params.max_tokens == (max_tokens or 256 - stream.request.num_prompt_tokens)


async def _status(client, path, body):
    async with client.post(path, json=body) as r:
        await r.read()
        return r.status, None


def test_max_token_chars_bounds_every_token(tokenizer):
    longest = max(len(tokenizer.token_text(i)) for i in range(tokenizer.vocab_size))
    assert tokenizer.max_token_chars == longest > 1


def test_a_prompt_the_engine_refuses_is_counted_once(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.reject = PromptTooLong("This model's maximum context length is 8192 tokens. However, ...")
    state = make_state(engine)

    async def body(client):
        async with client.post("/v1/completions", json=PROMPT) as r:
            return r.status
    assert run(state, body) == 400
    counts = rejected(state)
    assert counts["too_large"] == 1 and counts["bad_request"] == 0


def test_logit_bias_ids_outside_the_vocabulary_are_a_400(tokenizer):
    state = make_state(FakeEngine(tokenizer, script=[42]))

    async def body(client):
        async with client.post("/v1/completions", json={**PROMPT, "logit_bias": {"49152": 1}}) as r:
            bad = r.status, await r.json()
        async with client.post("/v1/completions", json={**PROMPT, "logit_bias": {"49151": 1}}) as r:
            return bad, r.status
    (status, err), ok = run(state, body)
    assert status == 400 and err["error"]["param"] == "logit_bias" and "49152" in err["error"]["message"]
    assert ok == 200


# ---- streams -------------------------------------------------------------------------------------------------

STREAM = {**PROMPT, "stream": True, "n": 2}


def test_a_stream_whose_response_cannot_start_aborts_its_requests(tokenizer, monkeypatch):
    engine = FakeEngine(tokenizer, script=None)
    state = make_state(engine)

    async def refuse(self, request):
        raise ConnectionResetError("the client went away before the headers")
    monkeypatch.setattr(web.StreamResponse, "prepare", refuse)

    async def body(client):
        try:
            async with client.post("/v1/completions", json=STREAM) as r:
                await r.read()
        except Exception:  # the connection dies with the handler; what matters is the engine side
            pass
        for _ in range(50):
            if len(engine.added) == 2 and set(map(id, engine.aborted)) >= set(map(id, engine.added)):
                break
            await asyncio.sleep(0.02)
    run(state, body)
    assert len(engine.added) == 2
    assert set(map(id, engine.aborted)) >= set(map(id, engine.added))


def test_a_timed_out_stream_frees_its_requests_before_writing_the_error(tokenizer, monkeypatch):
    engine = FakeEngine(tokenizer, script=None)  # nothing ever comes: the request times out
    state = make_state(engine, request_timeout=0.3)
    monkeypatch.setattr(app_module, "ERROR_WRITE_TIMEOUT_S", 0.5, raising=False)
    original_write = web.StreamResponse.write
    aborted_at_error = []

    async def stuck_write(self, data):
        if b"TimeoutError" in data:  # a client that stopped reading: this write never completes
            aborted_at_error.append(len(engine.aborted))
            await asyncio.sleep(3600)
        return await original_write(self, data)
    monkeypatch.setattr(web.StreamResponse, "write", stuck_write)

    async def body(client):
        start = time.monotonic()
        async with client.post("/v1/completions", json=STREAM) as r:
            assert r.status == 200
            try:
                await asyncio.wait_for(r.read(), timeout=5.0)
            except (asyncio.TimeoutError, Exception):
                pass
        return time.monotonic() - start
    seconds = run(state, body)
    assert aborted_at_error == [2]  # both choices were aborted before the error event was attempted
    assert seconds < 3.0  # and the handler gave up on the stuck write instead of waiting forever


def test_streamed_completion_logprobs_offsets_continue_across_chunks(tokenizer):
    ids = tokenizer.encode(" The capital of France is Paris, a city")
    state = make_state(FakeEngine(tokenizer, script=ids))

    async def body(client):
        async with client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 16, "logprobs": 0,
                                                         "echo": True}) as r:
            full = (await r.json())["choices"][0]
        async with client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 16, "logprobs": 0,
                                                         "echo": True, "stream": True}) as r:
            raw = await r.read()
        return full, raw
    full, raw = run(state, body)
    chunks = [json.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
    streamed = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert len(chunks) > 2
    assert streamed == full["logprobs"]["text_offset"]
    assert streamed[0] == len("Hi")  # after the echoed prompt
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert all(text[o:o + len(t)] == t for o, t in zip(streamed, tokens))


# ---- /debug/steps -------------------------------------------------------------------------------------------

def _steps_engine(tokenizer, num: int) -> FakeEngine:
    engine = FakeEngine(tokenizer)
    steps, copies = RecordLog(StepRecord, 100_000), RecordLog(CopyRecord, 100_000)
    for i in range(num):
        steps.append(StepRecord(float(i), float(i) + 0.5, i, 1))
        copies.append(CopyRecord(float(i), float(i) + 0.25, 4096))
    engine.workers = [SimpleNamespace(name="cpu:0", role="prefill", records=steps)]
    engine.transfers = [SimpleNamespace(name="kv cpu:0->cpu:1", records=copies)]
    engine.changes = [[50.0, "cpu:0", "prefill", "demand"], [19998.7, "cpu:0", "adaptive", "hold"]]
    return engine


def test_debug_steps_is_paged_and_capped(tokenizer):
    state = make_state(_steps_engine(tokenizer, 20_000))

    async def body(client):
        out = {}
        for query in ("", "?since=100&limit=3", "?since=19998", "?limit=0", "?limit=5001", "?limit=x"):
            async with client.get("/debug/steps" + query) as r:
                out[query] = (r.status, await r.json())
        return out
    out = run(state, body)
    status, snap = out[""]
    cap = app_module.DEBUG_STEPS_MAX_RECORDS
    assert status == 200 and len(snap["devices"][0]["steps"]) == cap and snap["devices"][0]["truncated"]
    assert snap["devices"][0]["steps"][0] == [0.0, 0.5, 0, 1] and len(snap["transfers"][0]["copies"]) == cap
    status, snap = out["?since=100&limit=3"]
    assert [s[1] for s in snap["devices"][0]["steps"]] == [100.5, 101.5, 102.5]
    assert [c[1] for c in snap["transfers"][0]["copies"]] == [100.25, 101.25, 102.25]
    status, snap = out["?since=19998"]
    assert [s[1] for s in snap["devices"][0]["steps"]] == [19998.5, 19999.5]
    assert not snap["devices"][0]["truncated"] and not snap["transfers"][0]["truncated"]
    assert snap["role_changes"] == [[19998.7, "cpu:0", "adaptive", "hold"]]  # adaptive mode's, since `since`
    assert len(out[""][1]["role_changes"]) == 2
    for query in ("?limit=0", "?limit=5001", "?limit=x"):
        assert out[query][0] == 400 and out[query][1]["error"]["param"] == "limit"


def test_transfer_records_are_a_ring():
    from nodeserve.runtime.transfer import KVTransfer

    records = KVTransfer.__new__(KVTransfer)
    pool = SimpleNamespace(heads=(range(2),))
    KVTransfer.__init__(records, SimpleNamespace(name="a"), pool, SimpleNamespace(name="b"), pool, lambda p, e: None)
    assert isinstance(records.records, RecordLog) and records.records.maxlen == 100_000


# ---- adaptive: /debug/profile and SLO rejections ------------------------------------------------------------

def test_debug_profile(tokenizer):
    from nodeserve.core.cost_model import CostModel, StepModel

    engine = FakeEngine(tokenizer)
    refined = []
    model = CostModel({"cpu:0": StepModel(coef=[0.1, 0.01, 0.0, 0.02, 0.0])}, {}, 46080, 30)
    state = make_state(engine, api_key="k")

    async def body(client):
        out = []
        for profiler in (None, SimpleNamespace(refine=lambda: refined.append(1), as_dict=model.as_dict)):
            engine.profiler = profiler
            async with client.get("/debug/profile", headers={"Authorization": "Bearer k"}) as r:
                out.append((r.status, await r.json()))
        async with client.get("/debug/profile") as r:
            out.append((r.status, None))
        return out
    (loading, _), (status, body_), (no_key, _) = run(state, body)
    assert loading == 503 and status == 200 and no_key == 401
    assert body_["devices"]["cpu:0"]["coefficients"]["prefill_tokens"] == 0.01 and refined == [1]


def test_an_slo_rejection_is_a_503_with_retry_after(tokenizer):
    from nodeserve.core.admission import SloMiss

    engine = FakeEngine(tokenizer)
    engine.reject = SloMiss("its predicted time to first token, 9.0s, misses the 2.5s target")
    state = make_state(engine)

    async def body(client):
        async with client.post("/v1/completions", json=PROMPT) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()
    status, retry, err = run(state, body)
    assert status == 503 and retry == "1" and "misses the 2.5s target" in err["error"]["message"]
    assert rejected(state)["slo"] == 1
