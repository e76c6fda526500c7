"""Core lending on the real model (runtime/lending.py): with devices.lend_idle_cores the greedy tokens are the
ones without it, the idle device's core did take GEMM halves, and the helper threads end with the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.kernels import native
from nodeserve.runtime.engine import Engine

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
