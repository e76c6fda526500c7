"""Soak: a real server under N minutes of mixed load, with client disconnects; then no leaked pages or RSS creep.

Starts a real nodeserve server (subprocess, temp config, free port), warms it up, then for `--minutes` keeps
`--concurrency` clients busy with a mix of requests:

- chat and completions, streamed and not; mostly short prompts, ~10 % long ones (~1500 tokens);
- random max_tokens (1..96), some with stop strings, some with n=2, some seeded sampling, some ignore_eos;
- ~6 % bad requests (invalid JSON, missing fields, out-of-range values, unknown model, prompt over the context)
  that must come back 4xx;
- with probability `--disconnect-prob` a client gives up: a streaming one closes the connection after a random
  number of SSE events (0 = right after the headers, i.e. usually during prefill), a non-streamed one sets a
  short client timeout (0.05-3 s). A request counts as *aborted* only if the client really gave up before the
  response was complete.

Per request it records kind, status, aborted, completed. *Completed* means: streamed -> got `data: [DONE]` with
no error event and a finish_reason for every choice; not streamed -> 200 JSON whose every choice has a
finish_reason; bad request -> the 4xx JSON error it should get. *Failed* = unexpected status (5xx, 4xx for a
good request, 2xx for a bad one) or a connection error.

While it runs it samples the server's RSS (VmRSS from /proc/<pid>/status) every `--rss-interval` seconds. At
the end it stops sending, waits for every in-flight request, waits for the server to go idle (`/debug/kv`:
nothing pending, running or waiting, every page free) and reports: requests sent / completed / aborted /
failed, leaked pages (sum over pools of num_pages - num_free once idle; must be 0), RSS after warm-up, at the
end and the growth in MiB, and whether every request that was not aborted completed.

    python bench/soak.py --minutes 2

Exit code 1 if any page leaked or a non-aborted request did not complete (or the server died). Writes JSON
(`--out`) with the exact command, the machine (CPU model from /proc/cpuinfo), the date, the summary and every
request record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import MODES, cpu_model, start_server  # noqa: E402  (bench/ is scripts, not a package)


SHORT_TOPICS = ["the sea", "prime numbers", "a red bicycle", "the moon landing", "bread", "a lighthouse",
                "rain in spring", "compilers", "an old library", "the color blue"]
STOP_CHOICES = [["\n"], ["."], [" the", ","], ["\n\n", "!"], ["zzzz-never"]]


# ---- pure statistics (unit-tested in tests/bench/test_soak_stats.py) -------------------------------------

def is_failed(rec: dict) -> bool:
    """An unexpected outcome the client did not cause: no response (connection error), a 5xx, a non-200 for a
    good request, a non-4xx for a bad one."""
    if rec.get("aborted"):
        return False
    status = rec.get("status")
    if status is None:
        return True
    if rec.get("bad"):
        return not 400 <= status < 500
    return status != 200


def summarize(records: list[dict]) -> dict:
    """Counts over the per-request records."""
    sent = len(records)
    aborted = sum(1 for r in records if r.get("aborted"))
    completed = sum(1 for r in records if r.get("completed") and not r.get("aborted"))
    failed = sum(1 for r in records if is_failed(r))
    not_completed = [r for r in records if not r.get("aborted") and not r.get("completed")]
    by_kind: dict[str, dict[str, int]] = {}
    statuses: dict[str, int] = {}
    for r in records:
        key = r["kind"] + ("/stream" if r.get("stream") else "") + ("/bad" if r.get("bad") else "")
        k = by_kind.setdefault(key, {"sent": 0, "completed": 0, "aborted": 0, "failed": 0})
        k["sent"] += 1
        k["aborted"] += bool(r.get("aborted"))
        k["completed"] += bool(r.get("completed") and not r.get("aborted"))
        k["failed"] += is_failed(r)
        s = str(r.get("status"))
        statuses[s] = statuses.get(s, 0) + 1
    return {
        "sent": sent, "completed": completed, "aborted": aborted, "failed": failed,
        "not_aborted_not_completed": len(not_completed),
        "bad_requests": sum(1 for r in records if r.get("bad")),
        "long_prompts": sum(1 for r in records if r.get("long")),
        "n2": sum(1 for r in records if r.get("n", 1) > 1),
        "with_stop": sum(1 for r in records if r.get("stop")),
        "aborted_streams": sum(1 for r in records if r.get("aborted") and r.get("stream")),
        "aborted_non_streamed": sum(1 for r in records if r.get("aborted") and not r.get("stream")),
        "by_kind": dict(sorted(by_kind.items())),
        "statuses": dict(sorted(statuses.items())),
        "all_non_aborted_completed": not not_completed,
        "examples_not_completed": [{k: r.get(k) for k in ("kind", "stream", "bad", "status", "error")}
                                   for r in not_completed[:5]],
    }


def leaked_pages(debug_kv: dict) -> int:
    """Pages still held once the server is idle: sum over pools of num_pages - num_free, plus host-tier slots
    still held by a load (KV tiers)."""
    return sum(p["num_pages"] - p["num_free"] for p in debug_kv["pools"]) + \
        sum(t.get("num_held", 0) for t in debug_kv.get("tiers", []) if t["tier"] != "device")


def is_idle(debug_kv: dict) -> bool:
    return debug_kv.get("num_pending", 0) == 0 and all(
        p.get("num_running", 0) == 0 and p.get("num_waiting", 0) == 0 and p["num_free"] == p["num_pages"]
        for p in debug_kv["pools"]) and all(t.get("num_held", 0) == 0 for t in debug_kv.get("tiers", []))


def rss_growth(samples: list[tuple[float, int]], start_kib: int | None = None, end_kib: int | None = None) -> dict:
    """samples: (seconds since start, VmRSS KiB). Start defaults to the first sample, end to the last."""
    if not samples and (start_kib is None or end_kib is None):
        return {"start_mib": None, "end_mib": None, "growth_mib": None, "max_mib": None, "num_samples": 0}
    start = samples[0][1] if start_kib is None else start_kib
    end = samples[-1][1] if end_kib is None else end_kib
    peak = max([start, end] + [kib for _, kib in samples])
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    return {"start_mib": mib(start), "end_mib": mib(end), "growth_mib": mib(end - start), "max_mib": mib(peak),
            "num_samples": len(samples)}


def verdict(summary: dict, leaked: int | None, server_alive: bool = True) -> tuple[bool, list[str]]:
    """Pass iff no page leaked and every request the client did not abort completed (and the server lived)."""
    reasons = []
    if leaked is None:
        reasons.append("could not read /debug/kv after the run")
    elif leaked > 0:
        reasons.append(f"{leaked} KV pages still held after the server went idle")
    if not summary["all_non_aborted_completed"]:
        reasons.append(f"{summary['not_aborted_not_completed']} requests that were not aborted did not complete")
    if not server_alive:
        reasons.append("the server process exited during the run")
    return not reasons, reasons


# ---- the server ------------------------------------------------------------------------------------------


def read_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_idle(url: str, timeout: float) -> tuple[dict | None, float]:
    """Polls /debug/kv until the server is idle or `timeout` passes; returns the last reading and the wait."""
    t0 = time.perf_counter()
    last = None
    while True:
        try:
            last = get_json(url + "/debug/kv")
            if is_idle(last):
                return last, time.perf_counter() - t0
        except (OSError, ValueError):
            pass
        if time.perf_counter() - t0 > timeout:
            return last, time.perf_counter() - t0
        time.sleep(0.25)


def scrape_counters(url: str) -> dict:
    """request_success by finished_reason and request_rejected by reason, from /metrics."""
    out: dict[str, dict[str, float]] = {"request_success": {}, "request_rejected": {}}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        for name, label in (("request_success", "finished_reason"), ("request_rejected", "reason")):
            if line.startswith(f"nodeserve:{name}_total{{") and f'{label}="' in line:
                value = line.rsplit(" ", 1)[1]
                key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[name][key] = float(value)
    return out


# ---- the load --------------------------------------------------------------------------------------------

def make_request(rng: random.Random, long_ids: list[int], long_text: str, disconnect_prob: float) -> dict:
    """One random request: where to send it, the body, and what the client will do."""
    kind = rng.choice(["chat", "completion"])
    stream = rng.random() < 0.5
    spec: dict = {"kind": kind, "stream": stream, "bad": False, "long": False, "n": 1, "stop": False,
                  "path": "/v1/chat/completions" if kind == "chat" else "/v1/completions", "raw": None}
    if rng.random() < 0.06:
        spec["bad"] = True
        spec["body"], spec["raw"], spec["bad_kind"] = _bad_body(rng, kind, stream)
        spec["disconnect_after"] = spec["give_up_after"] = None
        return spec
    long = rng.random() < 0.10
    max_tokens = rng.randint(1, 96) if not long else rng.randint(1, 32)
    body: dict = {"model": "m", "max_tokens": max_tokens, "stream": stream}
    if kind == "chat":
        content = long_text if long else f"Write a few sentences about {rng.choice(SHORT_TOPICS)}."
        body["messages"] = [{"role": "user", "content": content}]
    elif long:
        body["prompt"] = long_ids
    elif rng.random() < 0.5:
        body["prompt"] = f"Here is a short story about {rng.choice(SHORT_TOPICS)}:"
    else:
        body["prompt"] = [rng.randrange(300, 40000) for _ in range(rng.randint(5, 200))]
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.2), 2)
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOP_CHOICES)
        spec["stop"] = True
    if rng.random() < 0.15:
        body["n"] = spec["n"] = 2
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    spec["long"], spec["body"] = long, body
    give_up = rng.random() < disconnect_prob
    # streamed: close after this many SSE events (0 = straight after the headers); not streamed: client timeout
    spec["disconnect_after"] = rng.randint(0, max_tokens + 1) if give_up and stream else None
    spec["give_up_after"] = round(rng.uniform(0.05, 3.0), 2) if give_up and not stream else None
    return spec


def _bad_body(rng: random.Random, kind: str, stream: bool) -> tuple[dict | None, bytes | None, str]:
    base: dict = ({"model": "m", "messages": [{"role": "user", "content": "hi"}]} if kind == "chat"
                  else {"model": "m", "prompt": "hi"})
    base.update(max_tokens=8, stream=stream)
    which = rng.choice(["invalid_json", "missing_input", "negative_max_tokens", "bad_temperature", "n_zero",
                        "unknown_model", "too_long", "bad_stop"])
    if which == "invalid_json":
        return None, b'{"model": "m", "prompt": [1, 2', which
    if which == "missing_input":
        base.pop("messages" if kind == "chat" else "prompt")
    elif which == "negative_max_tokens":
        base["max_tokens"] = -3
    elif which == "bad_temperature":
        base["temperature"] = -1
    elif which == "n_zero":
        base["n"] = 0
    elif which == "unknown_model":
        base["model"] = "no-such-model"
    elif which == "too_long":
        if kind == "chat":
            base["messages"] = [{"role": "user", "content": "word " * 10000}]
        else:
            base["prompt"] = [rng.randrange(300, 40000) for _ in range(10000)]
    elif which == "bad_stop":
        base["stop"] = 42
    return base, None, which


async def send(session, url: str, spec: dict) -> dict:
    import aiohttp

    rec = {k: spec[k] for k in ("kind", "stream", "bad", "long", "n", "stop")}
    rec.update(status=None, aborted=False, completed=False, error=None, events=0)
    if spec["bad"]:
        rec["bad_kind"] = spec["bad_kind"]
    t0 = time.perf_counter()
    kwargs: dict = {"data": spec["raw"], "headers": {"Content-Type": "application/json"}} if spec["raw"] is not None \
        else {"json": spec["body"]}
    # a generous cap so a hung request can't hang the bench; hitting it counts as not completed
    kwargs["timeout"] = aiohttp.ClientTimeout(total=spec["give_up_after"] or 900)
    try:
        async with session.post(url + spec["path"], **kwargs) as r:
            rec["status"] = r.status
            if r.status != 200 or spec["bad"]:
                body = await r.read()
                try:
                    err = json.loads(body).get("error")
                except ValueError:
                    err = None
                rec["completed"] = bool(spec["bad"] and 400 <= r.status < 500 and err)
                rec["error"] = (err or {}).get("message", body[:200].decode(errors="replace"))[:200] \
                    if not rec["completed"] else None
            elif spec["stream"]:
                await _read_stream(r, spec, rec)
            else:
                obj = await r.json()
                choices = obj.get("choices", [])
                rec["completed"] = len(choices) == spec["n"] and all(c.get("finish_reason") for c in choices)
    except asyncio.TimeoutError:
        if spec["give_up_after"] is not None:
            rec["aborted"] = True
        else:
            rec["error"] = "client timeout (900 s)"
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["latency_s"] = round(time.perf_counter() - t0, 3)
    return rec


async def _read_stream(r, spec: dict, rec: dict) -> None:
    finished: set[int] = set()
    done = False
    if spec["disconnect_after"] == 0:
        r.close()
        rec["aborted"] = True
        return
    async for line in r.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            done = True
            break
        obj = json.loads(payload)
        rec["events"] += 1
        if "error" in obj:
            rec["error"] = str(obj["error"].get("message"))[:200]
        for c in obj.get("choices", []):
            if c.get("finish_reason"):
                finished.add(c["index"])
        if spec["disconnect_after"] is not None and rec["events"] >= spec["disconnect_after"]:
            r.close()  # drop the connection mid-stream
            rec["aborted"] = True
            return
    rec["completed"] = done and rec["error"] is None and len(finished) == spec["n"]
    if not rec["completed"] and rec["error"] is None:
        rec["error"] = f"stream ended: done={done}, finished choices {sorted(finished)} of {spec['n']}"


async def run_load(url: str, seconds: float, concurrency: int, rng: random.Random, long_ids: list[int],
                   long_text: str, disconnect_prob: float, pid: int, rss_interval: float,
                   rss_samples: list[tuple[float, int]], log_every: float = 15.0) -> list[dict]:
    import aiohttp

    records: list[dict] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client():
            while time.perf_counter() < deadline:
                records.append(await send(session, url, make_request(rng, long_ids, long_text, disconnect_prob)))

        async def sampler():
            next_log = log_every
            while time.perf_counter() < deadline:
                kib = read_rss_kib(pid)
                now = time.perf_counter() - t0
                if kib is not None:
                    rss_samples.append((round(now, 1), kib))
                if now >= next_log:
                    s = summarize(records)
                    print(f"  t={now:5.0f}s  sent {s['sent']}  completed {s['completed']}  aborted {s['aborted']}"
                          f"  failed {s['failed']}  rss {kib / 1024 if kib else float('nan'):.0f} MiB", flush=True)
                    next_log += log_every
                await asyncio.sleep(min(rss_interval, max(0.0, deadline - time.perf_counter())))

        await asyncio.gather(sampler(), *(client() for _ in range(concurrency)))
    return records


def long_inputs(rng: random.Random, tokens: int = 1500) -> tuple[list[int], str]:
    """~`tokens` random token ids for completions and a chat message of roughly that many tokens."""
    ids = [rng.randrange(300, 40000) for _ in range(tokens)]
    words = ["alpha", "river", "stone", "seven", "quiet", "window", "paper", "orange", "north", "signal"]
    text = "Summarize the following notes. " + " ".join(rng.choice(words) for _ in range(tokens - 40))
    return ids, text



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mode", choices=sorted(MODES), default="disaggregated")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--disconnect-prob", type=float, default=0.2)
    ap.add_argument("--kv-memory-gib", type=float, default=2.0,
                    help="KV pool per device; small values put the prefix cache under eviction pressure")
    ap.add_argument("--kv-extra", default="", help="more [kv] TOML lines, e.g. 'host_memory_gib = 0.2' "
                    "(with a small --kv-memory-gib: the KV tiers under eviction throughout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-interval", type=float, default=3.0)
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "soak.json"))
    args = ap.parse_args()

    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
                     "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
                                 "platform": platform.platform()},
                     "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}
    rng = random.Random(args.seed)
    long_ids, long_text = long_inputs(rng)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        t_start = time.perf_counter()
        proc, url = start_server(args.mode, args.dtype, tmp, log_path, kv_memory_gib=args.kv_memory_gib,
                                 kv_extra=args.kv_extra.replace("\\n", "\n"))
        print(f"server up in {time.perf_counter() - t_start:.1f} s ({args.mode}, dtype {args.dtype}), pid {proc.pid}",
              flush=True)
        try:
            # warm-up: one of each shape (incl. a long prompt) so lazy allocations happen before the RSS baseline
            warm_rng = random.Random(args.seed + 1)
            asyncio.run(run_load(url, 20, min(4, args.concurrency), warm_rng, long_ids, long_text, 0.0, proc.pid,
                                 1e9, [], log_every=1e9))
            idle, _ = wait_idle(url, args.idle_timeout)
            rss_start = read_rss_kib(proc.pid)
            print(f"warm-up done; RSS {rss_start / 1024:.0f} MiB; soaking {args.minutes:g} min at concurrency "
                  f"{args.concurrency}", flush=True)
            samples: list[tuple[float, int]] = []
            t_load = time.perf_counter()
            records = asyncio.run(run_load(url, args.minutes * 60, args.concurrency, rng, long_ids, long_text,
                                           args.disconnect_prob, proc.pid, args.rss_interval, samples))
            load_s = time.perf_counter() - t_load
            idle, idle_wait = wait_idle(url, args.idle_timeout)
            rss_end = read_rss_kib(proc.pid)
            alive = proc.poll() is None
            leaked = leaked_pages(idle) if idle is not None else None
            counters = scrape_counters(url)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            with open(log_path, errors="replace") as f:
                log_tail = f.read()[-4000:]

    summary = summarize(records)
    rss = rss_growth(samples, rss_start, rss_end)
    passed, reasons = verdict(summary, leaked, alive)
    results.update(summary=summary, load_seconds=round(load_s, 1), idle_wait_seconds=round(idle_wait, 1),
                   leaked_pages=leaked, debug_kv_after=idle, rss=rss, rss_samples=samples,
                   server_counters=counters, passed=passed, reasons=reasons, records=records)
    if not passed:
        results["server_log_tail"] = log_tail
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)

    s = summary
    print(f"\nsoak {args.mode}, {args.minutes:g} min, concurrency {args.concurrency}, "
          f"disconnect-prob {args.disconnect_prob}, seed {args.seed}")
    print(f"requests sent {s['sent']}: completed {s['completed']}, aborted by client {s['aborted']} "
          f"({s['aborted_streams']} streams, {s['aborted_non_streamed']} non-streamed), failed {s['failed']}")
    print(f"  bad requests {s['bad_requests']}, long prompts {s['long_prompts']}, n=2 {s['n2']}, "
          f"with stop {s['with_stop']}; statuses {s['statuses']}")
    for k, v in s["by_kind"].items():
        print(f"  {k:<22} sent {v['sent']:>4}  completed {v['completed']:>4}  aborted {v['aborted']:>4}  "
              f"failed {v['failed']:>3}")
    print(f"idle after {idle_wait:.1f} s; leaked pages {leaked}")
    print(f"RSS after warm-up {rss['start_mib']} MiB, at end {rss['end_mib']} MiB, growth {rss['growth_mib']} MiB "
          f"(max {rss['max_mib']} MiB over {rss['num_samples']} samples)")
    print(f"every non-aborted request completed: {s['all_non_aborted_completed']}")
    if s["examples_not_completed"]:
        print(f"  e.g. {s['examples_not_completed']}")
    print(f"server counters: {counters}")
    print(f"{'PASS' if passed else 'FAIL'}{': ' + '; '.join(reasons) if reasons else ''}   -> {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
