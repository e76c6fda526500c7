"""The KV tiers on a real GPU: pinned host slots, byte-exact copies both ways, the loader's per-layer events on its
own stream, and the engine's greedy tokens with pages coming back from the host tier and from another GPU.

Skipped without a GPU (the cross-GPU test without two). What to check first: docs/kv-tiers.md, "On a GPU".
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.needs_cuda, pytest.mark.timeout(3600)]
needs_two_gpus = pytest.mark.needs_cuda(num_gpus=2)


def _pool(loaded, num_pages: int, device: str):
    from nodeserve.kv.pool import KVPool

    pool = KVPool(loaded.config, num_pages, 16, torch.bfloat16, torch.device(device), prefix_cache=True)
    pool.data.copy_(torch.randn(pool.data.shape, dtype=torch.bfloat16, device=pool.device))
    return pool


def test_host_slots_are_pinned_and_copies_are_byte_exact_both_ways(gguf_path):
    from nodeserve.kv.host import HostTier
    from nodeserve.kv.manager import hash_pages
    from nodeserve.model.loader import load_model

    loaded = load_model(gguf_path, torch.bfloat16)
    pool = _pool(loaded, 32, "cuda:0")
    host = HostTier.like(16, pool, pin=True)
    assert host.data.is_pinned()
    hashes = hash_pages(list(range(8 * 16)), 16)
    pages = pool.manager.allocate(8)
    pool.manager.publish(pages, hashes)
    before = pool.data[:, pages].clone()
    assert host.store(pool, pages, hashes) == 8
    assert torch.equal(host.data[host.hold(hashes)].transpose(0, 1).cuda(), before)
    dst = pool.manager.allocate(8)
    slots = torch.tensor(host.hold(hashes))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the pool was written on the default stream
    with torch.cuda.stream(stream):  # as the loader does: its own stream, an event per layer
        events = []
        for layer in range(host.num_layers):
            host.copy_layer(layer, slots, pool, torch.tensor(dst, device="cuda:0"))
            events.append(torch.cuda.Event())
            events[-1].record(stream)
    torch.cuda.current_stream().wait_event(events[-1])
    assert torch.equal(pool.data[:, dst], before)


def _engine_tokens(loaded, devices: dict, host_gib: float, memory_gib: float, prompts, max_tokens: int = 16):
    from nodeserve.config import config_from_dict
    from nodeserve.core.sampling_params import SamplingParams
    from nodeserve.runtime.engine import Engine

    cfg = config_from_dict({"model": {"dtype": "bfloat16"}, "devices": devices,
                            "kv": {"memory_gib": memory_gib, "host_memory_gib": host_gib},
                            "profile": {"startup": False}})

    async def main():
        engine = Engine(cfg, loaded)
        engine.start(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, engine.warmup)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        try:
            out, cached = [], []
            for ids in prompts:
                stream = engine.add_request(ids, params)
                out.append([ev.token_id async for ev in stream if ev.token_id is not None])
                cached.append(dict(stream.request.cached_from))
            for _ in range(100):
                if all(p.num_free == p.num_pages for p in engine.pool_stats()):
                    break
                await asyncio.sleep(0.05)
            host = engine.tiers.host
            return out, cached, engine.pool_stats(), host.index.num_used if host is not None else 0
        finally:
            engine.stop()
    return asyncio.run(main())


def _evicting_prompts(prompt_ids):
    long = [(p * 40)[:400] for p in prompt_ids[:3]]
    return long + [long[0] + prompt_ids[4]]


def test_pages_evicted_on_a_gpu_come_back_from_pinned_host_memory_with_the_same_tokens(gguf_path, prompt_ids):
    from nodeserve.model.loader import load_model

    loaded = load_model(gguf_path, torch.bfloat16)
    prompts = _evicting_prompts(prompt_ids)
    devices = {"mode": "colocated", "devices": ["cuda:0"]}
    pool_gib = 30 * 368_640 / 2**30  # 30 bf16 pages: each 400-token prompt evicts the one before
    off, cached_off, _, _ = _engine_tokens(loaded, devices, 0, pool_gib, prompts)
    on, cached_on, pools, host_used = _engine_tokens(loaded, devices, 0.05, pool_gib, prompts)
    assert on == off
    assert "host" not in cached_off[-1] and cached_on[-1].get("host", 0) >= 320, cached_on
    assert all(p.num_free == p.num_pages for p in pools) and host_used == 0


@needs_two_gpus
def test_a_prefix_on_one_gpu_is_fetched_by_the_other_with_the_same_tokens(gguf_path, prompt_ids):
    from nodeserve.model.loader import load_model

    loaded = load_model(gguf_path, torch.bfloat16)
    base = (prompt_ids[0] * 40)[:400]
    prompts = [base + prompt_ids[1], base + prompt_ids[2]]
    devices = {"mode": "disaggregated", "prefill": ["cuda:0"], "decode": ["cuda:1"],
               "local_prefill_threshold": 64}
    one_gpu, _, _, _ = _engine_tokens(loaded, {"mode": "colocated", "devices": ["cuda:0"]}, 0, 1.0, prompts)
    two, cached, pools, _ = _engine_tokens(loaded, devices, 0, 1.0, prompts)
    assert two == one_gpu
    assert all(p.num_free == p.num_pages for p in pools)
    assert sum(cached[1].values()) >= 384, cached  # base's 25 pages: on the device, or fetched from the other GPU
