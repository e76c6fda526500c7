"""CUDA GPUs as devices: a compute stream per worker, events for cross-stream ordering, a copy stream per transfer.

Untested on the CPU-only CI machines; its logic paths are the same ones the CPU device drives.
"""

from __future__ import annotations

import torch

from nodeserve.device.base import Device


class CUDADevice(Device):
    def __init__(self, index: int):
        self.index = index
        self.name = f"cuda:{index}"
        self.torch_device = torch.device("cuda", index)
        self._compute_stream = None
        self._copy_stream = None

    def init_worker_thread(self) -> None:
        torch.cuda.set_device(self.index)
        self._compute_stream = torch.cuda.Stream(self.torch_device)
        torch.cuda.set_stream(self._compute_stream)

    def init_copy_thread(self) -> None:
        torch.cuda.set_device(self.index)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.torch_device)

    def record_event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def synchronize_event(self, event) -> None:
        if event is not None:
            event.synchronize()

    def copy_stream_context(self):
        return torch.cuda.stream(self._copy_stream)
