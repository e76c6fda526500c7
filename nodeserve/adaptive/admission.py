"""SLO admission: the router's hook that predicts a request's TTFT from live load and refuses it at once (503)
when its placement would miss the TTFT SLO by more than the margin.

Router.admit calls `SloAdmission(router, req)` before queueing a request. It snapshots the workers
(`snapshot`), asks placement.choose_placement for the placement the devices' roles allow and the rule picks (in
the static modes the one the router itself makes), records its predicted TTFT on the request
(req.predicted_ttft, for the prediction-error histogram), and with `slo.admission = "reject"` raises
SloMiss, a QueueFull, when that TTFT misses the target by more than the margin.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from nodeserve.adaptive.placement import DeviceLoad, Placement, SloTarget, StepLimits, choose_placement
from nodeserve.engine.router import QueueFull

if TYPE_CHECKING:
    from nodeserve.adaptive.placer import AdaptivePlacer
    from nodeserve.adaptive.profiler import Profiler
    from nodeserve.config import SloSection
    from nodeserve.engine.engine import Engine
    from nodeserve.engine.router import Router
    from nodeserve.engine.worker import Worker
    from nodeserve.request import Request

REFINE_INTERVAL_S = 1.0  # refit the cost model from fresh step records at most this often
PREFILL_WINDOW_S = 10.0  # a device's prefill share is measured over its steps of the last this many seconds


class SloMiss(QueueFull):
    """The request's predicted TTFT misses its SLO by more than the margin (503 + Retry-After)."""

    reject_reason = "slo"


def prefill_share(records, now: float, window: float = PREFILL_WINDOW_S) -> float:
    """Share of the last `window` seconds spent in steps with prefill chunks, from a worker's step records
    (read from the newest back by index: the worker thread may append meanwhile, which iterating would not allow)."""
    busy, i = 0.0, 1
    while i <= len(records):
        try:
            r = records[-i]
        except IndexError:
            break
        if r.end < now - window:
            break
        if r.num_prefill_tokens:
            busy += r.end - max(r.start, now - window)
        i += 1
    return min(busy / window, 1.0)


def worker_load(w: Worker, now: float, seated: list[Request]) -> DeviceLoad:
    """A worker's live load; `seated`: the requests the router placed there for decode. Read from the event loop
    while the worker runs: a slightly stale view is fine."""
    running = list(w.scheduler.running)
    decoding = {s.req.request_id for s in running}
    incoming = [r for r in seated if r.request_id not in decoding and not r.finished]
    return DeviceLoad(w.name, w.role, w.num_outstanding_prefill_tokens, len(running),
                      sum(s.req.num_tokens for s in running), w.limits.max_num_seqs - len(seated),
                      prefill_share(w.records, now), w.kv.num_free * w.kv.page_size,
                      len(incoming), sum(r.num_prompt_tokens for r in incoming))


def snapshot(router: Router, now: float) -> list[DeviceLoad]:
    """What placement.choose_placement takes: every device's load, prefill devices first."""
    seated: dict[Worker, list[Request]] = {}
    for rid, w in list(router.placements.items()):
        seated.setdefault(w, []).append(router.placed[rid])
    return [worker_load(w, now, seated.get(w, [])) for w in router.prefill_workers + router.decode_workers]


class SloAdmission:
    def __init__(self, slo: SloSection, profiler: Profiler, limits: StepLimits, local_prefill_threshold: int,
                 placer: AdaptivePlacer | None = None):
        self.target = SloTarget(slo.ttft_s, slo.tpot_s, slo.ttft_per_token_s)
        self.reject, self.margin = slo.admission == "reject", slo.margin
        self.profiler, self.limits = profiler, limits
        self.local_prefill_threshold = local_prefill_threshold
        self.placer = placer  # adaptive mode: predict on the roles its placement will see
        self._refined = 0.0

    def best(self, router: Router, req: Request, now: float) -> Placement | None:
        if now - self._refined > REFINE_INTERVAL_S:
            self.profiler.refine()
            self._refined = now
        loads = self.placer.loads(router, req, now) if self.placer is not None else snapshot(router, now)
        # Requests the router still holds (no seat or pages yet) go first: their prompts count as prefill work
        # queued ahead of this one, spread over the devices (a lower bound: they may also wait for pages).
        backlog = sum(r.num_prompt_tokens for r in router.pending)
        if backlog:
            loads = [replace(x, queued_prefill_tokens=x.queued_prefill_tokens + backlog // len(loads)) for x in loads]
        return choose_placement(self.profiler.model, self.limits, self.target, loads,
                                req.num_prompt_tokens, req.params.max_tokens, self.local_prefill_threshold)

    def __call__(self, router: Router, req: Request) -> None:
        best = self.best(router, req, time.monotonic())
        if best is None:
            # Every decode seat (or, in adaptive mode, the KV for it) is taken: it would wait for one for as long
            # as the requests ahead take to finish, which no SLO can count on; without rejection the router's
            # queue decides, as without admission.
            if self.reject:
                raise SloMiss("no device has a decode seat and the KV for it now")
            return
        req.predicted_ttft = best.ttft
        if not self.reject:
            return
        limit = self.target.ttft_limit(req.num_prompt_tokens)
        if best.ttft > limit * (1 + self.margin):
            raise SloMiss(f"its predicted time to first token, {best.ttft:.1f}s, misses the {limit:.1f}s target")
        # Decode: its own time per output token in the batch it joins, and that of the requests its prefill
        # chunks would stall; admitting it past either would drag requests already admitted past their SLO.
        tpot = max(best.tpot, best.others_tpot if best.num_others else 0.0)
        if tpot > self.target.tpot_s * (1 + self.margin):
            raise SloMiss(f"its predicted time per output token, {tpot * 1000:.0f}ms, misses the "
                          f"{self.target.tpot_s * 1000:.0f}ms target")


def install(engine: Engine) -> Profiler:
    """At the end of Engine.warmup: the cost model (measured unless profile.startup is false) and, with a
    profile, the router's admission hook and, in adaptive mode, its placer. Returns the profiler (GET
    /debug/profile reads it)."""
    from nodeserve.adaptive.profiler import Profiler

    from nodeserve.adaptive.placer import AdaptivePlacer

    cfg = engine.config
    profiler = Profiler(engine.workers)
    if cfg.profile.startup:
        profiler.measure(cfg.profile.budget_s)
        limits = StepLimits(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
        if cfg.devices.mode == "adaptive":
            engine.router.placer = AdaptivePlacer(profiler, limits, SloTarget(cfg.slo.ttft_s, cfg.slo.tpot_s,
                                                                               cfg.slo.ttft_per_token_s),
                                                  engine.workers)
        engine.router.admission = SloAdmission(cfg.slo, profiler, limits, cfg.devices.local_prefill_threshold,
                                               engine.router.placer)
    return profiler
