"""DiskTier: KV pages in files on a local disk, so a prefix computed once is still there after a restart.

The host-memory tier hands pages to put() (written by a background thread) and reads them back with get().
Files live in <path>/<fingerprint>/<page hash hex>.kvp; the fingerprint (model_fingerprint) names everything that
makes KV incompatible, so another model's or another KV layout's pages sit in their own directory, untouched.

Trust (docs/security.md, "The disk tier"): a page's K/V reveal its tokens to anyone with the weights, and a page
planted here would steer outputs. So:
  - one process owns <path> at a time: start() takes an flock on <path>/lock and refuses (DiskTierLocked) when
    another process holds it; only then does it remove the temporary files a killed owner left;
  - directories are created 0700 and files 0600, set with fchmod/chmod whatever the umask;
  - every file carries a MAC (HMAC-SHA256) over its header, its tokens and its K/V, under a random key
    in <path>/key (0600, created atomically), so a file this cache did not write (forged, from another cache,
    edited) is rejected, counted and removed when read;
  - every header holds the page's tokens, compared on get() with the prompt's, so a hash collision or a file
    renamed onto another page's hash is never served;
  - files are opened with O_NOFOLLOW and O_NONBLOCK and must be regular files (fstat), so a symlink or a FIFO put
    in the directory is removed, never followed and never waited on.
The disk is a cache, never a dependency: a failed write (a full disk) pauses writes with one warning and they
resume by themselves after a backoff; nothing here ever fails a request.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import queue
import stat
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch

from nodeserve.device.cpu import lower_thread_priority

if TYPE_CHECKING:
    from nodeserve.kv.events import KVEventSink

log = logging.getLogger(__name__)

MAGIC = b"NSKVPG02"
HEADER = struct.Struct("<8s16s16sQI")  # magic, fingerprint, page hash, payload length, number of tokens
TOKEN = struct.Struct("<q")            # then the page's tokens, the payload, and the MAC of all that came before
MAC_BYTES = 32
KEY_BYTES = 32
SUFFIX = ".kvp"
LOCK_NAME, KEY_NAME = "lock", "key"    # beside the fingerprint directories, which are 32 hex digits
HEX_DIGITS = frozenset("0123456789abcdef")
SAMPLE_BYTES = 16 << 20
CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")
# How K/V are laid out and computed (page layout, RoPE, scales...): bumped by a change to the code that makes
# pages an earlier version wrote wrong for this one. It is part of every fingerprint.
KV_LAYOUT_VERSION = 2
MAX_QUEUED_BYTES = 64 << 20   # pages waiting for the writer: held host slots, not copies (kv/host.py)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # after a failed write (a full disk): pause, doubling up to the max
O_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


class DiskTierLocked(RuntimeError):
    """Another process holds the disk tier's directory."""


def _file_digest(path: str, h: hashlib.blake2b) -> None:
    st = os.stat(path)
    # mtime_ns: an in-place edit between the sampled ends changes it (the inode is left out: a copy of the same
    # model into a fresh container would then look like another model)
    h.update(struct.pack("<QQ", st.st_size, st.st_mtime_ns))
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if st.st_size > SAMPLE_BYTES:
            # The tail starts after the head, so a file under 32 MiB is hashed whole and exactly once.
            f.seek(max(SAMPLE_BYTES, st.st_size - SAMPLE_BYTES))
            h.update(f.read())


def _update_str(h: hashlib.blake2b, s: str) -> None:
    # Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    raw = s.encode()
    h.update(struct.pack("<Q", len(raw)) + raw)


def model_fingerprint(model_path: str, *parts: str) -> str:
    """32 hex chars naming everything that makes stored KV incompatible: KV_LAYOUT_VERSION, the model's files and
    `parts` (architecture, dtype, KV dtype, page size, FP8 scales... as strings, from the caller).

    A file is identified by its size, its mtime, its first 16 MiB and its last 16 MiB (blake2b), not its whole
    content: hashing a 100 GB checkpoint at every start would take minutes. An edit in place changes the mtime; one
    that keeps size, mtime and both ends is a deliberate forgery by someone who can write the weights anyway. A
    directory (an HF checkpoint) is identified by its *.safetensors, *.gguf and config.json files, names included,
    in sorted order.
    """
    h = hashlib.blake2b(digest_size=16)
    _update_str(h, f"kv-layout {KV_LAYOUT_VERSION}")
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


def _private_dir(path: str, follow: bool = False) -> None:
    """`path` made if missing, a directory owned by this user, mode 0700; not a link unless `follow` (the
    configured disk_path may be one the operator made; what is inside it may not)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is not a directory owned by this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # makedirs' mode is masked by the umask; a 0755 cache would be readable by all


def _open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open without following a link or waiting on a FIFO; raises OSError(EINVAL) if it is not a regular
    file."""
    fd = os.open(path, flags | O_FLAGS | os.O_NONBLOCK, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, parts: Sequence[Any]) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view):]


def _load_key(root: str) -> bytes:
    """The MAC key in <root>/key: read if it is a regular 0600 file of this user, else a new one (a key others
    could read is no key), written to a temporary file and linked into place, so no reader sees half a key."""
    path = os.path.join(root, KEY_NAME)
    with contextlib.suppress(OSError):
        fd = _open_regular(path, os.O_RDONLY)
        try:
            st, key = os.fstat(fd), os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(key) == KEY_BYTES and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0:
            return key
        log.warning("KV disk tier: %s is not a private %d-byte key: replaced (every page written under the old "
                    "one is now rejected and removed when read)", path, KEY_BYTES)
        _remove(path)
    key = os.urandom(KEY_BYTES)
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_FLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)
        _write_all(fd, [key])
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if one appeared meanwhile: then that one is the key
    except FileExistsError:
        return _load_key(root)
    finally:
        _remove(tmp)
    return key


def lock_path(root: str) -> int:
    """Takes the flock on <root>/lock (creating root 0700) and returns its descriptor: closing it (or the process
    ending) releases it. DiskTierLocked names the pid holding it. The server takes it before loading its model, so
    a second server on one directory stops in a second, not after a minute's load."""
    _private_dir(root, follow=True)
    fd = _open_regular(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskTierLocked(f"kv.disk_path {root} is in use by another nodeserve process (pid {owner}); "
                             f"give each server its own disk_path") from None
    except BaseException:
        os.close(fd)
        raise
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class DiskTier:
    """Pages on disk, in an LRU index (hash -> file size) rebuilt by start() from a directory scan."""

    def __init__(self, path: str, max_bytes: int, fingerprint: str, page_nbytes: int, *, page_size: int,
                 max_queued_bytes: int = MAX_QUEUED_BYTES, events: KVEventSink | None = None,
                 write: Callable[[int, Sequence[Any]], None] = _write_all, lock_fd: int | None = None):
        """page_nbytes: a page's K/V bytes; page_size: its tokens; max_queued_bytes: pages waiting to be written
        (at least one); write(fd, buffers): writes every buffer to fd (tests inject a full disk here); lock_fd:
        path's lock, taken already (lock_path), which this tier then holds and releases."""
        if len(fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 hex chars, got {fingerprint!r}")
        if page_nbytes <= 0 or page_size <= 0:
            raise ValueError(f"page_nbytes ({page_nbytes}) and page_size ({page_size}) must be positive")
        self.fingerprint_bytes = bytes.fromhex(fingerprint)
        self.root = path
        self.dir = os.path.join(path, fingerprint)
        self.page_nbytes, self.page_size, self.max_bytes = page_nbytes, page_size, max_bytes
        self.max_queued = max(1, max_queued_bytes // page_nbytes)
        self.tokens_nbytes = page_size * TOKEN.size
        self.file_nbytes = HEADER.size + self.tokens_nbytes + page_nbytes + MAC_BYTES
        self.num_files = self.num_bytes = self.num_writes = self.num_write_bytes = 0
        self.num_reads = self.num_read_bytes = self.num_bad_files = self.num_evictions = self.num_dropped = 0
        self.num_write_errors = 0     # writes that failed (a full disk...): each pauses writing for a while
        self.num_foreign_bytes = 0    # other fingerprints' pages under path, counted against max_bytes
        self.read_seconds = 0.0
        self.disabled: str | None = None
        self.paused: str | None = None     # why writes pause (the last write error), until retry_at
        self.retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        if max_bytes < self.file_nbytes:
            self.disabled = f"max_bytes {max_bytes} is smaller than one page file ({self.file_nbytes} bytes)"
        self.write = write
        self._key = b""
        self._lock_fd: int | None = lock_fd
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: set[bytes] = set()  # queued or being written
        self._lock = threading.Condition()
        self._queue: queue.Queue[tuple[bytes, torch.Tensor, array, Callable[[], None]] | None] = \
            queue.Queue(self.max_queued)
        self._thread: threading.Thread | None = None
        self._abandon = False  # stop() ran out of time: the writer discards what is left
        self.events = events  # told, under the lock, every page entering or leaving the index

    def _mac(self, *parts: Any) -> bytes:
        # HMAC-SHA256 rather than keyed blake2b: SHA-NI makes it the faster of the two (Zen 4, one 368,640-byte
        # page: 0.42 vs 0.65 ms)
        m = hmac.new(self._key, digestmod="sha256")
        for part in parts:
            m.update(part)
        return m.digest()

    def _head(self, h: bytes, tokens: Sequence[int]) -> bytes:
        """The header and the tokens, as the file starts."""
        return HEADER.pack(MAGIC, self.fingerprint_bytes, h, self.page_nbytes, self.page_size) + \
            array("q", tokens).tobytes()

    def _path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex() + SUFFIX)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) != self.page_size:
            raise ValueError(f"a page holds {self.page_size} tokens, got {len(tokens)}")

    def _forget(self, h: bytes) -> None:
        with self._lock:
            size = self._index.pop(h, None)
            if size is not None:
                self.num_files, self.num_bytes = len(self._index), self.num_bytes - size
                if self.events is not None:
                    self.events.removed([h])

    def _take_lock(self) -> None:
        """The flock on <path>/lock (lock_path's, taken before the model load where the server does), held until
        stop() (or the process's end: a SIGKILL releases it too)."""
        if self._lock_fd is None:
            self._lock_fd = lock_path(self.root)

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    def _foreign_bytes(self) -> int:
        """Bytes of page files in the other fingerprints' directories under path."""
        total = 0
        with os.scandir(self.root) as entries:
            for e in entries:
                if e.name != os.path.basename(self.dir) and len(e.name) == 32 and set(e.name) <= HEX_DIGITS \
                        and e.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError), os.scandir(e.path) as files:  # unreadable: not counted
                        total += sum(f.stat(follow_symlinks=False).st_size for f in files
                                     if f.is_file(follow_symlinks=False))
        return total

    def start(self) -> None:
        """Takes the directory (DiskTierLocked if another process has it), then scans it. Any other error turns
        the tier off with one warning."""
        if self._thread is not None:
            raise RuntimeError("DiskTier.start() called twice")
        t0 = time.perf_counter()
        found: list[tuple[float, bytes, int]] = []
        num_bad = num_tmp = 0
        try:
            self._take_lock()
        except DiskTierLocked:
            raise
        except OSError as e:
            self.disabled = f"cannot use {self.root}: {e}"
            log.warning("KV disk tier off: %s", self.disabled)
            return
        try:
            self._key = _load_key(self.root)
            _private_dir(self.dir)
            with os.scandir(self.dir) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        continue
                    if entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False):
                        _remove(entry.path)  # half-written by a killed owner: the lock says none writes now
                        num_tmp += 1
                        continue
                    h, st = _parse_name(entry.name), entry.stat(follow_symlinks=False)
                    # Size only: contents are checked on get, so 10,000 files scan without reading any. A link or
                    # a FIFO here was not written by this tier.
                    if h is None or not stat.S_ISREG(st.st_mode) or st.st_size != self.file_nbytes:
                        num_bad += 1
                        _remove(entry.path)
                    else:
                        found.append((st.st_mtime, h, st.st_size))
            self.num_foreign_bytes = self._foreign_bytes()
        except OSError as e:
            self.disabled = f"cannot use {self.dir}: {e}"
            log.warning("KV disk tier off: %s", self.disabled)
            self._release_lock()
            return
        found.sort()
        with self._lock:
            self._index = OrderedDict((h, size) for _, h, size in found)
            self.num_files, self.num_bytes = len(self._index), sum(self._index.values())
            self.num_bad_files += num_bad
            if self.events is not None and self._index:
                self.events.stored(list(self._index))
        self._evict(0)
        log.info("KV disk tier %s: %d files, %d bytes, %d bad files and %d half-written ones removed, scanned in "
                 "%.3f s", self.dir, self.num_files, self.num_bytes, num_bad, num_tmp, time.perf_counter() - t0)
        if self.num_foreign_bytes:
            log.warning("KV disk tier: %d bytes of other fingerprints' pages (another model or KV layout) in %s "
                        "count against kv.disk_gib; remove those directories to reclaim the space",
                        self.num_foreign_bytes, self.root)
        self._abandon = False
        self._thread = threading.Thread(target=self._run, name="kv disk writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Writes what is queued, for up to `timeout` s, then lets the directory go."""
        thread, self._thread = self._thread, None  # later puts are no-ops
        if thread is None:
            self._release_lock()
            return
        self._abandon = not self.flush(timeout)
        # Once abandoned the writer empties the queue at once, so room appears unless a write itself hangs.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        thread.join(timeout=1.0)
        if not thread.is_alive():  # a hung write keeps the lock: no one else may write beside it
            self._release_lock()

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

    def put(self, h: bytes, page: torch.Tensor, tokens: Sequence[int],
            done: Callable[[], None] = lambda: None) -> bool:
        """Queues page `h` (its bytes, and its tokens) for writing; page must not change until done() is called,
        from the writer's thread once written or dropped (or from here, at once, when it is not queued). Returns
        whether it was queued."""
        if len(h) != 16:
            raise ValueError(f"page hash must be 16 bytes, got {len(h)}")
        _check_page(page, self.page_nbytes, "page")
        self._check_tokens(tokens)
        queued = False
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
            elif not (self.disabled or self._thread is None or h in self._pending):
                if self.paused and time.monotonic() < self.retry_at:
                    self.num_dropped += 1  # the disk was full a moment ago: not worth a try per page
                else:
                    try:
                        self._queue.put_nowait((h, page, array("q", tokens), done))
                        self._pending.add(h)
                        queued = True
                    except queue.Full:
                        self.num_dropped += 1
        if not queued:
            done()
        return queued

    def get(self, h: bytes, out: torch.Tensor, tokens: Sequence[int]) -> bool:
        """Reads page `h` into `out` if it is here, authentic and holds `tokens`; on False, `out` may hold part of a
        bad file. A bad file (forged, truncated, another cache's, a link, a FIFO) is counted, logged and removed."""
        _check_page(out, self.page_nbytes, "out")
        self._check_tokens(tokens)
        with self._lock:
            if h not in self._index:
                return False
            self._index.move_to_end(h)
        t0, path = time.perf_counter(), self._path(h)
        head, mac = bytearray(HEADER.size + self.tokens_nbytes), bytearray(MAC_BYTES)
        try:
            fd = _open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(h)  # gone: a miss, and the next start() looks again
            return False
        except OSError as e:  # ELOOP: a symlink; EINVAL: a FIFO, a socket, a device
            return self._bad(h, path, f"cannot be opened as a regular file ({e.strerror})")
        try:
            size = os.fstat(fd).st_size
            num_read = os.readv(fd, [head, out.numpy(), mac]) if size == self.file_nbytes else 0
            if num_read == self.file_nbytes:
                with contextlib.suppress(OSError):  # a read-only mount: the file is still good
                    os.utime(fd)  # mtime orders the LRU after a restart, so a read counts as a use there too
        except OSError as e:
            return self._bad(h, path, f"read failed ({e.strerror})")
        finally:
            os.close(fd)
        if num_read != self.file_nbytes:
            return self._bad(h, path, f"{size} bytes, not {self.file_nbytes}")
        # The MAC first: only then are the header's fields this cache's own.
        if not hmac.compare_digest(mac, self._mac(head, out.numpy())):
            return self._bad(h, path, "its MAC does not match (not written by this cache, or altered)")
        if head[:HEADER.size] != HEADER.pack(MAGIC, self.fingerprint_bytes, h, self.page_nbytes, self.page_size):
            return self._bad(h, path, "its header names another page or model")
        if head[HEADER.size:] != array("q", tokens).tobytes():
            return self._bad(h, path, "it holds other tokens than the prompt's (a hash collision)")
        with self._lock:
            self.num_reads, self.num_read_bytes = self.num_reads + 1, self.num_read_bytes + self.file_nbytes
            self.read_seconds += time.perf_counter() - t0
        return True

    def _bad(self, h: bytes, path: str, why: str) -> bool:
        log.warning("KV disk tier: %s removed: %s", os.path.basename(path), why)
        with self._lock:
            self.num_bad_files += 1
        self._forget(h)
        _remove(path)  # a link itself, never its target
        return False

    def _evict(self, num_new_bytes: int) -> None:
        victims = []
        with self._lock:
            while self._index and self.num_bytes + self.num_foreign_bytes + num_new_bytes > self.max_bytes:
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
            h, page, tokens, done = item
            try:
                written = not self.disabled and not self._abandon and self._write(h, page, tokens)
            finally:
                done()
            with self._lock:
                if not written:
                    self.num_dropped += 1
                self._pending.discard(h)
                self._lock.notify_all()

    def _write(self, h: bytes, page: torch.Tensor, tokens: array) -> bool:
        if self.paused and time.monotonic() < self.retry_at:
            return False
        self._evict(self.file_nbytes)
        data, path = page.numpy(), self._path(h)
        head = self._head(h, tokens)
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            # No fsync: per page it would cost more than the write. After a power loss a torn file fails its
            # MAC on get and is removed; a kill leaves only the temp file, which the next start() removes.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_FLAGS, 0o600)
            try:
                os.fchmod(fd, 0o600)
                self.write(fd, [head, data, self._mac(head, data)])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            self._write_failed(e)
            return False
        if self.paused:
            log.warning("KV disk tier: writes resumed (paused by: %s)", self.paused)
            self.paused, self._retry_s = None, RETRY_FIRST_S
        with self._lock:
            self._index[h] = self.file_nbytes
            self.num_files, self.num_bytes = len(self._index), self.num_bytes + self.file_nbytes
            self.num_writes, self.num_write_bytes = self.num_writes + 1, self.num_write_bytes + self.file_nbytes
            if self.events is not None:
                self.events.stored([h])
        return True

    def _write_failed(self, e: OSError) -> None:
        """Writes pause for a backoff (doubling, up to RETRY_MAX_S) and resume by themselves: a full disk is
        often freed again (our own evictions, another program's cleanup). One warning per pause, not per page."""
        with self._lock:
            self.num_write_errors += 1
        if self.paused is None:
            log.warning("KV disk tier: a write failed (%s): writes pause, retried in %.0f s; reads go on", e,
                        self._retry_s)
        self.paused = str(e)
        self.retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(RETRY_MAX_S, 2 * self._retry_s)
