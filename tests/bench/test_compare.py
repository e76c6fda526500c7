"""bench/compare.py's pure parts on synthetic summaries: headline numbers, goodput bounds, ratios of bounded
values, the issue's verdicts and the markdown table."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def C(load_bench):
    return load_bench("compare")


def _dist(p50=None, p99=None):
    return {"p50": p50, "p90": None, "p99": p99, "mean": None, "count": 1}


def _result(tpot_single, conc_tok_s, ttft=(1.0, 2.0), tpot_p99=0.08, itl_p99=0.12, att=0.95, goodput=None):
    return {
        "single": {"summary": {"tpot": _dist(tpot_single), "ttft": _dist(0.05)}},
        "concurrent": {"summary": {"output_token_throughput": conc_tok_s, "tpot": _dist(p99=0.3)}},
        "chat": {"summary": {"ttft": _dist(*ttft), "tpot": _dist(p99=tpot_p99), "itl": _dist(p99=itl_p99)},
                 "attainment": {"attainment": att}},
        "goodput": goodput,
    }


def _g(goodput, status, rate_min=0.25):
    return {"goodput": goodput, "status": status, "target": 0.9, "rate_min": rate_min,
            "points": [{"rate": rate_min, "attainment": 0.5}]}


def test_goodput_bound(C):
    assert C.goodput_bound(_g(1.5, "found")) == (1.5, "exact")
    assert C.goodput_bound(_g(4.0, "at_max")) == (4.0, "lower")
    assert C.goodput_bound(_g(1.0, "max_probes")) == (1.0, "lower")
    assert C.goodput_bound(_g(None, "below_min"), 0.25) == (0.25, "upper")
    assert C.goodput_bound(_g(None, "below_min")) == (0.25, "upper")  # falls back to the first probe's rate
    assert C.goodput_bound(None) == (None, None)


def test_headline(C):
    h = C.headline(_result(0.02, 300.0, goodput=_g(2.0, "found")))
    assert h["single_tok_s"] == pytest.approx(50.0)
    assert h["conc_tok_s"] == 300.0 and h["ttft_p50"] == 1.0 and h["ttft_p99"] == 2.0
    assert h["itl_p99"] == 0.12 and h["attainment"] == 0.95
    assert (h["goodput"], h["goodput_kind"]) == (2.0, "exact")
    assert h["failed"] == 0
    empty = C.headline({})
    assert empty.pop("failed") == 0 and all(v is None for v in empty.values())
    res = _result(0.02, 300.0)
    res["chat"]["summary"]["failed"], res["single"]["summary"]["failed"] = 2, 1
    assert C.headline(res)["failed"] == 3


@pytest.mark.parametrize("nk,dk,kind", [
    ("exact", "exact", "exact"), ("lower", "exact", "lower"), ("exact", "upper", "lower"),
    ("lower", "upper", "lower"), ("upper", "exact", "upper"), ("exact", "lower", "upper"),
    ("upper", "lower", "upper"), ("lower", "lower", None), ("upper", "upper", None)])
def test_ratio_kinds(C, nk, dk, kind):
    value, k = C.ratio(3.0, 1.5, nk, dk)
    assert k == kind
    assert value == (2.0 if kind else None)


def test_ratio_undefined(C):
    assert C.ratio(None, 1.0) == (None, None)
    assert C.ratio(1.0, None) == (None, None)
    assert C.ratio(1.0, 0.0) == (None, None)
    assert C.ratio(1.0, 1.0, None, "exact") == (None, None)


def test_verdict(C):
    assert C.verdict(1.2, "exact", 1.0) == "met"
    assert C.verdict(0.9, "exact", 1.0) == "not met"
    assert C.verdict(2.5, "lower", 2.0) == "met"
    assert C.verdict(1.5, "lower", 2.0) == "undecided"
    assert C.verdict(1.5, "upper", 2.0) == "not met"
    assert C.verdict(2.5, "upper", 2.0) == "undecided"
    assert C.verdict(None, None, 2.0) == "n/a"
    assert C.verdict(0.12, "exact", 0.15, higher_is_better=False) == "met"
    assert C.verdict(0.15, "exact", 0.15, higher_is_better=False) == "not met"


def _heads(C):
    return {"disaggregated": C.headline(_result(0.025, 330.0, itl_p99=0.140, goodput=_g(1.0, "found"))),
            "colocated": C.headline(_result(0.025, 300.0, itl_p99=3.0, goodput=_g(0.5, "found"))),
            "llama-server": C.headline(_result(0.0125, 100.0, itl_p99=3.6, goodput=_g(None, "below_min")))}


def test_verdicts(C):
    checks = {c["label"]: c for c in C.verdicts(_heads(C))}
    single = checks["single-stream decode tok/s, disaggregated / llama-server"]
    assert single["value"] == pytest.approx(0.5) and single["verdict"] == "not met"
    conc = checks["32-concurrent output tok/s, disaggregated / llama-server"]
    assert conc["value"] == pytest.approx(3.3) and conc["verdict"] == "met"
    # llama-server missed even 0.25 req/s: disaggregated's 1.0 req/s is > 4x of it
    vs_llama = checks["bimodal goodput, disaggregated / llama-server"]
    assert vs_llama["value"] == pytest.approx(4.0) and vs_llama["kind"] == "lower" and vs_llama["verdict"] == "met"
    vs_coloc = checks["bimodal goodput, disaggregated / colocated"]
    assert vs_coloc["value"] == pytest.approx(2.0) and vs_coloc["verdict"] == "met"
    itl = checks["inter-token gap p99 at concurrency 16, disaggregated"]
    assert itl["value"] == 0.140 and itl["verdict"] == "met"


def test_verdicts_with_missing_targets(C):
    checks = C.verdicts({"disaggregated": C.headline({})})
    assert [c["verdict"] for c in checks] == ["n/a"] * 5


def test_build_table(C):
    heads = _heads(C)
    table = C.build_table(heads, C.verdicts(heads))
    lines = table.splitlines()
    assert lines[0].startswith("| target | single-stream tok/s")
    assert lines[2] == "| disaggregated | 40.0 | 330.0 | 1.00 / 2.00 | 80 | 140 | 95 % | 1.00 | 0 |"
    assert lines[4].endswith("| < 0.25 | 0 |")  # llama-server: below the lowest rate probed
    assert "| bimodal goodput, disaggregated / llama-server | >= 4.00x | >= 2x | met |" in lines
    assert "| inter-token gap p99 at concurrency 16, disaggregated | 140 ms | < 150 ms | met |" in lines
    # a target that did not run shows dashes, not an error
    assert "| x | - | - | - / - | - | - | - | - | 0 |" in C.build_table({"x": C.headline({})}, []).splitlines()


def test_short_requests_are_seeded(C):
    a = C.short_requests(3, (50, 100), 128, seed=0, kind="concurrent")
    b = C.short_requests(3, (50, 100), 128, seed=0, kind="concurrent")
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(50 <= r.prompt_len == len(r.prompt) <= 100 and r.max_tokens == 128 for r in a)
