"""`nodeserve plan` against the real server: predicted vs measured SLO attainment and goodput, per mode and workload.

For each mode (colocated, disaggregated) it starts a server (bench/local_server.py), warms it up, reads its
cost model from GET /debug/profile (the start-up profile, refined by the warm-up's steps), and for each workload:
1. predicts the goodput with the simulator (plan/simulate.py) on that profile, for the same requests the probes
   send (the first `--requests` of the seeded workload, Poisson arrivals of the same seed);
2. measures SLO attainment at `--rate-factors` x that prediction with bench/serve.py's load generator, and the
   simulator predicts attainment at the same rates;
3. reports the measured goodput bracket (highest rate that met the target, lowest above it that missed) against
   the predicted goodput.

    python bench/plan_check.py                                  # both modes, agent and bimodal, ~25 min
    python bench/plan_check.py --modes colocated --workloads agent --requests 12 --rate-factors 0.7,1.4

Writes --out (default $NODESERVE_BENCH_DIR/plan_check.json, else under ~/.cache/nodeserve/bench). On a machine shared with other work the measurements are
contended; the load averages are recorded next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402
from local_server import start_server  # noqa: E402

from nodeserve.core.cost_model import CostModel  # noqa: E402
from nodeserve.core.placement import SloTarget, StepLimits  # noqa: E402
from nodeserve.plan.simulate import Mode, attainment, predict_goodput  # noqa: E402
from nodeserve.config import KVSection, SchedulerSection  # noqa: E402

MODES = {"colocated": Mode("colocated", {"cpu:0": "colocated", "cpu:1": "colocated"}),
         "disaggregated": Mode("1P:1D", {"cpu:0": "prefill", "cpu:1": "decode"})}


def fetch_profile(url: str) -> dict:
    with urllib.request.urlopen(url + "/debug/profile", timeout=30) as r:
        return json.load(r)


def prediction_errors(url: str) -> dict[str, float]:
    """The server's nodeserve:ttft_prediction_error_seconds buckets (le -> cumulative count): how far SLO
    admission's TTFT predictions were from what each request got."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "nodeserve:ttft_prediction_error_seconds":
            return {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--workloads", default="agent,bimodal")
    ap.add_argument("--requests", type=int, default=16, help="requests per probe (the same list at every rate)")
    ap.add_argument("--rate-factors", default="0.67,1.0,1.5", help="probe rates, as multiples of the prediction")
    ap.add_argument("--rates", default="", help="probe these rates (req/s) instead")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-ttft-per-token", type=float, default=0.025)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=S.DEFAULT_SLO_TARGET)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=float, default=0.35, help="KV pool per device (a shared machine may not have "
                    "room for two 2 GiB pools)")
    ap.add_argument("--out", default=out_path("plan_check.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the server is stopped (finally) on a kill too
    slo = SloTarget(args.slo_ttft, args.slo_tpot, args.slo_ttft_per_token)
    sch, kv = SchedulerSection(), KVSection(memory_gib=args.kv_gib)
    limits = StepLimits(sch.max_num_batched_tokens, sch.max_num_seqs)
    factors = [float(x) for x in args.rate_factors.split(",")]
    rates = [float(x) for x in args.rates.split(",") if x]
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "slo": vars(slo), "target": args.target, "requests_per_probe": args.requests, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for mode_name in args.modes.split(","):
            log = os.path.join(os.path.dirname(args.out), f"plan_check_{mode_name}.log")
            proc, url = start_server(mode_name, "auto", tmp, log, kv_memory_gib=args.kv_gib)
            try:
                model = serve.default_model(url, {})
                warm = W.generate("agent", 2, seed=args.seed + 100)
                serve.measure(url, model, warm, "concurrency", None, 1, args.seed, progress=False, force_close=True)
                capacity = kv.memory_gib * 2**30 / (fetch_profile(url)["kv_bytes_per_token"] or 1)
                for wl in args.workloads.split(","):
                    reqs = W.generate(wl, args.requests, seed=args.seed)
                    work = [(r.prompt_len, r.max_tokens) for r in reqs]
                    mode = MODES[mode_name]
                    profile = fetch_profile(url)  # refitted from every step the server has run so far
                    cost = CostModel.from_dict(profile)
                    pred = predict_goodput(cost, mode, limits, slo, work, args.seed, args.target,
                                           capacity_tokens=capacity)
                    start = pred.goodput or 0.05
                    print(f"{mode_name} {wl}: predicted goodput {pred.goodput} req/s ({pred.status})", flush=True)
                    run = {"mode": mode_name, "workload": wl, "predicted_goodput": pred.goodput,
                           "predicted_status": pred.status, "probes": [],
                           "profile": {d: m["coefficients"] for d, m in profile["devices"].items()}}
                    for rate in rates or [start * f for f in factors]:
                        load_before = os.getloadavg()[0]
                        m = serve.measure(url, model, reqs, "poisson", rate, None, args.seed, timeout=600,
                                          slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s, ttft_per_token=slo.ttft_per_token_s,
                                          progress=False, force_close=True)
                        predicted = attainment(cost, mode, limits, slo, work,
                                               W.arrival_times("poisson", len(work), rate, args.seed),
                                               capacity_tokens=capacity)
                        probe = {"rate": rate, "measured": m["attainment"]["attainment"], "predicted": predicted,
                                 "failed": m["summary"]["failed"], "ttft_p50": m["summary"]["ttft"]["p50"],
                                 "tpot_p50": m["summary"]["tpot"]["p50"], "loadavg_1m": [load_before,
                                                                                         os.getloadavg()[0]]}
                        run["probes"].append(probe)
                        print(f"{mode_name} {wl} @{rate:.3f} req/s: attainment measured {probe['measured']:.0%} "
                              f"predicted {predicted:.0%} (load {load_before:.1f})", flush=True)
                    lo, hi = S.bracket_from_points([(p["rate"], p["measured"]) for p in run["probes"]], args.target)
                    run["measured_bracket"] = [lo, hi if hi != float("inf") else None]
                    run["ttft_prediction_error_buckets"] = prediction_errors(url)  # cumulative over the server's life
                    # The same prediction from the profile as refitted with the probes' own steps: how much of
                    # the miss is the simulator, and how much the profile's conditions at start-up.
                    after = CostModel.from_dict(fetch_profile(url))
                    g = predict_goodput(after, mode, limits, slo, work, args.seed, args.target,
                                        capacity_tokens=capacity)
                    run["refit"] = {"predicted_goodput": g.goodput, "predicted": [
                        attainment(after, mode, limits, slo, work, W.arrival_times("poisson", len(work), p["rate"],
                                                                                  args.seed), capacity_tokens=capacity)
                        for p in run["probes"]]}
                    print(f"{mode_name} {wl}: refitted profile predicts goodput {g.goodput:.3f} req/s, attainment "
                          + ", ".join(f"{a:.0%}" for a in run["refit"]["predicted"]), flush=True)
                    print(f"{mode_name} {wl}: predicted goodput {pred.goodput:.3f} req/s, measured bracket "
                          f"[{lo:.3f}, {hi:.3f}]", flush=True)
                    results["runs"].append(run)
                    with open(args.out, "w") as fh:
                        json.dump(results, fh, indent=1)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
