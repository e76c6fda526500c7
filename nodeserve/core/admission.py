"""Admission: the refusals a request can get before it queues, and SLO admission, which predicts its TTFT and
TPOT from a load snapshot and refuses it at once (503) when its placement would miss the SLO by more than the
margin.

The router calls `SloAdmission.check(loads, req, backlog_tokens)` before queueing a request, with every device's
load as placement sees it. It asks placement.choose_placement for the placement the devices' roles allow and
the rule picks (in the static modes the one the router itself makes), records its predicted TTFT on the request
(req.predicted_ttft, for the prediction-error histogram), and with `slo.admission = "reject"` raises SloMiss, a
QueueFull, when that placement misses the target by more than the margin.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from nodeserve.core.cost_model import CostModel
from nodeserve.core.load import DeviceLoad, SloTarget, StepLimits
from nodeserve.core.placement import Placement, choose_placement
from nodeserve.core.placer import AdaptivePlacer
from nodeserve.core.request import Request


class QueueFull(Exception):
    """Too many requests are waiting for pages; the client should retry later (503)."""


class TooLarge(Exception):
    """The request can never fit in a device's KV pool (400)."""


class SloMiss(QueueFull):
    """The request's predicted TTFT misses its SLO by more than the margin (503 + Retry-After)."""

    reject_reason = "slo"


class SloAdmission:
    def __init__(self, target: SloTarget, reject: bool, margin: float, limits: StepLimits,
                 cost: Callable[[], CostModel], local_prefill_threshold: int = 0,
                 placer: AdaptivePlacer | None = None):
        self.target, self.reject, self.margin = target, reject, margin
        self.limits, self.cost = limits, cost
        self.local_prefill_threshold = local_prefill_threshold
        self.placer = placer  # adaptive mode: predict on the roles its placement will see

    def best(self, loads: Sequence[DeviceLoad], req: Request, backlog_tokens: int = 0) -> Placement | None:
        if self.placer is not None:
            loads = self.placer.view(loads, req)
        # Requests the router still holds (no seat or pages yet) go first: their prompts count as prefill work
        # queued ahead of this one, spread over the devices (a lower bound: they may also wait for pages).
        if backlog_tokens:
            loads = [replace(x, queued_prefill_tokens=x.queued_prefill_tokens + backlog_tokens // len(loads))
                     for x in loads]
        return choose_placement(self.cost(), self.limits, self.target, loads,
                                req.num_prompt_tokens, req.max_tokens, self.local_prefill_threshold)

    def check(self, loads: Sequence[DeviceLoad], req: Request, backlog_tokens: int = 0) -> None:
        best = self.best(loads, req, backlog_tokens)
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


