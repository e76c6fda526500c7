"""Load generator for any OpenAI-compatible endpoint: latency percentiles, SLO attainment and goodput.

Sends a seeded workload (bench/workloads.py: bimodal chat, summarization, agent loop, multi-turn chat) to `/v1/completions`,
streamed, with `ignore_eos: true` (so every request produces exactly `max_tokens` tokens) and
`stream_options.include_usage` (the output token count comes from `usage.completion_tokens`). Arrivals:

- ``--arrival poisson --rate R`` (default): Poisson arrivals at R req/s, open loop (a request is sent at
  its time whether or not earlier ones have finished);
- ``--concurrency N`` (or ``--arrival concurrency``): N clients, each sends its next request as soon as
  its previous one ends (closed loop);
- ``--burst`` (or ``--arrival burst``): every request at once.

The client timestamps every SSE data event as it arrives (time.perf_counter) and computes, per request,
TTFT, TPOT, every inter-token (inter-chunk) gap and the end-to-end latency; bench/stats.py defines each
exactly. It reports p50/p90/p99 of each, request and output-token throughput, and the attainment of the SLOs
(default TTFT <= 2.5 s and TPOT <= 100 ms for 90 % of requests). With ``--goodput-search`` it re-runs the same
workload at Poisson rates between ``--rate-min`` and ``--rate-max`` (bracketing, then bisection to
``--rate-tol``) and reports the goodput: the highest rate whose attainment >= ``--slo-target``.

    python bench/serve.py --url http://127.0.0.1:8000 --workload agent --rate 2 --num-requests 20
    python bench/serve.py --url http://127.0.0.1:8000 --workload bimodal --goodput-search \\
        --rate-min 0.25 --rate-max 8 --num-requests 100 --plots bench/results/plots

Writes JSON (`--out`): the exact command, the machine (from /proc/cpuinfo and /proc/meminfo), the date, the
arguments, every per-request record, the summary, the attainment and (if searched) every goodput probe.
`--plots DIR` writes latency CDFs (TTFT, TPOT, ITL) and, after a search, attainment vs rate, as PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402


# ---- one request ------------------------------------------------------------------------------------------

async def send(session, url: str, model: str, req: W.Request, headers: dict, extra_body: dict, t0: float,
               timeout: float) -> dict:
    """Streams one completion; returns its record (stats.request_metrics + bookkeeping)."""
    import aiohttp

    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0, **extra_body}
    rec: dict = {"kind": req.kind, "prompt_len": req.prompt_len, "max_tokens": req.max_tokens, "ok": False,
                 "status": None, "error": None}
    chunk_times: list[float] = []
    usage = None
    done = False
    t_send = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            rec["status"] = r.status
            if r.status != 200:
                rec["error"] = (await r.text())[:300]
            else:
                async for line in r.content:
                    now = time.perf_counter()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        rec["error"] = str((obj["error"] or {}).get("message"))[:300]
                        continue
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if obj.get("timings"):  # llama-server: prompt tokens computed (prompt_n) and reused (cache_n)
                        rec["timings"] = obj["timings"]
                    if any(c.get("text") or c.get("logprobs") for c in obj.get("choices") or ()):
                        chunk_times.append(now)
                if not done and rec["error"] is None:
                    rec["error"] = "stream ended without [DONE]"
    except asyncio.TimeoutError:
        rec["error"] = f"client timeout ({timeout:g} s)"
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    t_end = time.perf_counter()
    rec["ok"] = done and rec["error"] is None
    m = S.request_metrics(t_send, chunk_times, t_end, (usage or {}).get("completion_tokens"))
    rec.update(m)
    # the server's count when it reports usage; else the exact length of an id prompt (None for text)
    prompt_tokens = (usage or {}).get("prompt_tokens")
    rec["prompt_tokens"] = prompt_tokens if prompt_tokens is not None else (
        req.prompt_len if isinstance(req.prompt, list) else None)
    rec["usage_reported"] = usage is not None
    # prompt tokens served from the server's prefix cache, where it says (OpenAI's usage field)
    rec["cached_tokens"] = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    rec["sent_s"] = t_send - t0
    rec["end_s"] = t_end - t0
    return rec


# ---- one run ----------------------------------------------------------------------------------------------

def conversations(requests: list[W.Request]) -> list[list[int]]:
    """Request indices grouped into what must run in order: a multi-turn conversation's turns (by turn), every
    other request alone. Groups are in order of their first request."""
    groups: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(("c", r.conversation) if r.conversation is not None else ("r", i), []).append(i)
    return [sorted(g, key=lambda i: requests[i].turn or 0) for g in groups.values()]


async def run(url: str, model: str, requests: list[W.Request], arrival: str, rate: float | None,
              concurrency: int | None, seed: int, headers: dict, extra_body: dict, timeout: float,
              progress: bool = True, force_close: bool = False) -> tuple[list[dict], float]:
    """Sends every request with the given arrival pattern; returns (records in request order, duration).

    A multi-turn conversation (requests with `conversation` set) is one unit: it arrives (or a client takes
    it) as one, and its turns are sent in order, each when the previous one has ended.

    force_close: a new connection per request. llama-server (cpp-httplib) may close a kept-alive connection
    after a streamed response just as the next request is written on it ("Can not write request body").
    """
    import aiohttp

    records: list[dict | None] = [None] * len(requests)
    n_done = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=force_close)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()

        async def one(i: int, scheduled: float | None) -> None:
            nonlocal n_done
            rec = await send(session, url, model, requests[i], headers, extra_body, t0, timeout)
            rec["i"] = i
            rec["scheduled_s"] = scheduled
            records[i] = rec
            n_done += 1
            if progress and (n_done % max(1, len(requests) // 10) == 0 or n_done == len(requests)):
                print(f"  {n_done}/{len(requests)} done at t={time.perf_counter() - t0:.1f}s", flush=True)

        async def chain(conv: list[int], scheduled: float | None) -> None:  # a conversation's turns in order
            for k, i in enumerate(conv):
                await one(i, scheduled if k == 0 else None)

        convs = conversations(requests)
        if arrival == "concurrency":
            it = iter(convs)

            async def client() -> None:
                for conv in it:
                    await chain(conv, None)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            times = W.arrival_times(arrival, len(convs), rate, seed)
            tasks = []
            for conv, at in zip(convs, times):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(chain(conv, at)))
            await asyncio.gather(*tasks)
    duration = max((r["end_s"] for r in records), default=0.0)
    return records, duration


def measure(url: str, model: str, requests: list[W.Request], arrival: str, rate: float | None,
            concurrency: int | None, seed: int, headers: dict | None = None, extra_body: dict | None = None,
            timeout: float = 900.0, slo_ttft: float = S.DEFAULT_SLO_TTFT, slo_tpot: float = S.DEFAULT_SLO_TPOT,
            progress: bool = True, force_close: bool = False, ttft_per_token: float = 0.0) -> dict:
    """One run (see `run`) with its summary and SLO attainment: {"rate", "records", "summary", "attainment"}."""
    records, duration = asyncio.run(run(url, model, requests, arrival, rate, concurrency, seed, headers or {},
                                        extra_body or {}, timeout, progress=progress, force_close=force_close))
    return {"rate": rate, "records": records, "summary": S.summarize(records, duration),
            "attainment": S.slo_attainment(records, slo_ttft, slo_tpot, ttft_per_token)}


def search_goodput(measure_at, rate_min: float, rate_max: float, target: float = S.DEFAULT_SLO_TARGET,
                   tol: float = 0.1, max_probes: int = 12, report: bool = True) -> tuple[dict, dict]:
    """Goodput search (stats.goodput_search) where measure_at(rate) returns a `measure` result.

    Returns (the search as a dict, with every probe's summary and attainment under "probes"; the run reported
    with it: the probe at the goodput, or the lowest rate probed if none met the target).
    """
    probes: dict[float, dict] = {}

    def attainment_at(rate: float) -> float | None:
        print(f"goodput probe: Poisson {rate:.3f} req/s", flush=True)
        probes[rate] = measure_at(rate)
        if report:
            print_report(probes[rate]["summary"], probes[rate]["attainment"], f"probe {rate:.3f} req/s")
        return probes[rate]["attainment"]["attainment"]

    g = S.goodput_search(attainment_at, rate_min, rate_max, target, tol, max_probes=max_probes)
    out = g.as_dict()
    out["probes"] = [{"rate": r, "summary": p["summary"], "attainment": p["attainment"]} for r, p in probes.items()]
    return out, probes[g.goodput if g.goodput is not None else min(probes)]


# ---- environment ------------------------------------------------------------------------------------------

def machine() -> dict:
    info = {"cpu_model": "", "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kib = next((int(ln.split()[1]) for ln in f if ln.startswith("MemTotal")), None)
        info["mem_total_gib"] = round(kib / 2**20, 1) if kib else None
    except OSError:
        pass
    return info


def default_model(url: str, headers: dict) -> str:
    req = urllib.request.Request(url + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        data = json.load(r)["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


# ---- plots ------------------------------------------------------------------------------------------------

def plot(results: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    recs = [r for r in results["records"] if r["ok"]]
    slo = results["attainment"]
    series = [("TTFT", [r["ttft"] for r in recs if r["ttft"] is not None], slo["slo_ttft"]),
              ("TPOT", [r["tpot"] for r in recs if r["tpot"] is not None], slo["slo_tpot"]),
              ("ITL (every inter-chunk gap)", [g for r in recs for g in r["itl"]], None)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, vals, limit) in zip(axes, series):
        vals = sorted(v * 1000 for v in vals)
        if vals:
            ax.step(vals, [(k + 1) / len(vals) for k in range(len(vals))], where="post")
        if limit is not None:
            ax.axvline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name.startswith("ITL") else "requests"))
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    a = results["args"]
    load = (f"concurrency {a['concurrency']}" if results["arrival"] == "concurrency"
            else "burst" if results["arrival"] == "burst" else f"Poisson {results['rate']:g} req/s")
    fig.suptitle(f"{a['workload']}, {load}, {len(results['records'])} requests — {results['date']}")
    fig.tight_layout()
    p = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    if results.get("goodput"):
        g = results["goodput"]
        pts = sorted((q["rate"], q["attainment"]) for q in g["points"] if q["attainment"] is not None)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ax.plot([r for r, _ in pts], [x * 100 for _, x in pts], "o-")
        ax.axhline(g["target"] * 100, color="red", linestyle="--", label=f"target {g['target'] * 100:g} %")
        if g["goodput"] is not None:
            ax.axvline(g["goodput"], color="green", linestyle=":", label=f"goodput {g['goodput']:.2f} req/s")
        ax.set_xlabel("Poisson rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
        ax.set_title(f"{a['workload']}: TTFT <= {slo['slo_ttft']:g} s and TPOT <= {slo['slo_tpot'] * 1000:g} ms")
        fig.tight_layout()
        p = os.path.join(out_dir, "attainment_vs_rate.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


# ---- CLI --------------------------------------------------------------------------------------------------

def _fmt_ms(d: dict) -> str:
    f = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
    return f"{f(d['p50']):>9} {f(d['p90']):>9} {f(d['p99']):>9} {f(d['mean']):>9} {d['count']:>6}"


def print_report(summary: dict, att: dict, header: str) -> None:
    print(f"\n{header}")
    print(f"requests {summary['requests']} (failed {summary['failed']}), duration {summary['duration_s']:.1f} s, "
          f"{summary['request_throughput'] or 0:.2f} req/s, {summary['output_token_throughput'] or 0:.1f} "
          f"output tok/s")
    print(f"{'metric':<6} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'n':>6}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        print(f"{k:<6} {_fmt_ms(summary[k])}")
    a = att["attainment"]
    print(f"SLO attainment (TTFT <= {att['slo_ttft']:g} s and TPOT <= {att['slo_tpot'] * 1000:g} ms): "
          f"{att['met']}/{att['total']} = {'-' if a is None else f'{a * 100:.1f} %'} "
          f"(TTFT met {att['met_ttft']}, TPOT met {att['met_tpot']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="base URL (without /v1)")
    ap.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (env OPENAI_API_KEY)")
    ap.add_argument("--workload", choices=sorted(W.WORKLOAD_NAMES), default="bimodal")
    ap.add_argument("--long-share", type=float, default=None, help="bimodal: share of long prompts (default 0.2)")
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids")
    ap.add_argument("--vocab", default=f"{W.VOCAB_LO}:{W.VOCAB_HI}", help="token-id range LO:HI for ids prompts")
    ap.add_argument("--arrival", choices=["poisson", "concurrency", "burst"], default=None,
                    help="default: burst with --burst, concurrency with --concurrency, else poisson")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson rate, req/s")
    ap.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (closed loop)")
    ap.add_argument("--burst", action="store_true", help="send every request at t=0")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1, help="requests sent one by one before measuring, unrecorded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft", type=float, default=S.DEFAULT_SLO_TTFT, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=S.DEFAULT_SLO_TPOT, help="seconds")
    ap.add_argument("--slo-target", type=float, default=S.DEFAULT_SLO_TARGET)
    ap.add_argument("--goodput-search", action="store_true")
    ap.add_argument("--rate-min", type=float, default=0.25)
    ap.add_argument("--rate-max", type=float, default=16.0)
    ap.add_argument("--rate-tol", type=float, default=0.1, help="bisection stops when the bracket is this narrow")
    ap.add_argument("--max-probes", type=int, default=12)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--out", default=out_path("serve.json"))
    ap.add_argument("--plots", default=None, help="directory for PNG plots")
    args = ap.parse_args()

    arrival = args.arrival or ("burst" if args.burst else "concurrency" if args.concurrency else "poisson")
    if (args.burst and arrival != "burst") or (args.concurrency and arrival not in ("concurrency",)):
        ap.error(f"--arrival {arrival} conflicts with --burst/--concurrency")
    if arrival == "concurrency" and not (args.concurrency and args.concurrency > 0):
        ap.error("--arrival concurrency needs --concurrency N > 0")
    if arrival == "poisson" and args.rate <= 0:
        ap.error("--rate must be > 0")
    if args.goodput_search and arrival != "poisson":
        ap.error("--goodput-search searches over Poisson rates")
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra_body = json.loads(args.extra_body)
    lo, hi = (int(x) for x in args.vocab.split(":"))
    model = args.model or default_model(url, headers)
    requests = W.generate(args.workload, args.num_requests, args.seed, args.prompt_mode, args.long_share, (lo, hi))

    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
                     "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args),
                     "url": url, "model": model, "arrival": arrival}
    print(f"{args.workload}: {args.num_requests} requests, seed {args.seed}, model {model!r} at {url}", flush=True)

    if args.warmup:
        warm = W.generate(args.workload, args.warmup, args.seed + 10_000, args.prompt_mode, args.long_share, (lo, hi))
        asyncio.run(run(url, model, warm, "concurrency", None, 1, args.seed, headers, extra_body,
                        args.request_timeout, progress=False))

    def measure_at(rate: float | None, arr: str) -> dict:
        return measure(url, model, requests, arr, rate, args.concurrency, args.seed, headers, extra_body,
                       args.request_timeout, args.slo_ttft, args.slo_tpot)

    if args.goodput_search:
        results["goodput"], main = search_goodput(lambda rate: measure_at(rate, "poisson"), args.rate_min,
                                                  args.rate_max, args.slo_target, args.rate_tol, args.max_probes)
        arrival = results["arrival"] = "poisson"
    else:
        main = measure_at(args.rate if arrival == "poisson" else None, arrival)
    results.update(rate=main["rate"], summary=main["summary"], attainment=main["attainment"],
                   records=main["records"])

    load = (f"concurrency {args.concurrency}" if arrival == "concurrency" else "burst" if arrival == "burst"
            else f"Poisson {main['rate']:g} req/s")
    print_report(main["summary"], main["attainment"], f"{args.workload}, {load}:")
    if args.goodput_search:
        g = results["goodput"]
        pts = ", ".join(f"{p['rate']:.3f}->" + ("-" if p["attainment"] is None else f"{p['attainment'] * 100:.0f}%")
                        for p in g["points"])
        gp = "none" if g["goodput"] is None else f"{g['goodput']:.3f} req/s"
        print(f"goodput (attainment >= {args.slo_target * 100:g} %): {gp} [{g['status']}]; probes {pts}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"-> {args.out}")
    if args.plots:
        for p in plot(results, args.plots):
            print(f"-> {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
