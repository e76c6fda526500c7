"""Tensor-parallel groups end to end on the real model, exact path: a group of cpu:N ranks is one device, its
logits stay within 1e-4 of one device's, its greedy tokens equal transformers', and KV moves between groups of
different degree (reshard on the handoff, prefix fetch, host tier, live migration) without a page left held."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.attention.torch_ref import TorchAttention

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.device import make_device
from nodeserve.device.collectives import make_all_reduce
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.runtime.tp_group import GroupAttention, TPGroupModel
from tests.runtime.test_engine import _run  # starts an engine, runs the body, fails if a page is still held

GROUPINGS = {
    "colocated tp2": {"mode": "colocated", "devices": ["cpu:0+cpu:1"]},
    "tp1 -> tp2": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1+cpu:2"],
                   "local_prefill_when_busy": 0},
    "tp2 -> tp1": {"mode": "disaggregated", "prefill": ["cpu:0+cpu:1"], "decode": ["cpu:2"],
                   "local_prefill_when_busy": 0},
}


def _config(devices: dict, memory_gib: float = 0.25, **kv):
    return config_from_dict({"model": {"dtype": "float32"}, "devices": devices,
                             "kv": {"memory_gib": memory_gib, "page_size": 16, **kv},
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


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_greedy_matches_transformers_streamed_and_concurrent(grouping, loaded_fp32, prompt_ids, hf_greedy):
    async def body(engine):
        return await asyncio.gather(*(_tokens(engine.add_request(ids, _greedy())) for ids in prompt_ids))
    assert _run(_config(GROUPINGS[grouping]), loaded_fp32, body) == hf_greedy


@pytest.mark.slow
@pytest.mark.parametrize("grouping", ["tp1 -> tp2", "tp2 -> tp1"])
def test_random_aborts_leave_no_page_held_on_any_rank(grouping, loaded_fp32, prompt_ids):
    """One page-id space per group: the manager's count covers every rank's share of each page."""
    long_prompt = (prompt_ids[6] * 40)[:400]

    async def body(engine):
        streams = [engine.add_request(long_prompt if i % 2 else prompt_ids[i % 8], _greedy(120 if i < 8 else 16))
                   for i in range(10)]
        for s in streams[:3]:
            engine.abort(s)  # pending or mid-prefill
        n = 0
        async for _ in streams[4]:
            n += 1
            if n == 3:
                break
        for s in streams[3:8]:
            engine.abort(s)  # mid-transfer or decoding
        return [len(t) for t in await asyncio.gather(*(_tokens(s) for s in streams[8:]))]
    assert _run(_config(GROUPINGS[grouping]), loaded_fp32, body) == [16, 16]


def test_prefix_cache_across_groups_of_different_degree(loaded_fp32, prompt_ids):
    """Conditional mode over a TP 2 prefill group and a TP 1 decode device: a short suffix prefills on the decode
    device, a longer one on the group, which fetches the page only the decode device holds (a reshard from one
    rank to two). The tokens equal those of the same run without the cache."""
    from tests.runtime.test_prefix_cache import _conversation

    base = (prompt_ids[6] * 4)[:60]
    first = base + prompt_ids[4]
    prompts = [base, first, base + prompt_ids[5], first + prompt_ids[7]]
    devices = {"mode": "disaggregated", "prefill": ["cpu:0+cpu:1"], "decode": ["cpu:2"],
               "local_prefill_threshold": 30, "local_prefill_when_busy": 0}
    on, cached_on = _run(_config(devices), loaded_fp32, lambda e: _conversation(e, prompts))
    off, _ = _run(_config(devices, prefix_cache=False), loaded_fp32, lambda e: _conversation(e, prompts))
    assert on == off
    fetched = sum(n for source, n in cached_on[4].items() if source.startswith("device:"))
    assert cached_on[:4] == [0, 48, 48, 64] and fetched == 16


def test_host_tier_keeps_whole_pages_whatever_the_sharding(loaded_fp32):
    """Pages evicted from a TP 2 group's small pool go to the host tier as whole pages (every head) and come back
    into the group: same tokens as without the tier, and the follow-up's prefix comes from the host."""
    from tests.runtime.test_kv_tiers import _evict_and_return, _long_prompt

    tok = loaded_fp32.tokenizer
    a, b, c = (_long_prompt(tok, s, 200) for s in (1, 2, 3))
    convo = (a, b, c, a + tok.encode(" And then what happened next?"))
    pool_gib = 16 * 737_280 / 2**30  # 16 float32 pages
    devices = {"mode": "colocated", "devices": ["cpu:0+cpu:1"]}
    off, _, _ = _run(_config(devices, memory_gib=pool_gib), loaded_fp32, lambda e: _evict_and_return(e, convo))
    on, cached, sources = _run(_config(devices, memory_gib=pool_gib, host_memory_gib=0.05), loaded_fp32,
                               lambda e: _evict_and_return(e, convo))
    assert on == off and cached >= 176 and sources.get("host", 0) > 0, sources


@pytest.mark.parametrize("live", [True, False])
def test_a_request_moves_between_groups_of_different_degree(loaded_fp32, prompt_ids, live):
    """Live migration from a TP 1 device to a TP 2 group (or back): the KV is resharded round by round, the tokens
    equal a run that never moved, and every page on both sides comes back."""
    from tests.runtime.test_migration import _run_moving

    prompt = (prompt_ids[0] * 20)[:150]

    async def body(engine):
        base = await _run_moving(engine, prompt, 24, None, live)
        moved = await _run_moving(engine, prompt, 24, 8, live)
        return base, moved, dict(engine.router.num_migrations)
    devices = {"mode": "colocated", "devices": ["cpu:0", "cpu:1+cpu:2"]}
    base, moved, outcomes = _run(_config(devices, prefix_cache=False), loaded_fp32, body)
    assert base[0] == moved[0] and len(base[0]) == 24 and outcomes == {"moved": 1}
