"""nodeserve (disaggregated, colocated) against llama.cpp's llama-server: the same seeded workloads, one
server at a time on loopback, one table.

For each target it starts the server (bench/local_server.py for nodeserve, bench/llama_server.py for
llama-server), warms it up with one short and one 1,024-token request, runs four phases through
bench/serve.py's load generator, and stops it (always: also on an exception or Ctrl-C):

1. single stream: short prompts (64 tokens), 256 output tokens, one request at a time -> decode tok/s
   (1 / median TPOT) and TPOT;
2. 32 concurrent short requests: prompts 50-100 tokens, 128 output tokens, 64 requests at concurrency 32
   -> output tok/s, TPOT p99;
3. bimodal chat at concurrency 16 -> SLO attainment, TTFT p50/p99, TPOT p99, inter-token gap (ITL) p99; on
   nodeserve it also records the per-device timeline (GET /debug/steps) and plots it;
4. bimodal goodput: stats.goodput_search over Poisson rates (--rate-min .. --rate-max, --max-probes runs of
   --num-requests requests each).

Every request streams with ignore_eos, so it produces exactly max_tokens tokens, on a new connection
(serve.run's force_close); every target gets the same requests (same seeds); llama-server gets
`cache_prompt: false`, as the goodput probes resend the same prompts. SLOs (stats.py): TTFT <= 2.5 s and
TPOT <= 100 ms for 90 % of requests; --slo-ttft-per-token makes the TTFT SLO length-aware (2.5 s plus that
many seconds per prompt token; bench/README.md says why the published run uses 4 ms).

llama-server runs with -t 2 by default. Its threads spin at an OpenMP barrier after every op, so when other
work holds a core it slows down 10-100x; on a machine shared with other work, pass --llama-passive
(OMP_WAIT_POLICY=passive) and read the load averages recorded per target in results.json.

    python bench/compare.py                      # all three targets, ~30-40 min on the 2-core machine
    python bench/compare.py --quick              # a ~5-minute smoke version (numbers mean little)
    python bench/compare.py --targets disaggregated,llama-server --nodeserve-model-extra 'quantization = "fp16"'

Writes into --out-dir (default bench/results/compare/): results.json (machine, date, command, llama-server
version, every phase's summary per target, phase 3's records), table.md (the table and the issue's targets
met / not met), latency_cdf.png (phase 3, targets overlaid), attainment_vs_rate.png (phase 4) and
timeline_<target>.png (phase 3, nodeserve targets).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_server as L  # noqa: E402  (bench/ is scripts, not a package)
import serve  # noqa: E402
import stats as S  # noqa: E402
import timeline as TL  # noqa: E402
import workloads as W  # noqa: E402
from local_server import start_server  # noqa: E402

TARGETS = ("disaggregated", "colocated", "llama-server")
NODESERVE = ("disaggregated", "colocated")
DISAGG, COLOC, LLAMA = TARGETS


@dataclass(frozen=True)
class Plan:
    """How much of each phase to run."""

    single_requests: int = 4
    single_prompt: int = 64
    single_output: int = 256
    conc_requests: int = 64
    concurrency: int = 32
    conc_output: int = 128
    chat_requests: int = 48
    chat_concurrency: int = 16
    goodput_requests: int = 32
    max_probes: int = 4
    rate_min: float = 0.25
    rate_max: float = 4.0
    rate_tol: float = 0.1
    warmup: bool = True


FULL = Plan()
QUICK = Plan(single_requests=2, single_output=64, conc_requests=32, conc_output=16, chat_requests=4,
             goodput_requests=4, max_probes=2, rate_min=0.5, rate_tol=0.25)


# ---- pure: headline numbers, ratios, verdicts, table -------------------------------------------------------

def _get(d: dict | None, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


def goodput_bound(g: dict | None, rate_min: float | None = None) -> tuple[float | None, str | None]:
    """A goodput search as (value, kind): kind "exact" (bracketed to the tolerance), "lower" (at the rate cap
    or out of probes: the true goodput is at least this), "upper" (even the lowest rate missed: the goodput
    is below rate_min), or (None, None) if there is no search."""
    if not g:
        return None, None
    status = g.get("status")
    if status == "below_min":
        lo = rate_min if rate_min is not None else (g.get("points") or [{}])[0].get("rate")
        return (lo, "upper") if lo is not None else (None, None)
    if g.get("goodput") is None:
        return None, None
    return g["goodput"], "exact" if status == "found" else "lower"


def headline(res: dict) -> dict:
    """The table's numbers for one target's results (None where a phase did not run or had no data)."""
    tpot_single = _get(res, "single", "summary", "tpot", "p50")
    chat = _get(res, "chat", "summary")
    value, kind = goodput_bound(_get(res, "goodput"), _get(res, "goodput", "rate_min"))
    return {
        "single_tok_s": 1.0 / tpot_single if tpot_single else None,
        "single_tpot": tpot_single,
        "single_ttft": _get(res, "single", "summary", "ttft", "p50"),
        "conc_tok_s": _get(res, "concurrent", "summary", "output_token_throughput"),
        "conc_tpot_p99": _get(res, "concurrent", "summary", "tpot", "p99"),
        "ttft_p50": _get(chat, "ttft", "p50"), "ttft_p99": _get(chat, "ttft", "p99"),
        "tpot_p99": _get(chat, "tpot", "p99"), "itl_p99": _get(chat, "itl", "p99"),
        "attainment": _get(res, "chat", "attainment", "attainment"),
        "goodput": value, "goodput_kind": kind,
        # failed requests over phases 1-3 (goodput probes count theirs as SLO misses)
        "failed": sum(_get(res, phase, "summary", "failed") or 0 for phase in ("single", "concurrent", "chat")),
    }


_SIGN = {"exact": 0, "lower": 1, "upper": -1}


def ratio(num: float | None, den: float | None, num_kind: str | None = "exact",
          den_kind: str | None = "exact") -> tuple[float | None, str | None]:
    """num / den as (value, kind), kind as in goodput_bound: a lower bound over an exact value is a lower
    bound, over an upper bound too; two bounds the same way give nothing. (None, None) if undefined."""
    if num is None or den is None or not den or num_kind is None or den_kind is None:
        return None, None
    a, b = _SIGN[num_kind], _SIGN[den_kind]
    if a and a == b:
        return None, None
    s = a - b
    return num / den, "exact" if s == 0 else "lower" if s > 0 else "upper"


def verdict(value: float | None, kind: str | None, target: float, higher_is_better: bool = True) -> str:
    """"met", "not met", "undecided" (a bound on the wrong side of the target) or "n/a" (no value)."""
    if value is None or kind is None:
        return "n/a"
    if not higher_is_better:  # only exact values are compared this way here
        return "met" if value < target else "not met"
    if kind == "exact":
        return "met" if value >= target else "not met"
    if kind == "lower":
        return "met" if value >= target else "undecided"
    return "not met" if value < target else "undecided"


# (label, numerator target, denominator target, headline key, target factor)
RATIO_TARGETS = (
    ("single-stream decode tok/s, disaggregated / llama-server", DISAGG, LLAMA, "single_tok_s", 1.0),
    ("32-concurrent output tok/s, disaggregated / llama-server", DISAGG, LLAMA, "conc_tok_s", 3.0),
    ("bimodal goodput, disaggregated / llama-server", DISAGG, LLAMA, "goodput", 2.0),
    ("bimodal goodput, disaggregated / colocated", DISAGG, COLOC, "goodput", 1.5),
)
ITL_TARGET = 0.150  # disaggregated inter-token gap p99 at concurrency 16, seconds


def verdicts(heads: dict[str, dict]) -> list[dict]:
    """The issue's targets against the headline numbers of the targets that ran."""
    out = []
    for label, a, b, key, factor in RATIO_TARGETS:
        ha, hb = heads.get(a) or {}, heads.get(b) or {}
        kind_key = key + "_kind"
        value, kind = ratio(ha.get(key), hb.get(key), ha.get(kind_key, "exact"), hb.get(kind_key, "exact"))
        out.append({"label": label, "value": value, "kind": kind, "target": f">= {factor:g}x",
                    "verdict": verdict(value, kind, factor)})
    itl = (heads.get(DISAGG) or {}).get("itl_p99")
    out.append({"label": "inter-token gap p99 at concurrency 16, disaggregated", "value": itl,
                "kind": "exact" if itl is not None else None, "target": f"< {ITL_TARGET * 1000:g} ms",
                "verdict": verdict(itl, "exact" if itl is not None else None, ITL_TARGET, higher_is_better=False)})
    return out


def _num(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def _bounded(v: float | None, kind: str | None, fmt: str, suffix: str = "") -> str:
    if v is None or kind is None:
        return "-"
    return {"exact": "", "lower": ">= ", "upper": "< "}[kind] + format(v, fmt) + suffix


def build_table(heads: dict[str, dict], checks: list[dict]) -> str:
    """The markdown table (one row per target, in run order) and the targets block."""
    lines = ["| target | single-stream tok/s | 32-conc output tok/s | TTFT p50 / p99 @16 (s) | TPOT p99 @16 (ms) "
             "| ITL p99 @16 (ms) | attainment @16 | goodput (req/s) | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, h in heads.items():
        att = "-" if h["attainment"] is None else f"{h['attainment'] * 100:.0f} %"
        lines.append(f"| {name} | {_num(h['single_tok_s'], '.1f')} | {_num(h['conc_tok_s'], '.1f')} "
                     f"| {_num(h['ttft_p50'], '.2f')} / {_num(h['ttft_p99'], '.2f')} "
                     f"| {_num(h['tpot_p99'], '.0f', 1000)} | {_num(h['itl_p99'], '.0f', 1000)} | {att} "
                     f"| {_bounded(h['goodput'], h['goodput_kind'], '.2f')} | {h['failed']} |")
    lines += ["", "| issue target | measured | target | verdict |", "|---|---:|---:|---|"]
    for c in checks:
        if c["label"].startswith("inter-token"):
            shown = _num(c["value"], ".0f", 1000) + (" ms" if c["value"] is not None else "")
        else:
            shown = _bounded(c["value"], c["kind"], ".2f", "x")
        lines.append(f"| {c['label']} | {shown} | {c['target']} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


# ---- workloads --------------------------------------------------------------------------------------------

def short_requests(n: int, prompt: tuple[int, int], output: int, seed: int, kind: str) -> list[W.Request]:
    """n seeded id prompts with lengths drawn from `prompt` (inclusive) and a fixed output length."""
    rng = random.Random(f"{kind}-{seed}")
    out = []
    for _ in range(n):
        k = rng.randint(*prompt)
        out.append(W.Request(W.make_prompt(rng, k), k, output, kind))
    return out


# ---- one target -------------------------------------------------------------------------------------------

class Runner:
    """Runs the four phases against one server url; keeps what serve.measure returns, less the records."""

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

    def single(self) -> dict:
        p = self.plan
        reqs = short_requests(p.single_requests, (p.single_prompt, p.single_prompt), p.single_output, self.seed,
                              "single")
        return _brief(self.measure(reqs, "concurrency", concurrency=1))

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

    def goodput(self) -> dict:
        p = self.plan
        reqs = W.generate("bimodal", p.goodput_requests, self.seed + 1, long_share=self.long_share)
        g, _ = serve.search_goodput(lambda rate: self.measure(reqs, "poisson", rate=rate), p.rate_min, p.rate_max,
                                    self.slo_target, p.rate_tol, p.max_probes, report=False)
        g["rate_min"] = p.rate_min
        return g


def _brief(m: dict) -> dict:
    return {"summary": m["summary"], "attainment": m["attainment"]}


def _line(name: str, phase: str, m: dict) -> str:
    s, a = m["summary"], m["attainment"]
    f = lambda d, k: "-" if d[k] is None else f"{d[k] * 1000:.0f}"  # noqa: E731
    att = "-" if a["attainment"] is None else f"{a['attainment'] * 100:.0f} %"
    return (f"  {name} {phase}: {s['succeeded']}/{s['requests']} ok in {s['duration_s']:.1f} s, "
            f"{s['output_token_throughput'] or 0:.1f} out tok/s, TTFT p50 {f(s['ttft'], 'p50')} ms, "
            f"TPOT p50/p99 {f(s['tpot'], 'p50')}/{f(s['tpot'], 'p99')} ms, ITL p99 {f(s['itl'], 'p99')} ms, "
            f"attainment {att}")


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    target = None
    for name, res in results["targets"].items():
        g = res.get("goodput")
        if not g:
            continue
        target = g["target"]
        pts = sorted((p["rate"], p["attainment"]) for p in g["points"] if p["attainment"] is not None)
        ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], "o-", label=name)
    if target is not None:
        ax.axhline(target * 100, color="red", linestyle="--", label=f"target {target * 100:g} %")
    ax.set_xlabel("Poisson rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"bimodal: TTFT <= {results['slo']['ttft']:g} s and TPOT <= {results['slo']['tpot'] * 1000:g} ms")
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


def run_target(name: str, args, plan: Plan, tmp: str, log_dir: str, live: list) -> dict:
    """Starts the target's server, runs the phases, stops it; returns its results."""
    log = os.path.join(log_dir, f"{name}.log")
    t = time.perf_counter()
    if name == LLAMA:
        if os.getloadavg()[0] > 0.5 and not args.llama_passive and args.llama_threads > 1:
            print(f"warning: load average {os.getloadavg()[0]:.1f} before llama-server starts: with other work on "
                  "the cores its spinning OpenMP threads slow down by 10-100x; see --llama-passive", flush=True)
        srv = L.start(slots=args.llama_slots, slot_ctx=args.llama_slot_ctx, threads=args.llama_threads,
                      log_path=log, backend=args.llama_backend, passive=args.llama_passive)
        proc, url = srv.proc, srv.url
        info = {"backend": srv.backend, "version": srv.version, "note": srv.note,
                "args": f"-np {args.llama_slots} -c {args.llama_slots * args.llama_slot_ctx} "
                        f"-t {args.llama_threads} --metrics",
                "omp_wait_policy": "passive" if args.llama_passive else "default"}
    else:
        proc, url = start_server(name, args.dtype, tmp, log, model_extra=args.nodeserve_model_extra)
        info = {"mode": name, "dtype": args.dtype, "model_extra": args.nodeserve_model_extra}
    live.append(proc)
    info["start_s"] = time.perf_counter() - t
    info["loadavg_at_start"] = os.getloadavg()
    info["log"] = log
    print(f"{name}: up in {info['start_s']:.1f} s at {url}", flush=True)
    res: dict = {"server": info}
    try:
        # llama-server keeps each slot's last prompt and reuses its KV for a request with the same prefix; the
        # goodput probes resend the same requests, so without this its later probes would skip most prefill
        extra = {"cache_prompt": False} if name == LLAMA else {}
        r = Runner(url, plan, args.seed, (args.slo_ttft, args.slo_tpot, args.slo_target), args.long_share, extra,
                   args.slo_ttft_per_token)
        if plan.warmup:
            r.warmup()
        res["single"] = r.single()
        print(_line(name, "single stream", res["single"]), flush=True)
        res["concurrent"] = r.concurrent()
        print(_line(name, f"concurrency {plan.concurrency}", res["concurrent"]), flush=True)
        res["chat"], snap, t0 = r.chat(url if name in NODESERVE else None)
        print(_line(name, f"bimodal at concurrency {plan.chat_concurrency}", res["chat"]) + " (fixed TTFT SLO: "
              f"{(res['chat']['attainment_fixed_ttft']['attainment'] or 0) * 100:.0f} %)", flush=True)
        if snap is not None:
            rows = TL.parse(snap, t0)
            res["timeline"] = TL.summary(rows)
            png = TL.plot(rows, os.path.join(args.out_dir, f"timeline_{name}.png"),
                          f"nodeserve {name}: bimodal chat at concurrency {plan.chat_concurrency}")
            busy = ", ".join(f"{k} busy {v['busy'] * 100:.0f} %" for k, v in res["timeline"].items())
            print(f"  {name} timeline: {busy} -> {png}", flush=True)
        res["goodput"] = r.goodput()
        value, kind = goodput_bound(res["goodput"], plan.rate_min)
        pts = ", ".join(f"{p['rate']:.2f}->" + ("-" if p["attainment"] is None else f"{p['attainment'] * 100:.0f}%")
                        for p in res["goodput"]["points"])
        print(f"  {name} goodput: {_bounded(value, kind, '.2f', ' req/s')} ({res['goodput']['status']}); "
              f"probes {pts}", flush=True)
    finally:
        info["loadavg_at_end"] = os.getloadavg()  # other work on the 2 cores shows here
        _stop(proc)
        live.remove(proc)
    res["wall_s"] = time.perf_counter() - t
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    ap.add_argument("--quick", action="store_true", help="a ~5-minute smoke version of every phase")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "compare"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="nodeserve [model] dtype")
    ap.add_argument("--nodeserve-model-extra", default="", help="extra TOML lines for nodeserve's [model] table")
    ap.add_argument("--llama-backend", default="auto", choices=["auto", "binary", "xllamacpp"])
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--llama-passive", action="store_true",
                    help="OMP_WAIT_POLICY=passive for llama-server: use when other work shares the cores")
    ap.add_argument("--llama-slots", type=int, default=L.DEFAULT_SLOTS)
    ap.add_argument("--llama-slot-ctx", type=int, default=L.DEFAULT_SLOT_CTX, help="context per slot, tokens")
    ap.add_argument("--chat-requests", type=int, default=None, help="phase 3 requests (default 48, quick 4)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per goodput probe (default 32, "
                                                                   "quick 4)")
    ap.add_argument("--max-probes", type=int, default=None, help="goodput probes per target (default 4, quick 2)")
    ap.add_argument("--rate-min", type=float, default=None, help="req/s (default 0.25, quick 0.5)")
    ap.add_argument("--rate-max", type=float, default=None, help="req/s (default 4)")
    ap.add_argument("--rate-tol", type=float, default=None, help="req/s (default 0.1, quick 0.25)")
    ap.add_argument("--long-share", type=float, default=None, help="bimodal share of long prompts (default 0.2)")
    ap.add_argument("--slo-ttft", type=float, default=S.DEFAULT_SLO_TTFT, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=S.DEFAULT_SLO_TPOT, help="seconds")
    ap.add_argument("--slo-target", type=float, default=S.DEFAULT_SLO_TARGET)
    ap.add_argument("--slo-ttft-per-token", type=float, default=0.0,
                    help="length-aware TTFT SLO: seconds allowed per prompt token on top of --slo-ttft (default 0)")
    ap.add_argument("--reuse", default=None, metavar="RESULTS_JSON",
                    help="take the targets not in --targets from this earlier results.json (its command is kept "
                         "in the new one), so one target can be re-run without re-running the others")
    args = ap.parse_args()

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        ap.error(f"--targets must name some of {', '.join(TARGETS)}")
    plan = QUICK if args.quick else FULL
    overrides = {"chat_requests": args.chat_requests, "goodput_requests": args.num_requests,
                 "max_probes": args.max_probes, "rate_min": args.rate_min, "rate_max": args.rate_max,
                 "rate_tol": args.rate_tol}
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)

    results: dict = {
        "command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
        "machine": serve.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args),
        "plan": asdict(plan), "slo": {"ttft": args.slo_ttft, "tpot": args.slo_tpot, "target": args.slo_target,
                                        "ttft_per_token": args.slo_ttft_per_token},
        "targets": {}}
    if LLAMA in targets:
        try:
            results["llama_server_binary_version"] = L.binary_version()
        except Exception as e:  # recorded, not fatal: the xllamacpp backend may still run
            results["llama_server_binary_version"] = f"unavailable: {e}"
    if args.reuse:
        with open(args.reuse) as f:
            earlier = json.load(f)
        for name, res in earlier["targets"].items():
            if name not in targets:
                res["reused_from"] = earlier["command"]
                results["targets"][name] = res
        results["reused_command"] = earlier["command"]
    json_path = os.path.join(args.out_dir, "results.json")

    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this script started.
    signal.signal(signal.SIGTERM, _interrupt)
    live: list = []
    t_all = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in targets:
                results["targets"][name] = run_target(name, args, plan, tmp, log_dir, live)
                with open(json_path, "w") as f:  # after every target, so a later failure keeps these
                    json.dump(results, f, indent=1)
    finally:
        for proc in list(live):
            _stop(proc)
    results["wall_s"] = time.perf_counter() - t_all

    heads = {name: headline(res) for name, res in results["targets"].items()}
    checks = verdicts(heads)
    results["headline"], results["verdicts"] = heads, checks
    table = build_table(heads, checks)
    if LLAMA in results["targets"]:
        srv = results["targets"][LLAMA]["server"]
        results["llama_server"] = (f"{srv['version']} ({srv['args']}, OpenMP wait policy {srv['omp_wait_policy']}"
                                   + (f"; {srv['note']}" if srv["note"] else "") + ")")
    m = results["machine"]
    header = (f"# nodeserve vs llama-server, {results['date']}{' (--quick)' if args.quick else ''}\n\n"
              f"`{results['command']}`\n\n"
              + (f"Targets not re-run ({', '.join(n for n in results['targets'] if n not in targets)}) come from "
                 f"the earlier run `{results['reused_command']}`.\n\n" if args.reuse else "")
              + 
              f"Machine: {m.get('cpu_model')}, {m.get('logical_cpus')} logical CPUs, {m.get('mem_total_gib')} GiB. "
              f"llama-server: {results.get('llama_server', 'not run')}. SLOs: TTFT <= {args.slo_ttft:g} s"
              + (f" + {args.slo_ttft_per_token * 1000:g} ms per prompt token" if args.slo_ttft_per_token else "")
              + " and "
              f"TPOT <= {args.slo_tpot * 1000:g} ms for {args.slo_target * 100:g} % of requests. "
              f"Wall time {results['wall_s'] / 60:.1f} min.\n\n")
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(header + table)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    paths = [plot_cdfs(results, os.path.join(args.out_dir, "latency_cdf.png"), (args.slo_ttft, args.slo_tpot)),
             plot_attainment(results, os.path.join(args.out_dir, "attainment_vs_rate.png"))]
    print("\n" + table)
    print(f"wall time {results['wall_s']:.0f} s")
    for p in [json_path, os.path.join(args.out_dir, "table.md"), *paths]:
        print(f"-> {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
