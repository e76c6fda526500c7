"""Prints `nodeserve plan`'s predicted goodput for every (mode, workload) in adaptive.json next to the measured
bracket: from each run's own profile (its fresh server's, fetched before its probes) and from one profile for
all, as an operator runs `nodeserve plan`: `--profile-file`, one `nodeserve plan --measure --save-profile` (by
default results/adaptive/measured-profile.json, measured with measured-profile.toml), or `--profile-of MODE/WORKLOAD`
(that run's server's profile after its probes). Writes plan.json next to adaptive.json.

    nodeserve plan --config bench/results/adaptive/measured-profile.toml --measure --budget 2 \
        --save-profile bench/results/adaptive/measured-profile.json      # on a quiet machine
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

from nodeserve.core.cost_model import CostModel  # noqa: E402
from nodeserve.core.placement import SloTarget, StepLimits  # noqa: E402
from nodeserve.plan.simulate import predict_goodput  # noqa: E402
from nodeserve.config import SchedulerSection  # noqa: E402


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def against(pred: float | None, lo: float | None, hi: float | None) -> str:
    """The prediction and its error against the goodput found (the bracket's low end); "in bracket" where it
    lies inside [lo, hi), where the true goodput lies too."""
    if pred is None or lo is None:
        return fmt(pred) + ("" if hi is None or pred is None else f" ({'below' if pred < hi else 'not below'} {hi:.3f})")
    where = ", in bracket" if hi is not None and lo <= pred < hi else ""
    return f"{pred:.3f} ({(pred - lo) / lo:+.0%}{where})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results", "adaptive", "adaptive.json"))
    ap.add_argument("--profile-file", default=os.path.join(HERE, "results", "adaptive", "measured-profile.json"))
    ap.add_argument("--profile-of", default=None, help="MODE/WORKLOAD: that run's profile after its probes instead")
    ap.add_argument("--kv-gib", type=float, default=0.5)
    args = ap.parse_args()
    d = json.load(open(args.results))
    slo, sch = SloTarget(**d["slo"]), SchedulerSection()
    limits = StepLimits(sch.max_num_batched_tokens, sch.max_num_seqs)
    runs = {f"{r['mode']}/{r['workload']}": r for r in d["runs"]}
    if args.profile_of:
        one, one_name = CostModel.from_dict(runs[args.profile_of]["profile_after"]), args.profile_of + " after its probes"
    else:
        with open(args.profile_file) as fh:
            one, one_name = CostModel.from_dict(json.load(fh)), os.path.basename(args.profile_file)
    out = {"profile_of": one_name, "cells": {}}
    print(f"| mode / workload | measured goodput (bracket) | own profile | one profile ({one_name}) |")
    print("|---|---:|---:|---:|")
    for key, r in sorted(runs.items(), key=lambda kv: (kv[1]["workload"], kv[1]["mode"])):
        work = [(q.prompt_len, q.max_tokens) for q in W.generate(r["workload"], d["requests_per_probe"], seed=0)]
        cap = args.kv_gib * 2**30 / (one.kv_bytes_per_token or 1)
        pred = predict_goodput(one, MODES[r["mode"]], limits, slo, work, 0, d["target"], capacity_tokens=cap).goodput
        lo, hi = r["bracket"]
        out["cells"][key] = {"measured": r["goodput"], "bracket": [lo, hi], "own_profile": r["predicted_goodput"],
                             "one_profile": pred}
        print(f"| {key} | {fmt(r['goodput'])} ({fmt(lo)}-{fmt(hi)}) | {against(r['predicted_goodput'], lo, hi)} | "
              f"{against(pred, lo, hi)} |")
    with open(os.path.join(os.path.dirname(args.results), "plan.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
