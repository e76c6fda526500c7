"""Soak: a real server under a long mixed load, with client disconnects; then no leaked pages, no RSS creep, no 5xx
and no latency drift. One run with `--duration 3600` is the issue's one-hour soak.

Starts a real nodeserve server (subprocess, temp config, free port), warms it up (20 s of the same mix, so the
schemas compile and lazy allocations happen first), then for `--duration` seconds (or `--minutes`; exactly one)
keeps `--concurrency` clients busy with a mix of requests:

- chat and completions, streamed and not; mostly short prompts, ~10 % of those long (~1500 tokens);
- random max_tokens (1..96), some with stop strings, some with n=2, some seeded sampling, some ignore_eos;
- tools (~12 %): OpenAI `tools` with two function schemas and tool_choice "auto", "required" or a named
  function, some with a history holding a tool call and its result, some behind a shared system prompt;
- structured output (~12 %): `response_format` json_schema, one of a handful of small schemas reused (compiled
  once, then cached), ~3 % of them a fresh schema never seen before (a compile);
- shared prefixes (~10 %): one of three long system prompts (~400, ~800, ~1200 tokens) with a short question;
- multi-turn conversations (~12 %): a few conversations whose history grows turn by turn (each turn's prompt is
  the previous prompt + the real answer + a new user message) until ~1400 prompt tokens, then start again;
  a small `--kv-memory-gib` (e.g. 0.1 GiB: ~145 pages, ~2,300 tokens a device) keeps the prefix cache (and the
  `--kv-extra` host/disk tiers) evicting throughout;
- ~6 % bad requests (invalid JSON, missing fields, out-of-range values, unknown model, prompt over the context)
  that must come back 4xx;
- with probability `--disconnect-prob` a client gives up: a streaming one closes the connection after a random
  number of SSE events (0 = right after the headers, i.e. usually during prefill or while a grammar compiles),
  a non-streamed one sets a short client timeout (0.05-3 s: queued, prefilling or decoding). A request counts
  as *aborted* only if the client really gave up before the response was complete.

Per request it records kind, status, aborted, completed, send time, TTFT (streamed: the first chunk with
content or a tool call), latency. *Completed* means: streamed -> got `data: [DONE]` with no error event and a
finish_reason for every choice; not streamed -> 200 JSON whose every choice has a finish_reason; and for a
structured request whose choice finished ("stop" / "tool_calls", not "length"): the content validates against
its schema, a forced tool_choice produced a call whose arguments validate against the function's parameters, and
every tool call's arguments are a JSON object; bad request -> the 4xx JSON error it should get. *Failed* =
unexpected status (5xx, 4xx for a good request, 2xx for a bad one) or a connection error. *5xx* = a 5xx status or
an error event inside a 200 stream (how the server reports a 500/504 once streaming has begun).

While it runs it samples the server's RSS (VmRSS from /proc/<pid>/status) every `--rss-interval` seconds. At
the end it stops sending, waits for every in-flight request, waits for the server to go idle (`/debug/kv`:
nothing pending, running or waiting, every page free), reads /metrics and reports:

- requests sent / completed / aborted / failed, 5xx, per kind; tools requests completed and how many carried
  tool_calls, json_schema requests completed, invalid structured outputs;
- leaked pages (sum over pools of num_pages - num_free once idle, plus host slots held; must be 0);
- RSS: before the load; growth after the soak's warm-up (the first 10 % of the run or 5 minutes, whichever is
  smaller) in MiB and %: the median of the samples in the run's last window against the median of those in the
  window right after the warm-up, window = a twelfth of the run, 1 to 5 minutes (one hour: minutes 5-10 against
  55-60); the first sample after the warm-up and the idle end, for the record; and a plateau check: the
  least-squares slope in MiB/min over the first and the second half of the samples after warm-up (a plateau:
  the second half's slope near 0);
- latency windows: requests by send time in the first and the last window of the run, window = min(10 min,
  duration / 6) (one hour: the first and last 10 minutes; one minute: 10 s): p50/p99 of TTFT (streamed) and of
  e2e latency, over completed, non-aborted good requests; the ratios last / first;
- role changes (`nodeserve:device_role_changes_total`, adaptive mode): in all and during the soak;
- a verdict, PASS iff: RSS growth after warm-up < 2 %; 0 leaked pages; 0 5xx; e2e p99 of the last window within
  10 % of the first (last <= 1.10 x first; *not judged* when either window has fewer than 20 requests, which
  only short runs do: said so, not a failure); every non-aborted request completed; the server lived.

    python bench/soak.py --duration 3600 --mode adaptive --concurrency 8 --kv-memory-gib 0.1 \\
        --kv-extra 'host_memory_gib = 0.2' --out bench/results/soak-1h.json
    python bench/soak.py --minutes 1 --mode adaptive --concurrency 8 --kv-memory-gib 0.1   # a smoke check

Exit code 1 on FAIL. Writes JSON (`--out`) with the exact command, the machine (CPU model from /proc/cpuinfo),
the date, the summary, the RSS report and samples, the latency windows, the criteria, the server's counters and
every request record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import out_path  # noqa: E402
from local_server import MODES, cpu_model, start_server  # noqa: E402  (bench/ is scripts, not a package)


SHORT_TOPICS = ["the sea", "prime numbers", "a red bicycle", "the moon landing", "bread", "a lighthouse",
                "rain in spring", "compilers", "an old library", "the color blue"]
STOP_CHOICES = [["\n"], ["."], [" the", ","], ["\n\n", "!"], ["zzzz-never"]]
CITIES = ["Paris", "Lima", "Oslo", "Tokyo", "Nairobi", "Quito", "Hanoi", "Perth", "Dakar", "Riga"]

# Tools as tests/server/test_tools_api.py sends them (Hermes calls; SmolLM2's template gets nodeserve's fallback).
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": TIME_PARAMS}}]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A handful of small schemas, reused: each compiles once and is then served from the compile cache.
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                                      "reason": {"type": "string", "maxLength": 30}},
     "required": ["answer", "confidence", "reason"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "unit"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
]
SCHEMA_QUESTIONS = ["Is the sky blue?", "Describe a person.", "What is the weather like in Oslo?",
                    "Give me some numbers.", "Which colors are in a rainbow?"]
FRESH_SCHEMA_PROB = 0.03
WORDS = ["alpha", "river", "stone", "seven", "quiet", "window", "paper", "orange", "north", "signal", "garden",
         "copper", "winter", "market", "silver", "forest", "engine", "harbor", "letter", "bridge"]

# The verdict's thresholds (issue #26).
RSS_GROWTH_LIMIT_PCT = 2.0       # RSS growth after warm-up
P99_RATIO_LIMIT = 1.10           # e2e p99, last window / first window
MIN_WINDOW_SAMPLES = 20          # fewer completed requests in a window: the p99 ratio is not judged
WARMUP_FRACTION, WARMUP_MAX_S = 0.10, 300.0
WINDOW_FRACTION, WINDOW_MAX_S = 1 / 6, 600.0
RSS_WINDOW_FRACTION, RSS_WINDOW_MIN_S, RSS_WINDOW_MAX_S = 1 / 12, 60.0, 300.0


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


def is_5xx(rec: dict) -> bool:
    """A 5xx status, or an error event inside a 200 stream (a 500/504 after the headers went out)."""
    status = rec.get("status")
    return (status is not None and status >= 500) or bool(rec.get("stream_error"))


def summarize(records: list[dict]) -> dict:
    """Counts over the per-request records."""
    sent = len(records)
    aborted = sum(1 for r in records if r.get("aborted"))
    completed = sum(1 for r in records if r.get("completed") and not r.get("aborted"))
    failed = sum(1 for r in records if is_failed(r))
    not_completed = [r for r in records if not r.get("aborted") and not r.get("completed")]
    ok = [r for r in records if r.get("completed") and not r.get("aborted") and not r.get("bad")]
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
    tools = [r for r in ok if r["kind"] == "tools"]
    schema = [r for r in ok if r["kind"] == "json_schema"]
    return {
        "sent": sent, "completed": completed, "aborted": aborted, "failed": failed,
        "not_aborted_not_completed": len(not_completed),
        "http_5xx": sum(1 for r in records if is_5xx(r)),
        "stream_error_events": sum(1 for r in records if r.get("stream_error")),
        "bad_requests": sum(1 for r in records if r.get("bad")),
        "long_prompts": sum(1 for r in records if r.get("long")),
        "n2": sum(1 for r in records if r.get("n", 1) > 1),
        "with_stop": sum(1 for r in records if r.get("stop")),
        "aborted_streams": sum(1 for r in records if r.get("aborted") and r.get("stream")),
        "aborted_non_streamed": sum(1 for r in records if r.get("aborted") and not r.get("stream")),
        "tools_completed": len(tools),
        "tools_with_tool_calls": sum(1 for r in tools if r.get("tool_calls", 0) > 0),
        "tools_forced_completed": sum(1 for r in tools if r.get("tool_choice") not in (None, "auto")),
        "json_schema_completed": len(schema),
        "json_schema_fresh_completed": sum(1 for r in schema if r.get("fresh_schema")),
        "structured_invalid": sum(1 for r in records if r.get("invalid_output")),
        "shared_prefix_completed": sum(1 for r in ok if r["kind"] == "shared_prefix"),
        "multiturn_completed": sum(1 for r in ok if r["kind"] == "multiturn"),
        "multiturn_max_turn": max((r.get("turn", 0) for r in ok if r["kind"] == "multiturn"), default=0),
        "max_prompt_tokens": max((r.get("prompt_tokens") or 0 for r in ok), default=0),
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


def warmup_seconds(duration_s: float) -> float:
    """The soak's warm-up: the first 10 % of the run or 5 minutes, whichever is smaller."""
    return min(WARMUP_FRACTION * duration_s, WARMUP_MAX_S)


def window_seconds(duration_s: float) -> float:
    """The latency windows' length: a sixth of the run, at most 10 minutes (one hour: 10 min; one minute: 10 s)."""
    return min(WINDOW_FRACTION * duration_s, WINDOW_MAX_S)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value units per minute; None under 2 distinct times."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 60


def rss_window_seconds(duration_s: float) -> float:
    """The RSS windows' length: a twelfth of the run, at least one minute (one heap-trim cycle) and at most five
    (one hour: 5 min; ten minutes: 1 min)."""
    return min(max(RSS_WINDOW_FRACTION * duration_s, RSS_WINDOW_MIN_S), RSS_WINDOW_MAX_S)


def rss_report(samples: list[tuple[float, int]], duration_s: float, end_kib: int | None = None,
               before_kib: int | None = None, warmup_s: float | None = None) -> dict:
    """RSS growth after the warm-up (warmup_s, default warmup_seconds(duration_s)): the median of the samples in
    the last rss_window_seconds of the run against the median of those in the same length of time right after
    the warm-up, in MiB and % (the judged figure); the peak; the least-squares slope (MiB/min) over the first and
    the second half (by time) of the samples from the warm-up on; and, for the record, the first sample after the
    warm-up and the idle end (`end_kib`, else the last sample). samples: (s, KiB).

    Why medians of windows: the server trims the C heap every minute (runtime/memory.heap_trim_loop), so single
    samples swing +-40 MiB around it, and one sample against another was mostly where each fell in that cycle
    (the same hour read -0.13 % or +2.6 % by the two forms: bench/README.md)."""
    warm = warmup_seconds(duration_s) if warmup_s is None else warmup_s
    after = [(t, kib) for t, kib in samples if t >= warm]
    before = None if before_kib is None else round(before_kib / 1024, 1)
    window = min(rss_window_seconds(duration_s), max(0.0, duration_s - warm) / 2)
    out: dict = {"warmup_s": round(warm, 1), "window_s": round(window, 1), "before_load_mib": before,
                 "first_window_median_mib": None, "last_window_median_mib": None, "growth_mib": None,
                 "growth_pct": None, "after_warmup_mib": None, "end_mib": None, "max_mib": None,
                 "slope_first_half_mib_per_min": None, "slope_second_half_mib_per_min": None,
                 "num_samples": len(samples), "num_samples_after_warmup": len(after)}
    if not after:
        return out
    end = end_kib if end_kib is not None else samples[-1][1]
    t_last = after[-1][0]
    first_w = [kib for t, kib in after if t < after[0][0] + window] or [after[0][1]]
    last_w = [kib for t, kib in after if t > t_last - window] or [after[-1][1]]
    start, stop = statistics.median(first_w), statistics.median(last_w)
    mid = (after[0][0] + t_last) / 2
    first = [(t, kib / 1024) for t, kib in after if t <= mid]
    second = [(t, kib / 1024) for t, kib in after if t >= mid]
    r = lambda x: None if x is None else round(x, 2)  # noqa: E731
    out.update(first_window_median_mib=round(start / 1024, 1), last_window_median_mib=round(stop / 1024, 1),
               growth_mib=round((stop - start) / 1024, 1), growth_pct=round(100 * (stop - start) / start, 2),
               after_warmup_mib=round(after[0][1] / 1024, 1), end_mib=round(end / 1024, 1),
               max_mib=round(max([end] + [kib for _, kib in after]) / 1024, 1),
               slope_first_half_mib_per_min=r(slope_per_min(first)),
               slope_second_half_mib_per_min=r(slope_per_min(second)))
    return out


def _stats(values: list[float]) -> dict:
    p = lambda q: None if not values else round(percentile(values, q), 3)  # noqa: E731
    return {"n": len(values), "p50_s": p(50), "p99_s": p(99)}


def latency_windows(records: list[dict], duration_s: float) -> dict:
    """TTFT (streamed) and e2e p50/p99 over completed, non-aborted good requests sent in the first and in the last
    window_seconds(duration_s) of the run (by send time `t_send_s`), and the ratios last / first."""
    w = window_seconds(duration_s)
    spans = {"first": (0.0, w), "last": (duration_s - w, duration_s)}
    ok = [r for r in records if r.get("completed") and not r.get("aborted") and not r.get("bad")
          and r.get("t_send_s") is not None]
    out: dict = {"window_s": round(w, 1)}
    for name, (a, b) in spans.items():
        inside = [r for r in ok if (a <= r["t_send_s"] < b if name == "first" else r["t_send_s"] >= a)]
        out[name] = {"from_s": round(a, 1), "to_s": round(b, 1),
                     "ttft": _stats([r["ttft_s"] for r in inside if r.get("stream") and r.get("ttft_s") is not None]),
                     "e2e": _stats([r["latency_s"] for r in inside if r.get("latency_s") is not None])}
    ratio = {}
    for metric in ("ttft", "e2e"):
        for q in ("p50_s", "p99_s"):
            f, l = out["first"][metric][q], out["last"][metric][q]
            ratio[f"{metric}_{q[:-2]}"] = round(l / f, 3) if f and l is not None else None
    out["ratio_last_first"] = ratio
    return out


def verdict(summary: dict, leaked: int | None, server_alive: bool = True, rss: dict | None = None,
            windows: dict | None = None) -> tuple[bool, list[str]]:
    """Pass iff no page leaked, every request the client did not abort completed, no 5xx, the server lived, and,
    when given, RSS grew < RSS_GROWTH_LIMIT_PCT after warm-up (rss_report) and the last window's e2e p99 is
    within P99_RATIO_LIMIT of the first's (latency_windows; not judged with < MIN_WINDOW_SAMPLES in a window)."""
    reasons = []
    if leaked is None:
        reasons.append("could not read /debug/kv after the run")
    elif leaked > 0:
        reasons.append(f"{leaked} KV pages still held after the server went idle")
    if not summary["all_non_aborted_completed"]:
        reasons.append(f"{summary['not_aborted_not_completed']} requests that were not aborted did not complete")
    if summary.get("http_5xx", 0):
        reasons.append(f"{summary['http_5xx']} 5xx responses (statuses or stream error events)")
    if not server_alive:
        reasons.append("the server process exited during the run")
    if rss is not None:
        if rss.get("growth_pct") is None:
            reasons.append("no RSS sample after the warm-up")
        elif rss["growth_pct"] >= RSS_GROWTH_LIMIT_PCT:
            reasons.append(f"RSS grew {rss['growth_pct']:.2f} % after warm-up (limit {RSS_GROWTH_LIMIT_PCT:g} %)")
    if windows is not None and p99_judged(windows):
        ratio = windows["ratio_last_first"]["e2e_p99"]
        if ratio is None or ratio > P99_RATIO_LIMIT:
            reasons.append(f"e2e p99 of the last window is {ratio}x the first's (limit {P99_RATIO_LIMIT:g}x)")
    return not reasons, reasons


def p99_judged(windows: dict) -> bool:
    """Whether both windows hold enough completed requests for their e2e p99 ratio to be judged."""
    return min(windows["first"]["e2e"]["n"], windows["last"]["e2e"]["n"]) >= MIN_WINDOW_SAMPLES


def check_output(spec: dict, outputs: list[dict]) -> str | None:
    """What is wrong with a structured request's choices (None: nothing). outputs: per choice {"finish",
    "content", "calls": [{"name", "arguments"}]}. A choice cut by max_tokens ("length") is not checked."""
    for o in outputs:
        if o.get("finish") == "length":  # a call's arguments streamed as they came may stop mid-JSON, as OpenAI's
            continue
        for c in o.get("calls") or []:
            try:
                args = json.loads(c.get("arguments") or "")
            except ValueError:
                return f"tool call arguments are not JSON: {c.get('arguments')!r}"[:200]
            if not isinstance(args, dict):
                return f"tool call arguments are not an object: {c.get('arguments')!r}"[:200]
        choice = spec.get("tool_choice")
        if spec["kind"] == "tools" and choice not in (None, "auto"):
            calls = o.get("calls") or []
            if o.get("finish") != "tool_calls" or len(calls) != 1:
                return f"forced tool_choice gave finish {o.get('finish')!r} with {len(calls)} calls"
            name = calls[0].get("name")
            if isinstance(choice, dict) and name != choice["function"]["name"]:
                return f"named tool_choice {choice['function']['name']!r} called {name!r}"
            if name not in TOOL_PARAMS:
                return f"called an unknown function {name!r}"
            err = _schema_error(json.loads(calls[0]["arguments"]), TOOL_PARAMS[name])
            if err:
                return f"arguments of {name}: {err}"
        if spec["kind"] == "json_schema":
            try:
                value = json.loads(o.get("content") or "")
            except ValueError:
                return f"json_schema content is not JSON: {o.get('content')!r}"[:200]
            err = _schema_error(value, spec["schema"])
            if err:
                return f"json_schema content does not validate: {err}"[:200]
    return None


def _schema_error(value, schema: dict) -> str | None:
    try:
        import jsonschema
    except ImportError:  # the test extras have it; without it, only the JSON parse is checked
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return e.message[:150]
    return None


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


COUNTERS = (("request_success", "finished_reason"), ("request_rejected", "reason"),
            ("device_role_changes", "device"), ("prefix_cache_queries", "device"), ("prefix_cache_hits", "device"),
            ("kv_tier_evictions", "tier"), ("kv_tier_hit_tokens", "tier"), ("event_loop_stalls", "cause"))
# caches bounded by design that fill over hours (their growth is part of the RSS growth, by design)
GAUGES = ("grammar_cache_bytes", "grammar_cache_entries")


def parse_counters(text: str) -> dict:
    """COUNTERS from /metrics text: {name: {label value: count}}; GAUGES summed over their labels under
    "gauges": {name: value}."""
    out: dict[str, dict[str, float]] = {name: {} for name, _ in COUNTERS}
    out["gauges"] = {}
    for line in text.splitlines():
        for g in GAUGES:
            if line.startswith(f"nodeserve:{g}{{") or line.startswith(f"nodeserve:{g} "):
                out["gauges"][g] = out["gauges"].get(g, 0.0) + float(line.rsplit(" ", 1)[1])
        for name, label in COUNTERS:
            if line.startswith(f"nodeserve:{name}_total{{") and f'{label}="' in line:
                value = line.rsplit(" ", 1)[1]
                key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[name][key] = float(value)
    return out


def scrape_counters(url: str) -> dict:
    """request_success by finished_reason, request_rejected by reason, role changes, prefix-cache queries and
    hits by device, tier evictions and hits by tier, from /metrics."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        text = ""
    return parse_counters(text)


# ---- the load --------------------------------------------------------------------------------------------

def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Workload:
    """The shared state of the richer mix: long system prompts reused across requests, and conversations whose
    history grows turn by turn (each in use by one client at a time)."""

    def __init__(self, rng: random.Random, long_ids: list[int], long_text: str, num_conversations: int = 6,
                 system_words: tuple[int, ...] = (400, 800, 1200), max_conversation_tokens: int = 1400):
        self.long_ids, self.long_text = long_ids, long_text
        self.system_prompts = [f"You are assistant number {i}. Keep these notes in mind: " + _words(rng, n)
                               for i, n in enumerate(system_words)]
        self.max_conversation_tokens = max_conversation_tokens
        self.conversations = [self._new_conversation(rng, i) for i in range(num_conversations)]
        self.num_fresh_schemas = 0

    def _new_conversation(self, rng: random.Random, cid: int) -> dict:
        system = self.system_prompts[0] if rng.random() < 0.5 else "You are a helpful assistant."
        return {"id": cid, "system": system, "history": [], "turn": 0, "prompt_tokens": 0, "busy": False,
                "generation": 0}

    def take_conversation(self, rng: random.Random) -> dict | None:
        free = [c for c in self.conversations if not c["busy"]]
        if not free:
            return None
        conv = rng.choice(free)
        # the next prompt adds at most ~96 answer tokens and a ~100-token question: start again before the cap
        if conv["prompt_tokens"] + 200 > self.max_conversation_tokens or conv["turn"] >= 12:
            fresh = self._new_conversation(rng, conv["id"])
            fresh["generation"] = conv["generation"] + 1
            conv.clear()
            conv.update(fresh)
        conv["busy"] = True
        return conv

    def finish(self, spec: dict, rec: dict) -> None:
        """After a multi-turn request: a completed turn joins the history (the real answer); frees the slot."""
        conv = spec.get("conversation")
        if conv is None:
            return
        if rec.get("completed") and not rec.get("aborted") and rec.get("_content") is not None:
            conv["history"] += [spec["body"]["messages"][-1], {"role": "assistant", "content": rec["_content"]}]
            conv["turn"] += 1
            conv["prompt_tokens"] = rec.get("prompt_tokens") or conv["prompt_tokens"] + 200
        conv["busy"] = False

    def fresh_schema(self, rng: random.Random) -> dict:
        self.num_fresh_schemas += 1
        key = f"k{rng.randrange(10**9)}"
        return {"type": "object", "properties": {key: {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "note": {"type": "string", "maxLength": 12}},
                "required": [key, "note"], "additionalProperties": False}


def make_request(rng: random.Random, long_ids: list[int], long_text: str, disconnect_prob: float,
                 workload: Workload | None = None) -> dict:
    """One random request: where to send it, the body, and what the client will do. Without a workload, only
    chat and completions (the original mix); with one, also tools, json_schema, shared prefixes, multi-turn."""
    if workload is not None:
        x = rng.random()
        spec = None
        if x < 0.12:
            spec = _tools_request(rng, workload)
        elif x < 0.24:
            spec = _schema_request(rng, workload)
        elif x < 0.34:
            spec = _shared_prefix_request(rng, workload)
        elif x < 0.46:
            spec = _multiturn_request(rng, workload)  # None when every conversation is in use
        if spec is not None:
            _plan_give_up(rng, spec, disconnect_prob)
            return spec
    kind = rng.choice(["chat", "completion"])
    stream = rng.random() < 0.5
    spec = _spec(kind, stream, "/v1/chat/completions" if kind == "chat" else "/v1/completions")
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
    _sampling(rng, body)
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
    _plan_give_up(rng, spec, disconnect_prob)
    return spec


def _spec(kind: str, stream: bool, path: str = "/v1/chat/completions") -> dict:
    return {"kind": kind, "stream": stream, "bad": False, "long": False, "n": 1, "stop": False, "path": path,
            "raw": None}


def _sampling(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.2), 2)
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 30)


def _plan_give_up(rng: random.Random, spec: dict, disconnect_prob: float) -> None:
    """streamed: close after this many SSE events (0 = straight after the headers); not streamed: client timeout."""
    give_up = rng.random() < disconnect_prob
    max_tokens = spec["body"].get("max_tokens", 16)
    spec["disconnect_after"] = rng.randint(0, max_tokens + 1) if give_up and spec["stream"] else None
    spec["give_up_after"] = round(rng.uniform(0.05, 3.0), 2) if give_up and not spec["stream"] else None


def _chat_body(rng: random.Random, spec: dict, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "stream": spec["stream"]}
    _sampling(rng, body)
    if spec["stream"]:
        body["stream_options"] = {"include_usage": True}
    spec["body"] = body
    return body


def _tools_request(rng: random.Random, wl: Workload) -> dict:
    spec = _spec("tools", rng.random() < 0.5)
    city = rng.choice(CITIES)
    messages = [{"role": "user", "content": rng.choice([f"What is the weather in {city}?",
                                                        f"What time is it in {city}?",
                                                        f"Tell me about {city}."])}]
    if rng.random() < 0.25:
        messages.insert(0, {"role": "system", "content": rng.choice(wl.system_prompts)})
    x = rng.random()
    choice: object = "auto"
    if x < 0.3:
        choice = "required"
    elif x < 0.6:
        choice = {"type": "function", "function": {"name": rng.choice(list(TOOL_PARAMS))}}
    elif rng.random() < 0.5:  # auto, after a tool call and its result
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {
                             "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": f"{rng.randint(-5, 35)} degrees"}]
    body = _chat_body(rng, spec, messages, rng.randint(48, 96))
    body["tools"] = TOOLS
    if choice != "auto" or rng.random() < 0.5:
        body["tool_choice"] = choice
    if rng.random() < 0.15:
        body["n"] = spec["n"] = 2
    spec["tool_choice"] = choice
    return spec


def _schema_request(rng: random.Random, wl: Workload) -> dict:
    spec = _spec("json_schema", rng.random() < 0.5)
    if rng.random() < FRESH_SCHEMA_PROB:
        schema, question, spec["fresh_schema"] = wl.fresh_schema(rng), "Fill in the form.", True
    else:
        i = rng.randrange(len(SCHEMAS))
        schema, question = SCHEMAS[i], SCHEMA_QUESTIONS[i]
    body = _chat_body(rng, spec, [{"role": "user", "content": question}], rng.randint(64, 128))
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    if rng.random() < 0.15:
        body["n"] = spec["n"] = 2
    spec["schema"] = schema
    return spec


def _shared_prefix_request(rng: random.Random, wl: Workload) -> dict:
    spec = _spec("shared_prefix", rng.random() < 0.5)
    i = rng.randrange(len(wl.system_prompts))
    question = f"Using the notes, write a line about {rng.choice(SHORT_TOPICS)}."
    _chat_body(rng, spec, [{"role": "system", "content": wl.system_prompts[i]},
                           {"role": "user", "content": question}], rng.randint(1, 64))
    spec["long"], spec["system_prompt"] = i > 0, i
    return spec


def _multiturn_request(rng: random.Random, wl: Workload) -> dict | None:
    conv = wl.take_conversation(rng)
    if conv is None:
        return None
    spec = _spec("multiturn", rng.random() < 0.5)
    question = f"Now tell me more about {rng.choice(SHORT_TOPICS)}. " + _words(rng, rng.randint(10, 80))
    messages = [{"role": "system", "content": conv["system"]}] + conv["history"] + \
        [{"role": "user", "content": question}]
    _chat_body(rng, spec, messages, rng.randint(16, 96))
    spec["conversation"], spec["turn"] = conv, conv["turn"]
    spec["conversation_id"] = f"{conv['id']}.{conv['generation']}"
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


RECORD_KEYS = ("kind", "stream", "bad", "long", "n", "stop", "turn", "conversation_id", "system_prompt",
               "fresh_schema")


async def send(session, url: str, spec: dict, origin: float | None = None) -> dict:
    """Sends one request and reads it to the end (or gives up as planned). origin: the load's start
    (perf_counter), for the record's send time `t_send_s`."""
    import aiohttp

    rec = {k: spec[k] for k in RECORD_KEYS if k in spec}
    rec.update(status=None, aborted=False, completed=False, error=None, events=0)
    if spec["bad"]:
        rec["bad_kind"] = spec["bad_kind"]
    if "tool_choice" in spec:
        rec["tool_choice"] = spec["tool_choice"] if isinstance(spec["tool_choice"], str) else "named"
    t0 = time.perf_counter()
    if origin is not None:
        rec["t_send_s"] = round(t0 - origin, 3)
    kwargs: dict = {"data": spec["raw"], "headers": {"Content-Type": "application/json"}} if spec["raw"] is not None \
        else {"json": spec["body"]}
    # a generous cap so a hung request can't hang the bench; hitting it counts as not completed
    kwargs["timeout"] = aiohttp.ClientTimeout(total=spec["give_up_after"] or 900)
    outputs: list[dict] = []
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
                outputs = await _read_stream(r, spec, rec, t0)
            else:
                obj = await r.json()
                choices = obj.get("choices", [])
                rec["prompt_tokens"] = (obj.get("usage") or {}).get("prompt_tokens")
                outputs = [_choice_output(c) for c in sorted(choices, key=lambda c: c.get("index", 0))]
                rec["completed"] = len(choices) == spec["n"] and all(c.get("finish_reason") for c in choices)
    except asyncio.TimeoutError:
        if spec["give_up_after"] is not None:
            rec["aborted"] = True
        else:
            rec["error"] = "client timeout (900 s)"
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["latency_s"] = round(time.perf_counter() - t0, 3)
    if outputs and rec["completed"] and not rec["aborted"]:
        rec["finish_reasons"] = [o["finish"] for o in outputs]
        if spec["kind"] == "tools":
            rec["tool_calls"] = sum(1 for o in outputs if o["calls"])
        if spec["kind"] in ("tools", "json_schema"):
            problem = check_output(spec, outputs)
            if problem:
                rec.update(completed=False, invalid_output=True, error=problem)
        if spec["kind"] == "multiturn":
            rec["_content"] = outputs[0]["content"] or ""
    return rec


def _choice_output(c: dict) -> dict:
    msg = c.get("message") or {}
    return {"finish": c.get("finish_reason"), "content": msg.get("content", c.get("text")),
            "calls": [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                      for t in msg.get("tool_calls") or []]}


async def _read_stream(r, spec: dict, rec: dict, t0: float) -> list[dict]:
    """Reads SSE to [DONE] (or drops the connection as planned); per choice: finish, content, tool calls."""
    outs: dict[int, dict] = {}
    done = False
    if spec["disconnect_after"] == 0:
        r.close()
        rec["aborted"] = True
        return []
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
            rec["stream_error"] = True
        if obj.get("usage"):
            rec["prompt_tokens"] = obj["usage"].get("prompt_tokens")
        for c in obj.get("choices", []):
            o = outs.setdefault(c.get("index", 0), {"finish": None, "content": "", "calls": []})
            delta = c.get("delta") or {}
            text = delta.get("content") if "delta" in c else c.get("text")
            if (text or delta.get("tool_calls")) and "ttft_s" not in rec:
                rec["ttft_s"] = round(time.perf_counter() - t0, 3)
            o["content"] += text or ""
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("index", 0) >= len(o["calls"]):
                    o["calls"].append({"name": fn.get("name"), "arguments": fn.get("arguments") or ""})
                else:
                    o["calls"][tc["index"]]["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                o["finish"] = c["finish_reason"]
        if spec["disconnect_after"] is not None and rec["events"] >= spec["disconnect_after"]:
            r.close()  # drop the connection mid-stream
            rec["aborted"] = True
            return []
    finished = {i for i, o in outs.items() if o["finish"]}
    rec["completed"] = done and rec["error"] is None and len(finished) == spec["n"]
    if not rec["completed"] and rec["error"] is None:
        rec["error"] = f"stream ended: done={done}, finished choices {sorted(finished)} of {spec['n']}"
    return [outs[i] for i in sorted(outs)]


async def run_load(url: str, seconds: float, concurrency: int, rng: random.Random, long_ids: list[int],
                   long_text: str, disconnect_prob: float, pid: int, rss_interval: float,
                   rss_samples: list[tuple[float, int]], log_every: float = 15.0,
                   workload: Workload | None = None, consoles: int = 0,
                   console_stats: dict | None = None) -> list[dict]:
    import aiohttp

    records: list[dict] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client():
            while time.perf_counter() < deadline:
                spec = make_request(rng, long_ids, long_text, disconnect_prob, workload)
                rec: dict = {}
                try:
                    rec = await send(session, url, spec, origin=t0)
                finally:
                    if workload is not None:
                        workload.finish(spec, rec)  # frees its conversation even if send raised
                rec.pop("_content", None)
                records.append(rec)
                if is_failed(rec):
                    await asyncio.sleep(0.5)  # a server failing fast must not turn the soak into a flood

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
                          f"  failed {s['failed']}  5xx {s['http_5xx']}"
                          f"  rss {kib / 1024 if kib else float('nan'):.0f} MiB", flush=True)
                    next_log += log_every
                await asyncio.sleep(min(rss_interval, max(0.0, deadline - time.perf_counter())))

        async def console():
            """A browser's console left open: reads the live feed (/debug/events) until the soak ends."""
            while time.perf_counter() < deadline:
                try:
                    async with session.get(url + "/debug/events") as r:
                        while time.perf_counter() < deadline:
                            chunk = await asyncio.wait_for(r.content.readany(), max(0.1, deadline - time.perf_counter()))
                            if not chunk:
                                break
                            if console_stats is not None:
                                console_stats["bytes"] = console_stats.get("bytes", 0) + len(chunk)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    if console_stats is not None and time.perf_counter() < deadline:
                        console_stats["reconnects"] = console_stats.get("reconnects", 0) + 1
                    await asyncio.sleep(0.5)

        await asyncio.gather(sampler(), *(client() for _ in range(concurrency)),
                             *(console() for _ in range(consoles)))
    return records


def long_inputs(rng: random.Random, tokens: int = 1500) -> tuple[list[int], str]:
    """~`tokens` random token ids for completions and a chat message of roughly that many tokens."""
    ids = [rng.randrange(300, 40000) for _ in range(tokens)]
    words = ["alpha", "river", "stone", "seven", "quiet", "window", "paper", "orange", "north", "signal"]
    text = "Summarize the following notes. " + " ".join(rng.choice(words) for _ in range(tokens - 40))
    return ids, text


def criteria_rows(summary: dict, leaked: int | None, alive: bool, rss: dict, windows: dict,
                  rss_judged: bool = True, latency_judged: bool = True) -> list[tuple]:
    """(criterion, measured, PASS / FAIL / not judged) for the printed table."""
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    growth = rss.get("growth_pct")
    ratio = windows["ratio_last_first"]["e2e_p99"]
    judged = p99_judged(windows)
    return [
        (f"RSS growth after warm-up < {RSS_GROWTH_LIMIT_PCT:g} %", f"{growth} %",
         ok(growth is not None and growth < RSS_GROWTH_LIMIT_PCT) if rss_judged else "not judged (--no-rss-verdict)"),
        ("leaked KV pages == 0", str(leaked), ok(leaked == 0)),
        ("5xx == 0", str(summary["http_5xx"]), ok(summary["http_5xx"] == 0)),
        (f"e2e p99 last / first window <= {P99_RATIO_LIMIT:g}", f"{ratio}",
         ("not judged (--no-latency-verdict)" if not latency_judged else
          ok(ratio is not None and ratio <= P99_RATIO_LIMIT) if judged else
          f"not judged (n {windows['first']['e2e']['n']} / {windows['last']['e2e']['n']} < {MIN_WINDOW_SAMPLES})")),
        ("every non-aborted request completed", f"{summary['not_aborted_not_completed']} did not",
         ok(summary["all_non_aborted_completed"])),
        ("server alive", str(alive), ok(alive)),
    ]


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EventSubscribers:
    """Two SUB sockets on the server's KV events, each owned by its thread: `stalled` connects with the smallest
    buffers and never reads; `healthy` reads every batch and notes when. close() says what each got."""

    def __init__(self, endpoint: str):
        import zmq

        self.ctx, self.endpoint, self.stop = zmq.Context(), endpoint, threading.Event()
        self.times: list[float] = []
        self.gaps = 0
        self.start = time.monotonic()
        self.threads = [threading.Thread(target=self._healthy, daemon=True),
                        threading.Thread(target=self._stalled, daemon=True)]
        for t in self.threads:
            t.start()

    def _healthy(self) -> None:
        import zmq

        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        last = None
        while not self.stop.is_set():
            if sub.poll(100):
                seq = int.from_bytes(sub.recv_multipart()[1], "big")
                self.gaps += last is not None and seq != last + 1
                last = seq
                self.times.append(time.monotonic())
        sub.close(0)

    def _stalled(self) -> None:
        import zmq

        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        self.stop.wait()  # never reads
        sub.close(0)

    def close(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self.ctx.term()
        end = time.monotonic()
        last = self.times[-1] - self.start if self.times else None
        # the load ends a minute or two before close() (idle wait): batches must have come until then
        return {"healthy_batches": len(self.times), "healthy_sequence_gaps": self.gaps,
                "healthy_last_batch_s": last, "run_s": end - self.start,
                "healthy_kept_up": bool(self.times) and self.gaps == 0 and end - self.times[-1] < 300}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    length = ap.add_mutually_exclusive_group(required=True)
    length.add_argument("--duration", type=float, help="seconds of load (3600: the one-hour soak)")
    length.add_argument("--minutes", type=float, help="minutes of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mode", choices=sorted(MODES), default="disaggregated")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--disconnect-prob", type=float, default=0.2)
    ap.add_argument("--kv-memory-gib", type=float, default=2.0,
                    help="KV pool per device; small values put the prefix cache under eviction pressure")
    ap.add_argument("--kv-extra", default="", help="more [kv] TOML lines, e.g. 'host_memory_gib = 0.2' "
                    "(with a small --kv-memory-gib: the KV tiers under eviction throughout)")
    ap.add_argument("--basic-mix", action="store_true",
                    help="only chat and completions (the mix before tools, json_schema, shared prefixes, multi-turn)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-interval", type=float, default=3.0)
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle")
    ap.add_argument("--consoles", type=int, default=0,
                    help="this many live-console feeds (/debug/events) kept open through the soak, as browsers would")
    ap.add_argument("--no-latency-verdict", action="store_true",
                    help="report the latency windows but leave their p99 ratio out of the verdict (a minutes-long "
                         "run's windows hold a few dozen requests: their p99 is their maximum)")
    ap.add_argument("--no-rss-verdict", action="store_true",
                    help="report RSS but leave it out of the verdict (a minutes-long run, e.g. CI's, still sees "
                         "lazy first-time allocations; the RSS criterion is for the hour)")
    ap.add_argument("--kv-events", action="store_true",
                    help="publish KV events, with two subscribers through the soak: one that never reads (its "
                         "buffers fill) and one that reads every batch (it must keep getting them)")
    ap.add_argument("--out", default=out_path("soak.json"))
    args = ap.parse_args()
    duration = args.duration if args.duration is not None else args.minutes * 60
    if duration <= 0:
        ap.error("the duration must be positive")

    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
                     "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
                                 "platform": platform.platform()},
                     "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "duration_s": duration}
    rng = random.Random(args.seed)
    long_ids, long_text = long_inputs(rng)
    workload = None if args.basic_mix else Workload(random.Random(args.seed + 2), long_ids, long_text)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        t_start = time.perf_counter()
        events_port = free_port() if args.kv_events else 0
        proc, url = start_server(args.mode, args.dtype, tmp, log_path, kv_memory_gib=args.kv_memory_gib,
                                 kv_extra=args.kv_extra.replace("\\n", "\n").replace("{tmp}", tmp),
                                 extra=f"[kv_events]\nenabled = true\nport = {events_port}\n" if args.kv_events
                                 else "")
        subscribers = EventSubscribers(f"tcp://127.0.0.1:{events_port}") if args.kv_events else None
        print(f"server up in {time.perf_counter() - t_start:.1f} s ({args.mode}, dtype {args.dtype}), pid {proc.pid}",
              flush=True)
        try:
            # warm-up: one of each shape (incl. a long prompt, the schemas) so lazy allocations and compilations
            # happen before the load
            warm_rng = random.Random(args.seed + 1)
            asyncio.run(run_load(url, 20, min(4, args.concurrency), warm_rng, long_ids, long_text, 0.0, proc.pid,
                                 1e9, [], log_every=1e9, workload=workload))
            idle, _ = wait_idle(url, args.idle_timeout)
            rss_start = read_rss_kib(proc.pid)
            counters_before = scrape_counters(url)
            print(f"warm-up done; RSS {rss_start / 1024:.0f} MiB; soaking {duration:g} s ({duration / 60:g} min) at "
                  f"concurrency {args.concurrency}; RSS warm-up = first {warmup_seconds(duration):g} s, latency "
                  f"windows {window_seconds(duration):g} s", flush=True)
            samples: list[tuple[float, int]] = []
            t_load = time.perf_counter()
            console_stats: dict = {}
            records = asyncio.run(run_load(url, duration, args.concurrency, rng, long_ids, long_text,
                                           args.disconnect_prob, proc.pid, args.rss_interval, samples,
                                           log_every=max(15.0, min(60.0, duration / 40)), workload=workload,
                                           consoles=args.consoles, console_stats=console_stats))
            load_s = time.perf_counter() - t_load
            idle, idle_wait = wait_idle(url, args.idle_timeout)
            rss_end = read_rss_kib(proc.pid)
            alive = proc.poll() is None
            leaked = leaked_pages(idle) if idle is not None else None
            counters = scrape_counters(url)
        finally:
            events = subscribers.close() if subscribers is not None else None
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            with open(log_path, errors="replace") as f:
                log_tail = f.read()[-4000:]

    summary = summarize(records)
    rss = rss_growth(samples, rss_start, rss_end)
    plateau = rss_report(samples, duration, rss_end, before_kib=rss_start)
    windows = latency_windows(records, duration)
    passed, reasons = verdict(summary, leaked, alive, rss=None if args.no_rss_verdict else plateau,
                              windows=None if args.no_latency_verdict else windows)
    if events is not None and not events["healthy_kept_up"]:
        passed = False
        reasons.append(f"the reading KV-event subscriber stopped getting batches: {events}")
    changes = counters.get("device_role_changes", {})
    changes_before = counters_before.get("device_role_changes", {})
    role_changes = {"total": int(sum(changes.values())),
                    "during_soak": int(sum(changes.values()) - sum(changes_before.values())),
                    "by_device": changes}
    criteria = criteria_rows(summary, leaked, alive, plateau, windows, rss_judged=not args.no_rss_verdict,
                             latency_judged=not args.no_latency_verdict)
    results.update(summary=summary, load_seconds=round(load_s, 1), idle_wait_seconds=round(idle_wait, 1),
                   leaked_pages=leaked, debug_kv_after=idle, rss=rss, rss_plateau=plateau,
                   latency_windows=windows, role_changes=role_changes,
                   criteria=[{"criterion": c, "measured": m, "result": v} for c, m, v in criteria],
                   rss_samples=samples, server_counters=counters, server_counters_after_warmup=counters_before,
                   fresh_schemas=workload.num_fresh_schemas if workload else 0,
                   consoles={"open": args.consoles, **console_stats},
                   kv_events=events, passed=passed, reasons=reasons, records=records)
    if not passed:
        results["server_log_tail"] = log_tail
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)

    s = summary
    print(f"\nsoak {args.mode}, {duration:g} s ({duration / 60:g} min), concurrency {args.concurrency}, "
          f"disconnect-prob {args.disconnect_prob}, kv {args.kv_memory_gib:g} GiB/device"
          f"{', kv extra ' + repr(args.kv_extra) if args.kv_extra else ''}, seed {args.seed}")
    print(f"requests sent {s['sent']}: completed {s['completed']}, aborted by client {s['aborted']} "
          f"({s['aborted_streams']} streams, {s['aborted_non_streamed']} non-streamed), failed {s['failed']}, "
          f"5xx {s['http_5xx']} ({s['stream_error_events']} of them error events in streams)")
    print(f"  bad requests {s['bad_requests']}, long prompts {s['long_prompts']}, n=2 {s['n2']}, "
          f"with stop {s['with_stop']}; statuses {s['statuses']}")
    print(f"  tools completed {s['tools_completed']} ({s['tools_forced_completed']} forced), with tool_calls "
          f"{s['tools_with_tool_calls']}; json_schema completed {s['json_schema_completed']} "
          f"({s['json_schema_fresh_completed']} fresh schemas); invalid structured output {s['structured_invalid']}")
    print(f"  shared-prefix completed {s['shared_prefix_completed']}, multi-turn completed {s['multiturn_completed']} "
          f"(deepest turn {s['multiturn_max_turn']}), largest prompt {s['max_prompt_tokens']} tokens")
    for k, v in s["by_kind"].items():
        print(f"  {k:<24} sent {v['sent']:>5}  completed {v['completed']:>5}  aborted {v['aborted']:>4}  "
              f"failed {v['failed']:>3}")
    print(f"idle after {idle_wait:.1f} s; leaked pages {leaked}")
    p = plateau
    print(f"RSS before load {p['before_load_mib']} MiB; warm-up = first {p['warmup_s']:g} s (10 % of the run or "
          f"5 min, whichever is smaller); median of the {p['window_s']:g} s after it {p['first_window_median_mib']} "
          f"MiB, of the last {p['window_s']:g} s {p['last_window_median_mib']} MiB: growth {p['growth_mib']} MiB "
          f"({p['growth_pct']} %); first sample after warm-up {p['after_warmup_mib']} MiB, idle at the end "
          f"{p['end_mib']} MiB, max {p['max_mib']} MiB over {p['num_samples']} samples")
    print(f"  plateau: slope {p['slope_first_half_mib_per_min']} MiB/min over the first half after warm-up, "
          f"{p['slope_second_half_mib_per_min']} MiB/min over the second half")
    w = windows
    print(f"latency windows: {w['window_s']:g} s each (min(10 min, duration / 6)), by send time; completed, "
          f"non-aborted good requests")
    print(f"  {'window':<16}{'ttft n':>7}{'p50 s':>8}{'p99 s':>8}{'e2e n':>7}{'p50 s':>8}{'p99 s':>8}")
    for name in ("first", "last"):
        x = w[name]
        print(f"  {name + ' ' + format(x['from_s'], 'g') + '-' + format(x['to_s'], 'g') + ' s':<16}"
              f"{x['ttft']['n']:>7}{_fmt_s(x['ttft']['p50_s']):>8}{_fmt_s(x['ttft']['p99_s']):>8}"
              f"{x['e2e']['n']:>7}{_fmt_s(x['e2e']['p50_s']):>8}{_fmt_s(x['e2e']['p99_s']):>8}")
    r = w["ratio_last_first"]
    print(f"  {'last / first':<16}{'':>7}{_fmt_s(r['ttft_p50']):>8}{_fmt_s(r['ttft_p99']):>8}{'':>7}"
          f"{_fmt_s(r['e2e_p50']):>8}{_fmt_s(r['e2e_p99']):>8}")
    print(f"role changes: {role_changes['total']} in all, {role_changes['during_soak']} during the soak "
          f"{role_changes['by_device'] or ''}")
    print(f"server counters: {counters}")
    if s["examples_not_completed"]:
        print(f"  not completed, e.g. {s['examples_not_completed']}")
    print("criteria:")
    for c, m, v in criteria:
        print(f"  {c:<42} {m:<16} {v}")
    print(f"{'PASS' if passed else 'FAIL'}{': ' + '; '.join(reasons) if reasons else ''}   -> {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
