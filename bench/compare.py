"""nodeserve (disaggregated, colocated, adaptive) against llama.cpp's llama-server: the same seeded workloads, one
server at a time on loopback, one table.

Two passes over the targets; each pass starts a target's server (bench/local_server.py for nodeserve,
bench/llama_server.py for llama-server), warms it up with one short and one 1,024-token request, runs its
phases through bench/serve.py's load generator, and stops it (always: also on an exception or Ctrl-C).

Pass 1, per target:
0. calibration: one request at a time, prompts of a few lengths spanning the bimodal workload's range
   (64 to 3,000 tokens), `calib_output` tokens each: the unloaded TTFT per length, fitted as
   TTFT = a + b * prompt_tokens, and the unloaded TPOT (median), stats.calibrate;
1. single stream: short prompts (64 tokens), 256 output tokens, one request at a time -> decode tok/s
   (1 / median TPOT) and TPOT; then prompt processing: three 2,048-token prompts, one output token, one at a time
   -> prompt tok/s (2,048 / median TTFT);
2. 32 concurrent short requests: prompts 50-100 tokens, 128 output tokens, 64 requests at concurrency 32
   -> output tok/s, TPOT p99;
3. bimodal chat at concurrency 16 -> output tok/s, SLO attainment, TTFT p50/p99, TPOT p99, inter-token gap
   (ITL) p99; on nodeserve it also records the per-device timeline (GET /debug/steps) and plots it.

Between the passes: the machine-derived SLO (DistServe). The lowest TTFT fit and the lowest TPOT over every
calibrated target (stats.best_slo) are the unloaded basis; at SLO scale s a request must meet
TTFT <= s * (a + b * prompt_tokens) and TPOT <= s * unloaded TPOT (`--slo-scale`, default 5).

Pass 2, per target:
4. bimodal goodput: Poisson probes at a start rate common to every target (1 / the mean unloaded latency of
   the workload's requests under that basis, or `--rate-start`), then up (x2) or down (/2) until the 90 %
   attainment is bracketed, then bisected while probes last (`--max-probes`). A probe at rate r sends
   r * `--probe-seconds` requests (clamped to [min, max] requests; the same seeded list, cut). Each probe is
   also scored against the fixed SLO, which gives the fixed-SLO goodput bracket from the same runs, and the
   first probe (the common rate) against SLO scales 1, 2, 3, 5, 8 (attainment vs scale).

The default mode's SLO-attainment target is judged three ways: closed-loop at concurrency 16 (phase 3; it
saturates every server on two cores, so it mostly measures queueing), and at the common rate (the first probe, an
open-loop Poisson load, as DistServe defines attainment) under the fixed and under the derived SLO. With 20 % of
prompts 1,500-3,000 tokens, the fixed SLO's flat 2.5 s TTFT is out of reach for those prompts on a machine that
prefills under 600 tok/s, idle or not: the fixed-SLO figures cannot reach 90 % there; the derived SLO scales TTFT
with prompt length.

A nodeserve server is configured (`[slo]`) with the SLO it is judged on, as an operator would (its prefill order
and, disaggregated, its decode device's lending between steps aim at it; since 2026-11-27): the fixed SLO in pass
1, the derived SLO in pass 2's search. After the search, one more probe at the common rate runs on a server
configured with the fixed SLO, and gives the fixed-SLO attainment at the common rate; the fixed-SLO goodput
bracket still comes from the search's probes (a server aiming at the derived SLO).

The model: `--model`, a bundled model name or a .gguf path (default the bundled SmolLM2-135M-Instruct Q4_1);
nodeserve's [model] path and llama-server's -m are the same file (bench/llama_server.py gguf_path). The requests
are token ids drawn from [1000, 40000) (bench/workloads.py), ordinary tokens in both bundled vocabularies.

Every request streams with ignore_eos, so it produces exactly max_tokens tokens, on a new connection
(serve.run's force_close); every target gets the same requests (same seeds); llama-server gets
`cache_prompt: false` and nodeserve `[kv] prefix_cache = false`, as the goodput probes resend the same prompts
(before 2026-11-23 20:20 UTC nodeserve's cache was left on: the results of that day's run are optimistic for
nodeserve wherever a prompt was sent twice). The fixed SLO (stats.py): TTFT <= 2.5 s
and TPOT <= 100 ms for 90 % of requests; --slo-ttft-per-token makes its TTFT length-aware.

The llama-server peer is bench/llama_server.py's `--llama-backend` (default auto: the llama-server built natively
for this CPU by bench/build_llama.py, -march=native, else the prebuilt wheels). A comma-separated list runs each
peer as its own target, in the list's order, e.g. `--llama-backend native,xllamacpp`: the first is "llama-server"
(the one the issue's targets compare against), the others "llama-server-<backend>"; each gets its own row, and
results.json and table.md name every peer's build and the CPU features it was compiled for. `--targets
llama-server-<backend>` runs that peer alone (with --reuse: one peer added to an earlier run).

llama-server runs with -t 2 by default. Its threads spin at an OpenMP barrier after every op, so when other
work holds a core it slows down 10-100x; on a machine shared with other work, pass --llama-passive
(OMP_WAIT_POLICY=passive) and read the load averages recorded per target in results.json.

    python bench/compare.py                      # all four targets, 35.5 min on the 2-core machine
    python bench/compare.py --quick              # a ~10-minute smoke version (numbers mean little)
    python bench/compare.py --model gemma-3-270m # the same on the bundled Gemma 3 270M Q4_K_M
    python bench/compare.py --targets disaggregated,llama-server --nodeserve-model-extra 'quantization = "fp16"'
    python bench/compare.py --targets disaggregated,llama-server --llama-backend native,xllamacpp
    python bench/compare.py --targets disaggregated --nodeserve-kv-extra 'dtype = "float16"' --reuse RESULTS_JSON
    python bench/compare.py --cpu-class avx2     # both sides as an AVX2-only CPU runs them (below)

`--cpu-class avx2` measures the AVX2 class on any x86 machine, in one run: nodeserve with its native kernels built
for x86-64-v3 and forced to their AVX2 paths, torch's kernels capped at AVX2 (CPU_CLASS_ENV), against llama-server
built for the same class (bench/build_llama.py --cpu-class avx2: GGML_NATIVE=OFF, AVX2/FMA/F16C on, AVX-512 off;
several minutes the first time). On a CPU with more than AVX2 this is a proxy, and results.json and table.md say
so; on an AVX2-only CPU it is the real thing. Results go to compare-avx2 (compare-avx2-<model>).

Writes into --out-dir (default $NODESERVE_BENCH_DIR/compare, else ~/.cache/nodeserve/bench/compare: bench/outputs.py;
compare-<model> for another --model, e.g. compare-gemma-3-270m): results.json (machine, date, command, the model
and its file, llama-server version, every phase's summary per target, calibration and probe records, the derived
SLO), table.md (the tables and the issue's targets met / not met), latency_cdf.png (phase 3, targets overlaid),
attainment_vs_rate.png and attainment_vs_scale.png (pass 2) and timeline_<target>.png (phase 3, nodeserve).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import load_json, out_path  # noqa: E402
import llama_server as L  # noqa: E402  (bench/ is scripts, not a package)
import serve  # noqa: E402
import stats as S  # noqa: E402
import timeline as TL  # noqa: E402
import workloads as W  # noqa: E402
from local_server import start_server  # noqa: E402
from cpu_class import CPU_CLASS_ENV, class_is_proxy, class_text, nodeserve_env  # noqa: E402

TARGETS = ("disaggregated", "colocated", "adaptive", "llama-server")
NODESERVE = ("disaggregated", "colocated", "adaptive")
DISAGG, COLOC, ADAPT, LLAMA = TARGETS
SCALES = (1, 2, 3, 5, 8)  # SLO scales reported at the common rate
def kernels_lines(log_path: str) -> list[str]:
    """The lines of a nodeserve log that name the kernels it chose (native.load's and the loader's)."""
    try:
        with open(log_path, errors="replace") as f:
            return [line.strip() for line in f if "CPU kernels:" in line or "integer kernels" in line]
    except OSError:
        return []


def llama_peers(backends: list[str]) -> dict[str, str]:
    """Target name -> llama_server backend for each peer in --llama-backend's order: the first is LLAMA, the
    one the issue's targets compare against; the others are LLAMA-<backend>."""
    return {(LLAMA if k == 0 else f"{LLAMA}-{b}"): b for k, b in enumerate(backends)}


def is_llama(name: str) -> bool:
    return name == LLAMA or name.startswith(LLAMA + "-")


@dataclass(frozen=True)
class Plan:
    """How much of each phase to run."""

    calib_lens: tuple[int, ...] = (64, 512, 1024, 2048, 3000)
    calib_output: int = 32
    single_requests: int = 4
    single_prompt: int = 64
    single_output: int = 256
    prompt_requests: int = 3      # prompt processing: prompts of prompt_tokens, one output token, one at a time
    prompt_tokens: int = 2048
    conc_requests: int = 64
    concurrency: int = 32
    conc_output: int = 128
    chat_requests: int = 48
    chat_concurrency: int = 16
    probe_seconds: float = 60.0   # a probe at rate r sends r * probe_seconds requests ...
    probe_min_requests: int = 10  # ... clamped to [min, max]
    probe_max_requests: int = 32
    max_probes: int = 4
    goodput_budget_s: float = 360.0  # no further probe whose arrivals alone would end the search past this
    rate_growth: float = 2.0
    rate_span: float = 16.0       # the search stays within [start / span, start * span]
    rate_rel_tol: float = 0.25    # bisect until the bracket's width <= this share of its low end
    warmup: bool = True


FULL = Plan()
QUICK = Plan(calib_lens=(64, 1024), calib_output=8, single_requests=2, single_output=64, prompt_requests=1,
             conc_requests=32,
             conc_output=16, chat_requests=4, probe_seconds=15.0, probe_min_requests=4, probe_max_requests=6,
             max_probes=2, goodput_budget_s=90.0)


# ---- pure: headline numbers, brackets, ratios, verdicts, tables ------------------------------------------

def _get(d, *keys):
    """d[k0][k1]... (an int key indexes a list), or None where a level is missing."""
    for k in keys:
        if d is None:
            return None
        if isinstance(k, int):
            d = d[k] if isinstance(d, list) and -len(d) <= k < len(d) else None
        else:
            d = d.get(k)
    return d


def goodput_bracket(g: dict | None) -> tuple[float | None, float | None]:
    """A goodput search's bracket as (lo, hi): lo the highest rate that met the target (0.0 if none did),
    hi the lowest rate above it that missed (inf if none did); (None, None) without a search."""
    if not g:
        return None, None
    lo, hi = g.get("bracket") or (None, None)
    return (lo if lo is not None else 0.0), (hi if hi is not None else math.inf)


def bracket_ratio(a: tuple[float | None, float | None], b: tuple[float | None, float | None]
                  ) -> tuple[float | None, float | None]:
    """The range of x / y for x in bracket a and y in bracket b (each (lo, hi), 0 <= lo <= hi <= inf):
    (a_lo / b_hi, a_hi / b_lo), with x / inf = 0 and x / 0 = inf; (None, None) if either is unknown."""
    if None in a or None in b:
        return None, None
    lo = 0.0 if a[0] == 0 or b[1] == math.inf else a[0] / b[1]
    hi = math.inf if a[1] == math.inf or b[0] == 0 else a[1] / b[0]
    return lo, hi


def bracket_verdict(lo: float | None, hi: float | None, target: float) -> str:
    """"met" (the whole bracket >= target), "not met" (all of it below), "undecided", or "n/a"."""
    if lo is None or hi is None:
        return "n/a"
    if lo >= target:
        return "met"
    if hi < target:
        return "not met"
    return "undecided"


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    """"met", "not met" or "n/a" (no value) for an exact value."""
    if value is None:
        return "n/a"
    return "met" if (value >= target if higher_is_better else value < target) else "not met"


def headline(res: dict) -> dict:
    """The table's numbers for one target's results (None where a phase did not run or had no data)."""
    tpot_single = _get(res, "single", "summary", "tpot", "p50")
    chat = _get(res, "chat", "summary")
    g = _get(res, "goodput")
    lo, hi = goodput_bracket(g)
    flo, fhi = goodput_bracket({"bracket": _get(g, "fixed_bracket")}) if g else (None, None)
    return {
        "single_tok_s": 1.0 / tpot_single if tpot_single else None,
        "single_tpot": tpot_single,
        "single_ttft": _get(res, "single", "summary", "ttft", "p50"),
        "prompt_tok_s": _get(res, "prompt", "prompt_tok_s"),
        "conc_tok_s": _get(res, "concurrent", "summary", "output_token_throughput"),
        "conc_tpot_p99": _get(res, "concurrent", "summary", "tpot", "p99"),
        "chat_tok_s": _get(chat, "output_token_throughput"),
        "ttft_p50": _get(chat, "ttft", "p50"), "ttft_p99": _get(chat, "ttft", "p99"),
        "tpot_p99": _get(chat, "tpot", "p99"), "itl_p99": _get(chat, "itl", "p99"),
        "attainment": _get(res, "chat", "attainment", "attainment"),
        "attainment_derived": _get(res, "chat", "attainment_derived", "attainment"),
        # the first goodput probe: every target at the same Poisson rate, the SLO attainment DistServe defines
        "rate_attainment": _get(g, "probes", 0, "attainment", "attainment"),
        # (nodeserve: its own probe, on a server configured with the fixed SLO; before 2026-11-27, the first one)
        "rate_attainment_fixed": _get(g, "fixed_probe", "attainment", "attainment")
        if _get(g, "fixed_probe") else _get(g, "probes", 0, "attainment_fixed", "attainment"),
        "goodput_lo": lo, "goodput_hi": hi, "goodput_status": _get(g, "status"),
        "fixed_goodput_lo": flo, "fixed_goodput_hi": fhi,
        # failed requests over phases 1-3 (goodput probes count theirs as SLO misses)
        "failed": sum(_get(res, phase, "summary", "failed") or 0
                      for phase in ("single", "prompt", "concurrent", "chat")),
    }


# (label, numerator target, denominator target, headline key, target factor): ratios of exact values (issue #27)
RATIO_TARGETS = (
    ("single-stream decode tok/s, disaggregated / llama-server", DISAGG, LLAMA, "single_tok_s", 1.0),
    ("prompt processing tok/s (2,048-token prompt), disaggregated / llama-server", DISAGG, LLAMA, "prompt_tok_s",
     1.0),
    ("32-concurrent output tok/s, disaggregated / llama-server", DISAGG, LLAMA, "conc_tok_s", 3.0),
    ("bimodal chat @16 output tok/s, disaggregated / llama-server", DISAGG, LLAMA, "chat_tok_s", 2.0),
)
ATTAINMENT_TARGET = (0.9, 2.0)  # the default mode's SLO attainment: at least this, and this x llama's
# (label, headline key): where the target is judged. Closed-loop @16 saturates both servers; the common rate is an
# open-loop Poisson load every target gets, as DistServe measures attainment.
ATTAINMENTS = (("SLO attainment @16 (fixed SLO), disaggregated", "attainment"),
               ("SLO attainment at the common rate (fixed SLO), disaggregated", "rate_attainment_fixed"),
               ("SLO attainment at the common rate (derived SLO), disaggregated", "rate_attainment"))
# (label, numerator, denominator, target factor): ratios of goodput brackets under the derived SLO
GOODPUT_TARGETS = (
    ("bimodal goodput (derived SLO), disaggregated / llama-server", DISAGG, LLAMA, 2.0),
    ("bimodal goodput (derived SLO), disaggregated / colocated", DISAGG, COLOC, 1.5),
)
ITL_TARGET = 0.150  # disaggregated inter-token gap p99 at concurrency 16, seconds


def verdicts(heads: dict[str, dict]) -> list[dict]:
    """The issue's targets against the headline numbers of the targets that ran. Each entry has lo and hi
    (equal for an exact value; a goodput ratio is a bracket) and a verdict."""
    out = []
    for label, a, b, key, factor in RATIO_TARGETS:
        x, y = (heads.get(a) or {}).get(key), (heads.get(b) or {}).get(key)
        value = x / y if x is not None and y else None
        out.append({"label": label, "lo": value, "hi": value, "target": f">= {factor:g}x",
                    "verdict": verdict(value, factor)})
    for label, a, b, factor in GOODPUT_TARGETS:
        ha, hb = heads.get(a) or {}, heads.get(b) or {}
        lo, hi = bracket_ratio((ha.get("goodput_lo"), ha.get("goodput_hi")),
                               (hb.get("goodput_lo"), hb.get("goodput_hi")))
        out.append({"label": label, "lo": lo, "hi": hi, "target": f">= {factor:g}x",
                    "verdict": bracket_verdict(lo, hi, factor)})
    least, factor = ATTAINMENT_TARGET
    for label, key in ATTAINMENTS:
        ours, theirs = (heads.get(DISAGG) or {}).get(key), (heads.get(LLAMA) or {}).get(key)
        met = None if ours is None or theirs is None else ours >= least and ours >= factor * theirs
        out.append({"label": label, "lo": ours, "hi": ours,
                    "target": f">= {least:g} and >= {factor:g}x llama-server's ({_pct(theirs)})",
                    "verdict": "n/a" if met is None else "met" if met else "not met"})
    itl = (heads.get(DISAGG) or {}).get("itl_p99")
    out.append({"label": "inter-token gap p99 at concurrency 16, disaggregated", "lo": itl, "hi": itl,
                "target": f"< {ITL_TARGET * 1000:g} ms", "verdict": verdict(itl, ITL_TARGET, higher_is_better=False)})
    return out


def _num(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def fmt_bracket(lo: float | None, hi: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    """[lo, hi] as text: "x" if lo == hi, "lo–hi", "< hi" (lo = 0), ">= lo" (hi = inf), "-" if unknown."""
    if lo is None or hi is None or (lo == 0 and hi == math.inf):
        return "-"
    if lo == hi:
        return format(lo, fmt) + suffix
    if lo == 0:
        return "< " + format(hi, fmt) + suffix
    if hi == math.inf:
        return ">= " + format(lo, fmt) + suffix
    return f"{lo:{fmt}}–{hi:{fmt}}{suffix}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f} %"


def build_table(heads: dict[str, dict], checks: list[dict]) -> str:
    """The markdown table (one row per target, in run order) and the targets block."""
    lines = ["| target | single-stream tok/s | 2k-prompt tok/s | 32-conc output tok/s | bimodal @16 output tok/s "
             "| TTFT p50 / p99 @16 (s) | TPOT p99 @16 (ms) | ITL p99 @16 (ms) | attainment @16 fixed / derived "
             "| goodput fixed SLO (req/s) | goodput derived SLO (req/s) | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, h in heads.items():
        lines.append(f"| {name} | {_num(h['single_tok_s'], '.1f')} | {_num(h['prompt_tok_s'], '.0f')} "
                     f"| {_num(h['conc_tok_s'], '.1f')} "
                     f"| {_num(h['chat_tok_s'], '.1f')} "
                     f"| {_num(h['ttft_p50'], '.2f')} / {_num(h['ttft_p99'], '.2f')} "
                     f"| {_num(h['tpot_p99'], '.0f', 1000)} | {_num(h['itl_p99'], '.0f', 1000)} "
                     f"| {_pct(h['attainment'])} / {_pct(h['attainment_derived'])} "
                     f"| {fmt_bracket(h['fixed_goodput_lo'], h['fixed_goodput_hi'], '.3f')} "
                     f"| {fmt_bracket(h['goodput_lo'], h['goodput_hi'], '.3f')} | {h['failed']} |")
    lines += ["", "| issue target | measured | target | verdict |", "|---|---:|---:|---|"]
    for c in checks:
        if c["label"].startswith("inter-token"):
            shown = _num(c["lo"], ".0f", 1000) + (" ms" if c["lo"] is not None else "")
        elif c["label"].startswith("SLO attainment"):
            shown = _pct(c["lo"])
        else:
            shown = fmt_bracket(c["lo"], c["hi"], ".2f", "x")
        lines.append(f"| {c['label']} | {shown} | {c['target']} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def scale_table(results: dict) -> str:
    """Attainment against SLO scale at the common rate (each target's first goodput probe)."""
    rows = [(name, _get(res, "goodput", "vs_scale")) for name, res in results["targets"].items()]
    rows = [(n, v) for n, v in rows if v]
    if not rows:
        return ""
    scales = [p["scale"] for p in rows[0][1]]
    rate = _get(results, "goodput_plan", "rate_start")
    lines = [f"Attainment against SLO scale at the common rate ({_num(rate, '.3f')} req/s):", "",
             "| target | " + " | ".join(f"scale {s:g}" for s in scales) + " |",
             "|---|" + "---:|" * len(scales)]
    for name, sweep in rows:
        lines.append(f"| {name} | " + " | ".join(_pct(p["attainment"]) for p in sweep) + " |")
    return "\n".join(lines) + "\n"


def llama_text(results: dict) -> str:
    """Which llama-server each llama target ran: its build (with the CPU features it was compiled for), version,
    flags and OpenMP wait policy; "not run" if none ran."""
    parts = []
    for name, res in results["targets"].items():
        srv = _get(res, "server")
        if not is_llama(name) or not srv:
            continue
        parts.append(f"{name} = {srv.get('build') or srv['backend']}: {srv['version']} ({srv['args']}, OpenMP wait "
                     f"policy {srv['omp_wait_policy']}" + (f"; {srv['note']}" if srv["note"] else "") + ")")
    return "; ".join(parts) or "not run"


def slo_text(slo: dict | None, scale: float, target: float = S.DEFAULT_SLO_TARGET) -> str:
    """One line on the derived SLO: its basis, where it came from, and its values at `scale`."""
    if not slo:
        return "Derived SLO: none (no target calibrated)."
    a, b, tpot = slo["ttft_a"], slo["ttft_b"], slo["tpot"]
    return (f"Derived SLO at scale {scale:g}: TTFT <= {scale:g} x ({a * 1000:.0f} ms + {b * 1000:.3f} ms/prompt token) "
            f"(TTFT fit from {slo.get('ttft_from', '?')}: {scale * (a + 64 * b):.2f} s at 64 tokens, "
            f"{scale * (a + 3000 * b):.2f} s at 3,000) and TPOT <= {scale:g} x {tpot * 1000:.1f} ms = "
            f"{scale * tpot * 1000:.0f} ms (from {slo.get('tpot_from', '?')}), for {target * 100:g} % of requests.")


# ---- workloads --------------------------------------------------------------------------------------------

def probe_pool(plan: Plan, seed: int, long_share: float | None) -> list[W.Request]:
    """The goodput probes' seeded bimodal requests; a probe sends the first n."""
    return W.generate("bimodal", plan.probe_max_requests, seed + 1, long_share=long_share)


def short_requests(n: int, prompt: tuple[int, int], output: int, seed: int, kind: str) -> list[W.Request]:
    """n seeded id prompts with lengths drawn from `prompt` (inclusive) and a fixed output length."""
    rng = random.Random(f"{kind}-{seed}")
    out = []
    for _ in range(n):
        k = rng.randint(*prompt)
        out.append(W.Request(W.make_prompt(rng, k), k, output, kind))
    return out


# ---- one target -------------------------------------------------------------------------------------------

def probe_size(rate: float, plan: Plan) -> int:
    """Requests in a goodput probe at `rate`: about plan.probe_seconds of arrivals, within the plan's bounds."""
    return max(plan.probe_min_requests, min(plan.probe_max_requests, round(rate * plan.probe_seconds)))


def _slim(records: list[dict]) -> list[dict]:
    """Records without their inter-token gaps: what SLO attainment needs, small enough to keep for every probe."""
    return [{k: v for k, v in r.items() if k != "itl"} for r in records]


class Runner:
    """Runs the phases against one server url; keeps what serve.measure returns, less most records."""

    def __init__(self, url: str, plan: Plan, seed: int, slo: tuple[float, float, float], long_share: float | None,
                 extra_body: dict | None = None, ttft_per_token: float = 0.0):
        self.url, self.plan, self.seed, self.long_share = url, plan, seed, long_share
        self.ttft_per_token = ttft_per_token
        self.extra_body = extra_body or {}
        self.slo_ttft, self.slo_tpot, self.slo_target = slo
        self.model = serve.default_model(url, {})

    def measure(self, requests, arrival: str, rate: float | None = None, concurrency: int | None = None) -> dict:
        return serve.measure(self.url, self.model, requests, arrival, rate, concurrency, self.seed,
                             extra_body=self.extra_body, slo_ttft=self.slo_ttft, slo_tpot=self.slo_tpot,
                             progress=False, force_close=True, ttft_per_token=self.ttft_per_token)  # the same for every target; see serve.run

    def warmup(self) -> None:
        reqs = short_requests(1, (32, 32), 8, self.seed + 100, "warmup") + \
            short_requests(1, (1024, 1024), 2, self.seed + 101, "warmup")
        self.measure(reqs, "concurrency", concurrency=1)

    def calibrate(self) -> dict:
        """Phase 0: one request at a time at each calibration length -> records and the unloaded SLO basis."""
        p = self.plan
        reqs = [r for k, n in enumerate(p.calib_lens)
                for r in short_requests(1, (n, n), p.calib_output, self.seed + 200 + k, "calibration")]
        m = self.measure(reqs, "concurrency", concurrency=1)
        out = {"records": _slim(m["records"]), "summary": m["summary"]}
        try:
            out["slo"] = S.calibrate(m["records"]).as_dict()
        except ValueError as e:  # every request failed: this target gives no basis
            out["error"] = str(e)
        return out

    def single(self) -> dict:
        p = self.plan
        reqs = short_requests(p.single_requests, (p.single_prompt, p.single_prompt), p.single_output, self.seed,
                              "single")
        return _brief(self.measure(reqs, "concurrency", concurrency=1))

    def prompt(self) -> dict:
        """Prompt processing: prompts of plan.prompt_tokens, one output token, one at a time -> prompt tok/s as
        prompt tokens / median TTFT (the TTFT holds the HTTP round trip and tokenization, on both servers)."""
        p = self.plan
        reqs = short_requests(p.prompt_requests, (p.prompt_tokens, p.prompt_tokens), 1, self.seed + 300, "prompt")
        out = _brief(self.measure(reqs, "concurrency", concurrency=1))
        ttft = _get(out, "summary", "ttft", "p50")
        out["prompt_tok_s"] = p.prompt_tokens / ttft if ttft else None
        return out

    def concurrent(self) -> dict:
        p = self.plan
        reqs = short_requests(p.conc_requests, (50, 100), p.conc_output, self.seed, "concurrent")
        return _brief(self.measure(reqs, "concurrency", concurrency=p.concurrency))

    def chat(self, steps_url: str | None) -> tuple[dict, dict | None, float | None]:
        """Phase 3; with steps_url (a nodeserve server) also the /debug/steps snapshot of the run and its
        start in the server's clock."""
        p = self.plan
        reqs = W.generate("bimodal", p.chat_requests, self.seed, long_share=self.long_share)
        t0 = TL.server_now(steps_url) if steps_url else None
        m = self.measure(reqs, "concurrency", concurrency=p.chat_concurrency)
        snap = TL.fetch(steps_url, since=t0) if steps_url else None
        out = _brief(m)
        out["records"] = m["records"]
        # the same run under the fixed TTFT SLO, for reference when the length-aware one is in use
        out["attainment_fixed_ttft"] = S.slo_attainment(m["records"], self.slo_ttft, self.slo_tpot)
        return out, snap, t0

    def goodput(self, slo: S.DerivedSlo, scale: float, rate_start: float) -> dict:
        """Phase 4: the goodput search under the derived SLO at `scale`, from `rate_start`; every probe is also
        scored against the fixed SLO, and the first one against SCALES."""
        p = self.plan
        pool = probe_pool(p, self.seed, self.long_share)
        probes: list[dict] = []

        def attainment_at(rate: float) -> float | None:
            n = probe_size(rate, p)
            m = self.measure(pool[:n], "poisson", rate=rate)
            derived = S.slo_attainment(m["records"], *slo.at(scale))
            probes.append({"rate": rate, "num_requests": n, "summary": m["summary"], "attainment": derived,
                           "attainment_fixed": m["attainment"], "records": _slim(m["records"])})
            print(f"    probe {rate:.3f} req/s x {n}: derived {_pct(derived['attainment'])}, "
                  f"fixed {_pct(m['attainment']['attainment'])}", flush=True)
            return derived["attainment"]

        t0 = time.perf_counter()

        def can_probe(rate: float) -> bool:  # the probe's arrivals must fit in what is left of the budget
            return time.perf_counter() - t0 + probe_size(rate, p) / rate <= p.goodput_budget_s

        g = S.goodput_search(attainment_at, rate_start, rate_start * p.rate_span, self.slo_target, tol=0.0,
                             growth=p.rate_growth, max_probes=p.max_probes, rate_floor=rate_start / p.rate_span,
                             rel_tol=p.rate_rel_tol, can_probe=can_probe).as_dict()
        g["probes"] = probes
        flo, fhi = S.bracket_from_points([(q["rate"], q["attainment_fixed"]["attainment"]) for q in probes],
                                         self.slo_target)
        g["fixed_bracket"] = [flo, None if fhi == math.inf else fhi]  # JSON has no infinity
        g["vs_scale"] = [{k: v for k, v in q.items() if k in ("scale", "attainment", "met", "total")}
                         for q in S.attainment_vs_scale(probes[0]["records"], slo, SCALES)]
        g["rate_start"], g["scale"] = rate_start, scale
        return g

    def fixed_probe(self, rate: float) -> dict:
        """One probe at `rate` (the goodput pool, cut as the search cuts it) scored against the fixed SLO: for a
        nodeserve server configured with that SLO, as the search's server aims at the derived one."""
        p = self.plan
        pool = probe_pool(p, self.seed, self.long_share)
        m = self.measure(pool[:probe_size(rate, p)], "poisson", rate=rate)
        print(f"    probe {rate:.3f} req/s x {len(m['records'])} aiming at the fixed SLO: fixed "
              f"{_pct(m['attainment']['attainment'])}", flush=True)
        return {"rate": rate, "summary": m["summary"], "attainment": m["attainment"],
                "records": _slim(m["records"])}


def _brief(m: dict) -> dict:
    return {"summary": m["summary"], "attainment": m["attainment"]}


def _line(name: str, phase: str, m: dict) -> str:
    s, a = m["summary"], m["attainment"]
    f = lambda d, k: "-" if d[k] is None else f"{d[k] * 1000:.0f}"  # noqa: E731
    return (f"  {name} {phase}: {s['succeeded']}/{s['requests']} ok in {s['duration_s']:.1f} s, "
            f"{s['output_token_throughput'] or 0:.1f} out tok/s, TTFT p50 {f(s['ttft'], 'p50')} ms, "
            f"TPOT p50/p99 {f(s['tpot'], 'p50')}/{f(s['tpot'], 'p99')} ms, ITL p99 {f(s['itl'], 'p99')} ms, "
            f"attainment {_pct(a['attainment'])}")


# ---- plots ------------------------------------------------------------------------------------------------

def plot_cdfs(results: dict, path: str, slo: tuple[float, float]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, res in results["targets"].items():
        recs = [r for r in (_get(res, "chat", "records") or []) if r["ok"]]
        series = ([r["ttft"] for r in recs if r["ttft"] is not None], [r["tpot"] for r in recs if r["tpot"]],
                  [g for r in recs for g in r["itl"]])
        for ax, vals in zip(axes, series):
            vals = sorted(v * 1000 for v in vals)
            if vals:
                ax.step(vals, [(k + 1) / len(vals) for k in range(len(vals))], where="post", label=name)
    for ax, title, limit in zip(axes, ("TTFT", "TPOT", "ITL (every inter-chunk gap)"), (slo[0], slo[1], None)):
        if limit is not None:
            ax.axvline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"bimodal chat at concurrency {results['plan']['chat_concurrency']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attainment(results: dict, path: str) -> str:
    """Attainment against the Poisson rate of every goodput probe: the derived SLO (solid) and the fixed one
    (dotted), per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    target = None
    for k, (name, res) in enumerate(results["targets"].items()):
        g = res.get("goodput")
        if not g:
            continue
        target, color = g["target"], f"C{k}"
        for key, style, label in (("attainment", "o-", f"{name}, derived SLO"),
                                  ("attainment_fixed", "x:", f"{name}, fixed SLO")):
            pts = sorted((q["rate"], q[key]["attainment"]) for q in g["probes"] if q[key]["attainment"] is not None)
            ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], style, color=color, label=label)
    if target is not None:
        ax.axhline(target * 100, color="red", linestyle="--", label=f"target {target * 100:g} %")
    ax.set_xscale("log")
    ax.set_xlabel("Poisson rate (req/s, log scale)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=7)
    ax.set_title(f"bimodal: derived SLO at scale {results['slo']['scale']:g} vs fixed "
                 f"(TTFT <= {results['slo']['ttft']:g} s, TPOT <= {results['slo']['tpot'] * 1000:g} ms)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scale(results: dict, path: str) -> str:
    """Attainment against the SLO scale at the common rate (each target's first probe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    target = None
    for name, res in results["targets"].items():
        g = res.get("goodput")
        if not g or not g.get("vs_scale"):
            continue
        target = g["target"]
        pts = [(q["scale"], q["attainment"]) for q in g["vs_scale"] if q["attainment"] is not None]
        ax.plot([s for s, _ in pts], [a * 100 for _, a in pts], "o-", label=name)
    if target is not None:
        ax.axhline(target * 100, color="red", linestyle="--", label=f"target {target * 100:g} %")
    ax.set_xlabel("SLO scale (x the best unloaded TTFT(prompt length) and TPOT)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    rate = _get(results, "goodput_plan", "rate_start")
    ax.set_title(f"bimodal at Poisson {_num(rate, '.3f')} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main -------------------------------------------------------------------------------------------------

def _stop(proc) -> None:
    try:
        L.stop(proc, timeout=60)
    except Exception as e:  # keep stopping the others
        print(f"warning: could not stop pid {proc.pid}: {e}", file=sys.stderr)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def slo_table(ttft: float, tpot: float, ttft_per_token: float) -> str:
    """nodeserve's [slo] table for an SLO a phase is judged on: the server aims at what it is scored by
    (its prefill order and its decode device's lending between steps read it)."""
    return f"[slo]\nttft_s = {ttft!r}\nttft_per_token_s = {ttft_per_token!r}\ntpot_s = {tpot!r}\n"


@contextlib.contextmanager
def serving(name: str, args, tmp: str, log: str, live: list, slo: tuple[float, float, float] | None = None):
    """Starts the target's server and yields (url, info); stops it on the way out, whatever happens. slo:
    (ttft, tpot, ttft_per_token) a nodeserve server is configured with; None: the fixed SLO."""
    t = time.perf_counter()
    if is_llama(name):
        if os.getloadavg()[0] > 0.5 and not args.llama_passive and args.llama_threads > 1:
            print(f"warning: load average {os.getloadavg()[0]:.1f} before llama-server starts: with other work on "
                  "the cores its spinning OpenMP threads slow down by 10-100x; see --llama-passive", flush=True)
        srv = L.start(slots=args.llama_slots, slot_ctx=args.llama_slot_ctx, threads=args.llama_threads,
                      log_path=log, backend=args.llama_peers[name], passive=args.llama_passive, gguf=args.gguf,
                      cpu_class=args.cpu_class)
        proc, url = srv.proc, srv.url
        info = {"backend": srv.backend, "build": srv.build, "version": srv.version, "note": srv.note,
                "args": f"-np {args.llama_slots} -c {args.llama_slots * args.llama_slot_ctx} "
                        f"-t {args.llama_threads} --metrics",
                "omp_wait_policy": "passive" if args.llama_passive else "default"}
    else:
        # Its prefix cache off, as llama-server's cache_prompt: probes resend the same prompts.
        slo = slo or (args.slo_ttft, args.slo_tpot, args.slo_ttft_per_token)
        proc, url = start_server(name, args.dtype, tmp, log, model_extra=args.nodeserve_model_extra,
                                 kv_extra="prefix_cache = false\n" + args.nodeserve_kv_extra,
                                 extra=slo_table(*slo) + args.nodeserve_extra.replace("\\n", "\n"),
                                 model_path=args.gguf, env=nodeserve_env(args.cpu_class),
                                 devices_extra=args.nodeserve_devices_extra)
        info = {"mode": name, "dtype": args.dtype, "model_extra": args.nodeserve_model_extra,
                "kv_extra": args.nodeserve_kv_extra, "devices_extra": args.nodeserve_devices_extra,
                "extra": args.nodeserve_extra, "slo": dict(zip(("ttft_s", "tpot_s", "ttft_per_token_s"), slo)),
                "kernels": kernels_lines(log)}
        if args.cpu_class:
            info["cpu_class_env"] = CPU_CLASS_ENV[args.cpu_class]
            if not any(f"({args.cpu_class})" in line or f" {args.cpu_class} integer" in line
                       for line in info["kernels"]):
                print(f"warning: {name}'s log does not name {args.cpu_class} kernels: {info['kernels']}", flush=True)
    live.append(proc)
    info["start_s"] = time.perf_counter() - t
    info["loadavg_at_start"] = os.getloadavg()
    info["log"] = log
    print(f"{name}: up in {info['start_s']:.1f} s at {url}", flush=True)
    try:
        yield url, info
    finally:
        info["loadavg_at_end"] = os.getloadavg()  # other work on the 2 cores shows here
        _stop(proc)
        live.remove(proc)


def _runner(name: str, url: str, args, plan: Plan) -> Runner:
    # llama-server keeps each slot's last prompt and reuses its KV for a request with the same prefix; the
    # goodput probes resend the same requests, so without this its later probes would skip most prefill
    extra = {"cache_prompt": False} if is_llama(name) else {}
    r = Runner(url, plan, args.seed, (args.slo_ttft, args.slo_tpot, args.slo_target), args.long_share, extra,
               args.slo_ttft_per_token)
    if plan.warmup:
        r.warmup()
    return r


def run_target(name: str, args, plan: Plan, tmp: str, log_dir: str, live: list) -> dict:
    """Pass 1 for one target: calibration and phases 1-3."""
    t = time.perf_counter()
    res: dict = {}
    with serving(name, args, tmp, os.path.join(log_dir, f"{name}.log"), live) as (url, info):
        res["server"] = info
        r = _runner(name, url, args, plan)
        res["calibration"] = r.calibrate()
        c = res["calibration"]
        if "slo" in c:
            print(f"  {name} calibration: TTFT = {c['slo']['ttft_a'] * 1000:.0f} ms + "
                  f"{c['slo']['ttft_b'] * 1000:.3f} ms/token, TPOT {c['slo']['tpot'] * 1000:.1f} ms", flush=True)
        else:
            print(f"  {name} calibration failed: {c['error']}", flush=True)
        res["single"] = r.single()
        print(_line(name, "single stream", res["single"]), flush=True)
        res["prompt"] = r.prompt()
        print(f"  {name} prompt processing: {_num(res['prompt']['prompt_tok_s'], '.0f')} tok/s on "
              f"{plan.prompt_tokens}-token prompts (median TTFT of {plan.prompt_requests})", flush=True)
        res["concurrent"] = r.concurrent()
        print(_line(name, f"concurrency {plan.concurrency}", res["concurrent"]), flush=True)
        res["chat"], snap, t0 = r.chat(url if name in NODESERVE else None)
        print(_line(name, f"bimodal at concurrency {plan.chat_concurrency}", res["chat"]) + " (fixed TTFT SLO: "
              f"{(res['chat']['attainment_fixed_ttft']['attainment'] or 0) * 100:.0f} %)", flush=True)
        if snap is not None:
            rows = TL.parse(snap, t0)
            res["timeline"] = TL.summary(rows)
            res["steps"] = TL.step_stats(snap, t0)
            png = TL.plot(rows, os.path.join(args.out_dir, f"timeline_{name}.png"),
                          f"nodeserve {name}: bimodal chat at concurrency {plan.chat_concurrency}")
            busy = ", ".join(f"{k} busy {v['busy'] * 100:.0f} %" for k, v in res["timeline"].items())
            print(f"  {name} timeline: {busy} -> {png}", flush=True)
    res["wall_s"] = time.perf_counter() - t
    return res


def run_goodput(name: str, args, plan: Plan, tmp: str, log_dir: str, live: list, slo: S.DerivedSlo,
                rate_start: float) -> dict:
    """Pass 2 for one target: the goodput search under the derived SLO."""
    t = time.perf_counter()
    with serving(name, args, tmp, os.path.join(log_dir, f"{name}-goodput.log"), live,
                 slo.at(args.slo_scale)) as (url, info):
        g = _runner(name, url, args, plan).goodput(slo, args.slo_scale, rate_start)
        g["server"] = info
    if name in NODESERVE:  # the common rate again, on a server aiming at the fixed SLO it is then judged on
        with serving(name, args, tmp, os.path.join(log_dir, f"{name}-fixed-probe.log"), live) as (url, info):
            g["fixed_probe"] = _runner(name, url, args, plan).fixed_probe(rate_start)
            g["fixed_probe"]["server"] = info
    g["wall_s"] = time.perf_counter() - t
    print(f"  {name} goodput (derived SLO, scale {args.slo_scale:g}): "
          f"{fmt_bracket(*goodput_bracket(g), '.3f', ' req/s')} ({g['status']}); fixed SLO: "
          f"{fmt_bracket(*goodput_bracket({'bracket': g['fixed_bracket']}), '.3f', ' req/s')}", flush=True)
    return g


def json_safe(obj):
    """obj with every infinite float (an open bracket end) as None: JSON has no infinity."""
    if isinstance(obj, float) and math.isinf(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def derive_slo(results: dict, earlier: dict | None, plan: Plan, seed: int, long_share: float | None
               ) -> tuple[S.DerivedSlo | None, dict]:
    """The SLO basis: an earlier run's (with --reuse, so reused goodput results stay comparable), else the
    best calibration over the targets."""
    if earlier and earlier.get("derived_slo"):
        d = dict(earlier["derived_slo"])
        d["reused_from"] = earlier["command"]
        return S.DerivedSlo.from_dict(d), d
    slos = {n: S.DerivedSlo.from_dict(r["calibration"]["slo"]) for n, r in results["targets"].items()
            if _get(r, "calibration", "slo")}
    if not slos:
        return None, {}
    lens = [r.prompt_len for r in probe_pool(plan, seed, long_share)]
    slo, src = S.best_slo(slos, lens)
    return slo, {**slo.as_dict(), **src}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=L.DEFAULT_MODEL,
                    help="a bundled model name (smollm2-135m-instruct, gemma-3-270m) or a .gguf path, served by "
                         "every target from the same file")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    ap.add_argument("--quick", action="store_true", help="a ~10-minute smoke version of every phase")
    ap.add_argument("--out-dir", default=None,
                    help="default $NODESERVE_BENCH_DIR/compare (else ~/.cache/nodeserve/bench/compare), "
                         "compare-<model> for another --model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="nodeserve [model] dtype")
    ap.add_argument("--nodeserve-model-extra", default="", help="extra TOML lines for nodeserve's [model] table")
    ap.add_argument("--nodeserve-kv-extra", default="", help="extra TOML lines for nodeserve's [kv] table")
    ap.add_argument("--nodeserve-devices-extra", default="",
                    help="extra TOML lines for nodeserve's [devices] table, e.g. 'lend_between_steps = false'")
    ap.add_argument("--nodeserve-extra", default="",
                    help="more TOML tables for nodeserve's config, e.g. '[speculative]\\nmethod = \"off\"' (\\n: a newline)")
    ap.add_argument("--llama-backend", default="auto",
                    help=f"llama-server peer(s), comma-separated, of {','.join(L.BACKENDS)}; auto: the native build "
                         "if it builds, else the wheels; several run as one target each (see above)")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), default=None,
                    help="both sides as a CPU of this class runs them: nodeserve forced to its kernels, llama-server "
                         "built for it (a proxy on a CPU with more)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--llama-passive", action="store_true",
                    help="OMP_WAIT_POLICY=passive for llama-server: use when other work shares the cores")
    ap.add_argument("--llama-slots", type=int, default=L.DEFAULT_SLOTS)
    ap.add_argument("--llama-slot-ctx", type=int, default=L.DEFAULT_SLOT_CTX, help="context per slot, tokens")
    ap.add_argument("--chat-requests", type=int, default=None, help="phase 3 requests (default 48, quick 4)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="most requests in a goodput probe (default 32, quick 6)")
    ap.add_argument("--probe-seconds", type=float, default=None,
                    help="a probe at rate r sends r * this many requests (default 60, quick 15)")
    ap.add_argument("--max-probes", type=int, default=None, help="goodput probes per target (default 4, quick 2)")
    ap.add_argument("--goodput-budget", type=float, default=None,
                    help="seconds per target's goodput search, see above (default 360, quick 90)")
    ap.add_argument("--rate-start", type=float, default=None,
                    help="first goodput probe, req/s, the same for every target (default: 1 / the mean unloaded "
                         "latency of the probe requests under the derived SLO's basis)")
    ap.add_argument("--long-share", type=float, default=None, help="bimodal share of long prompts (default 0.2)")
    ap.add_argument("--slo-scale", type=float, default=5.0, help="derived SLO scale for the goodput search")
    ap.add_argument("--slo-ttft", type=float, default=S.DEFAULT_SLO_TTFT, help="fixed SLO: seconds")
    ap.add_argument("--slo-tpot", type=float, default=S.DEFAULT_SLO_TPOT, help="fixed SLO: seconds")
    ap.add_argument("--slo-target", type=float, default=S.DEFAULT_SLO_TARGET)
    ap.add_argument("--slo-ttft-per-token", type=float, default=0.0,
                    help="fixed SLO, length-aware: seconds allowed per prompt token on top of --slo-ttft")
    ap.add_argument("--skip-goodput", action="store_true", help="pass 1 only (calibration and phases 1-3)")
    ap.add_argument("--reuse", default=None, metavar="RESULTS_JSON",
                    help="take the targets not in --targets, and the derived SLO, from this earlier results.json "
                         "(its command is kept in the new one), so one target can be re-run without the others")
    args = ap.parse_args()
    args.out_dir = args.out_dir or out_path(L.results_name(f"compare-{args.cpu_class}" if args.cpu_class
                                                           else "compare", args.model))

    if args.slo_scale <= 0:
        ap.error("--slo-scale must be > 0")
    backends = [b.strip() for b in args.llama_backend.split(",") if b.strip()]
    if not backends or any(b not in L.BACKENDS for b in backends) or len(set(backends)) < len(backends):
        ap.error(f"--llama-backend must name distinct backends of {', '.join(L.BACKENDS)}")
    if args.cpu_class and backends not in (["auto"], ["native"]):
        ap.error(f"--cpu-class {args.cpu_class} runs llama-server built for the class: --llama-backend native")
    args.llama_peers = llama_peers(backends)
    # "llama-server" runs every peer; "llama-server-<backend>" (a later peer of --llama-backend) just that one
    known = list(TARGETS) + [p for p in args.llama_peers if p != LLAMA]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in known for t in targets):
        ap.error(f"--targets must name some of {', '.join(known)}")
    targets = [p for t in targets for p in (args.llama_peers if t == LLAMA else [t])]
    plan = QUICK if args.quick else FULL
    overrides = {"chat_requests": args.chat_requests, "probe_max_requests": args.num_requests,
                 "probe_seconds": args.probe_seconds, "max_probes": args.max_probes,
                 "goodput_budget_s": args.goodput_budget}
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    plan = replace(plan, probe_min_requests=min(plan.probe_min_requests, plan.probe_max_requests))
    earlier = load_json(args.reuse) if args.reuse else None
    if earlier and earlier["args"].get("model", L.DEFAULT_MODEL) != args.model:
        ap.error(f"{args.reuse} was run on another --model ({earlier['args'].get('model', L.DEFAULT_MODEL)})")
    try:
        gguf = L.gguf_path(args.model)
    except Exception as e:  # nodeserve's LoadError names the bundled models
        ap.error(f"--model {args.model}: {e}")
    args.gguf = gguf  # what serving() starts every target on
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)

    results: dict = {
        "command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
        "machine": serve.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args),
        "plan": asdict(plan), "slo": {"ttft": args.slo_ttft, "tpot": args.slo_tpot, "target": args.slo_target,
                                        "ttft_per_token": args.slo_ttft_per_token, "scale": args.slo_scale},
        "model": {"name": args.model, "file": gguf}, "targets": {}}
    if args.cpu_class:
        flags = L.build_llama.cpu_flags_line()
        results["cpu_class"] = {"class": args.cpu_class, "proxy": class_is_proxy(args.cpu_class, flags),
                                "nodeserve_env": CPU_CLASS_ENV[args.cpu_class],
                                "llama_cmake_args": list(L.build_llama.cmake_args(args.cpu_class))}
    if LLAMA in targets and "binary" in backends:
        try:
            results["llama_server_binary_version"] = L.binary_version()
        except Exception as e:  # recorded, not fatal: the xllamacpp backend may still run
            results["llama_server_binary_version"] = f"unavailable: {e}"
    if earlier:
        for name, res in earlier["targets"].items():
            if name not in targets:
                res["reused_from"] = earlier["command"]
                results["targets"][name] = res
        results["reused_command"] = earlier["command"]
    json_path = os.path.join(args.out_dir, "results.json")

    def save() -> None:  # after every pass of every target, so a later failure keeps these
        with open(json_path, "w") as f:
            json.dump(json_safe(results), f, indent=1)

    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this script started.
    signal.signal(signal.SIGTERM, _interrupt)
    live: list = []
    t_all = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in targets:
                results["targets"][name] = run_target(name, args, plan, tmp, log_dir, live)
                save()
            slo, results["derived_slo"] = derive_slo(results, earlier, plan, args.seed, args.long_share)
            if slo is not None:
                print(slo_text(results["derived_slo"], args.slo_scale, args.slo_target), flush=True)
                for res in results["targets"].values():
                    if _get(res, "chat", "records"):
                        res["chat"]["attainment_derived"] = S.slo_attainment(res["chat"]["records"],
                                                                             *slo.at(args.slo_scale))
                pool = probe_pool(plan, args.seed, args.long_share)
                rate_start = args.rate_start or _get(earlier, "goodput_plan", "rate_start") or \
                    1.0 / S.unloaded_service_time(slo, [(r.prompt_len, r.max_tokens) for r in pool])
                results["goodput_plan"] = {"rate_start": rate_start, "scale": args.slo_scale}
                if not args.skip_goodput:
                    print(f"goodput searches from {rate_start:.3f} req/s", flush=True)
                    for name in targets:
                        results["targets"][name]["goodput"] = run_goodput(name, args, plan, tmp, log_dir, live,
                                                                          slo, rate_start)
                        save()
    finally:
        for proc in list(live):
            _stop(proc)
    results["wall_s"] = time.perf_counter() - t_all

    heads = {name: headline(res) for name, res in results["targets"].items()}
    checks = verdicts(heads)
    results["headline"], results["verdicts"] = heads, checks
    table = build_table(heads, checks)
    results["llama_server"] = llama_text(results)
    m = results["machine"]
    named = "" if args.model.lower() == L.DEFAULT_MODEL else f" on {L.model_tag(args.model)}"
    header = (f"# nodeserve vs llama-server{named}, {results['date']}{' (--quick)' if args.quick else ''}\n\n"
              f"`{results['command']}`\n\n"
              + (f"Model: `{gguf}`.\n\n" if named else "")
              + (f"Targets not re-run ({', '.join(n for n in results['targets'] if n not in targets)}) come from "
                 f"the earlier run `{results['reused_command']}`.\n\n" if args.reuse else "")
              + f"Machine: {m.get('cpu_model')}, {m.get('logical_cpus')} logical CPUs, {m.get('mem_total_gib')} GiB. "
              + class_text(results.get("cpu_class"))
              + f"llama-server: {results['llama_server']}. Fixed SLO: TTFT <= {args.slo_ttft:g} s"
              + (f" + {args.slo_ttft_per_token * 1000:g} ms per prompt token" if args.slo_ttft_per_token else "")
              + f" and TPOT <= {args.slo_tpot * 1000:g} ms for {args.slo_target * 100:g} % of requests. "
              + slo_text(results.get("derived_slo"), args.slo_scale, args.slo_target)
              + " nodeserve servers are configured with the SLO they are judged on: the fixed one in phases 0-3 and "
              "in one probe at the common rate, the derived one in the goodput search (whose probes also give the "
              "fixed-SLO goodput bracket)."
              + f" Wall time {results['wall_s'] / 60:.1f} min.\n\n")
    scales = scale_table(results)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(header + table + ("\n" + scales if scales else ""))
    save()
    paths = [plot_cdfs(results, os.path.join(args.out_dir, "latency_cdf.png"), (args.slo_ttft, args.slo_tpot))]
    if any(_get(r, "goodput") for r in results["targets"].values()):
        paths += [plot_attainment(results, os.path.join(args.out_dir, "attainment_vs_rate.png")),
                  plot_scale(results, os.path.join(args.out_dir, "attainment_vs_scale.png"))]
    print("\n" + table + ("\n" + scales if scales else ""))
    print(f"llama-server: {results['llama_server']}")
    print(f"wall time {results['wall_s']:.0f} s")
    for p in [json_path, os.path.join(args.out_dir, "table.md"), *paths]:
        print(f"-> {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
