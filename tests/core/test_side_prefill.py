"""SidePrefill: a decode device's own prompt tokens per step, sized by its step model within the gap budget; and
the scheduler taking them so."""

from __future__ import annotations

import pytest

from nodeserve.core.cost_model import FEATURES, StepModel, StepShape
from nodeserve.core.load import SloTarget
from nodeserve.core.scheduler import Scheduler, Seq, WorkerLimits
from nodeserve.core.side_prefill import MAX_FIT_ERROR, MIN_TOKENS, SidePrefill
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.kv.manager import KVManager


def _model(per_token_s: float, per_decode_s: float = 0.002, step_s: float = 0.005, rel_error: float = 0.05):
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("step")] = step_s
    coef[FEATURES.index("prefill_tokens")] = per_token_s
    coef[FEATURES.index("decodes")] = per_decode_s
    m = StepModel(coef=coef)
    m.rel_error = rel_error
    return m


def _side(model: StepModel | None, max_step_s: float = 0.06, fallback: int = 32) -> SidePrefill:
    return SidePrefill(lambda: model, max_step_s, fallback)


def test_the_most_tokens_whose_predicted_step_fits_the_budget():
    model = _model(per_token_s=0.001)
    contexts = [100.0] * 10                        # 5 ms + 10 x 2 ms = 25 ms of decodes: 35 ms left, 1 ms a token
    n = _side(model).tokens(contexts, 0, 1024)
    assert n == 35
    assert model.step_time(StepShape.of([(n, 0)], contexts)) <= 0.06 < \
        model.step_time(StepShape.of([(n + 1, 0)], contexts))


def test_a_slower_core_takes_fewer_tokens_and_a_light_batch_more():
    fast, slow = _model(per_token_s=0.0006), _model(per_token_s=0.0022)  # AVX-512 bf16 vs AVX2 int16, roughly
    contexts = [500.0] * 16
    assert _side(slow).tokens(contexts, 0, 1024) < _side(fast).tokens(contexts, 0, 1024)
    assert _side(slow).tokens([500.0], 0, 1024) > _side(slow).tokens(contexts, 0, 1024)
    assert _side(fast).tokens([500.0], 0, 40) == 40  # never past the step's own budget


def test_a_batch_already_past_the_budget_still_moves_its_prompts():
    model = _model(per_token_s=0.001, per_decode_s=0.01)
    assert _side(model).tokens([100.0] * 8, 0, 1024) == MIN_TOKENS   # 85 ms of decodes alone


def test_no_model_or_a_bad_fit_takes_the_fixed_chunk():
    assert _side(None).tokens([100.0] * 4, 0, 1024) == 32
    assert _side(_model(0.001, rel_error=MAX_FIT_ERROR + 0.1)).tokens([100.0] * 4, 0, 1024) == 32
    assert _side(_model(0.001, rel_error=None)).tokens([100.0] * 4, 0, 20) == 20


def test_the_gap_budget_is_a_share_of_the_tpot_target():
    assert SloTarget(2.5, 0.1).max_side_step_s == pytest.approx(0.06)


def test_the_scheduler_takes_the_sized_tokens_beside_its_decodes():
    s = Scheduler(KVManager(64, 4), WorkerLimits(4, 64, 128, max_prefill_with_decodes=32), frozenset({0}))
    s.use_side_prefill(_side(_model(per_token_s=0.002, per_decode_s=0.004), max_step_s=0.03))

    def local(n: int) -> Seq:
        req = Request(f"r{len(s.waiting)}", list(range(1, n + 1)), SamplingParams(max_tokens=8))
        seq = Seq(req, s.kv.allocate(s.kv.pages_for(req.max_total_tokens)))
        s.waiting.append(seq)
        return seq

    local(4)
    batch = s.schedule()
    assert [len(c.token_ids) for c in batch.chunks] == [4]     # nothing decoding: the whole step's budget
    s.postprocess(batch, [TokenEvent(7) if c.want_logits else None for c in batch.chunks], 1.0)
    local(40)
    batch = s.schedule()
    # 5 ms + one decode's 4 ms = 9 ms; 21 ms left at 2 ms a token: 10 tokens (the fixed chunk would be 32)
    assert [len(c.token_ids) for c in batch.chunks] == [1, 10]

