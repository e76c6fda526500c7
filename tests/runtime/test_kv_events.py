"""The KV-event publisher on real ZMQ sockets: vLLM's framing (topic, 8-byte sequence number, msgpack batch),
AllBlocksCleared first, replay of buffered batches from a sequence number, batches past a subscriber's
high-water mark dropped and counted (never blocking) and recovered through replay, and a clear start-up error
for an address in use."""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq

from nodeserve.config import KVEventsSection
from nodeserve.kv.events import AllBlocksCleared, BlockStored, KVEventBatch, KVEventLog
from nodeserve.runtime.kv_events import (BATCH_INTERVAL_MS, END_SEQ, REPLAY_MIN_INTERVAL_S, KVEventPublisher,
                                          resolve_endpoint)

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(hwm: int = 1000, buffer_steps: int = 1000, interval_ms: float = BATCH_INTERVAL_MS,
               max_events: int = 100_000) -> tuple[KVEventPublisher, str, str]:
    """A publisher that connects to a subscriber's address (vLLM's rule for an address without * or ::, which
    keeps every socket here on 127.0.0.1) and binds its replay socket."""
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    settings = KVEventsSection(enabled=True, endpoint=pub, replay_endpoint=replay, hwm=hwm, buffer_steps=buffer_steps)
    p = KVEventPublisher(settings, "kv@127.0.0.1:8000@m", KVEventLog(16, include_tokens=True, max_events=max_events),
                         interval_ms=interval_ms)
    p.start()
    while p.num_batches == 0:  # AllBlocksCleared numbered: every later event makes batches of its own
        time.sleep(0.001)
    return p, pub, replay


def _subscriber(ctx: zmq.Context, endpoint: str, rcvhwm: int = 1000) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(endpoint)
    return sub


def _wait_subscribed(p: KVEventPublisher, sub: zmq.Socket) -> int:
    """Publishes probes until the subscriber gets one (a SUB socket joins asynchronously); returns the next seq."""
    for _ in range(200):
        p.events.sink("probe").removed([b"\x00" * 16])
        if sub.poll(50):
            while sub.poll(50):
                _, seq, _ = sub.recv_multipart()
            return int.from_bytes(seq, "big") + 1
    raise AssertionError("the subscriber never joined")


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            dealer.close(0)
            return out
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    raise AssertionError("no end-of-replay marker")


def test_batches_carry_the_topic_a_sequence_number_and_vllms_batch_and_replay_from_any_point():
    p, pub, replay = _publisher()
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub)
        seq = _wait_subscribed(p, sub)
        p.events.sink("cpu:0").stored([b"\x01" * 16], None, list(range(16)))
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"kv@127.0.0.1:8000@m" and int.from_bytes(seq_bytes, "big") == seq
        (event,) = DECODE.decode(payload).events
        assert event == BlockStored([0x0101010101010101], None, list(range(16)), 16, None, "cpu:0", None)
        batches = _replay(ctx, replay, 0)
        assert [s for s, _ in batches] == list(range(seq + 1))  # every batch since the start, in order
        assert batches[0][1].events[0] == AllBlocksCleared() and batches[0][1].data_parallel_rank == 0
        assert _replay(ctx, replay, seq + 5) == []  # nothing yet from there: just the end marker
    finally:
        p.stop()
        ctx.destroy(0)


def test_the_replay_buffer_keeps_exactly_the_last_buffer_steps_batches():
    # It used to grow to 2 x buffer_steps before each trim: a sawtooth of megabytes that read as creep in soaks.
    p, pub, replay = _publisher(buffer_steps=50, interval_ms=1)
    ctx = zmq.Context()
    try:
        sink = p.events.sink("cpu:0")
        for i in range(120):
            sink.removed([i.to_bytes(8, "big") + b"\x00" * 8])
            target = p.num_batches + 1
            while p.num_batches < target:  # one batch each
                time.sleep(0.001)
            assert len(p._buffer) == min(p.num_batches, 50)
        batches = _replay(ctx, replay, 0)  # from a trimmed point: the oldest kept on
        assert [s for s, _ in batches] == list(range(p.num_batches - 50, p.num_batches))
    finally:
        p.stop()
        ctx.destroy(0)


def test_batches_past_the_high_water_mark_are_dropped_counted_and_replayed():
    p, pub, replay = _publisher(hwm=2)
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub, rcvhwm=2)
        first = _wait_subscribed(p, sub)
        big = list(range(16)) * 4096  # 64k tokens a batch: the socket buffers fill after a few
        sink = p.events.sink("cpu:1")
        deadline = time.monotonic() + 30
        sent = 0
        while p.num_dropped_batches == 0 and time.monotonic() < deadline:  # the subscriber reads nothing meanwhile
            sink.stored([sent.to_bytes(8, "big") + b"\x00" * 8], None, big)
            sent += 1
            time.sleep(0.012)  # about one batch per interval
        assert p.num_dropped_batches > 0, "nothing was dropped"
        time.sleep(0.05)
        seen, gaps = [], 0
        while sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seen and seq != seen[-1] + 1:
                gaps += 1
            seen.append(seq)
        assert gaps > 0 or seen[-1] < p.num_batches - 1  # the subscriber can tell a batch is missing
        recovered = {s: b for s, b in _replay(ctx, replay, first)}
        stored = [e.block_hashes[0] for s in range(first, p.num_batches) for e in recovered[s].events
                  if isinstance(e, BlockStored)]
        assert stored == list(range(sent))  # with replay, every event arrives, in order
    finally:
        p.stop()
        ctx.destroy(0)


def test_an_address_in_use_fails_the_start_with_its_reason():
    p, pub, replay = _publisher()
    try:
        clash = KVEventPublisher(KVEventsSection(enabled=True, endpoint=pub, replay_endpoint=replay), "t",
                                 KVEventLog(16))
        with pytest.raises(RuntimeError, match=f"cannot open {pub} / {replay}: Address already in use"):
            clash.start()
    finally:
        p.stop()


def test_the_default_address_is_server_hosts_interface_and_a_wildcard_is_warned_about(caplog):
    assert resolve_endpoint("", "127.0.0.1") == ("tcp://127.0.0.1:5557", True)
    assert resolve_endpoint("", "::1") == ("tcp://[::1]:5557", True)
    assert resolve_endpoint("", "0.0.0.0") == ("tcp://*:5557", True)
    assert resolve_endpoint("tcp://router:5557", "127.0.0.1") == ("tcp://router:5557", False)  # vLLM's rule
    assert resolve_endpoint("tcp://*:6000", "127.0.0.1") == ("tcp://*:6000", True)
    assert resolve_endpoint("", "10.0.0.5", 6001) == ("tcp://10.0.0.5:6001", True)
    port = _port()
    ctx = zmq.Context()
    p = KVEventPublisher(KVEventsSection(enabled=True, port=port), "kv@t", KVEventLog(16), "127.0.0.1")
    caplog.set_level(logging.WARNING, logger="nodeserve.runtime.kv_events")
    p.start()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")  # bound, on 127.0.0.1: a subscriber connects to it
        for i in range(200):  # a SUB joins asynchronously: probes until one arrives
            p.events.sink("probe").removed([b"\x00" * 16])
            if sub.poll(50):
                break
        assert sub.recv_multipart()[0] == b"kv@t"
    finally:
        p.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    wild = KVEventPublisher(KVEventsSection(enabled=True, endpoint=f"tcp://*:{_port()}"), "kv@t", KVEventLog(16))
    wild.start()
    wild.stop()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "every interface" in line and "unauthenticated" in line
    ctx.destroy(0)


def _batch(p: KVEventPublisher, sink, n: int, tokens=()) -> None:
    """Appends one event (hash n) and waits until the publisher has numbered it as a batch of its own."""
    before = p.num_batches
    sink.stored([n.to_bytes(8, "big") + b"\x00" * 8], None, tokens)
    deadline = time.monotonic() + 10
    while p.num_batches == before:
        assert time.monotonic() < deadline, "the publisher numbered nothing"
        time.sleep(0.0002)


class _Reader(threading.Thread):
    """A healthy subscriber: reads every batch as it comes, on its own thread (which owns its socket)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        super().__init__(daemon=True)
        self.ctx, self.endpoint, self.seqs, self.times = ctx, endpoint, [], []
        self.stop = threading.Event()
        self.joined = threading.Event()

    def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(self.endpoint)
        while not self.stop.is_set():
            if sub.poll(20):
                _, seq, _ = sub.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.times.append(time.monotonic())
                self.joined.set()
        sub.close(0)


def test_a_stalled_subscriber_loses_its_own_batches_never_a_healthy_ones():
    """Over TCP, with small buffers and high-water marks on both sides, so the stalled peer's kernel buffers fill
    in seconds (against the real server they hid it for hours)."""
    port = _port()
    replay = f"tcp://127.0.0.1:{_port()}"
    p = KVEventPublisher(KVEventsSection(enabled=True, port=port, replay_endpoint=replay, hwm=4, buffer_steps=1000),
                         "kv@t",
                         KVEventLog(16, include_tokens=True), "127.0.0.1", interval_ms=2)
    p.start()
    ctx = zmq.Context()
    healthy = _Reader(ctx, f"tcp://127.0.0.1:{port}")
    healthy.start()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 4)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"kv@")
    stalled.connect(f"tcp://127.0.0.1:{port}")
    sink = p.events.sink("cpu:0")
    try:
        for i in range(400):  # probes until both have joined
            _batch(p, sink, i)
            if healthy.joined.is_set() and stalled.poll(20):
                break
        while stalled.poll(50):
            stalled.recv_multipart()
        first, n = p.num_batches, 200
        big = [70_000] * 65_536  # ~330 kB a batch: the stalled peer's buffers fill after a few dozen
        for i in range(n):
            _batch(p, sink, 1000 + i, big)
        deadline = time.monotonic() + 30
        while len([s for s in healthy.seqs if s >= first]) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s for s in healthy.seqs if s >= first] == list(range(first, first + n))  # every one, in order
        assert p.num_dropped_batches > 0  # the stalled one lost some: counted
        got = []
        while stalled.poll(500):
            got.append(int.from_bytes(stalled.recv_multipart()[1], "big"))
        assert len([s for s in got if s >= first]) < n  # ...and can tell: a gap
        recovered = [s for s, _ in _replay(ctx, replay, first)]
        assert recovered[:n] == list(range(first, first + n))  # replay has every batch it lost
    finally:
        healthy.stop.set()
        healthy.join(5)
        p.stop()
        ctx.destroy(0)


def test_a_replay_of_5000_batches_delivers_every_one_then_the_end_marker():
    p, pub, replay = _publisher(buffer_steps=6000, interval_ms=1)
    ctx = zmq.Context()
    try:
        sink = p.events.sink("cpu:0")
        for i in range(5000):
            _batch(p, sink, i)
        total = p.num_batches
        assert total == 5001  # AllBlocksCleared, then the 5,000
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
        else:
            raise AssertionError(f"no end marker after {len(seqs)} batches")
        assert seqs == list(range(total))
        dealer.close(0)
    finally:
        p.stop()
        ctx.destroy(0)


def _flood(ctx: zmq.Context, endpoint: str, stop: threading.Event, sent: list[int]) -> None:
    """Replay requests from 0 as fast as they go, from 200 peers that never read an answer."""
    dealers = []
    for _ in range(200):
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
        time.sleep(0.001)
    for d in dealers:
        d.close(0)


@pytest.mark.slow
def test_a_flood_of_replay_requests_never_delays_live_batches():
    p, pub, replay = _publisher(buffer_steps=3000, interval_ms=1)
    ctx = zmq.Context()
    sub = _subscriber(ctx, pub, rcvhwm=100_000)
    try:
        _wait_subscribed(p, sub)
        sink = p.events.sink("cpu:0")
        for i in range(2000):  # a full buffer: every request asks for 2,000 batches
            _batch(p, sink, i)
        while sub.poll(100):
            sub.recv_multipart()
        stop, sent = threading.Event(), [0]
        flood = threading.Thread(target=_flood, args=(ctx, replay, stop, sent), daemon=True)
        flood.start()
        time.sleep(0.5)
        delays = []
        for i in range(100):  # live batches during the flood, each timed from append to arrival
            t0 = time.monotonic()
            sink.stored([(10_000 + i).to_bytes(8, "big") + b"\x00" * 8])
            assert sub.poll(5000), f"live batch {i} never came"
            sub.recv_multipart()
            delays.append(time.monotonic() - t0)
            time.sleep(0.01)
        stop.set()
        flood.join(10)
        assert sent[0] > 10_000, sent  # it was a flood
        assert p.num_replays_refused > 0 and p.num_replays <= 200 * 10  # rate-limited per peer
        delays.sort()
        assert delays[-1] < 1.0, delays[-5:]  # live delivery never waited on the flood (before: never came in 5 s)
        first = p.num_batches - 10  # and once it is over, replay serves a fresh peer in full
        time.sleep(REPLAY_MIN_INTERVAL_S)
        assert [s for s, _ in _replay(ctx, replay, first)] == list(range(first, p.num_batches))
    finally:
        p.stop()
        ctx.destroy(0)


def test_stop_leaves_a_busy_threads_sockets_to_that_thread():
    p, pub, replay = _publisher()
    thread = p._thread
    with p.events._lock:  # the publisher's thread is stuck taking events
        p.stop(timeout=0.1)
        assert thread.is_alive()
        assert p._pub is not None and not p._pub.closed  # nobody closed them under its feet
    thread.join(5)
    assert not thread.is_alive() and p._pub is None and p._ctx is None  # it closed them itself


def test_an_overflowing_event_log_is_counted_and_shows_as_a_gap_replay_cannot_fill():
    log = KVEventLog(16, max_events=5)
    for i in range(8):
        log.sink("d").removed([bytes([i]) * 16])
    events, lost = log.take_batch()
    assert len(events) == 5 and lost == 3 and log.num_dropped == 3
    assert log.take_batch() == ([], 0)
    p, pub, replay = _publisher(max_events=5)
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub)
        first = _wait_subscribed(p, sub)
        with p.events._lock:  # the publisher falls behind: the log fills meanwhile
            p.events._events += [AllBlocksCleared()] * 5
        for i in range(3):
            p.events.sink("d").removed([bytes([i]) * 16])
        time.sleep(0.1)
        p.events.sink("d").removed([b"\x09" * 16])  # the next batch shows the gap before it
        time.sleep(0.1)
        seqs = []
        while sub.poll(200):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert p.num_lost_events == 3 and p.stats()["num_lost_events"] == 3
        assert seqs and seqs[-1] > first + len(seqs) - 1  # a sequence number no one got: the gap shows
        assert len([s for s, _ in _replay(ctx, replay, first)]) == len(seqs)  # replay cannot fill it either
    finally:
        p.stop()
        ctx.destroy(0)


def test_a_dead_subscriber_holds_at_most_the_replay_buffer_by_default():
    # The publisher queues up to `hwm` batches for a subscriber that never reads. Past `buffer_steps` behind, replay
    # cannot catch it up anyway, so the default queues no more than that: vLLM's 100,000 let one dead subscriber
    # grow the server by ~44 MB in the one-hour soak (docs/security.md).
    defaults = KVEventsSection()
    assert defaults.hwm <= defaults.buffer_steps
