"""CPU cores as devices: one worker thread per core, one torch intra-op thread, pinned where the OS allows."""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import torch

from nodeserve.device.base import Device
from nodeserve.kernels import cpuinfo

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # CFS weight 110 against 1024: ~10 % of a core the event loop or a worker also wants


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Raises the calling thread's nice value by `nice`, for background work that must not take a core from the
    event loop or a device worker (Linux: priorities are per thread; raising the value needs no privilege).
    Returns whether it did."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except OSError as e:
        log.debug("could not lower a thread's priority: %s", e)
        return False


def has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16); under NODESERVE_KERNELS_MARCH, whether the
    CPU the kernels are built for does (x86-64-v3: no), so a simulated AVX2 machine picks what a real one picks."""
    from nodeserve.kernels import native

    if native.march() != "native":
        kernels = native.load()
        return kernels is not None and bool({"amx_bf16", "avx512_bf16"} & kernels.features)
    flags = cpuinfo.isa_flags(cpuinfo.first_processor()) or frozenset()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def core_of(index: int) -> int:
    """The core device cpu:`index` runs on: that core, or for a name past the cores this process may use, one of
    them in turn (the devices then share it; the node warns at start)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return index if index in cores else cores[index % len(cores)]


class CPUDevice(Device):
    def __init__(self, index: int, on_thread_start: Callable[[], None] | None = None,
                 on_lend: Callable[[bool], None] | None = None, core: int | None = None):
        """Device cpu:`index`, pinned to `core` (default: core `index`). Core lending (runtime/lending.py):
        on_thread_start runs in the worker thread (it borrows a helper there); on_lend is called with True / False
        as the worker idles / works. None: this core lends nothing."""
        self.core = index if core is None else core
        self.name = f"cpu:{index}"
        self.torch_device = torch.device("cpu")
        self.on_thread_start, self.on_lend = on_thread_start, on_lend

    def init_worker_thread(self) -> None:
        # One core per worker: torch releases the GIL inside ops, so one thread per core is a real split.
        torch.set_num_threads(1)
        if hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, {self.core})  # pid 0 = the calling thread on Linux
            except OSError:
                pass
        if self.on_thread_start is not None:
            self.on_thread_start()

    def lend(self, idle: bool) -> None:
        if self.on_lend is not None:
            self.on_lend(idle)

    def init_copy_thread(self) -> None:
        torch.set_num_threads(1)
