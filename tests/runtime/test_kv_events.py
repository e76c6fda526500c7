"""The KV-event publisher on real ZMQ sockets: vLLM's framing (topic, 8-byte sequence number, msgpack batch),
AllBlocksCleared first, replay of buffered batches from a sequence number, batches past a subscriber's
high-water mark dropped and counted (never blocking) and recovered through replay, and a clear start-up error
for an address in use."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from nodeserve.config import KVEventsSection
from nodeserve.kv.events import AllBlocksCleared, BlockStored, KVEventBatch, KVEventLog
from nodeserve.runtime.kv_events import END_SEQ, KVEventPublisher

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(hwm: int = 1000, buffer_steps: int = 1000) -> tuple[KVEventPublisher, str, str]:
    """A publisher that connects to a subscriber's address (vLLM's rule for an address without * or ::, which
    keeps every socket here on 127.0.0.1) and binds its replay socket."""
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    settings = KVEventsSection(enabled=True, endpoint=pub, replay_endpoint=replay, hwm=hwm, buffer_steps=buffer_steps)
    p = KVEventPublisher(settings, "kv@127.0.0.1:8000@m", KVEventLog(16))
    p.start()
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
