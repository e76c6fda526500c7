"""How fast adaptive roles follow demand: a device dedicated to prefill for long prompts, given back once they stop.

Starts an adaptive server (bench/local_server.py), keeps `--streams` short requests decoding back to back, sends
`--long` long prompts (`--long-tokens` each, one every `--long-every` seconds) after `--warm` seconds, and goes on
with the short traffic for `--after` seconds. Then it reads the server's role changes and steps (GET /debug/steps)
and reports, per dedication: when it happened, when the dedicated device's last prefill step ended, and when the
device was given back, i.e. how long a role outlives the long prompts.

    python bench/roles.py            # ~1 min on the 2-core CPU machine

Writes bench/results/roles.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
from local_server import cpu_model, start_server  # noqa: E402  (bench/ is scripts, not a package)
from timeline import fetch as fetch_steps  # noqa: E402

import aiohttp  # noqa: E402

OUT = out_path("roles.json")


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        await r.read()


async def traffic(url: str, args, rng: random.Random) -> None:
    deadline = time.monotonic() + args.warm + args.long * args.long_every + args.after
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def short_loop():
            while time.monotonic() < deadline:
                await complete(session, url, [rng.randrange(300, 40000) for _ in range(64)], 32)

        async def long_prompts():
            await asyncio.sleep(args.warm)
            sent = []
            for _ in range(args.long):
                prompt = [rng.randrange(300, 40000) for _ in range(args.long_tokens)]
                sent.append(asyncio.create_task(complete(session, url, prompt, 16)))
                await asyncio.sleep(args.long_every)
            await asyncio.gather(*sent)

        await asyncio.gather(long_prompts(), *(short_loop() for _ in range(args.streams)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--warm", type=float, default=5.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server("adaptive", "auto", tmp, os.path.join(tmp, "server.log"), kv_memory_gib=0.5,
                                 kv_extra="prefix_cache = false")
        try:
            t0 = time.time()
            asyncio.run(traffic(url, args, random.Random(0)))
            snap = fetch_steps(url, 0.0)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    changes = snap.get("role_changes", [])
    steps = {d["device"]: d["steps"] for d in snap["devices"]}
    spans = []
    for i, (t, dev, role, reason) in enumerate(changes):
        if role != "prefill":
            continue
        back = next((c for c in changes[i + 1:] if c[1] == dev and c[2] == "adaptive"), None)
        end = back[0] if back else snap["now"]
        prefill_ends = [s[1] for s in steps[dev] if t <= s[1] <= end and s[2] > 0]
        last = max(prefill_ends) if prefill_ends else t
        spans.append({"device": dev, "dedicated": t, "last_prefill_step_end": last,
                      "given_back": back[0] if back else None, "reason_back": back[3] if back else None,
                      "held_after_last_prefill_s": (back[0] - last) if back else None})
    for s in spans:
        held = s["held_after_last_prefill_s"]
        print(f"{s['device']}: dedicated for {((s['given_back'] or snap['now']) - s['dedicated']):.1f} s, given back "
              + (f"{held:.1f} s after its last prefill step ({s['reason_back']})" if held is not None else "never"))
    result = {"machine": cpu_model(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
              "args": vars(args), "role_changes": changes, "dedications": spans}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
