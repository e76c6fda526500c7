"""A tensor-parallel group as one device: its ranks' devices behind the Device interface.

The control plane sees one device (one worker, one scheduler, one KV page-id space). The group's worker thread is
rank 0's; the other ranks' threads belong to the group's model (runtime/tp_group.py). Events and streams are
per rank: an event of a group is the tuple of its ranks' events, and waiting on any event makes every rank wait.
On CPU every one of them is None, as for a single core.
"""

from __future__ import annotations

import contextlib
from typing import Any

from nodeserve.device.base import Device


class DeviceGroup(Device):
    def __init__(self, ranks: list[Device]):
        self.ranks = ranks
        self.name = "+".join(r.name for r in ranks)
        self.torch_device = ranks[0].torch_device  # where the runner's step inputs and the logits live

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def init_worker_thread(self) -> None:
        self.ranks[0].init_worker_thread()

    def init_copy_thread(self) -> None:
        for r in self.ranks:
            r.init_copy_thread()

    def record_event(self) -> Any:
        events = tuple(r.record_event() for r in self.ranks)
        return None if all(e is None for e in events) else events

    def wait_event(self, event: Any) -> None:
        for e in _flatten(event):
            for r in self.ranks:
                r.wait_event(e)

    def synchronize_event(self, event: Any) -> None:
        for e, r in zip(_flatten(event), self.ranks * len(self.ranks)):
            r.synchronize_event(e)

    def record_stream(self, tensor: Any) -> None:
        for r in self.ranks:
            if r.torch_device == tensor.device:
                r.record_stream(tensor)
                return

    def new_stream(self) -> Any:
        streams = tuple(r.new_stream() for r in self.ranks)
        return None if all(s is None for s in streams) else streams

    def use_stream(self, stream: Any):
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for r, s in zip(self.ranks, stream):
            stack.enter_context(r.use_stream(s))
        return stack


def _flatten(event: Any) -> tuple:
    if event is None:
        return ()
    return tuple(e for e in event if e is not None) if isinstance(event, tuple) else (event,)
