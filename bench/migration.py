"""Live migration vs stop-and-copy: the inter-token gaps of one request moved between two devices mid-decode.

In process (no HTTP: the gaps are the engine's), colocated on two devices, the bundled model as the default config
loads it. For each context length: one run that never moves (the reference tokens and gaps), one moved live
(pre-copy rounds while it decodes, then a stop for the last pages), one moved by stop-and-copy (the whole KV copied
while it waits). Each moves after MOVE_AFTER tokens, so the context at the move is about the named length. The
prefix cache is on, so the three runs of a length prefill the prompt once; every run starts on the same device.

    python bench/migration.py --contexts 1024,4096,8000

Prints a table and writes bench/results/migration.json: per run the median and worst gap after the first token,
the gap at the move, the migration's downtime and pages copied, whether the tokens match the unmoved run, and
whether every page came back on both devices.
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

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.model.loader import load_model, parse_dtype
from nodeserve.runtime.engine import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is scripts, not a package
from outputs import out_path  # noqa: E402

MOVE_AFTER = 32   # tokens decoded on the source before the move
MAX_TOKENS = 128
OUT = out_path("migration.json")


async def one_run(engine: Engine, prompt: list[int], mode: str) -> dict:
    """mode: "none" (never moves), "live" or "stop" (stop-and-copy)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    stream = engine.add_request(prompt, params)
    rid = stream.request.request_id
    source = engine.router.placements[rid].name
    target = next(w.name for w in engine.decode_workers if w.name != source)
    before = dict(engine.router.num_migrations)
    tokens, times = [], []
    async for ev in stream:
        if ev.token_id is None:
            continue
        tokens.append(ev.token_id)
        times.append(time.perf_counter())
        if mode != "none" and len(tokens) == MOVE_AFTER:
            if not engine.migrate(rid, target, live=(mode == "live")):
                raise RuntimeError(f"{mode}: the move did not start")
    gaps = [b - a for a, b in zip(times, times[1:])]
    moved = {k: v - before.get(k, 0) for k, v in engine.router.num_migrations.items() if v != before.get(k, 0)}
    return {"mode": mode, "source": source, "tokens": tokens, "gaps_ms": [g * 1000 for g in gaps],
            "median_gap_ms": statistics.median(gaps) * 1000, "max_gap_ms": max(gaps) * 1000,
            "move_gap_ms": max(gaps[MOVE_AFTER - 1:MOVE_AFTER + 12]) * 1000 if mode != "none" else None,
            "outcomes": {str(k): v for k, v in moved.items()},
            "downtime_ms": engine.router.migration_downtimes[-1] * 1000 if moved.get("moved") else None}


async def bench(contexts: list[int], memory_gib: float) -> list[dict]:
    cfg = config_from_dict({"devices": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]},
                            "kv": {"memory_gib": memory_gib}, "profile": {"startup": False}})
    loaded = load_model(cfg.model.path, parse_dtype(cfg.dtype), quantization=cfg.quantization)
    engine = Engine(cfg, loaded)
    engine.start(asyncio.get_running_loop())
    engine.warmup()
    vocab = loaded.config.vocab_size
    rows = []
    try:
        for n in contexts:
            num_prompt = n - MOVE_AFTER
            prompt = [(i * 7919 + n) % (vocab - 1000) + 500 for i in range(num_prompt)]
            runs = {}
            for mode in ("none", "live", "stop"):
                runs[mode] = await one_run(engine, prompt, mode)
                await asyncio.sleep(0.5)  # the handoffs' page frees land
            free = [(s.device, s.num_free, s.num_pages) for s in engine.pool_stats()]
            reference = runs["none"]["tokens"]
            for mode, r in runs.items():
                r["same_tokens"] = r["tokens"] == reference
                r["context"] = n
                r["pages_whole"] = all(f == p for _, f, p in free)
                del r["tokens"]
                rows.append(r)
                print(f"{n:>6} {mode:>5}: median gap {r['median_gap_ms']:6.1f} ms, worst {r['max_gap_ms']:7.1f} ms"
                      f" ({r['max_gap_ms'] / r['median_gap_ms']:4.2f}x), at the move "
                      f"{r['move_gap_ms'] or 0:7.1f} ms, downtime {r['downtime_ms'] or 0:6.1f} ms, "
                      f"same tokens {r['same_tokens']}, pages whole {r['pages_whole']}", flush=True)
    finally:
        engine.stop()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8000", help="context lengths at the move (tokens)")
    ap.add_argument("--memory-gib", type=float, default=1.0, help="KV pool per device")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    start = time.time()
    rows = asyncio.run(bench(contexts, args.memory_gib))
    result = {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)),
              "seconds": round(time.time() - start, 1), "move_after": MOVE_AFTER, "max_tokens": MAX_TOKENS,
              "runs": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
