"""Block-quantized weights (model/block_quant.py): the GGUF's own blocks kept, int8/int4 for dense weights, and
the quantized model's decode path against float32 math on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nodeserve.kernels import native
from nodeserve.model import block_quant

pytestmark = pytest.mark.skipif(not block_quant.available(), reason="the native kernels could not be built")
# quantization = "auto" serves float32 weights on a CPU without AVX2 (model/loader.py): no blocks to test there
needs_avx2 = pytest.mark.needs_cpu("avx2", "fma", "f16c")


@pytest.fixture(scope="module")
def loaded_auto(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, quantization="auto")


@needs_avx2
def test_auto_keeps_the_files_blocks(loaded_auto, loaded_fp32):
    from nodeserve.runtime.memory import weight_bytes
    from nodeserve.model.native_ops import NativeOps

    model = loaded_auto.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    quant = {n: m for n, m in model.named_modules() if isinstance(m, block_quant.QuantLinear)}
    assert len(quant) == 4 * model.cfg.num_layers + 1
    assert {m.qtype & 0xff for n, m in quant.items() if n != "lm_head"} == {native.Q4_1}
    # repacked in 16-row groups where the CPU has an R16 kernel (AVX2 and up), every matrix alike
    assert {bool(m.qtype & native.R16) for m in quant.values()} == {native.load().r16}
    # tied embeddings: the Q8_0 table is shared by the lookup and the lm_head, not copied
    assert model.lm_head.qtype & 0xff == native.Q8_0 and model.lm_head.weight is model.embed_tokens.weight
    assert weight_bytes(model) < 0.2 * weight_bytes(loaded_fp32.model)
    assert isinstance(model.ops, NativeOps) and model.dtype == torch.float32
    # the weights are the file's, exactly: dequantized they are what the float32 path loaded
    ref = loaded_fp32.model.layers[7].self_attn.qkv_proj.weight
    assert torch.equal(model.layers[7].self_attn.qkv_proj.quantized.dequantize(), ref)
    ids = torch.tensor([1, 500, 49151])
    assert torch.equal(model.embed_tokens(ids), loaded_fp32.model.embed_tokens(ids))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dense_weights_quantize_within_half_a_step(fmt, one_thread):
    torch.manual_seed(0)
    lin = nn.Linear(64, 24, bias=True)
    q = block_quant.QuantLinear(block_quant.quantize(lin.weight, block_quant.BLOCK_FORMATS[fmt]), lin.bias)
    w = q.quantized.dequantize()
    blocks, deq = lin.weight.detach().view(24, 2, 32), w.view(24, 2, 32)
    levels = 254 if fmt == "int8" else 15
    step = (blocks.amax(-1) - blocks.amin(-1)) / levels if fmt == "int4" else blocks.abs().amax(-1) * 2 / levels
    assert ((deq - blocks).abs() <= step[..., None] * 0.51 + 1e-6).all()
    x = torch.randn(5, 64)
    torch.testing.assert_close(q(x), nn.functional.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)


@needs_avx2
def test_gemv_rows_tells_the_cost_model_how_small_steps_run(loaded_auto, loaded_fp32):
    max_rows = block_quant.MAX_REPACKED_ROWS if native.load().r16 else block_quant.MAX_GEMV_ROWS
    assert block_quant.gemv_rows(loaded_auto.model) == (max_rows, block_quant.ROWS_PER_PASS)
    assert block_quant.gemv_rows(loaded_fp32.model) == (0, 1)  # dense: every step is a GEMM
    src = (Path(native.__file__).parent / "csrc" / "cpu_kernels.c").read_text()
    assert f"#define MAX_TILE {block_quant.ROWS_PER_PASS} " in src  # the Python mirror of the C constant


@needs_avx2
def test_prefill_sized_batches_agree_with_float32_math(loaded_auto, one_thread):
    """Past MAX_GEMV_ROWS the GGUF layout takes the dense GEMM (float32 exactly); repacked weights take the R16
    kernel (int16 activations: within its rounding)."""
    mod = loaded_auto.model.layers[0].mlp.down_proj
    x = torch.randn(block_quant.MAX_GEMV_ROWS + 1, mod.in_features)
    dense = mod.quantized.dequantize()
    want = x @ dense.T
    if not mod.qtype & native.R16:
        torch.testing.assert_close(mod(x), want)
        torch.testing.assert_close(mod(x[:5]), want[:5], rtol=1e-5, atol=1e-4)  # the fused kernel
    else:  # within the int16 rounding bound of tests/kernels/test_native.py, of the product in float64
        nb = mod.in_features // 32
        xb = x.view(len(x), nb, 32).abs().amax(-1)
        bound = (dense.abs().view(-1, nb, 32).sum(-1)[None] * xb[:, None] / 32767 / 2).sum(-1) + 1e-5
        assert ((mod(x).double() - x.double() @ dense.double().T).abs() <= bound).all()


@needs_avx2
def test_a_long_chunks_mlp_runs_by_row_blocks_with_the_same_values(loaded_auto, one_thread):
    """Past llama.MAX_MLP_ROWS the gate/up projection runs by blocks of rows (so no activation outgrows glibc's
    fixed mmap threshold); each row's values are those of the whole-chunk product."""
    from nodeserve.model.llama import MAX_MLP_ROWS

    model = loaded_auto.model
    mlp = model.layers[0].mlp
    x = torch.randn(2 * MAX_MLP_ROWS + 7, mlp.gate_up_proj.in_features)
    blocks = list(mlp.gate_up_proj.row_blocks(x, MAX_MLP_ROWS))
    assert [len(b) for b in blocks] == [MAX_MLP_ROWS, MAX_MLP_ROWS, 7]
    whole = mlp.down_proj(model.ops.silu_and_mul(mlp.gate_up_proj(x)))
    if mlp.gate_up_proj.qtype & native.R16:  # the fused kernel: every row alike in any block
        assert torch.equal(torch.cat(blocks), mlp.gate_up_proj(x))
        assert torch.equal(mlp(x, model.ops), whole)
    else:  # dense GEMMs of another height may sum in another order: float32 rounding over 1536-term sums
        torch.testing.assert_close(mlp(x, model.ops), whole, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", [pytest.param("int8", marks=pytest.mark.needs_cpu("avx2", "fma", "f16c")),
                                  pytest.param("bf16", marks=pytest.mark.needs_cpu("avx512f", "avx512bw",
                                                                                   "avx512_vnni", "avx512_bf16"))])
def test_prompt_rows_leave_the_decode_rows_as_they_were(gguf_path, one_thread, kind):
    """With prompt_activations = "int8" (any R16 kernel: AVX2 and up) or "bf16" (the AVX-512 ones) the rows from
    prompt_from on (prompt tokens) take that kernel and the rows before it (the step's decodes) are bit for bit what
    they are alone; the lm_head never switches. Forced to the AVX2 kernels (NODESERVE_KERNELS=avx2), bf16 applies
    to nothing, as on an AVX2 CPU."""
    from nodeserve.model.llama import MAX_MLP_ROWS
    from nodeserve.model.loader import load_model

    flag = {"int8": native.ACT8, "bf16": native.BF16}[kind]
    model = load_model(gguf_path, torch.float32, quantization="auto", prompt_activations=kind).model
    mlp = model.layers[0].mlp
    gate_up = mlp.gate_up_proj
    if kind == "bf16" and native.avx2_only():
        assert gate_up.qtype & native.R16_AVX2 and gate_up.prompt_flag == 0
        return
    assert gate_up.prompt_flag == flag and not model.lm_head.prompt_flag
    x = torch.randn(MAX_MLP_ROWS + 9, gate_up.in_features)
    split = gate_up(x, prompt_from=3)
    int16 = gate_up.kernels.linear(gate_up.qtype, gate_up.weight, x, gate_up.out_features)
    prompt = gate_up.kernels.linear(gate_up.qtype | flag, gate_up.weight, x, gate_up.out_features)
    assert torch.equal(split[:3], int16[:3]) and torch.equal(split[3:], prompt[3:])
    assert not torch.equal(prompt[3:], int16[3:])
    assert torch.equal(gate_up(x), int16)  # no prompt_from: every row alike, as before
    assert torch.equal(torch.cat(list(gate_up.row_blocks(x, MAX_MLP_ROWS, prompt_from=3))), split)
    # a long chunk's MLP by row blocks, past its first block's rows, equals the one-call product
    want = mlp.down_proj(model.ops.silu_and_mul(split), prompt_from=3)
    assert torch.equal(mlp(x, model.ops, prompt_from=3), want)


@needs_avx2
def test_int8_decode_rows_leave_the_prompt_rows_as_they_were(gguf_path, one_thread):
    """With decode_activations = "int8" the rows before prompt_from (the step's decodes, and verify rows) take the
    int8 kernel and the prompt rows keep int16, bit for bit; no prompt_from: every row is a decode row. The native
    decoder (decode-only steps in one call per layer) multiplies with the same types: a decode step through it
    equals the module path's."""
    from nodeserve.model.loader import load_model

    model = load_model(gguf_path, torch.float32, quantization="auto", prompt_activations="int16",
                       decode_activations="int8").model
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.decode_flag == native.ACT8 and gate_up.prompt_flag == 0 and not model.lm_head.decode_flag
    x = torch.randn(12, gate_up.in_features)
    split = gate_up(x, prompt_from=3)
    int16 = gate_up.kernels.linear(gate_up.qtype, gate_up.weight, x, gate_up.out_features)
    int8 = gate_up.kernels.linear(gate_up.qtype | native.ACT8, gate_up.weight, x, gate_up.out_features)
    assert torch.equal(split[:3], int8[:3]) and torch.equal(split[3:], int16[3:])
    assert not torch.equal(int8, int16)
    assert torch.equal(gate_up(x), int8) and torch.equal(gate_up(x, prompt_from=0), int16)

    outs, _ = _decode_native_and_by_modules(model, [[1, 2, 3, 4, 5, 6, 7], [400, 401, 402]], 16)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-4)


@needs_avx2
@pytest.mark.parametrize("forced", [False, True])
def test_auto_decode_activations_take_int8_where_the_integer_kernels_are_avx2s(gguf_path, monkeypatch, forced):
    """decode_activations = "auto": int8 decode rows where the R16 kernels are AVX2's (an AVX2-only CPU, or any CPU
    forced to them with NODESERVE_KERNELS=avx2), int16 where they are VNNI's; prompt rows are left alone."""
    from nodeserve.model.loader import load_model

    if forced:
        monkeypatch.setenv("NODESERVE_KERNELS", "avx2")
    model = load_model(gguf_path, torch.float32, quantization="auto", decode_activations="auto").model
    gate_up = model.layers[0].mlp.gate_up_proj
    avx2 = native.r16_kernel(native.load()) == "avx2"
    assert avx2 or not forced
    assert gate_up.decode_flag == (native.ACT8 if avx2 else 0) and gate_up.prompt_flag == 0


@pytest.mark.slow
def test_quantized_decode_follows_float32_on_the_same_weights(loaded_auto, loaded_fp32, prompt_ids, one_thread):
    """Batch-1 decode steps (int16 activations, native attention and pointwise kernels) teacher-forced along the
    float32 path's greedy output: the same next token almost everywhere, logits within a small distance."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.kv.pool import KVPool, pages_for

    def runner(loaded):
        pool = KVPool(loaded.config, 64, 16, torch.float32, torch.device("cpu"))
        return ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))

    ref_runner, q_runner = runner(loaded_fp32), runner(loaded_auto)
    agree = total = 0
    max_diff = 0.0
    for ids in prompt_ids[:4]:
        tables = [r.pool.manager.allocate(pages_for(len(ids) + 24, 16)) for r in (ref_runner, q_runner)]
        ref_logits = ref_runner.run([SeqChunk(ids, 0, tables[0])])
        q_logits = q_runner.run([SeqChunk(ids, 0, tables[1])])
        for step in range(24):
            token = int(ref_logits.argmax(-1))  # the float32 path's greedy token feeds both
            agree += int(q_logits.argmax(-1) == ref_logits.argmax(-1))
            max_diff = max(max_diff, (q_logits - ref_logits).abs().max().item())
            total += 1
            pos = len(ids) + step
            ref_logits = ref_runner.run([SeqChunk([token], pos, tables[0])])
            q_logits = q_runner.run([SeqChunk([token], pos, tables[1])])
        for r, t in zip((ref_runner, q_runner), tables):
            r.pool.manager.free(t)
    assert agree / total >= 0.97, f"{agree}/{total}"
    assert max_diff < 0.1, max_diff  # measured: 96/96 tokens agree, max difference 0.013 (logits span ~75)


@needs_avx2
def test_native_decoder_is_the_module_path_in_one_call(loaded_auto, one_thread):
    """Decode-only steps through ns_decode_layer give what the per-op path (NativeOps, paged attention, the
    same kernels) gives, row for row, and fill the pool the same way."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [400, 401, 402], [9000] * 40]
    outs, pools = _decode_native_and_by_modules(loaded_auto.model, prompts, 32)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(pools[0].data, pools[1].data, rtol=1e-6, atol=1e-6)


def _decode_native_and_by_modules(model, prompts: list[list[int]], num_pages: int) -> tuple[list, list]:
    """Each prompt prefilled into two pools, then one decode step over all of them, through the native decoder into
    the first pool and through the modules into the second: ([logits native, logits modules], pools)."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.kv.pool import KVPool

    decoder = model.native_decoder
    assert decoder is not None
    pools = [KVPool(model.cfg, num_pages, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    per_seq = num_pages // len(prompts)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    outs = []
    for pool, use_native in zip(pools, (True, False)):
        runner = ModelRunner(model, TorchAttention(pool, model.cfg, model.dtype))
        runner.run([SeqChunk(p, 0, t, is_prompt=True) for p, t in zip(prompts, tables)])
        model.native_decoder = decoder if use_native else None
        try:
            outs.append(runner.run([SeqChunk([7 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]))
        finally:
            model.native_decoder = decoder
    return outs, pools


@needs_avx2
def test_a_prompts_last_token_alone_runs_as_a_prompt_row(loaded_auto, one_thread):
    """A prompt whose last token comes alone (the rest cached, or a chunk boundary the step budget drew), beside
    decodes, gives the K/V and first-token logits the whole prompt gives: prompt rows take prompt_activations,
    decode rows int16, so a one-token prompt chunk run as a decode row would make the answer depend on the cache
    and the load (greedy outputs differed between identical 32-stream bursts)."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
    from nodeserve.kv.pool import KVPool

    model = loaded_auto.model
    if not block_quant.use_prompt_activations(model, "int8"):  # prompt rows that round unlike decode rows
        pytest.skip("no int8 prompt rows on this CPU's kernels")
    try:
        prompt, other = [(i * 37) % 5000 + 100 for i in range(20)], [400, 401, 402, 403, 404]
        pools = [KVPool(model.cfg, 16, 16, torch.float32, torch.device("cpu")) for _ in range(3)]
        runners = [ModelRunner(model, TorchAttention(pool, model.cfg, model.dtype)) for pool in pools]
        whole = runners[0].run([SeqChunk(prompt, 0, [0, 1], is_prompt=True)])
        split = []
        for runner, is_prompt in zip(runners[1:], (True, False)):
            runner.run([SeqChunk(other, 0, [4], is_prompt=True),
                        SeqChunk(prompt[:-1], 0, [0, 1], want_logits=False, is_prompt=True)])
            logits = runner.run([SeqChunk([7], len(other), [4]),
                                 SeqChunk(prompt[-1:], len(prompt) - 1, [0, 1], is_prompt=is_prompt)])
            split.append(logits[1:])
    finally:
        for m in model.modules():
            if isinstance(m, block_quant.QuantLinear):
                m.prompt_flag = 0
    assert torch.equal(split[0], whole)
    assert torch.equal(pools[1].data[:, :2], pools[0].data[:, :2])  # the prompt's pages, every layer
    assert not torch.equal(split[1], whole)  # as a decode row (the old rule: any one-token chunk) it differs


def test_embedding_refuses_ids_outside_the_table(loaded_auto):
    with pytest.raises(IndexError):
        loaded_auto.model.embed_tokens(torch.tensor([0, loaded_auto.config.vocab_size]))


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_prompt_activations_say_so_where_nothing_takes_them(gguf_path, caplog, kind):
    """The exact path has no block-quantized projections: the setting changes nothing, and the log says so."""
    from nodeserve.model.loader import load_model

    with caplog.at_level("WARNING", logger="nodeserve"):
        model = load_model(gguf_path, torch.float32, quantization="none", prompt_activations=kind).model
    assert not any(isinstance(m, block_quant.QuantLinear) for m in model.modules())
    assert "prompt_activations" in caplog.text


@needs_avx2
def test_auto_prompt_activations_take_bf16_where_the_cpu_has_it_and_say_nothing(gguf_path, caplog):
    """The default: bf16 products on AVX512-BF16 CPUs, the kernels' own int16 elsewhere, and no warning on
    either (nor on the exact path, where nothing takes it)."""
    from nodeserve.model.loader import load_model

    kernels = native.load()
    want = native.BF16 if kernels is not None and kernels.bf16_gemm and native.r16_kernel(kernels) == "avx512-vnni" \
        else 0
    with caplog.at_level("WARNING", logger="nodeserve"):
        model = load_model(gguf_path, torch.float32, quantization="auto", prompt_activations="auto").model
        load_model(gguf_path, torch.float32, quantization="none", prompt_activations="auto")
    assert model.layers[0].mlp.gate_up_proj.prompt_flag == want and not model.lm_head.prompt_flag
    assert "prompt_activations" not in caplog.text


# ---- Q5_0 (served as Q8_0), Q5_1 and the K-quants ----

def _gguf_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of k weights in `qtype`'s blocks: gguf's quantizer where it has one, else random valid bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    if qtype in (native.Q5_0, native.Q5_1, native.Q4_0, native.Q8_0):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(quantize(w, GGMLQuantizationType(qtype)).copy())
    block, size = native.BLOCK_LAYOUTS[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in ((208,) if qtype == native.Q6_K else (0, 2)):
        raw[..., off:off + 2] = rng.uniform(0.001, 0.05, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def _gguf_dense(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType(qtype)).reshape(-1, k).copy())


def test_q5_0_becomes_q8_0_with_the_same_weights():
    blocks = _gguf_blocks(native.Q5_0, 24, 128)
    w = block_quant.to_kernel_layout(block_quant.QuantizedWeight(native.Q5_0, blocks, (24, 128)))
    assert w.qtype == native.Q8_0 and w.data.shape == (24, 128 // 32 * 34) and w.shape == (24, 128)
    assert torch.equal(w.dequantize(), _gguf_dense(blocks, native.Q5_0, 128))  # lossless
    other = block_quant.QuantizedWeight(native.Q4_K, _gguf_blocks(native.Q4_K, 4, 256), (4, 256))
    assert block_quant.to_kernel_layout(other) is other


@pytest.mark.parametrize("qtype", [native.Q5_1, native.Q4_K, native.Q5_K, native.Q6_K],
                         ids=lambda t: block_quant.type_name(t))
def test_kquant_linear_and_embedding_are_the_files_weights(qtype, one_thread):
    blocks = _gguf_blocks(qtype, 48, 512, seed=qtype)
    dense = _gguf_dense(blocks, qtype, 512)
    lin = block_quant.QuantLinear(block_quant.QuantizedWeight(qtype, blocks, (48, 512)), torch.randn(48))
    torch.manual_seed(0)
    for m in (3, block_quant.MAX_GEMV_ROWS + 5):  # the fused kernel, then dequantize + GEMM
        x = torch.randn(m, 512)
        torch.testing.assert_close(lin(x), nn.functional.linear(x, dense, lin.bias), rtol=1e-4, atol=1e-4)
    emb = block_quant.QuantEmbedding(block_quant.QuantizedWeight(qtype, blocks, (48, 512)))
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(emb(ids), dense[ids])
    # repack() leaves them in their GGUF layout (no R16 kernel for them); a Q8_0 neighbour is repacked as before
    q8 = block_quant.QuantLinear(block_quant.quantize(torch.randn(32, 512), native.Q8_0))
    model = nn.ModuleDict({"k": lin, "e": emb, "q8": q8})
    block_quant.repack(model)
    assert lin.qtype == qtype and emb.qtype == qtype
    assert bool(q8.qtype & native.R16) == (native.r16_kernel(native.load()) is not None)


def test_q4_0_and_q8_0_fuse_as_q8_0_without_loss():
    parts = [block_quant.QuantLinear(block_quant.QuantizedWeight(t, _gguf_blocks(t, n, 64, seed=n), (n, 64)))
             for t, n in ((native.Q4_0, 16), (native.Q8_0, 8), (native.Q4_0, 8))]
    fused = block_quant.fuse(parts)
    assert fused is not None and fused.qtype == native.Q8_0
    assert torch.equal(fused.quantized.dequantize(), torch.cat([p.quantized.dequantize() for p in parts]))


def test_k_quants_of_different_types_fuse_as_float32_and_say_so(caplog):
    from nodeserve.model import llama

    parts = [block_quant.QuantLinear(block_quant.QuantizedWeight(t, _gguf_blocks(t, 16, 256, seed=t), (16, 256)))
             for t in (native.Q4_K, native.Q4_K, native.Q6_K)]
    assert block_quant.fuse(parts) is None
    llama._say_fused_dense.cache_clear()
    with caplog.at_level("WARNING", logger="nodeserve"):
        fused = llama._fused(*parts)
    assert isinstance(fused, nn.Linear) and "Q4_K/Q4_K/Q6_K" in caplog.text and "float32" in caplog.text
    assert torch.equal(fused.weight, torch.cat([p.quantized.dequantize() for p in parts]))


@needs_avx2
def test_gemma3_q4_k_m_serves_its_blocks_and_greedy_follows_the_exact_tier(one_thread):
    """The real file people use (bundled gemma-3-270m, Q4_K_M): Q5_0 q/k with Q8_0 v and Q5_0 gate/up fuse as Q8_0,
    Q4_K / Q6_K o and down stay in their blocks, nothing falls back to float32, the weights are the exact tier's,
    and greedy decoding picks the same tokens (measured: 12/12, logits within 0.006 of a range of 24)."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.kv.pool import KVPool, pages_for
    from nodeserve.model.loader import load_model
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk

    auto, exact = (load_model("gemma-3-270m", torch.float32, quantization=q) for q in ("auto", "none"))
    layer, ref = auto.model.layers[3], exact.model.layers[3]
    assert not [n for n, m in auto.model.named_modules() if isinstance(m, nn.Linear)]
    assert layer.self_attn.qkv_proj.qtype & 0xFF == native.Q8_0 and layer.mlp.gate_up_proj.qtype & 0xFF == native.Q8_0
    assert {m.qtype for lay in auto.model.layers for m in (lay.self_attn.o_proj, lay.mlp.down_proj)} \
        == {native.Q4_K, native.Q6_K}
    for mine, theirs in ((layer.self_attn.qkv_proj, ref.self_attn.qkv_proj), (layer.mlp.down_proj, ref.mlp.down_proj)):
        assert torch.equal(mine.quantized.dequantize(), theirs.weight)
    ids = auto.tokenizer.encode("The capital of France is")
    tokens = []
    for loaded in (auto, exact):
        pool = KVPool(loaded.config, 8, 16, torch.float32, torch.device("cpu"))
        runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))
        pages = pool.manager.allocate(pages_for(len(ids) + 8, 16))
        seq = list(ids)
        logits = runner.run([SeqChunk(seq, 0, pages)])[-1]
        for _ in range(8):
            seq.append(int(logits.argmax()))
            logits = runner.run([SeqChunk(seq[-1:], len(seq) - 1, pages)])[0]
        tokens.append(seq[len(ids):])
    assert tokens[0] == tokens[1]


@needs_avx2
@pytest.mark.parametrize("forced", [False, True], ids=["best", "forced-avx2"])
def test_the_load_log_names_the_integer_kernels_chosen(gguf_path, caplog, monkeypatch, forced):
    """Start-up says which R16 kernels serve: the build's best (AVX-512 VNNI, AVX-VNNI or AVX2), or AVX2 under
    NODESERVE_KERNELS=avx2; the projections carry the flag that picks a kernel other than the best."""
    from nodeserve.model.loader import load_model

    if forced:
        monkeypatch.setenv("NODESERVE_KERNELS", "avx2")
    else:
        monkeypatch.delenv("NODESERVE_KERNELS", raising=False)
    kernels = native.load()
    chosen = "avx2" if forced else kernels.r16_kernels[0]
    with caplog.at_level("INFO", logger="nodeserve"):
        model = load_model(gguf_path, torch.float32, quantization="auto").model
    assert f"repacked for the {chosen} integer kernels" in caplog.text
    flag = 0 if chosen == kernels.r16_kernels[0] else native.R16_FLAGS[chosen]
    assert model.layers[0].mlp.gate_up_proj.qtype == native.Q4_1 | native.R16 | flag
