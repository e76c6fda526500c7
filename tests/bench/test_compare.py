"""bench/compare.py's pure parts on synthetic summaries: headline numbers, goodput brackets and their ratios,
the issue's verdicts, the markdown tables, probe sizes and the derived SLO's choice."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def C(load_bench):
    return load_bench("compare")


def _dist(p50=None, p99=None):
    return {"p50": p50, "p90": None, "p99": p99, "mean": None, "count": 1}


def _result(tpot_single, conc_tok_s, chat_tok_s=50.0, ttft=(1.0, 2.0), tpot_p99=0.08, itl_p99=0.12, att=0.95,
            goodput=None, prompt_tok_s=None):
    return {
        "single": {"summary": {"tpot": _dist(tpot_single), "ttft": _dist(0.05)}},
        "prompt": {"summary": {"ttft": _dist(4.0)}, "prompt_tok_s": prompt_tok_s},
        "concurrent": {"summary": {"output_token_throughput": conc_tok_s, "tpot": _dist(p99=0.3)}},
        "chat": {"summary": {"output_token_throughput": chat_tok_s, "ttft": _dist(*ttft), "tpot": _dist(p99=tpot_p99),
                             "itl": _dist(p99=itl_p99)},
                 "attainment": {"attainment": att}, "attainment_derived": {"attainment": 0.5}},
        "goodput": goodput,
    }


def _g(lo, hi, status="found", fixed=(0.0, 0.5), first=(0.95, 0.7)):
    """first: the first probe's (derived, fixed) SLO attainment, at the common rate."""
    return {"status": status, "target": 0.9, "bracket": [lo, hi], "fixed_bracket": list(fixed),
            "probes": [{"rate": 0.3, "attainment": {"attainment": first[0]},
                        "attainment_fixed": {"attainment": first[1]}}]}


def test_goodput_bracket(C):
    assert C.goodput_bracket(_g(1.5, 2.0)) == (1.5, 2.0)
    assert C.goodput_bracket(_g(4.0, None, "at_max")) == (4.0, math.inf)
    assert C.goodput_bracket(_g(None, 0.25, "below_min")) == (0.0, 0.25)
    assert C.goodput_bracket(None) == (None, None)


def test_bracket_ratio_and_verdict(C):
    assert C.bracket_ratio((2.0, 3.0), (0.5, 1.0)) == (2.0, 6.0)
    assert C.bracket_ratio((2.0, math.inf), (0.5, 1.0)) == (2.0, math.inf)
    assert C.bracket_ratio((0.0, 0.2), (0.5, 1.0)) == (0.0, pytest.approx(0.4))
    assert C.bracket_ratio((1.0, 2.0), (0.0, 0.25)) == (4.0, math.inf)     # the other target met nothing
    assert C.bracket_ratio((1.0, 2.0), (1.0, math.inf)) == (0.0, 2.0)
    assert C.bracket_ratio((None, None), (1.0, 2.0)) == (None, None)
    assert C.bracket_verdict(2.0, 6.0, 2.0) == "met"
    assert C.bracket_verdict(0.0, 1.9, 2.0) == "not met"
    assert C.bracket_verdict(1.5, 2.5, 2.0) == "undecided"
    assert C.bracket_verdict(None, None, 2.0) == "n/a"
    assert C.verdict(1.2, 1.0) == "met" and C.verdict(0.9, 1.0) == "not met" and C.verdict(None, 1.0) == "n/a"
    assert C.verdict(0.12, 0.15, higher_is_better=False) == "met"
    assert C.verdict(0.15, 0.15, higher_is_better=False) == "not met"


def test_fmt_bracket(C):
    assert C.fmt_bracket(0.31, 0.45, ".2f") == "0.31–0.45"
    assert C.fmt_bracket(0.0, 0.25, ".2f") == "< 0.25"
    assert C.fmt_bracket(4.0, math.inf, ".2f", "x") == ">= 4.00x"
    assert C.fmt_bracket(1.5, 1.5, ".1f") == "1.5"
    assert C.fmt_bracket(0.0, math.inf) == "-" and C.fmt_bracket(None, None) == "-"


def test_headline_fixed_bracket_open_above(C):
    h = C.headline({"goodput": _g(1.0, 2.0, fixed=(0.5, None))})
    assert (h["fixed_goodput_lo"], h["fixed_goodput_hi"]) == (0.5, math.inf)


def test_headline(C):
    h = C.headline(_result(0.02, 300.0, goodput=_g(2.0, 2.5)))
    assert h["single_tok_s"] == pytest.approx(50.0)
    assert h["conc_tok_s"] == 300.0 and h["chat_tok_s"] == 50.0 and h["ttft_p50"] == 1.0 and h["ttft_p99"] == 2.0
    assert h["itl_p99"] == 0.12 and h["attainment"] == 0.95 and h["attainment_derived"] == 0.5
    assert (h["goodput_lo"], h["goodput_hi"], h["goodput_status"]) == (2.0, 2.5, "found")
    assert (h["fixed_goodput_lo"], h["fixed_goodput_hi"]) == (0.0, 0.5)
    assert (h["rate_attainment"], h["rate_attainment_fixed"]) == (0.95, 0.7)
    assert h["failed"] == 0
    empty = C.headline({})
    assert empty.pop("failed") == 0 and all(v is None for v in empty.values())
    res = _result(0.02, 300.0)
    res["chat"]["summary"]["failed"], res["single"]["summary"]["failed"] = 2, 1
    assert C.headline(res)["failed"] == 3


def _heads(C):
    return {"disaggregated": C.headline(_result(0.025, 330.0, 60.0, itl_p99=0.140, goodput=_g(1.0, 1.25),
                                                prompt_tok_s=540.0)),
            "colocated": C.headline(_result(0.025, 300.0, 50.0, itl_p99=3.0, goodput=_g(0.5, 0.6))),
            "llama-server": C.headline(_result(0.0125, 100.0, 25.0, itl_p99=3.6,
                                               goodput=_g(None, 0.25, "below_min", first=(0.5, 0.3)),
                                               att=0.4, prompt_tok_s=270.0))}


def test_verdicts(C):
    checks = {c["label"]: c for c in C.verdicts(_heads(C))}
    single = checks["single-stream decode tok/s, disaggregated / llama-server"]
    assert single["lo"] == pytest.approx(0.5) and single["target"] == ">= 1x" and single["verdict"] == "not met"
    prompt = checks["prompt processing tok/s (2,048-token prompt), disaggregated / llama-server"]
    assert prompt["lo"] == pytest.approx(2.0) and prompt["verdict"] == "met"
    attainment = checks["SLO attainment @16 (fixed SLO), disaggregated"]
    assert attainment["lo"] == 0.95 and attainment["verdict"] == "met"  # >= 0.9 and >= 2 x 0.4
    at_rate = checks["SLO attainment at the common rate (derived SLO), disaggregated"]
    assert at_rate["lo"] == 0.95 and at_rate["verdict"] == "not met"      # >= 0.9 but < 2 x 0.5
    at_rate_fixed = checks["SLO attainment at the common rate (fixed SLO), disaggregated"]
    assert at_rate_fixed["lo"] == 0.7 and at_rate_fixed["verdict"] == "not met"  # >= 2 x 0.3 but < 0.9
    conc = checks["32-concurrent output tok/s, disaggregated / llama-server"]
    assert conc["lo"] == pytest.approx(3.3) and conc["verdict"] == "met"
    chat = checks["bimodal chat @16 output tok/s, disaggregated / llama-server"]
    assert chat["lo"] == pytest.approx(2.4) and chat["verdict"] == "met"
    # llama-server missed even 0.25 req/s: disaggregated's >= 1.0 req/s is > 4x of it
    vs_llama = checks["bimodal goodput (derived SLO), disaggregated / llama-server"]
    assert (vs_llama["lo"], vs_llama["hi"]) == (4.0, math.inf) and vs_llama["verdict"] == "met"
    vs_coloc = checks["bimodal goodput (derived SLO), disaggregated / colocated"]
    assert vs_coloc["lo"] == pytest.approx(1.0 / 0.6) and vs_coloc["hi"] == pytest.approx(2.5)
    assert vs_coloc["verdict"] == "met"  # 1.67 >= 1.5 at the bracket's worst end
    itl = checks["inter-token gap p99 at concurrency 16, disaggregated"]
    assert itl["lo"] == 0.140 and itl["verdict"] == "met"


def test_verdicts_with_missing_targets(C):
    checks = C.verdicts({"disaggregated": C.headline({})})
    assert [c["verdict"] for c in checks] == ["n/a"] * 10


def test_build_table(C):
    heads = _heads(C)
    table = C.build_table(heads, C.verdicts(heads))
    lines = table.splitlines()
    assert lines[0].startswith("| target | single-stream tok/s")
    assert lines[2] == ("| disaggregated | 40.0 | 540 | 330.0 | 60.0 | 1.00 / 2.00 | 80 | 140 | 95 % / 50 % | < 0.500 "
                        "| 1.000–1.250 | 0 |")
    assert lines[4].endswith("| < 0.250 | 0 |")  # llama-server: below the lowest rate probed
    assert "| bimodal goodput (derived SLO), disaggregated / llama-server | >= 4.00x | >= 2x | met |" in lines
    assert "| bimodal goodput (derived SLO), disaggregated / colocated | 1.67–2.50x | >= 1.5x | met |" in lines
    assert "| inter-token gap p99 at concurrency 16, disaggregated | 140 ms | < 150 ms | met |" in lines
    # a target that did not run shows dashes, not an error
    assert "| SLO attainment @16 (fixed SLO), disaggregated | 95 % | >= 0.9 and >= 2x llama-server's (40 %) | met |" \
        in lines
    assert "| x | - | - | - | - | - / - | - | - | - / - | - | - | 0 |" in \
        C.build_table({"x": C.headline({})}, []).splitlines()


def test_scale_table_and_slo_text(C):
    sweep = [{"scale": s, "attainment": a} for s, a in ((1, 0.0), (2, 0.25), (5, 1.0))]
    results = {"goodput_plan": {"rate_start": 0.3}, "targets": {"a": {"goodput": {"vs_scale": sweep}}, "b": {}}}
    lines = C.scale_table(results).splitlines()
    assert "0.300 req/s" in lines[0]
    assert lines[2] == "| target | scale 1 | scale 2 | scale 5 |"
    assert lines[4] == "| a | 0 % | 25 % | 100 % |" and len(lines) == 5
    assert C.scale_table({"targets": {}}) == ""
    text = C.slo_text({"ttft_a": 0.1, "ttft_b": 0.002, "tpot": 0.02, "ttft_from": "x", "tpot_from": "y"}, 5)
    assert "TTFT <= 5 x (100 ms + 2.000 ms/prompt token)" in text and "30.50 s at 3,000" in text
    assert "TPOT <= 5 x 20.0 ms = 100 ms (from y)" in text
    assert C.slo_text(None, 5).startswith("Derived SLO: none")


def test_probe_size(C):
    plan = C.Plan(probe_seconds=60, probe_min_requests=10, probe_max_requests=32)
    assert C.probe_size(0.05, plan) == 10 and C.probe_size(0.3, plan) == 18 and C.probe_size(2.0, plan) == 32


def test_derive_slo_takes_the_best_calibration_or_the_reused_one(C):
    def target(a, b, tpot):
        return {"calibration": {"slo": {"ttft_a": a, "ttft_b": b, "tpot": tpot}}}
    results = {"targets": {"disaggregated": target(0.1, 0.004, 0.02), "llama-server": target(0.05, 0.002, 0.03),
                           "colocated": {"calibration": {"error": "every request failed"}}}}
    slo, d = C.derive_slo(results, None, C.QUICK, 0, None)
    assert (slo.ttft.a, slo.ttft.b, slo.tpot) == (0.05, 0.002, 0.02)
    assert d["ttft_from"] == "llama-server" and d["tpot_from"] == "disaggregated"
    earlier = {"command": "python bench/compare.py", "derived_slo": {"ttft_a": 1.0, "ttft_b": 0.0, "tpot": 0.5}}
    slo, d = C.derive_slo(results, earlier, C.QUICK, 0, None)
    assert slo.tpot == 0.5 and d["reused_from"] == "python bench/compare.py"
    assert C.derive_slo({"targets": {}}, None, C.QUICK, 0, None) == (None, {})


def test_short_requests_are_seeded(C):
    a = C.short_requests(3, (50, 100), 128, seed=0, kind="concurrent")
    b = C.short_requests(3, (50, 100), 128, seed=0, kind="concurrent")
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(50 <= r.prompt_len == len(r.prompt) <= 100 and r.max_tokens == 128 for r in a)


def test_runner_goodput_on_a_synthetic_server(C):
    """Runner.goodput's plumbing with serve.measure replaced by a server whose latencies are the SLO basis
    times (1 + rate): at scale 2 it meets the derived SLO up to 1 req/s; long prompts never meet the fixed one."""
    S = C.S
    basis = S.DerivedSlo(S.LinearFit(0.1, 0.001), 0.02)
    sent = []

    def measure(requests, arrival, rate=None, concurrency=None):
        assert arrival == "poisson"
        sent.append((rate, len(requests)))
        k = 1 + rate
        recs = [{"ok": True, "prompt_len": r.prompt_len, "ttft": basis.ttft(r.prompt_len) * k, "tpot": basis.tpot * k,
                 "itl": [0.01], "e2e": 1.0, "n_out": r.max_tokens} for r in requests]
        return {"rate": rate, "records": recs, "summary": S.summarize(recs, 10.0),
                "attainment": S.slo_attainment(recs, 2.5, 0.1)}

    r = object.__new__(C.Runner)
    r.plan = C.Plan(probe_seconds=20, probe_min_requests=10, probe_max_requests=20, max_probes=4)
    r.seed, r.long_share, r.slo_target, r.measure = 0, None, 0.9, measure
    g = r.goodput(basis, 2.0, 0.3)
    assert [q["rate"] for q in g["probes"]] == pytest.approx([0.3, 0.6, 1.2, 0.9])
    assert [n for _, n in sent] == [10, 12, 20, 18]  # r * 20 s of arrivals, within [10, 20]
    assert g["status"] == "max_probes" and g["bracket"] == pytest.approx([0.9, 1.2])
    assert C.goodput_bracket(g) == pytest.approx((0.9, 1.2))
    assert g["fixed_bracket"] == [0.0, 0.3]  # 20 % long prompts: never 90 % under TTFT <= 2.5 s
    assert C.headline({"goodput": g})["fixed_goodput_lo"] == 0.0
    # the first probe (k = 1.3) scored at every scale: misses at 1, meets from 2 up
    assert [(q["scale"], q["attainment"]) for q in g["vs_scale"]] == [(1, 0.0), (2, 1.0), (3, 1.0), (5, 1.0), (8, 1.0)]
    assert "itl" not in g["probes"][0]["records"][0] and g["rate_start"] == 0.3 and g["scale"] == 2.0


def test_json_safe(C):
    import json
    out = C.json_safe({"a": [1.0, math.inf, (2, -math.inf)], "b": {"c": math.inf}, "d": "x"})
    assert out == {"a": [1.0, None, [2, None]], "b": {"c": None}, "d": "x"}
    json.dumps(out, allow_nan=False)


def test_the_slo_table_configures_the_slo_a_pass_is_judged_on(C):
    import tomllib

    from nodeserve.config import config_from_dict
    from nodeserve.goodput import DerivedSlo

    ttft, tpot, per_token = DerivedSlo.from_dict({"ttft_a": 0.0, "ttft_b": 0.000746, "tpot": 0.0041}).at(5)
    cfg = config_from_dict(tomllib.loads(C.slo_table(ttft, tpot, per_token)))
    assert (cfg.slo.ttft_s, cfg.slo.tpot_s, cfg.slo.ttft_per_token_s) == (0.0, tpot, per_token)
    assert cfg.slo.tpot_s == pytest.approx(0.0205)


ZEN3_FLAGS = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 popcnt avx f16c bmi1 avx2 bmi2 vaes vpclmulqdq sha_ni"


def test_cpu_class_avx2_is_a_proxy_only_on_a_cpu_with_more(C):
    """An AVX2-only Zen 3 runs the avx2 class for real; a CPU with AVX-512, AVX-VNNI or AMX as a proxy."""
    assert not C.class_is_proxy("avx2", ZEN3_FLAGS)
    for extra in ("avx512f", "avx_vnni", "amx_int8"):
        assert C.class_is_proxy("avx2", f"{ZEN3_FLAGS} {extra}")
    text = C.class_text({"class": "avx2", "proxy": True, "nodeserve_env": C.CPU_CLASS_ENV["avx2"]})
    assert "proxy" in text and "NODESERVE_KERNELS_MARCH=x86-64-v3" in text and C.class_text(None) == ""


def test_the_avx2_class_llama_build_turns_native_and_avx512_off(load_bench):
    B = load_bench("build_llama")
    native, avx2 = B.cmake_args(), B.cmake_args("avx2")
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_NATIVE=ON" not in avx2 and "-DGGML_NATIVE=OFF" in avx2
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{on}=ON" in avx2
    for off in ("AVX512", "AVX512_VNNI", "AVX_VNNI", "AMX_INT8"):
        assert f"-DGGML_{off}=OFF" in avx2
    assert set(native) - {"-DGGML_NATIVE=ON"} <= set(avx2)  # everything else as the native build
    # its own cache entry, never the native build's
    assert B.cache_key("cc 12", ZEN3_FLAGS, "avx2") != B.cache_key("cc 12", ZEN3_FLAGS)
    with pytest.raises(ValueError):
        B.ensure(cpu_class="avx512")
    label = B.label({"llama_cpp_build": 1, "llama_cpp_commit": "c", "isa": ["avx", "avx2"], "cpu_class": "avx2"})
    assert "avx2 class (GGML_NATIVE=OFF)" in label and "-march=native" not in label


def test_a_class_llama_server_is_only_the_native_build(load_bench):
    L = load_bench("llama_server")
    with pytest.raises(ValueError):
        L.start(backend="xllamacpp", cpu_class="avx2")
