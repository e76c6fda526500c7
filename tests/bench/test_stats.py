"""The load generator's pure parts (bench/stats.py, bench/workloads.py) on synthetic timings: percentiles,
per-request TTFT/TPOT/ITL, SLO attainment, goodput search, and the seeded workloads and arrivals."""

from __future__ import annotations

import importlib.util
import math
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


# ---- goodput search downwards (machine-derived SLOs) -----------------------------------------------------

@pytest.mark.parametrize("threshold", [0.02, 0.07, 0.2, 0.9])
def test_goodput_search_goes_down_from_the_start_and_brackets(S, threshold):
    g = S.goodput_search(curve(threshold), 1.0, 16.0, target=0.9, tol=0.0, rel_tol=0.25, max_probes=40,
                         rate_floor=0.01)
    assert g.status == "found" and g.points[0][0] == 1.0
    lo, hi = g.bracket
    assert lo == g.goodput and 0 < lo <= threshold < hi and hi - lo <= 0.25 * lo
    assert all(a >= 0.9 for r, a in g.points if r <= lo) and all(a < 0.9 for r, a in g.points if r >= hi)
    # the downward steps divide by the growth factor
    assert g.points[1][0] == pytest.approx(0.5)


def test_goodput_search_floor_and_probes(S):
    seen = []
    g = S.goodput_search(lambda r: seen.append(r) or 0.0, 1.0, 16.0, rate_floor=0.3)
    assert g.status == "below_min" and g.goodput is None and g.bracket == (None, 0.3)
    assert seen == [1.0, 0.5, 0.3]  # the floor itself is probed last
    g = S.goodput_search(lambda r: 0.0, 1.0, 16.0, rate_floor=0.01, max_probes=3)
    assert g.status == "max_probes" and g.goodput is None and g.bracket == (None, 0.25)
    # a start that meets the target goes up exactly as without a floor
    g = S.goodput_search(curve(3.0), 1.0, 16.0, tol=0.05, rate_floor=0.1, max_probes=40)
    assert g.status == "found" and [r for r, _ in g.points[:3]] == [1.0, 2.0, 4.0]
    # a time budget: the next probe is not run when can_probe says no; the bracket so far stands
    g = S.goodput_search(curve(0.1), 1.0, 16.0, rate_floor=0.01, can_probe=lambda r: r >= 0.2)
    assert g.status == "max_probes" and [r for r, _ in g.points] == [1.0, 0.5, 0.25] and g.bracket == (None, 0.25)
    g = S.goodput_search(curve(3.0), 1.0, 16.0, tol=0.01, can_probe=lambda r: r != 3.0)
    assert g.status == "max_probes" and g.bracket == (2.0, 4.0) and g.goodput == 2.0
    with pytest.raises(ValueError):
        S.goodput_search(curve(1), 1.0, 2.0, rate_floor=2.0)
    with pytest.raises(ValueError):
        S.goodput_search(curve(1), 1.0, 2.0, tol=0.0)


def test_bracket_from_points(S):
    assert S.bracket_from_points([(1.0, 0.95), (2.0, 0.5), (1.5, 0.92)], 0.9) == (1.5, 2.0)
    assert S.bracket_from_points([(1.0, 0.5), (0.5, 0.8)], 0.9) == (0.0, 0.5)        # nothing met
    assert S.bracket_from_points([(1.0, 0.95), (2.0, 0.91)], 0.9) == (2.0, math.inf)  # nothing missed
    assert S.bracket_from_points([(1.0, None), (0.5, 0.95)], 0.9) == (0.5, 1.0)       # no data = missed
    assert S.bracket_from_points([], 0.9) == (0.0, math.inf)


# ---- machine-derived SLOs ---------------------------------------------------------------------------------

def test_fit_ttft_exact_and_least_squares(S):
    f = S.fit_ttft([64, 512, 1024, 3000], [0.05 + 0.002 * x for x in (64, 512, 1024, 3000)])
    assert f.a == pytest.approx(0.05) and f.b == pytest.approx(0.002) and f(1000) == pytest.approx(2.05)
    xs, ys = [100, 200, 300, 400], [1.1, 1.9, 3.2, 3.8]
    f = S.fit_ttft(xs, ys)
    b, a = np.polyfit(xs, ys, 1)
    assert (f.a, f.b) == (pytest.approx(a), pytest.approx(b))


def test_fit_ttft_keeps_coefficients_non_negative(S):
    # the plain fit's intercept is negative: the best fit through the origin instead
    xs, ys = [100, 1000, 2000], [0.01, 2.0, 4.2]
    assert np.polyfit(xs, ys, 1)[1] < 0
    f = S.fit_ttft(xs, ys)
    assert f.a == 0 and f.b == pytest.approx(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    # a falling TTFT (noise): a flat fit at the mean
    f = S.fit_ttft([100, 200], [1.0, 0.8])
    assert f.b == 0 and f.a == pytest.approx(0.9)
    with pytest.raises(ValueError):
        S.fit_ttft([100, 100], [1.0, 1.1])
    with pytest.raises(ValueError):
        S.fit_ttft([100, 200], [1.0])


def test_derived_slo_scales_the_length_aware_slo(S):
    slo = S.DerivedSlo(S.LinearFit(0.1, 0.002), 0.02)
    assert slo.at(3) == pytest.approx((0.3, 0.06, 0.006))
    short = dict(rec(0.29, 0.05), prompt_len=0)        # 0.29 <= 3 * 0.1
    long = dict(rec(12.5, 0.05), prompt_len=2000)      # limit 3 * (0.1 + 4.0) = 12.3: misses
    assert S.slo_attainment([short, long], *slo.at(3))["attainment"] == 0.5
    sweep = S.attainment_vs_scale([short, long], slo, [1, 3, 5])
    assert [p["scale"] for p in sweep] == [1, 3, 5] and [p["attainment"] for p in sweep] == [0.0, 0.5, 1.0]
    assert S.DerivedSlo.from_dict(slo.as_dict()) == slo


def test_calibrate_and_best_slo(S):
    recs = [dict(rec(0.05 + 0.002 * n, t), prompt_len=n) for n, t in ((64, 0.02), (1024, 0.03), (3000, 0.025))]
    recs.append(dict(rec(None, None, ok=False), prompt_len=512))  # a failed one is left out
    slo = S.calibrate(recs)
    assert slo.ttft.a == pytest.approx(0.05) and slo.ttft.b == pytest.approx(0.002) and slo.tpot == 0.025
    with pytest.raises(ValueError):
        S.calibrate([dict(rec(0.1, None, n_out=1), prompt_len=64), dict(rec(0.2, None, n_out=1), prompt_len=99)])
    fast_prefill = S.DerivedSlo(S.LinearFit(0.2, 0.001), 0.05)
    fast_decode = S.DerivedSlo(S.LinearFit(0.01, 0.003), 0.01)
    best, src = S.best_slo({"a": fast_prefill, "b": fast_decode}, [100, 2000, 3000])
    assert best == S.DerivedSlo(fast_prefill.ttft, 0.01) and src == {"ttft_from": "a", "tpot_from": "b"}
    # over short prompts only, the other fit is lower
    assert S.best_slo({"a": fast_prefill, "b": fast_decode}, [50])[1]["ttft_from"] == "b"
    with pytest.raises(ValueError):
        S.best_slo({}, [1])


def test_unloaded_service_time(S):
    slo = S.DerivedSlo(S.LinearFit(0.1, 0.001), 0.02)
    assert S.unloaded_service_time(slo, [(100, 11), (1900, 1)]) == pytest.approx(((0.2 + 0.2) + 2.0) / 2)


# ---- multi-turn chat --------------------------------------------------------------------------------------

def test_multi_turn_prompts_grow_by_answer_and_user_message(W):
    reqs = W.multi_turn(20, seed=5)
    by_conv = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    assert sorted(by_conv) == list(range(20))
    spec = W.MULTITURN
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert spec.turns[0] <= len(turns) <= spec.turns[1]
        assert spec.first[0] <= turns[0].prompt_len <= spec.first[1]
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt[:len(prev.prompt)] == prev.prompt     # the previous prompt is a prefix
            added = cur.prompt_len - prev.prompt_len - prev.max_tokens  # then the answer, then the user message
            assert spec.user[0] <= added <= spec.user[1]
        for r in turns:
            assert len(r.prompt) == r.prompt_len and spec.output[0] <= r.max_tokens <= spec.output[1]
            assert r.kind == "multiturn" and all(W.VOCAB_LO <= t < W.VOCAB_HI for t in r.prompt)


def test_multi_turn_seeded_and_sliceable(W):
    a, b = W.multi_turn(6, seed=1), W.multi_turn(6, seed=1)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    assert [r.prompt for r in W.multi_turn(6, seed=2)] != [r.prompt for r in a]
    # conversation 3 is the same whether asked for alone or among others
    assert [r.prompt for r in W.multi_turn(1, seed=1, first_conversation=3)] == \
        [r.prompt for r in a if r.conversation == 3]
    # generate() counts turns and cuts the last conversation short
    g = W.generate("multiturn", 7, seed=1)
    assert len(g) == 7 and [(r.prompt, r.turn) for r in g] == [(r.prompt, r.turn) for r in a[:7]]
    t = W.multi_turn(3, seed=1, mode="text")
    for prev, cur in zip(t, t[1:]):
        if cur.conversation == prev.conversation:
            assert cur.prompt.startswith(prev.prompt + " ") and len(cur.prompt.split()) == cur.prompt_len
    with pytest.raises(ValueError):
        W.generate("multiturn", 3, long_share=0.2)


def test_serve_runs_a_conversation_in_turn_order(W):
    serve = _load("serve")
    reqs = W.generate("agent", 2, seed=0) + W.multi_turn(2, seed=0)
    groups = serve.conversations(reqs)
    assert groups[0] == [0] and groups[1] == [1]
    turns = [[(reqs[i].conversation, reqs[i].turn) for i in g] for g in groups[2:]]
    assert [[t for _, t in g] for g in turns] == [list(range(len(g))) for g in turns]
    assert sorted(i for g in groups for i in g) == list(range(len(reqs)))
    shuffled = list(reversed(reqs))  # turns out of order in the list still run in turn order
    for g in serve.conversations(shuffled):
        assert [shuffled[i].turn or 0 for i in g] == sorted(shuffled[i].turn or 0 for i in g)
