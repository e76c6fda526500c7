"""A discrete-event simulation of nodeserve's workers on a measured cost model, behind `nodeserve plan`.

It replays what runtime/router.py and runtime/worker.py do, with step times from the cost model instead of a model:
the router reserves a decode seat and `prompt + max_tokens - 1` tokens of KV (the device with the most free,
then the fewest requests; FIFO when none has room), sends the prompt to the prefill device with the fewest
queued prompt tokens (or prefills it on the decode device: colocated, or under the conditional threshold), or,
in adaptive mode, places it as core/placer.py does (placement.choose_placement on the roles.RolePolicy
roles, a newly dedicated device's decodes moved to the others). Each device runs steps back to back while it has
work: every running decode (up to max_num_seqs) plus prefill chunks FIFO within max_num_batched_tokens. A
prefill's last chunk gives the first token at the step's end; its KV then lands on the decode device after the
transfer's tail. Requests produce exactly max_tokens tokens (the benchmark sends ignore_eos). Scored with
goodput.py exactly as bench/serve.py scores a live server, on the same workloads (workloads.py).

Not modelled: the event loop, tokenization and HTTP; CPU shared with the copy thread; prefill-pool pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from nodeserve import goodput
from nodeserve.core.cost_model import CostModel, StepShape
from nodeserve.core.placement import DeviceLoad, SloTarget, StepLimits, choose_placement
from nodeserve.core.roles import RoleChange, RolePolicy

PREFILL_WINDOW_S = 10.0  # as admission.PREFILL_WINDOW_S: the adaptive rule sees the same prefill share


@dataclass(frozen=True)
class Mode:
    """A device layout: one role per device (prefill, decode, colocated or adaptive)."""

    name: str
    roles: dict[str, str]

    def devices_section(self) -> dict:
        """The [devices] section that serves this mode."""
        by = lambda role: [d for d, r in self.roles.items() if r == role]  # noqa: E731
        for role in ("adaptive", "colocated"):
            if role in self.roles.values():
                return {"mode": role, "devices": by(role)}
        return {"mode": "disaggregated", "prefill": by("prefill"), "decode": by("decode")}

    def config_lines(self) -> list[str]:
        return [f"{k} = " + (f'"{v}"' if isinstance(v, str) else "[" + ", ".join(f'"{x}"' for x in v) + "]")
                for k, v in self.devices_section().items()]


def candidate_modes(devices: Sequence[str]) -> list[Mode]:
    """Colocated, every P:D split (the first P devices prefill), and adaptive."""
    modes = [Mode("colocated", {d: "colocated" for d in devices})]
    for p in range(1, len(devices)):
        modes.append(Mode(f"{p}P:{len(devices) - p}D",
                          {d: ("prefill" if i < p else "decode") for i, d in enumerate(devices)}))
    if len(devices) > 1:
        modes.append(Mode("adaptive", {d: "adaptive" for d in devices}))
    return modes


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    max_tokens: int
    prefill_dev: str = ""
    decode_dev: str = ""
    computed: int = 0                 # prompt tokens prefilled
    num_out: int = 0                  # tokens produced
    prefill_start: float | None = None
    first_token: float | None = None
    end: float | None = None

    @property
    def context(self) -> int:
        return self.prompt_len + self.num_out

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_tokens - 1


@dataclass
class SimDevice:
    name: str
    role: str
    capacity_tokens: float
    waiting: deque = field(default_factory=deque)    # to prefill here, FIFO
    running: list = field(default_factory=list)      # decoding here
    num_assigned: int = 0
    reserved_tokens: int = 0
    queued_prefill_tokens: int = 0
    busy: bool = False
    moving: bool = False                             # dedicated to prefill: move its decodes at its step's end
    steps: deque = field(default_factory=deque)      # (start, end, had prefill) within PREFILL_WINDOW_S

    def prefill_share(self, now: float) -> float:
        while self.steps and self.steps[0][1] < now - PREFILL_WINDOW_S:
            self.steps.popleft()
        busy = sum(e - max(s, now - PREFILL_WINDOW_S) for s, e, p in self.steps if p)
        return min(busy / PREFILL_WINDOW_S, 1.0)


class Simulation:
    def __init__(self, cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget,
                 local_prefill_threshold: int = 0, capacity_tokens: float = float("inf")):
        self.cost, self.mode, self.limits, self.slo = cost, mode, limits, slo
        self.threshold = local_prefill_threshold
        self.devices = {d: SimDevice(d, r, capacity_tokens) for d, r in mode.roles.items()}
        adaptive = [d for d, r in mode.roles.items() if r == "adaptive"]
        self.policy = RolePolicy(cost, limits, slo, adaptive) if adaptive else None
        self.role_changes: list[RoleChange] = []
        self.pending: deque[SimRequest] = deque()
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, requests: Sequence[SimRequest]) -> list[SimRequest]:
        for r in requests:
            self._at(r.arrival, self._arrive, r)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return list(requests)

    # ---- router ------------------------------------------------------------------------------------------
    def _arrive(self, r: SimRequest) -> None:
        if self.policy is not None:
            self.policy.observe(self.now, r.prompt_len)
        self.pending.append(r)
        self._dispatch()

    def _fits(self, d: SimDevice, r: SimRequest) -> bool:
        return (d.num_assigned < self.limits.max_num_seqs
                and d.reserved_tokens + r.reserved_tokens <= d.capacity_tokens)

    def _place(self, r: SimRequest) -> tuple[str, str] | None:
        devs = list(self.devices.values())
        if self.policy is not None:  # as core/placer.py places
            def loads() -> list[DeviceLoad]:
                # Incoming: seated there, not decoding yet (those still waiting for their prefill are counted
                # with their prompts; a KV copy in flight only by number).
                waiting = [x for p in devs for x in p.waiting]
                return [DeviceLoad(d.name, d.role, d.queued_prefill_tokens, len(d.running),
                                   sum(x.context for x in d.running),
                                   self.limits.max_num_seqs - d.num_assigned if self._fits(d, r) else 0,
                                   d.prefill_share(self.now), d.capacity_tokens - d.reserved_tokens,
                                   d.num_assigned - len(d.running),
                                   sum(x.prompt_len for x in waiting if x.decode_dev == d.name)) for d in devs]
            self._apply(self.policy.update(self.now, loads()))
            while True:
                pl = choose_placement(self.cost, self.limits, self.slo,
                                      self.policy.request_loads(loads(), self.policy.is_long(r.prompt_len)),
                                      r.prompt_len, r.max_tokens)
                if pl is not None:
                    return pl.prefill, pl.decode
                change = self.policy.free_a_seat(self.now, loads())
                if change is None:
                    return None
                self._apply([change])
        decoders = [d for d in devs if d.role in ("decode", "colocated") and self._fits(d, r)]
        if not decoders:
            return None
        dec = min(decoders, key=lambda d: (-(d.capacity_tokens - d.reserved_tokens), d.num_assigned))
        prefillers = [d for d in devs if d.role == "prefill"]
        if prefillers and r.prompt_len >= self.threshold:
            return min(prefillers, key=lambda d: d.queued_prefill_tokens).name, dec.name
        return dec.name, dec.name

    def _apply(self, changes: list[RoleChange]) -> None:
        for c in changes:
            d = self.devices[c.device]
            d.role = c.role
            self.role_changes.append(c)
            if c.role == "prefill":  # as Router.move_decodes: what it was to decode moves, at its step's end
                d.moving = True
                if not d.busy:
                    self._move_decodes(d)

    def _move_decodes(self, d: SimDevice) -> None:
        d.moving = False
        for r in [*d.running, *(x for x in d.waiting if x.decode_dev == d.name)]:
            fits = [t for t in self.devices.values() if t.role == "adaptive" and self._fits(t, r)]
            if not fits:
                continue
            t = max(fits, key=lambda t: t.capacity_tokens - t.reserved_tokens)
            d.num_assigned, d.reserved_tokens = d.num_assigned - 1, d.reserved_tokens - r.reserved_tokens
            t.num_assigned, t.reserved_tokens = t.num_assigned + 1, t.reserved_tokens + r.reserved_tokens
            r.decode_dev = t.name
            if r in d.running:  # its whole KV is copied, then it decodes there
                d.running.remove(r)
                self._at(self.now + self.cost.transfer_time(d.name, t.name, r.context), self._land, r)

    def _dispatch(self) -> None:
        while self.pending:
            r = self.pending[0]
            placed = self._place(r)
            if placed is None:
                return
            self.pending.popleft()
            r.prefill_dev, r.decode_dev = placed
            d, p = self.devices[r.decode_dev], self.devices[r.prefill_dev]
            d.num_assigned += 1
            d.reserved_tokens += r.reserved_tokens
            p.waiting.append(r)
            p.queued_prefill_tokens += r.prompt_len
            self._kick(p)

    # ---- workers -----------------------------------------------------------------------------------------
    def _kick(self, d: SimDevice) -> None:
        if d.busy:
            return
        decodes = d.running[: self.limits.max_num_seqs]
        budget = self.limits.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[SimRequest, int]] = []
        for r in d.waiting:
            if budget <= 0 or len(decodes) + len(chunks) >= self.limits.max_num_seqs:
                break
            n = min(r.prompt_len - r.computed, budget)
            if r.prefill_start is None:
                r.prefill_start = self.now
            chunks.append((r, n))
            budget -= n
        if not decodes and not chunks:
            return
        shape = StepShape.of([(n, r.computed) for r, n in chunks], [r.context for r in decodes])
        end = self.now + self.cost.step_time(d.name, shape)
        d.busy = True
        d.steps.append((self.now, end, bool(chunks)))
        self._at(end, self._step_done, d, list(decodes), chunks)

    def _step_done(self, d: SimDevice, decodes: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        # Busy until this step is accounted: a request that finishes here dispatches the next, which must not
        # start a step on this device before the chunks below are counted (it would prefill them twice).
        for r in decodes:
            r.num_out += 1
            if r.num_out >= r.max_tokens:
                self._finish(r)
        for r, n in chunks:
            r.computed += n
            d.queued_prefill_tokens -= n
            if r.computed < r.prompt_len:
                continue
            d.waiting.remove(r)
            r.first_token, r.num_out = self.now, 1
            if r.max_tokens <= 1:
                self._finish(r)
            elif r.decode_dev == d.name:
                d.running.append(r)
            else:
                tail = self.cost.transfer_tail(d.name, r.decode_dev, r.prompt_len, self.now - r.prefill_start)
                self._at(self.now + tail, self._land, r)
        if d.moving:
            self._move_decodes(d)
        d.busy = False
        self._kick(d)

    def _land(self, r: SimRequest) -> None:
        d = self.devices[r.decode_dev]
        d.running.append(r)
        self._kick(d)

    def _finish(self, r: SimRequest) -> None:
        r.end = self.now
        d = self.devices[r.decode_dev]
        if r in d.running:
            d.running.remove(r)
        d.num_assigned -= 1
        d.reserved_tokens -= r.reserved_tokens
        self._dispatch()


def records(requests: Sequence[SimRequest]) -> list[dict]:
    """Per request what bench/serve.py records for a live one (goodput.slo_attainment reads these)."""
    out = []
    for r in requests:
        ok = r.first_token is not None and r.end is not None
        ttft = r.first_token - r.arrival if ok else None
        tpot = (r.end - r.first_token) / (r.num_out - 1) if ok and r.num_out > 1 else None
        out.append({"ok": ok, "ttft": ttft, "tpot": tpot, "e2e": r.end - r.arrival if ok else None,
                    "prompt_len": r.prompt_len, "n_out": r.num_out})
    return out


def simulate(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget, workload: Sequence[tuple[int, int]],
             arrivals: Sequence[float], local_prefill_threshold: int = 0,
             capacity_tokens: float = float("inf")) -> list[dict]:
    """Records of (prompt_len, max_tokens) requests sent at `arrivals` (seconds)."""
    reqs = [SimRequest(t, p, m) for (p, m), t in zip(workload, arrivals)]
    sim = Simulation(cost, mode, limits, slo, local_prefill_threshold, capacity_tokens)
    return records(sim.run(reqs))


def attainment(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget, workload, arrivals, **kw) -> float:
    recs = simulate(cost, mode, limits, slo, workload, arrivals, **kw)
    return goodput.slo_attainment(recs, slo.ttft_s, slo.tpot_s, slo.ttft_per_token_s)["attainment"]


def predict_goodput(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget,
                    workload: Sequence[tuple[int, int]], seed: int = 0, target: float = goodput.DEFAULT_SLO_TARGET,
                    rate_min: float = 0.05, rate_max: float = 100.0, rel_tol: float = 0.02,
                    **kw) -> goodput.GoodputResult:
    """goodput.goodput_search over Poisson rates, each probe one simulation of the whole workload with
    workloads.arrival_times("poisson", ..., seed): the same search bench/compare.py runs on a live server."""
    from nodeserve import workloads

    def measure(rate: float) -> float:
        arrivals = workloads.arrival_times("poisson", len(workload), rate, seed)
        return attainment(cost, mode, limits, slo, workload, arrivals, **kw)

    return goodput.goodput_search(measure, rate_min, rate_max, target=target, rel_tol=rel_tol, tol=1e-4,
                                  max_probes=40, rate_floor=1e-3)
