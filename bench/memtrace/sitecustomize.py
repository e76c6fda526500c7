"""Traces a nodeserve server's Python allocations during a soak: put this folder on PYTHONPATH and set
NODESERVE_MEMTRACE_DIR; a `nodeserve` process then starts tracemalloc after NODESERVE_MEMTRACE_DELAY seconds
(default 240: tracing the model load and the start-up profile would slow the start past the soak's patience)
and dumps a snapshot there every NODESERVE_MEMTRACE_EVERY seconds (default 120). Allocations made before tracing
started are not seen: growth between snapshots is. Other processes (the soak's client) are left alone.

    PYTHONPATH=bench/memtrace NODESERVE_MEMTRACE_DIR=/tmp/mt python bench/soak.py --minutes 20 ...
    python bench/memtrace/diff.py /tmp/mt            # growth by allocation site, first dump after warm-up -> last
"""

import os
import sys


def _start() -> None:
    import threading
    import time
    import tracemalloc

    out = os.environ["NODESERVE_MEMTRACE_DIR"]
    every = float(os.environ.get("NODESERVE_MEMTRACE_EVERY", "120"))
    delay = float(os.environ.get("NODESERVE_MEMTRACE_DELAY", "240"))
    os.makedirs(out, exist_ok=True)

    def dump() -> None:
        t0 = time.monotonic()
        time.sleep(delay)
        tracemalloc.start(int(os.environ.get("NODESERVE_MEMTRACE_FRAMES", "12")))
        while True:
            time.sleep(every)
            snap = tracemalloc.take_snapshot()
            with open(f"/proc/{os.getpid()}/status") as f:
                rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            name = f"{int(time.monotonic() - t0):06d}s-rss{rss_kib}k.snap"
            snap.dump(os.path.join(out, name))

    threading.Thread(target=dump, name="memtrace", daemon=True).start()


if os.environ.get("NODESERVE_MEMTRACE_DIR") and "nodeserve" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    _start()
