"""Hostile-input fuzz: a real server fed hostile JSON schemas, huge tool lists and adversarial tool outputs for
`--duration` seconds, while a prober times /health every 50 ms. Pass: no 5xx, /health never stalled past 200 ms,
RSS flat after the warm-up (and after the host KV tier has filled: its slots take memory as first written), no KV
page leaked.

What the clients send (random, seeded; `--concurrency` at once):
- response_format json_schema with a generated schema: huge enums, deep nesting, hundreds of optional
  properties, big minItems / maxLength counts, pathological regex `pattern`s, `$ref` recursion, anyOf of many
  branches; some past the server's limits (64 KiB of schema, counts over 1,024, patterns over 512 characters)
  or invalid (a 400 is the right answer there);
- tools: 1 to 128 functions whose parameters come from the same generator, tool_choice "required", named or
  auto;
- conversations holding tool results meant to hurt a parser: long whitespace runs, thousands of `<tool_call>`
  tags, unbalanced braces and quotes, control characters and astral-plane text, megabyte strings (past the
  context: 400);
- about a tenth of the clients give up mid-request (the compile keeps running; its result is cached).

Expected statuses are 200 and 400 (413 for bodies past the size limit); anything else, a 5xx, an error event in
a stream or a connection error fails the run. /health is probed from a process of its own (so this client's GIL
never delays a probe) on its own connection; its latency is what a load balancer or systemd's watchdog sees when
something holds the event loop. The server's own account of its loop comes from /metrics
(`event_loop_stalls_total` by cause: busy, starved, blocked, unseen, gc; server/loop_monitor.py) and its log's
stall lines, which carry the loop's stack.

    python bench/hostile.py --duration 600 --host-memory-gib 0.2 --out bench/results/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import platform
import random
import shlex
import string
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
from local_server import cpu_model, start_server  # noqa: E402  (bench/ is scripts, not a package)
from soak import (leaked_pages, percentile, read_rss_kib, rss_report, scrape_counters, wait_idle,  # noqa: E402
                  warmup_seconds)

HEALTH_EVERY_S = 0.05
HEALTH_STALL_LIMIT_S = 0.2
PATTERNS = ["(a|aa)*b", "(x+x+)+y", "^(([a-z])+.)+[A-Z]([a-z])+$", "(a*)*$", "([a-zA-Z]+)*@", "(.*a){12}",
            "|".join(f"w{i:03d}" for i in range(90)), "[\\u0000-\\uffff]{1,900}", "(\\d{1,3}\\.){3}\\d{1,3}",
            "a{1,1000}b{1,1000}"]


def schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema, often hostile, sometimes past the server's limits or invalid."""
    kind = rng.choice(["enum", "nest", "props", "array", "string", "pattern", "ref", "anyof", "number", "plain"])
    if depth > 2 and kind in ("nest", "props", "anyof", "ref"):
        kind = "string"
    if kind == "enum":
        return {"enum": [f"v{i}-{rng.randrange(10**6)}" for i in range(rng.choice([3, 200, 1000, 3000]))]}
    if kind == "nest":
        s: dict = {"type": "integer"}
        for i in range(rng.choice([5, 30, 64, 200])):
            s = {"type": "object", "properties": {f"n{i}": s}, "required": [f"n{i}"]}
        return s
    if kind == "props":
        n = rng.choice([10, 200, 600])
        return {"type": "object", "properties": {f"p{i}": schema(rng, depth + 1) if i < 3 else {"type": "string"}
                                                 for i in range(n)}, "required": [f"p{i}" for i in range(min(n, 3))]}
    if kind == "array":
        lo = rng.choice([0, 10, 1024, 5000])
        return {"type": "array", "items": {"type": "integer"}, "minItems": lo, "maxItems": lo + rng.choice([0, 24])}
    if kind == "string":
        return {"type": "string", "minLength": rng.choice([0, 100]), "maxLength": rng.choice([8, 1024, 100000])}
    if kind == "pattern":
        p = rng.choice(PATTERNS)
        return {"type": "string", "pattern": p * rng.choice([1, 1, 60])}
    if kind == "ref":
        return {"type": "object", "$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
            "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"]}
    if kind == "anyof":
        return {"anyOf": [schema(rng, depth + 1) for _ in range(rng.choice([2, 16, 64]))]}
    if kind == "number":
        return {"type": rng.choice(["number", "integer", 42, "nope"]), "minimum": rng.choice([-1e308, 0]),
                "maximum": rng.choice([1e308, 5]), "multipleOf": rng.choice([0.001, 7, -1])}
    return {"type": "object"}


def tool_output(rng: random.Random) -> str:
    """A tool result meant to hurt a tool-call parser or the tokenizer."""
    kind = rng.choice(["ws", "tags", "braces", "control", "astral", "huge", "json"])
    if kind == "ws":
        return "<tool_call>" + " \t\n" * rng.choice([1000, 20000]) + "x"
    if kind == "tags":
        return "<tool_call>{" * rng.choice([100, 3000]) + "</tool_call>" * rng.choice([0, 50])
    if kind == "braces":
        return "".join(rng.choice('{}[]"\\:,') for _ in range(rng.choice([100, 20000])))
    if kind == "control":
        return "".join(chr(rng.randrange(0, 32)) for _ in range(2000))
    if kind == "astral":
        return "".join(chr(rng.randrange(0x1F300, 0x1FAFF)) for _ in range(1500))
    if kind == "huge":
        return "y" * rng.choice([200_000, 2_000_000])
    return json.dumps({"result": [{"k": "".join(rng.choices(string.printable, k=40))} for _ in range(50)]})


def make_request(rng: random.Random) -> dict:
    stream = rng.random() < 0.5
    body: dict = {"model": "m", "max_tokens": rng.choice([1, 8, 24]), "stream": stream,
                  "temperature": rng.choice([0, 0.8])}
    x = rng.random()
    if x < 0.45:
        kind = "json_schema"
        body["messages"] = [{"role": "user", "content": "Fill in the form."}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema(rng)}}
    elif x < 0.8:
        kind = "tools"
        tools = [{"type": "function", "function": {"name": f"fn_{i}", "description": "d" * rng.choice([1, 500]),
                                                   "parameters": {"type": "object", "properties": {
                                                       "a": schema(rng, 2)}, "required": ["a"]}}}
                 for i in range(rng.choice([1, 8, 64, 128]))]
        body["messages"] = [{"role": "user", "content": "Call a tool."}]
        body["tools"] = tools
        body["tool_choice"] = rng.choice(["required", "auto",
                                          {"type": "function", "function": {"name": "fn_0"}}])
    else:
        kind = "tool_output"
        body["messages"] = [
            {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": tool_output(rng)}]
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
    give_up = rng.uniform(0.05, 2.0) if rng.random() < 0.1 else None
    return {"kind": kind, "stream": stream, "body": body, "give_up_after": give_up}


async def send(session, url: str, spec: dict) -> dict:
    import aiohttp

    rec = {"kind": spec["kind"], "stream": spec["stream"], "status": None, "aborted": False, "error": None}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(spec["give_up_after"]):
            async with session.post(url + "/v1/chat/completions", json=spec["body"]) as r:
                rec["status"] = r.status
                text = await r.text()
                if r.status == 200 and spec["stream"] and '"error"' in text and "data: [DONE]" not in text:
                    rec["error"] = "error event in stream: " + text[-300:]
                elif r.status not in (200, 400, 413):
                    rec["error"] = text[:300]
    except TimeoutError:
        rec["aborted"] = True
    except aiohttp.ClientError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_s"] = round(time.perf_counter() - t0, 3)
    return rec


def probe_health(url: str, stop, path: str) -> None:
    """In a process of its own: appends "seconds-since-start latency" lines to path every HEALTH_EVERY_S, on one
    connection, until stop (a multiprocessing Event) is set."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    t_start = time.perf_counter()
    with open(path, "w") as out:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
            took = time.perf_counter() - t0
            out.write(f"{t0 - t_start:.3f} {took:.4f}\n")
            stop.wait(max(0.0, HEALTH_EVERY_S - took))


def read_gauges(url: str, names: tuple[str, ...], label: str = "") -> dict[str, float]:
    """The nodeserve:<name> gauges in /metrics whose line contains `label` (e.g. 'tier="host"'); {} if unreachable."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                for name in names:
                    if line.startswith(f"nodeserve:{name}{{") and label in line:
                        out[name] = float(line.rsplit(" ", 1)[1])
    except OSError:
        return {}
    return out


def host_tier_pages(url: str) -> tuple[int, int] | None:
    """(pages used, pages) of the server's host KV tier, from /metrics; None without one."""
    g = read_gauges(url, ("kv_tier_pages_used", "kv_tier_pages_free"), 'tier="host"')
    if len(g) < 2:
        return None
    return int(g["kv_tier_pages_used"]), int(g["kv_tier_pages_used"] + g["kv_tier_pages_free"])


async def run(url: str, seconds: float, concurrency: int, seed: int, pid: int,
              rss: list[tuple[float, int]], health: list[tuple[float, float]],
              tier_full: list[float] | None = None) -> list[dict]:
    """tier_full: gets the time (s) of the first sample at which the host KV tier was full."""
    import aiohttp

    rng = random.Random(seed)
    records: list[dict] = []
    deadline = time.perf_counter() + seconds
    stop = asyncio.Event()
    ctx = multiprocessing.get_context("spawn")
    stop_probe = ctx.Event()
    probe_path = tempfile.mktemp(suffix=".health")
    prober = ctx.Process(target=probe_health, args=(url, stop_probe, probe_path), daemon=True)
    prober.start()
    t_start = time.perf_counter()

    async def client(session) -> None:
        while time.perf_counter() < deadline:
            records.append(await send(session, url, make_request(rng)))

    async def sample_rss() -> None:
        while not stop.is_set():
            kib = read_rss_kib(pid)
            now = round(time.perf_counter() - t_start, 1)
            if kib:
                rss.append((now, kib))
            if tier_full is not None and not tier_full:
                pages = await asyncio.to_thread(host_tier_pages, url)
                if pages is not None and pages[0] >= pages[1]:
                    tier_full.append(now)
            await asyncio.sleep(3.0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        rss_task = asyncio.create_task(sample_rss())
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        stop.set()
        stop_probe.set()
        await rss_task
    prober.join()
    if os.path.exists(probe_path):
        with open(probe_path) as f:
            health.extend(tuple(float(x) for x in line.split()) for line in f if len(line.split()) == 2)
        os.unlink(probe_path)
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-memory-gib", type=float, default=None, help="kv.host_memory_gib (default: the "
                    "server's, twice the pools: that tier filling shows as RSS growth)")
    ap.add_argument("--out", default=out_path("hostile.json"))
    args = ap.parse_args()
    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
                     "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
                                 "platform": platform.platform()},
                     "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        kv_extra = f"host_memory_gib = {args.host_memory_gib}" if args.host_memory_gib is not None else ""
        proc, url = start_server(args.mode, "auto", tmp, log_path, kv_memory_gib=0.5, kv_extra=kv_extra)
        try:
            rss: list[tuple[float, int]] = []
            health: list[tuple[float, float]] = []
            warm_rss: list = []
            asyncio.run(run(url, 20, 2, args.seed + 1, proc.pid, warm_rss, []))  # xgrammar's import, first compiles
            wait_idle(url, 120)
            before = read_rss_kib(proc.pid)
            tier_full: list[float] = []
            records = asyncio.run(run(url, args.duration, args.concurrency, args.seed, proc.pid, rss, health,
                                      tier_full))
            idle, _ = wait_idle(url, 300)
            end = read_rss_kib(proc.pid)
            stalls = scrape_counters(url)["event_loop_stalls"]
            grammar_cache = read_gauges(url, ("grammar_cache_entries", "grammar_cache_bytes"))
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            with open(log_path, errors="replace") as f:
                server_log = f.read()
            log_tail = server_log[-3000:]
            # each stall line and the stack under it, up to the next log line
            stall_logs = ["event loop stalled" + part.split("\n20", 1)[0]
                          for part in server_log.split("event loop stalled")[1:]][:50]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    by_kind = {k: sum(r["kind"] == k for r in records) for k in ("json_schema", "tools", "tool_output")}
    failures = [r for r in records if r["error"] and not r["aborted"]]
    num_5xx = sum(1 for r in records if (r["status"] or 0) >= 500 or (r["error"] or "").startswith("error event"))
    lat = [t for _, t in health]
    # The host KV tier's slots take memory as they are first written (torch.empty): RSS grows until it is full,
    # by design. Memory is judged from then on (or from the usual warm-up, if later; if it never fills, as usual).
    warm = max(warmup_seconds(args.duration), tier_full[0]) if tier_full else None
    plateau = rss_report(rss, args.duration, end, before_kib=before, warmup_s=warm)
    plateau["host_tier_full_at_s"] = tier_full[0] if tier_full else None
    leaked = leaked_pages(idle) if idle is not None else None
    criteria = [
        ("5xx == 0", num_5xx, num_5xx == 0),
        ("requests failed (not 200/400/413, connection errors) == 0", len(failures), not failures),
        (f"/health max latency < {HEALTH_STALL_LIMIT_S * 1000:.0f} ms", f"{max(lat) * 1000:.1f} ms",
         max(lat) < HEALTH_STALL_LIMIT_S),
        ("RSS growth after warm-up < 2 %", f"{plateau['growth_pct']} %", (plateau["growth_pct"] or 0) < 2),
        ("leaked KV pages == 0", leaked, leaked == 0),
        ("server alive", alive, alive)]
    passed = all(ok for _, _, ok in criteria)
    results.update(requests=len(records), statuses=statuses, by_kind=by_kind, aborted=sum(r["aborted"] for r in records),
                   num_5xx=num_5xx, failures=failures[:20],
                   health={"num_probes": len(lat), "p50_ms": round(percentile(lat, 50) * 1000, 2),
                           "p99_ms": round(percentile(lat, 99) * 1000, 2), "max_ms": round(max(lat) * 1000, 2),
                           "over_limit": sum(t >= HEALTH_STALL_LIMIT_S for t in lat)},
                   server_loop_stalls=stalls, server_stall_logs=stall_logs, grammar_cache_at_end=grammar_cache,
                   rss_plateau=plateau, leaked_pages=leaked,
                   criteria=[{"criterion": c, "measured": str(m), "result": "PASS" if ok else "FAIL"}
                             for c, m, ok in criteria],
                   passed=passed, rss_samples=rss, health_samples=health)
    if not passed:
        results["server_log_tail"] = log_tail
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"hostile fuzz {args.duration:g} s, concurrency {args.concurrency}: {len(records)} requests {by_kind}, "
          f"statuses {statuses}, aborted {results['aborted']}")
    print(f"/health: {len(lat)} probes, p50 {results['health']['p50_ms']} ms, p99 {results['health']['p99_ms']} ms, "
          f"max {results['health']['max_ms']} ms; the server's loop stalls past 100 ms by cause: {stalls}")
    print(f"RSS median {plateau['first_window_median_mib']} MiB after warm-up -> {plateau['last_window_median_mib']} "
          f"MiB at the end ({plateau['growth_pct']} %; windows of {plateau['window_s']:g} s), slopes {plateau['slope_first_half_mib_per_min']} / "
          f"{plateau['slope_second_half_mib_per_min']} MiB/min; host tier full at {plateau['host_tier_full_at_s']} s, "
          f"grammar cache at the end {grammar_cache}")
    for c, m, ok in criteria:
        print(f"  {'PASS' if ok else 'FAIL'}  {c}: {m}")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
