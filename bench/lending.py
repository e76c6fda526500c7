"""Core lending (`devices.lend_idle_cores`) on and off, one run each, on the engine without HTTP: one stream's
decode rate, one long prompt's prefill rate, and 16 concurrent short streams (both devices busy: lending should
cost nothing there). Default config otherwise (disaggregated cpu:0 -> cpu:1, the bundled Q4_1 model).

    python bench/lending.py --json bench/results/lending.json
    python bench/lending.py --prefill-attention-ab --json bench/results/prefill-attention-ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

import torch

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.kernels import native
from nodeserve.model.loader import load_model
from nodeserve.runtime.engine import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model  # noqa: E402  (bench/ is scripts, not a package)


async def _stream(engine, ids, max_tokens):
    """(seconds to the first token, seconds from the first token to the last, tokens)."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for ev in engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)):
        if ev.token_id is not None:
            n += 1
            last = time.perf_counter()
            first = first or last
    return first - t0, last - first, n


def bench_engine(loaded, lend: bool) -> Engine:
    """The engine these scripts measure: the default config but lend_idle_cores, no prefix cache (every run
    prefills its whole prompt), no start-up profile."""
    return Engine(config_from_dict({"devices": {"lend_idle_cores": lend},
                                    "kv": {"memory_gib": 1.0, "prefix_cache": False}, "profile": {"startup": False}}),
                  loaded)


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    return (tokenizer.encode("The history of the city is long. ") * num_tokens)[:num_tokens]


_native_prefill_attention = native.NativeKernels.prefill_attention


def run(loaded, lend: bool, long_tokens: int, decode_tokens: int, torch_prefill_attention: bool | None = None) -> dict:
    """torch_prefill_attention: None leaves the kernels alone; True refuses every prefill attention call of the native
    kernels for the run, so prompts take torch's path (NODESERVE_KERNELS=avx2 no longer does: AVX2 has its kernel
    now); False runs the native one."""
    if torch_prefill_attention:
        native.NativeKernels.prefill_attention = lambda *args, **kwargs: False  # the backend falls back to torch
    engine = bench_engine(loaded, lend)
    short = loaded.tokenizer.encode("Write a short story about a lighthouse keeper.")
    long_ids = long_prompt(loaded.tokenizer, long_tokens)

    async def main():
        engine.start(asyncio.get_running_loop())  # builds the attention backends
        try:
            await _stream(engine, short, 8)  # warm-up
            out = {}
            ttft, decode_s, n = await _stream(engine, short, decode_tokens)
            out["single_stream_tok_s"] = (n - 1) / decode_s
            ttft, _, _ = await _stream(engine, long_ids, 1)
            out["prefill_tok_s"] = long_tokens / ttft
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_stream(engine, short, 64) for _ in range(16)))
            out["16_streams_tok_s"] = sum(r[2] for r in results) / (time.perf_counter() - t0)
            out["helper_jobs"] = engine.lending.num_jobs() if engine.lending else None
            return out
        finally:
            engine.stop()
    try:
        return asyncio.run(main())
    finally:
        if torch_prefill_attention:
            native.NativeKernels.prefill_attention = _native_prefill_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill-attention-ab", action="store_true",
                    help="lending on in every run: the native prefill attention vs torch's (the native one "
                         "refused for the run; the model's GEMMs stay the default's), interleaved ABBAAB, three runs "
                         "each")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m-instruct", torch.float32, quantization="auto")
    result = {"machine": cpu_model(), "platform": platform.platform(), "kernels": native.load().isa,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "runs": {}}
    a, b = (("native prefill attention", True, False), ("torch prefill attention", True, True)) \
        if args.prefill_attention_ab else (("lend_idle_cores=False", False, None), ("lend_idle_cores=True", True, None))
    arms = [a, b, b, a, a, b] if args.prefill_attention_ab else [a, b, a, b]  # ABBAAB: a linear drift cancels
    run(loaded, True, args.long_tokens, args.decode_tokens)  # unrecorded: a process's first engine ran up to 30 % slow
    for name, lend, torch_attention in arms:  # interleaved: drift hits both alike
        r = run(loaded, lend, args.long_tokens, args.decode_tokens, torch_attention)
        result["runs"].setdefault(name if args.prefill_attention_ab else str(lend), []).append(r)
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
