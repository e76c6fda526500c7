"""The cost model's fit on synthetic samples: it recovers known coefficients and round-trips through JSON."""

from __future__ import annotations

import json
import random

import pytest

from nodeserve.core.cost_model import FEATURES, CostModel, LinearKernels, StepModel, StepShape, fit_nonnegative
from nodeserve.runtime.profiler import MIN_STEPS, PROFILE_STEPS

TRUE = [0.02, 0.004, 1e-6, 0.003, 2e-5]  # step, per prefill token, per attended pair, per decode, per context token


def _shapes() -> list[StepShape]:
    return [StepShape.of([(16, 0)]), StepShape.of([(64, 0)]), StepShape.of([(64, 448)]), StepShape.of([(256, 0)]),
            StepShape.of([], [64]), StepShape.of([], [64] * 8), StepShape.of([], [512] * 8),
            StepShape.of([], [128] * 32), StepShape.of([(32, 0)], [128] * 8), StepShape.of([], [1024] * 4)]


def _time(shape: StepShape, coef=TRUE) -> float:
    return sum(c * f for c, f in zip(coef, shape.features()))


def test_shape_features():
    s = StepShape.of([(10, 0), (4, 6)], [100, 50])
    assert s.features() == [1.0, 14.0, 10 * 5 + 4 * 8, 2.0, 150.0, 0.0, 0.0]  # dense weights: no passes
    assert StepShape().empty and not s.empty
    assert StepShape.from_row(s.row()) == s


def test_linear_kernel_features_follow_the_row_count():
    k = LinearKernels(max_gemv_rows=32, rows_per_pass=8)
    passes_gemm = lambda shape: shape.features(k)[-2:]  # noqa: E731
    assert passes_gemm(StepShape.of([], [64] * 8)) == [1.0, 0.0]
    assert passes_gemm(StepShape.of([], [64] * 9)) == [2.0, 0.0]
    assert passes_gemm(StepShape.of([(30, 0)], [64] * 2)) == [4.0, 0.0]
    assert passes_gemm(StepShape.of([(31, 0)], [64] * 2)) == [0.0, 1.0]
    with pytest.raises(ValueError):
        LinearKernels(32, 0)


def test_fit_recovers_pass_and_gemm_costs_from_the_start_up_steps():
    # The profile's first MIN_STEPS alone determine all seven coefficients on a block-quantized model.
    k = LinearKernels(32, 8)
    true = [0.002, 0.003, 1e-6, 0.004, 5e-6, 0.02, 0.1]
    m = StepModel(kernels=k)
    for chunks, decodes in PROFILE_STEPS[:MIN_STEPS]:
        shape = StepShape.of(chunks, decodes)
        m.add(shape, sum(c * f for c, f in zip(true, shape.features(k))))
    m.refit()
    assert m.coef == pytest.approx(true, rel=1e-6)
    eight, nine = StepShape.of([], [100] * 8), StepShape.of([], [100] * 9)
    assert m.step_time(nine) - m.step_time(eight) == pytest.approx(0.004 + 100 * 5e-6 + 0.02)  # a second pass


def test_fit_recovers_known_coefficients_exactly():
    m = StepModel()
    for s in _shapes():
        m.add(s, _time(s))
    m.refit()
    for got, want in zip(m.coef, TRUE):
        assert got == pytest.approx(want, rel=1e-6)
    assert m.rel_error < 1e-9


def test_fit_recovers_coefficients_under_noise():
    rng = random.Random(0)
    m = StepModel()
    for _ in range(5):
        for s in _shapes():
            m.add(s, _time(s) * (1 + rng.gauss(0, 0.03)))
    m.refit()
    for got, want in zip(m.coef, TRUE):
        assert got == pytest.approx(want, rel=0.25)
    assert 0.01 < m.rel_error < 0.06
    assert m.step_time(StepShape.of([(128, 0)])) == pytest.approx(_time(StepShape.of([(128, 0)])), rel=0.05)


def test_fit_keeps_coefficients_non_negative():
    # Decode time falls with context in this data (noise): a plain fit gives a negative slope; ours pins it at 0.
    xs = [StepShape.of([], [c]).features() for c in (10, 100, 1000)]
    coef = fit_nonnegative(xs, [0.052, 0.051, 0.050])
    assert all(c >= 0 for c in coef)
    assert coef[FEATURES.index("decode_context")] == 0


def test_empty_step_costs_nothing():
    m = StepModel(coef=list(TRUE))
    assert m.step_time(StepShape()) == 0
    m.add(StepShape(), 1.0)  # not a sample
    assert not m.samples


def test_online_samples_are_bounded_and_kept_apart():
    m = StepModel()
    for s in _shapes():
        m.add(s, _time(s))
    for _ in range(2000):
        m.add(StepShape.of([], [64]), 0.1, online=True)
    assert len(m.profile_samples) == len(_shapes()) and len(m.online_samples) == 512


def test_transfer_time_and_tail():
    cm = CostModel({}, {("a", "b"): 1e9}, kv_bytes_per_token=100_000, num_layers=10)
    assert cm.transfer_time("a", "b", 1000) == pytest.approx(0.1)
    assert cm.transfer_time("b", "a", 1000) == 0  # not measured
    assert cm.transfer_time("a", "a", 1000) == 0
    assert cm.transfer_tail("a", "b", 1000, prefill_seconds=5.0) == pytest.approx(0.01)  # overlapped: last layer
    assert cm.transfer_tail("a", "b", 1000, prefill_seconds=0.05) == pytest.approx(0.05)  # copy outlasts compute


def test_json_round_trip():
    m = StepModel()
    for s in _shapes():
        m.add(s, _time(s))
    m.add(StepShape.of([], [64]), 0.1, online=True)
    m.refit()
    cm = CostModel({"cpu:0": m}, {("cpu:0", "cpu:1"): 5e9}, 46080, 30)
    back = CostModel.from_dict(json.loads(json.dumps(cm.as_dict())))
    assert back.devices["cpu:0"].coef == pytest.approx(m.coef)
    assert len(back.devices["cpu:0"].profile_samples) == len(_shapes())
    assert len(back.devices["cpu:0"].online_samples) == 1
    assert back.copy_bandwidth == {("cpu:0", "cpu:1"): 5e9} and back.kv_bytes_per_token == 46080


def test_a_profile_saved_before_the_kernel_features_is_fitted_again():
    m = StepModel()
    for s in _shapes():
        m.add(s, _time(s))
    m.refit()
    old = m.as_dict()
    old["coefficients"] = {k: v for k, v in old["coefficients"].items() if k not in ("row_passes", "gemm")}
    old["coefficients"]["step"] = 99.0  # stale: refitted from the samples
    del old["linear_kernels"]
    back = StepModel.from_dict(old)
    assert back.step_time(StepShape.of([(128, 0)])) == pytest.approx(_time(StepShape.of([(128, 0)])), rel=1e-6)


def test_from_dict_rejects_other_json():
    with pytest.raises(ValueError, match="not a nodeserve profile"):
        CostModel.from_dict({"pools": []})
