"""What grammar-constrained decoding costs: decode throughput of N concurrent requests with and without a
JSON-schema grammar, in process (the engine, no HTTP), same prompts, same number of tokens.

    python bench/structured.py --concurrency 16 --max-tokens 64 --repeats 3 --json /tmp/structured.json

Each request decodes exactly --max-tokens tokens (ignore_eos). The constrained run gives every request a matcher
for a schema that cannot complete within that many tokens (an array of at least 100 {"name": string, "n":
integer} objects), so the grammar works on every step, strings included, as it would on a long JSON answer.
Throughput is counted over the window where all N requests are decoding (from the last first token to the first
finish): tokens in it / its length. Runs alternate (plain, constrained, plain, ...) so a machine whose load
changes hurts both alike; the medians and the cost (1 - constrained / plain) are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import statistics
import sys
import time

import torch

from nodeserve.config import config_from_dict
from nodeserve.sampling.constrain import accept_tokens, apply_grammar_masks
from nodeserve.runtime.engine import Engine
from nodeserve.model.loader import load_model
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.server.structured import Grammars

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}}
PROMPTS = ["List some fruits with their prices as JSON.", "Give me ten cities and their populations.",
           "Write an inventory of a kitchen as JSON.", "Name planets and their moons, as JSON."]


async def one_run(engine: Engine, grammars: Grammars | None, compiled, prompts: list[list[int]],
                  max_tokens: int) -> dict:
    times: list[list[float]] = [[] for _ in prompts]

    async def consume(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        grammar = grammars.matcher(compiled) if grammars is not None else None
        async for ev in engine.add_request(prompts[i], params, grammar=grammar):
            if ev.token_id is not None:
                times[i].append(time.perf_counter())
    await asyncio.gather(*(consume(i) for i in range(len(prompts))))
    start = max(t[0] for t in times)   # every request is decoding from here
    end = min(t[-1] for t in times)    # until the first one finishes
    tokens = sum(sum(1 for x in t if start < x <= end) for t in times)
    return {"tokens_per_s": tokens / (end - start), "window_s": end - start, "tokens": tokens}


def grammar_ms_per_step(grammars: Grammars, compiled, batch: int, vocab_size: int, num_steps: int = 200) -> float:
    """The grammar's own time per decode step (fill the batch's bitmask, apply it, advance every matcher), less
    the argmax it wraps: less exposed to a busy machine than the end-to-end numbers."""
    matchers = [grammars.matcher(compiled) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    with_grammar, without = [], []
    for _ in range(num_steps):
        logits = torch.randn(batch, vocab_size, generator=gen)
        t0 = time.perf_counter()
        logits.argmax(dim=-1).tolist()
        t1 = time.perf_counter()
        tokens = apply_grammar_masks(logits, matchers).argmax(dim=-1).tolist()
        accept_tokens(matchers, tokens)
        t2 = time.perf_counter()
        without.append(t1 - t0)
        with_grammar.append(t2 - t1)
    return 1e3 * (statistics.median(with_grammar) - statistics.median(without))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="auto", help="model.quantization (auto: the served default)")
    ap.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    devices = {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"]} if args.mode == "disaggregated" \
        else {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]}
    config = config_from_dict({"model": {"quantization": args.quantization}, "devices": devices,
                               "kv": {"memory_gib": 0.5}})
    loaded = load_model(config.model.path, quantization=config.quantization)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]))
               for i in range(args.concurrency)]
    grammars = Grammars(tok, loaded.config.vocab_size)
    compiled = grammars.compile(("json", "schema", SCHEMA))

    async def run_all() -> dict:
        engine = Engine(config, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            await one_run(engine, None, None, prompts, 8)  # warm-up
            runs = {"plain": [], "constrained": []}
            for _ in range(args.repeats):
                runs["plain"].append(await one_run(engine, None, None, prompts, args.max_tokens))
                runs["constrained"].append(await one_run(engine, grammars, compiled, prompts, args.max_tokens))
            return runs
        finally:
            engine.stop()
    runs = asyncio.run(run_all())
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    constrained = statistics.median(r["tokens_per_s"] for r in runs["constrained"])
    grammar_ms = grammar_ms_per_step(grammars, compiled, args.concurrency, loaded.config.vocab_size)
    step_ms = 1e3 * args.concurrency / plain
    result = {"command": " ".join(map(shlex.quote, [sys.executable, *sys.argv])), "machine": platform.processor()
              or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "runs": runs,
              "plain_tokens_per_s": plain, "constrained_tokens_per_s": constrained, "cost": 1 - constrained / plain,
              "grammar_ms_per_step": grammar_ms, "plain_step_ms": step_ms}
    print(f"decode throughput at {args.concurrency} concurrent requests: plain {plain:.1f} tok/s, constrained "
          f"{constrained:.1f} tok/s, cost {100 * result['cost']:.1f} % (median of {args.repeats})")
    print(f"grammar time per step at batch {args.concurrency}: {grammar_ms:.2f} ms, against a plain decode step of "
          f"{step_ms:.1f} ms ({100 * grammar_ms / step_ms:.1f} %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
