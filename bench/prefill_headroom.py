"""How much faster prefill must get for a measured run to meet its SLO: the run replayed through nodeserve plan's
simulator, with the prefill devices' prompt costs divided by a factor.

Takes a bench/serve.py result (--run: its records, each with its send time) and the cost model of the server
that ran it, saved after the run (--profile: GET /debug/profile, whose online samples hold the run's own steps,
lent cores' help included). The requests are sent again at their recorded times to plan/simulate.py's
simulation of --config's layout and settings (the prefill order, local prefill, the decode device's prefill
chunk), once per --speedups factor, with the prefill devices' per-token and per-query-key-pair coefficients
divided by it (what a faster prompt kernel changes; a step's fixed cost and the decode device stay). Prints the
SLO attainment, FIFO and deadline order, and how many long prompts met their TTFT.

Row x1.0 checks the replay against the measured run. The send times stay the measured ones: in a closed loop a
faster server is sent its next requests sooner, so the rows above x1.0 are optimistic, and the factor at which
the target is met is a lower bound on what it takes.

    python bench/serve.py --workload bimodal --concurrency 16 --num-requests 48 --seed 0 --out run.json
    curl -s localhost:8000/debug/profile > profile.json     # the same server, after the run
    python bench/prefill_headroom.py --run run.json --profile profile.json
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from nodeserve import goodput
from nodeserve.config import Config, config_from_dict, load_config
from nodeserve.core.cost_model import FEATURES, CostModel
from nodeserve.core.load import SloTarget, StepLimits
from nodeserve.plan.planner import simulation_settings
from nodeserve.plan.simulate import Mode, simulate

PROMPT_FEATURES = ("prefill_tokens", "prefill_pairs")  # the coefficients a faster prompt kernel divides


def faster_prefill(profile: dict, devices: Sequence[str], factor: float) -> CostModel:
    """The profile's cost model with `devices`' prompt coefficients divided by factor."""
    cost = CostModel.from_dict(profile)
    for name in devices:
        model = cost.devices[name]
        model.coef = [c / factor if f in PROMPT_FEATURES else c for f, c in zip(FEATURES, model.coef)]
    return cost


def replay(config: Config, profile: dict, records: Sequence[dict], factor: float,
           prefill_order: str) -> list[dict]:
    """The simulator's records of `records`' requests sent at their recorded times (seconds from the first)."""
    cost = faster_prefill(profile, config.prefill_devices or config.decode_devices, factor)
    limits = StepLimits(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    slo = SloTarget(config.slo.ttft_s, config.slo.tpot_s, config.slo.ttft_per_token_s)
    kw = {**simulation_settings(config, cost), "prefill_order": prefill_order}
    start = min(r["sent_s"] for r in records)
    return simulate(cost, Mode.of_section(config.devices), limits, slo, [(r["prompt_len"], r["max_tokens"]) for r in records],
                    [r["sent_s"] - start for r in records], **kw)


def summary(config: Config, records: Sequence[dict], long_prompt: int) -> dict:
    slo = config.slo
    att = goodput.slo_attainment(records, slo.ttft_s, slo.tpot_s, slo.ttft_per_token_s)["attainment"]
    longs = [r for r in records if r["prompt_len"] >= long_prompt]
    on_time = sum(1 for r in longs if r.get("ok", True) and r.get("ttft") is not None
                  and r["ttft"] <= goodput.ttft_limit(r, slo.ttft_s, slo.ttft_per_token_s))
    return {"attainment": att, "long_on_time": on_time, "num_long": len(longs)}


def headroom(config: Config, profile: dict, records: Sequence[dict], factors: Sequence[float],
             long_prompt: int = 1000) -> list[dict]:
    return [{"factor": f, **{order: summary(config, replay(config, profile, records, f, order), long_prompt)
                             for order in ("fifo", "deadline")}} for f in factors]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="bench/serve.py --out JSON")
    ap.add_argument("--profile", required=True, help="GET /debug/profile of the server that ran it, saved after")
    ap.add_argument("--config", default=None, help="the server's nodeserve.toml (default: the default config)")
    ap.add_argument("--speedups", default="1,1.25,1.5,1.75,2,2.5")
    ap.add_argument("--long-prompt", type=int, default=1000, help="prompts this long or longer count as long")
    args = ap.parse_args(argv)
    config = load_config(args.config, check_devices=False) if args.config else config_from_dict({}, False)
    with open(args.run) as f:
        records = json.load(f)["records"]
    with open(args.profile) as f:
        profile = json.load(f)
    measured = summary(config, records, args.long_prompt)
    print(f"measured: attainment {measured['attainment']:.1%}, long prompts on time "
          f"{measured['long_on_time']}/{measured['num_long']} (SLO: TTFT {config.slo.ttft_s} s, "
          f"TPOT {config.slo.tpot_s} s)")
    for row in headroom(config, profile, records, [float(x) for x in args.speedups.split(",")], args.long_prompt):
        print(f"prefill x{row['factor']:<5g}" + "".join(
            f" | {order} {row[order]['attainment']:.1%} (long {row[order]['long_on_time']}/{row[order]['num_long']})"
            for order in ("fifo", "deadline")))


if __name__ == "__main__":
    main()
