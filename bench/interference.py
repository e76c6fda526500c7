"""Decode interference: how much long prompts being prefilled slow down everyone else's token stream.

Starts a real nodeserve server per mode, keeps `--streams` short requests decoding, and measures at the
client the inter-token gaps of those short requests, first alone (baseline) and then while long prompts
(`--long-tokens` tokens) keep arriving. In disaggregated mode the long prompts run on the prefill device, so
the short requests' gaps should barely move; in colocated mode they share a device with the prefill chunks.

    python bench/interference.py --modes disaggregated,colocated --seconds 40

Writes bench/results/interference.json and prints p50/p99/max gaps per mode and phase, and the p99 ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
from local_server import cpu_model, start_server  # noqa: E402  (bench/ is scripts, not a package)

import aiohttp




async def stream_gaps(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    gaps, last = [], None
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def phase(url: str, seconds: float, streams: int, long_tokens: int, long_every: float, rng: random.Random) -> dict:
    """Runs `streams` short requests back to back for `seconds`; if long_every > 0, also sends a long prompt
    every `long_every` seconds. Returns the short requests' inter-token gaps."""
    deadline = time.perf_counter() + seconds
    gaps: list[float] = []
    num_long = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def short_loop():
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(300, 40000) for _ in range(rng.randint(50, 200))]
                gaps.extend(await stream_gaps(session, url, prompt, 64))

        async def long_loop():
            nonlocal num_long
            tasks = []
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(300, 40000) for _ in range(long_tokens)]
                tasks.append(asyncio.create_task(stream_gaps(session, url, prompt, 4)))
                num_long += 1
                await asyncio.sleep(long_every)
            await asyncio.gather(*tasks)

        jobs = [short_loop() for _ in range(streams)] + ([long_loop()] if long_every > 0 else [])
        await asyncio.gather(*jobs)
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000  # noqa: E731
    return {"num_gaps": len(gaps), "num_long_prompts": num_long, "p50_ms": q(0.50), "p90_ms": q(0.90),
            "p99_ms": q(0.99), "max_ms": gaps[-1] * 1000, "mean_ms": statistics.fmean(gaps) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=4.0)
    ap.add_argument("--out", default=out_path("interference.json"))
    args = ap.parse_args()
    results = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": platform.processor()
               or platform.machine(), "cpu_model": cpu_model(), "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            proc, url = start_server(mode, args.dtype, tmp)
            try:
                rng = random.Random(0)
                asyncio.run(phase(url, 5, args.streams, args.long_tokens, 0, rng))  # warm-up
                base = asyncio.run(phase(url, args.seconds, args.streams, args.long_tokens, 0, rng))
                loaded = asyncio.run(phase(url, args.seconds, args.streams, args.long_tokens, args.long_every, rng))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            results["modes"][mode] = {"baseline": base, "with_long_prompts": loaded,
                                      "p99_ratio": loaded["p99_ms"] / base["p99_ms"]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'mode':<14} {'phase':<18} {'gaps':>6} {'long':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for mode, r in results["modes"].items():
        for name in ("baseline", "with_long_prompts"):
            p = r[name]
            print(f"{mode:<14} {name:<18} {p['num_gaps']:>6} {p['num_long_prompts']:>5} {p['p50_ms']:>8.1f} "
                  f"{p['p99_ms']:>8.1f} {p['max_ms']:>8.1f}")
        print(f"{mode:<14} p99 with long prompts / baseline = {r['p99_ratio']:.2f}x")



if __name__ == "__main__":
    main()
