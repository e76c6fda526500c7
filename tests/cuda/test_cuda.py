"""The CUDA path on a real GPU: FlashInfer against the PyTorch reference, byte-exact KV copies between GPUs,
CUDA-graph decode against eager decode, FP8 KV, FlashInfer's norm / activation / RoPE kernels against TorchOps,
and the disaggregated engine across two GPUs.

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

# 3600 s a test, not the suite's 900: the first use of each FlashInfer kernel JIT-compiles it (minutes when cold).
pytestmark = [pytest.mark.needs_cuda, pytest.mark.timeout(3600)]
needs_flashinfer = pytest.mark.skipif(not flashinfer_importable(), reason="needs flashinfer (pip install -e '.[cuda]')")
needs_two_gpus = pytest.mark.needs_cuda(num_gpus=2)

H, KH, D = 8, 2, 128
SCALE = D ** -0.5  # what the backends derive from head_dim
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 keeps 8 mantissa bits; both sides accumulate in fp32
# e4m3 keeps 3 mantissa bits: each K/V value is off by up to 2^-4 of itself. Averaged by the softmax that is a mean
# error near 0.004 on these N(0, 1) inputs, and up to about 0.2 where one key dominates a row (measured on CPU).
FP8_MEAN_ERR, FP8_MAX_ERR = 0.01, 0.35

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
    page_tables = torch.zeros(len(seqs), max(pages_needed), dtype=torch.int64)
    for b, t in enumerate(tables):
        page_tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), page_tables=page_tables.to(device),
        seq_lens=torch.tensor(seq_lens, device=device), query_lens=[n for _, n in seqs], seq_lens_host=seq_lens,
        num_decodes=sum(1 for _, n in seqs if n == 1), page_size=page_size, page_tables_host=tables)
    to = dict(device=device, dtype=torch.bfloat16)
    return kv_layer.to(**to), torch.cat(qs).to(**to), torch.cat(ks).to(**to), torch.cat(vs).to(**to), meta


def _backend(cls, kv: torch.Tensor, num_layers: int = 1, dtype: torch.dtype = torch.bfloat16, **kw):
    """A `cls` backend for a bf16 model over a pool on kv's device whose every layer holds `kv`."""
    from types import SimpleNamespace

    from nodeserve.kv.pool import KVPool

    cfg = SimpleNamespace(num_layers=num_layers, num_heads=H, num_kv_heads=KH, head_dim=D, max_position_embeddings=4096,
                          softmax_scale=D ** -0.5, window=lambda layer: 0)
    pool = KVPool(cfg, kv.shape[0], kv.shape[2], dtype, kv.device)
    for layer in pool.layers:
        layer.copy_(kv)
    return cls(pool, cfg, torch.bfloat16, **kw)


@needs_flashinfer
@pytest.mark.parametrize("seqs", [DECODES, PREFILLS, DECODES + PREFILLS], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_reference(seqs, page_size):
    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    device = torch.device("cuda", 0)
    kv, q, k, v, meta = _step(seqs, page_size, device, seed=page_size)
    fi, reference = _backend(FlashInferAttention, kv, num_layers=2), _backend(TorchAttention, kv)
    fi.prepare(meta)
    reference.prepare(meta)
    out, ref = fi.forward(0, q, k, v), reference.forward(0, q, k, v)
    assert torch.equal(fi.pool.layers[0], reference.pool.layers[0]), "both backends must write the same K/V"
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    # A second layer of the same step runs on the same plan, over the pool's next layer.
    torch.testing.assert_close(fi.forward(1, q, k, v).float(), ref.float(), **BF16_TOL)


@needs_flashinfer
def test_fp8_kv_within_tolerance():
    """FlashInfer over an FP8 pool's layer with its own scales (used for the write and passed to run()): within
    e4m3's error of the bf16 reference, and within bf16's of the torch backend reading the same bytes."""
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.attention.torch_ref import write_kv_scaled

    device = torch.device("cuda", 0)
    kv, q, k, v, meta = _step(DECODES + PREFILLS, 16, device, seed=7)
    bf16 = _backend(TorchAttention, kv)
    bf16.prepare(meta)
    ref = bf16.forward(0, q, k, v)
    fp8 = torch.float8_e4m3fn
    flashinfer, reference = _backend(FlashInferAttention, kv, 2, fp8), _backend(TorchAttention, kv, 2, fp8)
    pools = [flashinfer.pool, reference.pool]
    for pool in pools:
        pool.k_scales, pool.v_scales = [1.0, 0.03], [1.0, 0.02]  # layer 1 holds |x| up to 13.4 and 9.0
        # The cached prefix, quantized the way the backends quantize new tokens.
        all_slots = torch.arange(kv.shape[0] * kv.shape[2], device=device)
        flat = kv.transpose(1, 2).reshape(-1, 2, KH, D)  # [slots, 2, KH, D]
        write_kv_scaled(pool.layers[1], flat[:, 0], flat[:, 1], all_slots, pool.k_scales[1], pool.v_scales[1])
    flashinfer.prepare(meta)
    out = flashinfer.forward(1, q, k, v)
    err = (out.float() - ref.float()).abs()
    assert err.mean() < FP8_MEAN_ERR and err.max() < FP8_MAX_ERR, (err.mean().item(), err.max().item())
    reference.prepare(meta)
    same_bytes = reference.forward(1, q, k, v)
    assert torch.equal(pools[0].data.view(torch.uint8), pools[1].data.view(torch.uint8))
    torch.testing.assert_close(out.float(), same_bytes.float(), **BF16_TOL)


def _pools(devices):
    from types import SimpleNamespace

    from nodeserve.kv.pool import KVPool

    cfg = SimpleNamespace(num_layers=3, num_kv_heads=KH, head_dim=D)
    return [KVPool(cfg, 64, 16, torch.bfloat16, torch.device(d)) for d in devices]


def _transfer_bytes_exact(src_name: str, dst_name: str, max_direct_runs: int):
    from nodeserve.device import make_device
    from nodeserve.runtime.transfer import KVTransfer
    src_dev, dst_dev = make_device(src_name), make_device(dst_name)
    src_pool, dst_pool = _pools([src_name, dst_name])
    for layer in src_pool.layers:
        layer.copy_(torch.randn(layer.shape, device=layer.device))
    # The fill ran on the default stream; the copies below run on the worker's and the transfer's own streams,
    # which do not wait on it: without this the copy may read the pool before the fill lands.
    torch.cuda.synchronize(src_pool.device)
    src_pages, dst_pages = [3, 4, 5, 9, 20, 21], [10, 11, 12, 13, 40, 2]  # runs of 3, 1, 1+1 pages
    freed = []
    transfer = KVTransfer(src_dev, src_pool, dst_dev, dst_pool, lambda pages, ev: freed.append(ev))
    transfer.max_direct_runs = max_direct_runs  # 0: gather, one copy, scatter; else one copy per run
    transfer.start()
    src_dev.init_worker_thread()
    pages = transfer.page_indices(src_pages, dst_pages)
    assert (pages.runs is None) == (max_direct_runs == 0)
    for layer in range(len(src_pool.layers)):
        transfer.copy_layer(layer, pages)
    delivered, failed = [], []
    transfer.finish("r", src_pool.manager.allocate(6), lambda ev, error: (delivered.append(ev), failed.append(error)))
    transfer.stop()
    assert failed == [None] and len(delivered) == 1 and len(freed) == 1
    delivered[0].synchronize()
    for layer in range(len(src_pool.layers)):
        got = dst_pool.layers[layer][dst_pages].cpu().view(torch.uint8)
        want = src_pool.layers[layer][src_pages].cpu().view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer}"


@needs_two_gpus
@pytest.mark.parametrize("max_direct_runs", [0, 8])
def test_p2p_copies_byte_exact(max_direct_runs):
    # Only pairs of two devices: the engine never builds a transfer from a device to itself (a device is in
    # one role list once), so a cuda:0 -> cuda:0 copy would test a path no request takes.
    _transfer_bytes_exact("cuda:0", "cuda:1", max_direct_runs)
    _transfer_bytes_exact("cuda:1", "cuda:0", max_direct_runs)


@pytest.fixture(scope="module")
def loaded_bf16(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.bfloat16)


def _greedy_decode(runner, prompts: list[list[int]], num_steps: int) -> list[list[int]]:
    from nodeserve.runtime.model_runner import SeqChunk
    from nodeserve.kv.pool import pages_for

    tables = [runner.pool.manager.allocate(pages_for(len(p) + num_steps, runner.pool.page_size)) for p in prompts]
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
            runner.pool.manager.free(t)


@needs_flashinfer
@pytest.mark.parametrize("batch", [1, 3, 4])  # 3 replays the graph of 4 with one padding row
def test_graph_decode_equals_eager(loaded_bf16, prompt_ids, batch):
    runners = _eager_and_graphed_runners(loaded_bf16, torch.bfloat16)
    assert sorted(runners[1].graphs.graphs) == [1, 2, 4, 8]
    prompts = prompt_ids[:batch]
    eager, graphed = (_greedy_decode(r, prompts, 16) for r in runners)
    assert graphed == eager


def _eager_and_graphed_runners(loaded, kv_dtype, calibration_ids=None):
    """Two runners over one bf16 replica on cuda:0, each with its own pool, warmed up; the second captures
    decode graphs for batches up to 8. FP8 pools are calibrated first (on calibration_ids), as Engine.warmup does."""
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.runtime.cuda_graphs import DecodeGraphs
    from nodeserve.runtime.kv_calibration import calibrate_kv_scales
    from nodeserve.runtime.model_runner import ModelRunner
    from nodeserve.runtime.warmup import warmup_runner
    from nodeserve.kv.pool import KVPool

    device = torch.device("cuda", 0)
    model = _replica(loaded.model, device)
    runners = []
    for use_graphs in (False, True):
        backend = FlashInferAttention(KVPool(loaded.config, 256, 16, kv_dtype, device), model.cfg, model.dtype)
        graphs = DecodeGraphs(model, backend, max_batch=8) if use_graphs else None
        runner = ModelRunner(model, backend, graphs)
        if calibration_ids is not None:
            calibrate_kv_scales(model, runner.pool, calibration_ids)
        warmup_runner(runner)
        runners.append(runner)
    return runners


def _replica(model, device):
    import copy

    return copy.deepcopy(model).to(device)


# FP8 KV against bf16 KV on the real model, with the texts and tolerance tests/kv/test_fp8_kv.py applies against
# float32 KV on CPU (conftest.FP8Check; measured there: 96.7 % top-1 agreement and a max logit difference of 3.30
# with calibrated scales; 0.8 % and 43.7 with scale 1e-4).
def _teacher_forced_logits(check, model, loaded, kv_dtype, device, scales=None) -> torch.Tensor:
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.runtime.model_runner import ModelRunner
    from nodeserve.kv.pool import KVPool

    pool = KVPool(loaded.config, 64, 16, kv_dtype, device)
    if scales is not None:
        pool.k_scales, pool.v_scales = list(scales[0]), list(scales[1])
    runner = ModelRunner(model, FlashInferAttention(pool, model.cfg, model.dtype))
    return check.teacher_forced_logits(runner, loaded.tokenizer)


@needs_flashinfer
def test_fp8_kv_with_calibrated_scales_within_tolerance_of_bf16(fp8_check, loaded_bf16):
    from nodeserve.runtime.kv_calibration import calibrate_kv_scales, calibration_token_ids
    from nodeserve.kv.pool import KVPool

    device = torch.device("cuda", 0)
    model = _replica(loaded_bf16.model, device)
    ref = _teacher_forced_logits(fp8_check, model, loaded_bf16, torch.bfloat16, device)
    calibrated = KVPool(loaded_bf16.config, 4, 16, torch.float8_e4m3fn, device)
    calibrate_kv_scales(model, calibrated, calibration_token_ids(loaded_bf16.tokenizer))
    assert all(s > 0 and s != 1.0 for s in calibrated.k_scales + calibrated.v_scales)
    n = loaded_bf16.config.num_layers
    # The same check passes with the calibrated scales and fails with a deliberately bad one.
    for scales, passes in (((calibrated.k_scales, calibrated.v_scales), True), (([1e-4] * n, [1e-4] * n), False)):
        got = _teacher_forced_logits(fp8_check, model, loaded_bf16, torch.float8_e4m3fn, device, scales)
        ok, agreement, max_diff = fp8_check.within_tolerance(got, ref)
        assert ok == passes, f"K scales {scales[0][:3]}...: top-1 agreement {agreement:.1%}, max diff {max_diff:.2f}"


@needs_flashinfer
def test_fp8_graphs_capture_the_calibrated_scales(loaded_bf16, prompt_ids):
    """Warm-up calibrates an FP8 pool before the capture, so the graphs hold the calibrated scales, and replaying
    them decodes the tokens eager FlashInfer decodes on a pool with the same scales."""
    from nodeserve.runtime.kv_calibration import calibration_token_ids

    eager, graphed = _eager_and_graphed_runners(loaded_bf16, torch.float8_e4m3fn,
                                                calibration_token_ids(loaded_bf16.tokenizer))
    assert all(s != 1.0 for s in graphed.pool.k_scales + graphed.pool.v_scales)
    assert graphed.graphs.captured_scales == (graphed.pool.k_scales, graphed.pool.v_scales)
    eager.pool.k_scales, eager.pool.v_scales = list(graphed.pool.k_scales), list(graphed.pool.v_scales)
    prompts = prompt_ids[:3]  # 3 replays the graph of 4 with one padding row
    assert _greedy_decode(graphed, prompts, 16) == _greedy_decode(eager, prompts, 16)


@needs_two_gpus
def test_disaggregated_engine_across_gpus_equals_one_gpu(loaded_bf16, prompt_ids):
    from nodeserve.config import config_from_dict
    from nodeserve.runtime.engine import Engine
    from nodeserve.core.sampling_params import SamplingParams

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


@needs_flashinfer
def test_colocated_engine_on_one_gpu_equals_the_eager_runner(loaded_bf16, prompt_ids):
    """A single-GPU host's end-to-end check: worker threads, compute streams, FlashInfer plans and decode-graph
    replay through the engine. Each prompt alone (batch 1, whole-prompt prefill) must give the eager runner's
    greedy tokens exactly; then all at once must finish with every page back."""
    from nodeserve.config import config_from_dict
    from nodeserve.runtime.engine import Engine, build_runner
    from nodeserve.kv.pool import KVPool
    from nodeserve.core.sampling_params import SamplingParams

    device, num_tokens = torch.device("cuda", 0), 24
    cfg = config_from_dict({"model": {"dtype": "bfloat16"}, "devices": {"mode": "colocated", "devices": ["cuda:0"]},
                            "kv": {"memory_gib": 1.0}})
    replica = _replica(loaded_bf16.model, device)
    eager = build_runner(replica, KVPool(loaded_bf16.config, 512, 16, torch.bfloat16, device), "auto", False, 8)
    expected = [_greedy_decode(eager, [ids], num_tokens)[0] for ids in prompt_ids]

    async def main():
        engine = Engine(cfg, loaded_bf16)
        engine.start(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, engine.warmup)
        assert engine.workers[0].runner.graphs is not None, "the engine should replay decode graphs here"
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        try:
            alone = []
            for ids in prompt_ids:
                alone.append([ev.token_id async for ev in engine.add_request(ids, params) if ev.token_id is not None])
            streams = [engine.add_request(ids, params) for ids in prompt_ids]
            together = [[ev.token_id async for ev in s if ev.token_id is not None] for s in streams]
            for _ in range(100):
                if all(p.num_free == p.num_pages for p in engine.pool_stats()):
                    break
                await asyncio.sleep(0.05)
            return alone, together, engine.pool_stats()
        finally:
            engine.stop()
    alone, together, pools = asyncio.run(main())
    assert alone == expected
    assert [len(t) for t in together] == [num_tokens] * len(prompt_ids)
    assert all(p.num_free == p.num_pages for p in pools), pools


@needs_flashinfer
def test_flashinfer_ops_match_torch_ops_in_bf16():
    from nodeserve.model.flashinfer_ops import FlashInferOps
    from nodeserve.model.ops import TorchOps
    from nodeserve.model.rope import RotaryEmbedding

    device, bf16 = torch.device("cuda", 0), torch.bfloat16
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(D, 500000.0, llama3)
    fi, ref = FlashInferOps(rope, 32768, device), TorchOps(rope)
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(bf16)

    x, residual, weight = randn(37, 576), randn(37, 576), 1 + 0.1 * randn(576)
    torch.testing.assert_close(fi.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), **BF16_TOL)
    want = ref.add_rms_norm(x, residual, weight, 1e-5)
    for got, w in zip(fi.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5), want):
        torch.testing.assert_close(got, w, **BF16_TOL)
    gate_up = randn(37, 2 * 1536)
    torch.testing.assert_close(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **BF16_TOL)
    # q and k as the model has them: strided views into the fused qkv output, rotated in place.
    positions = torch.tensor([0, 1, 2, 15, 99, 700, 8191, 8192, 32767], device=device)
    t = len(positions)
    q, k, _ = randn(t, (H + 2 * KH) * D).split([H * D, KH * D, KH * D], dim=-1)
    q, k = q.view(t, H, D), k.view(t, KH, D)
    want_q, want_k = ref.rotary(positions, bf16).apply(q, k)
    got_q, got_k = fi.rotary(positions, bf16).apply(q, k)
    torch.testing.assert_close(got_q.float(), want_q.float(), **BF16_TOL)
    torch.testing.assert_close(got_k.float(), want_k.float(), **BF16_TOL)


@needs_flashinfer
def test_graph_decode_with_flashinfer_ops_equals_eager(loaded_bf16, prompt_ids):
    """FlashInfer's norm / activation / rope kernels inside the decode graphs, as make_worker sets them up."""
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.runtime.cuda_graphs import DecodeGraphs
    from nodeserve.runtime.model_runner import ModelRunner
    from nodeserve.runtime.warmup import warmup_runner
    from nodeserve.kv.pool import KVPool
    from nodeserve.model.flashinfer_ops import FlashInferOps

    device = torch.device("cuda", 0)
    model = _replica(loaded_bf16.model, device)
    model.use_kernels(lambda rope: FlashInferOps(rope, model.cfg.max_position_embeddings, device))
    runners = []
    for use_graphs in (False, True):
        backend = FlashInferAttention(KVPool(loaded_bf16.config, 256, 16, torch.bfloat16, device), model.cfg,
                                      model.dtype)
        graphs = DecodeGraphs(model, backend, max_batch=4) if use_graphs else None
        runner = ModelRunner(model, backend, graphs)
        warmup_runner(runner)
        runners.append(runner)
    prompts = prompt_ids[:3]  # the graph of 4 with one padding row
    eager, graphed = (_greedy_decode(r, prompts, 16) for r in runners)
    assert graphed == eager


def test_upload_does_not_wait_for_queued_gpu_work():
    """device.upload returns while a long kernel is still running (a plain copy from pageable memory would wait
    for it), and the values arrive intact and in order behind that kernel."""
    import time

    from nodeserve.device import upload

    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        a = a @ a / 64  # ~3 TFLOP in total: well over 1 ms on any GPU
    queued = time.perf_counter()
    t = upload(list(range(1000)), device, torch.int64)
    returned = time.perf_counter()
    busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    done = time.perf_counter()
    assert busy, "the matmuls finished before upload returned: the test cannot tell blocking from not"
    assert returned - queued < (done - start) / 2, (returned - queued, done - start)
    assert t.tolist() == list(range(1000)) and t.device == device


@needs_flashinfer
def test_graph_plan_does_not_wait_for_queued_gpu_work():
    """A CUDA-graph decode backend's plan() (every decode step) returns while a long kernel is still running: its
    kv_indices reach the GPU through pinned memory (a host kv_indices is copied with non_blocking=False by FlashInfer
    0.7.2 in graph mode, a wait for all queued work)."""
    import time

    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    device = torch.device("cuda", 0)
    kv, _, _, _, meta = _step(DECODES, 16, device, seed=3)
    backend = _backend(FlashInferAttention, kv, graph_batch_size=len(DECODES))
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        a = a @ a / 64
    queued = time.perf_counter()
    backend.prepare(meta)  # the first plan: no previous one to wait on
    returned = time.perf_counter()
    busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    done = time.perf_counter()
    assert busy, "the matmuls finished before plan returned: the test cannot tell blocking from not"
    assert returned - queued < (done - start) / 2, (returned - queued, done - start)


@needs_flashinfer
def test_a_graph_decode_batch_may_list_the_same_pages_many_times():
    """Requests sharing a cached prefix list the same pages: 4 rows x 10 pages on a 12-page pool are 40 indices,
    more than the pool's pages + the bucket (the buffer size before), which made plan() raise in every such step
    (then each request ran alone, silently)."""
    from nodeserve.attention.base import AttentionMetadata
    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    device = torch.device("cuda", 0)
    kv = torch.randn(12, 2, 16, KH, D, device=device, dtype=torch.bfloat16)
    backend = _backend(FlashInferAttention, kv, graph_batch_size=4)
    tables = [list(range(10))] * 4
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([9 * 16 + 5] * 4, device=device),
        page_tables=torch.tensor(tables, device=device), seq_lens=torch.tensor([150] * 4, device=device),
        query_lens=[1] * 4, seq_lens_host=[150] * 4, num_decodes=4, page_size=16, page_tables_host=tables)
    backend.prepare(meta)  # raised before


@needs_flashinfer
@needs_two_gpus
def test_decode_graphs_on_a_second_gpu_equal_eager(loaded_bf16, prompt_ids):
    """Graphs captured on cuda:0 and then on cuda:1 (each on its own capture stream) replay correctly on both."""
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.runtime.cuda_graphs import DecodeGraphs
    from nodeserve.runtime.model_runner import ModelRunner
    from nodeserve.runtime.warmup import warmup_runner
    from nodeserve.kv.pool import KVPool

    prompts = prompt_ids[:3]  # the graph of 4 with one padding row
    for index in (0, 1):
        device = torch.device("cuda", index)
        model = _replica(loaded_bf16.model, device)
        runners = []
        for use_graphs in (False, True):
            backend = FlashInferAttention(KVPool(loaded_bf16.config, 256, 16, torch.bfloat16, device), model.cfg,
                                          model.dtype)
            graphs = DecodeGraphs(model, backend, max_batch=4) if use_graphs else None
            runner = ModelRunner(model, backend, graphs)
            warmup_runner(runner)
            runners.append(runner)
        assert runners[1].graphs.capture_stream.device == device
        eager, graphed = (_greedy_decode(r, prompts, 16) for r in runners)
        assert graphed == eager, f"cuda:{index}"
