"""The device interface: what the scheduler, workers and KV transfer need from CPU cores or CUDA GPUs.

Everything stream- or event-shaped goes through here, so a CUDA path (streams, P2P copies, graphs) and the
CPU path (one pinned thread per core, synchronous ops) share the same worker and transfer code.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch


class DeviceNameError(ValueError):
    pass


_NAME = re.compile(r"^(cpu|cuda):(\d+)$")


def parse_device_name(name: str) -> str:
    """The canonical form of a device name: "cpu:N", "cuda:N", or a tensor-parallel group of them joined by "+"
    ("cuda:0+cuda:1"), whose ranks are of one kind and distinct."""
    ranks = []
    for part in name.strip().lower().split("+"):
        m = _NAME.match(part.strip())
        if not m:
            raise DeviceNameError(f"'{name}' is not a device name; write cpu:N (a CPU core), cuda:N (a GPU), or a "
                                  "tensor-parallel group of them joined by '+' (cuda:0+cuda:1)")
        ranks.append(f"{m.group(1)}:{int(m.group(2))}")
    if len({r.split(":")[0] for r in ranks}) > 1:
        raise DeviceNameError(f"'{name}' mixes CPU cores and GPUs; a tensor-parallel group is of one kind")
    if len(set(ranks)) < len(ranks):
        raise DeviceNameError(f"'{name}' names a device twice; each rank of a group is a different device")
    return "+".join(ranks)


def group_ranks(name: str) -> list[str]:
    """The devices of a (canonical) device name: one for a single device, each rank's for a group."""
    return name.split("+")


def available_devices() -> list[str]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    names = [f"cpu:{c}" for c in cores]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return names


def upload(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a host tensor, or values to make one of) on `device`. To a GPU through pinned memory, without
    blocking: a copy from pageable memory synchronises the stream, i.e. the host waits for all queued GPU work."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Device:
    """One compute device. Methods that take or return events are no-ops on CPU, where every op has
    finished by the time the issuing thread moves on."""

    name: str
    torch_device: torch.device

    def init_worker_thread(self) -> None:
        """Called first thing in the worker thread that owns this device."""

    def init_copy_thread(self) -> None:
        """Called first thing in a KV transfer thread that copies out of this device."""

    def lend(self, idle: bool) -> None:
        """The worker thread's own: True while it waits for work (its core may help another device), False before
        it runs anything. A no-op unless core lending is set up (runtime/lending.py)."""

    def record_event(self) -> Any:
        """An event marking the work issued so far on this device's current stream (of the calling thread)."""
        return None

    def wait_event(self, event: Any) -> None:
        """Make the current stream wait for `event` without blocking the host."""

    def synchronize_event(self, event: Any) -> None:
        """Block the host until `event` has completed."""

    def record_stream(self, tensor: Any) -> None:
        """Tell the caching allocator that `tensor`, allocated on another stream, is used on this device's current
        stream: its memory is not handed out again before the work issued here so far has run."""

    def new_stream(self) -> Any:
        """A stream of its own on this device (a KV transfer makes one per device pair); None on CPU."""
        return None

    def use_stream(self, stream: Any):
        """Context manager under which ops on this device are issued on `stream` (from new_stream())."""
        import contextlib

        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return self.name
