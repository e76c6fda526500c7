"""CUDA GPUs as devices: a compute stream per worker, events for cross-stream ordering, copy streams for transfers.

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

    def init_worker_thread(self) -> None:
        torch.cuda.set_device(self.index)
        self._compute_stream = torch.cuda.Stream(self.torch_device)
        torch.cuda.set_stream(self._compute_stream)

    def init_copy_thread(self) -> None:
        torch.cuda.set_device(self.index)

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

    def record_stream(self, tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.torch_device))

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.torch_device)

    def use_stream(self, stream: torch.cuda.Stream):
        # Current on the stream's own device (per thread): entered once per device, a transfer's pair of streams
        # is current on both ends, which is what a cross-device copy_ queues on and synchronises with.
        return torch.cuda.stream(stream)
