"""The router's placement in `devices.mode = "adaptive"`: each request's (prefill device, decode device) from the
cost model and live load (placement.choose_placement), on device roles the role policy (roles.py) keeps.

Runs on the event loop thread: Router.admit calls observe(req) (demand for prefill devices), Router.dispatch
calls place(router, req). A role change sets the worker's role, which nothing in its step loop reads: it steers
the requests placed after it. A device dedicated to prefill also hands the requests it was to decode to the
others (Router.move_decodes): its worker moves each between two steps, with its KV, so no long prefill stalls
them there. Nothing is moved mid-step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from nodeserve.adaptive.admission import snapshot
from nodeserve.adaptive.placement import DeviceLoad, SloTarget, StepLimits, choose_placement
from nodeserve.adaptive.roles import RoleChange, RolePolicy
from nodeserve.engine.worker import Role

if TYPE_CHECKING:
    from nodeserve.adaptive.profiler import Profiler
    from nodeserve.engine.router import Router
    from nodeserve.engine.worker import Worker
    from nodeserve.request import Request

log = logging.getLogger(__name__)

MAX_ROLE_CHANGES = 10_000  # kept for /debug/steps (the timeline); older ones are dropped


class AdaptivePlacer:
    def __init__(self, profiler: Profiler, limits: StepLimits, slo: SloTarget, workers: Sequence[Worker]):
        self.profiler, self.limits, self.slo = profiler, limits, slo
        self.workers = {w.name: w for w in workers}
        self.policy = RolePolicy(profiler.model, limits, slo, [w.name for w in workers])
        self.changes: deque[RoleChange] = deque(maxlen=MAX_ROLE_CHANGES)
        self.num_changes = {w.name: 0 for w in workers}
        self.num_moved = 0  # requests sent from a newly dedicated prefill device to decode elsewhere

    def observe(self, req: Request) -> None:
        """An admitted request: a long prompt adds to the demand for prefill devices."""
        self.policy.cost = self.profiler.model  # the one the profiler holds now (a test may swap it)
        self.policy.observe(time.monotonic(), req.num_prompt_tokens)

    def loads(self, router: Router, req: Request, now: float,
              live: list[DeviceLoad] | None = None) -> list[DeviceLoad]:
        """Every device as this request's placement sees it (from `live`, a snapshot, if given): with the roles
        the policy gives it, and no seat on a device whose KV cannot hold the request now."""
        loads = [x if self.workers[x.name].kv.can_allocate(self.workers[x.name].kv.blocks_for(req.max_total_tokens))
                 else replace(x, free_seats=0) for x in (live if live is not None else snapshot(router, now))]
        return self.policy.request_loads(loads, self.policy.is_long(req.num_prompt_tokens))

    def place(self, router: Router, req: Request) -> tuple[Worker, Worker] | None:
        now = time.monotonic()
        live = snapshot(router, now)
        changes = self.policy.update(now, live)
        if changes:  # a dedication may have moved seats: look again (a give-back below moves none)
            self._apply(router, changes)
            live = snapshot(router, now)
        while True:
            pl = choose_placement(self.profiler.model, self.limits, self.slo, self.loads(router, req, now, live),
                                  req.num_prompt_tokens, req.params.max_tokens)
            if pl is not None:
                return self.workers[pl.prefill], self.workers[pl.decode]
            change = self.policy.free_a_seat(now, live)  # no adaptive device has a seat for it
            if change is None:
                return None
            self._apply(router, [change])

    def _apply(self, router: Router, changes: list[RoleChange]) -> None:
        for c in changes:
            w = self.workers[c.device]
            w.role = Role(c.role)
            moved = 0
            if w.role is Role.PREFILL:  # what it was to decode moves to the others, so no prefill stalls it
                moved = router.move_decodes(w, [x for x in self.workers.values() if x.role is Role.ADAPTIVE])
                self.num_moved += moved
            log.info("adaptive: %s -> %s (%s)%s", c.device, c.role, c.reason,
                     f"; {moved} requests sent to decode elsewhere" if moved else "")
            self.changes.append(c)
            self.num_changes[c.device] += 1
