"""KV-cache tiers benchmark: a chat working set larger than the device pools, a restart with the disk tier, a
prefix fetched from the other device, and identical concurrent prompts computed once. Real servers
(bench/local_server.py), streamed requests, the server's own counters from /metrics and /debug/kv.

    python bench/kv_tiers.py                                  # every part (about 11 min on a 2-core CPU)
    python bench/kv_tiers.py --quick                          # smaller chat (about 3 min)
    python bench/kv_tiers.py --parts chat --conversations 16 --turns 6 --concurrency 4
Parts (--parts chat,restart,cross,dedupe):
  chat     colocated cpu:0+cpu:1, N conversations x T turns (each turn resends the history, as a chat client does;
           answers are the model's greedy output), taken round-robin by C clients: users who think between turns,
           so every conversation stays live and the working set is all of them. Rows: big pool (run first: it
           measures the working set and the page size), no tier, host tier, host + disk; the small pools are
           sized to working set / --ratio pages.
  restart  a >= 1,000-token system prompt: question A, SIGTERM, restart on the same disk dir, question B; against
           question B on a fresh server without a disk tier.
  cross    max_num_seqs = 1, so a long request holding cpu:0's seat sends the next prompt to cpu:1, which fetches
           the prefix cpu:0 computed; against the same scene on a fresh server (cpu:1 computes it).
  dedupe   8 identical 1,000-token prompts at once on a fresh server.
Results: bench/results/kv_tiers/kv_tiers.json, kv_tiers.md, and one server-*.log per server started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_server as L  # noqa: E402
import local_server  # noqa: E402
import prefix as P  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kv_tiers")
PAGE = 16            # tokens per KV page (kv.page_size's default)
SMALL_GIB = 0.25     # pool per device for restart, cross and dedupe: room for their few requests


# ---- pure helpers (tests/bench/test_kv_tiers_bench.py) --------------------------------------------------

def counters(text: str) -> dict[str, dict[str, float]]:
    """{name without "nodeserve:": {its device or tier label ("" if neither): value}} from Prometheus text."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r"^nodeserve:(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        key = re.search(r'(?:device|tier)="([^"]*)"', labels)
        out.setdefault(name, {})[key.group(1) if key else ""] = float(value)
    return out


def working_set_pages(records: list[dict]) -> int:
    """KV pages of every conversation's whole history: its last turn's prompt and answer."""
    last: dict[int, dict] = {}
    for r in records:
        if r["conv"] not in last or r["turn"] > last[r["conv"]]["turn"]:
            last[r["conv"]] = r
    return sum(math.ceil((r["prompt_tokens"] + r["completion_tokens"]) / PAGE) for r in last.values())


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def check(value: float | None, limit: float, op: str = "<=") -> str:
    ok = value is not None and (value <= limit if op == "<=" else value >= limit)
    return f"{'PASS' if ok else 'FAIL'} ({'-' if value is None else f'{value:.3g}'} {op} {limit:g})"


# ---- servers and requests -----------------------------------------------------------------------------

def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


def scrape(url: str) -> dict[str, dict[str, float]]:
    return counters(get(url, "/metrics"))


@contextlib.contextmanager
def server(args, tmp: str, name: str, mode: str = "colocated", **kw):
    """A server with its own log, always stopped (SIGTERM, then SIGKILL after 30 s)."""
    log = os.path.join(args.out, f"server-{name}.log")
    proc, url = local_server.start_server(mode, args.dtype, tmp, log, **kw)
    try:
        yield proc, url
    finally:
        L.stop(proc)


async def stream(session, url: str, body: dict, first: asyncio.Event | None = None, timeout: float = 300) -> dict:
    """One streamed chat (body has "messages") or text completion, greedy: TTFT (client clock), text, usage.
    bench/serve.py's `send` keeps no text, which the chat history and the restart's comparison need; `first` is
    set when the first token arrives."""
    import aiohttp

    chat = "messages" in body
    body = {"temperature": 0.0, **body, "stream": True, "stream_options": {"include_usage": True}}
    times, parts, usage = [], [], {}
    t_send = time.perf_counter()
    async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if piece:
                    times.append(time.perf_counter())
                    parts.append(piece)
                    if first is not None:
                        first.set()
    m = S.request_metrics(t_send, times, time.perf_counter(), usage.get("completion_tokens"))
    return {"ttft": m["ttft"], "text": "".join(parts), "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def one(url: str, body: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        return await stream(s, url, body)


def ask(url: str, body: dict) -> dict:
    return asyncio.run(one(url, body))


# ---- chat -----------------------------------------------------------------------------------------------

async def run_chat(url: str, convs: list[dict], concurrency: int, max_tokens: int) -> list[dict]:
    """Round-robin: a client sends a conversation's next turn, then puts it at the back of the queue."""
    import aiohttp

    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(len(convs)):
        queue.put_nowait(c)
    untaken = sum(len(c["users"]) for c in convs)  # turns no client has taken yet: each is or will be queued
    history = [[{"role": "system", "content": c["system"]}] for c in convs]
    records: list[dict] = []

    async def client(session) -> None:
        nonlocal untaken
        while untaken > 0:  # a client waits for a conversation in flight rather than leave early
            untaken -= 1
            c = await queue.get()
            turn = (len(history[c]) - 1) // 2
            msgs = history[c] + [{"role": "user", "content": convs[c]["users"][turn]}]
            r = await stream(session, url, {"messages": msgs, "max_tokens": max_tokens})
            history[c] = msgs + [{"role": "assistant", "content": r["text"]}]
            records.append({**r, "conv": c, "turn": turn})
            if turn + 1 < len(convs[c]["users"]):
                queue.put_nowait(c)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return records


def chat_row(args, tmp: str, name: str, convs: list[dict], memory_gib: float, kv_extra: str) -> dict:
    with server(args, tmp, "chat-" + name.replace(" ", "").replace("+", "-"), kv_memory_gib=memory_gib,
                kv_extra=kv_extra) as (_, url):
        before, t = scrape(url), time.perf_counter()
        recs = asyncio.run(run_chat(url, convs, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t
        d, kv = P.delta(scrape(url), before), json.loads(get(url, "/debug/kv"))
    later = [r["ttft"] for r in recs if r["turn"] >= 1 and r["ttft"] is not None]
    row = {"memory_gib": memory_gib, "kv_extra": kv_extra, "pool_pages": kv["pools"][0]["num_pages"],
           "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
           "cached_tokens": sum(r["cached_tokens"] or 0 for r in recs),
           "computed": sum(d.get("prompt_tokens_computed_total", {}).values()),
           "own_pool_hits": sum(d.get("prefix_cache_hits_total", {}).values()),
           "tier_hits": d.get("kv_tier_hit_tokens_total", {}), "evictions": d.get("kv_tier_evictions_total", {}),
           "ttft_later": S.distribution(later), "wall_s": wall, "working_set_pages": working_set_pages(recs),
           "records": recs}
    print(f"chat {name:12} computed {row['computed']:.0f} of {row['prompt_tokens']}, later-turn TTFT p50 "
          f"{row['ttft_later']['p50']}, {wall:.0f} s", flush=True)
    return row


def part_chat(args, tmp: str) -> dict:
    convs = []
    for c in range(args.conversations):
        rng = random.Random(f"kv-tiers-chat-{c}")
        convs.append({"system": W.make_prompt(rng, args.system_words, "text"),
                      "users": [W.make_prompt(rng, rng.randint(40, 80), "text") for _ in range(args.turns)]})
    rows = {"big pool": chat_row(args, tmp, "big pool", convs, args.big_pool_gib, "host_memory_gib = 0")}
    big = rows["big pool"]
    # A pool's bytes over its pages is one page's bytes (within a page of rounding); the small pools hold
    # working set / ratio pages, but always one whole request (the largest history) and a little room.
    page_bytes = args.big_pool_gib * 2**30 / big["pool_pages"]
    ws = big["working_set_pages"]
    longest = max(math.ceil((r["prompt_tokens"] + args.max_tokens) / PAGE) for r in big["records"])
    small = round((max(ws // args.ratio, longest + 4) + 0.5) * page_bytes / 2**30, 6)
    host_all = round(2 * ws * page_bytes / 2**30, 3)        # twice: old turns' last pages are extra pages
    host_third = round(ws / 3 * page_bytes / 2**30, 3)
    disk_dir = tempfile.mkdtemp(prefix="kv_tiers_disk_", dir=tmp)
    for name, extra in (("no tier", "host_memory_gib = 0"), ("host tier", f"host_memory_gib = {host_all}"),
                        ("host + disk", f'host_memory_gib = {host_third}\ndisk_path = "{disk_dir}"\ndisk_gib = 2')):
        rows[name] = chat_row(args, tmp, name, convs, small, extra)
    rows = {k: rows[k] for k in ("no tier", "host tier", "host + disk", "big pool")}
    for r in rows.values():
        r["computed_vs_big"] = ratio(r["computed"], big["computed"])
        r["p50_vs_big"] = ratio(r["ttft_later"]["p50"], big["ttft_later"]["p50"])
    host, none = rows["host tier"], rows["no tier"]
    return {"page_bytes": page_bytes, "working_set_pages": ws, "ratio": ws / none["pool_pages"], "rows": rows,
            "targets": {"host tier computed <= 1.25x big pool": check(host["computed_vs_big"], 1.25),
                        "host tier later-turn TTFT p50 <= 1.5x big pool": check(host["p50_vs_big"], 1.5),
                        "host tier later-turn TTFT p50 <= 0.5x no tier":
                            check(ratio(host["ttft_later"]["p50"], none["ttft_later"]["p50"]), 0.5),
                        "working set >= 5x one device pool": check(ws / none["pool_pages"], 5, ">=")}}


# ---- restart, cross, dedupe -------------------------------------------------------------------------------

WARMUP = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def part_restart(args, tmp: str) -> dict:
    system = W.make_prompt(random.Random("kv-tiers-restart"), args.prefix_words, "text")
    q = {k: {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
             "max_tokens": 32} for k, text in (("A", "Which word comes up most often above?"),
                                               ("B", "Summarize the text above in one sentence."))}
    disk = tempfile.mkdtemp(prefix="kv_tiers_restart_", dir=tmp)
    tiered = f'host_memory_gib = 0.5\ndisk_path = "{disk}"\ndisk_gib = 2'
    out: dict = {}
    # Cold: a fresh server with no disk tier. Each server gets the same unrelated warm-up first, so neither
    # measured request pays a first request's one-time costs.
    with server(args, tmp, "restart-cold", kv_memory_gib=SMALL_GIB, kv_extra="host_memory_gib = 0.5") as (_, url):
        ask(url, WARMUP)
        out["cold"] = ask(url, q["B"])
    with server(args, tmp, "restart-1", kv_memory_gib=SMALL_GIB, kv_extra=tiered) as (proc, url):
        ask(url, WARMUP)
        out["first"] = ask(url, q["A"])
        proc.send_signal(signal.SIGTERM)  # a clean stop writes the pages still on the devices to disk
        proc.wait(timeout=120)
    out["files_after_stop"] = len(os.listdir(disk))
    with server(args, tmp, "restart-2", kv_memory_gib=SMALL_GIB, kv_extra=tiered) as (_, url):
        ask(url, WARMUP)
        before = scrape(url)
        out["restart"] = r = ask(url, q["B"])
        out["disk_hit_tokens"] = P.delta(scrape(url), before).get("kv_tier_hit_tokens_total", {}).get("disk")
        out["scan_log"] = [ln.strip() for ln in open(os.path.join(args.out, "server-restart-2.log"))
                           if "KV disk tier" in ln]
    out["stop_log"] = [ln.strip() for ln in open(os.path.join(args.out, "server-restart-1.log"))
                       if "KV disk tier" in ln]
    out["targets"] = {"cached_tokens >= 1000": check(r["cached_tokens"], 1000, ">="),
                      "TTFT <= 1/3 cold": check(ratio(r["ttft"], out["cold"]["ttft"]), 1 / 3),
                      "greedy text identical to cold": "PASS" if r["text"] == out["cold"]["text"] else "FAIL"}
    return out


async def cross_scene(url: str, hold: list[int], prompt: list[int], seed: dict | None) -> dict:
    """`seed` (if given) computes the prefix first; a request on `hold` then takes cpu:0's only seat (it lands
    where its prefix is, or on the first device); once it streams, `prompt` must go to cpu:1."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        if seed is not None:
            await stream(s, url, seed)
        first = asyncio.Event()
        holder = asyncio.create_task(stream(s, url, {"prompt": hold, "max_tokens": 2000, "ignore_eos": True},
                                            first))
        await asyncio.wait_for(first.wait(), 120)
        before = scrape(url)
        r = await stream(s, url, {"prompt": prompt, "max_tokens": 8})
        d = P.delta(scrape(url), before)
        holder.cancel()  # the disconnect aborts it
        with contextlib.suppress(asyncio.CancelledError):
            await holder
    return {**r, "device_hit_tokens": d.get("kv_tier_hit_tokens_total", {}).get("device"),
            "computed_by_device": d.get("prompt_tokens_computed_total", {})}


def part_cross(args, tmp: str) -> dict:
    rng = random.Random("kv-tiers-cross")
    prefix, q1, q2, q3 = (W.make_prompt(rng, n) for n in (args.cross_tokens, 40, 40, 40))
    kw = dict(kv_memory_gib=SMALL_GIB, kv_extra="host_memory_gib = 0", extra="[scheduler]\nmax_num_seqs = 1\n")
    with server(args, tmp, "cross-fetch", **kw) as (_, url):
        fetch = asyncio.run(cross_scene(url, prefix + q3, prefix + q2, {"prompt": prefix + q1, "max_tokens": 8}))
    with server(args, tmp, "cross-recompute", **kw) as (_, url):
        other = W.make_prompt(rng, args.cross_tokens + 40)  # the same load on cpu:0, nothing to share
        recompute = asyncio.run(cross_scene(url, other, prefix + q2, None))
    return {"fetch": fetch, "recompute": recompute,
            "targets": {"device-tier hit tokens > 0": "PASS" if (fetch["device_hit_tokens"] or 0) > 0 else "FAIL",
                        "TTFT <= 1/2 recompute": check(ratio(fetch["ttft"], recompute["ttft"]), 0.5)}}


def part_dedupe(args, tmp: str) -> dict:
    prompt = W.make_prompt(random.Random("kv-tiers-dedupe"), args.dedupe_tokens)
    reqs = [W.Request(prompt, len(prompt), 8, "dedupe") for _ in range(args.dedupe_requests)]
    with server(args, tmp, "dedupe", kv_memory_gib=SMALL_GIB) as (_, url):
        ask(url, WARMUP)
        before = scrape(url)
        m = serve.measure(url, serve.default_model(url, {}), reqs, "burst", None, None, 0, progress=False,
                          timeout=300)
        d, kv = P.delta(scrape(url), before), json.loads(get(url, "/debug/kv"))
    recs = m["records"]
    computed = sum(d.get("prompt_tokens_computed_total", {}).values())
    return {"requests": len(reqs), "succeeded": sum(r["ok"] for r in recs), "prompt_tokens": len(prompt),
            "computed": computed, "computed_per_prompt": computed / len(prompt),
            "without_dedupe": len(reqs) * len(prompt), "num_prefix_waits": kv["num_prefix_waits"],
            "tier_hits": d.get("kv_tier_hit_tokens_total", {}), "cached_tokens": [r["cached_tokens"] for r in recs],
            "ttft": S.distribution([r["ttft"] for r in recs if r["ttft"] is not None]),
            "targets": {"computed / one prompt <= 1.5": check(computed / len(prompt), 1.5)}}


# ---- report ---------------------------------------------------------------------------------------------

def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(res: dict) -> str:
    m = res["machine"]
    out = [f"# KV tiers benchmark\n\n`{res['command']}`\n\nMachine: {m['cpu_model']}, {m['logical_cpus']} logical "
           f"CPUs, {m.get('mem_total_gib')} GiB; server dtype {res['dtype']}; {res['date']}; total wall time "
           f"{res['wall_s']:.0f} s.\n"]
    if "chat" in res:
        c = res["chat"]
        out.append(f"## chat: {args_line(res, 'conversations', 'turns', 'concurrency', 'max_tokens')}\n\nWorking "
                   f"set {c['working_set_pages']} pages ({c['working_set_pages'] * c['page_bytes'] / 2**20:.0f} "
                   f"MiB) = {c['ratio']:.1f}x one device pool of {c['rows']['no tier']['pool_pages']} pages.\n\n"
                   "| row | pool pages | kv extra | prompt tokens | computed | computed / big pool | later-turn TTFT "
                   "p50 / p99 (ms) | p50 / big pool | hit tokens own pool / device / host / disk | wall (s) |\n"
                   + "|---" * 10 + "|")
        for name, r in c["rows"].items():
            h = r["tier_hits"]
            hits = " / ".join(f"{v:.0f}" for v in (r["own_pool_hits"], *(h.get(t, 0) for t in ("device", "host",
                                                                                              "disk"))))
            out.append(f"| {name} | {r['pool_pages']} | {kv_label(r['kv_extra'])} | {r['prompt_tokens']:,} | "
                       f"{r['computed']:,.0f} | {x(r['computed_vs_big'])} | {ms(r['ttft_later']['p50'])} / "
                       f"{ms(r['ttft_later']['p99'])} | {x(r['p50_vs_big'])} | {hits} | {r['wall_s']:.0f} |")
        out.append(targets(c))
    if "restart" in res:
        r = res["restart"]
        out.append("## restart\n\n| run | prompt tokens | cached tokens | TTFT (ms) | text |\n|---|---|---|---|---|")
        for k in ("cold", "first", "restart"):
            v = r[k]
            out.append(f"| {k} | {v['prompt_tokens']} | {v['cached_tokens']} | {ms(v['ttft'])} | {v['text']!r} |")
        out.append(f"\nDisk hit tokens after the restart: {r['disk_hit_tokens']}; files after the stop: "
                   f"{r['files_after_stop']}.\n\nLog at the stop: {r['stop_log']}\n\nLog at the restart: "
                   f"{r['scan_log']}\n" + targets(r))
    if "cross" in res:
        c = res["cross"]
        out.append("## cross\n\n| server | cached tokens | device-tier hit tokens | TTFT (ms) | prefilled on |\n"
                   "|---|---|---|---|---|")
        for k in ("fetch", "recompute"):
            v = c[k]
            on = ", ".join(f"{d}: {n:.0f}" for d, n in v["computed_by_device"].items() if n)
            out.append(f"| {k} | {v['cached_tokens']} | {v['device_hit_tokens']} | {ms(v['ttft'])} | {on} |")
        out.append(targets(c))
    if "dedupe" in res:
        d = res["dedupe"]
        out.append("## dedupe\n\n| requests | prompt tokens each | computed | computed / one prompt | without "
                   "dedupe | num_prefix_waits | tier hit tokens | TTFT p50 / max (ms) |\n" + "|---" * 8 + "|\n"
                   f"| {d['succeeded']}/{d['requests']} | {d['prompt_tokens']} | {d['computed']:.0f} | "
                   f"{d['computed_per_prompt']:.2f} | {d['without_dedupe']} (8.00) | {d['num_prefix_waits']} | "
                   f"{d['tier_hits']} | {ms(d['ttft']['p50'])} / {ms(d['ttft']['max'])} |")
        out.append(targets(d))
    out.append("## server logs\n\n" + "\n".join(f"- {k}: {v}" for k, v in res["logs"].items()))
    return "\n".join(out) + "\n"


def kv_label(kv_extra: str) -> str:
    return "; ".join("disk_path = (temp dir)" if ln.startswith("disk_path") else ln for ln in kv_extra.splitlines())


def args_line(res: dict, *keys: str) -> str:
    return ", ".join(f"{k} {res['args'][k]}" for k in keys)


def targets(part: dict) -> str:
    return "\n" + "\n".join(f"- {k}: **{v}**" for k, v in part["targets"].items()) + "\n"


def log_findings(out_dir: str) -> dict:
    """Per server log: its ERROR / Traceback lines (the first three), or "clean"."""
    found = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("server-") and name.endswith(".log"):
            bad = [ln.strip()[:200] for ln in open(os.path.join(out_dir, name), errors="replace")
                   if "ERROR" in ln or "Traceback" in ln]
            found[name] = f"{len(bad)} ERROR/Traceback lines: {bad[:3]}" if bad else "clean"
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="chat,restart,cross,dedupe")
    ap.add_argument("--quick", action="store_true", help="8 conversations x 4 turns, shorter system prompts")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300, help="each conversation's system prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ratio", type=int, default=6, help="chat: working set / one small pool, in pages")
    ap.add_argument("--big-pool-gib", type=float, default=2.0)
    ap.add_argument("--prefix-words", type=int, default=1100, help="restart: the system prompt (~1 token a word)")
    ap.add_argument("--cross-tokens", type=int, default=1500)
    ap.add_argument("--dedupe-tokens", type=int, default=1000)
    ap.add_argument("--dedupe-requests", type=int, default=8)
    ap.add_argument("--dtype", default="auto", help="[model] dtype (auto: the server's default)")
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_words = 8, 4, 200
    parts = args.parts.split(",")
    if not set(parts) <= {"chat", "restart", "cross", "dedupe"}:
        ap.error(f"unknown part in --parts {args.parts}")
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):  # this run's logs only
        if name.startswith("server-") and name.endswith(".log"):
            os.remove(os.path.join(args.out, name))
    res: dict = {"command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]), "machine": serve.machine(),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kv_tiers_") as tmp:
        for part in parts:
            t = time.perf_counter()
            res[part] = globals()[f"part_{part}"](args, tmp)
            res[part]["wall_s"] = time.perf_counter() - t
            print(f"{part}: {res[part]['targets']} ({res[part]['wall_s']:.0f} s)", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    res["logs"] = log_findings(args.out)
    first_log = os.path.join(args.out, sorted(n for n in os.listdir(args.out) if n.startswith("server-"))[0])
    res["dtype"] = next((m.group(1) for m in map(re.compile(r"dtype=(\S+)").search, open(first_log)) if m), "?")
    with open(os.path.join(args.out, "kv_tiers.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "kv_tiers.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
