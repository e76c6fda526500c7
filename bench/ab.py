"""Two server configurations, A and B, alternated on bench/speculative.py's workload: the ratio B / A per figure.

Each round starts a server with A's TOML, runs the workload (repetition requests and chat one stream at a time,
then 32 chat streams at once), then the same with B's (bench/local_server.py, the default model and config plus
the fragments). Each ratio is the median of the rounds' paired ratios: this machine's speed drifts by 10-20 %
between minutes, so only servers run back to back are compared. Outputs are compared text for text.

    python bench/ab.py --b-devices 'huge_pages = false' --out bench/results/ab-huge-pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model  # noqa: E402
from cpu_class import CPU_CLASS_ENV, nodeserve_env  # noqa: E402
from speculative import FIGURES, serve_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="disaggregated")
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-devices", default="", help=f"[devices] lines of {side.upper()}")
        ap.add_argument(f"--{side}-extra", default="", help=f"more tables of {side.upper()}, e.g. '[speculative]...'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), default=None)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            runs = {}
            for side in ("a", "b"):
                runs[side] = serve_workload(args.mode, tmp, os.path.join(tmp, f"{side}-{r}.log"), args.max_tokens,
                                            getattr(args, f"{side}_extra"), getattr(args, f"{side}_devices"),
                                            nodeserve_env(args.cpu_class))
            rounds.append(runs)
            print(f"round {r}:", {f"{p}.{k}": round(runs["b"][p][k] / runs["a"][p][k], 3) for p, k in FIGURES},
                  flush=True)
    ratios = {f"{p}.{k}": [r["b"][p][k] / r["a"][p][k] for r in rounds] for p, k in FIGURES}
    values = {side: {f"{p}.{k}": [r[side][p][k] for r in rounds] for p, k in FIGURES} for side in ("a", "b")}
    same = [x == y for r in rounds for x, y in zip(r["a"]["texts"], r["b"]["texts"])]
    result = {"command": " ".join(["python"] + sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(),
              "mode": args.mode, "a": {"devices": args.a_devices, "extra": args.a_extra},
              "b": {"devices": args.b_devices, "extra": args.b_extra}, "values": values,
              "ratio_b_over_a": {k: statistics.median(v) for k, v in ratios.items()}, "ratio_rounds": ratios,
              "outputs_identical": sum(same), "outputs": len(same)}
    print("B / A, medians of paired ratios:", json.dumps({k: round(v, 3) for k, v in result["ratio_b_over_a"].items()}),
          f"outputs identical {sum(same)}/{len(same)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
