"""KVTransfer: moves a request's KV pages from a prefill pool to its reserved decode pages, layer by layer.

One transfer (a copy thread, and on CUDA a dedicated copy stream) per (prefill device, decode device) pair.
Jobs run strictly in FIFO order, which is what makes the handoff safe:
  1. the prefill worker enqueues copy_layer(i) as soon as layer i's K/V is written (the event marks that
     point on its compute stream; on CPU the write has already finished), while later layers still compute;
  2. after a request's last prefill step it enqueues finish(req), which therefore runs after every copy of
     that request: it frees the prefill pages and hands the request to the decode worker, or, if the
     request was aborted meanwhile, frees the decode reservation too. Nothing is freed while a copy may
     still read or write it, and nothing is left behind.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nodeserve.device import Device
from nodeserve.kv.pool import KVPool
from nodeserve.request import Request


@dataclass
class _CopyLayer:
    layer: int
    src_pages: torch.Tensor  # [N] on the source device
    dst_pages: torch.Tensor  # [N] on the destination device
    ready: Any               # event after which the source pages of this layer are written


@dataclass
class _Finish:
    request: Request
    deliver: Callable[[Request, Any], None]   # (request, event the decode stream must wait on)
    release: Callable[[Request], None]        # frees the decode reservation of an aborted/finished request


class KVTransfer:
    def __init__(self, src_device: Device, src_pool: KVPool, dst_device: Device, dst_pool: KVPool,
                 on_transfer: Callable[[float, int], None] | None = None):
        self.src_device, self.src_pool = src_device, src_pool
        self.dst_device, self.dst_pool = dst_device, dst_pool
        self.name = f"kv {src_device.name}->{dst_device.name}"
        self.on_transfer = on_transfer
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.num_bytes = 0        # bytes copied so far
        self.busy_seconds = 0.0   # time spent copying, for the device timeline
        self.records: list[tuple[float, float, int]] = []  # (start, end, bytes) per copy, bounded below

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    # Called from the prefill worker thread.
    def page_indices(self, src_pages: list[int], dst_pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(src_pages, dtype=torch.int64, device=self.src_device.torch_device),
                torch.tensor(dst_pages, dtype=torch.int64, device=self.dst_device.torch_device))

    def copy_layer(self, layer: int, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        self._jobs.put(_CopyLayer(layer, src_pages, dst_pages, self.src_device.record_event()))

    def finish(self, request: Request, deliver: Callable[[Request, Any], None],
               release: Callable[[Request], None]) -> None:
        self._jobs.put(_Finish(request, deliver, release))

    def _run(self) -> None:
        self.src_device.init_copy_thread()
        with self.src_device.copy_stream_context():
            while (job := self._jobs.get()) is not None:
                if isinstance(job, _CopyLayer):
                    self._copy(job)
                else:
                    self._finish(job)

    def _copy(self, job: _CopyLayer) -> None:
        start = time.monotonic()
        self.src_device.wait_event(job.ready)
        src, dst = self.src_pool.layers[job.layer], self.dst_pool.layers[job.layer]
        # Gather scattered pages into one staging tensor, move it once, scatter on the destination.
        staged = src.index_select(0, job.src_pages).to(self.dst_device.torch_device, non_blocking=True)
        dst.index_copy_(0, job.dst_pages, staged)
        nbytes = staged.numel() * staged.element_size()
        end = time.monotonic()
        self.num_bytes += nbytes
        self.busy_seconds += end - start
        if len(self.records) < 100_000:
            self.records.append((start, end, nbytes))

    def _finish(self, job: _Finish) -> None:
        req = job.request
        done = self.src_device.record_event()
        # The prefill pages may be reused by the next prompt only once every copy reading them is done.
        self.src_device.synchronize_event(done)
        self.src_pool.allocator.free(req.prefill_pages)
        req.prefill_pages = []
        if req.aborted or req.finished:
            job.release(req)
            return
        if self.on_transfer is not None:
            # Time the handoff waited after the last prefill forward: the part of the copy the layer-by-layer
            # overlap did not hide. Bytes: every layer's K and V of the prompt's pages.
            waited = time.monotonic() - req.timings.get("prefill_end", time.monotonic())
            num_pages = -(-req.num_prompt_tokens // self.src_pool.page_size)
            self.on_transfer(waited, num_pages * self.src_pool.bytes_per_page_per_layer * len(self.src_pool.layers))
        job.deliver(req, done)
