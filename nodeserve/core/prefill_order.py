"""Prefill order: which waiting prompt a device prefills first, so that as many prompts as possible meet their
TTFT target. A pure policy: the worker and the simulator install the same one on their schedulers.

First come, first served is earliest deadline first when every prompt has the same target, and EDF meets every
deadline that can be met. When they cannot all be met, it lets a long prompt that will miss anyway push every
prompt behind it past its deadline as well: on the 2-core EPYC, bimodal chat at concurrency 16 queued six long
prompts (1,500-3,000 tokens) on the one prefill core and all six missed the 2.5 s target, the last by 14 s.
Moore and Hodgson's rule (1968) maximises the number of jobs that finish on time on one machine: walk the EDF
order and, whenever the prompts kept so far cannot all finish by the current one's deadline, set aside the
longest of them. Set-aside prompts run, oldest first, in steps that have no kept prompt to run: in a step
beside a kept one they would lengthen the step, and so delay the kept prompt's first token. One that has waited
MAX_WAIT_FACTOR times its target goes first whatever its chances, so a stream of prompts that can still make it
never starves it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from nodeserve.core.cost_model import CostModel
from nodeserve.core.load import DeviceLoad, Role, SloTarget, StepLimits
from nodeserve.core.placement import prefill_steps

if TYPE_CHECKING:
    from nodeserve.core.scheduler import Seq

MAX_WAIT_FACTOR = 4.0  # a prompt older than this many times its TTFT target is set aside no more


@dataclass
class DeadlineOrder:
    """Orders a device's waiting prompts by deadline (arrival + the SLO's TTFT limit), with the prompts that
    would make a kept one late set aside (Moore-Hodgson). Prefill times come from the cost model of this device
    with its current decode batch in every step, chunked as the scheduler chunks."""

    device: str
    target: SloTarget
    limits: StepLimits
    cost: Callable[[], CostModel]
    clock: Callable[[], float]

    def __call__(self, waiting: Sequence[Seq], running: Sequence[Seq] = ()) -> tuple[list[Seq], list[Seq]]:
        """(the prompts to run first, in order; those set aside, oldest first)."""
        if len(waiting) < 2:
            return list(waiting), []
        now, cost = self.clock(), self.cost()
        if self.device not in cost.devices:
            return list(waiting), []
        load = DeviceLoad(self.device, Role.COLOCATED, num_decodes=len(running),  # (prefill_steps reads no role)
                          decode_context=sum(s.req.num_computed_tokens for s in running))

        limit = {id(s): self.target.ttft_limit(s.req.num_prompt_tokens) for s in waiting}
        overdue = [s for s in waiting if now - s.req.arrival_time > MAX_WAIT_FACTOR * limit[id(s)]]
        rest = sorted((s for s in waiting if now - s.req.arrival_time <= MAX_WAIT_FACTOR * limit[id(s)]),
                      key=lambda s: s.req.arrival_time + limit[id(s)])
        kept: list[tuple[float, int, Seq]] = []  # max-heap on seconds left: (-seconds, position, seq)
        finish = now
        for i, seq in enumerate(rest):
            req = seq.req
            seconds = prefill_steps(cost, load, self.limits, req.num_prompt_tokens, req.num_computed_tokens)[0]
            heapq.heappush(kept, (-seconds, i, seq))
            finish += seconds
            if finish > req.arrival_time + limit[id(seq)]:
                longest, _, _ = heapq.heappop(kept)
                finish += longest  # (negative: its time comes off)
        on_time = {id(s) for _, _, s in kept}
        set_aside = sorted((s for s in rest if id(s) not in on_time), key=lambda s: s.req.arrival_time)
        return overdue + [s for s in rest if id(s) in on_time], set_aside
