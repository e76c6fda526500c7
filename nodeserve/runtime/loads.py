"""Load snapshots of live workers: the DeviceLoads every placement, role and admission decision is made on.

Read from the event loop while the workers run: a slightly stale view is fine, and nothing here changes a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from nodeserve.core.load import DeviceLoad
from nodeserve.core.serving_unit import ServingUnit, StepRecords

if TYPE_CHECKING:
    from nodeserve.core.request import Request

@dataclass
class NodeLoad:
    """The whole node as one worker, for routers in front of several nodes (vLLM's gauges, SMG's /v1/loads): a
    request prefilled on one device and decoded on another counts once."""

    num_running: int                # placed and started
    num_waiting: int                # in the router's queue, or placed and not started
    num_waiting_tokens: int         # prompt tokens admitted and not yet prefilled
    num_pages: int                  # the pools admission is limited by (the decode devices')
    num_free_pages: int
    page_size: int
    max_num_seqs: int               # decode seats, over those devices
    num_prefix_queried_tokens: int  # prompt tokens placed, and of them those taken from a cache of any tier
    num_prefix_hit_tokens: int
    gen_throughput: float = 0.0     # decode tokens a second over the last PREFILL_WINDOW_S (SMG's least_load)

    @property
    def kv_usage(self) -> float:
        return (self.num_pages - self.num_free_pages) / self.num_pages if self.num_pages else 0.0


PREFILL_WINDOW_S = 10.0  # a device's prefill share is measured over its steps of the last this many seconds


def prefill_share(records: StepRecords, now: float, window: float = PREFILL_WINDOW_S) -> float:
    """Share of the last `window` seconds spent in steps with prefill chunks, from a worker's step records."""
    busy = sum(r.end - max(r.start, now - window) for r in records.since(now - window) if r.num_prefill_tokens)
    return min(busy / window, 1.0)


def decode_rate(records, now: float, window: float = PREFILL_WINDOW_S) -> float:
    """Decode tokens a second over the last `window` seconds of a worker's step records."""
    return sum(r.num_decodes if r.num_decode_tokens < 0 else r.num_decode_tokens
               for r in records.since(now - window)) / window


def worker_load(w: ServingUnit, now: float, seated: Sequence[Request], req: Request | None = None) -> DeviceLoad:
    """A worker's live load; `seated`: the requests holding a decode seat there (placed there, or moving there);
    `req`: the request being placed, whose cached prefix there is counted. A decode row's context is its computed
    tokens, as the step records the cost model is fitted on count it (start_pos)."""
    running = list(w.scheduler.running)
    decoding = {s.req.request_id for s in running}
    incoming = [r for r in seated if r.request_id not in decoding and not r.finished]
    cached = len(w.kv.lookup(req.page_hashes, req.num_prompt_tokens)) * w.kv.page_size if req is not None else 0
    dead = w.failure is not None  # nothing more is placed on a device taken for dead
    waiting = list(w.scheduler.waiting)  # one C-level copy: the worker thread may change the deque meanwhile
    return DeviceLoad(w.name, w.role, w.num_outstanding_prefill_tokens, len(running),
                      sum(s.req.num_computed_tokens for s in running), 0 if dead else w.limits.max_num_seqs - len(seated),
                      prefill_share(w.records, now), 0 if dead else w.kv.num_free * w.kv.page_size,
                      len(incoming), sum(r.num_prompt_tokens for r in incoming), cached,
                      tuple(s.req.num_prompt_tokens - s.req.num_computed_tokens for s in waiting))


def snapshot(workers: Iterable[ServingUnit], seats: Iterable[tuple[ServingUnit, Request]], now: float,
             req: Request | None = None) -> list[DeviceLoad]:
    """Every worker's load, in order; `seats`: (worker, request) for each decode seat held."""
    seated: dict[ServingUnit, list[Request]] = {}
    for w, r in seats:
        seated.setdefault(w, []).append(r)
    return [worker_load(w, now, seated.get(w, []), req) for w in workers]
