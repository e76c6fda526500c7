"""HTTP fuzz: a real server fed malformed request lines, paths, headers and bodies, and well-formed requests with
mutated JSON on every route. Pass: no 5xx, every well-formed request answered, the server alive and answering a
normal completion after, and no KV page held once it is idle.

Two kinds of request (seeded, `--concurrency` at once):
- raw (~40 %): bytes written on a socket, because aiohttp's client will not send a broken request line: junk
  methods and versions, paths with %0A / %00 / bad escapes / `..` / 8 KiB / non-ASCII, headers without a colon,
  64 KiB headers, duplicate or non-numeric Content-Length, bad Transfer-Encoding, chunked bodies cut short,
  bodies shorter than their Content-Length. A 4xx or a closed connection is fine; a 5xx is not.
- http (~60 %): aiohttp requests to every route (/v1/chat/completions, /v1/completions, /v1/models, /tokenize,
  /health, /metrics, /debug/*...) with any method, odd headers (Content-Type, Authorization, Host, Origin,
  X-Request-Id) and bodies: valid requests with one field mutated (wrong type, out of range, huge, NaN, deep
  nesting, unknown keys), random JSON, invalid UTF-8, empty. Generations are kept short (max_tokens <= 8 unless
  the mutation is max_tokens itself, to an invalid value).

    python bench/fuzz_http.py --requests 10000 --out bench/results/fuzz-http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import cpu_model, start_server  # noqa: E402

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/m", "/tokenize", "/detokenize",
          "/health", "/metrics", "/debug/kv", "/debug/steps", "/debug/profile", "/", "/v1/embeddings", "/v2/x",
          "/v1/chat/completions/", "//v1//completions", "/v1/responses", "/v1/loads", "/flush_cache", "/version",
          "/openapi.json"]  # not /debug/events: the console's feed streams until the client leaves (tests/server)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
ODD_VALUES = [None, True, False, -1, 0, 1.5, 10**30, -10**30, float("nan"), float("inf"), "", "x" * 5000, [], {},
              [[[[[[]]]]]], {"a": {"b": {"c": {}}}}, "\u0000", "\ud7ff\ue000", "🦊" * 100, [1, "a", None]]
BAD_MAX_TOKENS = [-1, "8", 10**30, None, True, 1.5, [], "NaN"]


def mutated_body(rng: random.Random, model: str) -> bytes:
    kind = rng.random()
    if kind < 0.6:
        body = {**json.loads(json.dumps(rng.choice([CHAT, COMPLETION]))), "model": model}
        key = rng.choice(list(body) + ["n", "stop", "logprobs", "top_logprobs", "seed", "top_p", "top_k", "stream",
                                       "stream_options", "response_format", "tools", "tool_choice", "logit_bias",
                                       "presence_penalty", "min_tokens", "echo", "suffix", "user", "unknown_key"])
        value = rng.choice(BAD_MAX_TOKENS) if key == "max_tokens" else rng.choice(ODD_VALUES)
        body[key] = value
        if key == "messages" and rng.random() < 0.5:
            body[key] = [{"role": rng.choice(["user", "system", "tool", "x", None]), "content": rng.choice(ODD_VALUES)}]
        return json.dumps(body, allow_nan=True).encode()
    if kind < 0.75:
        return json.dumps(rng.choice(ODD_VALUES), allow_nan=True).encode()
    if kind < 0.85:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # invalid UTF-8, not JSON
    if kind < 0.9:
        return b"[" * 10000 + b"]" * 10000  # deep nesting
    return b""


def odd_headers(rng: random.Random) -> dict[str, str]:
    h: dict[str, str] = {"Content-Type": "application/json"}
    if rng.random() < 0.2:
        h["Content-Type"] = rng.choice(["application/json", "text/plain", "application/json; charset=latin-1",
                                        "multipart/form-data; boundary=x", "", "application/x-www-form-urlencoded"])
    if rng.random() < 0.3:
        h["Authorization"] = rng.choice(["Bearer ", "Bearer " + "a" * 4000, "Basic Zm9vOmJhcg==", "bearer x"])
    if rng.random() < 0.2:
        h["Origin"] = rng.choice(["http://evil.example", "null", "http://127.0.0.1:1"])
    if rng.random() < 0.2:
        h["X-Request-Id"] = rng.choice(["a" * 300, "id\twith\ttabs", "ok-1"])
    return h


def raw_request(rng: random.Random, port: int, model: str) -> bytes:
    method = rng.choice(METHODS + ["GE T", "FOO", "", "POST\x00"])
    path = rng.choice(ROUTES) + rng.choice(["", "%0Afake", "%00", "%zz", "/../../etc/passwd", "?a=%", "?" + "b" * 8000,
                                            "/\u00e9t\u00e9", "#frag", " extra"])
    version = rng.choice(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "HTTP/1.1 junk"])
    lines = [f"{method} {path} {version}".strip(), f"Host: {rng.choice(['127.0.0.1:' + str(port), 'evil', ''])}"]
    body = mutated_body(rng, model) if rng.random() < 0.7 else b""
    shape = rng.random()
    if shape < 0.15:
        lines.append("NoColonHeader")
    elif shape < 0.25:
        lines.append("X-Big: " + "h" * 65536)
    elif shape < 0.35:
        lines += [f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 5}"]
    elif shape < 0.45:
        lines.append(f"Content-Length: {rng.choice(['abc', '-5', '1e3', ' ', '99999999999999999999'])}")
    elif shape < 0.55:
        lines.append("Transfer-Encoding: " + rng.choice(["chunked", "gzip", "chunked, identity", "xchunked"]))
        body = rng.choice([b"5\r\nhello\r\n", b"zz\r\nx\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", body])
    elif shape < 0.65:
        lines.append(f"Content-Length: {len(body) + 100}")  # a body shorter than it says, then the socket closes
    else:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body


async def send_raw(data: bytes, port: int) -> str:
    """The response's status code, or 'closed' when the server closed without one (fine for broken HTTP)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except OSError:
        return "connect-failed"
    try:
        writer.write(data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        parts = line.split()
        return parts[1].decode() if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else "closed"
    except (OSError, asyncio.IncompleteReadError):
        return "closed"
    except asyncio.TimeoutError:
        return "timeout"
    finally:
        writer.close()


async def send_http(session: aiohttp.ClientSession, url: str, rng: random.Random, model: str) -> tuple[str, str]:
    method = rng.choice(["POST"] * 4 + METHODS)
    path = rng.choice(["/v1/chat/completions", "/v1/completions"]) if rng.random() < 0.5 else rng.choice(ROUTES)
    body = mutated_body(rng, model) if method in ("POST", "PUT", "PATCH") else None
    headers = odd_headers(rng)
    what = f"{method} {path} {sorted(headers)} {(body or b'')[:120]!r}"
    try:
        async with session.request(method, url + path, data=body, headers=headers) as r:
            await r.read()
            return str(r.status), what
    except aiohttp.ClientPayloadError as e:
        return "payload-error", f"{what} {e!r}"
    except (aiohttp.ClientError, OSError) as e:
        return "dropped", f"{what} {e!r}"
    except asyncio.TimeoutError:
        return "timeout", what


async def run(url: str, num: int, concurrency: int, seed: int, model: str) -> tuple[Counter, list]:
    port = int(url.rsplit(":", 1)[1])
    rng = random.Random(seed)
    plans = [(i, rng.random() < 0.4, random.Random(rng.getrandbits(64))) for i in range(num)]
    counts: Counter = Counter()
    bad: list = []
    queue: asyncio.Queue = asyncio.Queue()
    for p in plans:
        queue.put_nowait(p)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def worker() -> None:
            while not queue.empty():
                i, raw, r = queue.get_nowait()
                if raw:
                    data = raw_request(r, port, model)
                    status, what = await send_raw(data, port), repr(data[:160])
                else:
                    status, what = await send_http(session, url, r, model)
                kind = "raw" if raw else "http"
                counts[f"{kind} {status}"] += 1
                # broken HTTP may be closed without an answer; a well-formed request must get one, never a 5xx
                if status.startswith("5") or status in ("timeout", "connect-failed") or \
                        (not raw and status in ("dropped", "payload-error")):
                    bad.append({"i": i, "kind": kind, "status": status, "request": what})
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts, bad


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def after_checks(url: str, model: str) -> dict:
    """A normal completion still answers, and the server goes idle with every page free."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**COMPLETION, "model": model}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        ok = r.status == 200 and bool(json.loads(r.read())["choices"][0]["text"])
    held = None
    for _ in range(200):
        kv = get_json(url + "/debug/kv")
        held = sum(p["num_pages"] - p["num_free"] for p in kv["pools"])
        if held == 0 and kv.get("num_pending", 0) == 0:
            break
        time.sleep(0.1)
    return {"completion_ok": ok, "held_pages": held}


def fuzz(url: str, num: int, concurrency: int, seed: int) -> dict:
    model = get_json(url + "/v1/models")["data"][0]["id"]
    t0 = time.monotonic()
    counts, bad = asyncio.run(run(url, num, concurrency, seed, model))
    result = {"requests": num, "seconds": round(time.monotonic() - t0, 1), "statuses": dict(sorted(counts.items())),
              "failures": bad[:50], "num_failures": len(bad), **after_checks(url, model)}
    result["passed"] = not bad and result["completion_ok"] and result["held_pages"] == 0
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/fuzz-http.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        proc, url = start_server("disaggregated", "auto", tmp, log)
        try:
            result = fuzz(url, args.requests, args.concurrency, args.seed)
            result["server_alive"] = proc.poll() is None
            result["passed"] = result["passed"] and result["server_alive"]
        finally:
            proc.terminate()
            proc.wait(60)
    result = {"command": " ".join(["python"] + sys.argv), "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **result}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
