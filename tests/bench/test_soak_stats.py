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


# ---- the one-hour soak's statistics: warm-up, windows, percentiles, slope, plateau, verdict -----------------

def test_warmup_and_window_lengths(soak):
    assert soak.warmup_seconds(3600) == 300 and soak.warmup_seconds(60) == 6 and soak.warmup_seconds(1200) == 120
    assert soak.window_seconds(3600) == 600 and soak.window_seconds(60) == 10 and soak.window_seconds(7200) == 600


def test_percentile_interpolates_like_numpy(soak):
    import numpy as np

    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert soak.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert soak.percentile([], 50) is None and soak.percentile([2.0], 99) == 2.0


def test_slope_per_min(soak):
    assert soak.slope_per_min([(0, 100.0), (60, 110.0), (120, 120.0)]) == pytest.approx(10.0)
    noisy = [(t, 500.0 + 0.5 * t / 60 + (1 if t % 2 else -1)) for t in range(0, 600, 3)]
    assert soak.slope_per_min(noisy) == pytest.approx(0.5, abs=0.05)
    assert soak.slope_per_min([(0, 1.0)]) is None and soak.slope_per_min([(5, 1.0), (5, 2.0)]) is None


def test_rss_report_warmup_growth_and_plateau(soak):
    # one hour: grows 1 MiB/min during the 5-min warm-up, then flat at 1000 MiB, with the end read after idle
    samples = [(float(t), int(1024 * (995 + min(t, 300) / 60))) for t in range(0, 3600, 3)]
    r = soak.rss_report(samples, 3600, end_kib=1024 * 1010, before_kib=1024 * 990)
    assert r["warmup_s"] == 300 and r["window_s"] == 300 and r["before_load_mib"] == 990.0
    assert r["first_window_median_mib"] == r["last_window_median_mib"] == 1000.0
    assert r["growth_mib"] == 0 and r["growth_pct"] == 0  # the idle end is for the record, not judged
    assert r["after_warmup_mib"] == 1000.0 and r["end_mib"] == 1010.0 and r["max_mib"] == 1010.0
    assert r["slope_first_half_mib_per_min"] == 0 and r["slope_second_half_mib_per_min"] == 0
    assert r["num_samples_after_warmup"] == 1100
    # a slow leak after warm-up shows in both halves' slopes and in the windows' medians (1-min windows here)
    leak = [(float(t), 1024 * 1000 + int(1024 * t / 60)) for t in range(0, 600, 6)]
    r = soak.rss_report(leak, 600)
    assert r["warmup_s"] == 60 and r["window_s"] == 60 and r["after_warmup_mib"] == 1001.0
    assert r["slope_first_half_mib_per_min"] == pytest.approx(1.0, abs=0.02)
    assert r["slope_second_half_mib_per_min"] == pytest.approx(1.0, abs=0.02)
    assert r["growth_mib"] == pytest.approx(8.0, abs=0.1)  # medians at t = 87 and 567 s
    # no sample after the warm-up: nothing to report
    assert soak.rss_report([(1.0, 1024)], 600)["growth_pct"] is None
    # a later warm-up end (hostile.py: once the host KV tier is full) judges only what comes after it
    filling = [(float(t), int(1024 * (1000 + min(t, 240) / 6))) for t in range(0, 600, 6)]
    assert soak.rss_report(filling, 600)["growth_pct"] > 2
    r = soak.rss_report(filling, 600, warmup_s=240)
    assert r["warmup_s"] == 240 and r["growth_pct"] == 0 and r["after_warmup_mib"] == 1040.0


def test_rss_growth_is_the_windows_medians_not_where_two_samples_fall_in_the_trim_cycle(soak):
    """A heap trim every minute drops RSS 40 MiB, and it comes back over the minute: single samples moved by
    that much whichever way, so the judged growth compares the medians of the first and the last window."""
    def sawtooth(base_of):  # 1 s samples; a trim at each whole minute
        return [(float(t), int(1024 * (base_of(t) - 40 + min(t % 60, 20) * 2))) for t in range(0, 3600)]
    flat = sawtooth(lambda t: 1000)
    one_sample = lambda r: r["end_mib"] - r["after_warmup_mib"]  # noqa: E731
    # flat: the first sample after warm-up falls on a trim, the last at a cycle's top: +40 MiB (4 %) by samples
    r = soak.rss_report(flat, 3600)
    assert one_sample(r) == 40 and r["growth_pct"] == 0
    # creeping 0.5 MiB/min, the first sample at a cycle's top and the last on a trim: the samples read a fall,
    # the medians the creep
    creep = sawtooth(lambda t: 1000 + t / 120)[:3541]
    r = soak.rss_report(creep, 3600, warmup_s=320)
    assert one_sample(r) < 0 and r["growth_mib"] == pytest.approx(25, abs=1.5) and r["growth_pct"] > 2


def timed(t_send, latency, ttft=None, stream=False, **kw):
    r = rec(stream=stream, **kw)
    r.update(t_send_s=t_send, latency_s=latency)
    if ttft is not None:
        r["ttft_s"] = ttft
    return r


def test_latency_windows(soak):
    # 60 s run: windows of 10 s; first [0, 10), last [50, 60]
    records = [timed(t, 1.0 + t / 100, ttft=0.1 + t / 1000, stream=t % 2 == 0) for t in range(0, 60)]
    records += [timed(55, 99.0, aborted=True, completed=False),          # aborted: not counted
                timed(5, 99.0, bad=True, status=400),                     # bad request: not counted
                timed(5, 99.0, status=500, completed=False)]              # failed: not counted
    w = soak.latency_windows(records, 60)
    assert w["window_s"] == 10 and (w["first"]["from_s"], w["first"]["to_s"]) == (0, 10)
    assert (w["last"]["from_s"], w["last"]["to_s"]) == (50, 60)
    assert w["first"]["e2e"]["n"] == 10 and w["last"]["e2e"]["n"] == 10
    assert w["first"]["ttft"]["n"] == 5 and w["last"]["ttft"]["n"] == 5    # streamed only
    assert w["first"]["e2e"]["p50_s"] == pytest.approx(1.045) and w["last"]["e2e"]["p50_s"] == pytest.approx(1.545)
    assert w["first"]["e2e"]["p99_s"] == pytest.approx(1.0891, abs=1e-3)
    assert w["ratio_last_first"]["e2e_p50"] == pytest.approx(1.545 / 1.045, abs=1e-3)
    assert w["ratio_last_first"]["ttft_p50"] == pytest.approx(0.154 / 0.104, abs=1e-3)
    # one hour: 10-minute windows
    w = soak.latency_windows([timed(3599, 2.0), timed(0, 1.0)], 3600)
    assert w["window_s"] == 600 and w["last"]["from_s"] == 3000 and w["ratio_last_first"]["e2e_p99"] == 2.0
    empty = soak.latency_windows([], 3600)
    assert empty["first"]["e2e"] == {"n": 0, "p50_s": None, "p99_s": None}
    assert empty["ratio_last_first"]["e2e_p99"] is None


def windows_with(first_p99, last_p99, n=30):
    return {"first": {"e2e": {"n": n, "p50_s": 1.0, "p99_s": first_p99}},
            "last": {"e2e": {"n": n, "p50_s": 1.0, "p99_s": last_p99}},
            "ratio_last_first": {"e2e_p99": None if first_p99 is None or last_p99 is None
                                 else round(last_p99 / first_p99, 3)}}


def test_verdict_with_the_issue_criteria(soak):
    ok = soak.summarize([rec(), rec(stream=True, aborted=True, completed=False)])
    flat = {"growth_pct": 1.5}
    assert soak.verdict(ok, 0, True, rss=flat, windows=windows_with(10.0, 10.9)) == (True, [])
    passed, reasons = soak.verdict(ok, 0, True, rss={"growth_pct": 2.0}, windows=windows_with(10.0, 10.0))
    assert not passed and reasons == ["RSS grew 2.00 % after warm-up (limit 2 %)"]
    passed, reasons = soak.verdict(ok, 0, True, rss=flat, windows=windows_with(10.0, 11.2))
    assert not passed and "1.12x" in reasons[0]
    assert not soak.verdict(ok, 0, True, rss={"growth_pct": None})[0]
    # too few requests in a window: the ratio is not judged, and it is said so in the table
    few = windows_with(10.0, 30.0, n=soak.MIN_WINDOW_SAMPLES - 1)
    assert not soak.p99_judged(few) and soak.verdict(ok, 0, True, rss=flat, windows=few) == (True, [])
    rows = soak.criteria_rows(ok, 0, True, flat, few)
    assert [v for _, _, v in rows][:3] == ["PASS"] * 3 and rows[3][2].startswith("not judged")
    # a 5xx fails the run: a status, or an error event inside a 200 stream
    for r5 in (rec(status=503, completed=False), rec(stream=True, completed=False) | {"stream_error": True}):
        s = soak.summarize([rec(), r5])
        assert s["http_5xx"] == 1
        passed, reasons = soak.verdict(s, 0)
        assert not passed and any("5xx" in x for x in reasons)
    assert soak.summarize([rec(bad=True, status=404)])["http_5xx"] == 0


def test_summarize_tools_and_structured(soak):
    records = [rec(kind="tools") | {"tool_calls": 1, "tool_choice": "required"},
               rec(kind="tools") | {"tool_calls": 0, "tool_choice": "auto"},
               rec(kind="tools", stream=True, aborted=True, completed=False) | {"tool_calls": 0, "tool_choice": "auto"},
               rec(kind="json_schema"), rec(kind="json_schema") | {"fresh_schema": True},
               rec(kind="json_schema", completed=False) | {"invalid_output": True},
               rec(kind="multiturn") | {"turn": 3, "prompt_tokens": 900}, rec(kind="shared_prefix")]
    s = soak.summarize(records)
    assert (s["tools_completed"], s["tools_with_tool_calls"], s["tools_forced_completed"]) == (2, 1, 1)
    assert (s["json_schema_completed"], s["json_schema_fresh_completed"], s["structured_invalid"]) == (2, 1, 1)
    assert (s["multiturn_completed"], s["multiturn_max_turn"], s["shared_prefix_completed"]) == (1, 3, 1)
    assert s["max_prompt_tokens"] == 900 and not s["all_non_aborted_completed"]


def test_check_output(soak):
    weather = {"kind": "tools", "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    good = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    assert soak.check_output(weather, [{"finish": "tool_calls", "content": None, "calls": [good]}]) is None
    assert soak.check_output(weather, [{"finish": "length", "content": "", "calls": []}]) is None  # cut: unchecked
    assert "finish 'stop'" in soak.check_output(weather, [{"finish": "stop", "content": "hi", "calls": []}])
    wrong = {"name": "get_time", "arguments": '{"city": "Oslo"}'}
    assert "called 'get_time'" in soak.check_output(weather, [{"finish": "tool_calls", "calls": [wrong]}])
    bad_args = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "kelvin"}'}
    assert "arguments of get_weather" in soak.check_output(weather, [{"finish": "tool_calls", "calls": [bad_args]}])
    required = {"kind": "tools", "tool_choice": "required"}
    assert soak.check_output(required, [{"finish": "tool_calls", "calls": [wrong]}]) is None
    auto = {"kind": "tools", "tool_choice": "auto"}
    assert soak.check_output(auto, [{"finish": "stop", "content": "It is sunny.", "calls": []}]) is None
    assert "not JSON" in soak.check_output(auto, [{"finish": "tool_calls", "calls": [{"name": "f", "arguments": "{"}]}])
    # cut by max_tokens mid-arguments (streamed as they came): not checked, as for content
    assert soak.check_output(auto, [{"finish": "length", "calls": [{"name": "f", "arguments": "{\"ci"}]}]) is None
    schema = {"kind": "json_schema", "schema": soak.SCHEMAS[1]}
    assert soak.check_output(schema, [{"finish": "stop", "content": '{"name": "Ann", "age": 30}'}]) is None
    assert "not JSON" in soak.check_output(schema, [{"finish": "stop", "content": '{"name": "Ann"'}])
    assert "validate" in soak.check_output(schema, [{"finish": "stop", "content": '{"name": "Ann", "age": 300}'}])
    assert soak.check_output(schema, [{"finish": "length", "content": '{"name": "A'}]) is None


def test_parse_counters(soak):
    text = "\n".join([
        '# HELP nodeserve:device_role_changes_total role changes',
        'nodeserve:device_role_changes_total{model_name="m",device="cpu:0"} 3.0',
        'nodeserve:device_role_changes_total{model_name="m",device="cpu:1"} 2.0',
        'nodeserve:request_success_total{model_name="m",finished_reason="stop"} 7.0',
        'nodeserve:prefix_cache_hits_total{model_name="m",device="cpu:0"} 128.0',
        'nodeserve:kv_tier_evictions_total{model_name="m",tier="host"} 4.0',
        'nodeserve:device_role_changes_created{model_name="m",device="cpu:0"} 1.7e9',
        'nodeserve:grammar_cache_bytes{model_name="m"} 262144.0',
        'nodeserve:grammar_cache_entries{model_name="m"} 1.0'])
    c = soak.parse_counters(text)
    assert c["gauges"] == {"grammar_cache_bytes": 262144.0, "grammar_cache_entries": 1.0}
    assert c["device_role_changes"] == {"cpu:0": 3.0, "cpu:1": 2.0}
    assert c["request_success"] == {"stop": 7.0} and c["prefix_cache_hits"] == {"cpu:0": 128.0}
    assert c["kv_tier_evictions"] == {"host": 4.0} and c["request_rejected"] == {}


def test_richer_mix_and_conversations(soak):
    """With a Workload: tools (every tool_choice), json_schema (reused and fresh schemas), shared system prompts
    and multi-turn conversations whose history grows with the real answers and starts again at the cap."""
    rng = random.Random(1)
    ids, text = soak.long_inputs(rng)
    wl = soak.Workload(random.Random(2), ids, text)
    specs = []
    for _ in range(3000):
        spec = soak.make_request(rng, ids, text, 0.2, wl)
        specs.append(spec)
        done = {"completed": True, "aborted": False, "_content": "an answer", "prompt_tokens": 300}
        wl.finish(spec, done)
    kinds = {s["kind"] for s in specs}
    assert kinds == {"chat", "completion", "tools", "json_schema", "shared_prefix", "multiturn"}
    tools = [s for s in specs if s["kind"] == "tools"]
    assert {s["tool_choice"] if isinstance(s["tool_choice"], str) else "named" for s in tools} == \
        {"auto", "required", "named"}
    assert all(s["body"]["tools"] == soak.TOOLS for s in tools)
    assert any(m["role"] == "tool" for s in tools for m in s["body"]["messages"])
    schemas = [s for s in specs if s["kind"] == "json_schema"]
    assert all(s["body"]["response_format"]["type"] == "json_schema" for s in schemas)
    fresh = [s for s in schemas if s.get("fresh_schema")]
    assert 0 < len(fresh) < 0.1 * len(schemas) and wl.num_fresh_schemas == len(fresh)
    assert all(s["schema"] in soak.SCHEMAS for s in schemas if not s.get("fresh_schema"))
    shared = [s for s in specs if s["kind"] == "shared_prefix"]
    assert {s["body"]["messages"][0]["content"] for s in shared} == set(wl.system_prompts)
    turns = [s for s in specs if s["kind"] == "multiturn"]
    assert max(s["turn"] for s in turns) >= 3
    deep = next(s for s in turns if s["turn"] == 3)
    msgs = deep["body"]["messages"]
    assert len(msgs) == 1 + 2 * 3 + 1 and msgs[2] == {"role": "assistant", "content": "an answer"}
    assert all(not c["busy"] for c in wl.conversations)
    assert all(s["body"]["stream_options"] == {"include_usage": True} for s in turns if s["stream"])
    assert any(s["disconnect_after"] is not None for s in specs if s["stream"] and s["kind"] != "chat")


def test_conversation_starts_again_at_the_cap_and_aborted_turns_are_not_kept(soak):
    rng = random.Random(0)
    wl = soak.Workload(rng, [1], "x", num_conversations=1, max_conversation_tokens=1000)
    spec = soak._multiturn_request(rng, wl)
    assert spec["turn"] == 0 and soak._multiturn_request(rng, wl) is None   # in use: no second taker
    wl.finish(spec, {"completed": False, "aborted": True})
    spec = soak._multiturn_request(rng, wl)
    assert spec["turn"] == 0                                                 # the aborted turn left no trace
    wl.finish(spec, {"completed": True, "_content": "a", "prompt_tokens": 900})
    spec = soak._multiturn_request(rng, wl)                                  # 900 + 200 > 1000: a new one
    assert spec["turn"] == 0 and spec["conversation_id"] == "0.1" and len(spec["body"]["messages"]) == 2
