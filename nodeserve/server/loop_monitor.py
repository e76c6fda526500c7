"""Event-loop stalls, measured from inside the server.

A heartbeat on the loop times how late a timer fires (`nodeserve_event_loop_lag_seconds`). A watcher thread looks
at the loop thread while it is late and says why, from the kernel's per-thread counters
(/proc/thread-self/schedstat: time on a CPU, time runnable but waiting for one):
- busy: the loop was running Python (its stack, logged, says what);
- starved: the loop was ready but had no CPU (the worker threads and other processes had them all);
- blocked: neither: waiting for the GIL or a lock held by another thread;
- unseen: over before the watcher (itself a thread that may have to wait) could look;
- gc: the cyclic garbage collector ran for at least half of it (timed through gc.callbacks; it holds the GIL, so
  it stops the loop whichever thread triggered it).
Each stall past `stall_s` is counted by cause (`nodeserve_event_loop_stalls_total`) and logged once with the
loop's stack as the watcher saw it mid-stall.

The watcher is a Python thread: while another thread holds the GIL it cannot look either (cause "unseen"). For
those, with `dump_after_s` set (`server.stall_dumps`, off by default), faulthandler's C watchdog, re-armed by the
heartbeat, writes every thread's stack once the loop is `dump_after_s` late, GIL or not, and the heartbeat logs that
dump when the loop runs again: the thread that held the GIL is the one inside a C call. It is a diagnostic, not a
default, because that dump reads the other threads' frames without the GIL while they run: CPython documents it as
unsafe, and it crashed a server (SIGSEGV in faulthandler's dump_traceback) after ~300 dumps in a soak whose loop
stalled often (tracemalloc on, 2026-11-26).

Why: /health answered in 1 ms inside its handler while probes waited up to 446 ms under hostile input
(bench/hostile.py); a handler's own time cannot show a loop that was busy elsewhere or not running at all."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

def read_schedstat(native_id: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable without one) of a thread of this process, or None where the kernel has no
    schedstat."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns), int(wait_ns)
    except (OSError, ValueError):
        return None


def classify(run_ns: int, wait_ns: int, elapsed_ns: int) -> str:
    """Why a thread made no progress for elapsed_ns, given how much of it the thread ran / waited for a CPU:
    mostly neither: blocked; else whichever of the two was longer (a loop running Python on a shared core both runs
    and waits)."""
    if elapsed_ns <= 0:
        return "unseen"
    if run_ns + wait_ns < elapsed_ns / 2:
        return "blocked"
    return "busy" if run_ns >= wait_ns else "starved"


def _read_dump(dump) -> str:
    """What faulthandler wrote into the dump file since the last read (then empties it)."""
    if dump is None or dump.seek(0, 2) == 0:
        return ""
    dump.seek(0)
    text = dump.read().decode(errors="replace")
    dump.seek(0)
    dump.truncate()
    return text.strip()


@dataclass
class Stall:
    cause: str
    stack: str  # the loop thread's innermost frames, as the watcher saw them


@dataclass
class LoopMonitor:
    """Run `run()` as a task on the loop to monitor; on_lag(seconds) gets every heartbeat's lateness and
    on_stall(seconds, cause) every stall past stall_s."""
    interval_s: float = 0.05
    stall_s: float = 0.1
    on_lag: Callable[[float], None] | None = None
    on_stall: Callable[[float, str], None] | None = None
    max_stack_frames: int = 8
    dump_after_s: float | None = None       # seconds; None: no faulthandler dumps (unsafe, see above; one per process)
    _beat: float = 0.0                      # perf_counter when the heartbeat last armed its timer
    _stall: tuple[float, Stall] | None = None  # the watcher's diagnosis, with the beat it is for
    _stop: threading.Event = field(default_factory=threading.Event)
    _gc_started: float | None = None
    gc_seconds: float = 0.0                 # the collector's time since run() started, every generation

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_seconds += time.perf_counter() - self._gc_started
            self._gc_started = None

    async def run(self) -> None:
        loop_thread = threading.current_thread()
        watcher = threading.Thread(target=self._watch, args=(loop_thread.ident, loop_thread.native_id),
                                   name="loop-monitor", daemon=True)
        self._beat = time.perf_counter()
        watcher.start()
        dump = tempfile.TemporaryFile("w+b") if self.dump_after_s is not None else None
        armed_at = 0.0
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                beat = self._beat = time.perf_counter()
                gc_at_beat = self.gc_seconds
                if dump is not None and beat - armed_at > self.dump_after_s / 3:  # each arm starts a C thread
                    faulthandler.dump_traceback_later(self.dump_after_s, file=dump)
                    armed_at = beat
                await asyncio.sleep(self.interval_s)
                lag = max(0.0, time.perf_counter() - beat - self.interval_s)
                if self.on_lag is not None:
                    self.on_lag(lag)
                if lag >= self.stall_s:
                    seen = self._stall
                    stall = seen[1] if seen is not None and seen[0] == beat else None
                    if self.gc_seconds - gc_at_beat >= lag / 2:
                        stall = Stall("gc", stall.stack if stall is not None else "")
                    self._report(lag, stall, _read_dump(dump))
        finally:
            gc.callbacks.remove(self._on_gc)
            self._stop.set()
            if dump is not None:
                faulthandler.cancel_dump_traceback_later()
                dump.close()

    def _report(self, lag: float, stall: Stall | None, dump: str) -> None:
        cause = stall.cause if stall is not None else "unseen"
        if self.on_stall is not None:
            self.on_stall(lag, cause)
        where = f"; the loop was at:\n{stall.stack}" if stall is not None and stall.stack else ""
        if dump:
            where += f"\nevery thread {self.dump_after_s * 1000:.0f} ms into it (faulthandler):\n{dump}"
        log.warning("event loop stalled %.0f ms (%s)%s", lag * 1000, cause, where)

    def _watch(self, loop_ident: int, loop_native_id: int) -> None:
        """Watcher thread: once a beat is stall_s / 2 late, samples the loop thread's stack and its CPU counters
        over the next stall_s / 4, once per beat (so the diagnosis is ready when the stall reaches stall_s)."""
        poll = self.stall_s / 4
        seen = None
        while not self._stop.wait(poll):
            beat = self._beat
            if beat == seen or time.perf_counter() - beat - self.interval_s < self.stall_s / 2:
                continue
            seen = beat
            before, t0 = read_schedstat(loop_native_id), time.perf_counter_ns()
            frame = sys._current_frames().get(loop_ident)
            stack = "".join(traceback.format_stack(frame, limit=self.max_stack_frames)) if frame else ""
            self._stop.wait(poll)
            after, t1 = read_schedstat(loop_native_id), time.perf_counter_ns()
            cause = "unseen" if before is None or after is None else \
                classify(after[0] - before[0], after[1] - before[1], t1 - t0)
            self._stall = (beat, Stall(cause, stack))
