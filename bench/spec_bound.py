"""How much prompt lookup can speed up bench/speculative.py's repetition workload on this device, at best.

Servers (bench/local_server.py): one with speculation off gives each repetition prompt's greedy output, its
measured time to first token and its decode time; then one per k in PRICED_K, each verifying every guess found up
to k, give the price of a verify step by its rows (the median of their /debug/steps with no prompt tokens, by row
count: most have 1 or k + 1 rows; row counts between are priced on the line between their neighbours). Then each
output is replayed through the drafter (speculative/prompt_lookup.PromptLookup), step by step, and three ways of
choosing how many guesses to verify are priced by that table:
- `policy`: core/speculation.Speculator as the server runs it (adaptive, num_speculative_tokens), deciding from the
  decode device's start-up step model as the server's does;
- `fixed k`: every guess found, up to k;
- `oracle`: exactly the guesses that will be accepted (it knows the output), so no row is wasted and no accepted
  run is cut short: while a step of a + b rows costs less than a step of a and one of b (a step has a fixed
  part), no draft-length policy over this drafter does better.
Decode speedup = the price of one-token steps / the price of the verify steps. The whole-request bound adds the
measured times to first token (speculation leaves prefill alone) to the measured decode time over the oracle's
speedup. Outputs are re-tokenized from their text (close to, not always exactly, the ids served).

    python bench/spec_bound.py --out bench/results/spec-bound.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from typing import Callable

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model, start_server  # noqa: E402
from cpu_class import nodeserve_env  # noqa: E402
from speculative import CHAT, REPETITION, one  # noqa: E402

from nodeserve.config import SpeculativeSection  # noqa: E402
from nodeserve.core.cost_model import StepModel  # noqa: E402
from nodeserve.core.request import Request  # noqa: E402
from nodeserve.core.sampling_params import SamplingParams  # noqa: E402
from nodeserve.core.speculation import SeqSpeculation, Speculator  # noqa: E402
from nodeserve.model import registry  # noqa: E402
from nodeserve.model.gguf_header import read_header  # noqa: E402
from nodeserve.model.gguf_loader import read_metadata  # noqa: E402
from nodeserve.model.loader import resolve_path  # noqa: E402
from nodeserve.speculative.prompt_lookup import NgramIndex, PromptLookup  # noqa: E402
from nodeserve.tokenizer import Tokenizer  # noqa: E402

FIXED_K = (1, 2, 4, 7, 11, 15)
MAX_GUESSES = max(FIXED_K)
PRICED_K = (3, 7, 11, 15)  # verify steps of 4, 8, 12 and 16 rows, measured
MIN_SAMPLES = 5


async def serve(url: str, max_tokens: int) -> tuple[list[dict], dict, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await one(s, url, CHAT[0], 8)  # warm, as bench/speculative.py does
        outs = [await one(s, url, p, max_tokens) for p in REPETITION]
        async with s.get(url + "/debug/profile") as r:
            profile = await r.json()
        async with s.get(url + "/debug/steps") as r:
            steps = await r.json()
    return outs, profile, steps


def row_prices(runs: list[dict]) -> list[float]:
    """[r]: the median seconds of a step of r decode rows and no prompt tokens (1 .. MAX_GUESSES + 1), from the row
    counts seen MIN_SAMPLES times or more; the rest on the line between the nearest of those (past the last: its
    price)."""
    by_rows: dict[int, list[float]] = {}
    for dev in (dev for steps in runs for dev in steps["devices"]):
        for start, end, num_prompt, num_rows in dev["steps"]:
            if num_prompt == 0 and num_rows > 0:
                by_rows.setdefault(num_rows, []).append(end - start)
    seen = {r: statistics.median(v) for r, v in by_rows.items() if len(v) >= MIN_SAMPLES}
    if 1 not in seen:
        raise RuntimeError(f"fewer than {MIN_SAMPLES} one-row decode steps were recorded")
    known = sorted(seen)
    prices = [0.0]
    for r in range(1, MAX_GUESSES + 2):
        lo = max(k for k in known if k <= r)
        hi = min((k for k in known if k >= r), default=lo)
        prices.append(seen[lo] if hi == lo else seen[lo] + (seen[hi] - seen[lo]) * (r - lo) / (hi - lo))
    return prices


def step_model(profile: dict) -> StepModel:
    """The decode device's start-up model: its profile samples alone (online refits saw this run's steps)."""
    devices = profile["devices"]
    model = StepModel.from_dict(devices["cpu:1" if "cpu:1" in devices else next(iter(devices))])
    model.online_samples.clear()
    model.refit()
    return model


def replay(prompt_ids: list[int], out: list[int], price: Callable[[int], float],
           choose: Callable[[NgramIndex, SeqSpeculation, Request, int], int], sp: SpeculativeSection) -> dict:
    """Steps through `out` as verification would: choose() says how many of the drafter's guesses to verify."""
    index = NgramIndex(sp.prompt_lookup_min, sp.prompt_lookup_max)
    index.extend(prompt_ids)
    state, req = SeqSpeculation(), Request("r", prompt_ids, SamplingParams(max_tokens=len(out)))
    pos, seconds, num_steps, num_wasted = 0, 0.0, 0, 0
    while pos < len(out):
        req.output_ids = out[:pos]
        guesses = index.propose(MAX_GUESSES)[:choose(index, state, req, pos)]
        accepted = 0
        while accepted < len(guesses) and pos + accepted < len(out) and out[pos + accepted] == guesses[accepted]:
            accepted += 1
        if guesses:
            state.observe(len(guesses), accepted)
        seconds += price(1 + len(guesses))
        index.extend(out[pos:pos + accepted + 1])
        pos += accepted + 1
        num_steps += 1
        num_wasted += len(guesses) - accepted
    return {"seconds": seconds, "steps": num_steps, "wasted_rows": num_wasted}


def bound(requests: list[tuple[list[int], list[int]]], prices: list[float], model: StepModel,
          sp: SpeculativeSection) -> dict:
    """requests: (prompt ids, greedy output ids) each; prices: row_prices'; model: what the policy decides by."""
    def price(rows: int) -> float:
        return prices[rows]

    speculator = Speculator(PromptLookup(sp.prompt_lookup_min, sp.prompt_lookup_max), sp.num_speculative_tokens)
    speculator.use_step_model(lambda: model)

    def policy(index: NgramIndex, state: SeqSpeculation, req: Request, pos: int) -> int:
        state.state = index  # the speculator's drafter reads the same index
        drafts = speculator.drafts([state], [req], [sp.num_speculative_tokens], [req.num_prompt_tokens + pos])
        return len(drafts[0])

    def oracle_of(out: list[int]) -> Callable[[NgramIndex, SeqSpeculation, Request, int], int]:
        def oracle(index: NgramIndex, state: SeqSpeculation, req: Request, pos: int) -> int:
            guesses, n = index.propose(MAX_GUESSES), 0
            while n < len(guesses) and pos + n < len(out) and out[pos + n] == guesses[n]:
                n += 1
            return n
        return oracle

    rows: dict[str, dict] = {}
    plain = 0.0
    for prompt_ids, out in requests:
        plain += price(1) * len(out)
        ways = {"policy": policy, "oracle": oracle_of(out), **{f"fixed {k}": (lambda *_, k=k: k) for k in FIXED_K}}
        for name, choose in ways.items():
            r = replay(prompt_ids, out, price, choose, sp)
            acc = rows.setdefault(name, {"seconds": 0.0, "steps": 0, "wasted_rows": 0})
            for key in acc:
                acc[key] += r[key]
    for acc in rows.values():
        acc["decode_speedup"] = plain / acc["seconds"]
    return {"plain_decode_s": plain, "row_prices_ms": [1e3 * p for p in prices[1:]], "ways": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cpu-class", default=None, help="force a CPU class's kernels (bench/cpu_class.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sp = SpeculativeSection()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for spec in ['method = "off"', *(f'method = "prompt_lookup"\nadaptive = false\nnum_speculative_tokens = {k}'
                                         for k in PRICED_K)]:
            proc, url = start_server(args.mode, "auto", tmp, os.path.join(tmp, "server.log"),
                                     extra=f"[speculative]\n{spec}\n", env=nodeserve_env(args.cpu_class))
            try:
                runs.append(asyncio.run(serve(url, args.max_tokens)))
            finally:
                proc.terminate()
                proc.wait(60)
    (outs, profile, _), verify_steps = runs[0], [steps for _, _, steps in runs[1:]]
    path = resolve_path("smollm2-135m-instruct")
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(read_header(path)),
                                             registry.ARCHITECTURES["llama"].chat_template)
    requests = [(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_bos=False),
                 tokenizer.encode(o["text"], add_bos=False)) for p, o in zip(REPETITION, outs)]
    result = bound(requests, row_prices(verify_steps), step_model(profile), sp)
    ttft = sum(o["seconds"] - o["decode_seconds"] for o in outs)
    decode = sum(o["decode_seconds"] for o in outs)
    oracle = result["ways"]["oracle"]["decode_speedup"]
    result.update({"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_class": args.cpu_class or "native"},
                   "command": "python " + " ".join(sys.argv), "mode": args.mode,
                   "measured": {"ttft_and_first_s": ttft, "decode_s": decode,
                                "tokens": [o["tokens"] for o in outs]},
                   "whole_request_bound": (ttft + decode) / (ttft + decode / oracle)})
    print(f"{args.mode}, {args.cpu_class or 'native'} kernels: measured time to first token {ttft:.2f} s, "
          f"decode {decode:.2f} s over {len(outs)} requests (priced: {result['plain_decode_s']:.2f} s)")
    print("  verify step ms by rows: " + " ".join(f"{p:.1f}" for p in result["row_prices_ms"]))
    for name, r in result["ways"].items():
        print(f"  {name:10s} decode speedup {r['decode_speedup']:.2f}x  steps {r['steps']:4d}  "
              f"wasted rows {r['wasted_rows']}")
    print(f"  whole requests at the oracle's decode speedup: {result['whole_request_bound']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
