"""KV-cache tiers benchmark on real servers (bench/local_server.py, colocated cpu:0+cpu:1): streamed requests, the
server's own counters (/metrics, /debug/kv). Results: bench/results/kv_tiers/kv_tiers.json, kv_tiers.md, server-*.log.

    python bench/kv_tiers.py                  # every part: about 5 min on a 2-core CPU
    python bench/kv_tiers.py --quick          # chat of 3 turns with shorter system prompts: about 2.5 min
    python bench/kv_tiers.py --parts chat --conversations 16 --turns 6 --concurrency 4

chat     N conversations x T turns, each resending its whole history (answers: the model's greedy output), taken
         round-robin by C clients (users thinking between turns: every conversation stays live). Rows: big pool (run
         first: it measures the working set and the page size), then no tier, host tier, host + disk on pools of
         working set / RATIO pages.
restart  a >= 1,000-token system prompt: question A, SIGTERM, restart on the same disk dir, question B; against B on
         a fresh server without a disk tier.
cross    max_num_seqs = 1: a long request holding cpu:0's only seat sends the next prompt to cpu:1, which fetches the
         prefix cpu:0 computed; against the same scene on a fresh server, where cpu:1 computes it.
dedupe   8 identical 1,000-token prompts at once on a fresh server.
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
from outputs import out_path  # noqa: E402
import llama_server as L  # noqa: E402
import local_server  # noqa: E402
import prefix as P  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402

OUT_DIR = out_path("kv_tiers")
PAGE = 16            # tokens per KV page (kv.page_size's default)
SMALL_GIB = 0.25     # pool per device for restart, cross and dedupe: room for their few requests
RATIO, BIG_GIB = 6, 2.0   # chat: working set / one small pool (pages); the big pool per device
PREFIX_WORDS, CROSS_TOKENS, DEDUPE_TOKENS, DEDUPE_REQUESTS = 1100, 1500, 1000, 8  # ~1 token a word
WARMUP = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


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
    num = lambda v: "-" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"  # noqa: E731
    return f"{'PASS' if ok else 'FAIL'} ({num(value)} {op} {num(limit)})"


# ---- servers and requests -----------------------------------------------------------------------------

def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


def scrape(url: str) -> dict[str, dict[str, float]]:
    return counters(get(url, "/metrics"))


@contextlib.contextmanager
def server(args, tmp: str, name: str, **kw):
    """A colocated cpu:0+cpu:1 server with its own log, always stopped (SIGTERM, SIGKILL after 30 s)."""
    proc, url = local_server.start_server("colocated", "auto", tmp, os.path.join(args.out, f"server-{name}.log"),
                                          **kw)
    try:
        yield proc, url
    finally:
        L.stop(proc)


async def stream(url: str, body: dict, first: asyncio.Event | None = None, session=None, timeout: float = 300) -> dict:
    """One streamed chat (body has "messages") or text completion, greedy: TTFT (client clock), text, usage.
    bench/serve.py's `send` keeps no text, which the chat history and the restart's comparison need; `first` is
    set when the first token arrives."""
    import aiohttp

    if session is None:
        async with aiohttp.ClientSession() as s:
            return await stream(url, body, first, s, timeout)
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


def ask(url: str, body: dict) -> dict:
    return asyncio.run(stream(url, body))


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
        while untaken > 0:  # wait for a conversation in flight rather than leave early
            untaken -= 1
            c = await queue.get()
            turn = (len(history[c]) - 1) // 2
            msgs = history[c] + [{"role": "user", "content": convs[c]["users"][turn]}]
            r = await stream(url, {"messages": msgs, "max_tokens": max_tokens}, session=session)
            history[c] = msgs + [{"role": "assistant", "content": r["text"]}]
            records.append({**r, "conv": c, "turn": turn})
            if turn + 1 < len(convs[c]["users"]):
                queue.put_nowait(c)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return records


def chat_row(args, tmp: str, name: str, convs: list[dict], memory_gib: float, kv_extra: str) -> dict:
    log = "chat-" + re.sub(r"\W+", "-", name)
    with server(args, tmp, log, kv_memory_gib=memory_gib, kv_extra=kv_extra) as (_, url):
        before, t = scrape(url), time.perf_counter()
        recs = asyncio.run(run_chat(url, convs, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t
        d, kv = P.delta(scrape(url), before), json.loads(get(url, "/debug/kv"))
    row = {"memory_gib": memory_gib, "kv_extra": kv_extra, "pool_pages": kv["pools"][0]["num_pages"],
           "prompt_tokens": sum(r["prompt_tokens"] for r in recs), "wall_s": wall,
           "cached_tokens": sum(r["cached_tokens"] or 0 for r in recs),
           "computed": sum(d.get("prompt_tokens_computed_total", {}).values()),
           "own_pool_hits": sum(d.get("prefix_cache_hits_total", {}).values()),
           "tier_hits": d.get("kv_tier_hit_tokens_total", {}), "evictions": d.get("kv_tier_evictions_total", {}),
           "loaded_pages": d.get("kv_tier_loaded_pages_total", {}), "load_s": d.get("kv_tier_load_seconds_total", {}),
           # time placed requests waited for pages and seats: a small pool also admits fewer requests at once
           "queue_s_mean": ratio(d.get("request_queue_time_seconds_sum", {}).get(""),
                                 d.get("request_queue_time_seconds_count", {}).get("")),
           "ttft_later": S.distribution([r["ttft"] for r in recs if r["turn"] >= 1 and r["ttft"] is not None]),
           "working_set_pages": working_set_pages(recs), "records": recs}
    print(f"chat {name:12} computed {row['computed']:.0f} of {row['prompt_tokens']}, later-turn TTFT p50 "
          f"{row['ttft_later']['p50']:.3f} s, {wall:.0f} s", flush=True)
    return row


def part_chat(args, tmp: str) -> dict:
    convs = []
    for c in range(args.conversations):
        rng = random.Random(f"kv-tiers-chat-{c}")
        convs.append({"system": W.make_prompt(rng, args.system_words, "text"),
                      "users": [W.make_prompt(rng, rng.randint(40, 80), "text") for _ in range(args.turns)]})
    big = chat_row(args, tmp, "big pool", convs, BIG_GIB, "host_memory_gib = 0")
    # A pool's bytes over its pages is one page's bytes (to within a page in thousands). The small pools hold
    # working set / ratio pages, but at least each device's share of the clients' longest requests: fewer seats
    # than clients would make requests queue for pages, a cost of the pool's size and not of the tier.
    page_bytes = BIG_GIB * 2**30 / big["pool_pages"]
    ws = big["working_set_pages"]
    longest = max(math.ceil((r["prompt_tokens"] + args.max_tokens) / PAGE) for r in big["records"])
    pool = max(ws // RATIO, math.ceil(args.concurrency / 2) * longest + 2)
    small = round((pool + 0.5) * page_bytes / 2**30, 6)
    gib = lambda pages: round(pages * page_bytes / 2**30, 3)  # noqa: E731
    disk_dir = tempfile.mkdtemp(prefix="kv_tiers_disk_", dir=tmp)
    # Host tier: twice the working set (each turn's last partial page and answer are pages of their own).
    rows = {name: chat_row(args, tmp, name, convs, small, extra) for name, extra in (
        ("no tier", "host_memory_gib = 0"), ("host tier", f"host_memory_gib = {gib(2 * ws)}"),
        ("host + disk", f'host_memory_gib = {gib(ws / 3)}\ndisk_path = "{disk_dir}"\ndisk_gib = 2'))}
    rows["big pool"] = big
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

def part_restart(args, tmp: str) -> dict:
    system = W.make_prompt(random.Random("kv-tiers-restart"), PREFIX_WORDS, "text")
    q = {k: {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
             "max_tokens": 32} for k, text in (("A", "Which word comes up most often above?"),
                                               ("B", "Summarize the text above in one sentence."))}
    disk = tempfile.mkdtemp(prefix="kv_tiers_restart_", dir=tmp)
    tiered = f'host_memory_gib = 0.5\ndisk_path = "{disk}"\ndisk_gib = 2'
    logs = {k: os.path.join(args.out, f"server-restart-{k}.log") for k in ("1", "2")}
    out: dict = {}
    # Each fresh server gets the same unrelated warm-up first: no measured request pays first-request costs.
    with server(args, tmp, "restart-cold", kv_memory_gib=SMALL_GIB, kv_extra="host_memory_gib = 0.5") as (_, url):
        ask(url, WARMUP)
        out["cold"] = ask(url, q["B"])
    with server(args, tmp, "restart-1", kv_memory_gib=SMALL_GIB, kv_extra=tiered) as (proc, url):
        ask(url, WARMUP)
        out["first"] = ask(url, q["A"])
        proc.send_signal(signal.SIGTERM)  # a clean stop writes the pages still on the devices to disk
        proc.wait(timeout=120)
    out["files_after_stop"] = sum(len(files) for _, _, files in os.walk(disk))
    with server(args, tmp, "restart-2", kv_memory_gib=SMALL_GIB, kv_extra=tiered) as (_, url):
        ask(url, WARMUP)
        before = scrape(url)
        out["restart"] = r = ask(url, q["B"])
        d = P.delta(scrape(url), before)
    out["disk_hit_tokens"] = d.get("kv_tier_hit_tokens_total", {}).get("disk")
    out["disk_load_s"] = d.get("kv_tier_load_seconds_total", {}).get("disk")
    out["log"] = [ln.strip() for k in ("1", "2") for ln in open(logs[k]) if "KV disk tier" in ln]
    out["targets"] = {"cached_tokens >= 1000": check(r["cached_tokens"], 1000, ">="),
                      "TTFT <= 1/3 cold": check(ratio(r["ttft"], out["cold"]["ttft"]), 1 / 3),
                      "greedy text identical to cold": "PASS" if r["text"] == out["cold"]["text"] else "FAIL"}
    return out


async def cross_scene(url: str, hold: list[int], prompt: list[int], seed: dict | None) -> dict:
    """`seed` (if given) computes the prefix first; a request on `hold` then takes cpu:0's only seat (it lands
    where its prefix is, or on the first device); once it streams, `prompt` can only go to cpu:1."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        if seed is not None:
            await stream(url, seed, session=s)
        first = asyncio.Event()
        holder = asyncio.create_task(stream(url, {"prompt": hold, "max_tokens": 2000, "ignore_eos": True}, first, s))
        await asyncio.wait_for(first.wait(), 120)
        before = scrape(url)
        r = await stream(url, {"prompt": prompt, "max_tokens": 8}, session=s)
        d = P.delta(scrape(url), before)
        holder.cancel()  # the disconnect aborts it
        with contextlib.suppress(asyncio.CancelledError):
            await holder
    return {**r, "device_hit_tokens": d.get("kv_tier_hit_tokens_total", {}).get("device"),
            "computed_by_device": d.get("prompt_tokens_computed_total", {})}


def part_cross(args, tmp: str) -> dict:
    rng = random.Random("kv-tiers-cross")
    prefix, q1, q2, q3 = (W.make_prompt(rng, n) for n in (CROSS_TOKENS, 40, 40, 40))
    kw = dict(kv_memory_gib=SMALL_GIB, kv_extra="host_memory_gib = 0", extra="[scheduler]\nmax_num_seqs = 1\n")
    with server(args, tmp, "cross-fetch", **kw) as (_, url):
        fetch = asyncio.run(cross_scene(url, prefix + q3, prefix + q2, {"prompt": prefix + q1, "max_tokens": 8}))
    with server(args, tmp, "cross-recompute", **kw) as (_, url):
        other = W.make_prompt(rng, CROSS_TOKENS + 40)  # the same load on cpu:0, nothing to share
        recompute = asyncio.run(cross_scene(url, other, prefix + q2, None))
    return {"fetch": fetch, "recompute": recompute,
            "targets": {"device-tier hit tokens > 0": "PASS" if (fetch["device_hit_tokens"] or 0) > 0 else "FAIL",
                        "TTFT <= 1/2 recompute": check(ratio(fetch["ttft"], recompute["ttft"]), 0.5)}}


def part_dedupe(args, tmp: str) -> dict:
    prompt = W.make_prompt(random.Random("kv-tiers-dedupe"), DEDUPE_TOKENS)
    reqs = [W.Request(prompt, len(prompt), 8, "dedupe") for _ in range(DEDUPE_REQUESTS)]
    with server(args, tmp, "dedupe", kv_memory_gib=SMALL_GIB) as (_, url):
        ask(url, WARMUP)
        before = scrape(url)
        m = serve.measure(url, serve.default_model(url, {}), reqs, "burst", None, None, 0, progress=False,
                          timeout=300)
        d, kv = P.delta(scrape(url), before), json.loads(get(url, "/debug/kv"))
    recs, computed = m["records"], sum(d.get("prompt_tokens_computed_total", {}).values())
    return {"requests": len(reqs), "succeeded": sum(r["ok"] for r in recs), "prompt_tokens": len(prompt),
            "computed": computed, "computed_per_prompt": computed / len(prompt),
            "computed_by_device": d.get("prompt_tokens_computed_total", {}),
            "without_dedupe": len(reqs) * len(prompt), "num_prefix_waits": kv["num_prefix_waits"],
            "tier_hits": d.get("kv_tier_hit_tokens_total", {}), "cached_tokens": [r["cached_tokens"] for r in recs],
            "ttft": S.distribution([r["ttft"] for r in recs if r["ttft"] is not None]),
            "targets": {"computed / one prompt <= 1.5": check(computed / len(prompt), 1.5)}}


# ---- report ---------------------------------------------------------------------------------------------

def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def table(head: list[str], rows: list[list]) -> str:
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in [head, ["---"] * len(head), *rows])


def markdown(res: dict) -> str:
    m = res["machine"]
    out = [f"# KV tiers benchmark\n\n`{res['command']}`\n\nMachine: {m['cpu_model']}, {m['logical_cpus']} logical "
           f"CPUs, {m.get('mem_total_gib')} GiB RAM; server dtype {res['dtype']}; {res['date']}; total wall time "
           f"{res['wall_s']:.0f} s."]
    if "chat" in res:
        c, a = res["chat"], res["args"]
        rows = []
        for name, r in c["rows"].items():
            hits = " / ".join(f"{v:.0f}" for v in (r["own_pool_hits"], *(r["tier_hits"].get(t, 0)
                                                                         for t in ("device", "host", "disk"))))
            kv = "; ".join("disk_path = (temp dir)" if s.startswith("disk_path") else s
                           for s in r["kv_extra"].splitlines())
            rows.append([name, r["pool_pages"], kv, f"{r['prompt_tokens']:,}", f"{r['computed']:,.0f}",
                         f"{r['computed_vs_big']:.2f}x", f"{ms(r['ttft_later']['p50'])} / {ms(r['ttft_later']['p99'])}",
                         f"{r['p50_vs_big']:.2f}x", hits, ms(r["queue_s_mean"]), f"{r['wall_s']:.0f}"])
        out += [f"## chat: {a['conversations']} conversations x {a['turns']} turns, {a['concurrency']} clients, "
                f"max_tokens {a['max_tokens']}\n\nWorking set {c['working_set_pages']} pages "
                f"({c['working_set_pages'] * c['page_bytes'] / 2**20:.0f} MiB) = **{c['ratio']:.1f}x** one device "
                f"pool ({c['rows']['no tier']['pool_pages']} pages). Mean queue: the server's request_queue_time "
                f"(waiting for pages and seats).",
                table(["row", "pool pages", "[kv]", "prompt tokens", "computed", "computed / big pool",
                       "turns 2+ TTFT p50 / p99 (ms)", "p50 / big pool", "hit tokens own pool / device / host / disk",
                       "mean queue (ms)", "wall (s)"], rows), targets(c)]
    if "restart" in res:
        r = res["restart"]
        out += ["## restart\n\ncold: a fresh server without a disk tier (host tier 0.5 GiB like the others); every "
                "server first answers the same short warm-up.",
                table(["run", "prompt tokens", "cached tokens", "TTFT (ms)", "text"],
                      [[k, r[k]["prompt_tokens"], r[k]["cached_tokens"], ms(r[k]["ttft"]), repr(r[k]["text"])]
                       for k in ("cold", "first", "restart")]),
                f"After the restart: {r['disk_hit_tokens']:.0f} tokens from disk, loader time {ms(r['disk_load_s'])} "
                f"ms; {r['files_after_stop']} files after the stop. Disk tier log lines (server 1's start and stop, "
                f"the restarted server's start and stop):\n\n"
                + "\n".join(f"    {ln}" for ln in r["log"]), targets(r)]
    if "cross" in res:
        c = res["cross"]
        out += ["## cross", table(["server", "cached tokens", "device-tier hit tokens", "TTFT (ms)", "prefilled"],
                                    [[k, c[k]["cached_tokens"], f"{c[k]['device_hit_tokens']:.0f}", ms(c[k]["ttft"]),
                                      ", ".join(f"{d}: {n:.0f}" for d, n in c[k]["computed_by_device"].items() if n)]
                                     for k in ("fetch", "recompute")]), targets(c)]
    if "dedupe" in res:
        d = res["dedupe"]
        out += ["## dedupe", table(
            ["requests", "prompt tokens each", "computed (by device)", "computed / one prompt", "without dedupe",
             "num_prefix_waits", "TTFT p50 / max (ms)"],
            [[f"{d['succeeded']}/{d['requests']}", d["prompt_tokens"], f"{d['computed']:.0f} "
              f"({', '.join(f'{k}: {v:.0f}' for k, v in d['computed_by_device'].items())})",
              f"{d['computed_per_prompt']:.2f}", f"{d['without_dedupe']} ({d['requests']:.2f}x)", d["num_prefix_waits"],
              f"{ms(d['ttft']['p50'])} / {ms(d['ttft']['max'])}"]]), targets(d)]
    out.append("## server logs: ERROR / Traceback lines\n\n" + "\n".join(f"- {k}: {v}" for k, v in res["logs"].items()))
    return "\n\n".join(out) + "\n"


def targets(part: dict) -> str:
    return "\n".join(f"- {k}: **{v}**" for k, v in part["targets"].items())


def log_findings(out_dir: str) -> dict:
    found = {}
    for name in sorted(n for n in os.listdir(out_dir) if n.startswith("server-") and n.endswith(".log")):
        bad = [ln.strip()[:200] for ln in open(os.path.join(out_dir, name), errors="replace")
               if "ERROR" in ln or "Traceback" in ln]
        found[name] = f"{len(bad)}: {bad[:3]}" if bad else "none"
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="chat,restart,cross,dedupe")
    ap.add_argument("--quick", action="store_true", help="chat: 3 turns, 150-word system prompts")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300, help="each conversation's system prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()
    if args.quick:
        args.turns, args.system_words = 3, 150
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
    first_log = os.path.join(args.out, next(iter(res["logs"])))
    res["dtype"] = next((m.group(1) for m in map(re.compile(r" dtype=(\S+)").search, open(first_log)) if m), "?")
    with open(os.path.join(args.out, "kv_tiers.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "kv_tiers.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
