"""KVEventPublisher: sends the node's KV events to routers over ZMQ, in vLLM's framing, from its own thread.

Wire format (vLLM's ZmqEventPublisher): each batch is a multipart message (topic, 8-byte big-endian sequence
number, msgpack EventBatch); sequence numbers start at 0 and count every batch, sent or dropped. A ROUTER socket,
when configured, answers a request (identity, b"", 8-byte start sequence number) with every batch still buffered
from that number on, each as (identity, b"", seq, payload), then (identity, b"", -1 as 8 signed bytes, b"").

The PUB side is an XPUB socket with XPUB_NODROP: a plain PUB socket discards silently past its high-water mark,
so nobody would know a batch was lost. Here a send that would exceed it fails at once (the thread never blocks),
the batch is counted as dropped and stays in the replay buffer, and the subscriber sees the gap in the sequence
numbers and asks for it again. Workers never wait on any of this: they only append to the KVEventLog.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from nodeserve.config import KVEventsSection
from nodeserve.kv.events import EventBatch, KVEventLog

log = logging.getLogger(__name__)

BATCH_INTERVAL_MS = 10  # events gathered into one batch; also how often replay requests are looked at
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def default_topic(host: str, port: int, model: str) -> str:
    return f"kv@{host}:{port}@{model}"


class KVEventPublisher:
    def __init__(self, settings: KVEventsSection, topic: str, events: KVEventLog):
        self.settings, self.topic, self.events = settings, topic, events
        self.num_batches = 0          # batches numbered (sent or dropped)
        self.num_events = 0
        self.num_dropped_batches = 0  # past a subscriber's high-water mark: replay has them
        self.num_replays = 0
        self._buffer: list[tuple[int, bytes]] = []  # (seq, payload), the last buffer_steps batches
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Opens the sockets here, so a bad address or a port in use fails the start-up with its reason; from
        then on only the publisher's thread touches them (ZMQ sockets are not thread-safe)."""
        s = self.settings
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.SNDHWM, s.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if "*" in s.endpoint or "::" in s.endpoint or s.endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(s.endpoint)
            else:  # vLLM's convention: a subscriber that binds (llm-d's indexer) is connected to
                self._pub.connect(s.endpoint)
            if s.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(s.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise RuntimeError(f"KV events: cannot open {s.endpoint}"
                               f"{' / ' + s.replay_endpoint if s.replay_endpoint else ''}: {e}") from None
        self.events.cleared()  # a (re)started node holds nothing: subscribers drop what they knew of it
        self._thread = threading.Thread(target=self._run, name="kv events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (topic %r)%s", s.endpoint, self.topic,
                 f", replay on {s.replay_endpoint}" if s.replay_endpoint else "")

    def stop(self, timeout: float = 2.0) -> None:
        """Sends what is pending, then closes the sockets."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout)
        self._thread = None
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)  # subscription messages: read so they do not pile up
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic, max_buffered = self.topic.encode(), self.settings.buffer_steps
        while True:
            stopping = self._stopping.is_set()
            try:
                ready = dict(poller.poll(0 if stopping else BATCH_INTERVAL_MS))
                while self._pub in ready and self._pub.poll(0):
                    self._pub.recv(zmq.NOBLOCK)
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                events = self.events.take()
                if events:
                    seq = self.num_batches
                    payload = encode(EventBatch(time.time(), events, 0))
                    self.num_batches, self.num_events = seq + 1, self.num_events + len(events)
                    self._buffer.append((seq, payload))
                    if len(self._buffer) > 2 * max_buffered:  # trimmed in steps: amortized O(1) per batch
                        del self._buffer[:-max_buffered]
                    try:
                        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                    except zmq.Again:
                        self.num_dropped_batches += 1
            except zmq.ZMQError as e:  # a socket fault must not end the thread: later batches still go out
                log.warning("KV events: %s", e)
                time.sleep(BATCH_INTERVAL_MS / 1000)
            if stopping:
                return

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a replay request of %d frames ignored (want identity, b'', 8-byte seq)",
                            len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.num_replays += 1
            # ROUTER drops a reply to a peer past its high-water mark; it never blocks this thread.
            for seq, payload in self._buffer[-self.settings.buffer_steps:]:
                if seq >= start:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def stats(self) -> dict:
        return {"topic": self.topic, "num_batches": self.num_batches, "num_events": self.num_events,
                "num_dropped_batches": self.num_dropped_batches, "num_replays": self.num_replays}
