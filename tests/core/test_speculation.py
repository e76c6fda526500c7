"""core/speculation.py: acceptance tracking and how many guesses a step keeps, from the device's step model."""

from __future__ import annotations

from nodeserve.core.cost_model import LinearKernels, StepModel
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.core.speculation import SeqSpeculation, SpecCounts, Speculator


class FixedDrafter:
    def __init__(self, guesses: list[int]):
        self.guesses = guesses

    def propose(self, states, reqs, max_tokens):
        return [self.guesses[:m] for m in max_tokens]


def _model(step_ms: float, row_ms: float) -> StepModel:
    """Steps of step_ms plus row_ms a decode row."""
    coef = [step_ms / 1e3, 0.0, 0.0, row_ms / 1e3, 0.0, 0.0, 0.0]
    return StepModel(coef=coef, kernels=LinearKernels())


def _reqs(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=100)) for i in range(n)]


def _drafts(sp: Speculator, states, limits=None):
    n = len(states)
    return sp.drafts(states, _reqs(n), limits or [16] * n, [100] * n)


def test_acceptance_follows_what_verify_steps_kept():
    s = SeqSpeculation()
    assert s.acceptance == 0.7
    s.observe(4, 0)
    assert s.acceptance > 0.5  # one early miss does not end it
    for _ in range(20):
        s.observe(4, 4)
    assert s.acceptance > 0.95
    for _ in range(40):  # a miss checks one guess a step: the rate falls by the guesses checked, not the steps
        s.observe(4, 0)
    assert s.acceptance < 0.2
    low = s.acceptance
    for _ in range(200):
        s.regress()
    assert low < s.acceptance < 0.71


def test_cheap_rows_and_high_acceptance_keep_every_guess_costly_rows_keep_none():
    sp = Speculator(FixedDrafter([7] * 8), max_tokens=5)
    sp.use_step_model(lambda: _model(8.0, 0.5))
    good = SeqSpeculation(num_accepted=9.0, num_checked=10.0)
    assert _drafts(sp, [good]) == [[7] * 5]
    sp.use_step_model(lambda: _model(1.0, 5.0))  # a row costs 5 ms over a 1 ms step: a coin flip's guess does not pay
    assert _drafts(sp, [SeqSpeculation(5.0, 10.0)]) == [[]]


def test_a_low_acceptance_request_gets_fewer_guesses_than_a_high_one():
    sp = Speculator(FixedDrafter([7] * 8), max_tokens=8)
    sp.use_step_model(lambda: _model(8.0, 2.0))
    high, low = SeqSpeculation(19.0, 20.0), SeqSpeculation(1.0, 10.0)
    kept = _drafts(sp, [high, low])
    assert len(kept[0]) > len(kept[1]) and kept[1] == []


def test_limits_rows_and_the_step_time_cap_bound_the_guesses():
    sp = Speculator(FixedDrafter([7] * 8), max_tokens=8, max_rows=6)
    sp.use_step_model(lambda: _model(8.0, 0.1))
    states = [SeqSpeculation(19.0, 20.0) for _ in range(2)]
    kept = _drafts(sp, states, limits=[2, 16])
    assert len(kept[0]) <= 2 and sum(map(len, kept)) <= 6 - 2
    capped = Speculator(FixedDrafter([7] * 8), max_tokens=8, max_step_s=0.0085)
    capped.use_step_model(lambda: _model(8.0, 0.1))
    assert len(_drafts(capped, [SeqSpeculation(19.0, 20.0)])[0]) == 4  # 8 ms + 5 rows x 0.1 ms = 8.5 ms


def test_no_guesses_while_the_core_is_wanted_elsewhere():
    sp = Speculator(FixedDrafter([7] * 8), max_tokens=8)
    sp.use_step_model(lambda: _model(8.0, 0.1))
    wanted = [True]
    sp.yield_core_to(lambda: wanted[0])
    state = SeqSpeculation(19.0, 20.0)
    assert _drafts(sp, [state]) == [[]]
    assert (state.num_accepted, state.num_checked) == (19.0, 20.0)  # not counted as a guess declined
    wanted[0] = False
    assert len(_drafts(sp, [state])[0]) == 8


def test_without_a_step_model_guesses_are_kept_while_likely():
    sp = Speculator(FixedDrafter([7] * 8), max_tokens=8)
    assert len(_drafts(sp, [SeqSpeculation(8.0, 10.0)])[0]) == 3  # 0.8, 0.64, 0.51 >= 0.5; 0.41 not
    fixed = Speculator(FixedDrafter([7] * 8), max_tokens=6, adaptive=False, max_rows=8)
    assert [len(d) for d in _drafts(fixed, [SeqSpeculation(0.0, 10.0)] * 2)] == [6, 0]  # 8 rows: 2 + 6


def test_counts_per_position():
    c = SpecCounts()
    c.add(3, 2)
    c.add(1, 1)
    c.add(0, 0)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (2, 4, 3, [2, 1, 0])


def test_a_batch_with_no_room_for_guesses_does_not_draft():
    class Counting(FixedDrafter):
        calls = 0

        def propose(self, states, reqs, max_tokens):
            Counting.calls += 1
            return super().propose(states, reqs, max_tokens)

    sp = Speculator(Counting([5, 6, 7]), 3, max_rows=4)
    assert _drafts(sp, [SeqSpeculation() for _ in range(4)]) == [[]] * 4 and Counting.calls == 0
    assert any(_drafts(sp, [SeqSpeculation() for _ in range(2)])) and Counting.calls == 1
