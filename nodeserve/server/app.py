"""The aiohttp application: OpenAI-compatible routes, SSE streaming, health and KV debug endpoints."""

from __future__ import annotations

import asyncio
import datetime
import hmac
import importlib.resources
import ipaddress
import logging
import time
import uuid
from dataclasses import asdict, replace
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from nodeserve import __version__
from nodeserve.config import Config
from nodeserve.core.sampling_params import COMPLETION_MAX_TOKENS
from nodeserve.metrics import Metrics
from nodeserve.runtime.engine import Engine, PromptTooLong, QueueFull, TooLarge
from nodeserve.server import console
from nodeserve.server import protocol as P
from nodeserve.server.chat_prompt import render_chat
from nodeserve.server.generation import Generation, GenerationError, Piece
from nodeserve.server.offload import OffloadFull, OffloadQueue, offload_executor
from nodeserve.server.structured import Grammars, grammar_spec
from nodeserve.server.tool_parsers import ToolFormat, pick_format
from nodeserve.tokenizer import TemplateError

log = logging.getLogger(__name__)

ERROR_WRITE_TIMEOUT_S = 5.0  # how long a final error event may wait for a client that stopped reading
PROBE_CHARS_PER_TOKEN = 8  # texts longer than this per context token are measured on a prefix first
PROBE_MARGIN = 16          # tokens a prefix's cut may add or merge at its end
MAX_TOKENIZE_THREADS = 2  # more would only queue CPU work on a small node; a megabyte prompt holds one for ~1 s
MAX_TOKENIZE_JOBS = 64    # tokenizations queued or running, before admission; past it a request gets a 503
DEBUG_STEPS_MAX_RECORDS = 5_000  # per device and per transfer in one /debug/steps answer (~20 ms of JSON each)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ServerState:
    """What the routes need: the engine once loaded, and whether we are loading, ready or draining."""

    def __init__(self, config: Config):
        self.config = config
        self.status = "loading"
        self.engine: Engine | None = None
        self.model_name = config.served_model_name
        self.model_names = (self.model_name, *(a for a in config.model.aliases if a != self.model_name))
        self.created = int(time.time())
        s = config.server
        self.limits = P.Limits(max_n=s.max_n, max_stop=max(s.max_stop, 1), max_stop_bytes=s.max_stop_bytes,
                               max_logprobs=s.max_logprobs,
                               max_tokens=s.max_tokens_limit)
        self.metrics = Metrics(self.model_name)
        self.api_key = config.api_key.encode()
        self._chat_tools: tuple[ToolFormat | None, Grammars] | None = None
        # tokenization and template rendering, below the loop (server/offload.py); threads start on first use
        self.offload = offload_executor("tokenize", MAX_TOKENIZE_THREADS)
        self.offload_jobs = OffloadQueue(self.offload, MAX_TOKENIZE_JOBS)

    def chat_tools(self, engine: Engine) -> tuple[ToolFormat | None, Grammars]:
        """The model's tool-call format (model.tool_parser) and its grammar compiler, made on first use."""
        if self._chat_tools is None:
            tok = engine.tokenizer
            self._chat_tools = (pick_format(self.config.model.tool_parser, tok.template_source),
                                Grammars(tok, engine.loaded.config.vocab_size))
        return self._chat_tools


STATE = web.AppKey("state", ServerState)


def error_response(err: P.APIError) -> web.Response:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return web.json_response(err.body(), status=err.status, headers=headers, dumps=P.to_json)


_REJECT_REASONS = {400: "bad_request", 413: "bad_request", 415: "bad_request", 401: "unauthorized",
                   403: "unauthorized"}


REQUEST_ID = "X-Request-Id"
# Typed request storage where aiohttp has it (3.12+), which warns about string keys; a string key before that.
_RID = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one; echoed on the response."""
    rid = request.get(_RID)
    if rid is None:
        given = request.headers.get(REQUEST_ID, "")
        rid = given if 0 < len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given \
            else uuid.uuid4().hex
        request[_RID] = rid
    return rid


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID] = request_id(request)


class AccessLogger(AbstractAccessLogger):
    """One line per request: method, path, status, duration, request id; never the body (prompts stay out of
    the log). For a stream the line comes when it ends, so the duration is the whole stream's."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("%s %s %d %.1fms rid=%s", request.method, log_safe(request.path), response.status,
                         time * 1e3, response.headers.get(REQUEST_ID, "-"))


MAX_LOGGED_PATH = 256


def log_safe(text: str, limit: int = MAX_LOGGED_PATH) -> str:
    """Client-chosen text as one log line's worth: control characters, line separators, backslashes and
    non-ASCII escaped as Python writes them (a decoded path /%0Afake cannot start a forged line), then cut."""
    safe = text.encode("unicode_escape").decode("ascii")
    return safe if len(safe) <= limit else safe[:limit] + "..."


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except P.APIError as err:
        reason = err.reject_reason or _REJECT_REASONS.get(err.status)
        if reason is not None:
            request.app[STATE].metrics.rejected(reason)
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(P.APIError(413, "request body too large"))
        if exc.status >= 400:
            resp = error_response(P.APIError(exc.status, exc.reason or "error"))
            if "Allow" in exc.headers:  # a 405 must say which methods are allowed
                resp.headers["Allow"] = exc.headers["Allow"]
            return resp
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s", request.path)
        return error_response(P.APIError(500, "internal server error"))


def is_loopback(host: str) -> bool:
    """Whether a bind address or a Host/Origin name is this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header or an Origin ("http://name:port"), without scheme and port."""
    value = value.partition("://")[2] if "://" in value else value
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


@web.middleware
async def origin_middleware(request: web.Request, handler):
    """On a loopback address, only loopback names: a web page the operator visits could otherwise reach the API
    through DNS rebinding (its own name resolving to 127.0.0.1), or post to it from another origin."""
    if is_loopback(request.app[STATE].config.server.host):
        host = request.headers.get("Host", "")
        if not is_loopback(_host_name(host)):
            raise P.APIError(403, "this server listens on a loopback address and answers only requests for "
                                  "localhost, 127.0.0.1 or [::1] (the Host header named another host)")
        origin = request.headers.get("Origin")
        if origin is not None and not is_loopback(_host_name(origin)):
            raise P.APIError(403, "cross-origin requests are not accepted (the Origin header named another host)")
    return await handler(request)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """Authorization: Bearer <key>, when a key is configured; /health and /metrics may be left open, /debug/*
    never is, but for the console's feed with server.open_console (the console's static page is always open)."""
    state = request.app[STATE]
    if state.api_key:
        open_paths = {"/health": state.config.server.open_health, "/metrics": state.config.server.open_metrics}
        if not open_paths.get(request.path, False) and not console.is_open_path(request):
            if not has_key(request, state.api_key):
                raise P.APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'")
    return await handler(request)


def has_key(request: web.Request, api_key: bytes) -> bool:
    """Authorization: Bearer <api_key>."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # aiohttp keeps a header's non-UTF-8 bytes as surrogates, which .encode() refuses: such a key is simply
    # wrong, not a server error. compare_digest: the time taken does not depend on how much of the key matched.
    given_key = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given_key, api_key)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


async def _read_body(request: web.Request) -> Any:
    # Only JSON: a browser sends a cross-origin form or text/plain POST without asking first, but not JSON.
    if request.content_type != "application/json":
        raise P.APIError(415, f"Content-Type must be application/json, got '{request.content_type}'")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise P.APIError(413, f"request body is larger than {request.app[STATE].config.server.max_body_bytes} bytes")
    except web.RequestPayloadError as e:  # e.g. Content-Encoding: gzip on a body that isn't gzip
        raise P.APIError(400, f"could not read the request body: {' '.join(str(e).split())}")
    return P.parse_json(raw)


def _ready_engine(state: ServerState, model: str | None) -> Engine:
    if state.status != "ready" or state.engine is None:
        raise P.APIError(503, "the server is loading the model" if state.status == "loading"
                         else "the server is shutting down", reject_reason="draining")
    if model is not None and model not in state.model_names:
        raise P.APIError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'",
                         param="model")
    return state.engine


# ---- routes --------------------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    """200 when ready, else 503. With a key set, a caller without it (server.open_health) gets the status alone:
    failure texts, warnings and KV figures describe the node's internals, for its operator."""
    state = _state(request)
    body: dict[str, Any] = {"status": state.status}
    dead = state.engine.dead_threads() if state.engine is not None else []
    if dead:
        body["status"] = "unhealthy"
    if state.api_key and not has_key(request, state.api_key):
        return web.json_response(body, status=200 if body["status"] == "ready" else 503)
    if dead:
        body["dead_threads"] = dead
    if state.engine is not None and state.engine.router is not None:
        body["kv"] = [asdict(s) for s in state.engine.pool_stats()]
        body["num_pending"] = state.engine.num_pending
        if state.engine.warnings:
            body["warnings"] = list(state.engine.warnings)
    return web.json_response(body, status=200 if body["status"] == "ready" else 503)


async def debug_kv(request: web.Request) -> web.Response:
    state = _state(request)
    if state.engine is None or state.engine.router is None:
        raise P.APIError(503, "the server is loading the model")
    engine = state.engine
    body = {"pools": [asdict(s) for s in engine.pool_stats()], "tiers": [asdict(t) for t in engine.tier_stats()],
            "num_prefix_waits": engine.router.num_prefix_waits, "num_pending": engine.num_pending,
            "kv_events": engine.kv_events.stats() if engine.kv_events is not None else None}
    if request.query.get("index") in ("1", "true"):
        body["index"] = engine.kv_index()
    return web.json_response(body)


async def debug_steps(request: web.Request) -> web.Response:
    """Every device's recent steps, [start, end, prefill tokens, decodes] in the server's monotonic clock, every
    transfer's copies, [start, end, bytes], and adaptive mode's role changes, [time, device, role, reason]: the
    raw material of a per-device timeline."""
    state = _state(request)
    if state.engine is None or state.engine.router is None:
        raise P.APIError(503, "the server is loading the model")
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise P.APIError(400, "'since' must be a number (seconds, server monotonic clock)", param="since")
    try:
        limit = int(request.query.get("limit", str(DEBUG_STEPS_MAX_RECORDS)))
    except ValueError:
        limit = -1
    if not 1 <= limit <= DEBUG_STEPS_MAX_RECORDS:
        raise P.APIError(400, f"'limit' must be an integer from 1 to {DEBUG_STEPS_MAX_RECORDS}", param="limit")
    engine = state.engine
    now = time.monotonic()
    # Both kinds of records are logs appended in time order (runtime/records.py): at most `limit` of each go out,
    # oldest first (a page: ask again from the last one's end).
    devices, transfers = [], []
    for w in engine.workers:
        page = w.records.since(since, limit + 1)
        devices.append({"device": w.name, "role": w.role, "truncated": len(page) > limit,
                        "steps": [[r.start, r.end, r.num_prefill_tokens, r.num_decodes] for r in page[:limit]]})
    for t in engine.transfers:
        page = t.records.since(since, limit + 1)
        transfers.append({"name": t.name, "truncated": len(page) > limit, "copies": [list(c) for c in page[:limit]]})
    return web.json_response({"now": now, "devices": devices, "transfers": transfers,
                              "role_changes": engine.role_changes(since)[-limit:]})


async def debug_profile(request: web.Request) -> web.Response:
    """The cost model (core/cost_model.py), refitted from the latest step records: per device the step-time
    coefficients, the (features..., seconds) samples and the fit's error; KV copy bandwidth per device pair."""
    state = _state(request)
    if state.engine is None or state.engine.profiler is None:
        raise P.APIError(503, "the server is loading the model")
    state.engine.profiler.refine()
    return web.json_response(state.engine.profiler.as_dict())


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    max_len = state.engine.max_model_len if state.engine else None
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": state.created, "owned_by": "nodeserve",
        "root": state.config.model.path, "max_model_len": max_len} for name in state.model_names]})


async def loads(request: web.Request) -> web.Response:
    """The node's load in the shape SMG's load-aware policies read (its WorkerLoadResponse: one rank, since the
    node is one worker to a router in front of several)."""
    state = _state(request)
    if state.engine is None or state.engine.router is None:
        raise P.APIError(503, "the server is loading the model")
    node = state.engine.node_load()
    used = (node.num_pages - node.num_free_pages) * node.page_size
    queried, hits = node.num_prefix_queried_tokens, node.num_prefix_hit_tokens
    return web.json_response({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "dp_rank_count": 1,
        "loads": [{"dp_rank": 0, "num_running_reqs": node.num_running, "num_waiting_reqs": node.num_waiting,
                   "num_waiting_uncached_tokens": node.num_waiting_tokens,
                   "num_total_reqs": node.num_running + node.num_waiting, "num_used_tokens": used,
                   "max_total_num_tokens": node.num_pages * node.page_size, "token_usage": node.kv_usage,
                   "gen_throughput": node.gen_throughput, "cache_hit_rate": hits / queried if queried else 0.0,
                   "utilization": node.kv_usage, "max_running_requests": node.max_num_seqs}]})


async def flush_cache(request: web.Request) -> web.Response:
    """Drops every cached KV page no request holds (device pools and host tier; the disk tier stays)."""
    engine = _ready_engine(_state(request), None)
    num = engine.flush_cache()
    log.info("flush_cache: %d cached pages dropped", num)
    return web.json_response({"num_pages_dropped": num})


async def completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    req = P.parse_completion_request(await _read_body(request), state.limits)
    engine = _ready_engine(state, req.model)
    _check_logit_bias(engine, req.params)
    tok = engine.tokenizer
    texts = [p for p in req.prompts if isinstance(p, str)]

    def encode() -> tuple[list[list[int]], list[str]]:
        _check_text_length(engine, texts, "prompt")
        prompts = [_encode_within_context(engine, p, "prompt") if isinstance(p, str) else p for p in req.prompts]
        echo = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in req.prompts]
        return prompts, echo
    prompts, echo_texts = await _off_loop(state, encode)
    jobs = [(pi, prompts[pi], echo_texts[pi]) for pi in range(len(prompts)) for _ in range(req.n)]
    gens = _start(state, engine, [(ids, req.params) for _, ids, _ in jobs], COMPLETION_MAX_TOKENS, seed_offsets=True,
                  want_logprobs=req.params.logprobs is not None, prompt_param="prompt")
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    if req.stream:
        offsets = [len(echo) for _, _, echo in jobs]  # per choice: where its next token starts in its text

        def chunk(i: int, piece: Piece, first: bool) -> dict:
            text = (jobs[i][2] if first else "") + piece.text
            lp = None
            if req.params.logprobs is not None:
                lp = P.completion_logprobs(piece.logprobs, offsets[i])
                offsets[i] += sum(len(tok) for tok, _, _ in piece.logprobs)
            return P.completion_chunk(rid, model, created, i, text, piece.finish_reason, lp)
        return await _stream(request, engine, gens, chunk, None, "text_completion", rid, model, created,
                             req.include_usage, req.n)
    results = await _collect(state, engine, gens)
    choices = []
    for i, (text, finish, lps) in enumerate(results):
        lp = P.completion_logprobs(lps, len(jobs[i][2])) if req.params.logprobs is not None else None
        choices.append(P.completion_choice(i, jobs[i][2] + text, finish, lp))
    return web.json_response(P.completion_response(rid, model, created, choices, _usage(gens, req.n)),
                             dumps=P.to_json)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    req = P.parse_chat_request(await _read_body(request), state.limits)
    engine = _ready_engine(state, req.model)
    _check_logit_bias(engine, req.params)
    tok = engine.tokenizer
    fmt, grammars = state.chat_tools(engine)
    tools = req.tools if req.tool_choice != "none" else []
    spec = grammar_spec(req, fmt)
    parse_calls = fmt is not None and bool(tools)

    def encode() -> list[int]:
        _check_text_length(engine, [m["content"] for m in req.messages if m["content"]], "messages")
        try:
            text = render_chat(tok, req.messages, tools, fmt, req.chat_template_kwargs)
        except TemplateError as e:
            raise P.APIError(400, f"chat template error: {e}", param="messages")
        return _encode_within_context(engine, text, "messages")
    prompt = await _off_loop(state, encode)
    compiled = await grammars.compile_async(spec) if spec is not None else None
    make_grammar = (lambda: grammars.matcher(compiled)) if compiled is not None else None
    gens = _start(state, engine, [(prompt, req.params)] * req.n, state.config.server.default_max_tokens,
                  seed_offsets=True, want_logprobs=req.logprobs, make_grammar=make_grammar)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    if req.stream:
        streamers = [fmt.streamer() for _ in gens] if parse_calls else None

        def chunk(i: int, piece: Piece, first: bool) -> list[dict]:
            lp = P.chat_logprobs(piece.logprobs) if req.logprobs else None
            final = piece.finish_reason is not None
            if streamers is None:
                deltas = [{"content": piece.text}] if piece.text else []
            else:
                deltas = streamers[i].feed(piece.text, final)
            finish = piece.finish_reason
            if finish == "stop" and streamers is not None and streamers[i].num_calls:
                finish = "tool_calls"
            if not deltas and not final and lp is None:
                return []  # text held back (it may open a tool call): nothing to send yet
            deltas = deltas or [{}]  # a finish reason, or logprobs of tokens whose text is held back, alone
            last = len(deltas) - 1
            return [P.chat_chunk(rid, model, created, i, d, finish if k == last else None, lp if k == 0 else None)
                    for k, d in enumerate(deltas)]

        def role_chunk(i: int) -> dict:
            return P.chat_chunk(rid, model, created, i, {"role": "assistant", "content": ""})
        return await _stream(request, engine, gens, chunk, role_chunk, "chat.completion.chunk", rid, model,
                             created, req.include_usage, req.n)
    results = await _collect(state, engine, gens)
    choices = []
    for i, (text, finish, lps) in enumerate(results):
        content, calls = fmt.parse(text) if parse_calls else (text, [])
        if calls and finish == "stop":
            finish = "tool_calls"
        choices.append(P.chat_choice(i, content, finish, P.chat_logprobs(lps) if req.logprobs else None,
                                     [c.to_openai() for c in calls]))
    return web.json_response(P.chat_response(rid, model, created, choices, _usage(gens, req.n)), dumps=P.to_json)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: the ids a prompt (as /v1/completions encodes it) or a chat (as /v1/chat/completions
    renders it) becomes."""
    state = _state(request)
    req = P.parse_tokenize_request(await _read_body(request))
    engine = _ready_engine(state, req.model)
    tok = engine.tokenizer

    def encode() -> list[int]:
        if req.prompt is not None:
            _check_text_length(engine, [req.prompt], "prompt")
            return tok.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
        _check_text_length(engine, [m["content"] for m in req.messages if m["content"]], "messages")
        try:
            fmt = state.chat_tools(engine)[0]
            return tok.encode(render_chat(tok, req.messages, [], fmt, {}, req.add_generation_prompt))
        except TemplateError as e:
            raise P.APIError(400, f"chat template error: {e}", param="messages")
    ids = await _off_loop(state, encode)
    return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    state = _state(request)
    model, ids = P.parse_detokenize_request(await _read_body(request))
    engine = _ready_engine(state, model)
    vocab_size = engine.loaded.config.vocab_size
    outside = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
    if outside is not None:
        raise P.APIError(400, f"'tokens[{outside}]' = {ids[outside]} is outside the vocabulary [0, {vocab_size})",
                         param=f"tokens[{outside}]")
    return web.json_response({"prompt": await _off_loop(state, lambda: engine.tokenizer.decode(ids))})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    text = importlib.resources.files("nodeserve.server").joinpath("openapi.json").read_text(encoding="utf-8")
    return web.Response(text=text, content_type="application/json")


# ---- plumbing ------------------------------------------------------------------------------------------

async def _off_loop(state: ServerState, fn):
    """Runs fn (template rendering, tokenization: seconds for a long prompt) in a thread below the loop's
    priority, so that streams, /health and the watchdog keep going meanwhile. At most MAX_TOKENIZE_JOBS wait or
    run: a flood of large prompts gets 503s (the client retries) instead of queueing memory and time unbounded."""
    try:
        return await state.offload_jobs.run(fn)
    except OffloadFull:
        raise P.APIError(503, f"the server is busy: {state.offload_jobs.max_jobs} requests are being tokenized; "
                         "retry shortly", reject_reason="queue_full") from None


def _check_logit_bias(engine: Engine, params) -> None:
    vocab_size = engine.loaded.config.vocab_size
    outside = sorted(t for t in params.logit_bias if t >= vocab_size)
    if outside:
        raise P.APIError(400, f"'logit_bias' has token id {outside[0]} outside the vocabulary [0, {vocab_size})",
                         param="logit_bias")


def _check_text_length(engine: Engine, texts: list[str], param: str) -> None:
    """Refuses text that cannot fit the context whatever it tokenizes to, before spending time tokenizing it."""
    limit = engine.max_model_len * engine.tokenizer.max_token_chars
    num_chars = sum(len(t) for t in texts)
    if num_chars > limit:
        raise P.APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens, at most "
                              f"{limit} characters of text; your request has {num_chars} characters.",
                         param=param, reject_reason="too_large")


def _encode_within_context(engine: Engine, text: str, param: str) -> list[int]:
    """tokenizer.encode(text), but a text past PROBE_CHARS_PER_TOKEN characters per context token is first encoded
    in part: if that prefix alone is longer than the context, the request is refused without the rest. Why: a
    hostile 860,000-character prompt (128 tools) took 1.35 s to tokenize, and building its id list held the GIL for
    ~40 ms at a time, stalling the event loop, only for the request to be refused afterwards."""
    n = engine.max_model_len
    probe = n * PROBE_CHARS_PER_TOKEN
    if len(text) > probe:
        # A prefix's tokens are the whole text's up to the last few before the cut: PROBE_MARGIN covers those.
        count = len(engine.tokenizer.encode(text[:probe], add_bos=False)) - PROBE_MARGIN
        if count >= n:
            raise P.APIError(400, f"This model's maximum context length is {n} tokens. However, your request has "
                                  f"more than {count} input tokens. Please reduce the length of the input.",
                             param=param, reject_reason="too_large")
    return engine.tokenizer.encode(text)


def _start(state: ServerState, engine: Engine, jobs: list[tuple[list[int], Any]], default_max_tokens: int,
           seed_offsets: bool, want_logprobs: bool, prompt_param: str = "messages",
           make_grammar=None) -> list[Generation]:
    """Admits every choice, or none: if one is refused, the ones already admitted are aborted. default_max_tokens:
    the route's, for a request without one (the engine resolves it: resolve_max_tokens). make_grammar(): a new
    grammar matcher per choice (structured output), or None."""
    gens: list[Generation] = []
    try:
        for i, (ids, params) in enumerate(jobs):
            # n > 1 with a seed: distinct but reproducible choices
            p = replace(params, seed=params.seed + i) if seed_offsets and params.seed is not None else params
            # grammar= only when there is one: an engine without structured output still serves the rest.
            kw = {"grammar": make_grammar()} if make_grammar else {}
            stream = engine.add_request(ids, p, default_max_tokens=default_max_tokens, **kw)
            gens.append(Generation(engine, engine.tokenizer, stream, p.stop, want_logprobs, state.metrics))
    except (PromptTooLong, TooLarge) as e:
        _abort_all(engine, gens)
        raise P.APIError(400, str(e), param=prompt_param if "context" in str(e) else None,
                         reject_reason="too_large")
    except QueueFull as e:
        _abort_all(engine, gens)
        raise P.APIError(503, f"the server is overloaded ({e}); retry later",
                         reject_reason=getattr(e, "reject_reason", "queue_full"))
    return gens


def _abort_all(engine: Engine, gens: list[Generation]) -> None:
    for g in gens:
        engine.abort(g.stream)


def _usage(gens: list[Generation], n: int) -> dict:
    """Each distinct prompt counts once however many choices (n) it has, as OpenAI counts."""
    prompt_tokens = sum(g.num_prompt_tokens for g in gens[::n])
    cached_tokens = sum(g.stream.request.num_cached_tokens for g in gens[::n])
    return P.usage(prompt_tokens, sum(g.num_completion_tokens for g in gens), cached_tokens)


def _timeout(state: ServerState):
    seconds = state.config.server.request_timeout
    return asyncio.timeout(seconds if seconds > 0 else None)


async def _collect(state: ServerState, engine: Engine, gens: list[Generation]) -> list[tuple[str, str, list]]:
    async def one(g: Generation) -> tuple[str, str, list]:
        texts, lps, finish = [], [], None
        async for piece in g.pieces():
            texts.append(piece.text)
            lps.extend(piece.logprobs)
            finish = piece.finish_reason or finish
        return "".join(texts), finish, lps
    try:
        async with _timeout(state):
            return await asyncio.gather(*(one(g) for g in gens))
    except GenerationError as e:
        raise P.APIError(500, f"generation failed: {e}")
    except TimeoutError:
        raise P.APIError(504, f"the request ran longer than server.request_timeout "
                              f"({state.config.server.request_timeout:g} s)", type="TimeoutError")
    finally:
        _abort_all(engine, gens)  # no-op for finished ones; frees the rest on error or disconnect


async def _stream(request: web.Request, engine: Engine, gens: list[Generation], chunk, role_chunk,
                  obj: str, rid: str, model: str, created: int, include_usage: bool, n: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for piece in g.pieces():
                await queue.put((i, piece))
        except GenerationError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks: list[asyncio.Task] = []
    state = request.app[STATE]

    def end_all() -> None:
        for t in tasks:
            t.cancel()
        _abort_all(engine, gens)  # on disconnect (ConnectionResetError / CancelledError) frees every device

    try:
        await resp.prepare(request)  # inside the try: a closing transport must not leave the requests running
        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        async with _timeout(state):
            await _write_stream(resp, gens, queue, chunk, role_chunk, obj, rid, model, created, include_usage, n)
    except TimeoutError:
        end_all()  # first: a client that stopped reading must not keep the pages while the error waits to go out
        err = P.APIError(504, f"the request ran longer than server.request_timeout "
                              f"({state.config.server.request_timeout:g} s)", type="TimeoutError")
        try:
            async with asyncio.timeout(ERROR_WRITE_TIMEOUT_S):
                await resp.write(P.sse(err.body()))
                await resp.write(P.sse("[DONE]"))
        except (TimeoutError, ConnectionResetError):
            log.info("request %s: could not deliver the timeout error to the client", rid)
    finally:
        end_all()
    return resp


async def _write_stream(resp, gens, queue, chunk, role_chunk, obj, rid, model, created, include_usage, n) -> None:
    """Writes role chunks, then pieces as they arrive from every choice, then usage and [DONE]."""
    if role_chunk is not None:
        for i in range(len(gens)):
            await resp.write(P.sse(role_chunk(i)))
    first = [True] * len(gens)
    remaining = len(gens)
    while remaining:
        i, item = await queue.get()
        if item is None:
            remaining -= 1
        elif isinstance(item, GenerationError):
            err = P.APIError(500, f"generation failed: {item}")
            await resp.write(P.sse(err.body()))
            await resp.write(P.sse("[DONE]"))
            return
        elif item.text or item.finish_reason is not None or item.logprobs:
            out = chunk(i, item, first[i])
            for c in out if isinstance(out, list) else [out]:
                await resp.write(P.sse(c))
            first[i] = False
    if include_usage:
        await resp.write(P.sse(P.usage_chunk(rid, model, created, obj, _usage(gens, n))))
    await resp.write(P.sse("[DONE]"))
    await resp.write_eof()


async def _stop_offload(app: web.Application) -> None:
    app[STATE].offload.shutdown(wait=False, cancel_futures=True)


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, origin_middleware, auth_middleware],
                          client_max_size=state.config.server.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_on_prepare)
    app.on_cleanup.append(_stop_offload)
    app.router.add_get("/metrics", state.metrics.handler())
    app.router.add_get("/health", health)
    app.router.add_get("/debug/kv", debug_kv)
    app.router.add_get("/debug/steps", debug_steps)
    app.router.add_get("/debug/profile", debug_profile)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    console.register(app, state, is_loopback(state.config.server.host))  # GET / and /debug/events, when on
    return app
