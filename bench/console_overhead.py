"""What the live console's feed costs: decode throughput of N concurrent streams with 0 and with K consoles
connected to GET /debug/events, against one real server (the default config: disaggregated, cpu:0 -> cpu:1).

    python bench/console_overhead.py --streams 8 --max-tokens 128 --clients 5 --repeats 5 --json /tmp/console.json

Each run sends --streams completions at once, streamed, with ignore_eos (each makes exactly --max-tokens tokens),
and counts decode throughput over the window in which all of them are decoding (from the last first token to the
first finish): tokens in it / its length. Runs alternate (0 consoles, K consoles, 0, K, ...) so a machine whose
load drifts hurts both alike; the consoles are K readers of the feed in this process that stay connected for the
whole K-console run and read every update (as a browser tab would; a real browser usually sits on another
machine). Printed and written as JSON: the medians, their ratio (K / 0) and the cost (1 - ratio).

On a shared machine the throughput of one run moves by more than the 1 % looked for, so the server's own CPU time
is measured too (from /proc: every thread, and the event loop's thread, where the feed runs): CPU seconds per
generated token with and without consoles, and, with no load at all, what the event loop spends a second with K
consoles connected against none. Also what the server reports: the feed's build time per update (cost_ms) and the
bytes each console received a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model, start_server  # noqa: E402

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how a steam engine works, step by step.",
           "List the countries of Europe and their capitals.", "Describe a walk through a forest in autumn."]


async def one_stream(session, url: str, prompt: str, max_tokens: int) -> list[float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(every thread's, the main thread's) CPU seconds of process `pid` so far: the event loop runs in the main
    thread, whose schedstat counts nanoseconds (stat's utime + stime count 10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        loop = int(f.read().split()[0]) / 1e9
    return total, loop


async def one_run(session, url: str, streams: int, max_tokens: int, pid: int) -> dict:
    cpu0, loop0 = cpu_seconds(pid)
    times = await asyncio.gather(*(one_stream(session, url, PROMPTS[i % len(PROMPTS)] + f" ({i})", max_tokens)
                                   for i in range(streams)))
    cpu1, loop1 = cpu_seconds(pid)
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    tokens = sum(sum(1 for x in t if start < x <= end) for t in times)
    total = sum(len(t) for t in times)
    return {"tokens_per_s": tokens / (end - start), "window_s": end - start, "tokens": tokens,
            "cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / total, "loop_cpu_s": loop1 - loop0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def idle_loop_cpu(pid: int, seconds: float) -> float:
    """The event loop thread's CPU seconds a second while nothing is served."""
    _, before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    _, after = cpu_seconds(pid)
    return (after - before) / seconds


class Consoles:
    """K feed readers: each counts its messages and bytes and keeps the server's reported build times."""

    def __init__(self, session, url: str, num: int):
        self.session, self.url, self.num = session, url, num
        self.tasks: list[asyncio.Task] = []
        self.bytes = [0] * num
        self.messages = [0] * num
        self.cost_ms: list[float] = []
        self.started = 0.0

    async def _read(self, i: int) -> None:
        async with self.session.get(self.url + "/debug/events") as r:
            assert r.status == 200
            async for line in r.content:
                self.bytes[i] += len(line)
                if line.startswith(b"data: "):
                    self.messages[i] += 1
                    if i == 0:
                        cost = json.loads(line[6:]).get("cost_ms")
                        if cost is not None:
                            self.cost_ms.append(cost)

    async def __aenter__(self):
        self.tasks = [asyncio.create_task(self._read(i)) for i in range(self.num)]
        self.started = time.perf_counter()
        await asyncio.sleep(1.0)  # connected, history received
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.sleep(0.5)  # the server sees them leave and stops its producer

    def rates(self) -> dict:
        seconds = time.perf_counter() - self.started
        return {"bytes_per_s_per_client": sum(self.bytes) / max(self.num, 1) / seconds,
                "messages_per_s_per_client": sum(self.messages) / max(self.num, 1) / seconds}


async def main_async(args) -> dict:
    import aiohttp

    tmp = tempfile.mkdtemp(prefix="console-overhead-")
    proc, url = start_server("disaggregated", args.dtype, tmp, os.path.join(tmp, "server.log"))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            pid = proc.pid
            await one_run(session, url, args.streams, 16, pid)  # warm-up
            idle = {0: await idle_loop_cpu(pid, args.idle_s)}
            async with Consoles(session, url, args.clients):
                idle[args.clients] = await idle_loop_cpu(pid, args.idle_s)
            rss = [rss_mib(pid)]
            print(f"idle: the event loop's CPU {100 * idle[0]:.3f} % of a core with no console, "
                  f"{100 * idle[args.clients]:.3f} % with {args.clients}", flush=True)
            runs: dict[int, list[dict]] = {0: [], args.clients: []}
            feed: list[dict] = []
            costs: list[float] = []
            for rep in range(args.repeats):
                for k in ((0, args.clients) if rep % 2 == 0 else (args.clients, 0)):
                    if k == 0:
                        runs[0].append(await one_run(session, url, args.streams, args.max_tokens, pid))
                    else:
                        async with Consoles(session, url, k) as consoles:
                            runs[k].append(await one_run(session, url, args.streams, args.max_tokens, pid))
                            feed.append(consoles.rates())
                            costs.extend(consoles.cost_ms)
                    rss.append(rss_mib(pid))
                    r = runs[k][-1]
                    print(f"run {rep + 1}/{args.repeats}, {k} consoles: {r['tokens_per_s']:.1f} tok/s over "
                          f"{r['window_s']:.1f} s, server CPU {r['cpu_ms_per_token']:.2f} ms a token", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    base = statistics.median(r["tokens_per_s"] for r in runs[0])
    with_k = statistics.median(r["tokens_per_s"] for r in runs[args.clients])
    # Each repeat's two runs are neighbours in time: their ratio cancels a load that drifts between repeats.
    pairs = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[0], runs[args.clients])]
    cpu_base = statistics.median(r["cpu_ms_per_token"] for r in runs[0])
    cpu_k = statistics.median(r["cpu_ms_per_token"] for r in runs[args.clients])
    return {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{cpu_model()} ({os.cpu_count()} CPUs), {platform.python_version()}",
            "args": vars(args), "runs": {str(k): v for k, v in runs.items()},
            "median_tokens_per_s": {"0": base, str(args.clients): with_k}, "ratio": with_k / base,
            "cost": 1 - with_k / base, "pair_ratios": pairs, "pair_ratio_median": statistics.median(pairs),
            "median_cpu_ms_per_token": {"0": cpu_base, str(args.clients): cpu_k}, "cpu_ratio": cpu_k / cpu_base,
            "idle_loop_cpu_share": {str(k): v for k, v in idle.items()},
            "server_rss_mib": rss,
            "feed": {"build_ms_median": statistics.median(costs) if costs else None,
                     "build_ms_max": max(costs) if costs else None,
                     "bytes_per_s_per_client": statistics.median(f["bytes_per_s_per_client"] for f in feed),
                     "messages_per_s_per_client": statistics.median(f["messages_per_s_per_client"] for f in feed)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=5, help="consoles connected in the measured runs")
    p.add_argument("--repeats", type=int, default=5, help="runs of each kind, alternating")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle event-loop measurement")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    f = result["feed"]
    print(f"decode throughput, median of {args.repeats}: 0 consoles {result['median_tokens_per_s']['0']:.1f} tok/s, "
          f"{args.clients} consoles {result['median_tokens_per_s'][str(args.clients)]:.1f} tok/s: ratio "
          f"{result['ratio']:.4f} (cost {100 * result['cost']:+.2f} %)")
    print(f"per repeat (neighbouring runs), {args.clients} / 0 consoles: "
          f"{', '.join(f'{r:.3f}' for r in result['pair_ratios'])}; median {result['pair_ratio_median']:.4f}")
    cpu = result["median_cpu_ms_per_token"]
    print(f"server CPU per generated token, median: {cpu['0']:.3f} ms with 0 consoles, "
          f"{cpu[str(args.clients)]:.3f} ms with {args.clients}: ratio {result['cpu_ratio']:.4f}")
    idle = result["idle_loop_cpu_share"]
    print(f"idle event loop: {100 * idle['0']:.3f} % of a core with 0 consoles, "
          f"{100 * idle[str(args.clients)]:.3f} % with {args.clients}")
    if f["build_ms_median"] is not None:
        print(f"feed: {f['build_ms_median']:.2f} ms per update (max {f['build_ms_max']:.2f}), "
              f"{f['messages_per_s_per_client']:.1f} updates and {f['bytes_per_s_per_client'] / 1e3:.1f} kB a "
              f"second per console")
    print(f"server RSS: {result['server_rss_mib'][0]:.0f} MiB after the warm-up, "
          f"{result['server_rss_mib'][-1]:.0f} MiB after the last run")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
