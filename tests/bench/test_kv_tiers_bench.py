"""bench/kv_tiers.py's pure helpers: the /metrics parser, the working set, the target checks."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kvt(load_bench):
    return load_bench("kv_tiers")


def test_counters_keys_by_device_or_tier(kvt):
    text = "\n".join([
        "# TYPE nodeserve:prompt_tokens_computed_total counter",
        'nodeserve:prompt_tokens_computed_total{device="cpu:0",model_name="m"} 2543.0',
        'nodeserve:prompt_tokens_computed_total{device="cpu:1",model_name="m"} 7.0',
        'nodeserve:kv_tier_hit_tokens_total{model_name="m",tier="host"} 1104.0',
        'nodeserve:prompt_tokens_total{model_name="m"} 5.0',
    ])
    c = kvt.counters(text)
    assert c["prompt_tokens_computed_total"] == {"cpu:0": 2543.0, "cpu:1": 7.0}
    assert c["kv_tier_hit_tokens_total"] == {"host": 1104.0}
    assert c["prompt_tokens_total"] == {"": 5.0}


def test_working_set_counts_each_conversations_last_turn(kvt):
    recs = [{"conv": 0, "turn": 0, "prompt_tokens": 100, "completion_tokens": 32},
            {"conv": 0, "turn": 1, "prompt_tokens": 200, "completion_tokens": 32},   # 232 tokens: 15 pages
            {"conv": 1, "turn": 0, "prompt_tokens": 16, "completion_tokens": 0}]     # 1 page
    assert kvt.working_set_pages(list(reversed(recs))) == 16


def test_check_and_ratio(kvt):
    assert kvt.check(1.2, 1.25).startswith("PASS")
    assert kvt.check(1.3, 1.25).startswith("FAIL")
    assert kvt.check(1000, 1000, ">=").startswith("PASS")
    assert kvt.check(None, 1).startswith("FAIL")
    assert kvt.ratio(1, 0) is None and kvt.ratio(None, 2) is None and kvt.ratio(1, 4) == 0.25
