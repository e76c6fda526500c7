"""Faults injected into a real server from outside, each asserted the same way: the server keeps answering, no
page or seat is held once it drains, nothing is served wrong (a greedy completion is the same before and after),
and a metric and one log line say what happened.

- a KV-event subscriber that never reads (beside a healthy one, which must get every batch);
- a flood of replay requests from 100 peers that never read their answers;
- the event loop blocked for 1 s (SIGUSR1 to block_loop.py's server: a time.sleep on the loop)."""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import os
import signal
import threading
import time

import msgspec
import openai
import pytest
import zmq

from nodeserve.kv.events import BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PROMPT = "The capital of France is"


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(server) -> str:
    return _client(server).completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


_round = itertools.count()


def _traffic(server, num: int = 6, max_tokens: int = 24) -> None:
    """num concurrent requests with prompts never seen before (new pages, so new events) decoding max_tokens each."""
    r = next(_round)

    def one(i: int) -> int:
        i += 1000 * r
        prompt = f"Story {i}: " + " ".join(f"the {w} walked to town {i}" for w in ("cat", "dog", "owl", "fox", "bee"))
        reply = _client(server).completions.create(model="smollm2", prompt=prompt,  # ~40 tokens: pages to publish
                                                   max_tokens=max_tokens, temperature=0.8, seed=i,
                                                   extra_body={"ignore_eos": True})
        return reply.usage.completion_tokens
    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        assert list(pool.map(one, range(num))) == [max_tokens] * num


def _counter(metrics: str, name: str, **labels) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_drained(server, timeout: float = 30.0) -> None:
    """No page or seat held: every pool's pages free (cached ones count as free), nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        kv = server.get("/debug/kv")
        pools = kv["pools"]
        whole = all(p["num_free"] == p["num_pages"] and p["num_running"] == 0 and p["num_waiting"] == 0
                    for p in pools) and kv["num_pending"] == 0
        if whole:
            return
        assert time.monotonic() < deadline, f"held after drain: {pools}"
        time.sleep(0.1)


class Healthy(threading.Thread):
    """A subscriber that reads every batch as it comes (its own thread owns its socket)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        super().__init__(daemon=True)
        self.ctx, self.endpoint, self.seqs = ctx, endpoint, []
        self.stop, self.joined = threading.Event(), threading.Event()

    def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(self.endpoint)
        while not self.stop.is_set():
            if sub.poll(20):
                self.seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                self.joined.set()
        sub.close(0)

    def gaps(self) -> int:
        return sum(b != a + 1 for a, b in zip(self.seqs, self.seqs[1:]))


def _replay(ctx: zmq.Context, endpoint: str, start: int, batches: list | None = None) -> list[int]:
    """The sequence numbers a replay from `start` returns before its end marker; their batches into `batches`."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    seqs = []
    try:
        while dealer.poll(10_000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(seq, "big"))
            if batches is not None:
                batches.append(msgspec.msgpack.decode(payload, type=KVEventBatch))
        raise AssertionError(f"no end marker after {len(seqs)} batches")
    finally:
        dealer.close(0)


@pytest.fixture(scope="module")
def baseline(fault_server):
    return _greedy(fault_server)


def test_a_subscriber_that_never_reads_loses_only_its_own_batches(fault_server, baseline):
    s = fault_server
    ctx = zmq.Context()
    healthy = Healthy(ctx, s.events)
    healthy.start()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"kv@")
    stalled.connect(s.events)
    try:
        _traffic(s, num=2, max_tokens=8)  # both join
        assert healthy.joined.wait(10) and stalled.poll(5000)
        stalled.recv_multipart()
        before = s.get("/debug/kv")["kv_events"]["num_dropped_batches"]
        for _ in range(4):  # until the stalled peer's buffers are full and it starts losing batches
            _traffic(s, num=2, max_tokens=8)
            if s.get("/debug/kv")["kv_events"]["num_dropped_batches"] > before:
                break
        events = s.get("/debug/kv")["kv_events"]
        assert events["num_dropped_batches"] > before, events
        time.sleep(0.5)  # quiet: the last batches delivered
        events = s.get("/debug/kv")["kv_events"]
        first, last = healthy.seqs[0], events["num_batches"] - 1
        assert healthy.seqs == list(range(first, last + 1)) and healthy.gaps() == 0  # every batch, in order
        got = []
        while stalled.poll(300):
            got.append(int.from_bytes(stalled.recv_multipart()[1], "big"))
        assert len(got) < last - first  # the stalled one lost batches...
        missing = sorted(set(range(got[0], last + 1)) - set(got))
        assert missing and set(missing) <= set(_replay(ctx, s.replay, missing[0]))  # ...and replay has them
        metrics = s.metrics()
        assert _counter(metrics, "nodeserve:kv_events_dropped_batches_total") == events["num_dropped_batches"]
        assert len(re.findall("a subscriber is at its high-water mark", s.full_log())) == 1
        assert _greedy(s) == baseline
        _assert_drained(s)
    finally:
        healthy.stop.set()
        healthy.join(5)
        ctx.destroy(0)


def _flood(ctx: zmq.Context, endpoint: str, stop: threading.Event, sent: list[int]) -> None:
    dealers = []
    for _ in range(100):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.SNDHWM, 1_000_000)
        d.connect(endpoint)
        dealers.append(d)
    while not stop.is_set():
        for d in dealers:
            try:
                d.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                pass
        time.sleep(0.002)
    for d in dealers:
        d.close(0)


def test_a_replay_flood_never_stops_live_delivery(fault_server, baseline):
    s = fault_server
    ctx = zmq.Context()
    healthy = Healthy(ctx, s.events)
    healthy.start()
    stop, sent = threading.Event(), [0]
    flood = threading.Thread(target=_flood, args=(ctx, s.replay, stop, sent), daemon=True)
    try:
        _traffic(s, num=2, max_tokens=8)
        assert healthy.joined.wait(10)
        refused_before = _counter(s.metrics(), "nodeserve:kv_events_replays_refused_total")
        flood.start()
        time.sleep(0.5)
        _traffic(s, num=4, max_tokens=16)  # live batches during the flood
        assert _greedy(s) == baseline
        stop.set()
        flood.join(10)
        time.sleep(0.5)
        last = s.get("/debug/kv")["kv_events"]["num_batches"] - 1
        assert healthy.gaps() == 0 and healthy.seqs[-1] == last  # every live batch arrived
        assert sent[0] > 1000
        refused = _counter(s.metrics(), "nodeserve:kv_events_replays_refused_total")
        assert refused > refused_before
        assert len(re.findall("replay requests refused", s.full_log())) == 1
        time.sleep(0.6)
        batches: list[KVEventBatch] = []
        assert _replay(ctx, s.replay, 0, batches) == list(range(last + 1))  # replay serves again, in full
        stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] for e in stored)  # by default no event carries a user's text
        assert s.get("/debug/kv")["kv_events"]["endpoint"] == s.events  # bound on server.host, 127.0.0.1
        _assert_drained(s)
    finally:
        stop.set()
        healthy.stop.set()
        healthy.join(5)
        ctx.destroy(0)


def test_an_event_loop_blocked_for_a_second(fault_server, baseline):
    s = fault_server
    stalls_before = _counter(s.metrics(), "nodeserve:event_loop_stalls_total")
    client = _client(s)
    pieces, started = [], threading.Event()

    def stream():
        for chunk in client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            started.set()
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    s.proc.send_signal(signal.SIGUSR1)  # the loop sleeps for 1 s mid-stream
    t0 = time.monotonic()
    t.join(60)
    assert "".join(pieces) == baseline  # the stream finished, and with the right text
    assert s.get("/health")["status"] == "ready"
    time.sleep(0.2)
    metrics = s.metrics()
    assert _counter(metrics, "nodeserve:event_loop_stalls_total") >= stalls_before + 1, time.monotonic() - t0
    stalls = [l for l in s.full_log().splitlines() if re.search(r"event loop stalled (9\d\d|1\d\d\d) ms", l)]
    assert len(stalls) == 1, stalls  # one line for the one long stall (a busy CI machine may add short ones)
    _assert_drained(s)


def test_fuzzed_requests_get_no_5xx_and_leave_nothing_held(fault_server):
    """bench/fuzz_http.py, seeded and short: malformed request lines, paths and headers on raw sockets, mutated
    JSON on every route; every answer below 500, every well-formed request answered, then a normal completion
    and no page held. (The 10,000-request run is the benchmark's: bench/results/fuzz-http.json.)"""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "fuzz_http.py")
    spec = importlib.util.spec_from_file_location("nodeserve_bench_fuzz_http", path)
    fuzz_http = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz_http)
    result = fuzz_http.fuzz(fault_server.url, 600, 8, seed=7)
    assert result["passed"], result
    statuses = result["statuses"]
    assert statuses.get("http 200", 0) > 0 and statuses.get("http 400", 0) > 0 and statuses.get("raw 400", 0) > 0
