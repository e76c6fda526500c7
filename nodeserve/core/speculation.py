"""Speculation policy: how many guessed tokens each decoding request verifies in a step.

A decode step reads every weight to make one token per stream; on a CPU core up to a pass of rows costs about
what one does (cost_model.LinearKernels), so checking k guesses of a request costs little and yields up to k + 1
tokens. Per step the policy takes the drafter's guesses and keeps the ones that pay: a request's j-th guess is
used only if all before it are accepted, with probability a^j where a is its running acceptance rate, so the
step's expected tokens are the decodes plus the sum of the kept a^j. The kept set is the top-n of those gains
whose expected tokens per predicted second (the device's start-up step model, as fitted) is highest, within:
  - no more rows than the device's per-row kernels take (past them the step switches to a GEMM: slower, and its
    rows round differently, so an output would depend on whether others speculated);
  - no step longer than max_step_s (the node gives 0.6 x slo.tpot_s) on guesses' account: the split exists to
    hold inter-token gaps;
  - none while the device's core is wanted elsewhere between steps (a disaggregated decode device lending it to a
    prefill device with a backlog, runtime/lending.SlackLending): a guess row there is paid for with the queued
    prompts' TTFT. (AVX2 class, 32 chat streams, disaggregated, 3 rounds: 0.91 / 0.91 / 0.97x before, 1.11 / 0.99 /
    0.88x after: within this machine's noise; kept for the accounting, not for a measured gain.)
With no usable step model (the start-up profile off, or its fit refused), guesses are kept while a^j >= 1/2.
Weighing costs one step-time prediction per candidate, at most MAX_CANDIDATES: ~0.14 ms a step at the most.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from nodeserve.core.cost_model import StepModel, StepShape
from nodeserve.core.request import Request

# A request's first guesses count as 70 % right, with the weight of four checked: one early miss (a preamble
# before the copied text) must not end its speculation before the text it copies starts.
PRIOR_ACCEPTED, PRIOR_CHECKED = 2.8, 4.0
DECAY = 0.9        # per verify step: the acceptance rate follows the text as it changes (code, then prose)
REGRESS = 0.95     # per step without guesses kept: back toward the prior, so a request is tried again soon
MIN_GAIN_WITHOUT_MODEL = 0.5
MAX_CANDIDATES = 64  # guesses weighed per step at most (each a step-time prediction)


@dataclass
class SeqSpeculation:
    """One request's speculation on one device: its acceptance counts (decayed) and its drafter's state."""

    num_accepted: float = PRIOR_ACCEPTED
    num_checked: float = PRIOR_CHECKED
    state: Any = None  # the drafter's (speculative/prompt_lookup.NgramIndex), made on first use

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_checked

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verify step checked guesses in order until the first miss: the accepted ones and that miss."""
        checked = num_accepted + (1 if num_accepted < num_drafted else 0)
        self.num_accepted = self.num_accepted * DECAY + num_accepted
        self.num_checked = self.num_checked * DECAY + checked

    def regress(self) -> None:
        self.num_accepted = self.num_accepted * REGRESS + PRIOR_ACCEPTED * (1 - REGRESS)
        self.num_checked = self.num_checked * REGRESS + PRIOR_CHECKED * (1 - REGRESS)


class Drafter(Protocol):
    """Guesses a request's next tokens from what it holds (prompt lookup) or a smaller model."""

    def propose(self, states: Sequence[SeqSpeculation], reqs: Sequence[Request],
                max_tokens: Sequence[int]) -> list[list[int]]:
        """Per request: up to max_tokens[i] guesses of the tokens after its prompt and output so far."""
        ...

    def release(self, state: SeqSpeculation) -> None:
        """Gives back what it holds for a request that leaves the device (SeqSpeculation.state)."""
        ...


@dataclass
class SpecCounts:
    """What verification did on one device, for /metrics (vLLM's spec_decode_* counters and ours)."""

    num_drafts: int = 0            # request-steps that verified at least one guess
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: guesses accepted at position j

    def add(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class Speculator:
    def __init__(self, drafter: Drafter, max_tokens: int, adaptive: bool = True, max_rows: int = 0,
                 max_step_s: float = 0.0):
        """max_tokens: most guesses per request and step; max_rows: most decode rows a step may have with guesses
        (0: no limit); max_step_s: longest step guesses may make (0: no limit)."""
        self.drafter, self.max_tokens, self.adaptive = drafter, max_tokens, adaptive
        self.max_rows, self.max_step_s = max_rows, max_step_s
        self.step_model: Callable[[], StepModel | None] = lambda: None
        self.core_wanted: Callable[[], bool] = lambda: False
        self.counts = SpecCounts()

    def use_step_model(self, step_model: Callable[[], StepModel | None]) -> None:
        """This device's step model as it stands (refitted online), once the start-up profile measured it."""
        self.step_model = step_model

    def yield_core_to(self, wanted: Callable[[], bool]) -> None:
        """No guesses while wanted() says this device's core is lent out between steps."""
        self.core_wanted = wanted

    def drafts(self, states: Sequence[SeqSpeculation], reqs: Sequence[Request], limits: Sequence[int],
               contexts: Sequence[int], num_prefill_tokens: int = 0, prefill_pairs: float = 0.0,
               max_extra_rows: int | None = None) -> list[list[int]]:
        """The guesses each decoding request verifies this step. limits[i]: the most it may take (its token and
        page limits; 0 where it must not speculate); contexts[i]: tokens it attends; the step's prefill chunks;
        max_extra_rows: rows the step's token budget has left."""
        room = max(0, self.max_rows - len(states) - num_prefill_tokens) if self.max_rows else None
        if max_extra_rows is not None:
            room = max_extra_rows if room is None else min(room, max_extra_rows)
        caps = [min(self.max_tokens, lim) for lim in limits]
        # a full batch, or a core lent out between steps, verifies nothing: no drafting either (a drafter catches up)
        if room == 0 or not any(caps) or self.core_wanted():
            return [[] for _ in caps]
        proposals = self.drafter.propose(states, reqs, caps)
        if not self.adaptive:
            return _first(proposals, room)
        # every guess as (gain, request, position): request i's j-th guess pays a_i^(j+1), in that order per request
        gains = sorted(((states[i].acceptance ** (j + 1), i, j) for i, p in enumerate(proposals) for j in range(len(p))),
                       key=lambda g: -g[0])
        gains = gains[:min(room, MAX_CANDIDATES) if room is not None else MAX_CANDIDATES]
        n = self._num_kept([g for g, _, _ in gains], [contexts[i] + j + 1 for _, i, j in gains], len(states),
                           sum(contexts), num_prefill_tokens, prefill_pairs)
        kept = [0] * len(proposals)
        for _, i, j in gains[:n]:
            kept[i] = max(kept[i], j + 1)  # a kept guess's earlier ones have larger gains: kept too
        for i, p in enumerate(proposals):
            if p and not kept[i]:
                states[i].regress()
        return [p[:k] for p, k in zip(proposals, kept)]

    def _num_kept(self, gains: list[float], contexts: list[int], num_decodes: int, decode_context: int,
                  num_prefill_tokens: int, prefill_pairs: float) -> int:
        """How many of the gains (sorted, largest first) to keep: most expected tokens per predicted second."""
        if not gains:
            return 0
        model = self.step_model()
        base = StepShape(num_prefill_tokens, prefill_pairs, num_decodes, decode_context)
        if model is None or model.step_time(base) <= 0:
            return sum(1 for g in gains if g >= MIN_GAIN_WITHOUT_MODEL)
        extra_ctx = np.cumsum([0, *contexts])
        times = np.array([model.step_time(StepShape(num_prefill_tokens, prefill_pairs, num_decodes + n,
                                                    int(decode_context + extra_ctx[n])))
                          for n in range(len(gains) + 1)])
        tokens = num_decodes + np.cumsum([0.0, *gains])
        rate = tokens / np.maximum(times, 1e-9)
        if self.max_step_s:  # guesses never push a step past the limit (a step already past it takes none)
            rate[1:][times[1:] > max(self.max_step_s, times[0])] = -1.0
        return int(rate.argmax())


def _first(proposals: list[list[int]], room: int | None) -> list[list[int]]:
    """Every guess found, within `room` rows in all (the earlier requests first)."""
    if room is None:
        return proposals
    out = []
    for p in proposals:
        out.append(p[:room])
        room -= len(out[-1])
    return out
