"""The live node console in process, over a stand-in engine: GET / and its CSP, the feed's messages (history,
then only what is new; never prompt text), the API key and the switches that turn it off, a stalled client
dropped with its queue bounded, and one producer that runs only while consoles are connected."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import Counter, deque
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from nodeserve.config import ConfigError, config_from_dict, load_config
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.runtime.worker import StepRecord
from nodeserve.server import console
from nodeserve.server.app import ServerState, create_app

KEY = {"Authorization": "Bearer sekrit"}
SECRET_PROMPT = [987_654_321, 123_456_789]  # token ids no message may carry


class FakeEngine:
    """What the feed reads of an Engine: workers with step records, queues and KV counts, transfers with copy
    records, the router's placements, the in-flight streams, role changes and tiers."""

    def __init__(self):
        def worker(name, role):
            return SimpleNamespace(name=name, role=role, records=deque(maxlen=100_000),
                                   scheduler=SimpleNamespace(running=[], waiting=deque(), speculator=None),
                                   kv=SimpleNamespace(num_usable=100, num_used=10, num_cached=5, num_free=90))
        self.workers = [worker("cpu:0", "prefill"), worker("cpu:1", "decode")]
        self.transfers = [SimpleNamespace(name="kv cpu:0->cpu:1", src_device=SimpleNamespace(name="cpu:0"),
                                          dst_device=SimpleNamespace(name="cpu:1"), records=deque(maxlen=100_000),
                                          num_bytes=0)]
        self.prefill_workers = self.workers[:1]
        self.router = SimpleNamespace(placements={}, moving={}, num_migrations=Counter())
        self.streams: dict = {}
        self.num_pending = 0
        self.changes: list[list] = []

    def dead_threads(self) -> list[str]:
        return []

    def role_changes(self, since: float = 0.0) -> list[list]:
        return [c for c in self.changes if c[0] >= since]

    def tier_stats(self) -> list:
        return [SimpleNamespace(tier="host", num_pages=64, num_used=3, num_hit_tokens=48)]

    def step(self, device: int, num_prefill: int, num_decodes: int, seconds: float = 0.01) -> None:
        end = time.monotonic()
        self.workers[device].records.append(StepRecord(end - seconds, end, num_prefill, num_decodes))

    def add(self, rid: str, decode: int | None = None, running: bool = False) -> Request:
        req = Request(rid, list(SECRET_PROMPT), SamplingParams(max_tokens=8))
        self.streams[rid] = SimpleNamespace(request=req)
        if decode is not None:
            self.router.placements[rid] = self.workers[decode]
            if running:
                self.workers[decode].scheduler.running.append(SimpleNamespace(req=req))
        return req


def make_state(engine=None, **server) -> ServerState:
    state = ServerState(config_from_dict({"server": server}, check_devices=False))
    if engine is not None:
        state.engine, state.status = engine, "ready"
    return state


def run(state: ServerState, body, tick_s: float | None = None):
    async def main():
        app = create_app(state)
        if tick_s is not None and console.FEED in app:
            app[console.FEED].tick_s = tick_s
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def read_message(resp) -> dict:
    frame = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5)
    assert frame.startswith(b"data: ") and frame.count(b"\n") == 2, frame[:200]
    return json.loads(frame[6:])


# ---- the page -----------------------------------------------------------------------------------------------

class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.script_text = ""
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.script_text += data


def test_the_page_has_a_strict_csp_and_nothing_inline():
    state = make_state(FakeEngine())

    async def body(client):
        out = {}
        for path in ("/", "/console/console.js", "/console/console.css"):
            async with client.get(path) as r:
                out[path] = (r.status, dict(r.headers), await r.text())
        return out
    out = run(state, body)
    status, headers, html = out["/"]
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "frame-ancestors 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    tags = _Tags()
    tags.feed(html)
    scripts = [a for t, a in tags.tags if t == "script"]
    assert scripts == [{"src": "/console/console.js", "defer": None}] and not tags.script_text.strip()
    assert not any(t == "style" for t, _ in tags.tags)
    assert not any("style" in a or any(k.startswith("on") for k in a) for _, a in tags.tags)
    # Everything it loads is this server's: no CDN, no fonts, nothing fetched from elsewhere.
    for _, attrs in tags.tags:
        for key in ("src", "href"):
            if key in attrs:
                assert attrs[key].startswith(("/", "data:")), attrs
    status, headers, js = out["/console/console.js"]
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", js)
    assert "http://" not in js and "https://" not in js
    status, headers, css = out["/console/console.css"]
    assert status == 200 and headers["Content-Type"].startswith("text/css")
    assert "@import" not in css and "url(" not in css


# ---- the feed -----------------------------------------------------------------------------------------------

def test_the_feed_sends_history_then_only_what_is_new():
    engine = FakeEngine()
    for _ in range(3):
        engine.step(0, 128, 0)
        engine.step(1, 0, 4)
    engine.transfers[0].records.append((time.monotonic() - 0.02, time.monotonic() - 0.01, 4096))
    engine.changes.append([time.monotonic() - 5, "cpu:0", "prefill", "demand"])
    engine.add("req-1", decode=1, running=True)
    state = make_state(engine)

    async def body(client):
        async with client.get("/debug/events") as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
            first = await read_message(r)
            engine.step(1, 0, 5)
            engine.add("req-2")  # waiting in the router's queue
            del engine.streams["req-1"]  # finished
            engine.workers[1].scheduler.running.clear()
            second = await read_message(r)
            third = await read_message(r)
            return first, second, third
    first, second, third = run(state, body, tick_s=0.05)
    assert first["history"] and first["status"] == "ready" and first["model"] == "smollm2-135m-instruct"
    assert [d["name"] for d in first["devices"]] == ["cpu:0", "cpu:1"]
    dev = first["devices"][1]
    assert dev["role"] == "decode" and dev["running"] == 1 and dev["kv"] == {"pages": 100, "used": 10, "cached": 5,
                                                                             "free": 90}
    assert len(dev["steps"]) == 3 and dev["steps"][0][2:] == [0, 4]
    assert len(first["transfers"][0]["copies"]) == 1 and first["transfers"][0]["src"] == "cpu:0"
    assert first["role_changes"][0][1:] == ["cpu:0", "prefill", "demand"]
    row = first["requests"]["in_flight"][0]
    assert row["id"] == "req-1" and row["state"] == "decode" and row["decode"] == "cpu:1" and row["prompt"] == 2
    assert first["tiers"][0]["tier"] == "host" and "queue_full" in first["rejections"]
    assert first["slo"]["ttft_s"] == 2.5 and first["slo"]["admission"] == "off"
    # Then only the new step, no copy and no role change again.
    assert "history" not in second and second["seq"] == first["seq"] + 1
    assert [s[2:] for s in second["devices"][1]["steps"]] == [[0, 5]] and second["devices"][0]["steps"] == []
    assert second["transfers"][0]["copies"] == [] and second["role_changes"] == []
    rows = {q["id"]: q for q in second["requests"]["in_flight"]}
    assert rows["req-2"]["state"] == "waiting" and rows["req-2"]["prefill"] == "cpu:0"  # the one prefill device
    assert [q["id"] for q in second["requests"]["recent"]] == ["req-1"]
    assert second["requests"]["recent"][0]["state"] == "ended"
    assert third["devices"][1]["steps"] == []
    for msg in (first, second, third):  # never the prompt
        text = json.dumps(msg)
        assert str(SECRET_PROMPT[0]) not in text and str(SECRET_PROMPT[1]) not in text


def test_a_loading_server_feeds_its_status():
    state = make_state()  # no engine yet

    async def body(client):
        async with client.get("/debug/events") as r:
            return await read_message(r)
    msg = run(state, body, tick_s=0.05)
    assert msg["status"] == "loading" and "devices" not in msg


def test_newer_reads_a_ring_another_thread_appends_to_once_each_in_order():
    # Full from the start, so every append also drops the oldest and shifts every index.
    records: deque = deque((StepRecord(t - 0.5, t, 0, 1) for t in range(1, 2001)), maxlen=2000)
    stop = threading.Event()

    def appender():
        t = 2000.0
        while not stop.is_set():
            for _ in range(20):
                t += 1.0
                records.append(StepRecord(t - 0.5, t, 0, 1))
            time.sleep(0.0002)
    got, after = [], console._last_end(records, console._step_end)
    thread = threading.Thread(target=appender, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            new = console.newer(records, after, console._step_end)
            if new:
                got.extend(r.end for r in new)
                after = new[-1].end
    finally:
        stop.set()
        thread.join()
    got.extend(r.end for r in console.newer(records, after, console._step_end))
    assert len(got) > 1000
    # No record twice, in order, and none skipped (unless the ring dropped some before they could be read).
    assert got == sorted(set(got)) and got[0] == 2001.0
    assert sum(b - a != 1.0 for a, b in zip(got, got[1:])) <= len(got) // 100


def test_newer_uses_a_logs_own_lookup():
    class Log:
        def since(self, end, limit=None):
            return [r for r in (StepRecord(0, 1, 0, 1), StepRecord(1, 2, 0, 1)) if r.end > end][:limit]

    assert [r.end for r in console.newer(Log(), 1.0, console._step_end)] == [2]
    assert [r.end for r in console.window(Log(), 0.5, console._step_end, limit=1)] == [2]


# ---- access --------------------------------------------------------------------------------------------------

def _statuses(state, paths, headers=None):
    async def body(client):
        out = {}
        for path in paths:
            async with client.get(path, headers=headers or {}) as r:
                out[path] = r.status
        return out
    return run(state, body, tick_s=0.05)


def test_the_feed_needs_the_key_and_the_page_does_not():
    state = make_state(FakeEngine(), api_key="sekrit")
    assert _statuses(state, ["/", "/console/console.js", "/debug/events", "/debug/steps"]) == {
        "/": 200, "/console/console.js": 200, "/debug/events": 401, "/debug/steps": 401}
    assert _statuses(state, ["/debug/events"], KEY) == {"/debug/events": 200}
    assert _statuses(state, ["/debug/events"], {"Authorization": "Bearer wrong"}) == {"/debug/events": 401}


def test_open_console_opens_the_feed_only():
    state = make_state(FakeEngine(), api_key="sekrit", open_console=True)
    assert _statuses(state, ["/debug/events", "/debug/steps", "/debug/kv", "/v1/models"]) == {
        "/debug/events": 200, "/debug/steps": 401, "/debug/kv": 401, "/v1/models": 401}


@pytest.mark.parametrize("server, on", [
    ({"console": False}, False),
    ({"host": "0.0.0.0"}, False),                                    # reachable from the network, no key
    ({"host": "0.0.0.0", "console_public": True}, True),             # the operator's explicit choice
    ({"host": "0.0.0.0", "api_key": "sekrit"}, True),
    ({"host": "localhost"}, True),
])
def test_the_switches_turn_it_off(server, on):
    state = make_state(FakeEngine(), **server)
    got = _statuses(state, ["/", "/debug/events"], KEY if "api_key" in server else None)
    assert got == ({"/": 200, "/debug/events": 200} if on else {"/": 404, "/debug/events": 404})
    assert console.console_access(state.config, server.get("host", "127.0.0.1") != "0.0.0.0").enabled is on


def test_an_exposed_console_that_is_off_says_why(caplog):
    with caplog.at_level("WARNING", logger="nodeserve.server.console"):
        create_app(make_state(host="0.0.0.0"))
    assert "console (GET /) is off" in caplog.text and "console_public" in caplog.text


def test_the_console_keys_are_booleans_and_read_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="'server.console' must be true or false"):
        config_from_dict({"server": {"console": "yes"}}, check_devices=False)
    path = tmp_path / "n.toml"
    path.write_text("[server]\nopen_console = true\n")
    cfg = load_config(str(path), check_devices=False, environ={"NODESERVE_SERVER_CONSOLE": "false"})
    assert cfg.server.console is False and cfg.server.open_console is True and cfg.server.console_public is False


# ---- bounded: stalled clients, one producer ------------------------------------------------------------------

def test_a_stalled_client_is_dropped_and_its_queue_stays_bounded(monkeypatch, caplog):
    monkeypatch.setattr(console, "WRITE_TIMEOUT_S", 0.5)
    big = b"data: " + b"x" * 65_536 + b"\n\n"
    monkeypatch.setattr(console.Snapshots, "build", lambda self, history: (big, None))
    state = make_state(FakeEngine())

    async def body(client):
        feed = client.app[console.FEED]
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.setblocking(False)
        await loop.sock_connect(sock, (client.host, client.port))
        await loop.sock_sendall(sock, b"GET /debug/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        # ... and never read. Meanwhile the loop must keep turning and the client's queue stay small.
        start, max_gap, max_queued, subscribed, last = time.monotonic(), 0.0, 0, False, time.monotonic()
        while time.monotonic() - start < 10:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            max_gap, last = max(max_gap, now - last), now
            for c in feed.clients:
                subscribed = True
                max_queued = max(max_queued, len(c.queue))
                dropped = c.num_dropped
            if subscribed and not feed.clients:
                break
        elapsed = time.monotonic() - start
        sock.close()
        return subscribed, feed.clients, feed.running, max_queued, dropped, max_gap, elapsed
    with caplog.at_level("INFO", logger="nodeserve.server.console"):
        subscribed, clients, running, max_queued, dropped, max_gap, elapsed = run(state, body, tick_s=0.01)
    assert subscribed and not clients and not running  # dropped, and the producer stopped with it
    assert max_queued <= console.QUEUE_SIZE and dropped > 0
    assert elapsed < 8 and max_gap < 0.25, (elapsed, max_gap)
    assert "took no data" in caplog.text


def test_one_producer_for_every_client_and_none_once_they_leave():
    engine = FakeEngine()
    state = make_state(engine)

    async def body(client):
        feed = client.app[console.FEED]
        assert not feed.running
        resps = [await client.get("/debug/events") for _ in range(5)]
        msgs = [await read_message(r) for r in resps]
        producers = [t for t in asyncio.all_tasks() if t.get_name() == "console feed"]
        during = (feed.running, len(feed.clients), len(producers))
        ticks = feed.num_ticks
        for _ in range(3):
            await asyncio.gather(*(read_message(r) for r in resps))
        ticks = feed.num_ticks - ticks
        for r in resps:
            r.close()
        deadline = time.monotonic() + 3
        while (feed.clients or feed.running) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        after = (feed.running, len(feed.clients))
        resp = await client.get("/debug/events")  # and again, for a new console
        again = await read_message(resp)
        resp.close()
        return msgs, during, ticks, after, again
    msgs, during, ticks, after, again = run(state, body, tick_s=0.05)
    assert during == (True, 5, 1)
    assert all(m["history"] for m in msgs)
    assert 3 <= ticks <= 6  # three messages to each of five clients: one build per tick, not one per client
    assert after == (False, 0)
    assert again["history"]


def test_a_client_queue_drops_its_oldest():
    c = console.Client(size=3)
    for i in range(10):
        c.offer(bytes([i]))
    assert list(c.queue) == [bytes([7]), bytes([8]), bytes([9])] and c.num_dropped == 7

    async def drain():
        c.close()
        return [await c.next() for _ in range(4)]
    assert asyncio.run(drain()) == [bytes([7]), bytes([8]), bytes([9]), None]


def test_a_failing_update_is_logged_and_the_feed_goes_on(monkeypatch, caplog):
    calls = []
    real = console.Snapshots.build

    def flaky(self, history):
        calls.append(history)
        if len(calls) == 1:
            raise RuntimeError("a bug in the feed")
        return real(self, history)
    monkeypatch.setattr(console.Snapshots, "build", flaky)
    state = make_state(FakeEngine())

    async def body(client):
        async with client.get("/debug/events") as r:
            return await read_message(r)
    with caplog.at_level("ERROR", logger="nodeserve.server.console"):
        msg = run(state, body, tick_s=0.05)
    assert msg["history"] and len(calls) >= 2 and "building an update failed" in caplog.text


def test_slo_attainment_per_minute_and_predictions():
    state = make_state(FakeEngine())
    snaps = console.Snapshots(state)
    now = time.monotonic()
    # (ended, ttft, tpot, predicted ttft, ttft target): targets 2.5 s and 100 ms by default
    snaps.slo_samples.extend([(now - 400, 0.1, 0.01, 0.1, 2.5),  # outside the 5 minutes
                              (now - 200, 0.1, None, None, 2.5), (now - 90, 0.5, 0.2, 0.6, 2.5),
                              (now - 1, 3.0, 0.05, None, 2.5), (now, 0.5, 0.05, 0.4, 2.5)])
    slo = snaps._slow(state.engine, now)["slo"]
    assert (slo["requests"], slo["met"], slo["met_ttft"], slo["met_tpot"]) == (4, 2, 3, 3)
    assert slo["minutes"] == [[0, 0], [1, 1], [0, 0], [1, 0], [2, 1]]
    assert slo["predicted"] == [[0.6, 0.5], [0.4, 0.5]]
