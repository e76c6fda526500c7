"""Router: admits requests and applies the placer's decisions: reserves pages, sends prompts, changes roles, moves
decodes between devices.

Runs on the event loop thread. Every decision is the core's (core/placer.py, core/admission.py), made on load
snapshots (runtime/loads.py); the router only applies them. A placement reserves everything the request will
need at once, so nothing waits while holding pages: its decode pages (`prompt + max_tokens`), and, when it
prefills on another device, its prompt's pages there. So a finished prefill never waits for space, two devices
prefilling for each other cannot deadlock, and an abort has exactly the reservations to give back. A request's
decode seat ends when its decode device reports its pages given back (release()); a move holds a seat on both
devices until the source reports how it ended (on_migrated()).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Callable, Sequence

from nodeserve.core.admission import QueueFull, SloAdmission, TooLarge
from nodeserve.core.handoff import Handoff, Migrate, MigrationOutcome
from nodeserve.core.load import DeviceLoad, Role
from nodeserve.core.pending import PendingQueue
from nodeserve.core.placer import Decision, Placer, Seated, StaticPlacer, plan_balance, plan_moves
from nodeserve.core.prefix import wait_for_prefix
from nodeserve.core.request import Request
from nodeserve.core.roles import RoleChange
from nodeserve.core.serving_unit import ServingUnit
from nodeserve.kv.manager import hash_pages
from nodeserve.kv.reservation import Reservation, reserve_move, reserve_prompt
from nodeserve.runtime.loads import snapshot

if TYPE_CHECKING:
    from nodeserve.runtime.prefix_fetch import PrefixFetch

__all__ = ["QueueFull", "Router", "TooLarge"]

log = logging.getLogger(__name__)

MAX_ROLE_CHANGES = 10_000  # kept for /debug/steps (the timeline); older ones are dropped


class Router:
    def __init__(self, prefill_workers: Sequence[ServingUnit], decode_workers: Sequence[ServingUnit],
                 local_prefill_threshold: int, max_waiting: int, max_queued_tokens: int,
                 placer: Placer | None = None, admission: SloAdmission | None = None,
                 clock: Callable[[], float] = time.monotonic, fetch: PrefixFetch | None = None,
                 on_migration: Callable[[str, float, int], None] = lambda outcome, downtime, num_pages: None,
                 on_prefix_wait: Callable[[], None] = lambda: None,
                 on_placement_failed: Callable[[Request], None] = lambda req: None):
        """The devices are serving units (core/serving_unit.py): the engine's workers, or the simulator's virtual
        devices (plan/simulate.py), which run this same router on a virtual `clock`.

        fetch: where prompt pages a device lacks can be loaded from (other devices, the host and disk tiers); None:
        each device's own prefix cache only. on_migration(outcome, downtime seconds, pages copied): a move ended
        (metrics). on_prefix_wait(): a request was put off for a prefix another is computing; the engine arms a
        retry, since those pages can also be freed unpublished (their request aborted) by a worker thread, with no
        event reaching the router. on_placement_failed(req): its placement raised; the engine ends it with an
        error event."""
        self.prefill_workers, self.decode_workers = list(prefill_workers), list(decode_workers)
        self.workers = {w.name: w for w in [*prefill_workers, *decode_workers]}
        self.local_prefill_threshold, self.max_waiting = local_prefill_threshold, max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.placer: Placer = placer or StaticPlacer(local_prefill_threshold)
        self.admission = admission
        self.clock = clock
        self.pending: PendingQueue[Request] = PendingQueue()
        self.page_size = decode_workers[0].kv.page_size  # one page size on every device (kv.page_size)
        self.placements: dict[str, ServingUnit] = {}  # request id -> its decode worker, from placement to release
        self.placed: dict[str, Request] = {}     # request id -> the request, for the same time
        self.moving: dict[str, ServingUnit] = {}      # request id -> the worker it is moving to (a seat held there too)
        self.num_seats_taken: Counter[ServingUnit] = Counter()  # per worker: decode seats held, moves included
        self.role_changes: deque[RoleChange] = deque(maxlen=MAX_ROLE_CHANGES)
        self.num_role_changes: Counter[str] = Counter()
        self.num_migrations: Counter[str] = Counter()  # by MigrationOutcome
        self.migration_downtimes: deque[float] = deque(maxlen=10_000)  # seconds, of moves that resumed
        self.on_migration, self.on_prefix_wait, self.on_placement_failed = on_migration, on_prefix_wait, \
            on_placement_failed
        self.fetch = fetch
        self.num_prefix_waits = 0  # placements put off for a prefix another request was computing
        self.num_prefix_queried_tokens = 0  # prompt tokens placed, and of them those any cache tier held
        self.num_prefix_hit_tokens = 0
        self.waiting_for_prefix = False  # some request was put off so at the last dispatch: retry as pages publish
        self.cap_prompts_beside_decodes()

    def use_policy(self, admission: SloAdmission | None, placer: Placer | None = None) -> None:
        """The policy measured at start-up (the profile): SLO admission and, in adaptive mode, the placer."""
        self.admission = admission
        if placer is not None:
            self.placer = placer

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens admitted but not yet prefilled, here and on every worker."""
        queued = sum(r.num_prompt_tokens for r in self.pending)
        return queued + sum(w.num_outstanding_prefill_tokens for w in self.workers.values())

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens of KV one request can ever hold: a whole decode pool."""
        return max(w.kv.num_usable * w.kv.page_size for w in self.decode_workers)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def loads(self, now: float, req: Request | None = None) -> list[DeviceLoad]:
        """Every device's load now, prefill devices first; with `req`, its cached prefix on each."""
        seats = [(w, self.placed[rid]) for rid, w in [*self.placements.items(), *self.moving.items()]]
        return snapshot(self.workers.values(), seats, now, req)

    # ---- admission -----------------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        if req.max_total_tokens > self.max_seq_tokens:
            raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens but a device's KV cache holds at most "
                           f"{self.max_seq_tokens}")
        if self.prefill_workers and req.num_prompt_tokens >= self.local_prefill_threshold:
            capacity = min(w.kv.num_usable * w.kv.page_size for w in self.prefill_workers)
            if req.num_prompt_tokens > capacity:
                raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens but a prefill device holds at most "
                               f"{capacity}")
        if req.num_prompt_tokens > self.max_queued_tokens:
            raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens, more than server.max_queued_tokens "
                           f"({self.max_queued_tokens})")
        if len(self.pending) >= self.max_waiting:
            raise QueueFull(f"{len(self.pending)} requests are already waiting")
        if self.num_queued_tokens + req.num_prompt_tokens > self.max_queued_tokens:
            raise QueueFull(f"{self.num_queued_tokens} prompt tokens are already queued")
        req.page_hashes = hash_pages(req.prompt_ids, self.page_size)
        now = self.clock()
        loads = self.loads(now, req)
        self.placer.observe(now, loads, req)
        if self.admission is not None:
            self.admission.check(loads, req, sum(r.num_prompt_tokens for r in self.pending))
        self.pending.append(req)
        self.dispatch()

    def abort_pending(self, req: Request) -> bool:
        """Drops a request that has not been placed yet. Returns False if it already left the router."""
        if req not in self.pending:
            return False
        self.pending.remove(req)
        return True

    # ---- placement -----------------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Places waiting requests in the pending queue's order (core/pending.py)."""
        self.waiting_for_prefix = False
        self.pending.dispatch(self._place)

    def _place(self, req: Request) -> bool:
        now = self.clock()
        try:
            decision = self.placer.place(now, self.loads(now, req), req)
            try:
                # Its seat first: the placer chose it on the loads before any move, and the moves the decision
                # starts (a newly dedicated device's decodes) then take only the seats left. Moves first took the
                # seat it was given, and its decode device ran one request more than max_num_seqs: the last one
                # waited ~45 s for a step to take it.
                return decision.placed and self._reserve(req, decision)
            finally:
                self._apply_roles(decision)
        except Exception:  # a fault met by one request fails that request, not every request queued behind it
            log.exception("placing request %s failed; it ends with an error", req.request_id)
            self.on_placement_failed(req)
            return True  # out of the queue

    def _reserve(self, req: Request, decision: Decision) -> bool:
        """Takes the pages the decision needs, holds what its prompt can load from other devices and tiers, and
        sends the prompt; False (nothing taken) if the pages are gone, or if it should wait for a prefix another
        request is computing (core/prefix.py)."""
        decode, prefill = self.workers[decision.decode], self.workers[decision.prefill]
        hashes, n = req.page_hashes, req.num_prompt_tokens
        # a page cached under these hashes but holding other tokens, on a device or in the host tier: not reused
        host = self.fetch.host if self.fetch is not None else None
        caches = [(w.name, w.kv, True) for w in self.workers.values()] + ([("host", host.index, False)] if host else [])
        for name, kv, leading_only in caches:
            if kv.scrub(hashes, req.prompt_ids, stop_at_miss=leading_only):
                log.warning("%s: a cached KV page matched request %s's page hash but holds other tokens (a hash "
                            "collision): it left the cache, and the request computes that part itself",
                            name, req.request_id)
        if self.fetch is not None:
            sources = self.fetch.sources(req, prefill.name, len(prefill.kv.lookup(hashes, n)))
            if wait_for_prefix(sources):
                self.num_prefix_waits += 1
                self.waiting_for_prefix = True
                self.on_prefix_wait()
                return False
        reservation = reserve_prompt(decode.kv, prefill.kv, hashes, n, req.max_total_tokens, decode.window,
                                     prefill.window)
        if reservation is None:  # a worker's thread freed or took pages since the snapshot: try again later
            return False
        try:
            self._send(req, decode, prefill, reservation)
        except Exception:  # nothing reached a worker: give back what this placement took
            if self.placements.pop(req.request_id, None) is not None:
                self.num_seats_taken[decode] -= 1
            self.placed.pop(req.request_id, None)
            reservation.release()
            raise
        return True

    def _send(self, req: Request, decode: ServingUnit, prefill: ServingUnit, reservation: Reservation) -> None:
        """Records the placement, holds what the prompt can load from elsewhere, and sends the prompt."""
        own = reservation.num_own_cached_tokens
        self.placements[req.request_id], self.placed[req.request_id] = decode, req
        self.num_seats_taken[decode] += 1
        # After the allocation, which may have evicted some of them: the load starts where the pool's own
        # prefix ends, and holds what is still there.
        load = self.fetch.acquire(req, prefill.name, own // self.page_size) if self.fetch is not None else None
        req.cached_from = {"device": own} if own else {}
        for run in load.runs if load is not None else ():
            req.cached_from[run.source] = req.cached_from.get(run.source, 0) + len(run.src) * self.page_size
        if load is not None and load.disk_hashes:
            req.cached_from["disk"] = len(load.disk_hashes) * self.page_size
        req.num_computed_tokens = req.num_cached_tokens = own + (load.num_pages * self.page_size if load else 0)
        self.num_prefix_queried_tokens += req.num_prompt_tokens
        self.num_prefix_hit_tokens += req.num_cached_tokens
        try:
            if prefill is decode:
                decode.add_prefill(req, reservation.pages, load=load, num_own_pages=own // self.page_size,
                                   window=reservation.window)
            else:
                handoff = Handoff(decode, reservation.pages, reservation.num_cached_tokens // self.page_size,
                                  reservation.window)
                prefill.add_prefill(req, reservation.prompt_pages, handoff, load=load,
                                    num_own_pages=own // self.page_size, window=reservation.prompt_window)
        except Exception:
            if load is not None:
                self.fetch.release(load)
            raise

    def release(self, req: Request) -> None:
        """Its decode device gave back every page it held: its seats are free."""
        worker = self.placements.pop(req.request_id, None)
        self.placed.pop(req.request_id, None)
        if worker is not None:
            self.num_seats_taken[worker] -= 1
        target = self.moving.pop(req.request_id, None)
        if target is not None:
            self.num_seats_taken[target] -= 1

    # ---- roles and moves -----------------------------------------------------------------------------
    def _apply_roles(self, decision: Decision) -> None:
        for c in decision.role_changes:
            self.workers[c.device].role = Role(c.role)
            self.role_changes.append(c)
            self.num_role_changes[c.device] += 1
            log.info("adaptive: %s -> %s (%s)", c.device, c.role, c.reason)
        if decision.role_changes:
            self.cap_prompts_beside_decodes()
        for name in decision.moves_from:
            moved = self.move_decodes(self.workers[name])
            if moved:
                log.info("adaptive: %d requests move from %s to decode elsewhere", moved, name)
        for name in decision.moves_to:
            moved = self.balance_decodes(self.workers[name])
            if moved:
                log.info("adaptive: %d requests move to %s from the other devices (batches evened out)", moved, name)

    def update_roles(self) -> bool:
        """Applies the role changes due now with no request to place (Placer.roles), then places what waits.
        Returns whether some device is dedicated to prefill (in adaptive mode: ask again later)."""
        now = self.clock()
        decision = self.placer.roles(now, self.loads(now))
        if decision.role_changes or (decision.moves_to and not self.moving):  # moves under way: their batches
            self._apply_roles(decision)                                       # are not settled yet
            self.dispatch()
        return any(w.role is Role.PREFILL for w in self.workers.values()) and \
            any(w.role is Role.ADAPTIVE for w in self.workers.values())

    def cap_prompts_beside_decodes(self) -> None:
        """An adaptive device caps the prompt tokens a step of its decodes takes (its limits', sized by its step
        model) while another device is dedicated to prefill: it then decodes for it as a disaggregated decode device
        does, and its short prompts, mixed in whole, stalled every stream there (bimodal chat at concurrency 16,
        forced AVX2: steps of 124-949 prompt tokens beside 16 decodes, 0.3-2.7 s). With none dedicated it serves
        as colocated mode does, prompts in whole steps."""
        dedicated = any(w.role is Role.PREFILL for w in self.workers.values())
        for w in self.workers.values():
            if w.role is Role.ADAPTIVE:
                w.scheduler.caps_prefill_with_decodes = dedicated

    def move_decodes(self, source: ServingUnit) -> int:
        """`source` was just dedicated to prefill: every request holding a decode seat there moves to an adaptive
        device with a seat and room for it (core.placer.plan_moves), live. Returns how many moves started."""
        moves = plan_moves(self._movable(source), self.loads(self.clock()))
        return sum(self.migrate(self.placed[rid], self.workers[target]) for rid, target in moves)

    def balance_decodes(self, target: ServingUnit) -> int:
        """`target` was just given back to adaptive, or has the lightest batch: requests decoding on the other
        adaptive devices move to it until the batches are about even (core.placer.plan_balance), live. Without
        that a device given back decoded only what arrived after, while a burst placed during its dedication kept
        the other device's steps twice as large until it ended. Returns how many moves started."""
        # only requests decoding already: one still prefilling has nothing to gain from a move
        seated = {w.name: self._movable(w, decoding=True) for w in self.workers.values()
                  if w is not target and w.role is Role.ADAPTIVE}
        load = next(x for x in self.loads(self.clock()) if x.name == target.name)
        moves = plan_balance(load, seated)
        return sum(self.migrate(self.placed[rid], self.workers[name]) for rid, name in moves)

    def _movable(self, source: ServingUnit, decoding: bool = False) -> list[Seated]:
        """The requests holding a decode seat on `source` that a move could take (not moving, not ended; with
        `decoding`, only those that have started to decode)."""
        out = []
        for rid, w in self.placements.items():
            req = self.placed[rid]
            if w is source and rid not in self.moving and not req.finished and not req.aborted and \
                    (req.output_ids or not decoding):
                out.append(Seated(rid, source.kv.pages_for(req.max_total_tokens) * self.page_size,
                                  req.max_tokens - len(req.output_ids)))
        return out

    def migrate(self, req: Request, target: ServingUnit, live: bool = True) -> bool:
        """Starts moving a placed request's decode to `target`, whose pages for it are reserved now. Its source
        decides between two steps how it goes (on_migrated says). False if it cannot start."""
        source = self.placements.get(req.request_id)
        if source is None or source is target or req.request_id in self.moving or req.finished or req.aborted:
            return False
        if self.num_seats_taken[target] >= target.limits.max_num_seqs:
            return False
        taken = reserve_move(target.kv, target.window, req.max_total_tokens)
        if taken is None:
            return False
        pages, window = taken
        self.moving[req.request_id] = target
        self.num_seats_taken[target] += 1
        source.send(Migrate(req, Handoff(target, pages, window=window), live))
        return True

    def on_migrated(self, req: Request, outcome: MigrationOutcome, downtime: float, num_pages: int = 0) -> None:
        """A move ended: MOVED, its seat is the target's; NOT_RUNNING / NO_CONVERGENCE, it stays on its source.
        FINISHED and FAILED end with the request's release, which frees both seats."""
        self.num_migrations[outcome] += 1
        self.on_migration(str(outcome), downtime, num_pages)
        rid = req.request_id
        if outcome is MigrationOutcome.MOVED and rid in self.moving:
            self.num_seats_taken[self.placements[rid]] -= 1
            self.placements[rid] = self.moving.pop(rid)
            self.migration_downtimes.append(downtime)
        elif outcome in (MigrationOutcome.NOT_RUNNING, MigrationOutcome.NO_CONVERGENCE) and rid in self.moving:
            self.num_seats_taken[self.moving.pop(rid)] -= 1
        self.dispatch()


def role_changes_since(changes: Sequence[RoleChange], since: float) -> list[list]:
    return [[c.time, c.device, str(c.role), c.reason] for c in changes if c.time >= since]
