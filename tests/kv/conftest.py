"""Helpers the KV dtype tests share (test_fp8_kv.py, test_f16_kv.py), as fixtures: a step's attention metadata
laid out on given pages, greedy tokens through one ModelRunner over a pool of a given dtype, and an engine
serving prompts greedily."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk


def _step_meta(seqs: list[tuple[int, int]], page_size: int,
               table_ids: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """(cached, new) per sequence, decodes first, on pages taken in order from table_ids -> (metadata, the slot of
    every token of every sequence)."""
    tables, slots, all_slots = [], [], []
    for cached, new in seqs:
        n = pages_for(cached + new, page_size)
        table, table_ids = table_ids[:n], table_ids[n:]
        tables.append(table)
        seq = [table[p // page_size] * page_size + p % page_size for p in range(cached + new)]
        slots += seq[cached:]
        all_slots += seq
    page_tables = torch.zeros(len(seqs), max(len(t) for t in tables), dtype=torch.int64)
    for b, t in enumerate(tables):
        page_tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), page_tables=page_tables,
                             seq_lens=torch.tensor(seq_lens), query_lens=[n for _, n in seqs],
                             seq_lens_host=seq_lens, num_decodes=sum(n == 1 for _, n in seqs), page_size=page_size,
                             page_tables_host=tables)
    return meta, torch.tensor(all_slots)


def _greedy(loaded, dtype: torch.dtype, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, batched through one ModelRunner over one pool of `dtype`."""
    pool = KVPool(loaded.config, 128, 16, dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))
    tables = [pool.manager.allocate(pages_for(len(p) + num_tokens, 16)) for p in prompts]
    out = [[t] for t in runner.run([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]).argmax(-1).tolist()]
    for step in range(num_tokens - 1):
        logits = runner.run([SeqChunk([o[-1]], len(p) + step, t) for p, o, t in zip(prompts, out, tables)])
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


def _serve(cfg, loaded, prompts: list[list[int]], max_tokens: int, check=None):
    """An Engine on cfg, warmed up, `check(engine)` called, every prompt served greedily -> ([(tokens,
    finish_reason)], the pools' stats once every page is back, or after 10 s)."""
    from nodeserve.core.sampling_params import SamplingParams
    from nodeserve.runtime.engine import Engine

    async def main():
        engine = Engine(cfg, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.warmup)
            if check is not None:
                check(engine)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            streams = [engine.add_request(ids, params) for ids in prompts]
            out = []
            for s in streams:
                events = [ev async for ev in s]
                out.append(([ev.token_id for ev in events if ev.token_id is not None], events[-1].finish_reason))
            for _ in range(200):
                if all(p.num_free == p.num_pages for p in engine.pool_stats()):
                    break
                await asyncio.sleep(0.05)
            return out, engine.pool_stats()
        finally:
            engine.stop()

    return asyncio.run(main())


@pytest.fixture(scope="session")
def serve():
    return _serve


@pytest.fixture(scope="session")
def step_meta():
    return _step_meta


@pytest.fixture(scope="session")
def greedy():
    return _greedy
