"""The CUDA path on a real GPU: FlashInfer against the PyTorch reference, byte-exact KV copies between GPUs,
CUDA-graph decode against eager decode, FP8 KV, and the disaggregated engine across two GPUs.

Skipped without a GPU (and the two-GPU tests without two). Run them with scripts/gpu_check.sh.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from nodeserve.attention import flashinfer_importable
from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.torch_ref import TorchAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(not flashinfer_importable(), reason="needs flashinfer (pip install -e '.[cuda]')")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

H, KH, D = 8, 2, 128
SCALE = D ** -0.5
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 keeps 8 mantissa bits; both sides accumulate in fp32
FP8_TOL = dict(atol=1e-1, rtol=1e-1)   # e4m3 keeps 3: K/V each off by up to 6 %, averaged by the softmax

# (cached tokens, new tokens): decodes, whole prompts, and chunks extending a cached prefix.
DECODES = [(0, 1), (15, 1), (16, 1), (99, 1), (700, 1)]
PREFILLS = [(0, 7), (0, 64), (20, 13), (63, 2), (100, 37), (512, 300)]


def _step(seqs, page_size: int, device: torch.device, seed: int):
    """A pool with each sequence's cached prefix on shuffled pages, plus one step's q/k/v and metadata."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decodes first
    pages_needed = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = sum(pages_needed) + 4
    kv_layer = torch.randn(num_pages, 2, page_size, KH, D, generator=gen)
    ids = list(range(num_pages))
    rng.shuffle(ids)
    tables, qs, ks, vs, slots = [], [], [], [], []
    for (cached, new), n in zip(seqs, pages_needed):
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        seq_slots = [table[p // page_size] * page_size + p % page_size for p in range(cached + new)]
        slots += seq_slots[cached:]
        qs.append(torch.randn(new, H, D, generator=gen))
        ks.append(torch.randn(new, KH, D, generator=gen))
        vs.append(torch.randn(new, KH, D, generator=gen))
    block_tables = torch.zeros(len(seqs), max(pages_needed), dtype=torch.int64)
    for b, t in enumerate(tables):
        block_tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, device=device), query_lens=[n for _, n in seqs], seq_lens_host=seq_lens,
        num_decodes=sum(1 for _, n in seqs if n == 1), page_size=page_size, block_tables_host=tables)
    to = dict(device=device, dtype=torch.bfloat16)
    return kv_layer.to(**to), torch.cat(qs).to(**to), torch.cat(ks).to(**to), torch.cat(vs).to(**to), meta


@needs_flashinfer
@pytest.mark.parametrize("seqs", [DECODES, PREFILLS, DECODES + PREFILLS], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_reference(seqs, page_size):
    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    device = torch.device("cuda", 0)
    kv, q, k, v, meta = _step(seqs, page_size, device, seed=page_size)
    kv_ref = kv.clone()
    fi = FlashInferAttention(device)
    out = fi.forward(q, k, v, kv, meta, SCALE)
    ref = TorchAttention().forward(q, k, v, kv_ref, meta, SCALE)
    assert torch.equal(kv, kv_ref), "both backends must write the same K/V to the same slots"
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    # A second layer of the same step reuses the plan (no re-plan), on another layer's pool.
    kv2 = kv.clone()
    torch.testing.assert_close(fi.forward(q, k, v, kv2, meta, SCALE).float(), ref.float(), **BF16_TOL)


@needs_flashinfer
def test_fp8_kv_within_tolerance():
    from nodeserve.attention.flashinfer_backend import FlashInferAttention, write_kv_scaled

    device = torch.device("cuda", 0)
    kv, q, k, v, meta = _step(DECODES + PREFILLS, 16, device, seed=7)
    ref = TorchAttention().forward(q, k, v, kv.clone(), meta, SCALE)
    kv8 = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device=device)
    # The cached prefix, quantized the way the backend quantizes new tokens (scale 1.0).
    all_slots = torch.arange(kv.shape[0] * kv.shape[2], device=device)
    flat = kv.transpose(1, 2).reshape(-1, 2, KH, D)  # [slots, 2, KH, D]
    write_kv_scaled(kv8, flat[:, 0], flat[:, 1], all_slots)
    out = FlashInferAttention(device).forward(q, k, v, kv8, meta, SCALE)
    torch.testing.assert_close(out.float(), ref.float(), **FP8_TOL)


def _pools(devices):
    from types import SimpleNamespace

    from nodeserve.kv.pool import KVPool

    cfg = SimpleNamespace(num_layers=3, num_kv_heads=KH, head_dim=D)
    return [KVPool(cfg, 64, 16, torch.bfloat16, torch.device(d)) for d in devices]


def _transfer_bytes_exact(src_name: str, dst_name: str):
    from nodeserve.device import make_device
    from nodeserve.engine.transfer import KVTransfer
    from nodeserve.request import Request
    from nodeserve.sampling_params import SamplingParams

    src_dev, dst_dev = make_device(src_name), make_device(dst_name)
    src_pool, dst_pool = _pools([src_name, dst_name])
    for layer in src_pool.layers:
        layer.copy_(torch.randn(layer.shape, device=layer.device))
    src_pages, dst_pages = [3, 4, 5, 9, 20, 21], [10, 11, 12, 13, 40, 2]  # runs of 3, 1, 1+1 pages
    transfer = KVTransfer(src_dev, src_pool, dst_dev, dst_pool)
    transfer.start()
    src_dev.init_worker_thread()
    pages = transfer.page_indices(src_pages, dst_pages)
    for layer in range(len(src_pool.layers)):
        transfer.copy_layer(layer, pages)
    req = Request("r", list(range(96)), SamplingParams(max_tokens=2))
    req.prefill_pages = src_pool.allocator.allocate(6)
    delivered = []
    transfer.finish(req, lambda r, ev: delivered.append(ev), lambda r: None)
    transfer.stop()
    assert len(delivered) == 1
    delivered[0].synchronize()
    for layer in range(len(src_pool.layers)):
        got = dst_pool.layers[layer][dst_pages].cpu().view(torch.uint8)
        want = src_pool.layers[layer][src_pages].cpu().view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer}"


def test_copies_byte_exact_on_one_gpu():
    _transfer_bytes_exact("cuda:0", "cuda:0")


@needs_two_gpus
def test_p2p_copies_byte_exact():
    _transfer_bytes_exact("cuda:0", "cuda:1")
    _transfer_bytes_exact("cuda:1", "cuda:0")


@pytest.fixture(scope="module")
def loaded_bf16(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.bfloat16)


def _greedy_decode(runner, prompts: list[list[int]], num_steps: int) -> list[list[int]]:
    from nodeserve.engine.model_runner import SeqChunk
    from nodeserve.kv.pool import pages_for

    tables = [runner.pool.allocator.allocate(pages_for(len(p) + num_steps, runner.pool.page_size)) for p in prompts]
    try:
        logits = runner.run([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
        out = [[int(x)] for x in logits.argmax(-1).tolist()]
        for step in range(num_steps - 1):
            chunks = [SeqChunk([o[-1]], len(p) + step, t) for p, o, t in zip(prompts, out, tables)]
            for o, x in zip(out, runner.run(chunks).argmax(-1).tolist()):
                o.append(int(x))
        return out
    finally:
        for t in tables:
            runner.pool.allocator.free(t)


@needs_flashinfer
@pytest.mark.parametrize("batch", [1, 3, 4])  # 3 replays the graph of 4 with one padding row
def test_graph_decode_equals_eager(loaded_bf16, prompt_ids, batch):
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.engine.cuda_graphs import DecodeGraphs
    from nodeserve.engine.model_runner import ModelRunner
    from nodeserve.engine.warmup import warmup_runner
    from nodeserve.kv.pool import KVPool

    device = torch.device("cuda", 0)
    model = _replica(loaded_bf16.model, device)
    runners = []
    for use_graphs in (False, True):
        pool = KVPool(loaded_bf16.config, 256, 16, torch.bfloat16, device)
        graphs = DecodeGraphs(model, pool, max_batch=8) if use_graphs else None
        runner = ModelRunner(model, pool, FlashInferAttention(device), graphs)
        warmup_runner(runner)
        runners.append(runner)
    assert sorted(runners[1].graphs.graphs) == [1, 2, 4, 8]
    prompts = prompt_ids[:batch]
    eager, graphed = (_greedy_decode(r, prompts, 16) for r in runners)
    assert graphed == eager


def _replica(model, device):
    import copy

    return copy.deepcopy(model).to(device)


@needs_two_gpus
def test_disaggregated_engine_across_gpus_equals_one_gpu(loaded_bf16, prompt_ids):
    from nodeserve.config import config_from_dict
    from nodeserve.engine.engine import Engine
    from nodeserve.sampling_params import SamplingParams

    def run(devices):
        cfg = config_from_dict({"model": {"dtype": "bfloat16"}, "devices": devices,
                                "kv": {"memory_gib": 1.0}, "scheduler": {"max_num_batched_tokens": 64}})

        async def main():
            engine = Engine(cfg, loaded_bf16)
            engine.start(asyncio.get_running_loop())
            await asyncio.get_running_loop().run_in_executor(None, engine.warmup)
            try:
                streams = [engine.add_request(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                           for ids in prompt_ids]
                out = []
                for s in streams:
                    out.append([ev.token_id async for ev in s if ev.token_id is not None])
                for _ in range(100):
                    if all(p.num_free == p.num_pages for p in engine.pool_stats()):
                        break
                    await asyncio.sleep(0.05)
                assert all(p.num_free == p.num_pages for p in engine.pool_stats()), engine.pool_stats()
                return out
            finally:
                engine.stop()
        return asyncio.run(main())

    colocated = run({"mode": "colocated", "devices": ["cuda:0"]})
    disaggregated = run({"mode": "disaggregated", "prefill": ["cuda:0"], "decode": ["cuda:1"]})
    assert disaggregated == colocated
