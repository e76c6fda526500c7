"""The C heap in long runs (runtime/memory): free pages given back (trim_heap) and malloc arenas capped
(limit_malloc_arenas), the fixes for RSS creep in soaks."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys

import pytest

from nodeserve.runtime import memory


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_trim_returns_the_holes_left_between_live_blocks():
    if memory._libc() is None:  # not glibc: nothing to call, and it says so
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


# Eight threads malloc at once, each holding its block until all have one; then glibc's malloc_info counts the
# arenas. A new thread's first malloc takes a fresh arena while there are fewer than the limit (8 per core).
_COUNT_ARENAS = r"""
import ctypes, os, sys, tempfile, threading
from nodeserve.runtime import memory
print("capped" if memory.limit_malloc_arenas() else "uncapped")
libc = ctypes.CDLL("libc.so.6")
barrier = threading.Barrier(8)
def work():
    block = ctypes.create_string_buffer(100_000)
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
path = tempfile.mktemp()
libc.fopen.restype = ctypes.c_void_p
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp)); libc.fclose(ctypes.c_void_p(fp))
print(open(path).read().count("<heap nr="))
os.unlink(path)
"""


def _arenas(env_extra: dict) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env_extra
    out = subprocess.run([sys.executable, "-c", _COUNT_ARENAS], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_the_server_caps_malloc_arenas_unless_the_operator_chose():
    if memory._libc() is None:
        pytest.skip("not glibc")
    said, arenas = _arenas({})
    assert said == "capped" and arenas <= memory.MAX_MALLOC_ARENAS, arenas
    said, arenas = _arenas({"MALLOC_ARENA_MAX": "6"})  # the operator's value is left alone
    assert said == "uncapped" and memory.MAX_MALLOC_ARENAS < arenas <= 6, arenas


def test_nodeserve_run_caps_the_arenas_and_fixes_the_mmap_threshold_before_loading(monkeypatch, tmp_path):
    from nodeserve import cli

    calls = []
    monkeypatch.setattr(memory, "limit_malloc_arenas", lambda: calls.append("arenas") or True)
    monkeypatch.setattr(memory, "fix_malloc_thresholds", lambda: calls.append("mmap") or True)
    (tmp_path / "bad.toml").write_text("[devices]\nmode = 'nonsense'\n")
    assert cli.main(["run", "--config", str(tmp_path / "bad.toml")]) == 2
    assert calls == ["arenas", "mmap"]


# A 16 MiB block freed, then taken and freed again, with a small block allocated after it each time (a long-lived
# one, as the server's requests leave): how much of the second one stays resident after its free.
_RESIDENT_AFTER_FREE = r"""
import ctypes, sys
from nodeserve.runtime import memory
if sys.argv[1] == "fixed":
    assert memory.fix_malloc_thresholds()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
keep = []
for _ in range(2):
    big = libc.malloc(16 << 20)
    ctypes.memset(big, 1, 16 << 20)
    keep.append(libc.malloc(200))
    before = rss()
    libc.free(ctypes.c_void_p(big))
print(rss() - before + 16)
"""


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}


def _resident_after_free(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_FREE, mode], env=_clean_env(), capture_output=True,
                         text=True, check=True).stdout
    return float(out)


def test_a_fixed_mmap_threshold_gives_every_large_block_back_on_free():
    if memory._libc() is None:
        pytest.skip("not glibc")
    assert _resident_after_free("default") > 12  # glibc raised its threshold: the second block came from the heap
    assert _resident_after_free("fixed") < 2     # the threshold fixed: the block unmapped on free


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_the_operators_malloc_thresholds_win(env):
    if memory._libc() is None:
        pytest.skip("not glibc")
    code = "from nodeserve.runtime import memory; print(memory.fix_malloc_thresholds())"
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env() | env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
