"""The prefix cache end to end on the real model: the same tokens with it on and off in every mode, for requests
that share prefixes with earlier, concurrent and aborted ones; only the uncached suffix is prefilled and
transferred; every pool is whole (free + evictable = total) when idle."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from tests.runtime.test_engine import MODES, _greedy, _tokens, _wait_pools_whole


def _config(mode: str, prefix_cache: bool, memory_gib: float = 0.25):
    return config_from_dict({"model": {"dtype": "float32", "quantization": "none"}, "devices": MODES[mode],
                             "kv": {"memory_gib": memory_gib, "page_size": 16, "prefix_cache": prefix_cache},
                             "scheduler": {"max_num_batched_tokens": 48}})


def _run(config, loaded, body, on_transfer=None):
    async def main():
        engine = Engine(config, loaded, on_transfer=on_transfer)
        engine.start(asyncio.get_running_loop())
        try:
            result = await body(engine)
            await _wait_pools_whole(engine)
            return result, engine.pool_stats(), [w.kv.num_cached for w in engine.workers]
        finally:
            engine.stop()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def prompts(prompt_ids):
    """A conversation's turns: each prompt extends an earlier one, as a chat client resends its history."""
    base = (prompt_ids[6] * 4)[:60]
    first = base + prompt_ids[4]
    return [base, first, base + prompt_ids[5], first + prompt_ids[7]]


async def _conversation(engine, prompts):
    """prompts[0] alone; then prompts[1] and [2] together with an aborted request sharing their prefix; then
    prompts[3], which extends prompts[1]. Returns the tokens and each request's cached prompt tokens."""
    first = engine.add_request(prompts[0], _greedy(max_tokens=8))
    results = [await _tokens(first)]
    doomed = engine.add_request(prompts[3] + prompts[3], _greedy())
    streams = [engine.add_request(p, _greedy(max_tokens=8)) for p in prompts[1:3]]
    await asyncio.sleep(0.05)
    engine.abort(doomed)
    results += await asyncio.gather(*(_tokens(s) for s in streams))
    last = engine.add_request(prompts[3], _greedy(max_tokens=8))
    results.append(await _tokens(last))
    cached = [s.request.num_cached_tokens for s in [first, *streams, last]]
    return [r[0] for r in results], cached + [last.request.cached_from]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional"])
def test_the_cache_changes_no_token_and_leaks_no_page(mode, loaded_fp32, prompts):
    body = lambda engine: _conversation(engine, prompts)  # noqa: E731
    (on, cached_on), stats, num_cached = _run(_config(mode, True), loaded_fp32, body)
    (off, cached_off), _, num_cached_off = _run(_config(mode, False), loaded_fp32, body)
    assert on == off
    assert cached_off[:4] == [0, 0, 0, 0] and num_cached_off == [0] * len(num_cached_off)
    # prompts[1] and [2] share prompts[0]'s 3 full pages; prompts[3] also has prompts[1]'s 4th where prompts[1]
    # was prefilled. In conditional mode that was the decode device (a 16-token suffix), while prompts[3]'s
    # longer suffix is prefilled on a device that holds prompts[0]'s pages only: it fetches the 4th from the
    # other device instead of computing it.
    assert cached_on[0] == 0 and cached_on[1] == cached_on[2] == 48
    assert cached_on[3] == 64
    fetched = sum(n for source, n in cached_on[4].items() if source.startswith("device:"))
    assert fetched == (16 if mode == "conditional" else 0) and cached_on[4]["device"] == 64 - fetched
    assert all(s.whole for s in stats) and any(num_cached)  # idle: cached pages all evictable


def test_a_prefix_the_decode_device_holds_is_not_transferred_again(loaded_fp32, prompts):
    transfers = []

    async def body(engine):
        await _tokens(engine.add_request(prompts[0], _greedy(max_tokens=4)))
        await _tokens(engine.add_request(prompts[1], _greedy(max_tokens=4)))
        return engine.decode_workers[0].pool.bytes_per_page_per_layer * len(engine.decode_workers[0].pool.layers)
    page_bytes, _, _ = _run(_config("disaggregated", True), loaded_fp32, body,
                            on_transfer=lambda seconds, sent, saved: transfers.append((sent, saved)))
    num_pages = [-(-len(p) // 16) for p in prompts[:2]]
    # The first prompt moves whole; the second moves only what follows the 3 full pages the decode device kept.
    assert transfers == [(num_pages[0] * page_bytes, 0), ((num_pages[1] - 3) * page_bytes, 3 * page_bytes)]


def test_eviction_under_pressure_keeps_outputs_and_pages_whole(loaded_fp32, prompts):
    """A pool too small to keep every prefix: later requests evict earlier prefixes (and are placed only when
    pages can be had), with aborts at every stage, and still produce what the cache-off engine produces."""
    async def body(engine):
        streams = [engine.add_request(prompts[i % 4] + [i % 7 + 1] * (i % 3), _greedy(max_tokens=6))
                   for i in range(12)]
        for s in streams[3::4]:
            engine.abort(s)
        done = await asyncio.gather(*(_tokens(s) for s in streams))
        return [tokens for i, (tokens, _) in enumerate(done) if i % 4 != 3]
    # 0.04 GiB of float32 KV for SmolLM2: 56 pages per device, about 8 of these requests at a time.
    on, stats, _ = _run(_config("disaggregated", True, memory_gib=0.04), loaded_fp32, body)
    off, _, _ = _run(_config("disaggregated", False, memory_gib=0.04), loaded_fp32, body)
    assert on == off and all(s.whole for s in stats)



@pytest.fixture(scope="module")
def loaded_int8(gguf_path):
    """The default quantized path with int8 prompt rows: prompt and decode rows round apart in every kernel."""
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, quantization="auto", prompt_activations="int8")


@pytest.mark.needs_cpu("avx2", "fma", "f16c")
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prompt_cached_but_its_last_token_answers_as_it_did_uncached(mode, loaded_int8, prompt_ids):
    """The same 33-token prompt twice: the second time its two full pages are cached and its last token is
    prefilled alone. That token runs as a prompt row, as it did the first time, so the logprobs match exactly;
    run as a decode row it rounded as decode rows do, and an answer could change with the cache's state (or, on a
    decode device prefilling beside its streams, with the load). The quantized path's kernels give each row the
    same bits in any batch; the exact path's float32 GEMMs (MKL) do not promise that."""
    prompt = (prompt_ids[6] * 8)[:33]

    async def body(engine):
        outs = []
        for _ in range(2):
            stream = engine.add_request(prompt, _greedy(max_tokens=4, logprobs=3))
            outs.append([(ev.token_id, ev.logprob, ev.top_logprobs) async for ev in stream if ev.token_id is not None])
            cached.append(stream.request.num_cached_tokens)
        return outs
    cached: list[int] = []
    config = config_from_dict({"model": {"quantization": "auto"}, "devices": MODES[mode],
                               "kv": {"memory_gib": 0.25, "page_size": 16, "prefix_cache": True}})
    outs, _, _ = _run(config, loaded_int8, body)
    assert cached == [0, 32] and len(outs[0]) == 4
    assert outs[0] == outs[1]
