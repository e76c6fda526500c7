"""Host time per decode step, eager vs CUDA graphs: how long the Python side keeps a device waiting.

Command (on a GPU host, after scripts/gpu_check.sh has warmed FlashInfer's JIT cache):

    python bench/decode_host.py --device cuda:0 --dtype bf16 --batch 1,8,32 --json /tmp/decode_host.json

On CPU (`--device cpu`, torch attention, eager only) it runs too, as a smoke test of the same code path.

What it runs, per mode (eager, graphs) and batch size B: the bundled model on one device, a runner built exactly
as a decode worker builds it (nodeserve.runtime.engine.build_runner, then warmup_runner, which captures the
graphs), and --steps decode steps of B sequences that each already hold --context tokens in the pool (the
pool's values do not change the cost). Per step:
  * host: time from calling runner.run() to its return, before any synchronisation: the time the host needs
    to issue the step (prepare, plan, launches or one graph replay);
  * step: time until the device has finished it too (torch.cuda.synchronize after run()).
On CPU every op runs as it is issued, so host = step there. Medians over the steps after --warmup ones.
With host < step the device never waits for Python; host per step x 8 is what one process spends issuing
work to 8 GPUs in turn, the number that matters for one process driving a whole node.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nodeserve.runtime.node import build_runner
from nodeserve.runtime.model_runner import SeqChunk
from nodeserve.runtime.warmup import warmup_runner
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.model.loader import load_model, parse_dtype

MODEL = "smollm2-135m-instruct"


def measure(model, device: torch.device, mode: str, batch: int, context: int, num_steps: int,
            num_warmup: int, attention: str, page_size: int = 16) -> dict:
    """Median host and step milliseconds of `num_steps` decode steps of `batch` sequences."""
    pages_per_seq = pages_for(context + num_warmup + num_steps + 1, page_size)
    # +1 page: a graph bucket's padding rows write to a page reserved for them
    pool = KVPool(model.cfg, batch * pages_per_seq + 1, page_size, model.dtype, device)
    runner = build_runner(model, pool, attention, cuda_graphs=mode == "graphs", max_num_seqs=batch)
    if mode == "graphs" and runner.graphs is None:
        raise SystemExit(f"--modes graphs needs CUDA and FlashInfer; {device} runs {type(runner.backend).__name__}")
    warmup_runner(runner)
    tables = [pool.manager.allocate(pages_per_seq) for _ in range(batch)]
    cuda = device.type == "cuda"
    host_ms, step_ms = [], []
    for step in range(num_warmup + num_steps):
        chunks = [SeqChunk([1], context + step, table) for table in tables]
        start = time.perf_counter()
        runner.run(chunks)
        issued = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        done = time.perf_counter()
        if step >= num_warmup:
            host_ms.append((issued - start) * 1e3)
            step_ms.append((done - start) * 1e3)
    used_graphs = runner.graphs is not None and bool(runner.graphs.graphs)
    return {"mode": mode, "batch": batch, "context": context, "steps": num_steps, "graphs_replayed": used_graphs,
            "host_ms": statistics.median(host_ms), "step_ms": statistics.median(step_ms),
            "backend": type(runner.backend).__name__}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens each sequence already holds")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--modes", default=None, help="eager,graphs (default: both on CUDA, eager on CPU)")
    ap.add_argument("--quantization", default="none", help="model.quantization (none, auto, int8, int4, fp16)")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    modes = (args.modes or ("eager,graphs" if device.type == "cuda" else "eager")).split(",")
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core, as a CPU worker runs
    model = load_model(MODEL, parse_dtype(args.dtype), quantization=args.quantization).model.to(device)
    rows = []
    print(f"{MODEL} {args.dtype} ({args.quantization}) on {device}, context {args.context}, median of {args.steps} steps")
    print(f"{'mode':<7} {'batch':>5} {'host ms':>9} {'step ms':>9}  backend")
    for mode in modes:
        for batch in (int(b) for b in args.batch.split(",")):
            row = measure(model, device, mode, batch, args.context, args.steps, args.warmup, args.attention)
            rows.append(row)
            print(f"{mode:<7} {batch:>5} {row['host_ms']:>9.3f} {row['step_ms']:>9.3f}  {row['backend']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
