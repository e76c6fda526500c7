"""GGUF checkpoints built here with gguf.GGUFWriter: every tensor type dequantizes exactly as gguf.quants does,
llama.cpp's Q/K row permutation is undone, tiny random Llama / Qwen2 models converted to GGUF give transformers'
logits through ModelRunner, and metadata maps onto ModelConfig (or fails with a one-line LoadError)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from nodeserve.attention.torch_ref import TorchAttention  # noqa: E402
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk  # noqa: E402
from nodeserve.kv.pool import KVPool, pages_for  # noqa: E402
from nodeserve.model.config import LoadError  # noqa: E402
from nodeserve.model.gguf_loader import config_from_metadata, load_gguf  # noqa: E402
from nodeserve.model.loader import load_model  # noqa: E402

ATOL = 1e-4
PAGE_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- llama.cpp's conversion, written out independently of the loader ----

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleaves the rotary halves of each head's rows.
    Works on float rows and on rows of quantized bytes alike (it only moves whole rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_rows_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse, by index: GGUF row i holds HF row perm[i]."""
    perm = llama_cpp_permute(np.arange(w.shape[0]), n_head)
    out = np.empty_like(w)
    out[perm] = w
    return out


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{kind}"


def write_metadata(writer, meta: dict) -> None:
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def arch_metadata(arch: str, *, layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, ctx=256, eps=1e-6,
                  theta=10000.0, vocab=None, key_length=None) -> dict:
    meta = {
        f"{arch}.block_count": layers, f"{arch}.context_length": ctx, f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.rope.freq_base": theta,
        f"{arch}.attention.layer_norm_rms_epsilon": eps,
    }
    if vocab is not None:
        meta[f"{arch}.vocab_size"] = vocab
    if key_length is not None:
        meta[f"{arch}.attention.key_length"] = key_length
        meta[f"{arch}.attention.value_length"] = key_length
    return meta


# ---- a minimal byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") ----

def _bytes_to_unicode() -> list[str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r"]
BOS, EOS = "<|bos|>", "<|eos|>"


def tokenizer_vocab() -> tuple[list[str], list[int]]:
    tokens = _bytes_to_unicode() + [m.replace(" ", "") for m in MERGES] + [BOS, EOS]
    types = [1] * (len(tokens) - 2) + [3, 3]  # normal, then two control tokens
    return tokens, types


TOKENS, TOKEN_TYPES = tokenizer_vocab()
VOCAB = len(TOKENS)


def tokenizer_metadata() -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": TOKEN_TYPES,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": TOKENS.index(BOS),
            "tokenizer.ggml.eos_token_id": TOKENS.index(EOS)}


# ---- 1. every tensor type dequantizes exactly as gguf.quants does ----

# Byte offsets of the float16 scale / min fields inside one block of each type (see gguf/quants.py); every other
# byte may be anything: random nibbles, sign bits, packed 6-bit scales and grid indices are all valid.
F16_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.TQ1_0: (52,), QT.TQ2_0: (64,),
    QT.IQ2_XXS: (0,), QT.IQ2_XS: (0,), QT.IQ2_S: (0,), QT.IQ3_XXS: (0,), QT.IQ3_S: (0,), QT.IQ1_S: (0,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
    QT.MXFP4: (), QT.NVFP4: (), QT.IQ1_M: (),  # special-cased in random_blocks
}
# Types gguf.quants can quantize: written from random float weights through gguf.quants.quantize.
QUANTIZABLE = (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.TQ1_0, QT.TQ2_0, QT.MXFP4)
REQUIRED = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
ALL_TYPES = tuple(dict.fromkeys(REQUIRED + QUANTIZABLE + tuple(F16_FIELDS)))

HIDDEN_K = 256      # row length: a multiple of every block size (256 for K- and IQ-quants)
HEADS_K, KV_HEADS_K = 4, 2


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid raw blocks [rows, bytes per row] of `qtype`: random bytes with sane finite scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.uniform(0.002, 0.05, size=n) * rng.choice([-1, 1], size=n)).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    if qtype == QT.MXFP4:  # one E8M0 exponent byte: keep it near 2^0
        raw[:, 0] = rng.integers(120, 127, size=n)
    elif qtype == QT.IQ1_M:  # the f16 scale is spread over the top nibbles of the four uint16 scale words
        d = rng.uniform(0.002, 0.05, size=n).astype(np.float16).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def tensor_data(qtype: QT, rows: int, cols: int, rng: np.random.Generator):
    """(array to write, raw_dtype or None, the float32 values [rows, cols] it stands for, original floats or None)."""
    if qtype in (QT.F32, QT.F16):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        data = w if qtype == QT.F32 else w.astype(np.float16)
        return data, None, data.astype(np.float32), w
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        data = quantize(w, qtype)
    else:
        w, data = None, random_blocks(qtype, rows, cols, rng)
    expected = dequantize(data, qtype)
    assert expected.shape == (rows, cols) and np.isfinite(expected).all()
    return data, qtype, expected, w


def add(writer, name: str, data: np.ndarray, raw_dtype: QT | None, shape: tuple[int, int]) -> None:
    """For raw uint8 blocks the writer takes the byte shape and works out the element shape itself."""
    if raw_dtype is None:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    info = writer.tensors[-1][name]
    assert tuple(info.shape) == tuple(shape) and info.dtype == (raw_dtype or info.dtype)


@pytest.fixture(scope="module", params=ALL_TYPES, ids=lambda t: t.name)
def typed_file(request, tmp_path_factory):
    """A one-layer llama GGUF whose attn_q, attn_k, attn_output and ffn_up are of one tensor type.
    Returns (qtype, path, {gguf name: expected float32 values as stored}, {gguf name: original floats})."""
    qtype = request.param
    rng = np.random.default_rng(int(qtype))
    path = tmp_path_factory.mktemp(qtype.name) / "typed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, arch_metadata("llama", layers=1, hidden=HIDDEN_K, ffn=512, heads=HEADS_K,
                                         kv_heads=KV_HEADS_K, vocab=8))
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, HIDDEN_K)).astype(np.float32))
    expected, originals = {}, {}
    head_dim = HIDDEN_K // HEADS_K
    for name, rows in (("blk.0.attn_q.weight", HIDDEN_K), ("blk.0.attn_k.weight", KV_HEADS_K * head_dim),
                       ("blk.0.attn_output.weight", HIDDEN_K), ("blk.0.ffn_up.weight", 512)):
        data, raw_dtype, values, w = tensor_data(qtype, rows, HIDDEN_K, rng)
        add(writer, name, data, raw_dtype, (rows, HIDDEN_K))
        expected[name], originals[name] = values, w
    finish(writer)
    return qtype, path, expected, originals


def test_tensor_type_dequantizes_exactly(typed_file):
    qtype, path, expected, _ = typed_file
    cfg, state, _ = load_gguf(str(path), torch.float32)
    for gname, ours in (("blk.0.attn_output.weight", "layers.0.self_attn.o_proj.weight"),
                        ("blk.0.ffn_up.weight", "layers.0.mlp.up_proj.weight")):
        got = state[ours]
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert tuple(got.shape) == expected[gname].shape
        assert torch.equal(got, torch.from_numpy(expected[gname])), f"{qtype.name} {gname}"
    # q/k: the dequantized rows, put back in HF order
    q = hf_rows_from_gguf(expected["blk.0.attn_q.weight"], cfg.num_heads)
    k = hf_rows_from_gguf(expected["blk.0.attn_k.weight"], cfg.num_kv_heads)
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(state["layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.BF16], ids=lambda t: t.name)
def test_tensor_type_converts_to_serving_dtype(tmp_path, qtype, dtype):
    rng = np.random.default_rng(7)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, arch_metadata("llama", layers=1, hidden=HIDDEN_K, heads=HEADS_K, kv_heads=KV_HEADS_K))
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, HIDDEN_K)).astype(np.float32))
    data, raw_dtype, values, _ = tensor_data(qtype, 64, HIDDEN_K, rng)
    add(writer, "blk.0.ffn_down.weight", data, raw_dtype, (64, HIDDEN_K))
    finish(writer)
    _, state, _ = load_gguf(str(path), dtype)
    got = state["layers.0.mlp.down_proj.weight"]
    assert got.dtype == dtype
    assert torch.equal(got, torch.from_numpy(values).to(dtype))
    assert state["lm_head.weight"] is state["embed_tokens.weight"]


# Sanity on top of exactness: what comes back is the weights that were quantized, not garbage.
NEAR_ORIGINAL_TOL = {QT.F32: 0.0, QT.F16: 2e-3, QT.BF16: 2e-2, QT.Q8_0: 3e-2, QT.Q5_0: 0.3, QT.Q5_1: 0.3,
                     QT.Q4_0: 0.6, QT.Q4_1: 0.6}


@pytest.mark.parametrize("typed_file", list(NEAR_ORIGINAL_TOL), ids=lambda t: t.name, indirect=True)
def test_quantized_weights_stay_near_the_originals(typed_file):
    qtype, path, _, originals = typed_file
    _, state, _ = load_gguf(str(path), torch.float32)
    w = torch.from_numpy(originals["blk.0.ffn_up.weight"])
    assert (state["layers.0.mlp.up_proj.weight"] - w).abs().max() <= NEAR_ORIGINAL_TOL[qtype]
    q = torch.from_numpy(hf_rows_from_gguf(originals["blk.0.attn_q.weight"], HEADS_K))  # the file's rows, un-permuted
    assert (state["layers.0.self_attn.q_proj.weight"] - q).abs().max() <= NEAR_ORIGINAL_TOL[qtype]


def test_type_gguf_cannot_dequantize_is_a_load_error(tmp_path):
    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, arch_metadata("llama", layers=1, hidden=HIDDEN_K, heads=HEADS_K, kv_heads=KV_HEADS_K))
    writer.add_tensor("token_embd.weight", np.zeros((8, HIDDEN_K), np.float32))
    _, size = GGML_QUANT_SIZES[QT.Q8_K]
    add(writer, "blk.0.ffn_up.weight", np.zeros((4, size), np.uint8), QT.Q8_K, (4, HIDDEN_K))
    finish(writer)
    with pytest.raises(LoadError) as info:
        load_gguf(str(path), torch.float32)
    msg = str(info.value)
    assert "\n" not in msg and "blk.0.ffn_up.weight" in msg and "Q8_K" in msg


# The fast tier (quantization "auto"): these types stay in blocks the kernels run, Q5_0 as Q8_0 (lossless).
KEPT = {QT.Q5_0: QT.Q8_0, QT.Q5_1: QT.Q5_1, QT.Q4_K: QT.Q4_K, QT.Q5_K: QT.Q5_K, QT.Q6_K: QT.Q6_K}


@pytest.mark.parametrize("typed_file", list(KEPT), ids=lambda t: t.name, indirect=True)
def test_fast_tier_keeps_the_blocks_with_the_same_weights(typed_file):
    from nodeserve.model.block_quant import KEPT_TYPES, QuantizedWeight

    qtype, path, expected, _ = typed_file
    cfg, state, _ = load_gguf(str(path), torch.float32, keep_blocks=KEPT_TYPES)
    for gname, ours, heads in (("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight", cfg.num_heads),
                               ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight", cfg.num_kv_heads),
                               ("blk.0.attn_output.weight", "layers.0.self_attn.o_proj.weight", 0),
                               ("blk.0.ffn_up.weight", "layers.0.mlp.up_proj.weight", 0)):
        w = state[ours]
        assert isinstance(w, QuantizedWeight) and w.qtype == KEPT[qtype], gname
        want = hf_rows_from_gguf(expected[gname], heads) if heads else expected[gname]
        assert torch.equal(w.dequantize(), torch.from_numpy(want)), gname  # bit for bit


def write_typed_model(path: Path, types: dict[str, QT], scale: float = 1e-3) -> Path:
    """A one-layer llama GGUF with the tokenizer, its projections and token_embd (GGUF names) in `types` (default
    Q4_K; token_embd F32), small random blocks (fp16 scales up to `scale`) so activations stay in range. No
    output.weight: the lm_head is the embedding table."""
    rng = np.random.default_rng(11)
    hidden, ffn, heads, kv_heads = 256, 512, 4, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, {**arch_metadata("llama", layers=1, hidden=hidden, ffn=ffn, heads=heads,
                                            kv_heads=kv_heads), **tokenizer_metadata()})
    if "token_embd" not in types:
        writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    head_dim = hidden // heads
    shapes = {"token_embd": (VOCAB, hidden)} if "token_embd" in types else {}
    for part, (rows, cols) in {**shapes, "attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                               "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                               "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}.items():
        qtype = types.get(part, QT.Q4_K)
        if qtype in QUANTIZABLE:
            data = quantize((rng.standard_normal((rows, cols)) * scale * 8).astype(np.float32), qtype)
        else:
            data = random_blocks(qtype, rows, cols, rng)
            for off in F16_FIELDS[qtype]:
                blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
                blocks[:, off:off + 2] = rng.uniform(scale / 10, scale, (len(blocks), 1)).astype(np.float16) \
                    .view(np.uint8)
        add(writer, f"{part}.weight" if part == "token_embd" else f"blk.0.{part}.weight", data, qtype, (rows, cols))
    finish(writer)
    return path


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    """Prefill logits of ids[:-1], then one decode step's of ids[-1]: [len(ids), vocab]."""
    runner = _new_runner(loaded)
    pages = runner.pool.manager.allocate(pages_for(len(ids), PAGE_SIZE))
    x, positions, meta, _ = runner.prepare([SeqChunk(ids[:-1], 0, pages)])
    runner.backend.prepare(meta)
    prefill = loaded.model.compute_logits(loaded.model(x, positions, runner.backend))
    return torch.cat([prefill, runner.run([SeqChunk(ids[-1:], len(ids) - 1, pages)])])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q5_1, QT.Q5_0], ids=lambda t: t.name)
def test_auto_serves_the_type_in_blocks_and_follows_the_exact_tier(tmp_path, qtype, caplog):
    """Every projection and the (tied) embedding table in one type: kept in blocks, the one-call decode layer
    built, and prefill and decode logits those of the exact tier within the kernels' rounding."""
    from nodeserve.model.block_quant import QuantEmbedding, QuantLinear

    path = write_typed_model(tmp_path / "m.gguf", dict.fromkeys(
        ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), qtype))
    with caplog.at_level("WARNING", logger="nodeserve"):
        auto = load_model(str(path), torch.float32, quantization="auto")
    exact = load_model(str(path), torch.float32, quantization="none")
    layer = auto.model.layers[0]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(mod, QuantLinear) and mod.qtype & 0xFF == int(KEPT[qtype])
    assert "float32" not in caplog.text  # nothing fell back
    assert isinstance(auto.model.embed_tokens, QuantEmbedding) and auto.model.native_decoder is not None
    assert auto.model.lm_head.weight is auto.model.embed_tokens.weight  # tied: one table
    ref_layer = exact.model.layers[0]
    assert torch.equal(layer.self_attn.qkv_proj.quantized.dequantize(), ref_layer.self_attn.qkv_proj.weight)
    ids = exact.tokenizer.encode(" the answer is in the") + [5, 17, 200]
    want, got = _logits(exact, ids), _logits(auto, ids)
    # one decode row takes int16 activations; measured: within 5e-5 of the logits' range
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * float(want.abs().max()))


def test_gemma_like_mix_shares_q8_0_and_a_k_quant_mix_falls_back_to_float32(tmp_path, caplog):
    """Q5_0 q/k with a Q8_0 v (Gemma 3's Q4_K_M) fuse as Q8_0; Q4_K q/k with a Q6_K v (a Llama Q4_K_M) have no
    lossless common type: float32, and the log says so."""
    from torch import nn

    from nodeserve.model.block_quant import QuantLinear

    gemma = write_typed_model(tmp_path / "g.gguf", {"attn_q": QT.Q5_0, "attn_k": QT.Q5_0, "attn_v": QT.Q8_0,
                                                    "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q6_K})
    layer = load_model(str(gemma), torch.float32, quantization="auto").model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.qtype & 0xFF == QT.Q8_0
    assert layer.mlp.down_proj.qtype == QT.Q6_K
    llama_mix = write_typed_model(tmp_path / "l.gguf", {"attn_v": QT.Q6_K})
    from nodeserve.model import llama

    llama._say_fused_dense.cache_clear()
    with caplog.at_level("WARNING", logger="nodeserve"):
        model = load_model(str(llama_mix), torch.float32, quantization="auto").model
    exact = load_model(str(llama_mix), torch.float32, quantization="none").model
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear)
    assert "Q4_K/Q4_K/Q6_K" in caplog.text and "float32" in caplog.text
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, exact.layers[0].self_attn.qkv_proj.weight)


def test_fast_tier_dequantizes_a_type_without_kernels_and_says_so_once(tmp_path, caplog):
    from nodeserve.model.block_quant import KEPT_TYPES, QuantizedWeight

    path = tmp_path / "q3k.gguf"
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, arch_metadata("llama", layers=1, hidden=HIDDEN_K, heads=HEADS_K, kv_heads=KV_HEADS_K))
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, HIDDEN_K)).astype(np.float32))
    expected = {}
    for part in ("ffn_up", "ffn_gate"):
        data, raw_dtype, values, _ = tensor_data(QT.Q3_K, 64, HIDDEN_K, rng)
        add(writer, f"blk.0.{part}.weight", data, raw_dtype, (64, HIDDEN_K))
        expected[part] = values
    finish(writer)
    with caplog.at_level("WARNING", logger="nodeserve"):
        _, state, _ = load_gguf(str(path), torch.float32, keep_blocks=KEPT_TYPES)
    up = state["layers.0.mlp.up_proj.weight"]
    assert not isinstance(up, QuantizedWeight) and torch.equal(up, torch.from_numpy(expected["ffn_up"]))
    assert caplog.text.count("Q3_K") == 1 and "blk.0.ffn_up.weight" in caplog.text and "float32" in caplog.text


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_type_no_tier_can_read_is_a_load_error_naming_it(tmp_path, quantization):
    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, {**arch_metadata("llama", layers=1, hidden=HIDDEN_K, heads=HEADS_K,
                                            kv_heads=KV_HEADS_K), **tokenizer_metadata()})
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN_K), np.float32))
    _, size = GGML_QUANT_SIZES[QT.Q8_K]
    add(writer, "blk.0.ffn_up.weight", np.zeros((4, size), np.uint8), QT.Q8_K, (4, HIDDEN_K))
    finish(writer)
    with pytest.raises(LoadError) as info:
        load_model(str(path), torch.float32, quantization=quantization)
    msg = str(info.value)
    assert "\n" not in msg and "blk.0.ffn_up.weight" in msg and "Q8_K" in msg


# ---- 2. tiny transformers models converted to GGUF ----

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-5)

MODEL_CASES = {
    # name: (arch, HF config kwargs, extra vocab rows past the tokenizer, linear-weight quantization type)
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=10000.0), 0, None),
    "llama_untied": ("llama", dict(tie_word_embeddings=False, rope_theta=50000.0), 0, None),
    "llama_head_dim32": ("llama", dict(tie_word_embeddings=False, rope_theta=20000.0, head_dim=32), 0, None),
    "llama_q8_0": ("llama", dict(tie_word_embeddings=False, rope_theta=10000.0), 0, QT.Q8_0),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0), 20, None),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1000000.0), 0, None),
}


def build_hf(name: str):
    arch, kwargs, pad, _ = MODEL_CASES[name]
    torch.manual_seed(1234)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=VOCAB + pad, **COMMON, **kwargs))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=VOCAB + pad, **COMMON, **kwargs))
    hf = hf.float().eval()
    with torch.no_grad():  # random init leaves norms at one and biases at zero: make every weight matter
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.normal_(0, 0.5)
    return hf


def write_model_gguf(path: Path, name: str, hf, *, drop_keys=(), extra_tensors=(), drop_tensors=()) -> Path:
    """Converts `hf` the way convert_hf_to_gguf.py does: llama q/k rows permuted, output.weight only when untied,
    linear weights quantized when the case says so (and the HF model's weights set to their dequantized values)."""
    arch, kwargs, pad, qtype = MODEL_CASES[name]
    hc = hf.config
    meta = arch_metadata(arch, hidden=hc.hidden_size, ffn=hc.intermediate_size, heads=hc.num_attention_heads,
                         kv_heads=hc.num_key_value_heads, ctx=hc.max_position_embeddings, eps=hc.rms_norm_eps,
                         theta=float(kwargs["rope_theta"]), vocab=hc.vocab_size,
                         key_length=kwargs.get("head_dim"))
    meta.update(tokenizer_metadata())
    for key in drop_keys:
        del meta[key]
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, meta)
    tied = hc.tie_word_embeddings
    for hf_name, p in hf.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        tname = gguf_name(hf_name)
        if tname in drop_tensors:
            continue
        w = p.detach().numpy().astype(np.float32)
        raw_dtype = None
        if qtype is not None and w.ndim == 2 and tname.startswith("blk."):
            data = quantize(w, qtype)
            with torch.no_grad():  # the reference model computes with what the file holds
                p.copy_(torch.from_numpy(dequantize(data, qtype)))
            w, raw_dtype = data, qtype
        if arch == "llama" and ".attn_q." in tname:
            w = llama_cpp_permute(w, hc.num_attention_heads)
        elif arch == "llama" and ".attn_k." in tname:
            w = llama_cpp_permute(w, hc.num_key_value_heads)
        add(writer, tname, w, raw_dtype, tuple(p.shape))
    for tname, data in extra_tensors:
        writer.add_tensor(tname, data)
    finish(writer)
    return path


@pytest.fixture(scope="module", params=sorted(MODEL_CASES))
def converted(request, tmp_path_factory):
    """(case name, gguf path, transformers model, nodeserve LoadedModel)."""
    name = request.param
    hf = build_hf(name)
    path = write_model_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", name, hf)
    return name, path, hf, load_model(str(path), torch.float32)


def test_model_config_from_metadata(converted):
    name, _, hf, loaded = converted
    arch, kwargs, _, _ = MODEL_CASES[name]
    cfg, hc = loaded.config, hf.config
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == \
        (hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, kwargs.get("head_dim", 16))
    assert cfg.rope_theta == kwargs["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 256
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings
    assert not cfg.rope_scaling
    if cfg.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight


def test_every_weight_equals_the_hf_original(converted):
    _, _, hf, loaded = converted
    ours = loaded.model.state_dict()
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    # The loader fuses q/k/v and gate/up (LlamaModel.fuse): expect HF's tensors concatenated the same way.
    for i in range(loaded.config.num_layers):
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            for kind in ("weight", "bias"):
                names = [f"layers.{i}.{p}.{kind}" for p in parts]
                if names[0] in theirs:
                    theirs[f"layers.{i}.{fused}.{kind}"] = torch.cat([theirs.pop(n) for n in names])
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], value), key


def test_tokenizer_from_gguf_vocab(converted):
    tok = converted[3].tokenizer
    assert tok.bos_token_id == TOKENS.index(BOS)
    assert TOKENS.index(EOS) in tok.eos_token_ids
    ids = tok.encode(" the cat", add_bos=False)
    assert ids[0] == TOKENS.index("Ġthe")
    assert tok.decode(ids) == " the cat"


def _new_runner(loaded, num_pages: int = 32) -> ModelRunner:
    pool = KVPool(loaded.config, num_pages, PAGE_SIZE, torch.float32, torch.device("cpu"))
    pool.data.normal_(0, 10)  # garbage in unused slots: a read past a sequence's KV would show
    return ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))


def test_logits_match_transformers(converted):
    _, _, hf, loaded = converted
    rng = random.Random(5)
    ids = loaded.tokenizer.encode(" the answer is in the") + [rng.randrange(VOCAB) for _ in range(6)]
    n_prefill = len(ids) - 3
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [L, V]
    runner = _new_runner(loaded)
    pages = runner.pool.manager.allocate(pages_for(len(ids), PAGE_SIZE))
    rng.shuffle(pages)
    # prefill: every position's logits
    x, positions, meta, _ = runner.prepare([SeqChunk(ids[:n_prefill], 0, pages)])
    runner.backend.prepare(meta)
    hidden = loaded.model(x, positions, runner.backend)
    logits = loaded.model.compute_logits(hidden)
    assert logits.shape == (n_prefill, loaded.config.vocab_size)
    torch.testing.assert_close(logits, ref[:n_prefill], atol=ATOL, rtol=0)
    # decode the rest one token at a time
    for pos in range(n_prefill, len(ids)):
        logits = runner.run([SeqChunk([ids[pos]], pos, pages)])
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)


# ---- 3. metadata -> config, and one-line LoadErrors ----

def _meta(**overrides) -> dict:
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 512,
            "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.rope.freq_base": 500000.0, "llama.vocab_size": 100}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return meta


def test_config_mapping_basic():
    cfg = config_from_metadata(_meta(), "x.gguf")
    assert (cfg.architecture, cfg.num_layers, cfg.max_position_embeddings, cfg.hidden_size) == ("llama", 2, 512, 64)
    assert (cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (128, 4, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.vocab_size == 100
    assert not cfg.attention_bias and cfg.rope_scaling is None


def test_config_head_dim_from_key_length():
    cfg = config_from_metadata(_meta(**{"llama.attention.key_length": 48}), "x.gguf")
    assert cfg.head_dim == 48 and cfg.hidden_size == 64
    assert cfg.kv_bytes_per_token == 2 * 2 * 2 * 48


def test_config_defaults():
    cfg = config_from_metadata(_meta(**{"llama.attention.head_count_kv": None, "llama.rope.freq_base": None}),
                               "x.gguf")
    assert cfg.num_kv_heads == cfg.num_heads == 4  # no head_count_kv: plain multi-head attention
    assert cfg.rope_theta == 10000.0


def test_config_vocab_from_token_list_and_qwen2_bias():
    meta = {k.replace("llama.", "qwen2."): v for k, v in _meta(**{"llama.vocab_size": None}).items()}
    meta["general.architecture"] = "qwen2"
    meta["tokenizer.ggml.tokens"] = ["a"] * 77
    cfg = config_from_metadata(meta, "x.gguf")
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.vocab_size == 77


def test_config_linear_rope_scaling():
    cfg = config_from_metadata(_meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
                               "x.gguf")
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.attention.head_count", "llama.block_count",
                                 "llama.feed_forward_length", "llama.context_length",
                                 "llama.attention.layer_norm_rms_epsilon"])
def test_config_missing_required_key(key):
    with pytest.raises(LoadError) as info:
        config_from_metadata(_meta(**{key: None}), "x.gguf")
    msg = str(info.value)
    assert "\n" not in msg and key in msg and "x.gguf" in msg


def test_config_unsupported_architecture():
    with pytest.raises(LoadError, match="unsupported architecture 'phi3'"):
        config_from_metadata(_meta(**{"general.architecture": "phi3"}), "x.gguf")


def _load_error(path) -> str:
    with pytest.raises(LoadError) as info:
        load_model(str(path), torch.float32)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    assert str(path) in msg
    return msg


@pytest.fixture(scope="module")
def small_hf():
    return build_hf("llama_untied")


def test_missing_required_key_in_file(tmp_path, small_hf):
    path = write_model_gguf(tmp_path / "m.gguf", "llama_untied", small_hf, drop_keys=["llama.context_length"])
    assert "llama.context_length" in _load_error(path)


@pytest.mark.parametrize("tname", ["blk.0.attn_qkv.weight", "blk.1.ffn_gate_exps.weight", "pos_embd.weight",
                                   "blk.0.attn_q.scale"])
def test_unexpected_tensor_name(tmp_path, small_hf, tname):
    path = write_model_gguf(tmp_path / "m.gguf", "llama_untied", small_hf,
                            extra_tensors=[(tname, np.zeros((4, 64), np.float32))])
    msg = _load_error(path)
    assert f"unexpected tensor '{tname}'" in msg


def test_missing_tensor(tmp_path, small_hf):
    path = write_model_gguf(tmp_path / "m.gguf", "llama_untied", small_hf, drop_tensors=["blk.1.ffn_up.weight"])
    msg = _load_error(path)
    assert "missing" in msg and "layers.1.mlp.up_proj.weight" in msg


def test_missing_token_embd(tmp_path, small_hf):
    path = write_model_gguf(tmp_path / "m.gguf", "llama_untied", small_hf, drop_tensors=["token_embd.weight"])
    assert "missing" in (msg := _load_error(path)) and "embed_tokens.weight" in msg


def test_missing_token_embd_and_output(tmp_path):
    """Tied checkpoint without its embedding: nothing to tie lm_head to."""
    path = write_model_gguf(tmp_path / "m.gguf", "llama_tied", build_hf("llama_tied"),
                            drop_tensors=["token_embd.weight"])
    assert "token_embd.weight" in _load_error(path)
