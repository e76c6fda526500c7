"""KVTransfer: moves a request's KV pages from a prefill pool to its reserved decode pages, layer by layer.

One transfer per (prefill device, decode device) pair: a copy thread and, on CUDA, a dedicated stream on each
of the two devices, both current in that thread. Jobs run strictly in FIFO order, which makes the handoff safe:
  1. the prefill worker enqueues copy_layer(i) as soon as layer i's K/V is written (an event marks that point
     on its compute stream), while later layers still compute; the copy waits on that event on the copy
     stream, never on the host;
  2. after a request's last prefill step (or its end) the prefill worker enqueues finish(request_id, pages,
     on_done), which runs after every copy of that request and records two events: `read` (the source pages
     are read) goes back to the prefill worker with the pages, whose stream waits on it before they are reused;
     `landed` (every byte written) goes to on_done, i.e. to the decode worker, whose stream waits on it before
     the request's first decode step. No host synchronisation on that path. The decode worker also decides
     what to do with a request that ended or lost a copy meanwhile: free its pages there.
A layer's pages move as a few runs of pages contiguous on both sides (one copy each, peer to peer where the
GPUs allow it), or, when they are scattered, gathered into a staging tensor, copied once and scattered.
The same code runs on CPU devices, where events are None and every op completes in order.
A copy that raises fails the requests whose pages it carried, at their handoff, and the pair keeps serving;
the copy thread never dies with jobs behind it (a dead thread would leave every later request waiting).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from nodeserve.core.reshard import reshard_plan, whole_pages
from nodeserve.device import Device
from nodeserve.kv.pool import KVPool
from nodeserve.runtime.records import RecordLog

log = logging.getLogger(__name__)


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) per maximal run where both page lists go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


MAX_DIRECT_RUNS = 8  # more runs than this per layer: one gather + copy + scatter beats a copy call per run
MAX_COPY_RECORDS = 100_000  # kept for /debug/steps and the bandwidth fit


class CopyRecord(NamedTuple):
    """One copy job: when it ran (monotonic seconds) and how many bytes it moved."""

    start: float
    end: float
    num_bytes: int


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index tensor on the device of the rank it indexes (a group's ranks are on several GPUs)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def peer_access(src: torch.device, dst: torch.device) -> bool | None:
    """Whether a GPU-to-GPU copy can go peer to peer (NVLink/PCIe); None unless both are distinct GPUs."""
    if src.type != "cuda" or dst.type != "cuda" or src == dst:
        return None
    return torch.cuda.can_device_access_peer(src.index, dst.index)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 pools are copied as uint8: the same bytes, and index/copy kernels that exist for every dtype."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


@dataclass
class PageMap:
    """Which source pages go to which destination pages, built once per step and reused for every layer:
    either a few contiguous runs, or index tensors for a gather/scatter through a staging tensor."""

    runs: list[tuple[int, int, int]] | None  # (src_start, dst_start, length); None: stage
    src: torch.Tensor | None = None          # [N] int64 on the source device, when staging
    dst: torch.Tensor | None = None          # [N] int64 on the destination device, when staging
    request_ids: tuple[str, ...] = ()        # whose pages these are: the requests a failed copy fails


@dataclass
class _CopyLayer:
    layer: int
    pages: PageMap
    ready: Any               # event after which the source pages of this layer are written


@dataclass
class _AfterCopies:
    on_done: Callable[[Any], None]  # (event on the destination stream after every copy queued before)


@dataclass
class _Finish:
    request_id: str
    src_pages: list[int]                    # the request's pages in the source pool, freed after the copies
    num_copied_pages: int                   # pages its copies carried, and pages the destination already held
    num_cached_pages: int
    on_done: Callable[[Any, str | None], None]  # (event the decode stream must wait on, error of a failed copy)
    queued_at: float


class KVTransfer:
    def __init__(self, src_device: Device, src_pool: KVPool, dst_device: Device, dst_pool: KVPool,
                 free_src_pages: Callable[[list[int], Any], None],
                 on_transfer: Callable[[float, int, int], None] | None = None):
        """free_src_pages(pages, event): frees prefill pages once the prefill stream has waited on `event`
        (a FreePages message to the prefill worker, run in its own thread)."""
        self.src_device, self.src_pool = src_device, src_pool
        self.dst_device, self.dst_pool = dst_device, dst_pool
        self.name = f"kv {src_device.name}->{dst_device.name}"
        self.free_src_pages = free_src_pages
        # Which heads of which source rank go to which destination rank (core/reshard.py); one whole-page copy per
        # rank when both sides hold heads alike.
        self.plan = reshard_plan(src_pool.heads, dst_pool.heads)
        self.whole_pages = whole_pages(self.plan, src_pool.heads, dst_pool.heads)
        self.on_transfer = on_transfer
        self.max_direct_runs = MAX_DIRECT_RUNS
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._failed: dict[str, str] = {}  # request id -> error of a copy that carried its pages; copy thread only
        self._stopped = False
        self.busy_since: float | None = None  # when the job in hand started (the watchdog's view); None: idle
        self.num_bytes = 0        # bytes copied so far
        self.busy_seconds = 0.0   # time spent copying, for the device timeline
        self.records = RecordLog(CopyRecord, MAX_COPY_RECORDS)

    def start(self) -> None:
        peer = peer_access(self.src_device.torch_device, self.dst_device.torch_device)
        if peer is True:
            log.info("%s: peer-to-peer copies", self.name)
        elif peer is False:
            log.warning("%s: no peer access between these GPUs; copies are staged through host memory (slower)",
                        self.name)
        self._thread.start()

    @property
    def dead(self) -> bool:
        """Its thread ended without being stopped: every later request of this pair would wait forever."""
        return self._thread.ident is not None and not self._thread.is_alive() and not self._stopped

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    # Called from the prefill worker thread.
    def page_indices(self, src_pages: list[int], dst_pages: list[int], request_ids: tuple[str, ...] = ()) -> PageMap:
        runs = contiguous_runs(src_pages, dst_pages)
        if len(runs) <= self.max_direct_runs:
            return PageMap(runs, request_ids=request_ids)
        return PageMap(None, torch.tensor(src_pages, dtype=torch.int64, device=self.src_device.torch_device),
                       torch.tensor(dst_pages, dtype=torch.int64, device=self.dst_device.torch_device), request_ids)

    def copy_layer(self, layer: int, pages: PageMap) -> None:
        self._jobs.put(_CopyLayer(layer, pages, self.src_device.record_event()))

    def after_copies(self, on_done: Callable[[Any], None]) -> None:
        """Calls on_done(landed) from the copy thread once every copy queued before is issued; `landed` marks
        their end on the destination stream (a live migration's round, or pages of an abandoned move)."""
        self._jobs.put(_AfterCopies(on_done))

    def finish(self, request_id: str, src_pages: list[int], on_done: Callable[[Any, str | None], None],
               num_copied_pages: int = 0, num_cached_pages: int = 0) -> None:
        """num_copied_pages, num_cached_pages: for the transfer metrics (pages sent, pages the decode side had)."""
        self._jobs.put(_Finish(request_id, src_pages, num_copied_pages, num_cached_pages, on_done,
                               time.monotonic()))

    def _run(self) -> None:
        self.src_device.init_copy_thread()
        src_stream, dst_stream = self.src_device.new_stream(), self.dst_device.new_stream()
        with self.src_device.use_stream(src_stream), self.dst_device.use_stream(dst_stream):
            while (job := self._jobs.get()) is not None:
                self.busy_since = time.monotonic()
                try:
                    if isinstance(job, _CopyLayer):
                        self._copy(job)
                    elif isinstance(job, _AfterCopies):
                        job.on_done(self.dst_device.record_event())
                    else:
                        self._finish(job)
                except Exception:
                    log.exception("%s: %s failed", self.name, type(job).__name__.strip("_"))
                    error = f"KV transfer {self.name} failed (the error is in the server log)"
                    if isinstance(job, _CopyLayer):
                        self._failed.update((rid, error) for rid in job.pages.request_ids)
                    elif isinstance(job, _Finish):
                        self._give_up(job, error)
                self.busy_since = None

    def _copy(self, job: _CopyLayer) -> None:
        start = time.monotonic()
        self.src_device.wait_event(job.ready)
        # The destination pages were free before the router handed them over: whatever the destination device
        # queued on them before freeing them (compute, or another pair's copy out of them) must be done first.
        self.dst_device.wait_event(self.dst_pool.freed_event)
        nbytes = self._copy_pages(job.layer, job.pages)
        end = time.monotonic()
        self.num_bytes += nbytes
        self.busy_seconds += end - start
        self.records.append(CopyRecord(start, end, nbytes))

    def _copy_pages(self, layer: int, pages: PageMap) -> int:
        """Issues one layer's copy on the transfer's streams, one part per HeadCopy of the reshard plan (between
        single devices or groups of one layout: whole pages, rank to rank); returns the bytes moved."""
        if pages.src is not None:
            # The index tensors were made on the prefill worker's thread, on other streams: without record_stream
            # a block freed there could be reused while these copies still read it, scattering KV into the wrong
            # pages. `staged` is allocated and used on the transfer's own streams only, so stream-ordered reuse
            # covers it.
            self.src_device.record_stream(pages.src)
            self.dst_device.record_stream(pages.dst)
        nbytes = 0
        for c in self.plan:
            src = _as_bytes(self.src_pool.shards[c.src_rank].layers[layer])  # [pages, 2, P, heads of rank, D]
            dst = _as_bytes(self.dst_pool.shards[c.dst_rank].layers[layer])
            if not self.whole_pages:
                src = src[:, :, :, c.src_head:c.src_head + c.num_heads]
                dst = dst[:, :, :, c.dst_head:c.dst_head + c.num_heads]
            if pages.runs is not None:
                for s, d, n in pages.runs:
                    dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
                nbytes += sum(n for _, _, n in pages.runs) * src[0].numel() * src.element_size()
                continue
            assert pages.src is not None and pages.dst is not None  # PageMap: runs, or both index tensors
            staged = src.index_select(0, _on(pages.src, src.device)).to(dst.device, non_blocking=True)
            dst.index_copy_(0, _on(pages.dst, dst.device), staged)
            nbytes += staged.numel() * staged.element_size()
        return nbytes

    def _finish(self, job: _Finish) -> None:
        read = self.src_device.record_event()     # on the source stream, after every copy reading the pages
        landed = self.dst_device.record_event()   # on the destination stream, after every write of them
        self.free_src_pages(job.src_pages, read)
        job.src_pages = []  # given back: a failure from here on must not free them twice
        error = self._failed.pop(job.request_id, None)
        if error is None and self.on_transfer is not None:
            # Time from the last prefill step to the handoff: the part of the copy the layer-by-layer overlap did
            # not hide on CPU. On CUDA it is the host side only (no sync here).
            page_bytes = self.src_pool.bytes_per_page_per_layer * self.src_pool.num_layers
            self.on_transfer(time.monotonic() - job.queued_at, job.num_copied_pages * page_bytes,
                             job.num_cached_pages * page_bytes)
        job.on_done(landed, error)

    def _events(self) -> tuple[Any, Any]:
        """(read, landed): events after every copy queued so far, on the source and the destination stream; None
        for one that cannot be recorded (the device failed): then the pages are freed without waiting."""
        events = []
        for device in (self.src_device, self.dst_device):
            try:
                events.append(device.record_event())
            except Exception:
                log.exception("%s: recording an event failed", self.name)
                events.append(None)
        return events[0], events[1]

    def _give_up(self, job: _Finish, error: str) -> None:
        """The handoff itself raised: free the source pages and let the decode side fail the request."""
        self._failed.pop(job.request_id, None)
        read, landed = self._events()
        free = (lambda: self.free_src_pages(job.src_pages, read)) if job.src_pages else (lambda: None)
        for step in (free, lambda: job.on_done(landed, error)):
            try:
                step()
            except Exception:
                log.exception("%s: cleaning up request %s failed", self.name, job.request_id)
