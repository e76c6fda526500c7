"""Adaptive serving against the static modes on the real server: goodput per mode and workload, `nodeserve plan`'s
prediction of each, SLO admission under overload, and the timeline of role changes.

1. For each mode (colocated, disaggregated 1P:1D, adaptive) it starts a server (bench/local_server.py), warms it,
   reads its cost model (GET /debug/profile) and, per workload (default: bimodal chat and uniform short chat):
   predicts the goodput with the simulator behind `nodeserve plan` (plan/simulate.py), then measures it with
   a goodput search (goodput.goodput_search: from the prediction, brackets by `--growth`, bisects; at most
   `--max-probes` probes), each probe `--requests` requests of the seeded workload at Poisson arrivals
   (bench/serve.py). The adaptive server's steps and role changes during its highest-rate bimodal probe are kept
   for the timeline plot (`--plot`).
2. With `--admission`, an adaptive server with `[slo] admission = "reject"` takes bimodal (`--admission-requests`,
   another seed) at the adaptive goodput found in 1 (the sustainable rate, or `--sustainable`) and at twice it:
   the attainment of the requests it admitted, how many it refused (503 + Retry-After) and the SLO-meeting
   requests per second, at both rates; then a fresh server with `admission = "off"` at both rates.

Servers run with the prefix cache off (`--prefix-cache` to keep it): every probe resends the same requests.

    python bench/adaptive.py --admission                 # ~45 min on the 2-core CPU machine (disaggregated
                                                         # bimodal alone: 6-10 min a probe)
    python bench/adaptive.py --modes '' --admission --sustainable 0.6    # phase 2 alone, ~10 min
    python bench/adaptive.py --modes adaptive --workloads short --requests 12 --max-probes 2

SLO (default): TTFT <= 25 ms per prompt token, TPOT <= 90 ms: bench/compare.py's derived SLO of 2026-11-23
(5 x the best unloaded figures, 4.97 ms/token and 17.8 ms), rounded. Writes --out (JSON) and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import timeline  # noqa: E402
import workloads as W  # noqa: E402
from local_server import start_server  # noqa: E402
from plan_check import fetch_profile  # noqa: E402

from nodeserve.core.cost_model import CostModel  # noqa: E402
from nodeserve.core.placement import SloTarget, StepLimits  # noqa: E402
from nodeserve.plan.simulate import Mode, attainment, predict_goodput  # noqa: E402
from nodeserve.config import SchedulerSection  # noqa: E402

MODES = {"colocated": Mode("colocated", {"cpu:0": "colocated", "cpu:1": "colocated"}),
         "disaggregated": Mode("1P:1D", {"cpu:0": "prefill", "cpu:1": "decode"}),
         "adaptive": Mode("adaptive", {"cpu:0": "adaptive", "cpu:1": "adaptive"})}


def probe_record(m: dict, rate: float, predicted: float | None) -> dict:
    s = m["summary"]
    refused = sum(1 for r in m["records"] if r.get("status") == 503)
    return {"rate": rate, "attainment": m["attainment"]["attainment"], "predicted": predicted,
            "met": m["attainment"]["met"], "requests": s["requests"], "failed": s["failed"] - refused,
            "refused": refused, "duration_s": s["duration_s"],
            "ttft_p50": s["ttft"]["p50"], "ttft_p90": s["ttft"]["p90"], "tpot_p50": s["tpot"]["p50"],
            "tpot_p90": s["tpot"]["p90"], "itl_p99": s["itl"]["p99"], "loadavg_1m": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="colocated,disaggregated,adaptive")
    ap.add_argument("--workloads", default="bimodal,short")
    ap.add_argument("--requests", type=int, default=24, help="requests per probe (the same list at every rate)")
    ap.add_argument("--max-probes", type=int, default=4)
    ap.add_argument("--growth", type=float, default=1.5)
    ap.add_argument("--rel-tol", type=float, default=0.2, help="stop bisecting when the bracket is this narrow")
    ap.add_argument("--slo-ttft", type=float, default=0.0)
    ap.add_argument("--slo-ttft-per-token", type=float, default=0.025)
    ap.add_argument("--slo-tpot", type=float, default=0.09)
    ap.add_argument("--target", type=float, default=S.DEFAULT_SLO_TARGET)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=float, default=0.5)
    ap.add_argument("--min-start-rate", type=float, default=0.1, help="the first probe's rate is the prediction, "
                    "but not below this (a probe at rate r takes requests / r seconds)")
    ap.add_argument("--prefix-cache", action="store_true", help="keep the servers' prefix cache on (off by "
                    "default: every probe sends the same requests, so later probes would hit what earlier ones left)")
    ap.add_argument("--admission", action="store_true", help="also run phase 2 (reject admission under 2x load)")
    ap.add_argument("--sustainable", type=float, default=None, help="phase 2's sustainable rate (default: the "
                    "adaptive bimodal goodput phase 1 found; give it with --modes '' to run phase 2 alone)")
    ap.add_argument("--admission-requests", type=int, default=48, help="phase 2's requests per probe")
    ap.add_argument("--margin", type=float, default=0.25, help="phase 2's slo.margin")
    ap.add_argument("--append", action="store_true", help="keep the runs already in --out (other modes)")
    ap.add_argument("--out", default=out_path("adaptive", "adaptive.json"))
    ap.add_argument("--plot", default=out_path("adaptive", "timeline.png"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the server is stopped (finally) on a kill too
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    slo = SloTarget(args.slo_ttft, args.slo_tpot, args.slo_ttft_per_token)
    sch = SchedulerSection()
    limits = StepLimits(sch.max_num_batched_tokens, sch.max_num_seqs)
    kv_extra = "" if args.prefix_cache else "prefix_cache = false"
    slo_toml = (f"[slo]\nttft_s = {slo.ttft_s}\nttft_per_token_s = {slo.ttft_per_token_s}\ntpot_s = {slo.tpot_s}\n")
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "machine": serve.machine(), "slo": vars(slo), "target": args.target,
               "requests_per_probe": args.requests, "runs": [], "admission": None}

    if args.append and os.path.exists(args.out):
        with open(args.out) as fh:
            old = json.load(fh)
        redo = {(m, wl) for m in args.modes.split(",") for wl in args.workloads.split(",")}
        results["runs"] = [r for r in old["runs"] if (r["mode"], r["workload"]) not in redo]
        results["command"] = old["command"] + " ; " + results["command"]
        results["admission"] = old.get("admission") if not args.admission else None

    def save() -> None:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)

    def measure(url: str, model: str, reqs, rate: float) -> dict:
        return serve.measure(url, model, reqs, "poisson", rate, None, args.seed, timeout=900,
                             slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s, ttft_per_token=slo.ttft_per_token_s,
                             progress=False, force_close=True)

    with tempfile.TemporaryDirectory() as tmp:
        # A fresh server per mode and workload: nothing (adaptive roles, the step model's recent samples, the
        # allocator's state) carries over from another workload's probes.
        for mode_name, wl in [(m, w) for m in args.modes.split(",") if m for w in args.workloads.split(",")]:
            stamp = time.strftime("%H%M%S")  # one server log per run: --append runs keep the earlier ones
            log = os.path.join(os.path.dirname(args.out), f"{mode_name}-{wl}-{stamp}.log")
            proc, url = start_server(mode_name, "auto", tmp, log, kv_memory_gib=args.kv_gib, kv_extra=kv_extra,
                                     extra=slo_toml)
            try:
                model = serve.default_model(url, {})
                serve.measure(url, model, W.generate("agent", 2, seed=args.seed + 100), "concurrency", None, 1,
                              args.seed, progress=False, force_close=True)
                reqs = W.generate(wl, args.requests, seed=args.seed)
                work = [(r.prompt_len, r.max_tokens) for r in reqs]
                cost = CostModel.from_dict(fetch_profile(url))
                capacity = args.kv_gib * 2**30 / (cost.kv_bytes_per_token or 1)
                pred = predict_goodput(cost, MODES[mode_name], limits, slo, work, args.seed, args.target,
                                       capacity_tokens=capacity)
                print(f"{mode_name} {wl}: predicted goodput {pred.goodput} req/s ({pred.status})", flush=True)
                run = {"mode": mode_name, "workload": wl, "predicted_goodput": pred.goodput,
                       "predicted_status": pred.status, "probes": [], "profile": cost.as_dict()}
                results["runs"].append(run)  # saved with every probe, so an interrupted search keeps them

                def attainment_at(rate: float) -> float | None:
                    since = timeline.server_now(url)
                    m = measure(url, model, reqs, rate)
                    if mode_name == "adaptive" and not run["probes"]:
                        # The first probe's, for the plot: on the fresh server every device starts adaptive, so the
                        # role changes the traffic causes fall inside it (later probes start where it left them).
                        run["debug_steps"] = timeline.fetch(url, since)
                    predicted = attainment(cost, MODES[mode_name], limits, slo, work,
                                           W.arrival_times("poisson", len(work), rate, args.seed),
                                           capacity_tokens=capacity)
                    p = probe_record(m, rate, predicted)
                    run["probes"].append(p)
                    print(f"{mode_name} {wl} @{rate:.3f} req/s: attainment {p['attainment']:.0%} (predicted "
                          f"{predicted:.0%}), TTFT p90 {p['ttft_p90']:.1f} s, TPOT p90 "
                          f"{p['tpot_p90'] * 1000:.0f} ms, load {p['loadavg_1m']:.1f}", flush=True)
                    save()
                    return p["attainment"]

                start = max(pred.goodput or 0.0, args.min_start_rate)
                g = S.goodput_search(attainment_at, start, 10.0, args.target, tol=0.005, growth=args.growth,
                                     max_probes=args.max_probes, rate_floor=0.01, rel_tol=args.rel_tol)
                lo, hi = g.bracket
                run["goodput"], run["status"], run["bracket"] = g.goodput, g.status, [lo, hi]
                run["profile_after"] = fetch_profile(url)  # refitted with every probe's steps: what `plan` reads
                print(f"{mode_name} {wl}: goodput {g.goodput} req/s ({g.status}), bracket {lo}-{hi}, "
                      f"predicted {pred.goodput}", flush=True)
                save()
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        by = {(r["mode"], r["workload"]): r for r in results["runs"]}
        sustainable = args.sustainable or (by.get(("adaptive", "bimodal")) or {}).get("goodput")
        if args.admission and sustainable:
            # Each setting on a fresh server (no role or refit carried over from phase 1), at the sustainable rate
            # and at twice it: with reject admission, and without (what rejecting buys).
            reqs = W.generate("bimodal", args.admission_requests, seed=args.seed + 1)
            out = []
            results["admission"] = {"sustainable_rate": sustainable, "margin": args.margin, "probes": out}
            for setting, factors in (("reject", (1.0, 2.0)), ("off", (1.0, 2.0))):
                log = os.path.join(os.path.dirname(args.out), f"adaptive-{setting}-{time.strftime('%H%M%S')}.log")
                proc, url = start_server("adaptive", "auto", tmp, log, kv_memory_gib=args.kv_gib, kv_extra=kv_extra,
                                         extra=slo_toml + f'admission = "{setting}"\nmargin = {args.margin}\n')
                try:
                    model = serve.default_model(url, {})
                    for factor in factors:
                        m = measure(url, model, reqs, sustainable * factor)
                        p = probe_record(m, sustainable * factor, None)
                        admitted = [r for r in m["records"] if r.get("status") != 503]
                        p["admission"], p["factor"] = setting, factor
                        p["admitted_attainment"] = S.slo_attainment(admitted, slo.ttft_s, slo.tpot_s,
                                                                    slo.ttft_per_token_s)["attainment"]
                        p["met_per_s"] = p["met"] / p["duration_s"]
                        keep = ("kind", "prompt_len", "status", "ttft", "tpot", "error")
                        p["records"] = [{k: r.get(k) for k in keep} for r in m["records"]]
                        out.append(p)
                        print(f"admission {setting} @{p['rate']:.3f} req/s ({factor:g}x): {p['refused']} refused, "
                              f"admitted attainment {p['admitted_attainment']:.0%}, {p['met_per_s']:.3f} "
                              f"SLO-meeting req/s, TTFT p90 {p['ttft_p90']:.1f} s, TPOT p90 "
                              f"{p['tpot_p90'] * 1000:.0f} ms", flush=True)
                        save()
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    adaptive_bimodal = by.get(("adaptive", "bimodal"))
    if adaptive_bimodal and args.plot:
        timeline.plot_snapshot(adaptive_bimodal["debug_steps"], args.plot,
                               title=f"adaptive, bimodal probes (SLO {slo.ttft_per_token_s * 1000:g} ms/prompt token, "
                                     f"{slo.tpot_s * 1000:g} ms TPOT)")
    # `nodeserve plan` as an operator runs it: one profile (the last server's after its probes, refitted by what
    # it served) predicts every mode.
    last = next((r for r in reversed(results["runs"]) if "profile_after" in r), None)
    if last is not None:
        cost = CostModel.from_dict(last["profile_after"])
        capacity = args.kv_gib * 2**30 / (cost.kv_bytes_per_token or 1)
        results["plan"] = {"profile_of": f"{last['mode']}/{last['workload']}, after its probes", "predicted_goodput": {
            f"{m}/{wl}": predict_goodput(cost, MODES[m], limits, slo,
                                         [(r.prompt_len, r.max_tokens) for r in W.generate(wl, args.requests,
                                                                                           seed=args.seed)],
                                         args.seed, args.target, capacity_tokens=capacity).goodput
            for m in MODES for wl in sorted({r["workload"] for r in results["runs"]})}}
        save()
    for (mode, wl), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        plan = (results.get("plan") or {}).get("predicted_goodput", {}).get(f"{mode}/{wl}")
        print(f"{wl:<8} {mode:<14} goodput {r['goodput']} ({r['status']}) bracket {r['bracket']} "
              f"predicted {r['predicted_goodput']} (own profile), {plan} (one profile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
