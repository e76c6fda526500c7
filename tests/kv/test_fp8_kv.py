"""FP8 (e4m3) KV on CPU: the quantize/dequantize round trip, the reference backend's FP8 reads, per-layer scale
calibration on the real model, FP8-vs-float32 logits within a stated tolerance (and a bad scale outside it), and
an engine serving from FP8 pools."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.torch_ref import FP8_E4M3_MAX, TorchAttention, fp8_to, gather_kv, write_kv_scaled
from nodeserve.config import config_from_dict
from nodeserve.runtime.kv_calibration import (SCALE_MARGIN, calibrate_kv_scales, calibration_token_ids,
                                             measure_kv_amax, scales_from_amax)
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.kv.pool import KVPool, pages_for

FP8 = torch.float8_e4m3fn
KH, D, H = 2, 16, 6

# FP8 KV vs float32 KV, teacher-forced over FP8Check.TEXTS' positions (243 on SmolLM2-135M), measured:
#   calibrated scales: 96.7 % top-1 agreement, max |logit diff| 3.30 (logits span -35..38; mean diff 0.31);
#   uniform scale 1e-4 (everything clamps): 0.8 % / 43.7; 1e3 (everything underflows): 9.1 % / 43.0;
#   K/V 64x larger (same float32 logits) at scale 1.0: 80.7 % / 19.1; calibrated: 96.7 % / 3.30 again.
# (SmolLM2's own |K| <= 20 and |V| <= 16 sit well inside e4m3 at scale 1.0, which passes too: 95.9 % / 3.36.)
# The bounds leave room for other CPUs' rounding; wrong scales miss them by a wide margin.
# The bounds and texts are FP8Check's, in tests/conftest.py.


# ---- the quantizing write and the reference backend's reads ---------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.05, 7.0])
def test_round_trip_error_bound(scale):
    """stored * scale is within e4m3's rounding of x: 2^-4 relative in the normal range (3 mantissa bits, round to
    nearest), half the smallest subnormal step (scale * 2^-10) below it, and clamped to 448 * scale above."""
    layer = torch.zeros(8, 2, 4, KH, D, dtype=FP8)
    slots = torch.arange(32)
    gen = torch.Generator().manual_seed(0)
    # Magnitudes from deep in the subnormals to past the top of the range.
    x = torch.exp2(torch.empty(32, KH, D).uniform_(-14, 10, generator=gen)) * scale
    x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    write_kv_scaled(layer, x, -x, slots, k_scale=scale, v_scale=scale)
    k, v = gather_kv(layer, torch.arange(8)[None], 32, torch.float32)
    k, v = k[0] * scale, v[0] * scale
    assert torch.equal(v, -k)
    top = FP8_E4M3_MAX * scale
    bound = torch.maximum(x.abs() * 2 ** -4, torch.full_like(x, scale * 2 ** -10))
    inside = x.abs() <= top
    assert ((k - x).abs() <= bound)[inside].all()
    assert (~inside).any()
    torch.testing.assert_close(k[~inside], x[~inside].sign() * top, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_table_conversion_equals_torchs(dtype):
    every = torch.arange(256, dtype=torch.uint8).view(FP8).reshape(4, 64)  # every byte, NaNs included
    got, want = fp8_to(every, dtype), every.to(dtype)
    nan = want.isnan()
    assert got.dtype == dtype and torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


def _dequantized(layer: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    deq = layer.float()
    deq[:, 0] *= k_scale
    deq[:, 1] *= v_scale
    return deq


def _float32_attention(meta: AttentionMetadata, layer: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TorchAttention over a float32 pool holding `layer`, the step writing what `layer` already holds at its slots."""
    cfg = SimpleNamespace(num_layers=1, num_heads=H, num_kv_heads=KH, head_dim=D, softmax_scale=D ** -0.5,
                          window=lambda layer: 0)
    pool = KVPool(cfg, layer.shape[0], meta.page_size, torch.float32, torch.device("cpu"))
    pool.layers[0].copy_(layer)
    pages, offsets = meta.slot_mapping // meta.page_size, meta.slot_mapping % meta.page_size
    backend = TorchAttention(pool, cfg, torch.float32)
    backend.prepare(meta)
    return backend.forward(0, q, layer[pages, 0, offsets], layer[pages, 1, offsets])


def test_torch_backend_reads_fp8_by_layer_index(one_thread, step_meta):
    """An FP8 pool through TorchAttention (scales folded into the softmax scale and the output) equals attention
    over a float32 pool holding the dequantized values, for decodes, whole prompts and prefix extensions. Each layer
    is read and written with the scales at its index: layers 0 and 1 hold the same cached bytes under different
    scales, and each gives the attention of its own dequantized values."""
    page_size, seqs = 4, [(0, 1), (9, 1), (30, 1), (0, 7), (5, 6)]  # decodes first
    cfg = SimpleNamespace(num_layers=2, num_heads=H, num_kv_heads=KH, head_dim=D, softmax_scale=D ** -0.5,
                          window=lambda layer: 0)
    pool = KVPool(cfg, 32, page_size, FP8, torch.device("cpu"))
    pool.k_scales, pool.v_scales = [0.1, 0.05], [0.04, 0.03]  # |x| up to 44.8 / 17.9 in layer 0, 22.4 / 13.4 in 1
    rng = random.Random(0)
    meta, all_slots = step_meta(seqs, page_size, rng.sample(range(32), 32))
    gen = torch.Generator().manual_seed(1)
    # The cached prefixes: values around 3, far from 1.0-scale e4m3's sweet spot; the same bytes in both layers.
    k_all, v_all = torch.randn(2, len(all_slots), KH, D, generator=gen) * 3
    write_kv_scaled(pool.layers[1], k_all, v_all, all_slots, pool.k_scales[1], pool.v_scales[1])
    pool.layers[0].view(torch.uint8).copy_(pool.layers[1].view(torch.uint8))
    t = meta.slot_mapping.numel()
    q = torch.randn(t, H, D, generator=gen)
    k, v = torch.randn(2, t, KH, D, generator=gen) * 3
    backend = TorchAttention(pool, cfg, torch.float32)
    assert [backend.scales(i) for i in (0, 1)] == [(0.1, 0.04), (0.05, 0.03)]
    backend.prepare(meta)
    outs = [backend.forward(i, q, k, v) for i in (0, 1)]

    pages, offsets = meta.slot_mapping // page_size, meta.slot_mapping % page_size
    for i, out in enumerate(outs):
        deq = _dequantized(pool.layers[i], pool.k_scales[i], pool.v_scales[i])
        torch.testing.assert_close(out, _float32_attention(meta, deq, q), atol=1e-5, rtol=1e-5)
        # and the values written are this step's K/V within e4m3's rounding at this layer's scales
        torch.testing.assert_close(deq[pages, 0, offsets], k, rtol=2 ** -4, atol=pool.k_scales[i] * 2 ** -10)
        torch.testing.assert_close(deq[pages, 1, offsets], v, rtol=2 ** -4, atol=pool.v_scales[i] * 2 ** -10)
    assert (outs[0] - outs[1]).abs().max() > 0.1  # the scales, not the bytes, told the layers apart
    wrong = _dequantized(pool.layers[1], pool.k_scales[0], pool.v_scales[0])  # layer 1 read with layer 0's scales
    assert (outs[1] - _float32_attention(meta, wrong, q)).abs().max() > 0.1


def test_pool_scales_are_per_layer_and_default_to_one():
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=KH, head_dim=D)
    pool = KVPool(cfg, 4, 4, FP8, torch.device("cpu"))
    assert pool.is_fp8 and pool.k_scales == [1.0] * 3 and pool.v_scales == [1.0] * 3
    pool.k_scales[2], pool.v_scales[2] = 0.5, 0.25
    attn_cfg = SimpleNamespace(head_dim=D, softmax_scale=D ** -0.5, window=lambda layer: 0)
    backend = TorchAttention(pool, attn_cfg, torch.float32)
    assert [backend.scales(i) for i in range(3)] == [(1.0, 1.0), (1.0, 1.0), (0.5, 0.25)]
    wide = KVPool(cfg, 4, 4, torch.float32, torch.device("cpu"))
    wide.k_scales[2] = 0.5
    assert TorchAttention(wide, attn_cfg, torch.float32).scales(2) == (1.0, 1.0)  # stored as is


# ---- calibration -------------------------------------------------------------------------------------------

def test_scales_from_amax():
    assert scales_from_amax([224.0, 4.48]) == [224.0 * SCALE_MARGIN / 448, 4.48 * SCALE_MARGIN / 448]
    assert scales_from_amax([448.0], margin=1.0) == [1.0]
    # Nothing to scale, or an overflow: 1.0, never 0 (a division by zero on write) or inf.
    assert scales_from_amax([0.0, float("inf"), float("nan")]) == [1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def calibration_ids(loaded_fp32) -> list[int]:
    return calibration_token_ids(loaded_fp32.tokenizer)


@pytest.fixture(scope="module")
def calibrated(loaded_fp32, calibration_ids) -> KVPool:
    pool = KVPool(loaded_fp32.config, 64, 16, FP8, torch.device("cpu"))
    calibrate_kv_scales(loaded_fp32.model, pool, calibration_ids)
    return pool


def test_calibrated_scales_are_positive_per_layer_and_differ(loaded_fp32, calibrated):
    n = loaded_fp32.config.num_layers
    for scales in (calibrated.k_scales, calibrated.v_scales):
        assert len(scales) == n and all(s > 0 and s != 1.0 for s in scales)
    # SmolLM2-135M: |K| peaks at 10.7 to 20.3 per layer, |V| at 0.6 to 15.8: one scale for all would not do.
    assert max(calibrated.v_scales) / min(calibrated.v_scales) > 10
    assert max(calibrated.k_scales) / min(calibrated.k_scales) > 1.5


def test_amax_is_what_the_layers_write(loaded_fp32, calibration_ids):
    """The recorded amax is the largest |K| (after RoPE) and |V| an unquantized pool holds after the same prefill."""
    k_amax, v_amax = measure_kv_amax(loaded_fp32.model, calibration_ids, torch.device("cpu"))
    pool = KVPool(loaded_fp32.config, pages_for(len(calibration_ids), 16), 16, torch.float32, torch.device("cpu"))
    ModelRunner(loaded_fp32.model, TorchAttention(pool, loaded_fp32.config, torch.float32)).run(
        [SeqChunk(calibration_ids, 0, list(range(pool.num_pages)), want_logits=False)])
    written = [(layer[:, 0].abs().max().item(), layer[:, 1].abs().max().item()) for layer in pool.layers]
    assert k_amax == pytest.approx([w[0] for w in written], rel=1e-6)
    assert v_amax == pytest.approx([w[1] for w in written], rel=1e-6)


# ---- FP8 vs float32 on the real model ------------------------------------------------------------------------

def _teacher_forced_logits(check, loaded, dtype, k_scales=None, v_scales=None) -> torch.Tensor:
    pool = KVPool(loaded.config, 64, 16, dtype, torch.device("cpu"))
    if k_scales is not None:
        pool.k_scales, pool.v_scales = list(k_scales), list(v_scales)
    runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))
    return check.teacher_forced_logits(runner, loaded.tokenizer)


@pytest.fixture(scope="module")
def fp32_logits(fp8_check, loaded_fp32) -> torch.Tensor:
    return _teacher_forced_logits(fp8_check, loaded_fp32, torch.float32)


def test_fp8_with_calibrated_scales_is_within_tolerance_of_fp32(fp8_check, loaded_fp32, calibrated, fp32_logits):
    got = _teacher_forced_logits(fp8_check, loaded_fp32, FP8, calibrated.k_scales, calibrated.v_scales)
    assert fp32_logits.shape[0] >= 200
    ok, agreement, max_diff = fp8_check.within_tolerance(got, fp32_logits)
    assert ok, f"top-1 agreement {agreement:.1%}, max logit diff {max_diff:.2f}"


@pytest.mark.parametrize("bad_scale", [1e-4, 1e3])  # clamps everything / flushes everything toward zero
def test_a_bad_scale_fails_the_same_check(fp8_check, loaded_fp32, fp32_logits, bad_scale):
    n = loaded_fp32.config.num_layers
    got = _teacher_forced_logits(fp8_check, loaded_fp32, FP8, [bad_scale] * n, [bad_scale] * n)
    ok, agreement, max_diff = fp8_check.within_tolerance(got, fp32_logits)
    assert not ok, f"top-1 agreement {agreement:.1%}, max logit diff {max_diff:.2f}"


def _with_kv_scaled_up(loaded, factor: float):
    """A copy of the model whose K and V are `factor` times larger and whose q and o_proj are that much smaller:
    with a power of two, the same float32 logits, but K/V magnitudes past what e4m3 holds at scale 1.0."""
    import copy

    model = copy.deepcopy(loaded.model)
    cfg = loaded.config
    q_size = cfg.num_heads * cfg.head_dim
    with torch.no_grad():
        for layer in model.layers:
            w = layer.self_attn.qkv_proj.weight  # [q; k; v] rows
            w[:q_size] /= factor
            w[q_size:] *= factor
            layer.self_attn.o_proj.weight /= factor
    return SimpleNamespace(config=cfg, model=model, tokenizer=loaded.tokenizer)


def test_calibration_keeps_large_kv_in_range(fp8_check, loaded_fp32, calibration_ids, fp32_logits):
    """Where |K| reaches about 1300 (64x SmolLM2's), scale 1.0 clamps and fails the tolerance; calibrated scales
    follow the model and pass it."""
    big = _with_kv_scaled_up(loaded_fp32, 64.0)
    n = big.config.num_layers
    ok, agreement, max_diff = fp8_check.within_tolerance(_teacher_forced_logits(fp8_check, big, FP8, [1.0] * n, [1.0] * n), fp32_logits)
    assert not ok, f"scale 1.0: top-1 agreement {agreement:.1%}, max logit diff {max_diff:.2f}"
    pool = KVPool(big.config, 4, 16, FP8, torch.device("cpu"))
    calibrate_kv_scales(big.model, pool, calibration_ids)
    ok, agreement, max_diff = fp8_check.within_tolerance(_teacher_forced_logits(fp8_check, big, FP8, pool.k_scales, pool.v_scales),
                                                fp32_logits)
    assert ok, f"calibrated: top-1 agreement {agreement:.1%}, max logit diff {max_diff:.2f}"


# ---- the engine --------------------------------------------------------------------------------------------

def test_engine_serves_from_fp8_pools_on_cpu(loaded_fp32, prompt_ids, greedy, serve):
    """kv.dtype = fp8_e4m3 with the torch backend on CPU: warm-up calibrates both pools (to the same scales, since
    the transfer copies bytes), requests finish, and every page comes back."""
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": {"prefill": ["cpu:0"], "decode": ["cpu:1"]},
                            "kv": {"memory_gib": 0.0625, "page_size": 16, "dtype": "fp8_e4m3"},
                            "scheduler": {"max_num_batched_tokens": 48}})

    def check(engine):
        pools = [w.pool for w in engine.workers]
        assert all(p.dtype == FP8 for p in pools)
        assert pools[0].k_scales == pools[1].k_scales and pools[0].v_scales == pools[1].v_scales
        assert all(s != 1.0 for s in pools[0].k_scales + pools[0].v_scales)

    out, stats = serve(cfg, loaded_fp32, prompt_ids, 16, check)
    assert all(p.num_free == p.num_pages for p in stats), stats
    assert [f for _, f in out] == ["length"] * len(prompt_ids) and all(len(t) == 16 for t, _ in out)
    # Greedy decoding drifts once one near-tie flips, so compare the first tokens only: the first comes from
    # the prefill device, the next three from the decode device reading the transferred FP8 pages.
    same_start = sum(t[:4] == ref for (t, _), ref in zip(out, greedy(loaded_fp32, torch.float32, prompt_ids, 4)))
    assert same_start >= len(prompt_ids) - 2, [t for t, _ in out]
