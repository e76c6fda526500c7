"""KV held per request on a model with sliding-window layers: kv.window_pages = "free" against "keep".

In process (no HTTP), disaggregated on cpu:0 (prefill) and cpu:1 (decode), the bundled Gemma 3 270M by default.
For each context length one request decodes past it, greedy; while it decodes, after each token, the decode
device's held pages are read: full-layer pages times the full layers, plus window pages times the windowed
layers, in pages of one layer. The table compares that with a whole cache (every layer, every position) and with
the bound (global layers' full context + local layers' window) / (all layers' full context), and checks the two
settings generate the same tokens.

    python bench/window_memory.py --contexts 2048,8192

Prints a table and writes bench/results/window-memory.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.model.loader import load_model, parse_dtype
from nodeserve.runtime.engine import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is scripts, not a package
from outputs import out_path  # noqa: E402

MAX_TOKENS = 32
OUT = out_path("window-memory.json")


def layer_pages_held(engine: Engine) -> int:
    """Pages of one layer that the decode device's requests hold now."""
    worker = engine.decode_workers[0]
    pool = worker.pool
    num_full_layers = pool.num_layers - len(pool.window_layers)
    held = worker.kv.num_used * num_full_layers
    if pool.window is not None:
        held += pool.window.manager.num_used * len(pool.window_layers)
    return held


async def one_run(model: str, setting: str, prompts: dict[int, list[int]], memory_gib: float) -> dict[int, dict]:
    cfg = config_from_dict({"model": {"path": model},
                            "devices": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"]},
                            "kv": {"memory_gib": memory_gib, "window_pages": setting, "prefix_cache": False},
                            "profile": {"startup": False}})
    loaded = load_model(cfg.model.path, parse_dtype(cfg.dtype), quantization=cfg.quantization)
    engine = Engine(cfg, loaded)
    engine.start(asyncio.get_running_loop())
    out = {}
    try:
        mc = loaded.config
        windows = [mc.window(i) for i in range(mc.num_layers)]
        for n, prompt in prompts.items():
            stream = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))
            tokens, most = [], 0
            async for ev in stream:
                if ev.token_id is not None:
                    tokens.append(ev.token_id)
                    most = max(most, layer_pages_held(engine))
            await asyncio.sleep(0.5)  # the last frees land
            context = n + MAX_TOKENS
            page = cfg.kv.page_size
            whole = mc.num_layers * -(-context // page)
            window = max(windows)
            bound = (sum(1 for w in windows if not w) * context + sum(1 for w in windows if w) * window) / \
                (mc.num_layers * context)
            out[n] = {"context": context, "layer_pages_held": most, "whole_cache_layer_pages": whole,
                      "ratio": most / whole, "bound": bound, "bound_plus_a_page_per_layer": bound + mc.num_layers / whole,
                      "tokens": tokens, "pages_back": layer_pages_held(engine) == 0}
    finally:
        engine.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--contexts", default="2048,8192", help="prompt lengths (tokens)")
    ap.add_argument("--memory-gib", type=float, default=2.0, help="KV pool per device")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    prompts = {n: [(i * 7919 + n) % 200000 + 1000 for i in range(n)] for n in map(int, args.contexts.split(","))}
    start = time.time()
    runs = {s: asyncio.run(one_run(args.model, s, prompts, args.memory_gib)) for s in ("free", "keep")}
    rows = []
    print(f"{'context':>8} {'setting':>7} {'held':>8} {'whole':>8} {'ratio':>6} {'bound':>6} {'+1 page':>7}  same tokens")
    for n in prompts:
        for setting, run in runs.items():
            r = dict(run[n], setting=setting, same_tokens=run[n]["tokens"] == runs["keep"][n]["tokens"])
            del r["tokens"]
            rows.append(r)
            print(f"{r['context']:>8} {setting:>7} {r['layer_pages_held']:>8} {r['whole_cache_layer_pages']:>8} "
                  f"{r['ratio']:6.3f} {r['bound']:6.3f} {r['bound_plus_a_page_per_layer']:7.3f}  {r['same_tokens']}")
    result = {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "model": args.model, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)),
              "seconds": round(time.time() - start, 1), "max_tokens": MAX_TOKENS, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
