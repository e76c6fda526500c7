"""Event-loop stalls (server/loop_monitor.py): a loop running Python is seen as runnable with its stack, one
waiting on a lock as blocked, one inside C code holding the GIL through faulthandler's dump, one inside the
garbage collector as gc, and a quiet loop reports lags of a few milliseconds and no stall."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from nodeserve.server.loop_monitor import LoopMonitor, classify, read_schedstat


def _monitor_while(action, seconds: float = 0.6) -> tuple[list[float], list[tuple[float, str]]]:
    lags, stalls = [], []
    monitor = LoopMonitor(interval_s=0.02, stall_s=0.1, dump_after_s=0.3, on_lag=lags.append,
                          on_stall=lambda s, c: stalls.append((s, c)))

    async def main():
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.1)
        action()
        await asyncio.sleep(0.1)
        task.cancel()
    asyncio.run(main())
    return lags, stalls


def spin_in_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_quiet_loop_has_no_stall():
    lags, stalls = _monitor_while(lambda: time.sleep(0))
    assert stalls == [] and len(lags) >= 5 and max(lags) < 0.1, lags


def test_a_loop_running_python_is_busy_and_the_log_names_the_function(caplog):
    with caplog.at_level(logging.WARNING, logger="nodeserve.server.loop_monitor"):
        _, stalls = _monitor_while(lambda: spin_in_python(0.4))
    assert len(stalls) == 1 and stalls[0][0] >= 0.3, stalls
    # on a CPU of its own "busy"; with other work on the machine the loop also waits for a core ("starved"):
    # runnable either way, never "blocked" (test_classify pins the boundary)
    assert stalls[0][1] in ("busy", "starved")
    assert "spin_in_python" in caplog.text


def test_a_loop_waiting_on_a_lock_is_blocked():
    lock = threading.Lock()
    lock.acquire()
    threading.Timer(0.4, lock.release).start()

    def wait_for_lock():
        with lock:
            pass
    _, stalls = _monitor_while(wait_for_lock)
    assert [c for _, c in stalls] == ["blocked"], stalls


def test_classify():
    assert classify(90, 5, 100) == "busy"
    assert classify(50, 50, 100) == "busy"  # Python on a core shared with one other thread
    assert classify(30, 65, 100) == "starved"
    assert classify(10, 10, 100) == "blocked"
    assert classify(0, 0, 0) == "unseen"


def test_schedstat_reads_this_thread():
    stat = read_schedstat(threading.get_native_id())
    if stat is None:  # a kernel without schedstat: the monitor then says "unseen"
        return
    spin_in_python(0.05)
    assert read_schedstat(threading.get_native_id())[0] - stat[0] >= 10_000_000  # even on a shared core


def hold_the_gil_in_c(values: list[float]) -> None:
    sorted(values)  # C code start to end: no other Python thread runs meanwhile


def test_a_stall_inside_c_code_that_holds_the_gil_is_dumped_by_faulthandler(caplog):
    import random
    values = [random.random() for _ in range(3_000_000)]
    start = time.perf_counter()
    sorted(values)
    if time.perf_counter() - start < 0.6:  # a faster machine: sort more
        values *= 4
    with caplog.at_level(logging.WARNING, logger="nodeserve.server.loop_monitor"):
        _, stalls = _monitor_while(lambda: hold_the_gil_in_c(values))
    assert len(stalls) == 1 and stalls[0][0] >= 0.3, stalls
    assert "faulthandler" in caplog.text and "hold_the_gil_in_c" in caplog.text


def test_a_stall_spent_in_the_garbage_collector_is_gc():
    import gc
    import math

    objects = [[i] for i in range(1_500_000)]  # the collector visits each of them on a full pass
    start = time.perf_counter()
    gc.collect()
    passes = math.ceil(0.4 / (time.perf_counter() - start))  # a stall of ~0.4 s whatever the machine's speed

    def collect():
        for _ in range(passes):
            gc.collect()
    _, stalls = _monitor_while(collect)
    del objects
    assert [c for _, c in stalls] == ["gc"], stalls


def test_thread_dumps_are_off_unless_asked_for():
    # faulthandler's dump reads running threads' frames without the GIL: it crashed a soaking server once
    # (SIGSEGV in dump_traceback), so the server arms it only with server.stall_dumps = true.
    from nodeserve.config import ServerSection

    assert LoopMonitor().dump_after_s is None and ServerSection().stall_dumps is False
