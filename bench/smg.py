"""SMG (`smg launch`) in front of two one-core nodeserve nodes, against one one-core node alone.

Two nodes are started once, each a colocated node on one core (cpu:0 and cpu:1), plus a router per configuration;
every node's prefix cache is flushed (POST /flush_cache) before each configuration, so each starts cold.

1. Multi-turn chat: `--conversations` (odd, so round_robin cannot pin conversations to nodes by parity) x
   `--turns`, each conversation with its own `--system-tokens`-word system prompt and a growing history, all
   conversations at once (a conversation sends its next turn when its previous answer is complete). Streamed
   chat with `ignore_eos`, so every answer has exactly `--max-tokens` tokens. Per configuration: prefix hit share
   (usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens, checked against the nodes' own
   vllm:prefix_cache_hits_total / vllm:prompt_tokens_total), TTFT p50/p99 of all turns and of later turns,
   requests/s, output tokens/s, failures, and how many requests each node served (SMG's
   x-smg-routed-worker-id header).
2. Short chat throughput: `--short-chats` short independent chats per node at `--short-concurrency` per node
   (one node: C clients; two nodes behind SMG: 2C clients, so each node sees the same load), with the CPU time
   the router, the client (this process) and each node used meanwhile (/proc), since all of them share the
   machine's cores.

    python bench/smg.py [--conversations 9] [--turns 4] [--short-chats 160] [--short-concurrency 16]
Results: bench/results/smg/smg.json and smg.md; the router's and the nodes' logs next to them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
import serve  # noqa: E402
import stats as S  # noqa: E402
import workloads as W  # noqa: E402

OUT_DIR = out_path("smg")
SMG = shutil.which("smg", path=os.path.dirname(sys.executable)) or shutil.which("smg")
MODEL = "smollm2"
# The recipe (deploy/smg/README.md): cache_aware, tuned. A match of the chat template's preamble alone (a third of a
# short chat's text) no longer pins a request to the node that saw it first (--cache-threshold 0.5, default 0.3),
# and a node 4 requests (and 1.5x) busier than the other spills to it (default 64). No cache hit is diverted to a
# "thin" node (SMG's warm-up slices for misses stay on): a diverted hit moves a conversation away from its cache.
RECIPE = ["--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "4",
          "--balance-rel-threshold", "1.5", "--worker-warmup-divert-every", "0"]
ROUTER_COMMON = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                 "--health-success-threshold", "1", "--load-monitor-interval", "2", "--log-level", "info"]
CONFIGS = {  # name -> smg arguments (None: one node, no router)
    "one node": None,
    "round_robin": ["--policy", "round_robin"],
    "cache_aware (defaults)": ["--policy", "cache_aware"],
    "cache_aware (recipe)": RECIPE,
    "cache_aware (recipe + no warm-up)": RECIPE + ["--worker-warmup-secs", "0"],
    "prefix_hash": ["--policy", "prefix_hash"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, method: str = "GET") -> str:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as r:
        return r.read().decode()


def wait_for(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


def start_node(core: int, tmp: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """A one-core node: colocated mode with the one device cpu:<core>, and the whole process (its HTTP event loop
    and tokenizer threads too, which nodeserve does not pin) kept on that core, so one node alone cannot borrow
    the other core. Host KV tier and start-up profile off."""
    port = free_port()
    path = os.path.join(tmp, f"node{core}.toml")
    with open(path, "w") as f:
        f.write(f'[model]\npath = "smollm2-135m-instruct"\nname = "{MODEL}"\n[server]\nhost = "127.0.0.1"\n'
                f'port = {port}\n[devices]\nmode = "colocated"\ndevices = ["cpu:{core}"]\n'
                f'[kv]\nmemory_gib = 1.0\nhost_memory_gib = 0\n[profile]\nstartup = false\n')
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nodeserve", "run", "--config", path],
                                stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    url = f"http://127.0.0.1:{port}"
    wait_for(f"node on cpu:{core}", lambda: proc.poll() is None and json.loads(get(url + "/health")), 300)
    return proc, url


def start_router(args: list[str], workers: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *ROUTER_COMMON, *args]
    with open(log_path, "ab") as log:
        log.write(f"\n#### {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        # Healthy, and polled once: until its first load report a node is scored by SMG's own in-flight count
        # while the other is scored by its report, and cache_aware's fallback then sent 8 of 9 new conversations
        # to one node (they stay there: affinity).
        ws = json.loads(get(url + "/workers"))["workers"]
        return len(ws) == len(workers) and all(w["is_healthy"] and w.get("engine_load") for w in ws)
    wait_for("smg to list every node healthy and polled", ready, 60)
    return proc, url


def wait_quiet(limit_s: float, cores: float = 0.2) -> float:
    """Waits (at most limit_s) until the machine's other jobs use under `cores` cores over 3 s, since they share
    the cores with the nodes; returns what they used at the last look (reported next to the results)."""
    deadline = time.monotonic() + limit_s
    while True:
        t, busy = time.monotonic(), busy_seconds()
        time.sleep(3)
        used = (busy_seconds() - busy) / (time.monotonic() - t)
        if used < cores or time.monotonic() > deadline:
            return used


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU time every process on the machine has used so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def node_counters(url: str) -> dict[str, float]:
    text = get(url + "/metrics")
    out = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))
    return out


# ---- the client -------------------------------------------------------------------------------------------

async def chat(session, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: its record (ok, ttft, e2e, usage, the node SMG chose, the answer's text)."""
    import aiohttp

    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec: dict = {"ok": False, "status": None, "error": None, "ttft": None, "usage": None, "worker": None}
    parts: list[str] = []
    done = False
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=600)) as r:
            rec["status"] = r.status
            rec["worker"] = r.headers.get("x-smg-routed-worker-id")
            if r.status != 200:
                rec["error"] = (await r.text())[:300]
            else:
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        rec["error"] = str(obj["error"])[:300]
                    rec["usage"] = obj.get("usage") or rec["usage"]
                    for c in obj.get("choices") or ():
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            if rec["ttft"] is None:
                                rec["ttft"] = time.perf_counter() - t0
                            parts.append(piece)
    except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["e2e"] = time.perf_counter() - t0
    rec["ok"] = done and rec["error"] is None and rec["usage"] is not None
    rec["text"] = "".join(parts)
    return rec


def conversations(n: int, turns: int, system_tokens: int, user_tokens: int, seed: int) -> list[dict]:
    """Each conversation: its own system prompt (a document it is about) and its turns' user messages."""
    out = []
    for c in range(n):
        rng = random.Random(f"smg-conversation-{seed}-{c}")
        out.append({"system": f"Conversation {c}. Answer questions about this document. "
                              + W.make_prompt(rng, system_tokens, mode="text"),
                    "users": [f"Question {t + 1}: " + W.make_prompt(rng, user_tokens, mode="text")
                              for t in range(turns)]})
    return out


async def run_conversations(url: str, convs: list[dict], max_tokens: int) -> tuple[list[dict], float]:
    import aiohttp

    records: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(conv: dict) -> None:
            messages = [{"role": "system", "content": conv["system"]}]
            for turn, user in enumerate(conv["users"]):
                messages.append({"role": "user", "content": user})
                rec = await chat(session, url, messages, max_tokens)
                rec["turn"] = turn
                records.append(rec)
                if not rec["ok"]:
                    return  # the rest of this conversation would not be the same conversation
                messages.append({"role": "assistant", "content": rec.pop("text")})
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in convs))
        return records, time.perf_counter() - t0


async def run_short(url: str, n: int, concurrency: int, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    import aiohttp

    rng = random.Random(f"smg-short-{seed}")
    prompts = [W.make_prompt(rng, rng.randint(20, 60), mode="text") for _ in range(n)]
    it = iter(prompts)
    records: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            for p in it:
                rec = await chat(session, url, [{"role": "user", "content": p}], max_tokens)
                rec.pop("text")
                records.append(rec)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def summarize(records: list[dict], duration: float) -> dict:
    ok = [r for r in records if r["ok"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in ok)
    output = sum(r["usage"]["completion_tokens"] for r in ok)
    by_worker: dict[str, int] = {}
    for r in ok:
        by_worker[r["worker"] or "direct"] = by_worker.get(r["worker"] or "direct", 0) + 1
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({f"{r['status']}: {r['error']}" for r in records if not r["ok"]})[:5],
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_share": cached / prompt if prompt else None,
        "ttft": S.distribution([r["ttft"] for r in ok if r["ttft"] is not None]),
        "ttft_later_turns": S.distribution([r["ttft"] for r in ok if r.get("turn") and r["ttft"] is not None]),
        "duration_s": duration, "requests_per_s": len(ok) / duration, "output_tokens_per_s": output / duration,
        "output_tokens": output, "by_worker": by_worker,
    }


# ---- one configuration ------------------------------------------------------------------------------------

def measure(name: str, smg_args: list[str] | None, nodes: list[tuple[subprocess.Popen, str]], work, log_path: str,
            quiet_s: float) -> dict:
    """Flushes every node's cache, waits for the machine to be quiet (at most quiet_s), starts the router (unless
    one node alone), runs work(url) and reports it with the nodes' counters and everyone's CPU time."""
    urls = [u for _, u in nodes]
    used = nodes[:1] if smg_args is None else nodes
    for u in urls:
        get(u + "/flush_cache", "POST")
    background = wait_quiet(quiet_s)
    router = None
    url = urls[0]
    if smg_args is not None:
        router, url = start_router(smg_args, urls, log_path)
    try:
        before = {u: node_counters(u) for _, u in used}
        cpu0 = {"client": time.process_time(), "all": busy_seconds(), **{u: cpu_seconds(p.pid) for p, u in used}}
        if router:
            cpu0["router"] = cpu_seconds(router.pid)
        records, duration = work(url)
        cpu = {"client": time.process_time() - cpu0["client"],
               **{u: cpu_seconds(p.pid) - cpu0[u] for p, u in used}}
        if router:
            cpu["router"] = cpu_seconds(router.pid) - cpu0["router"]
        # Whatever else ran on the machine meanwhile (another job's tests, say): it took cores from the nodes.
        cpu["others"] = busy_seconds() - cpu0["all"] - sum(cpu.values())
        after = {u: node_counters(u) for _, u in used}
    finally:
        if router:
            stop(router)
    out = summarize(records, duration)
    hits = sum(after[u]["vllm:prefix_cache_hits_total"] - before[u]["vllm:prefix_cache_hits_total"] for u in after)
    prompt = sum(after[u]["vllm:prompt_tokens_total"] - before[u]["vllm:prompt_tokens_total"] for u in after)
    out["node_hit_share"] = hits / prompt if prompt else None
    out["background_cores_before"] = background
    names = {urls[0]: "node A", urls[1]: "node B"}
    out["cores_used"] = {names.get(k, k): max(v, 0.0) / duration for k, v in cpu.items()}
    out["by_worker"] = {names.get(k, k): v for k, v in out["by_worker"].items()}
    print(f"  {name:24} {out['requests']} requests, {out['failed']} failed, hit share {out['hit_share']:.3f} "
          f"(nodes {out['node_hit_share']:.3f}), TTFT p50 {out['ttft']['p50'] * 1000:.0f} ms, "
          f"{out['requests_per_s']:.2f} req/s, {out['output_tokens_per_s']:.1f} tok/s, {out['by_worker']}, "
          f"cores {', '.join(f'{k} {v:.2f}' for k, v in out['cores_used'].items())}", flush=True)
    return out


def ms(d: dict, q: str) -> str:
    return "-" if d.get(q) is None else f"{d[q] * 1000:.0f}"


def table(res: dict) -> str:
    one = res["multi_turn"].get("one node")
    rows = [] if not one else [
        "| multi-turn | prefix hit share | / one node | TTFT p50 / p99 (ms) | later turns p50 / p99 (ms) | req/s | "
        "output tok/s | failed | requests per node | other jobs (cores) |", "|---" * 10 + "|"]
    for name, r in res["multi_turn"].items() if one else ():
        split = " / ".join(str(v) for _, v in sorted(r["by_worker"].items()))
        rows.append(f"| {name} | {r['hit_share']:.3f} | {r['hit_share'] / one['hit_share']:.2f}x | "
                    f"{ms(r['ttft'], 'p50')} / {ms(r['ttft'], 'p99')} | {ms(r['ttft_later_turns'], 'p50')} / "
                    f"{ms(r['ttft_later_turns'], 'p99')} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f}"
                    f" | {r['failed']} of {r['requests']} | {split} | {r['cores_used']['others']:.2f} |")
    if not res["short_chat"]:
        return "\n".join(rows)
    rows += ["", "| short chat | clients | req/s | output tok/s | / one node | TTFT p50 / p99 (ms) | failed | "
                 "cores used: router / client / nodes / other jobs |", "|---" * 8 + "|"]
    base = res["short_chat"]["one node"]["output_tokens_per_s"]
    for name, r in res["short_chat"].items():
        cores = r["cores_used"]
        nodes = " + ".join(f"{v:.2f}" for k, v in cores.items() if k.startswith("node"))
        rows.append(f"| {name} | {r['clients']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                    f"{r['output_tokens_per_s'] / base:.2f}x | {ms(r['ttft'], 'p50')} / {ms(r['ttft'], 'p99')} | "
                    f"{r['failed']} of {r['requests']} | {cores.get('router', 0):.2f} / {cores['client']:.2f} / "
                    f"{nodes} / {cores['others']:.2f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=9, help="an odd number (round_robin would pin an even one)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=600, help="words in each conversation's system prompt")
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens in each multi-turn answer")
    ap.add_argument("--short-chats", type=int, default=160, help="short chats per node")
    ap.add_argument("--short-concurrency", type=int, default=16, help="clients per node")
    ap.add_argument("--short-max-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="multi-turn configurations, comma-separated (\"\": none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-wait", type=float, default=60,
                    help="seconds to wait, at most, before each configuration for other jobs to leave the CPU")
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()
    if SMG is None:
        sys.exit("smg is not installed: pip install -e '.[test]' (it pins smg==1.13.0)")
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]), "machine": serve.machine(),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": vars(args),
                 "smg": importlib.metadata.version("smg"),
                 "router_flags": ROUTER_COMMON, "recipe": RECIPE, "multi_turn": {}, "short_chat": {}}
    router_log = os.path.join(args.out, "smg.log")
    open(router_log, "w").close()
    tmp = os.path.join(args.out, "tmp")
    os.makedirs(tmp, exist_ok=True)
    nodes = []
    t_start = time.monotonic()
    try:
        for core in (0, 1):
            nodes.append(start_node(core, tmp, os.path.join(args.out, f"node{core}.log")))
        convs = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.seed)
        print(f"multi-turn: {args.conversations} conversations x {args.turns} turns", flush=True)
        for name in filter(None, args.configs.split(",")):
            res["multi_turn"][name] = measure(
                name, CONFIGS[name], nodes,
                lambda url: asyncio.run(run_conversations(url, convs, args.max_tokens)), router_log, args.quiet_wait)
        print(f"short chat: {args.short_chats} chats per node, {args.short_concurrency} clients per node", flush=True)
        for name, smg_args, k in (("one node", None, 1), ("two nodes, SMG cache_aware (recipe)", RECIPE, 2),
                                  ("two nodes, SMG cache_aware (recipe + no warm-up)",
                                   RECIPE + ["--worker-warmup-secs", "0"], 2),
                                  ("two nodes, SMG round_robin", ["--policy", "round_robin"], 2)):
            clients = args.short_concurrency * k
            res["short_chat"][name] = r = measure(
                name, smg_args, nodes, lambda url: asyncio.run(run_short(
                    url, args.short_chats * k, clients, args.short_max_tokens, args.seed)), router_log, args.quiet_wait)
            r["clients"] = clients
    finally:
        for proc, _ in nodes:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    res["total_s"] = time.monotonic() - t_start
    with open(os.path.join(args.out, "smg.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    with open(os.path.join(args.out, "smg.md"), "w") as f:
        f.write(f"`{res['command']}`, {res['date']}, {res['machine']['cpu_model']} "
                f"({res['machine']['logical_cpus']} cores), smg {res['smg']}\n\n{md}\n")
    print(md)
    print(f"total {res['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
