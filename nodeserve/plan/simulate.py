"""A discrete-event simulation of nodeserve on a measured cost model, behind `nodeserve plan`.

It runs the engine's own control plane on a virtual clock, with no copy of its rules: the runtime's Router
(runtime/router.py: admission's size checks, the core's PendingQueue order, the core placer's decisions, page
reservations, role changes, moves and seats), given `clock=` this simulation's time, over virtual devices that
offer it what a Worker does; each device batches with a core Scheduler (core/scheduler.py) over a KVManager
(kv/manager.py) holding its pages, and a live move goes round by round as core.handoff.next_migration_step says.
What is simulated here is only what a worker does around them (runtime/worker.py: a turn is inbox, migrations, one
step; what a step's StepOutput does): every step's duration is CostModel.step_time of its shape, a prefill's KV
lands on its decode device CostModel.transfer_tail after the prefill ends, a pre-copy round or a move's last copy
takes CostModel.transfer_time of its pages.

Requests are core Requests of dummy token ids; every sampled token is token 0 and requests run to max_tokens
(ignore_eos, as the benchmark sends them). Scored with goodput.py exactly as bench/serve.py scores a live server,
on the same workloads (workloads.py).

Not modelled: the event loop, tokenization and HTTP; the server's queue limits and SLO admission; the CPU the copy
thread shares; copies on one link running one after another (each copy takes its own time, in parallel); the
prefix cache (off); CPU core lending (runtime/lending.py: a step takes its device's own time, lent or not). With
capacity_tokens infinite, each device's pool is sized so that pages never run out (equal on every device, so the
placers choose as with infinite pools); a mapping gives each device its own (tensor-parallel groups of different
degrees hold different pools).
"""

from __future__ import annotations

import heapq
import itertools
from functools import partial
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from nodeserve import goodput
from nodeserve.config import DevicesSection
from nodeserve.core.admission import TooLarge
from nodeserve.core.cost_model import CostModel, StepShape
from nodeserve.core.handoff import (Arrival, FreePages, Handoff, Migrate, Migration, MigrationOutcome, MigrationStep,
                                    next_migration_step)
from nodeserve.core.load import Role, SloTarget, StepLimits
from nodeserve.core.placer import AdaptivePlacer, Placer, PlacerTiming, StaticPlacer
from nodeserve.core.prefill_order import DeadlineOrder
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.roles import ROLE_TICK_S, RoleChange
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.core.scheduler import Batch, PageLoad, Scheduler, Seq, StepOutput, WorkerLimits
from nodeserve.core.side_prefill import SidePrefill
from nodeserve.kv.manager import KVManager
from nodeserve.kv.window import WindowKV, WindowPages
from nodeserve.runtime.records import RecordLog
from nodeserve.runtime.router import Router

PAGE_SIZE = 16                  # config's kv.page_size default
MAX_MODEL_LEN = 1 << 62         # a request ends at max_tokens only
TOKEN = 0                       # what every step samples
CHECK_EVERY = 256               # events between two checks of stop_below (each reads every request once)


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

    @classmethod
    def of_section(cls, section: DevicesSection) -> Mode:
        """The mode a [devices] section (config.DevicesSection) serves: devices_section's inverse."""
        if section.mode == "disaggregated":
            return cls(section.mode, {**{d: "prefill" for d in section.prefill},
                                      **{d: "decode" for d in section.decode}})
        return cls(section.mode, {d: section.mode for d in section.devices})

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
    """One request to simulate, and what happened to it (filled in by Simulation.run)."""

    arrival: float
    prompt_len: int
    max_tokens: int
    prefill_dev: str = ""               # where it was placed
    decode_dev: str = ""                # where it decoded last
    num_out: int = 0                    # tokens produced
    first_token: float | None = None
    end: float | None = None
    refused: bool = False               # the router refused it (it can never fit a device's KV)
    request: Request | None = field(default=None, repr=False)


class StepRecord(NamedTuple):
    """What runtime/loads.prefill_share reads of a worker's step records."""

    start: float
    end: float
    num_prefill_tokens: int


class SimDevice:
    """A virtual device: a core.serving_unit.ServingUnit, as the runtime's Worker is, and its inbox of moves (handled
    between steps, as a worker does). What the router sends it is seen at a later event, as a worker sees what the
    event loop sends it, so the router is never re-entered from inside its own dispatch."""

    def __init__(self, sim: Simulation, name: str, role: Role, limits: WorkerLimits, num_pages: int):
        self.sim, self.name, self.role, self.limits = sim, name, role, limits
        self.kv = KVManager(num_pages, PAGE_SIZE)
        self.window: WindowKV | None = None  # the simulator models a model's KV as full layers only
        self.scheduler = Scheduler(self.kv, limits, frozenset())
        self.num_outstanding_prefill_tokens = 0
        self.records = RecordLog(StepRecord, 4096)  # prefill_share reads the last 10 s only
        self.inbox: list[Migrate] = []
        self.migrating: list[Seq] = []   # its requests that were asked to move live (some may have ended)
        self.busy = False   # in a turn or a step: what arrives now is seen at its next turn
        self.failure: str | None = None  # a virtual device never fails

    def add_prefill(self, req: Request, pages: list[int], handoff: Handoff | None = None,
                    load: PageLoad | None = None, num_own_pages: int = -1, window: WindowPages | None = None) -> None:
        """As Worker.add_prefill; the simulator models no tier below the device pools (load is always None), and no
        window pages (window is always None)."""
        self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        self.scheduler.waiting.append(Seq(req, pages, handoff, num_published=num_own_pages))
        sim = self.sim._sim[req.request_id]
        sim.prefill_dev, sim.decode_dev = self.name, (handoff.target if handoff else self).name
        self.sim._at(self.sim.now, self.sim._turn, self)

    def send(self, msg: Arrival | FreePages | Migrate | None) -> None:
        """Only moves arrive here: the simulator copies no KV, so no page comes back to free and nothing lands."""
        if isinstance(msg, Migrate):
            self.inbox.append(msg)
            self.sim._at(self.sim.now, self.sim._turn, self)

    def __repr__(self) -> str:
        return f"SimDevice({self.name!r}, {self.role!s})"


def pool_pages(capacity_tokens: float, num_devices: int, limits: StepLimits,
               requests: Sequence[SimRequest]) -> int:
    """Pages per device: capacity_tokens' worth; when infinite, more than can ever be held at once (a device holds
    at most its own decode seats' pages and, prefilling, the prompts of seats elsewhere: every seat's pages in
    all, moves included, and never more than every request's pages together)."""
    if capacity_tokens != float("inf"):
        return int(capacity_tokens // PAGE_SIZE)
    pages = [-(-(r.prompt_len + r.max_tokens - 1) // PAGE_SIZE) + -(-r.prompt_len // PAGE_SIZE) for r in requests]
    seats = (num_devices + 1) * limits.max_num_seqs * max(pages, default=1)
    return max(min(seats, sum(pages)), 1)


class Simulation:
    def __init__(self, cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget,
                 local_prefill_threshold: int = 0, capacity_tokens: float | Mapping[str, float] = float("inf"),
                 local_prefill_when_busy: int = 0, decode_prefill_chunk: int = 0, prefill_order: str = "deadline",
                 stop_below: float | None = None, side_prefill: bool = False):
        self.cost, self.mode, self.limits, self.slo = cost, mode, limits, slo
        # Stop once fewer than this share of the requests can still meet the SLO: a goodput search needs only to
        # know that a rate misses, and an overloaded run's queue makes its last seconds the slowest to simulate.
        self.stop_below = stop_below
        self.stopped_early = False
        self.prefill_order = prefill_order  # scheduler.prefill_order: the engine installs it after its profile
        self.threshold, self.capacity_tokens = local_prefill_threshold, capacity_tokens
        self.decode_prefill_chunk = decode_prefill_chunk  # a decode device's prefill tokens per decoding step
        self.side_prefill = side_prefill  # ... sized each step by its step model, as scheduler.decode_prefill_chunk = 0
        self.roles = {d: Role(r) for d, r in mode.roles.items()}
        # As the engine orders its workers: prefill devices first.
        self.names = sorted(self.roles, key=lambda d: self.roles[d] != Role.PREFILL)
        # as the engine's: decode devices chosen by the step models; with side chunks sized by them, a busy-time
        # local prefill is weighed by them too
        timing = PlacerTiming(lambda: cost, limits, slo.max_side_step_s if side_prefill else None)
        self.placer: Placer = StaticPlacer(local_prefill_threshold, local_prefill_when_busy, timing)
        if Role.ADAPTIVE in self.roles.values():
            self.placer = AdaptivePlacer(lambda: cost, limits, slo, self.names)
        self.devices: dict[str, SimDevice] = {}
        self.router: Router | None = None
        self._sim: dict[str, SimRequest] = {}
        self._step_times: dict[tuple[str, StepShape], float] = {}  # the cost model's, for shapes seen before
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0

    @property
    def role_changes(self) -> list[RoleChange]:
        return list(self.router.role_changes) if self.router else []

    @property
    def num_migrations(self) -> Counter[str]:
        return self.router.num_migrations if self.router else Counter()

    @property
    def migration_downtimes(self) -> list[float]:
        return list(self.router.migration_downtimes) if self.router else []

    @property
    def _router(self) -> Router:
        """The router of the run in progress (run() builds it)."""
        if self.router is None:
            raise RuntimeError("the simulation is not running")
        return self.router

    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, requests: Sequence[SimRequest]) -> list[SimRequest]:
        capacity = self.capacity_tokens
        num_pages = {n: pool_pages(capacity[n] if isinstance(capacity, Mapping) else capacity, len(self.names),
                                   self.limits, requests) for n in self.names}
        wl = WorkerLimits(self.limits.max_num_seqs, self.limits.max_num_batched_tokens, MAX_MODEL_LEN)
        decode_wl = replace(wl, max_prefill_with_decodes=self.decode_prefill_chunk)  # as the engine's decode workers
        self.devices = {n: SimDevice(self, n, self.roles[n], decode_wl if self.roles[n] in (Role.DECODE,
                                                                                        Role.ADAPTIVE) else wl,
                                     num_pages[n]) for n in self.names}
        workers = list(self.devices.values())
        if self.side_prefill:
            for d in workers:
                if d.role in (Role.DECODE, Role.ADAPTIVE):
                    d.scheduler.use_side_prefill(SidePrefill(partial(self.cost.devices.get, d.name),
                                                             self.slo.max_side_step_s, self.decode_prefill_chunk))
        if self.prefill_order == "deadline":
            for d in workers:
                d.scheduler.use_order(DeadlineOrder(d.name, self.slo, self.limits, lambda: self.cost,
                                                    lambda: self.now))
        # The engine's own router, on the virtual clock; its queue limits are not modelled (no request refused
        # for them), its size checks are (TooLarge).
        self.router = Router([w for w in workers if w.role == Role.PREFILL],
                             [w for w in workers if w.role != Role.PREFILL], self.threshold,
                             max_waiting=len(requests) + 1, max_queued_tokens=1 << 62, placer=self.placer,
                             clock=lambda: self.now)
        if isinstance(self.placer, AdaptivePlacer):  # as the engine's role tick
            self._at(ROLE_TICK_S, self._role_tick)
        reqs = []
        for i, r in enumerate(requests):
            req = r.request = Request(str(i), [1] * r.prompt_len,
                                      SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                                      arrival_time=r.arrival)
            reqs.append(req)
            self._sim[req.request_id] = r
            self._at(r.arrival, self._admit, r, req)
        num_events = 0
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
            num_events += 1
            if (self.stop_below is not None and not num_events % CHECK_EVERY
                    and (len(requests) - self._num_sure_misses(requests)) / len(requests) < self.stop_below):
                self.stopped_early = True  # the requests not done are records of failures
                break
        for r, req in zip(requests, reqs):
            r.num_out, r.first_token = len(req.output_ids), req.prefill_end
        return list(requests)

    def _num_sure_misses(self, requests: Sequence[SimRequest]) -> int:
        """Requests that miss the SLO however the run goes on: refused, first token (or none yet) past the TTFT
        limit, or a TPOT over the target even if every token left came now."""
        n = 0
        for r in requests:
            req = r.request
            if r.refused:
                n += 1
            elif req is not None and req.arrival_time <= self.now:
                first = req.prefill_end
                if (first if first is not None else self.now) - r.arrival > self.slo.ttft_limit(r.prompt_len):
                    n += 1
                elif first is not None:
                    num_out = len(req.output_ids) if r.end is not None else r.max_tokens  # at most, if not done
                    end = r.end if r.end is not None else self.now                      # at least
                    if num_out > 1 and (end - first) / (num_out - 1) > self.slo.tpot_s:
                        n += 1
        return n

    def _admit(self, r: SimRequest, req: Request) -> None:
        try:
            self._router.admit(req)
        except TooLarge:  # it can never fit a device's KV
            r.refused = True

    def _room(self) -> None:
        """What the engine does when a worker has room no ended request made (Engine._room)."""
        if self._router.num_pending:
            self._router.dispatch()

    def _role_tick(self) -> None:
        """What the engine does every ROLE_TICK_S in adaptive mode (Engine._role_tick), while the run has events
        left, or requests waiting that a device given back could take."""
        dedicated = self._router.update_roles()
        if self._events or (dedicated and self._router.num_pending):
            self._at(self.now + ROLE_TICK_S, self._role_tick)

    def _release(self, reqs: Sequence[Request]) -> None:
        """What the engine does when a worker reports requests released: Router.release each, then dispatch."""
        for req in reqs:
            self._router.release(req)
        self._router.dispatch()

    def _on_migrated(self, req: Request, outcome: MigrationOutcome, downtime: float = 0.0) -> None:
        self._router.on_migrated(req, outcome, downtime)

    # ---- the workers (runtime/worker.py) -----------------------------------------------------------------
    def _turn(self, d: SimDevice) -> None:
        """One turn of an idle worker's loop: its inbox (moves), its migrations, then a step if it has work. A
        busy one sees what arrived at its next turn, after its step."""
        if d.busy:
            return
        d.busy = True
        while d.inbox:
            self._migrate_here(d, d.inbox.pop(0))
        if d.migrating:
            self._advance_migrations(d)
        batch = d.scheduler.schedule()
        if batch is None:
            d.busy = False
            return
        chunks, nd = batch.chunks, batch.num_decodes
        prefill: list[tuple[int, int]] = []
        if nd < len(chunks):
            for seq in batch.seqs[nd:]:
                if seq.req.prefill_start is None:
                    seq.req.prefill_start = self.now
            prefill = [(len(c.token_ids), c.start_pos) for c in chunks[nd:]]
        # a verify step's guesses are decode rows (one a token fed), as the worker's step records count them
        shape = StepShape.of(prefill, [c.start_pos + j for c in chunks[:nd] for j in range(len(c.token_ids))])
        key = (d.name, shape)
        seconds = self._step_times.get(key)
        if seconds is None:
            seconds = self._step_times[key] = self.cost.step_time(d.name, shape)
        self._at(self.now + seconds, self._step_done, d, batch, self.now, shape.num_prefill_tokens)

    def _step_done(self, d: SimDevice, batch: Batch, start: float, num_prefill_tokens: int) -> None:
        if num_prefill_tokens:  # prefill_share counts these only (the others add nothing to it)
            d.records.append(StepRecord(start, self.now, num_prefill_tokens))
        outcomes: list[TokenEvent | Exception | None] = [TokenEvent(TOKEN) if c.want_logits else None
                                                         for c in batch.chunks]
        self._finish(d, d.scheduler.postprocess(batch, outcomes, self.now))
        d.busy = False
        self._turn(d)

    def _finish(self, d: SimDevice, out: StepOutput) -> None:
        """Worker._finish: hands prefilled requests over, notes what ended, reports moves ended and releases."""
        d.num_outstanding_prefill_tokens -= out.num_prompt_tokens_done
        for req in out.released:  # what ended: released here, or handed over having ended
            self._sim[req.request_id].end = self.now
        ended = {id(s) for s in out.migrations_ended}
        for seq in out.handoffs:
            if seq.req.finished:
                self._sim[seq.req.request_id].end = self.now
            if id(seq) in ended:  # ended while moving: nothing left to copy but what is in flight (not timed)
                self._hand_off(d, seq, 0.0)
            else:  # prefilled here: the layers' copies ran with the prefill, the tail is left
                h, started = seq.handoff, seq.req.prefill_start
                assert h is not None and started is not None  # handed over: prefilled here, for a target
                self._hand_off(d, seq, self.cost.transfer_tail(d.name, h.target.name, seq.req.num_prompt_tokens,
                                                               self.now - started))
        for seq in out.migrations_ended:
            self._on_migrated(seq.req, MigrationOutcome.FINISHED)
        if out.released:
            self._release(out.released)
        elif out.handoffs:
            self._room()

    def _hand_off(self, d: SimDevice, seq: Seq, delay: float, migrated_at: float | None = None) -> None:
        """Worker._hand_off: after `delay` the KV is on the target, and its pages here are given back."""
        h = seq.handoff
        assert h is not None  # only a sequence bound for another device is handed off
        src, seq.page_table = seq.page_table, []
        self._at(self.now + delay, self._receive, d, self.devices[h.target.name], seq.req, h, src, migrated_at)

    def _receive(self, source: SimDevice, d: SimDevice, req: Request, h: Handoff, src_pages: list[int],
                 migrated_at: float | None) -> None:
        """Worker._receive: it decodes here from now; one that ended meanwhile gives its pages here back."""
        source.kv.free(src_pages)
        self._room()  # the source's FreePages
        if not req.finished:
            d.scheduler.start_decode(Seq(req, h.pages, num_published=h.num_cached_pages), self.now)
            self._sim[req.request_id].decode_dev = d.name
            if migrated_at is not None:
                self._on_migrated(req, MigrationOutcome.MOVED, self.now - migrated_at)
            self._turn(d)
            return
        d.kv.free(h.pages)
        self._release([req])

    def _migrate_here(self, d: SimDevice, msg: Migrate) -> None:
        """Worker._migrate: decoding here, it moves live; still prefilling here, its KV goes to the target when
        the prefill ends; not here (its KV on its way) or ended, it stays."""
        req, h = msg.req, msg.handoff
        sched = d.scheduler
        seq = next((s for s in [*sched.running, *sched.waiting] if s.req is req), None)
        if seq is None or seq.handoff is not None or seq.migration is not None or req.finished:
            self.devices[h.target.name].kv.free(h.pages)
            if not req.finished:
                self._on_migrated(req, MigrationOutcome.NOT_RUNNING)
            return
        if seq in sched.running:
            seq.migration = Migration(h, live=msg.live)
            d.migrating.append(seq)
            return  # its rounds start in this turn's _advance_migrations
        seq.handoff = h
        self._on_migrated(req, MigrationOutcome.MOVED)

    def _advance_migrations(self, d: SimDevice) -> None:
        """Worker._advance_migrations: between two steps, each moving request pre-copies the pages it filled since
        the last round (it keeps decoding here meanwhile), or, once next_migration_step says so, stops here; its
        last pages' copy is its downtime, then it decodes on the target."""
        d.migrating = [s for s in d.migrating if s.migration is not None and s in d.scheduler.running]
        for seq, m in [(s, s.migration) for s in d.migrating if s.migration is not None]:
            req = seq.req
            step = next_migration_step(m, req.num_computed_tokens, PAGE_SIZE)
            if step is MigrationStep.WAIT:
                continue
            h = m.handoff
            if step is MigrationStep.GIVE_UP:
                seq.migration = None
                self.devices[h.target.name].kv.free(h.pages)
                self._on_migrated(req, MigrationOutcome.NO_CONVERGENCE)
                continue
            end = (-(-req.num_computed_tokens // PAGE_SIZE) if step is MigrationStep.STOP
                   else req.num_computed_tokens // PAGE_SIZE)  # a round sends full pages only
            copy = self.cost.transfer_time(d.name, h.target.name, max(end - h.num_sent_pages, 0) * PAGE_SIZE)
            if end > h.num_sent_pages:
                h.num_copied_pages += end - h.num_sent_pages
                h.num_sent_pages = end
            if step is MigrationStep.STOP:
                d.scheduler.running.remove(seq)
                seq.handoff, seq.migration = h, None
                self._hand_off(d, seq, copy, migrated_at=self.now)
                continue
            m.num_rounds += 1
            m.round_done = False
            self._at(self.now + copy, self._round_done, d, m)

    def _round_done(self, d: SimDevice, m: Migration) -> None:
        m.round_done = True
        self._turn(d)


def records(requests: Sequence[SimRequest]) -> list[dict]:
    """Per request what bench/serve.py records for a live one (goodput.slo_attainment reads these)."""
    out: list[dict[str, Any]] = []
    for r in requests:
        first, end = r.first_token, r.end
        if first is None or end is None:
            out.append({"ok": False, "ttft": None, "tpot": None, "e2e": None, "prompt_len": r.prompt_len,
                        "n_out": r.num_out})
            continue
        tpot = (end - first) / (r.num_out - 1) if r.num_out > 1 else None
        out.append({"ok": True, "ttft": first - r.arrival, "tpot": tpot, "e2e": end - r.arrival,
                    "prompt_len": r.prompt_len, "n_out": r.num_out})
    return out


def simulate(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget, workload: Sequence[tuple[int, int]],
             arrivals: Sequence[float], local_prefill_threshold: int = 0,
             capacity_tokens: float | Mapping[str, float] = float("inf"), local_prefill_when_busy: int = 0,
             decode_prefill_chunk: int = 0, prefill_order: str = "deadline",
             stop_below: float | None = None, side_prefill: bool = False) -> list[dict]:
    """Records of (prompt_len, max_tokens) requests sent at `arrivals` (seconds). With stop_below, a run stops once
    that share of the requests can no longer meet the SLO; the requests not done then are failures."""
    reqs = [SimRequest(t, p, m) for (p, m), t in zip(workload, arrivals)]
    sim = Simulation(cost, mode, limits, slo, local_prefill_threshold, capacity_tokens, local_prefill_when_busy,
                     decode_prefill_chunk, prefill_order, stop_below, side_prefill)
    return records(sim.run(reqs))


def attainment(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget, workload: Sequence[tuple[int, int]],
               arrivals: Sequence[float], **kw: Any) -> float:
    recs = simulate(cost, mode, limits, slo, workload, arrivals, **kw)
    return goodput.slo_attainment(recs, slo.ttft_s, slo.tpot_s, slo.ttft_per_token_s)["attainment"]


def predict_goodput(cost: CostModel, mode: Mode, limits: StepLimits, slo: SloTarget,
                    workload: Sequence[tuple[int, int]], seed: int = 0, target: float = goodput.DEFAULT_SLO_TARGET,
                    rate_min: float = 0.05, rate_max: float = 100.0, rel_tol: float = 0.02,
                    on_probe: Callable[[float, list[dict]], None] | None = None, stop_early: bool = False,
                    **kw: Any) -> goodput.GoodputResult:
    """goodput.goodput_search over Poisson rates, each probe one simulation of the whole workload with
    workloads.arrival_times("poisson", ..., seed): the same search bench/compare.py runs on a live server.
    on_probe(rate, records) sees each probe's records (what the TTFT and TPOT were there). stop_early: a probe
    stops once it cannot meet the target (the same goodput; a missing probe's attainment is then only a bound)."""
    from nodeserve import workloads

    def measure(rate: float) -> float:
        arrivals = workloads.arrival_times("poisson", len(workload), rate, seed)
        recs = simulate(cost, mode, limits, slo, workload, arrivals, stop_below=target if stop_early else None,
                        **kw)
        if on_probe is not None:
            on_probe(rate, recs)
        return goodput.slo_attainment(recs, slo.ttft_s, slo.tpot_s, slo.ttft_per_token_s)["attainment"]

    return goodput.goodput_search(measure, rate_min, rate_max, target=target, rel_tol=rel_tol, tol=1e-4,
                                  max_probes=40, rate_floor=1e-3)
