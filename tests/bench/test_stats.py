"""The load generator's pure parts (bench/stats.py, bench/workloads.py) on synthetic timings: percentiles,
per-request TTFT/TPOT/ITL, SLO attainment, goodput search, and the seeded workloads and arrivals."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import numpy as np
import pytest

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"nodeserve_bench_{name}", os.path.join(_BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def S():
    return _load("stats")


@pytest.fixture(scope="module")
def W():
    return _load("workloads")


# ---- percentiles ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 101, 1000])
def test_percentile_matches_numpy_linear(S, n):
    rng = random.Random(n)
    vals = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 10, 25, 50, 90, 99, 99.9, 100):
        assert S.percentile(vals, q) == pytest.approx(float(np.percentile(vals, q, method="linear")), rel=1e-12)


def test_percentile_hand_values_and_edges(S):
    assert S.percentile([1, 2, 3, 4], 50) == 2.5          # rank 1.5
    assert S.percentile([10, 20], 90) == pytest.approx(19)  # rank 0.9
    assert S.percentile([4, 1, 3, 2], 0) == 1             # unsorted input
    assert S.percentile([4, 1, 3, 2], 100) == 4
    assert S.percentile([5.0], 99) == 5.0
    assert S.percentile([], 50) is None
    with pytest.raises(ValueError):
        S.percentile([1], 101)
    d = S.distribution([0.1, 0.2, 0.3])
    assert d["count"] == 3 and d["p50"] == pytest.approx(0.2) and d["mean"] == pytest.approx(0.2)
    assert S.distribution([]) == {"count": 0, "mean": None, "min": None, "max": None,
                                  "p50": None, "p90": None, "p99": None}


# ---- per-request metrics ----------------------------------------------------------------------------------

def test_request_metrics_from_timestamps(S):
    # sent at 10.0; chunks at 10.5, 10.6, 10.8, 11.1; stream ends at 11.2; 4 tokens
    m = S.request_metrics(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, completion_tokens=4)
    assert m["ttft"] == pytest.approx(0.5)
    assert m["e2e"] == pytest.approx(1.2)
    assert m["itl"] == pytest.approx([0.1, 0.2, 0.3])
    assert m["tpot"] == pytest.approx((1.2 - 0.5) / 3)
    assert m["n_out"] == 4 and m["n_chunks"] == 4


def test_request_metrics_tpot_uses_usage_not_chunks(S):
    # 3 chunks, but the server reports 7 tokens (several tokens per chunk): TPOT divides by 7 - 1
    m = S.request_metrics(0.0, [1.0, 1.5, 2.0], 2.2, completion_tokens=7)
    assert m["tpot"] == pytest.approx(1.2 / 6)
    assert m["itl"] == pytest.approx([0.5, 0.5])
    # no usage: fall back to the chunk count
    assert S.request_metrics(0.0, [1.0, 1.5, 2.0], 2.0, None)["tpot"] == pytest.approx(0.5)


def test_request_metrics_one_token_and_none(S):
    m = S.request_metrics(0.0, [0.3], 0.35, completion_tokens=1)
    assert m["ttft"] == pytest.approx(0.3) and m["tpot"] is None and m["itl"] == []
    m = S.request_metrics(0.0, [], 0.4, completion_tokens=None)
    assert m["ttft"] is None and m["tpot"] is None and m["n_out"] == 0 and m["e2e"] == pytest.approx(0.4)
    with pytest.raises(ValueError):
        S.request_metrics(0.0, [1.0, 0.5], 2.0)


# ---- SLO attainment ---------------------------------------------------------------------------------------

def rec(ttft, tpot, ok=True, itl=(), e2e=1.0, n_out=10):
    return {"ttft": ttft, "tpot": tpot, "ok": ok, "itl": list(itl), "e2e": e2e, "n_out": n_out}


def test_attainment_counts_both_slos(S):
    records = [
        rec(1.0, 0.05),          # meets both
        rec(2.5, 0.100),         # exactly at both limits: meets (<=)
        rec(2.6, 0.05),          # TTFT misses
        rec(1.0, 0.101),         # TPOT misses
        rec(3.0, 0.2),           # both miss
        rec(0.5, None, n_out=1),  # one token: TPOT met trivially
        rec(3.0, None, n_out=1),  # one token but TTFT misses
        rec(0.1, 0.01, ok=False),  # failed request: never meets
        rec(None, None),          # no content chunk: does not meet
    ]
    a = S.slo_attainment(records, 2.5, 0.1)
    assert a["total"] == 9 and a["met"] == 3
    assert a["attainment"] == pytest.approx(3 / 9)
    # the per-SLO counts are over the 7 successful requests that got a first token
    assert a["met_ttft"] == 4       # 1.0, 2.5, 1.0, 0.5
    assert a["met_tpot"] == 5       # 0.05, 0.1, 0.05, None, None


def test_attainment_defaults_and_empty(S):
    assert S.DEFAULT_SLO_TTFT == 2.5 and S.DEFAULT_SLO_TPOT == 0.1 and S.DEFAULT_SLO_TARGET == 0.9
    a = S.slo_attainment([rec(2.4, 0.099), rec(2.4, 0.11)])
    assert a["attainment"] == 0.5
    assert S.slo_attainment([])["attainment"] is None


def test_length_aware_ttft_slo(S):
    short, long = dict(rec(2.4, 0.05), prompt_len=100), dict(rec(9.0, 0.05), prompt_len=2000)
    assert S.slo_attainment([short, long], 2.5, 0.1)["attainment"] == 0.5            # fixed 2.5 s
    a = S.slo_attainment([short, long], 2.5, 0.1, ttft_per_token=0.004)             # 2.5 s + 4 ms/token
    assert a["attainment"] == 1.0 and a["met_ttft"] == 2 and a["slo_ttft_per_token"] == 0.004
    assert not S.meets_slo(dict(rec(2.95, 0.05), prompt_len=100), 2.5, 0.1, 0.004)    # 2.95 > 2.5 + 0.4
    assert S.ttft_limit({"prompt_len": 3000}, 2.5, 0.004) == pytest.approx(14.5)


def test_summarize(S):
    records = [rec(0.1, 0.01, itl=[0.01, 0.02], e2e=0.2, n_out=10), rec(0.3, 0.03, itl=[0.03], e2e=0.4, n_out=20),
               rec(None, None, ok=False, e2e=0.1, n_out=0)]
    s = S.summarize(records, duration=2.0)
    assert s["requests"] == 3 and s["succeeded"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(15.0)
    assert s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["itl"]["count"] == 3 and s["itl"]["p50"] == pytest.approx(0.02)
    assert s["e2e"]["p99"] == pytest.approx(float(np.percentile([0.2, 0.4], 99)))
    assert S.summarize([], 0.0)["request_throughput"] is None


# ---- goodput search ---------------------------------------------------------------------------------------

def curve(threshold: float):
    """A monotone synthetic attainment curve: 1.0 up to `threshold`, then falling linearly; it crosses 0.9
    exactly at `threshold`."""
    return lambda rate: 1.0 if rate <= threshold else max(0.0, 0.9 - (rate - threshold) * 0.2)


@pytest.mark.parametrize("threshold", [0.3, 1.0, 3.7, 5.55, 15.9])
def test_goodput_finds_threshold(S, threshold):
    g = S.goodput_search(curve(threshold), 0.25, 16.0, target=0.9, tol=0.05, max_probes=40)
    assert g.status == "found"
    assert threshold - 0.05 <= g.goodput <= threshold
    lo, hi = g.bracket
    assert hi - lo <= 0.05 and lo == g.goodput
    # every probe recorded, in order; the goodput was probed and met the target; nothing higher met it
    rates = [r for r, _ in g.points]
    assert g.goodput in rates and rates[0] == 0.25
    assert all(a >= 0.9 for r, a in g.points if r <= g.goodput)
    assert all(a < 0.9 for r, a in g.points if r > g.goodput)
    d = g.as_dict()
    assert d["goodput"] == g.goodput and len(d["points"]) == len(g.points)


def test_goodput_never_meets(S):
    g = S.goodput_search(lambda r: 0.5, 0.25, 16.0)
    assert g.goodput is None and g.status == "below_min" and g.points == [(0.25, 0.5)]


def test_goodput_always_meets(S):
    seen = []
    g = S.goodput_search(lambda r: seen.append(r) or 1.0, 0.25, 16.0)
    assert g.status == "at_max" and g.goodput == 16.0
    assert seen == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]  # geometric bracketing, capped at rate_max


def test_goodput_threshold_between_min_and_first_step_and_exact_target(S):
    # attainment exactly equal to the target counts as meeting it
    g = S.goodput_search(lambda r: 0.9 if r <= 1.0 else 0.89, 1.0, 4.0, target=0.9, tol=0.01)
    assert g.status == "found" and 0.99 <= g.goodput <= 1.0
    # rate_min == rate_max
    assert S.goodput_search(lambda r: 1.0, 2.0, 2.0).status == "at_max"
    assert S.goodput_search(lambda r: 0.0, 2.0, 2.0).status == "below_min"


def test_goodput_max_probes_and_bad_args(S):
    g = S.goodput_search(curve(3.3), 0.25, 16.0, tol=1e-6, max_probes=6)
    assert g.status == "max_probes" and len(g.points) == 6 and g.goodput <= 3.3
    with pytest.raises(ValueError):
        S.goodput_search(curve(1), 0.0, 1.0)
    with pytest.raises(ValueError):
        S.goodput_search(curve(1), 2.0, 1.0)


# ---- workloads and arrivals -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bimodal", "summarization", "agent"])
def test_workloads_seed_deterministic(W, name):
    a = W.generate(name, 50, seed=3)
    b = W.generate(name, 50, seed=3)
    c = W.generate(name, 50, seed=4)
    assert [(r.prompt, r.max_tokens, r.kind) for r in a] == [(r.prompt, r.max_tokens, r.kind) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    t1, t2 = W.generate(name, 20, seed=3, mode="text"), W.generate(name, 20, seed=3, mode="text")
    assert [r.prompt for r in t1] == [r.prompt for r in t2] and isinstance(t1[0].prompt, str)


def test_workload_ranges(W):
    for r in W.generate("summarization", 300, seed=1):
        assert 1500 <= len(r.prompt) == r.prompt_len <= 3000 and 32 <= r.max_tokens <= 96
    for r in W.generate("agent", 300, seed=1):
        assert 50 <= len(r.prompt) <= 300 and 16 <= r.max_tokens <= 64
        assert all(W.VOCAB_LO <= t < W.VOCAB_HI for t in r.prompt)
    for r in W.generate("agent", 50, seed=1, vocab=(5, 9)):
        assert set(r.prompt) <= {5, 6, 7, 8}
    for r in W.generate("agent", 50, seed=1, mode="text"):
        assert len(r.prompt.split()) == r.prompt_len


@pytest.mark.parametrize("share", [0.1, 0.2, 0.3])
def test_bimodal_share_and_ranges(W, share):
    reqs = W.generate("bimodal", 200, seed=7, long_share=share)
    longs = [r for r in reqs if r.kind == "long"]
    assert len(longs) == round(share * 200)
    for r in reqs:
        lo, hi = (1500, 3000) if r.kind == "long" else (50, 200)
        assert lo <= len(r.prompt) <= hi and 32 <= r.max_tokens <= 256
    # long requests are spread over the run, not bunched at one end
    idx = [i for i, r in enumerate(reqs) if r.kind == "long"]
    assert min(idx) < 50 and max(idx) > 150
    assert len([r for r in W.generate("bimodal", 100, seed=0) if r.kind == "long"]) == 20  # default 20 %


def test_workload_bad_args(W):
    with pytest.raises(ValueError):
        W.generate("nope", 3)
    with pytest.raises(ValueError):
        W.generate("bimodal", 3, long_share=1.5)
    with pytest.raises(ValueError):
        W.generate("agent", 3, long_share=0.2)
    with pytest.raises(ValueError):
        W.generate("agent", 3, mode="bytes")


def test_arrivals(W):
    assert W.arrival_times("burst", 4) == [0.0] * 4
    t = W.arrival_times("poisson", 4000, rate=4.0, seed=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.25, rel=0.06)          # mean gap 1/rate
    assert gaps.std() == pytest.approx(0.25, rel=0.1)            # exponential: std == mean
    assert W.arrival_times("poisson", 50, 2.0, seed=1) == W.arrival_times("poisson", 50, 2.0, seed=1)
    # same seed, doubled rate: the same pattern at half the spacing
    assert W.arrival_times("poisson", 50, 4.0, seed=1) == pytest.approx([x / 2 for x in
                                                                         W.arrival_times("poisson", 50, 2.0, 1)])
    with pytest.raises(ValueError):
        W.arrival_times("poisson", 3, rate=0)
    with pytest.raises(ValueError):
        W.arrival_times("closed", 3)
