"""fp16 weight storage (model/quant.py): the kernel's arithmetic, the swap of every Linear, and model quality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nodeserve.model.quant import PackedLinear, quantize_linears, supported

pytestmark = pytest.mark.skipif(supported("fp16") is not None, reason="this torch build has no fbgemm")


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_float32_math_on_fp16_rounded_weights(rows, bias, one_thread):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    x = torch.randn(2, rows, 96)
    packed = PackedLinear(lin, "fp16")
    want = nn.functional.linear(x, lin.weight.half().float(), lin.bias)
    got = packed(x)
    assert got.shape == (2, rows, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ... and not the unrounded weights: the rounding is real and visible.
    assert not torch.allclose(got, lin(x), rtol=1e-6, atol=1e-7)


def test_batch_does_not_change_a_row(one_thread):
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(64, 32), "fp16")
    x = torch.randn(17, 64)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(17)])
    torch.testing.assert_close(packed(x), alone, rtol=1e-6, atol=1e-6)


def test_unknown_format_is_refused():
    assert "int3" in supported("int3")
    with pytest.raises(ValueError, match="int3"):
        PackedLinear(nn.Linear(4, 4), "int3")


@pytest.fixture(scope="module")
def loaded_fp16w(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, quantization="fp16")


def test_every_linear_is_packed_and_the_embedding_kept(loaded_fp16w, loaded_fp32):
    model = loaded_fp16w.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * model.cfg.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert torch.equal(model.embed_tokens.weight, loaded_fp32.model.embed_tokens.weight)
    assert quantize_linears(model, "fp16") == 0  # nothing left to convert


def test_fp16_weights_keep_the_models_answers(loaded_fp16w, loaded_fp32, prompt_ids):
    """Teacher-forced next-token agreement with float32 over every position of the parity prompts."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.kv.pool import KVPool, pages_for

    def all_logits(loaded, ids):
        pool = KVPool(loaded.config, 64, 16, torch.float32, torch.device("cpu"))
        runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))
        t, pos, meta, _ = runner.prepare([SeqChunk(ids, 0, pool.manager.allocate(pages_for(len(ids), 16)))])
        runner.backend.prepare(meta)
        return loaded.model.compute_logits(loaded.model(t, pos, runner.backend))

    agree = total = 0
    for ids in prompt_ids:
        ref, got = all_logits(loaded_fp32, ids), all_logits(loaded_fp16w, ids)
        assert (got - ref).abs().max() < 0.5  # logits span ~75 here; measured max difference 0.054
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.98, f"{agree}/{total}"
