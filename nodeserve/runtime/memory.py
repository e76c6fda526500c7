"""Whether a model replica and its KV pool fit in a device's free memory, checked before anything is copied; and
giving the C heap's free pages back to the OS while serving."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import itertools
import logging

import torch

from nodeserve.config import ConfigError

log = logging.getLogger(__name__)

HEAP_TRIM_INTERVAL_S = 60.0


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def check_fits(device_name: str, free_bytes: int, weight_bytes: int, kv_bytes: int) -> None:
    """A clear error, before any copy, when a GPU cannot hold what it is given: a CUDA out-of-memory error half-way
    through copying the weights names neither the model nor the fix."""
    gib = 2**30
    if weight_bytes > free_bytes:
        raise ConfigError(f"the model's weights ({weight_bytes / gib:.1f} GiB) do not fit in {device_name}'s free "
                          f"memory ({free_bytes / gib:.1f} GiB): every GPU holds a whole replica (there is no "
                          "tensor parallelism); use a smaller model or dtype, or free the GPU")
    if weight_bytes + kv_bytes > free_bytes:
        raise ConfigError(f"'kv.memory_gib' = {kv_bytes / gib:g} does not fit in {device_name}: "
                          f"{free_bytes / gib:.1f} GiB free, {weight_bytes / gib:.1f} GiB of it for the weights; "
                          f"lower it, or set 0 to use what is free less 'kv.memory_headroom'")


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Returns the free memory inside the C heap's arenas to the OS (glibc malloc_trim(0)); True if any was.

    Why: every step allocates and frees activation tensors of many sizes on several threads (device workers,
    tokenizers, the loop), each with its own malloc arena; glibc returns an arena's free pages only from its top,
    so the holes between live blocks stayed resident and RSS crept up ~1 MiB a minute in a soak with the Python
    heap flat (bench/memtrace). malloc_trim also releases the pages inside the holes."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


async def heap_trim_loop(interval_s: float = HEAP_TRIM_INTERVAL_S) -> None:
    """trim_heap() every interval_s, on a thread (it walks every arena under its lock: milliseconds)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        try:
            await loop.run_in_executor(None, trim_heap)
        except Exception:  # never worth stopping the server for
            log.exception("malloc_trim failed")
