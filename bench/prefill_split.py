"""Where one long prompt's prefill time goes: every native kernel call on the engine's prefill device timed by
kind (the projections' GEMMs, prompt attention, SiLU, the norms, RoPE, the KV writes), with `devices.lend_idle_cores`
off (one core) and on (the decode device's idle core lent), interleaved. Default config otherwise (disaggregated
cpu:0 -> cpu:1, the bundled Q4_1 model, the default prompt kernels).

    python bench/prefill_split.py --json bench/results/prefill-split.json

What the kernels do not account for (TTFT minus the timed calls) is torch's ops, the scheduler and sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import defaultdict

import torch

from nodeserve.kernels import native
from nodeserve.model.loader import load_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lending import _stream, bench_engine, long_prompt  # noqa: E402  (bench/ is scripts, not a package)
from local_server import cpu_model  # noqa: E402

KERNELS = ("linear", "prefill_attention", "silu_and_mul", "rms_norm", "add_rms_norm", "rope", "write_kv",
           "dequantize")


def instrument(seconds: dict[str, float]) -> None:
    """Every NativeKernels method in KERNELS adds its wall time to seconds[name] (this process only)."""
    for name in KERNELS:
        fn = getattr(native.NativeKernels, name)

        def timed(self, *args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - t0
        setattr(native.NativeKernels, name, timed)


def run(loaded, lend: bool, num_tokens: int, seconds: dict[str, float]) -> dict:
    engine = bench_engine(loaded, lend)
    ids = long_prompt(loaded.tokenizer, num_tokens)

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            await _stream(engine, ids[:100], 2)  # warm-up
            seconds.clear()
            ttft, _, _ = await _stream(engine, ids, 1)
            return {"ttft_s": ttft, "tok_s": num_tokens / ttft, "kernels_ms": {k: v * 1e3 for k, v in seconds.items()},
                    "other_ms": (ttft - sum(seconds.values())) * 1e3}
        finally:
            engine.stop()
    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each arm, interleaved")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load_model("smollm2-135m-instruct", torch.float32, quantization="auto", prompt_activations="auto")
    seconds: dict[str, float] = defaultdict(float)
    instrument(seconds)
    result = {"machine": cpu_model(), "platform": platform.platform(), "kernels": native.load().isa,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "runs": {}}
    run(loaded, True, args.tokens, seconds)  # unrecorded: a process's first engine runs slow
    for _ in range(args.repeat):
        for lend in (False, True):
            r = run(loaded, lend, args.tokens, seconds)
            result["runs"].setdefault(f"lend_idle_cores={lend}", []).append(r)
            split = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["kernels_ms"].items(), key=lambda kv: -kv[1]))
            print(f"lend_idle_cores={lend}: {r['ttft_s']:.3f} s ({r['tok_s']:.0f} tok/s); ms: {split}, "
                  f"other {r['other_ms']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
