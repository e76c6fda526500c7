"""One stream on a tensor-parallel group against one core and against core lending, on the engine without HTTP.

Three colocated layouts of the bundled Q4_1 model (the default quantized path), one after another in one run:
  one core       devices = ["cpu:0"]
  lending        devices = ["cpu:0", "cpu:1"], lend_idle_cores = true (one stream: its device borrows the other core)
  tp2            devices = ["cpu:0+cpu:1"]
Each: a warm-up request, then --repeats greedy streams of --decode-tokens tokens; the decode rate is tokens after
the first over the time from the first to the last (median of the repeats), and a --prompt-tokens prompt's TTFT.
For tp2, the all-reduce's share of a decode step (reduce_share: the group's runner with and without it).

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


def reduce_share(loaded, steps: int = 200) -> dict:
    """The all-reduce's share of a TP 2 decode step (one row, 64 tokens of context), from two runs of the group's
    runner on cpu:0+cpu:1: as served, and with each rank reducing in a group of its own (no waiting, no sum: wrong
    logits, the same work otherwise). What the reduce costs is the difference: the sums, the barriers, and each
    rank's wait for the slower one at every reduce."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.device import make_device
    from nodeserve.device.collectives import RankComm, make_all_reduce
    from nodeserve.kv.pool import KVPool, pages_for
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.runtime.tp_group import GroupAttention, TPGroupModel

    group = make_device("cpu:0+cpu:1")
    model = TPGroupModel(loaded.config, loaded.shards[2], group.ranks, make_all_reduce("cpu", 2))
    pool = KVPool(loaded.config, 64, 16, torch.float32, torch.device("cpu"), shards=model.kv_shards())
    runner = ModelRunner(model, GroupAttention(pool, [TorchAttention(p, s.cfg, torch.float32)
                                                      for s, p in zip(model.shards, pool.shards)]))
    out: dict = {}

    def step_ms() -> float:
        table = pool.manager.allocate(pages_for(64 + steps, 16))
        runner.run([SeqChunk(list(range(100, 164)), 0, table, True)])
        t = time.perf_counter()
        for i in range(steps):
            runner.run([SeqChunk([5], 64 + i, table, True)])
        pool.manager.free(table)
        return (time.perf_counter() - t) / steps * 1e3

    def main() -> None:
        group.init_worker_thread()
        served = model.reduces
        out["step_ms"] = step_ms()
        model.reduces = [RankComm(make_all_reduce("cpu", 1), 0) for _ in served]
        out["step_ms_without_reduce"] = step_ms()
        model.reduces = served

    import threading

    worker = threading.Thread(target=main)  # as a worker thread: pinned to cpu:0, one intra-op thread
    worker.start()
    worker.join()
    out["share"] = 1 - out["step_ms_without_reduce"] / out["step_ms"]
    return out


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
    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": cpu_model(), "platform": platform.platform(), "kernels": native.load().isa,
              "quantization": args.quantization, "decode_tokens": args.decode_tokens, "runs": {}}
    for layout in LAYOUTS:
        r = run(loaded, layout, args.decode_tokens, args.prompt_tokens, args.repeats)
        result["runs"][layout] = r
        print(f"{layout:9s} decode {r['decode_tok_s']:6.1f} tok/s  prefill {r['prefill_tok_s']:6.0f} tok/s", flush=True)
    one, lend, tp = (result["runs"][k]["decode_tok_s"] for k in LAYOUTS)
    result["tp2_over_one_core"] = tp / one
    result["tp2_over_lending"] = tp / lend
    print(f"tp2 / one core {tp / one:.2f}x, tp2 / lending {tp / lend:.2f}x")
    share = reduce_share(loaded)
    result["all_reduce"] = share
    print(f"tp2 decode step {share['step_ms']:.2f} ms, {share['step_ms_without_reduce']:.2f} ms with each rank "
          f"reducing alone: the all-reduce (sums, barriers, waits for the slower rank) is {share['share']:.1%}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
