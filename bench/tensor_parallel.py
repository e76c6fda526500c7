"""One stream on a tensor-parallel group against one core and against core lending, on the engine without HTTP.

Three colocated layouts of the bundled Q4_1 model (the default quantized path), one after another in one run:
  one core       devices = ["cpu:0"]
  lending        devices = ["cpu:0", "cpu:1"], lend_idle_cores = true (one stream: its device borrows the other core)
  tp2            devices = ["cpu:0+cpu:1"]
Each: a warm-up request, then --repeats greedy streams of --decode-tokens tokens; the decode rate is tokens after
the first over the time from the first to the last (median of the repeats), and a --prompt-tokens prompt's TTFT.
For tp2, the all-reduce's share of a decode step: two per layer, each timed alone between two threads on the two
cores (the median of 2000; in a step a rank also waits there for the slower one, which this leaves out).

    python bench/tensor_parallel.py --json bench/results/tensor-parallel.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time

import torch

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.kernels import native
from nodeserve.model.loader import load_model
from nodeserve.runtime.engine import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lending import _stream, long_prompt  # noqa: E402  (bench/ is scripts, not a package)
from local_server import cpu_model  # noqa: E402
from outputs import out_path  # noqa: E402

LAYOUTS = {
    "one core": {"mode": "colocated", "devices": ["cpu:0"], "lend_idle_cores": False},
    "lending": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"], "lend_idle_cores": True},
    "tp2": {"mode": "colocated", "devices": ["cpu:0+cpu:1"], "lend_idle_cores": False},
}


def reduce_latency(num_floats: int, calls: int = 2000) -> float:
    """Median seconds of one all-reduce of num_floats float32 between two threads on cpu:0 and cpu:1 (what a
    decode row costs the group twice per layer; includes the wait for the other rank, here none to speak of)."""
    from nodeserve.device import make_device
    from nodeserve.device.collectives import make_all_reduce

    group = make_all_reduce("cpu", 2)
    devices = [make_device("cpu:0"), make_device("cpu:1")]
    times: list[float] = []

    def rank(r: int) -> None:
        devices[r].init_worker_thread()
        x = torch.ones(num_floats)
        for _ in range(calls):
            t = time.perf_counter()
            group(r, x)
            if r == 0:
                times.append(time.perf_counter() - t)
            x.fill_(1.0)

    import threading

    other = threading.Thread(target=rank, args=(1,))
    other.start()
    rank(0)
    other.join()
    return statistics.median(times)


def run(loaded, layout: str, decode_tokens: int, prompt_tokens: int, repeats: int) -> dict:
    engine = Engine(config_from_dict({"devices": LAYOUTS[layout], "kv": {"memory_gib": 1.0, "prefix_cache": False},
                                      "profile": {"startup": False}}), loaded)
    short = loaded.tokenizer.encode("Write a short story about a lighthouse keeper.")

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            await _stream(engine, short, 8)
            rates = []
            for _ in range(repeats):
                _, decode_s, n = await _stream(engine, short, decode_tokens)
                rates.append((n - 1) / decode_s)
            ttft, _, _ = await _stream(engine, long_prompt(loaded.tokenizer, prompt_tokens), 1)
            return {"decode_tok_s": statistics.median(rates), "decode_tok_s_runs": rates,
                    "prefill_tok_s": prompt_tokens / ttft}
        finally:
            engine.stop()
    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="auto", help="model.quantization: auto (Q4_1 blocks) or none (float32)")
    ap.add_argument("--json", default=str(out_path("tensor-parallel.json")))
    args = ap.parse_args()
    loaded = load_model("smollm2-135m-instruct", torch.float32, quantization=args.quantization, tp_degrees=(2,))
    result = {"machine": cpu_model(), "platform": platform.platform(), "kernels": native.load().isa,
              "quantization": args.quantization, "decode_tokens": args.decode_tokens, "runs": {}}
    for layout in LAYOUTS:
        r = run(loaded, layout, args.decode_tokens, args.prompt_tokens, args.repeats)
        result["runs"][layout] = r
        print(f"{layout:9s} decode {r['decode_tok_s']:6.1f} tok/s  prefill {r['prefill_tok_s']:6.0f} tok/s", flush=True)
    one, lend, tp = (result["runs"][k]["decode_tok_s"] for k in LAYOUTS)
    result["tp2_over_one_core"] = tp / one
    result["tp2_over_lending"] = tp / lend
    print(f"tp2 / one core {tp / one:.2f}x, tp2 / lending {tp / lend:.2f}x")
    cfg = loaded.config
    latency = reduce_latency(cfg.hidden_size)
    share = 2 * cfg.num_layers * latency * tp  # seconds of all-reduce per step / seconds per step
    result["all_reduce_s_decode_row"] = latency
    result["all_reduce_share_of_decode_step"] = share
    print(f"all-reduce of one decode row ({cfg.hidden_size} floats): {latency * 1e6:.1f} us median; "
          f"x {2 * cfg.num_layers} per step = {share:.1%} of a tp2 decode step")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
