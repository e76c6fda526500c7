"""Whether a model replica and its KV pool fit in a device's free memory, checked before anything is copied; which
C allocator serves malloc (jemalloc where installed); and, on glibc's, giving the heap's free pages back while
serving."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import itertools
import logging
import os
from typing import TYPE_CHECKING, Mapping

from nodeserve.config import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HEAP_TRIM_INTERVAL_S = 60.0
JEMALLOC_CONF = "background_thread:true"  # purge freed pages on jemalloc's own thread, also while the server idles
MAX_MALLOC_ARENAS = 2
MMAP_THRESHOLD_BYTES = 8 * 2**20  # blocks this big get their own mapping, unmapped on free
TRIM_THRESHOLD_BYTES = 64 * 2**20  # free bytes the heap's top keeps between trims
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameter numbers (malloc.h)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def check_fits(device_name: str, free_bytes: int, weight_bytes: int, kv_bytes: int) -> None:
    """A clear error, before any copy, when a GPU cannot hold what it is given: a CUDA out-of-memory error half-way
    through copying the weights names neither the model nor the fix."""
    gib = 2**30
    if weight_bytes > free_bytes:
        raise ConfigError(f"the model's weights ({weight_bytes / gib:.1f} GiB) do not fit in {device_name}'s free "
                          f"memory ({free_bytes / gib:.1f} GiB); split it over a tensor-parallel group "
                          "(\"cuda:0+cuda:1\", docs/tensor-parallel.md), or use a smaller model or dtype")
    if weight_bytes + kv_bytes > free_bytes:
        raise ConfigError(f"'kv.memory_gib' = {kv_bytes / gib:g} does not fit in {device_name}: "
                          f"{free_bytes / gib:.1f} GiB free, {weight_bytes / gib:.1f} GiB of it for the weights; "
                          f"lower it, or set 0 to use what is free less 'kv.memory_headroom'")


@functools.cache
def _libc():
    """glibc's functions, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def find_jemalloc() -> str | None:
    """jemalloc's shared library as the dynamic loader names it (libjemalloc.so.2), or None if not installed."""
    return ctypes.util.find_library("jemalloc")


def allocator_in_use() -> str:
    """"jemalloc" if this process's malloc is jemalloc's (preloaded), else "glibc"."""
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" if any("libjemalloc" in line for line in f) else "glibc"
    except OSError:
        return "glibc"


def jemalloc_environ(allocator: str, environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to run `nodeserve run` again in so that jemalloc (`library`) serves malloc, or None to go
    on with the allocator in use. allocator: the config's server.allocator (auto | jemalloc | glibc).

    Why: torch's activations come and go in every size on several threads, and glibc's arenas fragment under
    that: freed blocks are reused from all over the heap, which kept growing (the one-hour soak: +2.6 % by
    5-minute medians with two arenas, +3.6 % with one, bench/README.md) and malloc_trim's pages came back within
    seconds. jemalloc's size classes and its decay purging (on its own thread here) held the hour to +1.25 %, and
    the engine ran no slower with it (single stream +9 %, 16 streams +5 %, prefill -2 %; bench/README.md)."""
    if allocator == "glibc" or "jemalloc" in environ.get("LD_PRELOAD", ""):  # chosen, or preloaded already
        return None
    if library is None:
        if allocator == "jemalloc":
            raise ConfigError("'server.allocator' = \"jemalloc\" but libjemalloc.so.2 is not installed (Debian and "
                              "Ubuntu: apt install libjemalloc2); or set \"auto\" to use glibc's malloc without it")
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library} {environ.get('LD_PRELOAD', '')}".strip()
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)  # the operator's jemalloc options win
    return env


def limit_malloc_arenas(max_arenas: int = MAX_MALLOC_ARENAS) -> bool:
    """Caps glibc's malloc arenas at max_arenas, unless MALLOC_ARENA_MAX is set (the operator's choice wins); True
    if the cap was set. Call before the server starts its threads: each thread that mallocs takes a new arena up
    to 8 per core, and each arena keeps its own fragmented free memory.

    Why: a soak with glibc's default arenas grew RSS 1.4-3.7 MiB a minute with the Python heap flat; the same soak
    with two arenas grew 0.4-0.5 MiB a minute (bench/results/soak-15min-arena2.json)."""
    libc = _libc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, max_arenas))


def fix_malloc_thresholds(threshold: int = MMAP_THRESHOLD_BYTES, top_pad: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold at `threshold` bytes and its trim threshold at `top_pad`, unless the operator
    set either (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES); True if set. Call before the
    server starts its threads.

    Why: glibc raises the mmap threshold (to 32 MiB at most) each time a mapped block is freed, so after the first
    prefill its large activations came from the heap, whose freed blocks stay resident behind small long-lived
    ones: a soak's heap mapping grew ~45 MiB in 8 minutes while the bytes malloc had in use stayed flat
    (bench/memtrace's mallinfo2 and smaps views), and RSS crept 0.55-0.92 MiB a minute (0.29-0.41 with this,
    bench/README.md). Fixed, a block past it is unmapped on free. A prefill chunk keeps its blocks under it
    (llama.MAX_MLP_ROWS; up to ~3.6k tokens of context, where attention's repeated K/V pass 8 MiB), so it costs
    no page faults; and fixing the mmap threshold also freezes glibc's dynamic trim threshold at its 128 KiB
    default, which gave the heap's top back and faulted it in again on every layer (4-5 % of prefill): hence the
    64 MiB top pad, bounded, and returned every minute by heap_trim_loop."""
    libc = _libc()
    if libc is None or any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if any(t in os.environ.get("GLIBC_TUNABLES", "") for t in ("mmap_threshold", "trim_threshold")):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, top_pad))


def trim_heap() -> bool:
    """Returns the free memory inside the C heap's arenas to the OS (glibc malloc_trim(0)); True if any was.

    Why: every step allocates and frees activation tensors of many sizes on several threads (device workers,
    tokenizers, the loop), each with its own malloc arena; glibc returns an arena's free pages only from its top,
    so the holes between live blocks stayed resident and RSS crept up ~1 MiB a minute in a soak with the Python
    heap flat (bench/memtrace). malloc_trim also releases the pages inside the holes."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


async def heap_trim_loop(interval_s: float = HEAP_TRIM_INTERVAL_S) -> None:
    """trim_heap() every interval_s, on a thread (it walks every arena under its lock: milliseconds)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        try:
            await loop.run_in_executor(None, trim_heap)
        except Exception:  # never worth stopping the server for
            log.exception("malloc_trim failed")
