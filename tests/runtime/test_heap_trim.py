"""Giving the C heap's free pages back to the OS (runtime/memory.trim_heap), the fix for RSS creep in soaks."""

from __future__ import annotations

import asyncio
import ctypes

from nodeserve.runtime import memory


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_trim_returns_the_holes_left_between_live_blocks():
    if memory._malloc_trim() is None:  # not glibc: nothing to call, and it says so
        assert memory.trim_heap() is False
        return
    # 300 MB of heap blocks (under the mmap threshold), every other one freed: holes free() keeps resident
    blocks = [ctypes.create_string_buffer(100_000) for _ in range(3000)]
    blocks[::2] = [None] * len(blocks[::2])
    before = _rss_mib()
    assert memory.trim_heap()
    assert _rss_mib() < before - 50, (before, _rss_mib())


def test_the_loop_trims_on_its_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1) or True)

    async def run():
        task = asyncio.create_task(memory.heap_trim_loop(0.01))
        await asyncio.sleep(0.1)
        task.cancel()
    asyncio.run(run())
    assert len(calls) >= 3
