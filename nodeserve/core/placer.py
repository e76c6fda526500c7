"""Placement, one protocol for every mode: `place(now, loads, req) -> Decision`, on load snapshots only.

A Decision names the device that prefills a request and the one that decodes it (the same one when it is
colocated), and the role changes the policy made on the way, with the devices whose decodes must now move
elsewhere and those given back, which take a share of the others' decodes. `roles(now, loads)` is a Decision
with no request: what the policy changes as time passes (the runtime asks every ROLE_TICK_S, core/roles.py).
The runtime's router applies it: it reserves the pages, sends the prompt, changes the workers' roles and
moves their decodes; the simulator behind `nodeserve plan` applies the same decisions to its virtual devices.
Nothing here calls back into either.

  StaticPlacer    disaggregated and colocated modes: decode where a seat and the KV are free (where, by the step
                  models, the request would end soonest: its own prefill there when it would prefill there, its
                  decode beside that device's batch; without usable models, the longest cached prefix among the
                  devices with about the fewest seats taken; then most free KV), prefill on the prefill device with
                  the least work ahead (its cache counted), or on the decode device itself (colocated, a prompt under
                  local_prefill_threshold, or a short one while the prefill devices are busy:
                  local_prefill_when_busy).
  AdaptivePlacer  adaptive mode: choose_placement (placement.py) on the roles RolePolicy (roles.py) keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

from nodeserve.core.cost_model import CostModel, StepShape
from nodeserve.core.load import DeviceLoad, Role, SloTarget, StepLimits
from nodeserve.core.placement import Placement, choose_placement, prefill_steps, side_prefill_seconds
from nodeserve.core.request import Request
from nodeserve.core.roles import RoleChange, RolePolicy
from nodeserve.core.side_prefill import usable


@dataclass(frozen=True)
class Decision:
    prefill: str | None    # the device that prefills it (== decode when colocated); None: not placed now
    decode: str | None     # the device whose decode seat and KV it takes now
    role_changes: tuple[RoleChange, ...] = ()
    moves_from: tuple[str, ...] = ()        # devices just dedicated to prefill: their decodes go elsewhere
    prediction: Placement | None = None     # adaptive mode: what the cost model predicts for it
    moves_to: tuple[str, ...] = ()          # devices just given back: they take a share of the others' decodes

    @property
    def placed(self) -> bool:
        return self.decode is not None


class Placer(Protocol):
    def observe(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> None:
        """A request was admitted (before it is placed), on `loads` as place's (its cached prefix on each device)."""

    def place(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> Decision:
        """Where `req` goes, on `loads`: every device as this request sees it (its cached prefix there)."""

    def roles(self, now: float, loads: Sequence[DeviceLoad]) -> Decision:
        """The role changes due now with no request to place (a Decision that places nothing)."""


def fits(load: DeviceLoad, num_tokens: int) -> bool:
    return load.free_tokens >= num_tokens


def num_uncached(loads: Sequence[DeviceLoad], req: Request) -> int:
    """The prompt tokens req would compute on the device with room for it whose cache holds the most of its prefix:
    what makes it long (core/roles.py). By its whole length, a multi-turn prompt of 3,000 tokens, all but the last
    turn cached, dedicated a device to prefill the few tokens it had left and moved that device's decodes away."""
    n = req.num_prompt_tokens
    return n - max((min(x.cached_tokens, n) for x in loads if fits(x, n)), default=0)


# Adaptive mode: decodes a device's batch may have beyond another's before some move to it (AdaptivePlacer.roles).
# A decode row costs ~2.3 ms of a step on one AVX2-class core (32-row steps, in process): 16 rows against 12 put
# ~9 ms on every step of the larger batch for as long as they decode; a move costs a copy of the request's KV and,
# live, a pause of a few milliseconds.
MIN_BALANCE = 4

# Without step models: seats taken beyond the least loaded decode device's that a cached prefix may not outweigh
# (one seat is a row in every step of a request's decode; a short prefix is a few tokens of prefill, once).
MAX_SEAT_IMBALANCE = 4


@dataclass(frozen=True)
class PlacerTiming:
    """What lets the static placer weigh its choices in seconds: the devices' step models (the start-up profile's,
    refitted online), the step limits and the longest step a decode device's own prompts may make beside its
    decodes (SloTarget.max_side_step_s; None where scheduler.decode_prefill_chunk fixes those chunks instead: the
    busy-time rule then counts tokens)."""

    cost: Callable[[], CostModel]
    limits: StepLimits
    max_side_step_s: float | None


class StaticPlacer:
    def __init__(self, local_prefill_threshold: int = 0, local_prefill_when_busy: int = 0,
                 timing: PlacerTiming | None = None):
        """local_prefill_threshold: prompts with fewer new tokens always prefill on their decode device.
        local_prefill_when_busy: prompts with fewer new tokens may prefill there when every prefill device has at
        least that many prompt tokens queued (conditional disaggregation): a short prompt would wait behind a long
        one longer than its own prefill takes beside the decodes. Whether it would is predicted by `timing`'s step
        models where they are usable, else by queued tokens (the decode device has fewer queued). The decode device
        is chosen by `timing` too (_decode_device)."""
        self.local_prefill_threshold = local_prefill_threshold
        self.local_prefill_when_busy = local_prefill_when_busy
        self.timing = timing
        self.num_busy_local = 0  # prompts local_prefill_when_busy kept on their decode device

    def observe(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> None:
        pass

    def roles(self, now: float, loads: Sequence[DeviceLoad]) -> Decision:
        return Decision(None, None)  # static modes: roles never change

    def place(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> Decision:
        # Decode: a device with a free seat in its batch (so its own short prefills always find one and nothing it
        # holds waits behind the batch) and room for the whole request, then the longest cached prefix, then the
        # most free pages, then the fewest seats taken.
        decoders = [x for x in loads if x.role in (Role.DECODE, Role.COLOCATED, Role.ADAPTIVE) and x.free_seats > 0
                    and fits(x, req.max_total_tokens)]
        if not decoders:
            return Decision(None, None)
        prefillers = [x for x in loads if x.role == Role.PREFILL]
        decode = self._decode_device(decoders, bool(prefillers), req)
        num_new = req.num_prompt_tokens - decode.cached_tokens
        if not prefillers or num_new < self.local_prefill_threshold:
            return Decision(decode.name, decode.name)
        if num_new < self.local_prefill_when_busy:
            ahead = min(x.queued_prefill_tokens - x.cached_tokens for x in prefillers)
            if ahead >= self.local_prefill_when_busy and self._sooner_here(decode, prefillers, req, ahead):
                self.num_busy_local += 1
                return Decision(decode.name, decode.name)
        # Prefill: the least work ahead, counting what its own cache saves; its prompt pages are taken now.
        room = [x for x in prefillers if fits(x, req.num_prompt_tokens)]
        if not room:
            return Decision(None, None)
        prefill = min(room, key=lambda x: x.queued_prefill_tokens - x.cached_tokens)
        return Decision(prefill.name, decode.name)

    def _decode_device(self, decoders: list[DeviceLoad], disaggregated: bool, req: Request) -> DeviceLoad:
        """Where req would end soonest by the step model (the best fitted of the decoders'): its prefill there
        (its queued prompts first, its cached prefix saved) when it would prefill there, then max_tokens steps
        beside the batch there (every seat taken, and this one); then the longest cached prefix, the most free
        KV. Without usable models, the longest cached prefix among the devices within MAX_SEAT_IMBALANCE seats of
        the least loaded, then the most free KV. Longest cached prefix first put a 32-stream burst of chat
        prompts, whose template prefix the first device cached, all on one colocated device, its lent
        neighbour's core splitting 32-row steps (53 ms) where two devices step 16 rows each (36 ms; AVX2 class,
        484 against 600 tok/s)."""
        if len(decoders) == 1:
            return decoders[0]
        timing = self.timing
        cost = timing.cost() if timing is not None else None
        if timing is None or cost is None or not all(usable(cost.devices.get(x.name)) for x in decoders):
            # as SGLang's cache-aware router: the cache decides unless the loads are too far apart
            most_free = max(x.free_seats for x in decoders)
            near = [x for x in decoders if x.free_seats >= most_free - MAX_SEAT_IMBALANCE]
            return max(near, key=lambda x: (x.cached_tokens, x.free_tokens, x.free_seats))
        # The devices a static mode balances are alike (one node's cores or GPUs), so one model, the best fitted,
        # prices them all: the online refits' differences are the shapes each device happened to run (steps with
        # the other core lent or not; verify steps, which skewed them most, no longer enter them: runtime/
        # profiler.py). Each its own, a device that had run verify steps priced its rows 40 % lower and took 60 %
        # more of a 32-stream burst.
        ref = min((cost.devices[x.name] for x in decoders), key=lambda m: m.rel_error or 0.0)
        alike = CostModel({x.name: ref for x in decoders})
        limits, n, out = timing.limits, req.num_prompt_tokens, req.max_tokens

        def end(x: DeviceLoad) -> float:
            local = x.role != Role.DECODE or not disaggregated or n - x.cached_tokens < self.local_prefill_threshold
            ttft = prefill_steps(alike, x, limits, n, min(x.cached_tokens, n))[0] if local else 0.0
            batch = limits.max_num_seqs - x.free_seats + 1
            context = x.decode_context + x.incoming_context + n + out // 2
            return ttft + out * ref.step_time(StepShape(num_decodes=batch, decode_context=context))

        return min(decoders, key=lambda x: (end(x), -x.cached_tokens, -x.free_tokens))

    def _sooner_here(self, decode: DeviceLoad, prefillers: list[DeviceLoad], req: Request, ahead: int) -> bool:
        """Whether req's prefill would end sooner on its decode device than on the least busy prefill device (its
        KV handoff counted). By queued tokens alone, the decode device took half of a burst of short prompts and
        then prefilled them 8-19 tokens a step beside its first streams for seconds, while the prefill device,
        done with its half, idled (AVX2 class, 32 chat streams, four servers: 365-478 tok/s where it did, 530
        where its first step, before any stream, happened to take its half whole)."""
        timing = self.timing
        cost = timing.cost() if timing is not None else None
        if timing is None or cost is None or timing.max_side_step_s is None or \
                not all(usable(cost.devices.get(x.name)) for x in (decode, *prefillers)):
            return decode.queued_prefill_tokens < ahead
        limits = timing.limits
        here = side_prefill_seconds(cost, decode, limits, timing.max_side_step_s,
                                    req.num_prompt_tokens - decode.cached_tokens)

        def there(x: DeviceLoad) -> float:
            n = req.num_prompt_tokens
            seconds = prefill_steps(cost, x, limits, n, min(x.cached_tokens, n))[0]
            return seconds + cost.transfer_tail(x.name, decode.name, req.num_prompt_tokens, seconds)

        return here < min(there(x) for x in prefillers)


@dataclass
class AdaptivePlacer:
    cost: Callable[[], CostModel]   # the cost model as the profiler holds it now (refitted online)
    limits: StepLimits
    slo: SloTarget
    devices: Sequence[str]
    policy: RolePolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = RolePolicy(self.cost(), self.limits, self.slo, list(self.devices))

    def observe(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> None:
        """A long prompt adds to the demand for prefill devices."""
        self.policy.cost = self.cost()
        self.policy.observe(now, num_uncached(loads, req))

    def view(self, loads: Sequence[DeviceLoad], req: Request) -> list[DeviceLoad]:
        """Every device as this request's placement sees it: the role the policy gives it, and no seat where its
        KV does not fit now."""
        room = [x if fits(x, req.max_total_tokens) else replace(x, free_seats=0) for x in loads]
        return self.policy.request_loads(room, self.policy.is_long(num_uncached(loads, req)))

    def roles(self, now: float, loads: Sequence[DeviceLoad]) -> Decision:
        """A device whose demand ended goes back on time, not at the next placement: a burst of short requests
        all placed while a device was still dedicated leaves it idle until one of them ends (a 32-stream burst
        just after long prompts: given back 8-13 s after the last one instead of 4, the other device decoding
        all 32 meanwhile)."""
        self.policy.cost = self.cost()
        decision = self._decision(None, None, self.policy.update(now, loads), None)
        if decision.role_changes:
            return decision
        # Nothing due: the adaptive devices' batches are evened out once they differ by MIN_BALANCE (the requests
        # a device was prefilling when it got one back decode there, and a burst's requests end at different
        # times); the lightest one takes from the others (plan_balance).
        adaptive = [x for x in loads if x.name not in self.policy.prefill and x.role != Role.PREFILL]
        if len(adaptive) < 2:
            return decision
        batch = {x.name: x.num_decodes + x.num_incoming for x in adaptive}
        lightest = min((x for x in adaptive if not x.queued_prefill_tokens), key=lambda x: batch[x.name],
                       default=None)
        if lightest is None or max(batch.values()) - batch[lightest.name] < MIN_BALANCE:
            return decision
        return replace(decision, moves_to=(lightest.name,))

    def place(self, now: float, loads: Sequence[DeviceLoad], req: Request) -> Decision:
        self.policy.cost = self.cost()
        changes = self.policy.update(now, loads)
        while True:
            pl = choose_placement(self.policy.cost, self.limits, self.slo, self.view(loads, req),
                                  req.num_prompt_tokens, req.max_tokens)
            if pl is not None:
                return self._decision(pl.prefill, pl.decode, changes, pl)
            change = self.policy.free_a_seat(now, loads)  # no adaptive device has a seat for it
            if change is None:
                return self._decision(None, None, changes, None)
            changes.append(change)

    def _decision(self, prefill: str | None, decode: str | None, changes: list[RoleChange],
                  pl: Placement | None) -> Decision:
        dedicated = tuple(c.device for c in changes if c.role == Role.PREFILL and c.device in self.policy.prefill)
        returned = tuple(c.device for c in changes if c.role == Role.ADAPTIVE and c.device not in self.policy.prefill)
        return Decision(prefill, decode, tuple(changes), dedicated, pl, returned)


@dataclass(frozen=True)
class Seated:
    """A request decoding on a device that is to give it up: what plan_moves needs of it."""

    request_id: str
    num_tokens: int   # KV tokens it may ever need (prompt + max_tokens - 1)
    num_left: int = 0  # output tokens it may still decode (max_tokens - those it has)


def plan_moves(seated: Sequence[Seated], targets: Sequence[DeviceLoad]) -> list[tuple[str, str]]:
    """(request id, target device) for each request that can move: to the adaptive device with the most free KV
    that has a seat and room for it, counting the ones already sent there."""
    free = {t.name: [t.free_seats, t.free_tokens] for t in targets if t.role == Role.ADAPTIVE}
    out = []
    for s in seated:
        room = [name for name, (seats, tokens) in free.items() if seats > 0 and tokens >= s.num_tokens]
        if not room:
            continue
        target = max(room, key=lambda name: free[name][1])
        free[target][0] -= 1
        free[target][1] -= s.num_tokens
        out.append((s.request_id, target))
    return out


def plan_balance(target: DeviceLoad, seated: dict[str, Sequence[Seated]]) -> list[tuple[str, str]]:
    """(request id, target device) for the moves that even out decode batches between `target`, an adaptive
    device just given back with none or few, and the other adaptive devices (`seated`: each one's requests that can
    move): one at a time from the device with the most, while it has at least two more than the target, within
    the target's free seats and KV. A device's requests with the most output left go first: a move costs a copy,
    and it buys a smaller batch for as many steps as the request has left."""
    counts = {name: len(reqs) for name, reqs in seated.items()}
    queues = {name: sorted(reqs, key=lambda s: -s.num_left) for name, reqs in seated.items()}
    num_here, seats, tokens = target.num_decodes + target.num_incoming, target.free_seats, target.free_tokens
    out: list[tuple[str, str]] = []
    while seats > 0 and counts:
        source = max(counts, key=lambda name: counts[name])
        if counts[source] < num_here + 2 or not queues[source]:
            break
        s = queues[source].pop(0)
        if s.num_tokens > tokens:
            continue
        counts[source] -= 1
        out.append((s.request_id, target.name))
        num_here, seats, tokens = num_here + 1, seats - 1, tokens - s.num_tokens
    return out
