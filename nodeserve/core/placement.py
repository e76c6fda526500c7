"""Per-request placement: predict each (prefill device, decode device) pair's TTFT and decode slowdown from the
cost model and a snapshot of live load, and choose the pair that best keeps both SLOs. Pure functions.

A placement either prefills on its decode device, in chunks mixed into that device's decode steps (colocated),
or on another device, whose KV is then moved (disaggregated). The same rule serves static modes (candidates are
limited by the devices' roles), `devices.mode = "adaptive"` (every device may do both), admission, and the
simulator behind `nodeserve plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nodeserve.core.cost_model import CostModel, StepShape
from nodeserve.core.load import DeviceLoad, Role, SloTarget, StepLimits
from nodeserve.core.side_prefill import SidePrefill, usable


@dataclass(frozen=True)
class Placement:
    prefill: str
    decode: str
    ttft: float          # predicted seconds from now to the first token
    transfer: float      # the KV handoff's delay after the prefill (0 when prefill and decode share a device)
    tpot: float          # predicted time per output token of this request
    others_tpot: float   # predicted TPOT of the requests already decoding where this one prefills, while it does

    num_others: int = 0  # how many requests others_tpot is about

    def violation(self, slo: SloTarget, num_prompt_tokens: int) -> float:
        """The worst ratio of a prediction to its SLO: <= 1 keeps every SLO this placement touches."""
        return max(self.ttft / slo.ttft_limit(num_prompt_tokens), self.tpot / slo.tpot_s,
                   self.others_tpot / slo.tpot_s)

    def num_misses(self, slo: SloTarget, num_prompt_tokens: int) -> int:
        """Requests predicted to miss an SLO: this one, and those decoding where it prefills."""
        own = self.ttft > slo.ttft_limit(num_prompt_tokens) or self.tpot > slo.tpot_s
        return int(own) + (self.num_others if self.others_tpot > slo.tpot_s else 0)


def prefill_steps(cost: CostModel, load: DeviceLoad, limits: StepLimits, num_prompt_tokens: int,
                  num_computed_tokens: int = 0) -> tuple[float, int, float]:
    """(seconds until this prompt's last chunk ends, steps that takes, seconds of the longest step) on `load`'s
    device: its queued prompt tokens first (FIFO; as chunks from position 0), then this prompt's chunks from
    num_computed_tokens on, every step also carrying the device's decode batch."""
    budget = max(limits.max_num_batched_tokens - load.num_decodes, 1)
    decodes = [load.decode_context / load.num_decodes] * load.num_decodes if load.num_decodes else []
    seconds, steps, longest = 0.0, 0, 0.0
    for total, own in ((load.queued_prefill_tokens, False), (num_prompt_tokens, True)):
        done = num_computed_tokens if own else 0
        while done < total:
            n = min(budget, total - done)
            t = cost.step_time(load.name, StepShape.of([(n, done if own else 0)], decodes))
            seconds, steps, longest, done = seconds + t, steps + 1, max(longest, t), done + n
    return seconds, steps, longest


def side_prefill_seconds(cost: CostModel, load: DeviceLoad, limits: StepLimits, max_side_step_s: float,
                         num_prompt_tokens: int) -> float:
    """Seconds until a prompt a decode device prefills itself ends: its queued prompt tokens first, then this one,
    in the chunks its scheduler adds beside its decode batch (core/side_prefill.py): the requests decoding there
    and those whose prefill elsewhere ends first, each at the batch's mean context. A decode device with streams
    prefills far slower than an idle one: its chunks are what keeps their token gaps within max_side_step_s."""
    batch = load.num_decodes + load.num_incoming
    contexts = [(load.decode_context + load.incoming_context) / batch] * batch if batch else []
    budget = max(limits.max_num_batched_tokens - batch, 1)
    chunk = budget
    if batch:
        side = SidePrefill(lambda: cost.devices.get(load.name), max_side_step_s, budget)
        chunk = side.tokens(contexts, 0, budget)
    total = load.queued_prefill_tokens + num_prompt_tokens
    num_full, rest = divmod(total, chunk)
    full = cost.step_time(load.name, StepShape.of([(chunk, 0)], contexts)) if num_full else 0.0
    return num_full * full + (cost.step_time(load.name, StepShape.of([(rest, 0)], contexts)) if rest else 0.0)


def predict(cost: CostModel, limits: StepLimits, loads: dict[str, DeviceLoad], prefill: str, decode: str,
            num_prompt_tokens: int, max_tokens: int, max_side_step_s: float | None = None) -> Placement:
    """What placing a request (num_prompt_tokens, max_tokens) with prefill on `prefill` and decode on `decode`
    would give. The others' TPOT spreads the mixed steps' extra time over max_tokens tokens (this request's
    length stands in for theirs). A prompt prefilled where it decodes, on a device that caps the prompt tokens
    beside its decodes (caps_prefill), takes the chunks that cap allows (side_prefill_seconds; max_side_step_s:
    the cap's step limit). The prefill device computes only what its prefix cache does not hold (cached_tokens)."""
    p, d = loads[prefill], loads[decode]
    cached = min(p.cached_tokens, num_prompt_tokens)  # the prefix the prefill device's cache holds is not computed
    ttft, steps, longest = prefill_steps(cost, p, limits, num_prompt_tokens, cached)
    out = max(max_tokens - 1, 1)
    others = 0.0
    if p.num_decodes:
        alone = cost.step_time(p.name, StepShape(num_decodes=p.num_decodes, decode_context=p.decode_context))
        mixed_extra = ttft - steps * alone
        others = alone + mixed_extra / max(out, steps)
    if prefill == decode and p.caps_prefill and max_side_step_s is not None and usable(cost.devices.get(p.name)):
        ttft = side_prefill_seconds(cost, p, limits, max_side_step_s, num_prompt_tokens - cached)
    transfer = cost.transfer_tail(prefill, decode, num_prompt_tokens, ttft) if prefill != decode else 0.0
    # Its own decode steps: the batch it joins (what decodes there now and what holds a seat there and will,
    # as its prefill ends first), with its context half-way through its output, slowed by the prefill chunks
    # mixed into them: the device's recent prefill share, or the prompt tokens already queued there if they
    # take more of the time this request decodes.
    batch = d.num_decodes + d.num_incoming + 1
    context = d.decode_context + d.incoming_context + num_prompt_tokens + max_tokens // 2
    step = cost.step_time(d.name, StepShape(num_decodes=batch, decode_context=context))
    share = d.prefill_share
    if prefill != decode and d.queued_prefill_tokens:
        drain = prefill_steps(cost, d, limits, 0)[0]
        share = max(share, drain / (drain + out * step))
    if share > 0:
        # A fraction f of the steps carry a full chunk (time `mixed`), the rest are plain decodes (`step`):
        # share = f * mixed / mean step, so mean step = step * mixed / (mixed * (1 - share) + share * step).
        chunk = max(limits.max_num_batched_tokens - batch, 1)
        mixed = cost.step_time(d.name, StepShape(chunk, chunk * chunk / 2, batch, context))
        if mixed > 0:  # a model with no samples yet predicts 0 for everything
            step = step * mixed / (mixed * (1 - share) + share * step)
    tpot = step + transfer / out
    return Placement(prefill, decode, ttft, transfer, tpot, others, p.num_decodes)


def candidates(loads: Sequence[DeviceLoad], num_prompt_tokens: int, local_prefill_threshold: int = 0
               ) -> list[tuple[str, str]]:
    """Every (prefill, decode) pair the roles allow, as the router places: decode on a device with a free seat;
    a colocated device prefills what it decodes; a decode device gets its prefill from a prefill device, or does
    it itself under local_prefill_threshold; an adaptive device may do either, with any adaptive or prefill
    device prefilling for it."""
    out = []
    for d in loads:
        if d.role == Role.PREFILL or d.free_seats <= 0:
            continue
        local_only = d.role == Role.COLOCATED or (d.role == Role.DECODE and num_prompt_tokens < local_prefill_threshold)
        if d.role != Role.DECODE or local_only:
            out.append((d.name, d.name))
        if not local_only:
            # A prompt prefilled for another device takes its pages there at placement.
            out += [(p.name, d.name) for p in loads if p is not d and p.role in (Role.PREFILL, Role.ADAPTIVE)
                    and p.free_tokens >= num_prompt_tokens
                    and (d.role == Role.ADAPTIVE or p.role == Role.PREFILL)]
    return out


def choose_placement(cost: CostModel, limits: StepLimits, slo: SloTarget, loads: Sequence[DeviceLoad],
                     num_prompt_tokens: int, max_tokens: int, local_prefill_threshold: int = 0) -> Placement | None:
    """The candidate with the fewest requests predicted to miss an SLO, then the smallest worst miss; among
    equals, what colocated mode's router does: prefill on the decode device itself, the one with the most free
    KV, then free seats (the remaining work it holds balances decode load better than this instant's TTFT).
    So under light or uniform short load it is colocated; a long prompt that would stall a decode batch goes
    to a device whose decodes it stalls least, ideally none, with its decode elsewhere: a dedicated prefill
    device. None when no decode device has a free seat."""
    by_name = {x.name: x for x in loads}
    best, best_key = None, None
    for p, d in candidates(loads, num_prompt_tokens, local_prefill_threshold):
        pl = predict(cost, limits, by_name, p, d, num_prompt_tokens, max_tokens, slo.max_side_step_s)
        key = (pl.num_misses(slo, num_prompt_tokens), max(pl.violation(slo, num_prompt_tokens), 1.0),
               p != d, -by_name[d].free_tokens, -by_name[d].free_seats, pl.ttft)
        if best_key is None or key < best_key:
            best, best_key = pl, key
    return best
