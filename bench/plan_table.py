"""Prints `nodeserve plan`'s predicted goodput for every (mode, workload) in adaptive.json next to the measured
bracket: from each run's own profile (fetched before its probes) and from one profile (`--profile-of`, the
adaptive bimodal server's after its probes by default), as an operator would run `nodeserve plan` with a
server's /debug/profile. Writes plan.json next to adaptive.json.

    python bench/plan_table.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads as W  # noqa: E402
from adaptive import MODES  # noqa: E402  (bench/adaptive.py)

from nodeserve.adaptive.cost_model import CostModel  # noqa: E402
from nodeserve.adaptive.placement import SloTarget, StepLimits  # noqa: E402
from nodeserve.adaptive.simulate import predict_goodput  # noqa: E402
from nodeserve.config import SchedulerSection  # noqa: E402


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results", "adaptive", "adaptive.json"))
    ap.add_argument("--profile-of", default="adaptive/bimodal")
    ap.add_argument("--kv-gib", type=float, default=0.5)
    args = ap.parse_args()
    d = json.load(open(args.results))
    slo, sch = SloTarget(**d["slo"]), SchedulerSection()
    limits = StepLimits(sch.max_num_batched_tokens, sch.max_num_seqs)
    runs = {f"{r['mode']}/{r['workload']}": r for r in d["runs"]}
    one = CostModel.from_dict(runs[args.profile_of]["profile_after"])
    out = {"profile_of": args.profile_of + ", after its probes", "cells": {}}
    print(f"| mode / workload | measured goodput (bracket) | own profile | one profile ({args.profile_of}) |")
    print("|---|---:|---:|---:|")
    for key, r in sorted(runs.items(), key=lambda kv: (kv[1]["workload"], kv[1]["mode"])):
        work = [(q.prompt_len, q.max_tokens) for q in W.generate(r["workload"], d["requests_per_probe"], seed=0)]
        cap = args.kv_gib * 2**30 / (one.kv_bytes_per_token or 1)
        pred = predict_goodput(one, MODES[r["mode"]], limits, slo, work, 0, d["target"], capacity_tokens=cap).goodput
        lo, hi = r["bracket"]
        out["cells"][key] = {"measured": r["goodput"], "bracket": [lo, hi], "own_profile": r["predicted_goodput"],
                             "one_profile": pred}
        print(f"| {key} | {fmt(r['goodput'])} ({fmt(lo)}-{fmt(hi)}) | {fmt(r['predicted_goodput'])} | {fmt(pred)} |")
    with open(os.path.join(os.path.dirname(args.results), "plan.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
