"""Speculative decoding (prompt lookup) on and off, on real servers: output tok/s, identical outputs, token gaps.

For each mode (--modes) and method (off and --methods: prompt_lookup, draft), one server (bench/local_server.py, default model and
config plus the [speculative] method), then, greedy and streamed (SSE arrival times are what a client sees):
- repetition: requests whose answer repeats the prompt (rewrite code with one change, extract fields to JSON,
  answer quoting a passage, fix a typo in a paragraph), one stream at a time: output tok/s over the whole
  request and over its decode (first token to last);
- chat (--chat-prompts short questions): one stream at a time, then 32 at once: output tok/s;
- the gaps between consecutive streamed chunks of the 32-stream run: p50 / p99 (the split's figure).
Outputs of the two methods are compared text for text per request (greedy: they must be the same).
Servers alternate off / method, --rounds times (default 3); each figure is the median over the rounds, each speedup
the median of the rounds' paired ratios (one server per round and method; every round's values are kept).

    python bench/speculative.py --out bench/results/speculative.json
    python bench/speculative.py --cpu-class avx2 --out bench/results/speculative-avx2.json  # the AVX2 class
    python bench/speculative.py --model-extra 'decode_activations = "int8"'   # int8 decode and verify rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model, start_server  # noqa: E402
from cpu_class import CPU_CLASS_ENV, class_is_proxy, nodeserve_env  # noqa: E402
from build_llama import cpu_flags_line  # noqa: E402

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


def dedupe(items):
    """Return the items without repeats, first occurrence kept."""
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result
'''
PASSAGE = ("The Rhine rises in the Swiss Alps, flows through Lake Constance and forms part of the border between "
           "Germany and France before turning north through the Rhineland. It reaches the North Sea in the "
           "Netherlands after a course of about 1,230 kilometres, and it has been a major trade route since "
           "Roman times, carrying coal, grain and containers between Basel and Rotterdam.")
REPETITION = [
    "Rewrite this code, renaming the function `dedupe` to `unique`. Reply with the whole code only.\n\n" + CODE,
    "Add type hints to this code. Reply with the whole code only.\n\n" + CODE,
    'Extract every place name and number from this passage as JSON, like {"places": [...], "numbers": [...]}:\n\n'
    + PASSAGE,
    "Quote the sentence of this passage that says where the Rhine ends, word for word, then explain it.\n\n"
    + PASSAGE,
    "Fix the spelling mistakes in this paragraph and reply with the corrected paragraph only:\n\nThe Rhine rises "
    "in the Swiss Alpps, flows through Lake Constanse and forms part of the bordr between Germany and France "
    "before turning north through the Rhineland. It reaches the North Sea in the Netherlands.",
]
CHAT = ["What is the capital of France?", "Give me three tips for sleeping better.",
        "Write a haiku about autumn.", "Explain what a hash table is in two sentences.",
        "What causes the seasons on Earth?", "Name three famous painters and one work of each.",
        "How do I boil an egg?", "What is the difference between weather and climate?"]


async def one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, times, text, usage = time.monotonic(), [], [], None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                usage = msg["usage"]
            for c in msg.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    times.append(time.monotonic())
                    text.append(piece)
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"text": "".join(text), "tokens": tokens, "seconds": time.monotonic() - start,
            "decode_seconds": times[-1] - times[0] if len(times) > 1 else None,
            "gaps": [b - a for a, b in zip(times, times[1:])]}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def workload(url: str, max_tokens: int, repetition: list[str] = REPETITION) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await one(s, url, CHAT[0], 8)  # warm
        rep = [await one(s, url, p, max_tokens) for p in repetition]
        chat1 = [await one(s, url, p, 128) for p in CHAT]
        t0 = time.monotonic()
        chat32 = await asyncio.gather(*(one(s, url, CHAT[i % len(CHAT)] + f" (#{i})", 128) for i in range(32)))
        wall32 = time.monotonic() - t0
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    spec = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_") and "_per_pos" not in line and not line.startswith("#")}

    def rate(rs):  # output tokens a second, whole requests, one at a time
        return sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)

    gaps = [g for r in chat32 for g in r["gaps"]]
    return {"repetition": {"tok_s": rate(rep), "decode_tok_s": sum(r["tokens"] - 1 for r in rep) /
                           sum(r["decode_seconds"] for r in rep), "tokens": [r["tokens"] for r in rep]},
            "chat_1": {"tok_s": rate(chat1)},
            "chat_32": {"tok_s": sum(r["tokens"] for r in chat32) / wall32,
                        "gap_p50_ms": 1e3 * (pct(gaps, 0.5) or 0), "gap_p99_ms": 1e3 * (pct(gaps, 0.99) or 0)},
            "spec_counters": spec,
            "texts": [r["text"] for r in rep + chat1 + list(chat32)]}


def serve_workload(mode: str, tmp: str, log: str, max_tokens: int, extra: str = "", devices_extra: str = "",
                   env: dict[str, str] | None = None, model_extra: str = "",
                   repetition: list[str] = REPETITION) -> dict:
    """One server (bench/local_server.py: the default config plus these TOML lines) through workload(), then
    stopped."""
    proc, url = start_server(mode, "auto", tmp, log, extra=extra, devices_extra=devices_extra, env=env,
                             model_extra=model_extra)
    try:
        return asyncio.run(workload(url, max_tokens, repetition))
    finally:
        proc.terminate()
        proc.wait(60)


FIGURES = (("repetition", "tok_s"), ("repetition", "decode_tok_s"), ("chat_1", "tok_s"), ("chat_32", "tok_s"),
           ("chat_32", "gap_p50_ms"), ("chat_32", "gap_p99_ms"))
SPEEDUPS = {"repetition_1": ("repetition", "tok_s"), "repetition_1_decode": ("repetition", "decode_tok_s"),
            "chat_1": ("chat_1", "tok_s"), "chat_32": ("chat_32", "tok_s")}


def summarize(rounds: list[dict], methods: list[str], num_repetition: int = len(REPETITION)) -> dict:
    """Per method, each figure's median over the rounds (and every round's value); per compared method, each
    speedup as the median of the rounds' paired ratios (this machine's speed drifts by 10-20 % between minutes:
    a ratio within one round compares servers run back to back), and its outputs against off's, every round."""
    med = statistics.median
    out: dict = {}
    for method in ["off", *methods]:
        runs = [r[method] for r in rounds]
        row: dict = {"rounds": len(runs)}
        for part, key in FIGURES:
            row.setdefault(part, {})[key] = med(run[part][key] for run in runs)
            row[part][key + "_rounds"] = [run[part][key] for run in runs]
        row["repetition"]["tokens"] = runs[0]["repetition"]["tokens"]
        row["spec_counters"] = {k: sum(run["spec_counters"].get(k, 0.0) for run in runs)
                                for k in runs[0]["spec_counters"]}
        out[method] = row
    for method in methods:
        same = [a == b for r in rounds for a, b in zip(r["off"]["texts"], r[method]["texts"])]
        parts = ["repetition"] * num_repetition + ["chat_1"] * len(CHAT) + ["chat_32"] * 32  # workload's order
        differing = [{"round": i // len(parts), "part": parts[i % len(parts)], "index": i % len(parts)}
                     for i, ok in enumerate(same) if not ok]
        ratios = {name: [r[method][part][key] / r["off"][part][key] for r in rounds]
                  for name, (part, key) in SPEEDUPS.items()}
        out[method].update({"outputs_identical": sum(same), "outputs": len(same), "differing": differing,
                            "speedup": {name: med(v) for name, v in ratios.items()},
                            "speedup_rounds": ratios})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="bench/results/speculative.json")
    ap.add_argument("--methods", default="prompt_lookup", help="compared with off, e.g. prompt_lookup,draft")
    ap.add_argument("--draft-model", default="smollm2-135m-instruct", help="method draft's model")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), default=None,
                    help="servers forced to this CPU class's kernels (bench/cpu_class.py; a proxy on a larger CPU)")
    ap.add_argument("--rounds", type=int, default=3, help="off / method servers alternated this many times")
    ap.add_argument("--log-dir", default="", help="keep the servers' logs here (default: a temporary directory)")
    ap.add_argument("--model-extra", default="", help='more [model] lines for every server, off and on alike, '
                    'e.g. \'decode_activations = "int8"\'')
    ap.add_argument("--repetition", default="", help="a JSON file: a list of prompts to use as the repetition "
                    "workload instead of this script's (e.g. bench/prompts/repetition-unseen.json)")
    args = ap.parse_args()
    repetition = REPETITION
    if args.repetition:
        with open(args.repetition) as f:
            repetition = json.load(f)
    results: dict = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                                 "load_before": os.getloadavg()},
                     "command": " ".join(["python"] + sys.argv), "modes": {}}
    if args.cpu_class:
        results["cpu_class"] = {"class": args.cpu_class, "proxy": class_is_proxy(args.cpu_class, cpu_flags_line()),
                                "nodeserve_env": CPU_CLASS_ENV[args.cpu_class]}
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            rounds: list[dict] = []  # per round: {method: workload result}; servers alternate within a round
            for r in range(args.rounds):
                runs = {}
                for method in ["off", *methods]:
                    log = os.path.join(args.log_dir or tmp, f"{mode}-{method}-{r}.log")
                    runs[method] = serve_workload(mode, tmp, log, args.max_tokens,
                                                  extra=f'[speculative]\nmethod = "{method}"\n'
                                                        f'draft_model = "{args.draft_model}"\n',
                                                  env=nodeserve_env(args.cpu_class), model_extra=args.model_extra,
                                                  repetition=repetition)
                rounds.append(runs)
            results["modes"][mode] = summarize(rounds, methods, len(repetition))
            for method in methods:
                row = results["modes"][mode][method]
                print(mode, method, json.dumps(row["speedup"]), "gap p99 ms off/on:",
                      round(results["modes"][mode]["off"]["chat_32"]["gap_p99_ms"], 1),
                      round(row["chat_32"]["gap_p99_ms"], 1),
                      f"identical {row['outputs_identical']}/{row['outputs']}", "counters:", row["spec_counters"],
                      flush=True)
    results["machine"]["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
