"""The model's kernel sets on CPU: TorchOps is bit for bit the math the model had before kernel sets (which
matches transformers), RoPE follows the device of its positions, and FlashInferOps' plumbing (shapes, the
cos/sin table's layout, in-place updates on strided views) against a stand-in `flashinfer` whose functions
compute, in plain PyTorch, what FlashInfer documents. tests/cuda checks FlashInfer's real kernels on a GPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nodeserve.model.ops import TorchOps
from nodeserve.model.rope import RotaryEmbedding

H, KH, D = 4, 2, 16
HIDDEN, INTER = 32, 48
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the math as llama.py / rope.py had it inline, before kernel sets ------------------------------------
def _old_rms_norm(x, weight, eps):
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _old_rope(x, positions, inv_freq, dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _qkv(t: int, dtype: torch.dtype, seed: int = 0):
    """q [T, H, D] and k, v [T, KH, D] as the model makes them: strided views into one fused projection."""
    qkv = torch.randn(t, (H + 2 * KH) * D, generator=_gen(seed)).to(dtype)
    q, k, v = qkv.split([H * D, KH * D, KH * D], dim=-1)
    return qkv, q.view(t, H, D), k.view(t, KH, D), v.view(t, KH, D)


POSITIONS = torch.tensor([0, 1, 2, 7, 3, 100, 511, 5])  # ragged steps: prefill rows, then decodes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_equal_the_previous_math(dtype):
    ops = TorchOps(RotaryEmbedding(D, 10000.0, LLAMA3))
    g = _gen(1)
    x, residual = torch.randn(8, HIDDEN, generator=g).to(dtype), torch.randn(8, HIDDEN, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), _old_rms_norm(x, weight, 1e-5))
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, _old_rms_norm(residual + x, weight, 1e-5))

    gate_up = torch.randn(8, 2 * INTER, generator=g).to(dtype)
    gate, up = gate_up.split(INTER, dim=-1)
    assert torch.equal(ops.silu_and_mul(gate_up), F.silu(gate) * up)

    _, q, k, _ = _qkv(len(POSITIONS), dtype)
    q_rot, k_rot = ops.rotary(POSITIONS, dtype).apply(q, k)
    assert torch.equal(q_rot, _old_rope(q, POSITIONS, ops.rope.inv_freq, dtype))
    assert torch.equal(k_rot, _old_rope(k, POSITIONS, ops.rope.inv_freq, dtype))


def test_rope_follows_the_device_of_its_positions():
    # The meta device stands in for a GPU: a CPU inv_freq times meta positions is the same device mismatch.
    rope = RotaryEmbedding(D, 10000.0, None)
    cos, sin = rope.cos_sin(torch.arange(5, device="meta"), torch.bfloat16)
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (5, D) and cos.dtype == torch.bfloat16
    meta = torch.device("meta")
    assert rope.inv_freq_on(meta) is rope.inv_freq_on(meta)  # copied once, not per step
    assert rope.inv_freq_on(torch.device("cpu")) is rope.inv_freq
    assert rope.cos_sin_cache(32, meta).device.type == "meta"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_cos_sin_cache_layout(scaling):
    rope = RotaryEmbedding(D, 500000.0, scaling)
    cache = rope.cos_sin_cache(600, torch.device("cpu"))
    assert cache.shape == (600, D) and cache.dtype == torch.float32 and cache.is_contiguous()
    cos, sin = rope.cos_sin(POSITIONS, torch.float32)  # [T, D]: each half repeats the D/2 angles
    assert torch.equal(cache[POSITIONS, :D // 2], cos[:, :D // 2])
    assert torch.equal(cache[POSITIONS, D // 2:], sin[:, :D // 2])


# ---- a stand-in flashinfer ------------------------------------------------------------------------------
def _fake_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """out = input / RMS(input) * weight, in float32, rounded once (FlashInfer's kernel)."""
    assert input.stride(-1) == 1 and weight.dim() == 1 and input.shape[-1] == weight.shape[0]
    assert input.dtype == weight.dtype  # one c_type for all three in the kernel
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _fake_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place: residual += input; input = rmsnorm(residual)."""
    assert input.shape == residual.shape and input.dim() == 2
    residual.copy_((residual.float() + input.float()).to(residual.dtype))
    input.copy_(_fake_rmsnorm(residual, weight, eps))


def _fake_silu_and_mul(input, out=None, enable_pdl=None):
    if input.shape[-1] % 2:
        raise ValueError("The last dimension must be even (2 * hidden_size).")
    half = input.shape[-1] // 2
    y = (F.silu(input[..., :half].float()) * input[..., half:].float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


_rope_calls: list[dict] = []


def _fake_rope_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """FlashInfer's checks (rope.py and csrc/rope.cu), then neox-style rotation written back in place."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.is_contiguous()
    assert positions.dim() == 1 and positions.is_contiguous() and positions.dtype in (torch.int32, torch.int64)
    assert query.dim() == key.dim() == 2 and query.shape[0] == key.shape[0] == positions.shape[0]
    assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
    assert is_neox
    _rope_calls.append(dict(q_contiguous=query.is_contiguous(), k_contiguous=key.is_contiguous()))
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions, None, :half], cos_sin_cache[positions, None, half:]  # [T, 1, R/2]
    for x in (query, key):
        x3 = x.view(x.shape[0], -1, head_size)  # as rope.py does: fails unless heads and D merge as a view
        assert x3.stride(-1) == 1               # CHECK_LAST_DIM_CONTIGUOUS_INPUT
        x1, x2 = x3[..., :half].float(), x3[..., half:].float()
        x3.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))


@pytest.fixture
def flashinfer_ops(monkeypatch):
    """FlashInferOps, built against the stand-in module."""
    parts = {
        "norm": dict(rmsnorm=_fake_rmsnorm, fused_add_rmsnorm=_fake_fused_add_rmsnorm),
        "activation": dict(silu_and_mul=_fake_silu_and_mul),
        "rope": dict(apply_rope_with_cos_sin_cache_inplace=_fake_rope_inplace),
    }
    root = types.ModuleType("flashinfer")
    monkeypatch.setitem(sys.modules, "flashinfer", root)
    for name, functions in parts.items():
        module = types.ModuleType(f"flashinfer.{name}")
        module.__dict__.update(functions)
        setattr(root, name, module)
        monkeypatch.setitem(sys.modules, f"flashinfer.{name}", module)
    _rope_calls.clear()
    from nodeserve.model.flashinfer_ops import FlashInferOps

    return FlashInferOps


def test_flashinfer_is_imported_only_when_the_set_is_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # any `import flashinfer` now raises
    from nodeserve.model.flashinfer_ops import FlashInferOps

    with pytest.raises(ImportError):
        FlashInferOps(RotaryEmbedding(D, 10000.0, None), 16, torch.device("cpu"))


def test_flashinfer_ops_pointwise_match_torch_ops(flashinfer_ops):
    rope = RotaryEmbedding(D, 10000.0, None)
    fi, ref = flashinfer_ops(rope, 64, torch.device("cpu")), TorchOps(rope)
    g = _gen(2)
    x, residual = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    torch.testing.assert_close(fi.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), **F32_TOL)
    want_normed, want_sum = ref.add_rms_norm(x, residual, weight, 1e-5)
    x_in, residual_in = x.clone(), residual.clone()
    normed, summed = fi.add_rms_norm(x_in, residual_in, weight, 1e-5)
    assert normed is x_in and summed is residual_in  # FlashInfer's fused add+norm works in place
    torch.testing.assert_close(normed, want_normed, **F32_TOL)
    torch.testing.assert_close(summed, want_sum, **F32_TOL)
    gate_up = torch.randn(8, 2 * INTER, generator=g)
    torch.testing.assert_close(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **F32_TOL)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_flashinfer_rope_rotates_the_strided_qkv_views_in_place(flashinfer_ops, scaling):
    rope = RotaryEmbedding(D, 500000.0, scaling)
    fi, ref = flashinfer_ops(rope, 512 + 1, torch.device("cpu")), TorchOps(rope)
    qkv, q, k, v = _qkv(len(POSITIONS), torch.float32, seed=3)
    v_before = v.clone()
    want_q, want_k = ref.rotary(POSITIONS, torch.float32).apply(q, k)
    got_q, got_k = fi.rotary(POSITIONS, torch.float32).apply(q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # no copies
    assert _rope_calls == [dict(q_contiguous=False, k_contiguous=False)]
    assert got_q.shape == (len(POSITIONS), H, D) and got_k.shape == (len(POSITIONS), KH, D)
    torch.testing.assert_close(got_q, want_q, **F32_TOL)
    torch.testing.assert_close(got_k, want_k, **F32_TOL)
    assert torch.equal(v, v_before)  # V shares the qkv buffer and must be left alone


def _tiny_model(seed: int):
    from nodeserve.model.config import ModelConfig
    from nodeserve.model.llama import LlamaModel

    cfg = ModelConfig("llama", vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=3,
                      num_heads=H, num_kv_heads=KH, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=128, tie_word_embeddings=False, rope_scaling=LLAMA3)
    model = LlamaModel(cfg).to_empty(device="cpu")
    g = _gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else
                    0.2 * torch.randn(p.shape, generator=g))
    model.fuse()
    return model.eval()


def _greedy(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts in one step, then batched decode: tokens and every step's logits."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.kv.pool import KVPool, pages_for

    pool = KVPool(model.cfg, 64, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, TorchAttention(pool, model.cfg, model.dtype))
    tables = [pool.manager.allocate(pages_for(len(p) + steps, 4)) for p in prompts]
    logits = runner.run([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    history, out = [logits], [[int(x)] for x in logits.argmax(-1)]
    for step in range(steps - 1):
        logits = runner.run([SeqChunk([o[-1]], len(p) + step, t) for p, o, t in zip(prompts, out, tables)])
        history.append(logits)
        for o, x in zip(out, logits.argmax(-1)):
            o.append(int(x))
    return out, history


def test_model_with_flashinfer_ops_matches_torch_ops(flashinfer_ops):
    """The whole forward: in-place add+norm on the residual stream and in-place RoPE on the qkv output, over
    a ragged prefill and batched decodes, must give TorchOps' logits (and so its greedy tokens)."""
    model = _tiny_model(seed=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    want_tokens, want_logits = _greedy(model, prompts, steps=6)
    model.use_kernels(lambda rope: flashinfer_ops(rope, model.cfg.max_position_embeddings, torch.device("cpu")))
    tokens, logits = _greedy(model, prompts, steps=6)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
