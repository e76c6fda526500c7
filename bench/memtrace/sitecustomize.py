"""Traces a nodeserve server's memory during a soak: put this folder on PYTHONPATH and set
NODESERVE_MEMTRACE_DIR; a `nodeserve` process then starts tracemalloc after NODESERVE_MEMTRACE_DELAY seconds
(default 240: tracing the model load and the start-up profile would slow the start past the soak's patience)
and dumps a snapshot there every NODESERVE_MEMTRACE_EVERY seconds (default 120). Allocations made before tracing
started are not seen: growth between snapshots is. With each snapshot goes a `.native.json`: glibc's mallinfo2
(bytes in use vs free inside the C heap: live allocations against fragmentation) and /proc/<pid>/smaps summed by
kind of mapping (heap, anonymous, files), jemalloc's counters when it serves malloc (live bytes vs resident) and the
live objects by type, so what tracemalloc does not see can be placed too; with MALLOC_CONF=...,prof:true,
prof_prefix:DIR/p (jemalloc's heap profiler) a heap profile too, for jeprof. Set
NODESERVE_MEMTRACE_PY=0 to skip tracemalloc (its overhead) and keep the native view only. Other processes (the
soak's client) are left alone.

    PYTHONPATH=bench/memtrace NODESERVE_MEMTRACE_DIR=/tmp/mt python bench/soak.py --minutes 20 ...
    python bench/memtrace/diff.py /tmp/mt            # growth by allocation site, first dump after warm-up -> last
"""

import os
import sys


def _mallinfo2() -> dict:
    import ctypes

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {name: getattr(info, name) for name, _ in MallInfo2._fields_}


def _jemalloc_stats() -> dict:
    """jemalloc's own counters when it serves malloc (LD_PRELOAD): allocated (live), active, resident, mapped,
    retained bytes; allocated growing means live allocations grow, resident alone means pages kept."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        mallctl = lib.mallctl
    except (OSError, AttributeError):
        return {}
    epoch = ctypes.c_uint64(1)
    size = ctypes.c_size_t(8)
    mallctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), ctypes.c_size_t(8))
    out = {}
    for key in ("allocated", "active", "resident", "mapped", "retained", "metadata"):
        value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(f"stats.{key}".encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0:
            out[key] = value.value
    return out


def _jemalloc_prof_dump() -> None:
    """A heap profile (jemalloc's own sampler: the process runs with MALLOC_CONF prof:true) written to its
    prof_prefix, for `jeprof --base=<earlier> python3 <later>`: live native bytes by allocating stack."""
    import ctypes

    try:
        ctypes.CDLL(None).mallctl(b"prof.dump", None, None, None, ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


def _python_objects(top: int = 40) -> dict:
    """Live objects the collector tracks, counted by type (the top ones), and pymalloc's block count."""
    import collections
    import gc

    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    return {"allocated_blocks": sys.getallocatedblocks(), "by_type": dict(counts.most_common(top))}


def _smaps_by_kind(pid: int) -> dict:
    """Rss kB summed per mapping kind: [heap], [stack], anonymous, or the mapped file's basename."""
    totals: dict = {}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
                kind = path if path.startswith("[") else (os.path.basename(path) if path else "anon")
            elif head[0] == "Rss:" and kind is not None:
                totals[kind] = totals.get(kind, 0) + int(head[1])
    return totals


def _start() -> None:
    import json
    import threading
    import time
    import tracemalloc

    out = os.environ["NODESERVE_MEMTRACE_DIR"]
    every = float(os.environ.get("NODESERVE_MEMTRACE_EVERY", "120"))
    delay = float(os.environ.get("NODESERVE_MEMTRACE_DELAY", "240"))
    trace_python = os.environ.get("NODESERVE_MEMTRACE_PY", "1") != "0"
    os.makedirs(out, exist_ok=True)

    def dump() -> None:
        t0 = time.monotonic()
        time.sleep(delay)
        if trace_python:
            tracemalloc.start(int(os.environ.get("NODESERVE_MEMTRACE_FRAMES", "12")))
        while True:
            time.sleep(every)
            with open(f"/proc/{os.getpid()}/status") as f:
                rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            name = f"{int(time.monotonic() - t0):06d}s-rss{rss_kib}k"
            native = {"rss_kib": rss_kib, "mallinfo2": _mallinfo2(), "smaps_rss_kib": _smaps_by_kind(os.getpid()),
                      "jemalloc": _jemalloc_stats(), "python": _python_objects()}
            with open(os.path.join(out, name + ".native.json"), "w") as f:
                json.dump(native, f)
            if "prof:true" in os.environ.get("MALLOC_CONF", ""):
                _jemalloc_prof_dump()
            if trace_python:
                tracemalloc.take_snapshot().dump(os.path.join(out, name + ".snap"))

    threading.Thread(target=dump, name="memtrace", daemon=True).start()


if os.environ.get("NODESERVE_MEMTRACE_DIR") and "nodeserve" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    _start()
