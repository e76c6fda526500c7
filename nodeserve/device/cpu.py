"""CPU cores as devices: one worker thread per core, one torch intra-op thread, pinned where the OS allows."""

from __future__ import annotations

import os

import torch

from nodeserve.device.base import Device


def has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class CPUDevice(Device):
    def __init__(self, core: int):
        self.core = core
        self.name = f"cpu:{core}"
        self.torch_device = torch.device("cpu")

    def init_worker_thread(self) -> None:
        # One core per worker: torch releases the GIL inside ops, so one thread per core is a real split.
        torch.set_num_threads(1)
        if hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, {self.core})  # pid 0 = the calling thread on Linux
            except OSError:
                pass

    def init_copy_thread(self) -> None:
        torch.set_num_threads(1)
