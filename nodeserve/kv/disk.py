"""DiskTier: KV pages in files on a local disk, so a prefix computed once is still there after a restart.

The host-memory tier hands pages to put() (written by a background thread) and reads them back with get().
Files live in <path>/<fingerprint>/<page hash hex>.kvp; the fingerprint (model_fingerprint) names everything that
makes KV incompatible, so another model's or another KV layout's pages sit in their own directory, untouched.
One directory belongs to one server process at a time: start() removes the temporary files it finds there.
The disk is a cache, never a dependency: an I/O error stops writes with one warning and never reaches a request.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from nodeserve.device.cpu import lower_thread_priority

if TYPE_CHECKING:
    from nodeserve.kv.events import KVEventSink

log = logging.getLogger(__name__)

MAGIC = b"NSKVPG01"
HEADER = struct.Struct("<8s16s16sQI")  # magic, fingerprint, page hash, payload length, crc32 of the payload
SUFFIX = ".kvp"
HEX_DIGITS = frozenset("0123456789abcdef")
SAMPLE_BYTES = 16 << 20
CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")


def _file_digest(path: str, h: hashlib.blake2b) -> None:
    size = os.path.getsize(path)
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            # The tail starts after the head, so a file under 32 MiB is hashed whole and exactly once.
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read())


def _update_str(h: hashlib.blake2b, s: str) -> None:
    # Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    raw = s.encode()
    h.update(struct.pack("<Q", len(raw)) + raw)


def model_fingerprint(model_path: str, *parts: str) -> str:
    """32 hex chars naming everything that makes stored KV incompatible: the model's files plus `parts`
    (architecture, dtype, KV dtype, page size, FP8 scales... as strings, from the caller).

    A file is identified by its size, its first 16 MiB and its last 16 MiB (blake2b), not its whole content:
    hashing a 100 GB checkpoint at every start would take minutes, and an edit that keeps the size and both ends
    is not worth that cost. A directory (an HF checkpoint) is identified by its *.safetensors, *.gguf and
    config.json files, names included, in sorted order.
    """
    h = hashlib.blake2b(digest_size=16)
    if os.path.isdir(model_path):
        names = sorted(n for n in os.listdir(model_path) if n.endswith(CHECKPOINT_SUFFIXES) or n == "config.json")
        if not names:
            raise ValueError(f"{model_path}: no *.safetensors, *.gguf or config.json to fingerprint")
        for name in names:
            _update_str(h, name)
            _file_digest(os.path.join(model_path, name), h)
    else:
        _file_digest(model_path, h)
    for part in parts:
        _update_str(h, part)
    return h.hexdigest()


def _parse_name(name: str) -> bytes | None:
    """The page hash in a file name as _path writes it (32 lower-case hex digits + .kvp), else None."""
    stem = name.removesuffix(SUFFIX)
    return bytes.fromhex(stem) if stem != name and len(stem) == 32 and set(stem) <= HEX_DIGITS else None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _check_page(t: torch.Tensor, page_nbytes: int, what: str) -> None:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != page_nbytes:
        raise ValueError(f"{what} must be a contiguous uint8 CPU tensor of {page_nbytes} bytes, got {t.dtype} "
                         f"{t.device} {tuple(t.shape)}")


class DiskTier:
    """Pages on disk, in an LRU index (hash -> file size) rebuilt by start() from a directory scan."""

    def __init__(self, path: str, max_bytes: int, fingerprint: str, page_nbytes: int, max_queued: int = 1024,
                 events: KVEventSink | None = None):
        if len(fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 hex chars, got {fingerprint!r}")
        if page_nbytes <= 0 or max_queued <= 0:
            raise ValueError(f"page_nbytes ({page_nbytes}) and max_queued ({max_queued}) must be positive")
        self.fingerprint_bytes = bytes.fromhex(fingerprint)
        self.dir = os.path.join(path, fingerprint)
        self.page_nbytes, self.max_bytes, self.max_queued = page_nbytes, max_bytes, max_queued
        self.file_nbytes = HEADER.size + page_nbytes
        self.num_files = self.num_bytes = self.num_writes = self.num_write_bytes = 0
        self.num_reads = self.num_read_bytes = self.num_bad_files = self.num_evictions = self.num_dropped = 0
        self.read_seconds = 0.0
        self.disabled: str | None = None
        if max_bytes < self.file_nbytes:
            self.disabled = f"max_bytes {max_bytes} is smaller than one page file ({self.file_nbytes} bytes)"
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: set[bytes] = set()  # queued or being written
        self._lock = threading.Condition()
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_queued)
        self._thread: threading.Thread | None = None
        self._abandon = False  # stop() ran out of time: the writer discards what is left
        self.events = events  # told, under the lock, every page entering or leaving the index

    def _header(self, h: bytes, payload) -> bytes:
        return HEADER.pack(MAGIC, self.fingerprint_bytes, h, self.page_nbytes, zlib.crc32(payload))

    def _path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex() + SUFFIX)

    def _forget(self, h: bytes) -> None:
        with self._lock:
            size = self._index.pop(h, None)
            if size is not None:
                self.num_files, self.num_bytes = len(self._index), self.num_bytes - size
                if self.events is not None:
                    self.events.removed([h])

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("DiskTier.start() called twice")
        t0 = time.perf_counter()
        found: list[tuple[float, bytes, int]] = []
        num_bad = 0
        try:
            os.makedirs(self.dir, exist_ok=True)
            with os.scandir(self.dir) as entries:
                for e in entries:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    if e.name.endswith(".tmp"):  # half-written by a killed process
                        _remove(e.path)
                        continue
                    h, st = _parse_name(e.name), e.stat(follow_symlinks=False)
                    # Size only: contents are checked on get, so 10,000 files scan without reading any.
                    if h is None or st.st_size != self.file_nbytes:
                        num_bad += 1
                        _remove(e.path)
                    else:
                        found.append((st.st_mtime, h, st.st_size))
        except OSError as e:
            self.disabled = f"cannot use {self.dir}: {e}"
            log.warning("KV disk tier off: %s", self.disabled)
            return
        found.sort()
        with self._lock:
            self._index = OrderedDict((h, size) for _, h, size in found)
            self.num_files, self.num_bytes = len(self._index), sum(self._index.values())
            self.num_bad_files += num_bad
            if self.events is not None and self._index:
                self.events.stored(list(self._index))
        self._evict(0)
        log.info("KV disk tier %s: %d files, %d bytes, %d bad files removed, scanned in %.3f s",
                 self.dir, self.num_files, self.num_bytes, num_bad, time.perf_counter() - t0)
        self._abandon = False
        self._thread = threading.Thread(target=self._run, name="kv disk writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        thread, self._thread = self._thread, None  # later puts are no-ops
        if thread is None:
            return
        self._abandon = not self.flush(timeout)
        # Once abandoned the writer empties the queue at once, so room appears unless a write itself hangs.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        thread.join(timeout=1.0)

    def flush(self, timeout: float = 30.0) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout)

    def match(self, hashes: Sequence[bytes]) -> int:
        with self._lock:
            for i, h in enumerate(hashes):
                if h not in self._index:
                    return i
            return len(hashes)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def __contains__(self, h: bytes) -> bool:
        return self.match((h,)) == 1

    def put(self, h: bytes, page: torch.Tensor) -> None:
        if len(h) != 16:
            raise ValueError(f"page hash must be 16 bytes, got {len(h)}")
        _check_page(page, self.page_nbytes, "page")
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
                return
            if self.disabled or self._thread is None or h in self._pending:
                return
            try:
                self._queue.put_nowait((h, page))
            except queue.Full:
                self.num_dropped += 1
                return
            self._pending.add(h)

    def get(self, h: bytes, out: torch.Tensor) -> bool:
        """Reads page `h` into `out`; on False, `out` may hold part of a bad file."""
        _check_page(out, self.page_nbytes, "out")
        with self._lock:
            if h not in self._index:
                return False
            self._index.move_to_end(h)
        t0, path = time.perf_counter(), self._path(h)
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER.size)
                num_read = f.readinto(out.numpy())
        except OSError:
            self._forget(h)  # gone or unreadable: a miss, and the next start() looks again
            return False
        # Magic, fingerprint (another model's file moved here), hash, length and checksum all in one comparison.
        good = num_read == self.page_nbytes and header == self._header(h, out.numpy())
        with self._lock:
            if good:
                self.num_reads, self.num_read_bytes = self.num_reads + 1, self.num_read_bytes + self.file_nbytes
                self.read_seconds += time.perf_counter() - t0
            else:
                self.num_bad_files += 1
        if not good:
            self._forget(h)
            _remove(path)
            return False
        with contextlib.suppress(OSError):
            os.utime(path)  # mtime orders the LRU after a restart, so a read counts as a use there too
        return True

    def _evict(self, num_new_bytes: int) -> None:
        victims = []
        with self._lock:
            while self._index and self.num_bytes + num_new_bytes > self.max_bytes:
                h, size = self._index.popitem(last=False)
                self.num_bytes -= size
                self.num_evictions += 1
                victims.append(h)
            self.num_files = len(self._index)
            if self.events is not None:
                self.events.removed(victims)
        for h in victims:
            _remove(self._path(h))

    def _run(self) -> None:
        lower_thread_priority()  # background writes: the event loop and the workers come first on a busy core
        while (item := self._queue.get()) is not None:
            h, page = item
            written = not self.disabled and not self._abandon and self._write(h, page)
            with self._lock:
                if not written:
                    self.num_dropped += 1
                self._pending.discard(h)
                self._lock.notify_all()

    def _write(self, h: bytes, page: torch.Tensor) -> bool:
        self._evict(self.file_nbytes)
        data, path = page.numpy(), self._path(h)
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            # No fsync: per page it would cost more than the write. After a power loss a torn file fails its
            # checksum on get and is removed; a kill leaves only the temp file, which start() removes.
            with open(tmp, "wb") as f:
                f.write(self._header(h, data))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self.disabled = f"write failed: {e}"
            log.warning("KV disk tier stops writing (reads go on): %s", self.disabled)
            _remove(tmp)
            return False
        with self._lock:
            self._index[h] = self.file_nbytes
            self.num_files, self.num_bytes = len(self._index), self.num_bytes + self.file_nbytes
            self.num_writes, self.num_write_bytes = self.num_writes + 1, self.num_write_bytes + self.file_nbytes
            if self.events is not None:
                self.events.stored([h])
        return True
