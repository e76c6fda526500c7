"""The C heap in long runs (runtime/memory): free pages given back (trim_heap) and malloc arenas capped
(limit_malloc_arenas), the fixes for RSS creep in soaks."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys

import pytest

from nodeserve.config import ConfigError
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


def _run_calls(monkeypatch, tmp_path, allocator: str, library: str | None, in_use: str = "glibc") -> list:
    """What `nodeserve run` does before loading, in order, with the server's run(), os.execve and the signal mask
    recorded (cli._run: the part of the command that does not end the process)."""
    from nodeserve import cli
    from nodeserve.server import serve

    calls: list = []
    monkeypatch.setattr(memory, "find_jemalloc", lambda: library)
    monkeypatch.setattr(memory, "allocator_in_use", lambda: in_use)
    monkeypatch.setattr(memory, "limit_malloc_arenas", lambda: calls.append("arenas") or True)
    monkeypatch.setattr(memory, "fix_malloc_thresholds", lambda: calls.append("mmap") or True)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append(("exec", path, list(argv), env)))
    monkeypatch.setattr(signal, "pthread_sigmask", lambda how, sigs: calls.append(("mask", how, set(sigs))))
    monkeypatch.setattr(serve, "run", lambda config: calls.append("run") or 0)
    (tmp_path / "ok.toml").write_text(f"[server]\nallocator = {allocator!r}\n")
    assert cli._run(cli.build_parser().parse_args(["run", "--config", str(tmp_path / "ok.toml")])) == 0
    return calls


def test_nodeserve_run_caps_the_arenas_and_fixes_the_mmap_threshold_before_loading(monkeypatch, tmp_path):
    assert _run_calls(monkeypatch, tmp_path, "auto", None) == ["arenas", "mmap", "run"]
    assert _run_calls(monkeypatch, tmp_path, "glibc", "libjemalloc.so.2") == ["arenas", "mmap", "run"]


def test_nodeserve_run_runs_itself_again_with_jemalloc_when_the_system_has_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LD_PRELOAD", "libextra.so")
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    calls = _run_calls(monkeypatch, tmp_path, "auto", "libjemalloc.so.2")
    # SIGTERM / SIGINT stay blocked across the exec: pending until the new image has its handlers
    assert calls[0] == ("mask", signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    (exec_call, path, argv, env), rest = calls[1], calls[2:]
    assert exec_call == "exec" and path == sys.executable and argv == sys.orig_argv  # the same command
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libextra.so" and env["MALLOC_CONF"] == memory.JEMALLOC_CONF
    assert rest == ["arenas", "mmap", "run"]  # (only because execve was recorded, not done)
    # run again: jemalloc serves malloc, so no third run, and glibc's arenas and thresholds are left alone
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])
    assert _run_calls(monkeypatch, tmp_path, "auto", "libjemalloc.so.2", in_use="jemalloc") == ["run"]


def test_jemalloc_environ():
    lib = "libjemalloc.so.2"
    assert memory.jemalloc_environ("glibc", {}, lib) is None
    assert memory.jemalloc_environ("auto", {}, None) is None  # not installed: glibc, no error
    with pytest.raises(ConfigError, match="apt install libjemalloc2"):
        memory.jemalloc_environ("jemalloc", {}, None)
    env = memory.jemalloc_environ("jemalloc", {"PATH": "/bin", "MALLOC_CONF": "narenas:2"}, lib)
    assert env == {"PATH": "/bin", "LD_PRELOAD": lib, "MALLOC_CONF": "narenas:2"}  # the operator's options win
    # preloaded already (this is the run again, or the operator's own LD_PRELOAD): never again
    assert memory.jemalloc_environ("auto", {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, lib) is None


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


@pytest.mark.parametrize("allocator", ["auto", "glibc"])
def test_nodeserve_run_serves_malloc_from_jemalloc_unless_told_glibc(tmp_path, allocator):
    """The real command: run again with jemalloc preloaded (auto), or not at all (glibc); the log says which. The
    model path does not exist, so it stops right after the line."""
    if memory.find_jemalloc() is None:
        pytest.skip("libjemalloc is not installed (apt install libjemalloc2)")
    config = tmp_path / "nodeserve.toml"
    config.write_text(f'[model]\npath = "{tmp_path}/none.gguf"\n[server]\nport = 0\nallocator = "{allocator}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-m", "nodeserve", "run", "--config", str(config), "--log-level", "info"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "cannot load model" in proc.stderr, proc.stderr
    expected = "jemalloc" if allocator == "auto" else "glibc"
    assert f"malloc: {expected}\n" in proc.stderr, proc.stderr
