"""bench/prefill_headroom.py on a hand-made cost model: only the prompt coefficients of the prefill devices are
divided, and a replay finds the on-time counts worked out by hand."""

from __future__ import annotations

import pytest

from nodeserve.config import config_from_dict
from nodeserve.core.cost_model import FEATURES

# One prefill core at 1 ms a prompt token (no fixed cost, no attention cost), one decode core at 1 ms a step.
PROFILE = {"kv_bytes_per_token": 0, "num_layers": 1, "devices": {
    "cpu:0": {"coefficients": {"prefill_tokens": 1e-3}, "samples": []},
    "cpu:1": {"coefficients": {"step": 1e-3, "prefill_tokens": 1e-3}, "samples": []}}}
# Four 2,000-token prompts sent 0.4 s apart: 2 s of prefill each against a TTFT limit of 2.5 s.
RECORDS = [{"prompt_len": 2000, "max_tokens": 4, "sent_s": 10.0 + 0.4 * i, "ok": True, "ttft": 9.0, "tpot": 0.01}
           for i in range(4)]


@pytest.fixture(scope="module")
def H(load_bench):
    return load_bench("prefill_headroom")


def test_only_the_prefill_devices_prompt_coefficients_are_divided(H):
    cost = H.faster_prefill(PROFILE, ["cpu:0"], 4.0)
    coef = dict(zip(FEATURES, cost.devices["cpu:0"].coef))
    assert coef["prefill_tokens"] == pytest.approx(2.5e-4) and coef["step"] == 0.0
    assert dict(zip(FEATURES, cost.devices["cpu:1"].coef))["prefill_tokens"] == pytest.approx(1e-3)


def test_replay_meets_what_the_faster_prefill_allows(H):
    """x1: 2 s a prompt; the first ends at 2.0 s (on time), and any next one would end at 4.0 s, past every
    other limit (2.9, 3.3, 3.7 s): 1 of 4 on time, in either order. x4: 0.5 s each, TTFTs 0.5-0.8 s: all 4."""
    config = config_from_dict({}, check_devices=False)
    rows = {r["factor"]: r for r in H.headroom(config, PROFILE, RECORDS, [1.0, 4.0])}
    for order in ("fifo", "deadline"):
        assert rows[1.0][order]["long_on_time"] == 1 and rows[1.0][order]["attainment"] == 0.25
        assert rows[4.0][order]["long_on_time"] == 4 and rows[4.0][order]["attainment"] == 1.0
    assert H.summary(config, RECORDS, 1000) == {"attainment": 0.0, "long_on_time": 0, "num_long": 4}
