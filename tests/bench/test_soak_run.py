"""CI's two-minute soak (issue #26): bench/soak.py end to end against a real adaptive server with a small pool, a
host tier evicting, tools, json_schema, shared prefixes, multi-turn and client aborts, and a console's live feed
open throughout: no failed request, no 5xx, no leaked page. RSS and latency drift are reported, not judged: both
criteria are for the hour (bench/README.md has that run); a 2-minute run's 20-second windows hold a few dozen
requests, whose p99 is their maximum (a contended run failed on it at 1.28x)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.mark.slow
def test_two_minute_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "soak.py"), "--minutes", "2", "--mode", "adaptive",
                           "--concurrency", "8", "--kv-memory-gib", "0.1", "--kv-extra", "host_memory_gib = 0.2",
                           "--consoles", "1", "--no-rss-verdict", "--no-latency-verdict", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    # the records of requests that did not complete, in full, so a CI failure says which and why
    stuck = [r for r in result.get("records", []) if not r.get("aborted") and not r.get("completed")]
    assert proc.returncode == 0 and result["passed"], (result.get("reasons"), stuck[:5], proc.stdout[-2000:])
    s = result["summary"]
    assert s["failed"] == 0 and s["http_5xx"] == 0 and result["leaked_pages"] == 0
    assert s["completed"] > 50 and s["aborted"] > 0  # a real load, aborts included
    assert s["tools_completed"] > 0 and s["json_schema_completed"] > 0 and s["multiturn_completed"] > 0
    assert result["consoles"]["bytes"] > 10_000  # a console's feed stayed open and kept streaming
