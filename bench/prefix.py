"""Prefix cache benchmark: multi-turn chat and an agent loop, nodeserve with the cache on and off in both modes,
against llama-server (which reuses each slot's cached prompt).

Per target and workload: TTFT p50/p99 of first turns and of later turns, prompt tokens the server computed
(prompt tokens less those it reports cached), the server's own prefix-cache and transfer counters from /metrics
(checked against what the client measured), and SLO attainment and goodput (requests meeting the fixed SLO per
second) at a fixed client concurrency.

    python bench/prefix.py [--conversations 8] [--agents 4] [--calls 4] [--concurrency 4]
    python bench/prefix.py --modes adaptive --cache on --no-llama [--cpu-class avx2]   # adaptive's role changes
Results: bench/results/prefix/prefix.json, prefix.md and prefix_ttft.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
from cpu_class import CPU_CLASS_ENV, nodeserve_env  # noqa: E402
import llama_server as L  # noqa: E402
import local_server  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402

OUT_DIR = out_path("prefix")
SYSTEM_TOKENS = 1536
CHAT = W.MultiTurnSpec(output=(16, 48))


def agent_loop(num_agents: int, num_calls: int, seed: int = 0) -> list[W.Request]:
    """Agents that share one 1.5k-token system prompt (instructions + tool list); each call resends it with the
    agent's task and its history so far (earlier answers and tool results), as an agent framework does."""
    system = W.make_prompt(random.Random(f"agent-system-{seed}"), SYSTEM_TOKENS)
    out = []
    for a in range(num_agents):
        rng = random.Random(f"agent-{seed}-{a}")
        prompt = system + W.make_prompt(rng, rng.randint(50, 150))
        for k in range(num_calls):
            max_tokens = rng.randint(16, 48)
            out.append(W.Request(prompt, len(prompt), max_tokens, "agent", a, k))
            prompt = prompt + W.make_prompt(rng, max_tokens) + W.make_prompt(rng, rng.randint(20, 80))  # answer, tool result
    return out


def scrape(url: str) -> dict[str, dict[str, float]]:
    """nodeserve's counters this benchmark reads: {name: {device (or "" for per-server ones): value}}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "kv_transfer_bytes_sum",
                 "kv_transfer_saved_bytes_total", "prompt_tokens_total", "device_role_changes_total",
                 "prompt_tokens_computed_total"):
        for labels, value in re.findall(rf"^nodeserve:{name}{{([^}}]*)}} (\S+)$", text, re.M):
            device = re.search(r'device="([^"]*)"', labels)
            out.setdefault(name, {})[device.group(1) if device else ""] = float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: {d: v - before.get(k, {}).get(d, 0.0) for d, v in by.items()} for k, by in after.items()}


def run_workload(url: str, model: str, requests: list[W.Request], concurrency: int, extra_body: dict,
                 is_nodeserve: bool) -> dict:
    before = scrape(url) if is_nodeserve else None
    m = serve.measure(url, model, requests, "concurrency", None, concurrency, 0, extra_body=extra_body,
                      progress=False, force_close=True)
    recs = m["records"]
    for rec, req in zip(recs, requests):
        rec["turn"] = req.turn
    ok = [r for r in recs if r["ok"]]
    cached = [r.get("cached_tokens") if r.get("cached_tokens") is not None else
              (r.get("timings") or {}).get("cache_n") for r in ok]
    out = {
        "requests": len(recs), "succeeded": len(ok),
        "ttft_first_turn": S.distribution([r["ttft"] for r in ok if r["turn"] == 0 and r["ttft"] is not None]),
        "ttft_later_turns": S.distribution([r["ttft"] for r in ok if r["turn"] and r["ttft"] is not None]),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": None if None in cached else sum(cached),
        "attainment": m["attainment"]["attainment"],
        "goodput": m["attainment"]["met"] / m["summary"]["duration_s"] if m["summary"]["duration_s"] else None,
        "duration_s": m["summary"]["duration_s"],
    }
    out["computed_tokens"] = None if out["cached_tokens"] is None else out["prompt_tokens"] - out["cached_tokens"]
    if is_nodeserve:
        server = out["server"] = delta(scrape(url), before)
        # The prompt tokens the devices computed, by their counter, against what the client was told was not
        # cached. (Per-device cache hits do not add up to it: a prefix is also loaded from another device or a
        # tier, a disaggregated decode device prefills short prompts when the prefill device is busy, and its
        # hits count the pages a handoff did not copy.)
        out["server_computed"] = sum(server.get("prompt_tokens_computed_total", {}).values())
        out["metrics_agree"] = out["computed_tokens"] == out["server_computed"]
    return out


def table(results: dict) -> str:
    rows = ["| workload | target | TTFT p50 / p99 turn 1 (ms) | TTFT p50 / p99 later turns (ms) | prompt tokens "
            "computed | KV bytes transferred | saved | SLO met | goodput (req/s) | /metrics computed = client's | role "
            "changes |", "|---" * 11 + "|"]

    def ms(d: dict, q: str) -> str:
        return "-" if d.get(q) is None else f"{d[q] * 1000:.0f}"

    for wl, by_target in results["workloads"].items():
        for target, r in by_target.items():
            server = r.get("server") or {}
            sent = sum(server.get("kv_transfer_bytes_sum", {}).values())
            saved = sum(server.get("kv_transfer_saved_bytes_total", {}).values())
            changes = int(sum(server.get("device_role_changes_total", {}).values())) if server else "-"
            comp = "-" if r["computed_tokens"] is None else f"{r['computed_tokens']:,} of {r['prompt_tokens']:,}"
            mib = [("-" if not v else f"{v / 2**20:.1f} MiB") for v in (sent, saved)]
            met = "-" if r["attainment"] is None else f"{r['attainment'] * 100:.0f} %"
            good = "-" if r["goodput"] is None else f"{r['goodput']:.3f}"
            first, later = r["ttft_first_turn"], r["ttft_later_turns"]
            rows.append(f"| {wl} | {target} | {ms(first, 'p50')} / {ms(first, 'p99')} | {ms(later, 'p50')} / "
                        f"{ms(later, 'p99')} | {comp} | {mib[0]} | {mib[1]} | {met} | {good} | "
                        f"{ {True: 'yes', False: 'NO', None: '-'}[r.get('metrics_agree')] } | {changes} |")
    return "\n".join(rows)


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4))
    for ax, wl in zip(axes if len(workloads) > 1 else [axes], workloads):
        targets = list(results["workloads"][wl])
        p50 = [results["workloads"][wl][t]["ttft_later_turns"].get("p50") or 0 for t in targets]
        p99 = [results["workloads"][wl][t]["ttft_later_turns"].get("p99") or 0 for t in targets]
        x = range(len(targets))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        ax.set_xticks(list(x), targets, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("TTFT of later turns (s)")
        ax.set_title(wl)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
    ap.add_argument("--modes", default="disaggregated,colocated", help="nodeserve modes, comma-separated")
    ap.add_argument("--cache", choices=("both", "on", "off"), default="both", help="nodeserve's prefix cache")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), help="nodeserve forced to a CPU class's kernels")
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    workloads = {"multi-turn chat": W.multi_turn(args.conversations, 0, spec=CHAT),
                 "agent loop": agent_loop(args.agents, args.calls)}
    results: dict = {"machine": serve.machine(), "args": vars(args), "workloads": {w: {} for w in workloads}}
    targets = [(f"nodeserve {mode}, cache {'on' if on else 'off'}", mode, on)
               for mode in args.modes.split(",") for on in (True, False) if args.cache in ("both", "on" if on else "off")]
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode, on in targets:
            proc, url = local_server.start_server(mode, "auto", tmp, os.path.join(args.out, "server.log"),
                                                  kv_extra=f"prefix_cache = {'true' if on else 'false'}",
                                                  env=nodeserve_env(args.cpu_class))
            try:
                model = serve.default_model(url, {})
                for wl, reqs in workloads.items():
                    t = time.perf_counter()
                    results["workloads"][wl][name] = r = run_workload(url, model, reqs, args.concurrency, {}, True)
                    print(f"{wl:16} {name:36} later-turn TTFT p50 {r['ttft_later_turns'].get('p50')}, computed "
                          f"{r['computed_tokens']} of {r['prompt_tokens']} ({time.perf_counter() - t:.0f} s)", flush=True)
            finally:
                L.stop(proc)
        if not args.no_llama:
            srv = L.start(slots=args.concurrency, slot_ctx=4096, log_path=os.path.join(args.out, "llama.log"),
                          passive=True)
            results["llama_server"] = {"backend": srv.backend, "version": srv.version, "note": srv.note}
            try:
                model = serve.default_model(srv.url, {})
                for wl, reqs in workloads.items():
                    results["workloads"][wl]["llama-server"] = r = run_workload(
                        srv.url, model, reqs, args.concurrency, {"cache_prompt": True}, False)
                    print(f"{wl:16} llama-server later-turn TTFT p50 {r['ttft_later_turns'].get('p50')}", flush=True)
            finally:
                L.stop(srv.proc)
    with open(os.path.join(args.out, "prefix.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = table(results)
    with open(os.path.join(args.out, "prefix.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    print(plot(results, os.path.join(args.out, "prefix_ttft.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
