"""Greedy parity with transformers in float32, token for token: one prompt at a time and all batched together."""

from __future__ import annotations

import torch

from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.kv.pool import KVPool, pages_for

NUM_NEW_TOKENS = 32  # tests/conftest.py generates this many reference tokens


def _greedy(loaded, prompts: list[list[int]], page_size: int, prefill_chunk: int) -> list[list[int]]:
    """Runs all prompts together: chunked prefill, then batched decode, the way a worker steps."""
    cfg = loaded.config
    pool = KVPool(cfg, 512, page_size, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, TorchAttention(pool, cfg, torch.float32))
    tables = [pool.manager.allocate(pages_for(len(p) + NUM_NEW_TOKENS, page_size)) for p in prompts]
    done = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks, idx = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = min(prefill_chunk, len(p) - done[i])
                chunks.append(SeqChunk(p[done[i]:done[i] + n], done[i], tables[i], done[i] + n == len(p)))
                idx.append(i)
                done[i] += n
        logits = runner.run(chunks)
        rows = iter(logits.argmax(-1).tolist())
        for i, c in zip(idx, chunks):
            if c.want_logits:
                outs[i].append(next(rows))
    for _ in range(NUM_NEW_TOKENS - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, outs, tables)]
        for o, tok in zip(outs, runner.run(chunks).argmax(-1).tolist()):
            o.append(tok)
    for t in tables:
        pool.manager.free(t)
    assert pool.manager.num_free == pool.num_pages
    return outs


def test_one_prompt_at_a_time_matches_transformers(loaded_fp32, prompt_ids, hf_greedy):
    for ids, ref in zip(prompt_ids, hf_greedy):
        assert _greedy(loaded_fp32, [ids], page_size=16, prefill_chunk=4096) == [ref]


def test_batched_prompts_of_different_lengths_match_transformers(loaded_fp32, prompt_ids, hf_greedy):
    assert len({len(p) for p in prompt_ids}) > 4  # genuinely ragged
    assert _greedy(loaded_fp32, prompt_ids, page_size=16, prefill_chunk=4096) == hf_greedy


def test_chunked_prefill_and_odd_page_size_match_transformers(loaded_fp32, prompt_ids, hf_greedy):
    assert _greedy(loaded_fp32, prompt_ids, page_size=7, prefill_chunk=9) == hf_greedy


def test_reference_output_is_the_known_answer(loaded_fp32, prompt_ids, hf_greedy):
    text = loaded_fp32.tokenizer.decode(hf_greedy[0])
    assert text.startswith("The capital of France is Paris.")
