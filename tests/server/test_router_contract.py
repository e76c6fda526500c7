"""What routers in front of several nodes read (SMG, the Inference Extension's endpoint picker, production-stack):
vLLM's metric names, one series each and consistent with the per-device ones; /v1/models' root and
max_model_len; SMG's /v1/loads; /flush_cache."""

from __future__ import annotations

import json
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

VLLM_ONE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:prefix_cache_queries",
                   "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
                   "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                   "vllm:request_generation_tokens", "vllm:prompt_tokens", "vllm:generation_tokens")


def _get(server, path: str, method: str = "GET"):
    req = urllib.request.Request(server.url + path, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def _families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_get(server, "/metrics"))}


def _one(fams, name: str, sample: str | None = None) -> float:
    values = [s.value for s in fams[name].samples if s.name == (sample or name)]
    assert len(values) == 1, (name, values)
    return values[0]


def test_vllm_names_are_one_series_each_and_agree_with_the_per_device_ones(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "The harbor at dawn: " + "gulls and rope and salt, " * 30
    for _ in range(2):  # the second one's prefix is cached
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    fams = _families(server)
    for name in VLLM_ONE_SERIES:
        label_sets = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in fams[name].samples}
        assert len(label_sets) == 1, (name, label_sets)
        (labels,) = label_sets
        assert dict(labels).get("model_name") == "smollm2", (name, labels)
        if name != "vllm:cache_config_info":
            assert set(dict(labels)) == {"model_name"}, (name, labels)
    assert _one(fams, "vllm:num_requests_running") == 0 and _one(fams, "vllm:num_requests_waiting") == 0
    decode = [s for s in fams["nodeserve:kv_pages_used"].samples if s.labels["device"] == "cpu:1"]
    free = [s for s in fams["nodeserve:kv_pages_free"].samples if s.labels["device"] == "cpu:1"]
    pages = decode[0].value + free[0].value
    assert _one(fams, "vllm:kv_cache_usage_perc") == decode[0].value / pages == _one(fams, "vllm:gpu_cache_usage_perc")
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) == pages
    queries, hits = _one(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"), \
        _one(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert hits >= 16 and queries >= 2 * 16 and hits < queries  # the second request found the first one's pages
    assert _one(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == \
        _one(fams, "nodeserve:prompt_tokens", "nodeserve:prompt_tokens_total")
    assert _one(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count") == \
        _one(fams, "nodeserve:e2e_request_latency_seconds", "nodeserve:e2e_request_latency_seconds_count")


def test_models_loads_and_flush_cache(server):
    model = json.loads(_get(server, "/v1/models"))["data"][0]
    assert model["root"] == "smollm2-135m-instruct" and model["max_model_len"] > 0
    loads = json.loads(_get(server, "/v1/loads"))
    (rank,) = loads["loads"]
    assert loads["dp_rank_count"] == 1 and rank["num_running_reqs"] == 0 and rank["max_total_num_tokens"] > 0
    assert 0 <= rank["token_usage"] <= 1 and rank["max_running_requests"] >= 1
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model="smollm2", prompt="A long enough prompt to fill a page or two. " * 8,
                              max_tokens=2, temperature=0)
    # The decode rate over the last 10 s (SMG's least_load drains queued work at it): that request's second token.
    assert json.loads(_get(server, "/v1/loads"))["loads"][0]["gen_throughput"] > 0
    dropped = json.loads(_get(server, "/flush_cache", "POST"))["num_pages_dropped"]
    assert dropped > 0
    assert json.loads(_get(server, "/flush_cache", "POST"))["num_pages_dropped"] == 0  # nothing left to drop
