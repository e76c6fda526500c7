"""The soak benchmark's pure statistics (bench/soak.py) on synthetic records: counts, RSS growth, verdict."""

from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def soak(load_bench):
    return load_bench("soak")


def rec(kind="chat", stream=False, bad=False, status=200, aborted=False, completed=True, n=1, long=False,
        stop=False):
    return {"kind": kind, "stream": stream, "bad": bad, "status": status, "aborted": aborted,
            "completed": completed, "n": n, "long": long, "stop": stop, "error": None}


def test_summarize_counts(soak):
    records = [
        rec(),                                                         # completed chat
        rec(kind="completion", stream=True, n=2, stop=True),           # completed stream, n=2
        rec(stream=True, aborted=True, completed=False),               # client closed the stream
        rec(kind="completion", status=None, aborted=True, completed=False),  # client timeout, no status
        rec(bad=True, status=400),                                     # bad request, expected 4xx
        rec(bad=True, status=404, kind="completion"),                  # unknown model
        rec(status=500, completed=False),                              # server error
        rec(kind="completion", long=True),
    ]
    s = soak.summarize(records)
    assert (s["sent"], s["completed"], s["aborted"], s["failed"]) == (8, 5, 2, 1)
    assert s["not_aborted_not_completed"] == 1 and not s["all_non_aborted_completed"]
    assert (s["bad_requests"], s["long_prompts"], s["n2"], s["with_stop"]) == (2, 1, 1, 1)
    assert (s["aborted_streams"], s["aborted_non_streamed"]) == (1, 1)
    assert s["statuses"] == {"200": 4, "400": 1, "404": 1, "500": 1, "None": 1}
    assert s["by_kind"]["chat"] == {"sent": 2, "completed": 1, "aborted": 0, "failed": 1}
    assert s["by_kind"]["chat/stream"] == {"sent": 1, "completed": 0, "aborted": 1, "failed": 0}
    assert s["by_kind"]["completion/bad"]["completed"] == 1
    assert s["examples_not_completed"][0]["status"] == 500


def test_summarize_empty(soak):
    s = soak.summarize([])
    assert s["sent"] == 0 and s["all_non_aborted_completed"]


@pytest.mark.parametrize("r,failed", [
    (rec(), False),
    (rec(status=None, completed=False), True),              # connection error
    (rec(status=503, completed=False), True),
    (rec(status=400, completed=False), True),               # a good request refused
    (rec(bad=True, status=422), False),
    (rec(bad=True, status=200, completed=False), True),     # a bad request accepted
    (rec(bad=True, status=500, completed=False), True),
    (rec(status=None, aborted=True, completed=False), False),
])
def test_is_failed(soak, r, failed):
    assert soak.is_failed(r) is failed


def test_aborted_never_counts_as_completed(soak):
    s = soak.summarize([rec(stream=True, aborted=True, completed=True)])
    assert s["completed"] == 0 and s["aborted"] == 1 and s["all_non_aborted_completed"]


def test_leaked_pages_and_idle(soak):
    kv = {"pools": [{"device": "cpu:0", "role": "prefill", "num_pages": 100, "num_free": 100, "num_running": 0,
                     "num_waiting": 0},
                    {"device": "cpu:1", "role": "decode", "num_pages": 100, "num_free": 97, "num_running": 0,
                     "num_waiting": 0}], "num_pending": 0}
    assert soak.leaked_pages(kv) == 3 and not soak.is_idle(kv)
    kv["pools"][1]["num_free"] = 100
    assert soak.leaked_pages(kv) == 0 and soak.is_idle(kv)
    kv["num_pending"] = 1
    assert not soak.is_idle(kv)
    kv["num_pending"], kv["pools"][0]["num_running"] = 0, 1
    assert not soak.is_idle(kv)


def test_rss_growth(soak):
    samples = [(0.0, 1024 * 500), (3.0, 1024 * 530), (6.0, 1024 * 510)]
    g = soak.rss_growth(samples)
    assert g == {"start_mib": 500.0, "end_mib": 510.0, "growth_mib": 10.0, "max_mib": 530.0, "num_samples": 3}
    g = soak.rss_growth(samples, start_kib=1024 * 520, end_kib=1024 * 515)
    assert (g["start_mib"], g["end_mib"], g["growth_mib"], g["max_mib"]) == (520.0, 515.0, -5.0, 530.0)
    assert soak.rss_growth([])["growth_mib"] is None
    assert soak.rss_growth([], 2048, 3072)["growth_mib"] == 1.0


def test_verdict(soak):
    ok = soak.summarize([rec(), rec(stream=True, aborted=True, completed=False)])
    assert soak.verdict(ok, 0) == (True, [])
    passed, reasons = soak.verdict(ok, 4)
    assert not passed and "4 KV pages" in reasons[0]
    assert not soak.verdict(ok, None)[0]
    assert not soak.verdict(ok, 0, server_alive=False)[0]
    bad = soak.summarize([rec(), rec(stream=True, completed=False)])
    passed, reasons = soak.verdict(bad, 0)
    assert not passed and "1 requests" in reasons[0]


def test_make_request_mix(soak):
    """The generator produces every shape the soak promises, and give-up plans only when asked to."""
    rng = random.Random(0)
    ids, text = soak.long_inputs(rng)
    specs = [soak.make_request(rng, ids, text, 0.2) for _ in range(2000)]
    assert {s["kind"] for s in specs} == {"chat", "completion"}
    assert any(s["bad"] for s in specs) and any(s["long"] for s in specs)
    assert any(s["n"] == 2 for s in specs) and any(s["stop"] for s in specs)
    assert any(s["disconnect_after"] is not None for s in specs if s["stream"])
    assert any(s["give_up_after"] is not None for s in specs if not s["stream"])
    assert all(s["give_up_after"] is None for s in specs if s["stream"])
    assert {s["bad_kind"] for s in specs if s["bad"]} >= {"invalid_json", "unknown_model", "too_long"}
    calm = [soak.make_request(rng, ids, text, 0.0) for _ in range(300)]
    assert all(s["disconnect_after"] is None and s["give_up_after"] is None for s in calm)
