"""The live node console: `GET /` serves a single page (the files in nodeserve/server/console/), and
`GET /debug/events` feeds it with Server-Sent Events built from what the engine already keeps.

The feed: one producer task for every connected console, started with the first and cancelled with the last,
reads the workers' step records, the transfers' copy records, the roles, the KV pools and the in-flight
requests TICK_S apart, on the event loop. Each tick costs what happened since the last one (the record logs are
read from the last record sent, never copied whole), and its JSON is encoded once for all clients. Each client holds at
most QUEUE_SIZE messages: past that its oldest is dropped, and a client whose socket takes nothing for
WRITE_TIMEOUT_S is disconnected, so a stalled browser costs a few messages and one socket buffer, never the
loop's time or a growing queue. Prompt text never enters the feed.

Access: the page itself is static (no data) and always answers when the console is on; the feed needs the API
key when one is set, unless `server.open_console`. The console is off with `server.console = false`, and off on
a non-loopback host without an API key unless `server.console_public = true` (docs/console.md).
"""

from __future__ import annotations

import asyncio
import bisect
import importlib.resources
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from nodeserve.config import Config
from nodeserve.server import protocol as P

log = logging.getLogger(__name__)

FEED_PATH = "/debug/events"
# URL path -> (file in nodeserve/server/console, Content-Type)
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
          "/console/console.css": ("console.css", "text/css; charset=utf-8")}
# Nothing inline, nothing from elsewhere: the page's own script and style, fetch() to this server only.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
FEED_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}

TICK_S = 0.25            # 4 updates a second: smooth enough to watch, cheap enough to leave open
SLOW_EVERY = 4           # rejections, tiers and SLO attainment once a second (they read more)
QUEUE_SIZE = 4           # messages waiting per client; past it the oldest is dropped
WRITE_TIMEOUT_S = 5.0    # a client whose socket takes nothing for this long is disconnected
MAX_CLIENTS = 32         # more get 503: each costs a queue and a socket buffer
WINDOW_S = 30.0          # the step history a new client starts with (what the timeline shows)
MAX_RECORDS = 5_000      # step or copy records per device or transfer in one message
MAX_IN_FLIGHT = 64       # requests listed in one message, newest first
NUM_RECENT = 32          # finished requests listed
SLO_WINDOW_S = 300.0     # attainment over the last five minutes (while a console was open)
MAX_SLO_SAMPLES = 10_000


@dataclass(frozen=True)
class Access:
    """Whether the console is on, and if not, why."""

    enabled: bool
    reason: str = ""


def console_access(config: Config, loopback: bool) -> Access:
    """server.console, and the safety rule: on a non-loopback address (`loopback` False) without an API key, anyone
    on the network would see the node's traffic, so it is off unless console_public says otherwise."""
    s = config.server
    if not s.console:
        return Access(False, "server.console = false")
    if not loopback and not config.api_key and not s.console_public:
        return Access(False, f"server.host {s.host} is not a loopback address and no API key is set; set "
                             "server.api_key, or server.console_public = true to show it to anyone who can reach "
                             "the port")
    return Access(True)


def is_open_path(request: web.Request) -> bool:
    """For the API-key middleware: the console's static files (no data in them) always answer without the key when
    the console is on; its feed only with server.open_console."""
    feed = request.app.get(FEED)
    if feed is None:  # the console is off
        return False
    return request.path in STATIC or (request.path == FEED_PATH and feed.state.config.server.open_console)


# ---- reading the engine ----------------------------------------------------------------------------------

def newer(records, after: float, end_of, limit: int = MAX_RECORDS) -> list:
    """The first `limit` records of a time-ordered log that end after `after`, oldest first. A log with since()
    (runtime/records.py) finds them by bisection under its lock. A deque ring is walked back from its newest end,
    so a tick costs its new records, not the ring (100,000 of them); its owning thread may append meanwhile, which
    shifts the walk by one: that can repeat a record (dropped here by identity) but not skip one, and the record
    appended is newer than all those seen, so the next call gets it."""
    since = getattr(records, "since", None)
    if since is not None:
        return since(after, limit)
    out, seen, k = [], set(), 1
    while True:
        try:
            r = records[-k]
        except IndexError:
            break
        if end_of(r) <= after:
            break
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
        k += 1
    out.sort(key=end_of)
    return out[:limit]


def window(records, since: float, end_of, limit: int = MAX_RECORDS) -> list:
    """The newest `limit` records ending after `since` (a new client's history): read once per new client."""
    if hasattr(records, "since"):
        items = records.since(since)
    else:
        items = list(records)  # one copy of the ring, as /debug/steps did
        items = items[bisect.bisect_right(items, since, key=end_of):]
    return items[-limit:]


def _last_end(records: deque, end_of) -> float:
    try:
        return end_of(records[-1])
    except IndexError:
        return float("-inf")


def _step_row(r) -> list:
    # decode tokens made (a verify step's rows include guesses not kept)
    return [round(r.start, 4), round(r.end, 4), r.num_prefill_tokens,
            r.num_decodes if r.num_decode_tokens < 0 else r.num_decode_tokens]


def _spec_counts(w):
    return w.scheduler.speculator.counts if w.scheduler.speculator is not None else None


def _copy_row(c) -> list:
    return [round(c[0], 4), round(c[1], 4), c[2]]


def _step_end(r) -> float:
    return r.end


def _copy_end(c) -> float:
    return c[1]  # a (start, end, bytes) tuple or runtime.transfer.CopyRecord


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


@dataclass
class _Tracked:
    """A request the feed has seen in flight: where it runs, and when its output last grew (for tokens/s)."""

    req: Any
    prefill: str | None = None
    decode: str | None = None
    state: str = "waiting"
    num_out: int = 0
    grew_at: float = 0.0
    ended_at: float | None = None


class Snapshots:
    """Builds the feed's messages; the memory of one producer run (what was sent, requests seen, SLO samples)."""

    def __init__(self, state):
        self.state = state
        self.seq = 0
        self.step_after: dict[str, float] = {}      # device -> end of the newest step sent
        self.copy_after: dict[str, float] = {}      # transfer -> end of the newest copy sent
        self.role_after = time.monotonic()          # newest role change sent (history covers before)
        self.bytes_seen: dict[str, deque] = {}      # transfer -> (time, bytes copied so far), the last ~second
        self.tracked: dict[str, _Tracked] = {}
        self.recent: deque[_Tracked] = deque(maxlen=NUM_RECENT)
        self.slo_samples: deque[tuple] = deque(maxlen=MAX_SLO_SAMPLES)  # (ended, ttft, tpot, predicted, target)
        self.slow: dict = {}
        self.started = time.monotonic()
        self.cost_s = 0.0                            # the last tick's build time, shown on the page

    def build(self, history: bool) -> tuple[bytes, bytes | None]:
        """This tick's message for clients already fed, and with `history` one that also carries the last WINDOW_S
        of records, for clients that just connected."""
        t0 = time.perf_counter()
        self.seq += 1
        state, now = self.state, time.monotonic()
        engine = state.engine
        msg: dict[str, Any] = {"seq": self.seq, "now": round(now, 4), "status": state.status,
                               "model": state.model_name, "tick_s": TICK_S}
        if engine is None or engine.router is None:
            data = _sse(msg)
            return data, data if history else None
        cfg = state.config
        msg.update(mode=cfg.devices.mode, pending=engine.num_pending, cost_ms=round(self.cost_s * 1e3, 2),
                   max_num_seqs=cfg.scheduler.max_num_seqs)
        dead = set(engine.dead_threads())
        devices, hist_devices = [], []
        for w in engine.workers:
            kv = w.kv
            if w.name not in self.step_after:  # first sight: the history covers what came before
                self.step_after[w.name] = _last_end(w.records, _step_end)
            new = newer(w.records, self.step_after[w.name], _step_end)
            if new:
                self.step_after[w.name] = new[-1].end
            dev = {"name": w.name, "role": str(w.role), "running": len(w.scheduler.running),
                   "waiting": len(w.scheduler.waiting),
                   "dead": any(d == w.name or d.startswith(w.name + ": ") for d in dead),
                   "kv": {"pages": kv.num_usable, "used": kv.num_used, "cached": kv.num_cached, "free": kv.num_free},
                   # speculative decoding so far: guesses verified, accepted
                   "spec": [c.num_draft_tokens, c.num_accepted_tokens] if (c := _spec_counts(w)) is not None else None,
                   "steps": [_step_row(r) for r in new]}
            devices.append(dev)
            if history:
                hist_devices.append({**dev, "steps": [_step_row(r) for r in window(w.records, now - WINDOW_S,
                                                                                    _step_end)]})
        transfers, hist_transfers = [], []
        for t in engine.transfers:
            if t.name not in self.copy_after:
                self.copy_after[t.name] = _last_end(t.records, _copy_end)
            new = newer(t.records, self.copy_after[t.name], _copy_end)
            if new:
                self.copy_after[t.name] = new[-1][1]
            tr = {"name": t.name, "src": t.src_device.name, "dst": t.dst_device.name,
                  "mb_s": round(self._rate(t.name, t.num_bytes, now) / 1e6, 2), "copies": [_copy_row(c) for c in new]}
            transfers.append(tr)
            if history:
                hist_transfers.append({**tr, "copies": [_copy_row(c) for c in window(t.records, now - WINDOW_S,
                                                                                      _copy_end)]})
        changes = [c for c in engine.role_changes(self.role_after) if c[0] > self.role_after]
        if changes:
            self.role_after = changes[-1][0]
        msg.update(devices=devices, transfers=transfers, role_changes=[[_r(c[0], 4), *c[1:]] for c in changes],
                   requests=self._requests(engine, now))
        if self.seq % SLOW_EVERY == 1 or not self.slow:
            self.slow = self._slow(engine, now)
        msg.update(self.slow)
        data = _sse(msg)
        hist = None
        if history:
            msg.update(history=True, devices=hist_devices, transfers=hist_transfers,
                       role_changes=[[_r(c[0], 4), *c[1:]] for c in engine.role_changes(now - WINDOW_S)][-50:])
            hist = _sse(msg)
        self.cost_s = time.perf_counter() - t0
        return data, hist

    def _rate(self, name: str, num_bytes: int, now: float) -> float:
        """Bytes a second a transfer copied over about the last second (from its running total)."""
        seen = self.bytes_seen.setdefault(name, deque())
        seen.append((now, num_bytes))
        while len(seen) > 2 and seen[1][0] <= now - 1.0:
            seen.popleft()
        (t0, b0), (t1, b1) = seen[0], seen[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    # ---- requests ------------------------------------------------------------------------------------------
    def _requests(self, engine, now: float) -> dict:
        router = engine.router
        where: dict[str, tuple[str, str]] = {}  # request id -> (state, device) from the workers' queues
        for w in engine.workers:
            for seq in list(w.scheduler.waiting):
                rid = seq.req.request_id
                where[rid] = ("prefill" if seq.req.prefill_start is not None else "queued", w.name)
            for seq in list(w.scheduler.running):
                where[seq.req.request_id] = ("decode", w.name)
        # Disaggregated with one prefill device: every prompt from the threshold up prefills there, even one whose
        # prefill began and ended between two ticks.
        prefill_workers = getattr(engine, "prefill_workers", [])
        only_prefill = prefill_workers[0].name if len(prefill_workers) == 1 else None
        threshold = self.state.config.devices.local_prefill_threshold
        live = engine.streams
        for rid, stream in list(live.items()):
            tr = self.tracked.get(rid)
            if tr is None:
                tr = self.tracked[rid] = _Tracked(stream.request, grew_at=now)
                if only_prefill is not None and tr.req.num_prompt_tokens >= threshold:
                    tr.prefill = only_prefill
            self._locate(tr, rid, where, router)
            n = len(tr.req.output_ids)
            if n != tr.num_out:
                tr.num_out, tr.grew_at = n, now
        for rid in [rid for rid in self.tracked if rid not in live]:
            tr = self.tracked.pop(rid)
            n = len(tr.req.output_ids)
            if n != tr.num_out:
                tr.num_out, tr.grew_at = n, now
            tr.state, tr.ended_at = "ended", now
            self.recent.append(tr)
            self._sample(tr)
        in_flight = sorted(self.tracked.values(), key=lambda t: t.req.arrival_time, reverse=True)[:MAX_IN_FLIGHT]
        return {"in_flight": [self._row(t, now) for t in in_flight], "num_in_flight": len(self.tracked),
                "recent": [self._row(t, now) for t in reversed(self.recent)]}

    @staticmethod
    def _locate(tr: _Tracked, rid: str, where: dict, router) -> None:
        state, device = where.get(rid, (None, None))
        decode = router.placements.get(rid)
        if decode is not None:
            tr.decode = decode.name
        if rid in router.moving:
            tr.state = "moving"
        elif state is not None:
            tr.state = state
            if state in ("prefill", "queued"):
                tr.prefill = device
            else:
                tr.decode = device
        elif decode is not None:
            tr.state = "transfer"  # placed, its KV between devices
        else:
            tr.state = "waiting"   # in the router's queue for pages or a seat

    @staticmethod
    def _ttft(req) -> float | None:
        return req.prefill_end - req.arrival_time if req.prefill_end is not None else None

    @staticmethod
    def _tok_s(tr: _Tracked, now: float) -> float | None:
        req = tr.req
        if tr.num_out < 2 or req.prefill_end is None:
            return None
        end = tr.grew_at if tr.ended_at is not None else now
        return (tr.num_out - 1) / (end - req.prefill_end) if end > req.prefill_end else None

    def _row(self, tr: _Tracked, now: float) -> dict:
        req = tr.req
        return {"id": req.request_id, "state": tr.state, "prefill": tr.prefill, "decode": tr.decode,
                "prompt": req.num_prompt_tokens, "cached": req.num_cached_tokens, "from": dict(req.cached_from),
                "out": tr.num_out, "max": req.max_tokens, "ttft": _r(self._ttft(req)),
                "predicted": _r(req.predicted_ttft), "tok_s": _r(self._tok_s(tr, now), 1),
                "age": _r(now - req.arrival_time, 1)}

    def _sample(self, tr: _Tracked) -> None:
        """A finished request's SLO sample: (ended, ttft, tpot, predicted ttft, its ttft target)."""
        req, slo = tr.req, self.state.config.slo
        ttft = self._ttft(req)
        if ttft is None:
            return
        tpot = (tr.grew_at - req.prefill_end) / (tr.num_out - 1) if tr.num_out > 1 else None
        self.slo_samples.append((tr.ended_at, ttft, tpot, req.predicted_ttft,
                                 slo.ttft_s + slo.ttft_per_token_s * req.num_prompt_tokens))

    # ---- once a second -------------------------------------------------------------------------------------
    def _slow(self, engine, now: float) -> dict:
        slo = self.state.config.slo
        samples = [s for s in self.slo_samples if s[0] >= now - SLO_WINDOW_S]
        met_ttft = sum(1 for s in samples if s[1] <= s[4])
        met_tpot = sum(1 for s in samples if s[2] is None or s[2] <= slo.tpot_s)
        met = sum(1 for s in samples if s[1] <= s[4] and (s[2] is None or s[2] <= slo.tpot_s))
        minutes = [[0, 0] for _ in range(5)]  # per minute, oldest first: [requests, met both]
        for s in samples:
            ago = min(int((now - s[0]) // 60), 4)
            minutes[4 - ago][0] += 1
            minutes[4 - ago][1] += s[1] <= s[4] and (s[2] is None or s[2] <= slo.tpot_s)
        predicted = [[_r(s[3]), _r(s[1])] for s in samples if s[3] is not None][-100:]
        tiers = [{"tier": t.tier, "pages": t.num_pages, "used": t.num_used, "hit_tokens": t.num_hit_tokens}
                 for t in engine.tier_stats()]
        return {"slo": {"ttft_s": slo.ttft_s, "ttft_per_token_s": slo.ttft_per_token_s, "tpot_s": slo.tpot_s,
                        "admission": slo.admission, "window_s": round(min(SLO_WINDOW_S, now - self.started), 1),
                        "requests": len(samples), "met": met, "met_ttft": met_ttft, "met_tpot": met_tpot,
                        "minutes": minutes, "predicted": predicted},
                "rejections": self._rejections(), "tiers": tiers,
                "migrations": {str(k): v for k, v in engine.router.num_migrations.items()}}

    def _rejections(self) -> dict[str, float]:
        """nodeserve:request_rejected_total by reason, read from that one counter (not a whole scrape)."""
        name = "nodeserve:request_rejected_total"
        out = {}
        for family in self.state.metrics.registry.restricted_registry([name]).collect():
            for s in family.samples:
                if s.name == name:
                    out[s.labels["reason"]] = s.value
        return out


def _sse(msg: dict) -> bytes:
    return b"data: " + json.dumps(msg, separators=(",", ":")).encode() + b"\n\n"


# ---- the feed ------------------------------------------------------------------------------------------

class Client:
    """One console's queue: at most `size` messages, the oldest dropped first."""

    def __init__(self, size: int = QUEUE_SIZE):
        self.queue: deque[bytes] = deque(maxlen=size)
        self.wake = asyncio.Event()
        self.new = True          # its next message carries the history
        self.closed = False
        self.num_dropped = 0
        self.num_sent = 0

    def offer(self, data: bytes) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.num_dropped += 1
        self.queue.append(data)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    async def next(self) -> bytes | None:
        """The oldest queued message, waiting for one; None once closed."""
        while not self.queue:
            if self.closed:
                return None
            self.wake.clear()
            await self.wake.wait()
        return self.queue.popleft()

    @property
    def num_queued_bytes(self) -> int:
        return sum(len(m) for m in self.queue)


class Feed:
    """Every console's updates from one producer task, which runs only while some console is connected."""

    def __init__(self, state, tick_s: float = TICK_S, queue_size: int = QUEUE_SIZE):
        self.state, self.tick_s, self.queue_size = state, tick_s, queue_size
        self.clients: set[Client] = set()
        self.task: asyncio.Task | None = None
        self.num_ticks = 0
        self.num_errors = 0

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def subscribe(self) -> Client:
        client = Client(self.queue_size)
        self.clients.add(client)
        if not self.running:
            self.task = asyncio.get_running_loop().create_task(self._produce(), name="console feed")
        return client

    def unsubscribe(self, client: Client) -> None:
        client.close()
        self.clients.discard(client)
        if not self.clients and self.task is not None:
            self.task.cancel()
            self.task = None

    def close(self) -> None:
        for client in list(self.clients):
            self.unsubscribe(client)

    async def _produce(self) -> None:
        snapshots = Snapshots(self.state)  # a fresh memory per run: a new console gets the history anyway
        while self.clients:
            new = [c for c in self.clients if c.new]
            try:
                data, hist = snapshots.build(history=bool(new))
            except Exception:  # the feed is a view: a bug here must not take the server's loop with it
                self.num_errors += 1
                if self.num_errors == 1 or self.num_errors % 60 == 0:  # not a stack a second in the log
                    log.exception("console feed: building an update failed (%d times so far)", self.num_errors)
                await asyncio.sleep(1.0)
                continue
            self.num_ticks += 1
            for client in self.clients:
                client.offer(hist if client.new and hist is not None else data)
                client.new = False
            await asyncio.sleep(self.tick_s)


FEED = web.AppKey("console_feed", Feed)


# ---- routes --------------------------------------------------------------------------------------------

def register(app: web.Application, state, loopback: bool) -> None:
    """Adds GET / (the page), its script and style, and GET /debug/events (the feed), when the console is on;
    `loopback`: whether server.host is a loopback address."""
    access = console_access(state.config, loopback)
    if not access.enabled:
        if state.config.server.console:
            log.warning("the console (GET /) is off: %s", access.reason)
        return
    if not state.config.api_key and not loopback:
        log.warning("the console (GET /) and its feed are public (server.console_public = true): anyone who can "
                    "reach port %d sees this node's traffic and can use its API", state.config.server.port)
    files = importlib.resources.files("nodeserve.server").joinpath("console")
    pages = {path: (files.joinpath(name).read_bytes(), ctype) for path, (name, ctype) in STATIC.items()}
    feed = Feed(state)
    app[FEED] = feed

    async def static(request: web.Request) -> web.Response:
        body, ctype = pages[request.path]
        return web.Response(body=body, headers={**PAGE_HEADERS, "Content-Type": ctype})

    async def events(request: web.Request) -> web.StreamResponse:
        if len(feed.clients) >= MAX_CLIENTS:
            raise P.APIError(503, f"{MAX_CLIENTS} consoles are already connected")
        resp = web.StreamResponse(headers=FEED_HEADERS)
        client = feed.subscribe()
        try:
            await resp.prepare(request)
            while (data := await client.next()) is not None:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await resp.write(data)
                client.num_sent += 1
        except TimeoutError:
            log.info("console feed: a client took no data for %.0f s; disconnected", WRITE_TIMEOUT_S)
            if request.transport is not None:
                request.transport.abort()
        except ConnectionResetError:
            pass
        finally:
            feed.unsubscribe(client)
        return resp

    async def on_shutdown(app: web.Application) -> None:
        feed.close()  # ends every feed's handler, so the shutdown does not wait for them

    for path in STATIC:
        app.router.add_get(path, static)
    app.router.add_get(FEED_PATH, events)
    app.on_shutdown.append(on_shutdown)
