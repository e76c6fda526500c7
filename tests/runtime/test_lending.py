"""Core lending on the real model (runtime/lending.py): with devices.lend_idle_cores the greedy tokens are the
ones without it, the idle device's core did take GEMM halves, and the helper threads end with the engine; a
decode device lends its core between steps only to a long prefill queue, within the inter-token gap."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.kernels import native
from nodeserve.runtime.engine import Engine
from nodeserve.runtime.lending import MIN_BACKLOG_TOKENS, SlackLending

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels could not be built")


@pytest.fixture(scope="module")
def loaded_auto(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, quantization="auto")


def _serve(loaded, prompts, lend: bool):
    cfg = config_from_dict({"devices": {"mode": "disaggregated", "lend_idle_cores": lend},
                            "kv": {"memory_gib": 0.1}, "profile": {"startup": False}})
    engine = Engine(cfg, loaded)

    async def tokens(ids):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        return [ev.token_id async for ev in engine.add_request(ids, params) if ev.token_id is not None]

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            out = [await tokens(ids) for ids in prompts]  # one at a time: the other device idles meanwhile
            return out, engine.lending.num_jobs() if engine.lending is not None else None
        finally:
            engine.stop()
    out, jobs = asyncio.run(main())
    return out, jobs, engine


def test_lending_keeps_the_tokens_and_the_idle_core_helps(loaded_auto, prompt_ids):
    plain, jobs, engine = _serve(loaded_auto, prompt_ids[:2], lend=False)
    assert jobs is None and engine.lending is None
    lent, jobs, engine = _serve(loaded_auto, prompt_ids[:2], lend=True)
    assert lent == plain
    # cpu:1's core helped cpu:0's prefills, cpu:0's helped cpu:1's decode steps
    assert jobs[0] > 0 and jobs[1] > 0, jobs
    assert engine.lending.helpers == []  # freed at stop


def test_slack_lending_pauses_up_to_the_gap_only_for_a_long_queue():
    queued = [0]
    slack = SlackLending(lambda: queued[0], max_gap_s=0.06)
    assert slack.pause(step_start=10.0, now=10.02) == 0.0  # nothing queued there
    queued[0] = MIN_BACKLOG_TOKENS - 1
    assert slack.pause(10.0, 10.02) == 0.0                 # a short prompt: over before a slice helps it
    assert not slack.wanted()                              # ... so speculation may take the slack
    queued[0] = MIN_BACKLOG_TOKENS
    assert slack.wanted()
    assert slack.pause(10.0, 10.02) == pytest.approx(0.04)  # the step's 20 ms + 40 ms lent = the 60 ms gap
    assert slack.pause(10.0, 10.058) == 0.0                # 2 ms left: not worth a slice
    assert slack.pause(10.0, 10.08) == 0.0                 # the step alone took longer than the gap


def _serve_overlapped(loaded, short_ids, long_ids, between: bool):
    """A request decoding on cpu:1 while a long prompt prefills on cpu:0: (both outputs, seconds cpu:1 lent)."""
    cfg = config_from_dict({"devices": {"mode": "disaggregated", "lend_between_steps": between},
                            "kv": {"memory_gib": 0.2}, "profile": {"startup": False}})
    engine = Engine(cfg, loaded)

    async def tokens(ids, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [ev.token_id async for ev in engine.add_request(ids, params) if ev.token_id is not None]

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            decoding = asyncio.ensure_future(tokens(short_ids, 48))
            while not engine.decode_workers[0].scheduler.running:  # decoding on cpu:1 before the prompt comes
                await asyncio.sleep(0.005)
            out = await asyncio.gather(decoding, tokens(long_ids, 2))
            return out, engine.decode_workers[0].lent_seconds
        finally:
            engine.stop()
    return asyncio.run(main())


def test_a_decode_device_lends_its_core_between_steps_to_a_long_prefill(loaded_auto, prompt_ids):
    long_ids = (prompt_ids[0] * (2 * MIN_BACKLOG_TOKENS // len(prompt_ids[0]) + 1))[:MIN_BACKLOG_TOKENS + 200]
    plain, lent_s = _serve_overlapped(loaded_auto, prompt_ids[1], long_ids, between=False)
    assert lent_s == 0.0
    lent, lent_s = _serve_overlapped(loaded_auto, prompt_ids[1], long_ids, between=True)
    assert lent == plain  # the same greedy tokens, for both requests
    assert lent_s > 0.0
