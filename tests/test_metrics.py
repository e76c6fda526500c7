"""Metrics: exact counts/sums from synthetic requests, scrape-time gauges, the aiohttp handler, isolation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.parser import text_string_to_metric_families

from nodeserve.metrics import Metrics, PoolStats

MODEL = "smol"


def scrape(m: Metrics) -> dict[str, list]:
    """Family name -> samples, from the text exposition (what Prometheus would read)."""
    text = generate_latest(m.registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(fams, family: str, sample: str, **labels) -> float:
    hits = [s.value for s in fams[family] if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, sample, labels, hits)
    return hits[0]


def fill(m: Metrics) -> None:
    # Tokens as server/generation.py counts them, as they come: a prompt with its first token.
    for prompt, n in ((10, 4), (7, 2)):
        m.observe_tokens(prompt, 1)
        for _ in range(n - 1):
            m.observe_tokens(0, 1)
    # Request 1: 4 tokens, stop. arrival 100, first token at 100.5, then every 0.1 s; finished at 100.8.
    m.observe_request(prompt_tokens=10, completion_tokens=4, finish_reason="stop", arrival=100.0,
                      first_token=100.5, finished=100.8, token_times=[100.5, 100.6, 100.7, 100.8],
                      queue_time=0.25, prefill_time=0.25, decode_time=0.25)
    # Request 2: 2 tokens, length, no phase timings.
    m.observe_request(prompt_tokens=7, completion_tokens=2, finish_reason="length", arrival=200.0,
                      first_token=201.0, finished=203.0, token_times=[201.0, 203.0])
    # Request 3: aborted before its first token.
    m.observe_request(prompt_tokens=5, completion_tokens=0, finish_reason="abort", arrival=300.0,
                      first_token=None, finished=300.5, token_times=[])
    m.observe_transfer(0.002, 65536)
    m.rejected("queue_full")
    m.rejected("queue_full")
    m.rejected("too_large")


def test_counts_and_sums():
    m = Metrics(MODEL)
    fill(m)
    f = scrape(m)
    h = "nodeserve:time_to_first_token_seconds"
    assert value(f, h, h + "_count", model_name=MODEL) == 2
    assert value(f, h, h + "_sum", model_name=MODEL) == pytest.approx(1.5)
    assert value(f, h, h + "_bucket", model_name=MODEL, le="0.5") == 1
    assert value(f, h, h + "_bucket", model_name=MODEL, le="+Inf") == 2

    h = "nodeserve:inter_token_latency_seconds"  # 3 gaps of 0.1 s, 1 gap of 2 s
    assert value(f, h, h + "_count") == 4
    assert value(f, h, h + "_sum") == pytest.approx(2.3)

    h = "nodeserve:request_time_per_output_token_seconds"  # (0.8-0.5)/3 and (3-1)/1
    assert value(f, h, h + "_count") == 2
    assert value(f, h, h + "_sum") == pytest.approx(0.1 + 2.0)

    h = "nodeserve:e2e_request_latency_seconds"
    assert value(f, h, h + "_count") == 3
    assert value(f, h, h + "_sum") == pytest.approx(0.8 + 3.0 + 0.5)

    for name in ("queue", "prefill", "decode"):
        h = f"nodeserve:request_{name}_time_seconds"
        assert value(f, h, h + "_count") == 1
        assert value(f, h, h + "_sum") == pytest.approx(0.25)

    h = "nodeserve:kv_transfer_time_seconds"
    assert value(f, h, h + "_count") == 1
    assert value(f, h, h + "_sum") == pytest.approx(0.002)
    h = "nodeserve:kv_transfer_bytes"
    assert value(f, h, h + "_count") == 1
    assert value(f, h, h + "_sum") == 65536
    assert value(f, h, h + "_bucket", le="65536.0") == 1
    assert value(f, h, h + "_bucket", le="16384.0") == 0

    # the aborted request's 5 prompt tokens never made a token: not counted (vLLM counts what a step computed)
    assert value(f, "nodeserve:prompt_tokens", "nodeserve:prompt_tokens_total", model_name=MODEL) == 17
    assert value(f, "nodeserve:generation_tokens", "nodeserve:generation_tokens_total") == 6
    c = "nodeserve:request_success"
    assert {r: value(f, c, c + "_total", finished_reason=r) for r in ("stop", "length", "abort", "error")} == \
        {"stop": 1, "length": 1, "abort": 1, "error": 0}
    c = "nodeserve:request_rejected"
    assert {r: value(f, c, c + "_total", reason=r)
            for r in ("queue_full", "too_large", "bad_request", "unauthorized", "draining")} == \
        {"queue_full": 2, "too_large": 1, "bad_request": 0, "unauthorized": 0, "draining": 0}


def test_gauges_read_at_scrape_time():
    m = Metrics(MODEL)
    f = scrape(m)  # no source yet: the families exist, with no samples
    assert f["nodeserve:num_requests_running"] == [] and f["nodeserve:kv_cache_usage_perc"] == []

    states = [PoolStats("cpu:0", "prefill", 100, 75, 1, 2), PoolStats("cpu:1", "decode", 200, 200, 3, 0)]
    m.set_state_source(lambda: states)
    f = scrape(m)
    assert value(f, "nodeserve:num_requests_running", "nodeserve:num_requests_running",
                 device="cpu:0", role="prefill", model_name=MODEL) == 1
    assert value(f, "nodeserve:num_requests_waiting", "nodeserve:num_requests_waiting",
                 device="cpu:0", role="prefill") == 2
    assert value(f, "nodeserve:num_requests_running", "nodeserve:num_requests_running",
                 device="cpu:1", role="decode") == 3
    assert value(f, "nodeserve:kv_pages_used", "nodeserve:kv_pages_used", device="cpu:0") == 25
    assert value(f, "nodeserve:kv_pages_free", "nodeserve:kv_pages_free", device="cpu:0") == 75
    assert value(f, "nodeserve:kv_cache_usage_perc", "nodeserve:kv_cache_usage_perc", device="cpu:0") == 0.25
    assert value(f, "nodeserve:kv_cache_usage_perc", "nodeserve:kv_cache_usage_perc", device="cpu:1") == 0.0

    # Read again at the next scrape, not pushed.
    states[1] = PoolStats("cpu:1", "decode", 200, 50, 0, 0, lent_seconds=1.5)
    f = scrape(m)
    assert value(f, "nodeserve:kv_cache_usage_perc", "nodeserve:kv_cache_usage_perc", device="cpu:1") == 0.75
    assert value(f, "nodeserve:core_lent_between_steps_seconds", "nodeserve:core_lent_between_steps_seconds_total",
                 device="cpu:1") == 1.5

    # The router's admission queue is a waiting series of its own, so sum(num_requests_waiting) counts it.
    pending = [4]
    m.set_state_source(lambda: states, pending=lambda: pending[0])
    f = scrape(m)
    assert value(f, "nodeserve:num_requests_waiting", "nodeserve:num_requests_waiting",
                 device="router", role="admission") == 4
    pending[0] = 0
    assert value(scrape(m), "nodeserve:num_requests_waiting", "nodeserve:num_requests_waiting",
                 device="router", role="admission") == 0
    assert "router" not in {s.labels["device"] for s in f["nodeserve:kv_pages_used"]}

    # A failing source leaves the gauges empty instead of failing the scrape.
    m.set_state_source(lambda: 1 / 0)
    f = scrape(m)
    assert f["nodeserve:kv_pages_used"] == []
    assert value(f, "nodeserve:request_success", "nodeserve:request_success_total", finished_reason="stop") == 0


def test_speculative_decoding_counters_per_device_and_with_vllm_names():
    m = Metrics(MODEL)
    states = [PoolStats("cpu:0", "prefill", 10, 10, 0, 0),
              PoolStats("cpu:1", "decode", 10, 10, 0, 0, num_spec_drafts=4, num_spec_draft_tokens=12,
                        num_spec_accepted_tokens=7, spec_accepted_per_pos=(4, 2, 1)),
              PoolStats("cpu:2", "decode", 10, 10, 0, 0, num_spec_drafts=1, num_spec_draft_tokens=1,
                        num_spec_accepted_tokens=1, spec_accepted_per_pos=(1,))]
    m.set_state_source(lambda: states)
    f = scrape(m)
    assert value(f, "nodeserve:spec_decode_num_draft_tokens", "nodeserve:spec_decode_num_draft_tokens_total",
                 device="cpu:1") == 12
    assert value(f, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 5
    assert value(f, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total") == 13
    assert value(f, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total") == 8
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert [value(f, per_pos, per_pos + "_total", position=str(j)) for j in range(3)] == [5, 2, 1]


def test_aiohttp_handler():
    m = Metrics(MODEL)
    fill(m)
    m.set_state_source(lambda: [PoolStats("cuda:0", "colocated", 10, 4, 2, 1)])

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", m.handler())
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/metrics")
            return resp.status, resp.headers["Content-Type"], await resp.text()

    status, ctype, text = asyncio.run(main())
    assert status == 200
    assert ctype.startswith("text/plain")
    fams = list(text_string_to_metric_families(text))
    assert fams and all(f.name.startswith(("nodeserve:", "vllm:")) for f in fams)
    by_name = {f.name: f.samples for f in fams}
    assert value(by_name, "nodeserve:kv_pages_used", "nodeserve:kv_pages_used", device="cuda:0") == 6
    assert value(by_name, "nodeserve:generation_tokens", "nodeserve:generation_tokens_total") == 6


def test_instances_do_not_collide():
    a, b = Metrics("a"), Metrics("b")  # would raise "Duplicated timeseries" with a shared registry
    a.rejected("draining")
    a.observe_transfer(0.1, 4096)
    fa, fb = scrape(a), scrape(b)
    c = "nodeserve:request_rejected"
    assert value(fa, c, c + "_total", reason="draining", model_name="a") == 1
    assert value(fb, c, c + "_total", reason="draining", model_name="b") == 0
    h = "nodeserve:kv_transfer_bytes"
    assert value(fb, h, h + "_count") == 0


def test_ttft_prediction_error_and_slo_rejections():
    m = Metrics(MODEL)
    # Predicted 0.8 s, took 0.5 s: -0.3. Predicted 0.2 s, took 1.0 s: +0.8. No prediction: not observed.
    for predicted, first in ((0.8, 100.5), (0.2, 101.0), (None, 100.1)):
        m.observe_request(prompt_tokens=10, completion_tokens=2, finish_reason="stop", arrival=100.0,
                          first_token=first, finished=102.0, token_times=[first, 102.0], predicted_ttft=predicted)
    m.rejected("slo")
    f = scrape(m)
    h = "nodeserve:ttft_prediction_error_seconds"
    assert value(f, h, h + "_count") == 2  # no _sum: prometheus_client leaves it out with negative buckets
    assert value(f, h, h + "_bucket", le="-0.2") == 1 and value(f, h, h + "_bucket", le="0.0") == 1
    r = "nodeserve:request_rejected"
    assert value(f, r, r + "_total", reason="slo") == 1


def test_grammar_cache_size_read_at_scrape_time():
    m = Metrics(MODEL)
    cache = {"a": 1, "b": 2}
    m.set_grammar_source(lambda: len(cache), lambda: 3 * 2**20)
    f = scrape(m)
    assert value(f, "nodeserve:grammar_cache_entries", "nodeserve:grammar_cache_entries") == 2
    cache["c"] = 3
    f = scrape(m)
    assert value(f, "nodeserve:grammar_cache_entries", "nodeserve:grammar_cache_entries") == 3
    assert value(f, "nodeserve:grammar_cache_bytes", "nodeserve:grammar_cache_bytes") == 3 * 2**20


def test_kv_tiers_read_at_scrape_time():
    from nodeserve.runtime.kv_tiers import TierStats

    m = Metrics(MODEL)
    assert scrape(m)["nodeserve:kv_tier_pages_used"] == []  # no source yet
    tiers = [TierStats("device", 400, 10, 64, 4, 4 * 1000, 0.5, 7, num_held=10),
             TierStats("host", 1000, 300, 2048, 128, 128 * 1000, 0.25, 3, num_dropped=5),
             TierStats("disk", 5000, 900, 512, 32, 32 * 1000, 0.125, 0, num_bad_files=2, num_write_errors=3,
                       num_read_timeouts=4)]
    m.set_tier_source(lambda: tiers)
    f = scrape(m)
    assert value(f, "nodeserve:kv_tier_pages_used", "nodeserve:kv_tier_pages_used", tier="host") == 300
    assert value(f, "nodeserve:kv_tier_pages_free", "nodeserve:kv_tier_pages_free", tier="host") == 700
    assert value(f, "nodeserve:kv_tier_hit_tokens", "nodeserve:kv_tier_hit_tokens_total", tier="device") == 64
    assert value(f, "nodeserve:kv_tier_loaded_bytes", "nodeserve:kv_tier_loaded_bytes_total", tier="disk") == 32000
    assert value(f, "nodeserve:kv_tier_load_seconds", "nodeserve:kv_tier_load_seconds_total", tier="host") == 0.25
    assert value(f, "nodeserve:kv_tier_evictions", "nodeserve:kv_tier_evictions_total", tier="device") == 7
    assert value(f, "nodeserve:kv_tier_bad_files", "nodeserve:kv_tier_bad_files_total", tier="disk") == 2
    assert value(f, "nodeserve:kv_tier_dropped_pages", "nodeserve:kv_tier_dropped_pages_total", tier="host") == 5
    assert value(f, "nodeserve:kv_tier_write_errors", "nodeserve:kv_tier_write_errors_total", tier="disk") == 3
    assert value(f, "nodeserve:kv_tier_read_timeouts", "nodeserve:kv_tier_read_timeouts_total", tier="disk") == 4
    m.set_tier_source(lambda: 1 / 0)  # a failing source empties the families, never the scrape
    assert scrape(m)["nodeserve:kv_tier_hit_tokens"] == []


def test_a_scrape_runs_off_the_event_loop_so_a_slow_collector_never_stalls_it():
    m = Metrics(MODEL)
    threads = []

    class Slow(Collector):
        def collect(self):
            threads.append(threading.current_thread())
            time.sleep(0.5)  # a collector taking half a second (a large registry, a slow source)
            return []

    m.registry.register(Slow())
    m.set_node_source(lambda: None)

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", m.handler())
        async with TestClient(TestServer(app)) as client:
            scrape = asyncio.ensure_future(client.get("/metrics"))
            await asyncio.sleep(0.1)  # the scrape is under way
            t0 = time.monotonic()
            await asyncio.sleep(0.01)  # the loop answers meanwhile
            ticked = time.monotonic() - t0
            resp = await scrape
            return resp.status, ticked

    status, ticked = asyncio.run(main())
    assert status == 200 and threads and threads[0] is not threading.main_thread()
    assert ticked < 0.2, ticked  # on the loop, the scrape would have held it for ~0.4 s more
