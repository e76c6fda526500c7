"""KVEventPublisher: sends the node's KV events to routers over ZMQ, in vLLM's framing, from its own thread.

Wire format (vLLM's ZmqEventPublisher): each batch is a multipart message (topic, 8-byte big-endian sequence
number, msgpack EventBatch); sequence numbers start at 0 and count every batch, sent or dropped. A ROUTER socket,
when configured, answers a request (identity, b"", 8-byte start sequence number) with every batch still buffered
from that number on, each as (identity, b"", seq, payload), then (identity, b"", -1 as 8 signed bytes, b"").

Isolation: the PUB side is an XPUB socket. Each send first tries with XPUB_NODROP (it fails if any subscriber is
at its high-water mark), so the publisher knows when someone is behind; it then sends again without it, which
libzmq delivers to every subscriber with room and drops for the full ones only. A stalled subscriber thus loses
its own batches (counted, still in the replay buffer), never anyone else's, and the thread never blocks.

Replay is paced: each request becomes a cursor sent a chunk per tick, on a ROUTER with ROUTER_MANDATORY (a peer
whose queue is full is skipped until it reads, instead of libzmq silently dropping the rest and the end marker).
Requests are rate-limited per peer and in number, and each tick does a bounded amount of replay work after the
live batch, so a flood of requests never delays live delivery. Workers never wait on any of this: they only
append to the KVEventLog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from nodeserve.config import KVEventsSection
from nodeserve.kv.events import EventBatch, KVEventLog

log = logging.getLogger(__name__)

BATCH_INTERVAL_MS = 10  # events gathered into one batch; also how often replay requests are looked at
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAYS = 8                    # replays under way at once; a request past it gets the end marker alone
REPLAY_CHUNK = 256                 # batches a replay sends per tick: 5,000 batches take ~20 ticks
MAX_REQUESTS_PER_TICK = 64         # replay requests read per tick; the rest wait in the socket (RCVHWM bounds them)
REPLAY_MIN_INTERVAL_S = 0.5        # per peer: a second request sooner is refused (end marker alone)
REPLAY_STALL_S = 30.0              # a replay whose peer reads nothing for this long is abandoned
WARN_EVERY_S = 60.0                # one log line per kind of trouble per minute at most
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def default_topic(host: str, port: int, model: str) -> str:
    return f"kv@{host}:{port}@{model}"


def resolve_endpoint(endpoint: str, server_host: str, port: int = 5557) -> tuple[str, bool]:
    """(address, bind) of the PUB socket. "" (the default): bound on server.host's interface, on `port`, so a
    server on 127.0.0.1 publishes on 127.0.0.1 only. An explicit address keeps vLLM's rule: bound if it has * or
    :: (or is ipc/inproc), else connected to a subscriber that binds (llm-d's indexer)."""
    if not endpoint:
        host = server_host if server_host not in ("", "0.0.0.0") else "*"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{port}", True
    return endpoint, "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_wildcard(address: str) -> bool:
    """A tcp address bound on every interface."""
    if not address.startswith("tcp://"):
        return False
    return address[len("tcp://"):].rsplit(":", 1)[0] in WILDCARD_HOSTS


@dataclass
class _Replay:
    """One peer's replay under way: batches next_seq..end_seq-1, then the end marker."""
    identity: bytes
    next_seq: int
    end_seq: int
    last_progress: float


class KVEventPublisher:
    def __init__(self, settings: KVEventsSection, topic: str, events: KVEventLog, server_host: str = "127.0.0.1",
                 interval_ms: float = BATCH_INTERVAL_MS):
        self.settings, self.topic, self.events, self.interval_ms = settings, topic, events, interval_ms
        self.endpoint, self.bind = resolve_endpoint(settings.endpoint, server_host, settings.port)
        self.num_batches = 0          # batches numbered (sent, dropped, or lost in an overflowing log)
        self.num_events = 0
        self.num_dropped_batches = 0  # batches at least one subscriber lost at its high-water mark: replay has them
        self.num_replays = 0          # replay requests taken on
        self.num_replays_refused = 0  # answered with the end marker alone: rate limit, or too many at once
        self.num_replays_abandoned = 0  # their peer stopped reading (or left) before the end
        self.num_lost_events = 0      # dropped by the event log itself: its consumer fell behind
        # payloads of the last buffer_steps batches, None: a batch lost in the log. A deque with maxlen, not a list
        # trimmed in steps: its size is flat once full, where the list's sawtooth (1x-2x) read as RSS creep in soaks
        self._buffer: deque[bytes | None] = deque(maxlen=settings.buffer_steps)
        self._replays: dict[bytes, _Replay] = {}
        self._last_request: dict[bytes, float] = {}
        self._last_warned: dict[str, float] = {}
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Opens the sockets here, so a bad address or a port in use fails the start-up with its reason; from
        then on only the publisher's thread touches them, and closes them (ZMQ sockets are not thread-safe)."""
        s = self.settings
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.SNDHWM, s.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if s.sndbuf:
                self._pub.setsockopt(zmq.SNDBUF, s.sndbuf)
            if "[" in self.endpoint or self.endpoint.count(":") > 2:
                self._pub.setsockopt(zmq.IPV6, 1)
            (self._pub.bind if self.bind else self._pub.connect)(self.endpoint)
            if s.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer: EAGAIN, not a silent drop
                if "[" in s.replay_endpoint or s.replay_endpoint.count(":") > 2:
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(s.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise RuntimeError(f"KV events: cannot open {self.endpoint}"
                               f"{' / ' + s.replay_endpoint if s.replay_endpoint else ''}: {e}") from None
        self.events.cleared()  # a (re)started node holds nothing: subscribers drop what they knew of it
        self._thread = threading.Thread(target=self._run, name="kv events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (%s, topic %r)%s", self.endpoint, "bound" if self.bind else "connected",
                 self.topic, f", replay on {s.replay_endpoint}" if s.replay_endpoint else "")
        wild = [a for a in (self.endpoint if self.bind else "", s.replay_endpoint) if is_wildcard(a)]
        if wild:
            log.warning("KV events listen on every interface (%s), unauthenticated: anyone who can reach them "
                        "learns which prefixes this node caches%s; bind them to one interface or firewall them "
                        "(docs/security.md)", ", ".join(wild), " and their token ids" if s.include_tokens else "")

    def stop(self, timeout: float = 2.0) -> None:
        """Sends what is pending; the thread then closes its own sockets. A thread still busy after `timeout` is
        left to finish and close them itself (a daemon: it cannot hold the process)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: the publisher did not stop within %.1f s; it closes its sockets when it "
                        "does", timeout)
        self._thread = None

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last_warned[kind] = now
            log.warning("KV events: " + msg, *args)

    def _run(self) -> None:
        try:
            if self._pub is not None:  # start() opened it
                self._loop(self._pub, self._replay)
        finally:
            self._close()

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encode = msgspec.msgpack.Encoder().encode
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)  # subscription messages: read so they do not pile up
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        interval_ms = max(1, round(self.interval_ms))
        topic = self.topic.encode()
        while True:
            stopping = self._stopping.is_set()
            try:
                ready = dict(poller.poll(0 if stopping else interval_ms))
                for _ in range(MAX_REQUESTS_PER_TICK):
                    if not (pub in ready and pub.poll(0)):
                        break
                    pub.recv(zmq.NOBLOCK)
                events, num_lost = self.events.take_batch()
                if events:
                    seq = self.num_batches
                    payload = encode(EventBatch(time.time(), events, 0))
                    self.num_batches, self.num_events = seq + 1, self.num_events + len(events)
                    self._buffer.append(payload)
                    self._send_live(pub, (topic, seq.to_bytes(8, "big"), payload))
                if num_lost:  # appends refused while the log was full, so after those events: a sequence number
                    self.num_lost_events += num_lost  # no one gets, a gap that replay cannot fill
                    self._buffer.append(None)
                    self.num_batches += 1
                    self._warn("lost", "the event log overflowed (%d events lost, %d in all): subscribers see a "
                               "gap that replay cannot fill and should resynchronise", num_lost, self.num_lost_events)
                if replay is not None:
                    if replay in ready:
                        self._take_requests(replay)
                    if self._replays:
                        self._serve_replays(replay)
            except zmq.ZMQError as e:  # a socket fault must not end the thread: later batches still go out
                log.warning("KV events: %s", e)
                time.sleep(self.interval_ms / 1000)
            if stopping:
                return

    def _send_live(self, pub: zmq.Socket, frames: tuple[bytes, bytes, bytes]) -> None:
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:  # some subscriber is at its high-water mark: it alone loses this batch
            pass
        self.num_dropped_batches += 1
        self._warn("behind", "a subscriber is at its high-water mark and loses batches (%d so far; the replay "
                   "socket has them); the others get every batch", self.num_dropped_batches)
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    def _take_requests(self, replay: zmq.Socket) -> None:
        """Reads at most MAX_REQUESTS_PER_TICK requests; each becomes a cursor, or is refused with the end marker
        alone (too soon after this peer's last one, or too many replays under way)."""
        now = time.monotonic()
        for _ in range(MAX_REQUESTS_PER_TICK):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[2]) != 8:
                self._warn("bad request", "a replay request of %d frames ignored (want identity, b'', 8-byte seq)",
                           len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            if identity in self._replays:  # its replay under way ends with the one end marker it waits for
                self.num_replays_refused += 1
                continue
            too_soon = now - self._last_request.get(identity, -REPLAY_MIN_INTERVAL_S) < REPLAY_MIN_INTERVAL_S
            self._last_request[identity] = now
            if too_soon or len(self._replays) >= MAX_REPLAYS:
                self.num_replays_refused += 1
                self._warn("refused", "replay requests refused (%d so far): %s", self.num_replays_refused,
                           "a peer asks too often" if too_soon else f"{MAX_REPLAYS} replays under way")
                self._send_end(replay, identity)
                continue
            self.num_replays += 1
            self._replays[identity] = _Replay(identity, max(start, self._first_seq), self.num_batches, now)
        if len(self._last_request) > 4 * MAX_REQUESTS_PER_TICK:  # peers come and go: keep the recent ones
            self._last_request = {i: t for i, t in self._last_request.items() if now - t < REPLAY_MIN_INTERVAL_S}

    def _send_end(self, replay: zmq.Socket, identity: bytes) -> bool:
        try:
            replay.send_multipart((identity, b"", END_SEQ, b""), zmq.NOBLOCK)
            return True
        except zmq.Again:  # its queue is full: it is not reading
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # it left
                return True
            raise

    def _serve_replays(self, replay: zmq.Socket) -> None:
        """A chunk of each replay under way, then its end marker once every batch is out."""
        now = time.monotonic()
        for r in list(self._replays.values()):
            done = self._advance(replay, r, now)
            if not done and now - r.last_progress > REPLAY_STALL_S:
                done = True
                self.num_replays_abandoned += 1
                self._warn("abandoned", "a replay was abandoned: its peer read nothing for %.0f s (%d so far)",
                           REPLAY_STALL_S, self.num_replays_abandoned)
            if done:
                del self._replays[r.identity]

    def _advance(self, replay: zmq.Socket, r: _Replay, now: float) -> bool:
        """Sends up to REPLAY_CHUNK batches of r; True when r is over (end marker sent, or its peer left)."""
        r.next_seq = max(r.next_seq, self._first_seq)  # batches trimmed meanwhile: the peer sees the gap
        try:
            for _ in range(REPLAY_CHUNK):
                if r.next_seq >= r.end_seq:
                    if self._send_end(replay, r.identity):
                        return True
                    return False
                payload = self._buffer[r.next_seq - self._first_seq]
                if payload is not None:
                    replay.send_multipart((r.identity, b"", r.next_seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                r.next_seq += 1
                r.last_progress = now
        except zmq.Again:  # its queue is full: more on a later tick
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.num_replays_abandoned += 1
                return True
            raise
        return False

    @property
    def _first_seq(self) -> int:
        """The sequence number of the oldest batch kept for replay."""
        return self.num_batches - len(self._buffer)

    def stats(self) -> dict:
        return {"topic": self.topic, "endpoint": self.endpoint, "num_batches": self.num_batches,
                "num_events": self.num_events, "num_dropped_batches": self.num_dropped_batches,
                "num_replays": self.num_replays, "num_replays_refused": self.num_replays_refused,
                "num_replays_abandoned": self.num_replays_abandoned, "num_lost_events": self.num_lost_events,
                "num_replays_active": len(self._replays)}
