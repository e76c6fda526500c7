"""The role policy of `devices.mode = "adaptive"`: how many devices to dedicate to prefill, and which. Pure: the
engine's router (through core/placer.py) and the simulator behind `nodeserve plan` run the same one.

Every device starts *adaptive*: it decodes, prefills what it decodes (chunks mixed into its decode steps), and may
prefill for another device and send it the KV. A prompt is *long* when prefilling it alone takes more than
LONG_PREFILL_TPOTS times the TPOT target: mixed into a decode batch, that one prompt alone would add a whole TPOT
to every request of LONG_PREFILL_TPOTS output tokens decoding there, and a short request sees several such
prompts in its life. The policy keeps the predicted prefill seconds
of the long prompts admitted in the last WINDOW_S; that demand (device-seconds per second) divided by
PREFILL_UTILIZATION, rounded up, is how many devices to dedicate (at most all but one). Short prompts are always
colocated (placed among the non-prefill devices as the rule picks), so uniform short traffic is served as colocated
mode serves it. A *prefill* device takes no new decode seats (the requests it was decoding move to the others with
their KV, between steps: see core/placer.py), so long prompts prefill where they stall nobody, and short ones
stay colocated on the adaptive devices. Roles change between placements, never inside a step. A device is dedicated
as soon as demand asks for it. Demand counts only while long prompts keep coming: once none has been admitted for
IDLE_S it asks for none. A prefill device goes back once demand has asked for fewer for HOLD_S and it has no prompt
queued (a device with a queue would stall the decodes it takes), or at once when no adaptive device has a decode
seat and it has no prompt queued; a device given back takes a share of the others' decodes (core/placer.py
plan_balance), and the runtime asks for these changes every ROLE_TICK_S, not only when it places a request.
So a role follows demand within seconds; the 30 s window only sets how many
devices a steady stream of long prompts needs. A device given back for want of seats is not dedicated again for
SEAT_HOLD_S, doubled each time that happens again within MAX_SEAT_HOLD_S (up to it): the shortage that sent it
back outlasts the next long prompt, and re-dedicating at once moved its decodes back and forth every second
(9,008 role changes in a one-hour soak with a small KV pool).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

from nodeserve.core.cost_model import CostModel
from nodeserve.core.load import DeviceLoad, Role, SloTarget, StepLimits
from nodeserve.core.placement import prefill_steps

ADAPTIVE, PREFILL = Role.ADAPTIVE, Role.PREFILL
# 32 let every prompt of bimodal chat's 1,500-3,000 tokens mix whole into the decode steps on a CPU that prefills
# one in under 3.2 s (the AVX-512 Zen 4: ~1,000 prompt tok/s a core): a short request then met several stalls of
# 1.5-3 s in its life, and 2-16 of 48 missed a TPOT of 100 ms at concurrency 16 where the disaggregated mode
# missed none (docs/adaptive.md)
LONG_PREFILL_TPOTS = 16
WINDOW_S = 30.0
PREFILL_UTILIZATION = 0.8
HOLD_S = 1.0
IDLE_S = 3.0  # no long prompt for this long: demand asks for no prefill device
SEAT_HOLD_S = 5.0  # after a give-back for want of seats, no new dedication for this long (doubling, see above)
MAX_SEAT_HOLD_S = 60.0
ROLE_TICK_S = 0.5  # how often the runtime asks for the changes due with no request to place (Placer.roles)


@dataclass(frozen=True)
class RoleChange:
    time: float
    device: str
    role: Role
    reason: str


@dataclass
class RolePolicy:
    cost: CostModel
    limits: StepLimits
    slo: SloTarget
    devices: Sequence[str]
    window_s: float = WINDOW_S
    hold_s: float = HOLD_S
    idle_s: float = IDLE_S
    prefill: set[str] = field(default_factory=set)  # the devices dedicated to prefill now
    # (admitted at, predicted prefill seconds) of long prompts
    demand: deque[tuple[float, float]] = field(default_factory=deque)
    fewer_since: float | None = None                # since when demand has asked for fewer devices
    last_long: float = -math.inf                    # when the last long prompt was admitted
    seat_hold_s: float = SEAT_HOLD_S                # the next seat hold (doubles while seats keep running out)
    seat_held_until: float = -math.inf              # no dedication before this: seats ran out

    def prefill_seconds(self, num_prompt_tokens: int) -> float:
        """Predicted seconds to prefill this prompt alone (on the first device: every device runs the model)."""
        return prefill_steps(self.cost, DeviceLoad(self.devices[0], ADAPTIVE), self.limits, num_prompt_tokens)[0]

    def is_long(self, num_prompt_tokens: int) -> bool:
        return self.prefill_seconds(num_prompt_tokens) > LONG_PREFILL_TPOTS * self.slo.tpot_s

    def observe(self, now: float, num_prompt_tokens: int) -> bool:
        """Counts an admitted prompt in the demand; True if it is long."""
        seconds = self.prefill_seconds(num_prompt_tokens)
        if seconds <= LONG_PREFILL_TPOTS * self.slo.tpot_s:
            return False
        self.demand.append((now, seconds))
        self.last_long = now
        return True

    def num_wanted(self, now: float) -> int:
        while self.demand and self.demand[0][0] < now - self.window_s:
            self.demand.popleft()
        if now - self.last_long >= self.idle_s:
            return 0
        return min(math.ceil(self._rate() / PREFILL_UTILIZATION), len(self.devices) - 1)

    def update(self, now: float, loads: Sequence[DeviceLoad]) -> list[RoleChange]:
        """Dedicates or gives back devices as demand asks (loads: every device, by name in self.devices)."""
        wanted, have = self.num_wanted(now), len(self.prefill)
        if now < self.seat_held_until:
            wanted = min(wanted, have)
        if wanted >= have:
            self.fewer_since = None
        elif self.fewer_since is None:
            self.fewer_since = now
        changes = []
        while wanted > len(self.prefill):
            # The adaptive device with the fewest decodes to drain, then the most free seats.
            d = min((x for x in loads if x.name not in self.prefill), key=lambda x: (x.num_decodes, -x.free_seats))
            changes.append(self._set(now, d.name, PREFILL, f"long-prompt demand {self._rate():.2f} device-s/s"))
        if self.fewer_since is not None and now - self.fewer_since >= self.hold_s:
            idle = sorted((x for x in loads if x.name in self.prefill and not x.queued_prefill_tokens),
                          key=lambda x: x.name)
            for x in idle[:len(self.prefill) - wanted]:
                reason = (f"long-prompt demand {self._rate():.2f} device-s/s" if wanted else
                          f"no long prompt for {now - self.last_long:.1f} s") + ", nothing queued"
                changes.append(self._set(now, x.name, ADAPTIVE, reason))
            if len(self.prefill) <= wanted:
                self.fewer_since = None
        return changes

    def give_back(self, now: float, loads: Sequence[DeviceLoad], reason: str) -> RoleChange:
        """Returns the prefill device with the least prefill queued to the adaptive devices."""
        d = min((x for x in loads if x.name in self.prefill), key=lambda x: x.queued_prefill_tokens)
        return self._set(now, d.name, ADAPTIVE, reason)

    def free_a_seat(self, now: float, loads: Sequence[DeviceLoad]) -> RoleChange | None:
        """No adaptive device has a decode seat for a request: a prefill device with no prompt queued goes back to
        decoding. One still prefilling keeps its role (the request waits for a seat): given back, its long
        prompts' chunks would stall the decodes it takes, and the next long prompt would take it again, moving
        them once more (under KV pressure that flapped every second or two)."""
        if not any(x.name in self.prefill and not x.queued_prefill_tokens for x in loads):
            return None
        again = now < self.seat_held_until + MAX_SEAT_HOLD_S
        self.seat_hold_s = min(self.seat_hold_s * 2, MAX_SEAT_HOLD_S) if again else SEAT_HOLD_S
        self.seat_held_until = now + self.seat_hold_s
        return self.give_back(now, loads, f"no decode seat on the other devices; no dedication for "
                                          f"{self.seat_hold_s:g} s")

    def _set(self, now: float, device: str, role: Role, reason: str) -> RoleChange:
        (self.prefill.add if role == PREFILL else self.prefill.discard)(device)
        return RoleChange(now, device, role, reason)

    def _rate(self) -> float:
        return sum(s for _, s in self.demand) / self.window_s

    def request_loads(self, loads: Sequence[DeviceLoad], long: bool) -> list[DeviceLoad]:
        """The roles one request's placement sees. A long prompt prefills on a prefill device and decodes on
        another when one is dedicated; otherwise (all devices asked to decode) anywhere the rule likes. A short
        prompt decodes on a device that is not a prefill one. With none dedicated it is colocated, prefilled where
        it decodes (a cross placement would buy nothing but a copy). While one is, the devices that decode cap the
        prompt tokens beside their decodes (runtime/router.py), and a burst of short prompts there prefilled a
        few tokens a step: in bimodal chat's first burst at concurrency 16 (AVX2 class), 6 of its 15 short
        prompts missed a 2.5 s TTFT, where the disaggregated mode missed 2. So it may also prefill on a prefill
        device, where a short prompt waits behind the short ones queued there and the chunk of a long one that
        is running, not behind the whole long prompts (deadline order sets those aside: core/prefill_order.py);
        the placement rule weighs the two."""
        def view(x: DeviceLoad) -> DeviceLoad:
            if x.name in self.prefill:
                if long:
                    return replace(x, role=PREFILL)
                longs = sum(n for n in x.queued_prompts if self.is_long(n))
                ahead = max(x.queued_prefill_tokens - longs, 0) + min(longs, self.limits.max_num_batched_tokens)
                return replace(x, role=PREFILL, queued_prefill_tokens=ahead)
            if long:
                return replace(x, role=Role.DECODE if self.prefill else ADAPTIVE)
            if not self.prefill:
                return replace(x, role=Role.COLOCATED)
            return replace(x, role=ADAPTIVE, caps_prefill=True)
        return [view(x) for x in loads]
