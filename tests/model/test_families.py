"""The families of model/registry.py against their transformers classes, token for token in float32: tiny random
Qwen3, Llama 3.2 (llama3 RoPE scaling, tied embeddings) and Gemma 3 (sliding windows shorter than the prompts)
models, converted to GGUF as llama.cpp's converter does with their matrices in every block type served, and saved
as HF checkpoints; the real Gemma 3 270M Q4_K_M file is tests/model/test_gemma3.py's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from nodeserve.model import registry  # noqa: E402
from nodeserve.model.config import LoadError, config_from_hf  # noqa: E402
from nodeserve.model.loader import load_model  # noqa: E402
from tests.model.test_gguf_loader import (QUANTIZABLE, VOCAB, add, arch_metadata, finish,  # noqa: E402
                                          llama_cpp_permute, random_blocks, tokenizer_metadata, write_metadata)
from tests.model.test_parity import NUM_NEW_TOKENS, _greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Every block type a matrix may come in (the K-quants need rows of 256).
BLOCK_TYPES = (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # short, so the prompts' positions reach past it

FAMILIES = {
    "qwen3": lambda **kw: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, intermediate_size=512, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, **kw)),  # head_dim 128, not hidden / heads = 64
    "llama3": lambda **kw: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True, **kw)),
    "gemma3": lambda **kw: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, query_pre_attn_scalar=128, intermediate_size=512, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}, tie_word_embeddings=True,
        **{"sliding_window": 8, **kw})),
}
# HF name (after "model.layers.N.") -> GGUF name, per family: what convert_hf_to_gguf.py writes.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
LAYER_NAMES = {
    "qwen3": {**GGUF_NAMES, "post_attention_layernorm": "ffn_norm"},
    "llama3": {**GGUF_NAMES, "post_attention_layernorm": "ffn_norm"},
    "gemma3": {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
}


def build_hf(family: str, **config):
    torch.manual_seed(99)
    hf = FAMILIES[family](**config).float().eval()
    with torch.no_grad():  # random init leaves norms at one (Gemma's at zero): make every weight matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
    return hf


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for llama3 scaling (LlamaModel.generate_extra_tensors)."""
    s = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = s["original_max_position_embeddings"] / s["low_freq_factor"], \
        s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, family: str, hf, qtype: QT) -> None:
    """`hf` as convert_hf_to_gguf.py writes it, its matrices in `qtype` (the HF model's weights set to what the
    file holds, so it computes with the same values)."""
    hc = hf.config
    arch = registry.ARCHITECTURES[family if family != "llama3" else "llama"].gguf_name
    meta = arch_metadata(arch, layers=hc.num_hidden_layers, hidden=hc.hidden_size, ffn=hc.intermediate_size,
                         heads=hc.num_attention_heads, kv_heads=hc.num_key_value_heads,
                         ctx=hc.max_position_embeddings, eps=hc.rms_norm_eps, vocab=hc.vocab_size,
                         theta=float(hc.rope_parameters.get("full_attention", hc.rope_parameters)["rope_theta"]),
                         key_length=getattr(hc, "head_dim", None))
    if family == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = hc.sliding_window
    meta.update(tokenizer_metadata())
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, meta)
    rng = np.random.default_rng(int(qtype))
    for hf_name, p in hf.state_dict().items():
        if hf_name == "lm_head.weight" and hc.tie_word_embeddings:
            continue
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.removesuffix(".weight").split(".", 3)
            tname = f"blk.{layer}.{LAYER_NAMES[family][rest]}.weight"
        else:
            tname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[hf_name]
        w, raw = p.detach().numpy().astype(np.float32), None
        if family == "gemma3" and "norm" in tname:
            w = w + 1  # the converter stores Gemma's norms as 1 + w
        if w.ndim == 2 and tname.startswith("blk.") and qtype != QT.F32:
            if qtype == QT.F16:
                w = w.astype(np.float16)
                data = w
            else:
                data = quantize(w, qtype) if qtype in QUANTIZABLE else random_blocks(qtype, *w.shape, rng)
                raw = qtype
            with torch.no_grad():
                p.copy_(torch.from_numpy(dequantize(data, qtype) if raw else data.astype(np.float32)))
            w = data
        if family == "llama3" and ".attn_q." in tname:
            w = llama_cpp_permute(w, hc.num_attention_heads)
        elif family == "llama3" and ".attn_k." in tname:
            w = llama_cpp_permute(w, hc.num_key_value_heads)
        add(writer, tname, w, raw, tuple(p.shape))
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(hc))
    finish(writer)


def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    hf.generation_config.eos_token_id = None  # past EOS, as ignore_eos does
    with torch.inference_mode():
        return [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                for ids in prompts]


def write_word_tokenizer(path) -> None:
    """A tokenizer.json with one word per id: the ids are what is compared, the text does not matter."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(path / "tokenizer.json"))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 23, 41)]  # past Gemma's window of 8


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_greedy_equals_transformers(tmp_path, family, qtype):
    hf = build_hf(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, hf, qtype)
    loaded = load_model(str(path), torch.float32)
    assert loaded.config.architecture == registry.ARCHITECTURES[family if family != "llama3" else "llama"].name
    prompts = _prompts()
    want = hf_greedy(hf, prompts)
    assert _greedy(loaded, prompts, page_size=16, prefill_chunk=4096) == want
    assert _greedy(loaded, prompts, page_size=3, prefill_chunk=7) == want  # chunks cross the window's pages


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_checkpoint_greedy_equals_transformers(tmp_path, family):
    hf = build_hf(family)
    hf.save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    prompts = _prompts()
    assert _greedy(loaded, prompts, page_size=4, prefill_chunk=9) == hf_greedy(hf, prompts)


def test_gemma3_config_from_hf_and_gguf_agree(tmp_path):
    hf = build_hf("gemma3")
    hf.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", "gemma3", hf, QT.F32)
    from_hf = config_from_hf(str(tmp_path / "hf"))
    from_gguf = load_model(str(tmp_path / "m.gguf"), torch.float32).config
    assert from_hf.layer_windows == from_gguf.layer_windows == (8, 8, 8, 8, 8, 0)
    assert from_hf.rope_local_theta == from_gguf.rope_local_theta == 10000.0
    assert from_hf.query_scale == pytest.approx(from_gguf.query_scale) == 128 ** -0.5
    assert from_hf.embed_scale == from_gguf.embed_scale == math.sqrt(256)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    with pytest.raises(LoadError) as info:
        config_from_hf(str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg
    assert all(name in msg for a in registry.ARCHITECTURES.values() for name in a.hf_classes)


def test_every_architecture_is_tested_here_or_in_the_suite():
    """The registry's promise: each row names its reference, and this file (or test_gguf_loader's Llama/Qwen2
    cases) checks it against that class."""
    tested = {"llama", "qwen2", "qwen3", "gemma3"}
    assert set(registry.ARCHITECTURES) == tested
    for a in registry.ARCHITECTURES.values():
        assert a.reference.split(":")[0] in a.hf_classes + ("Gemma3ForCausalLM",)


def test_mistral_sliding_window_checkpoint_equals_transformers(tmp_path):
    torch.manual_seed(5)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=8)).float().eval()
    hf.save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.config.architecture == "llama" and loaded.config.layer_windows == (8, 8)
    prompts = _prompts()
    assert _greedy(loaded, prompts, page_size=4, prefill_chunk=9) == hf_greedy(hf, prompts)


@pytest.mark.needs_cpu("avx2")  # without AVX2 the fast tier serves float32 weights: no decode layer to build
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_one_call_decode_layer_computes_every_family(tmp_path, family):
    """The fast tier's native decode layer (q/k norm, sandwich norms, GeGLU, the local RoPE table as struct
    fields) gives the module path's logits, decode step after decode step past Gemma's window."""
    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.kv.pool import KVPool
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk

    hf = build_hf(family, **({"sliding_window": 20} if family == "gemma3" else {}))
    write_gguf(tmp_path / "m.gguf", family, hf, QT.Q8_0)
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, quantization="auto")
    decoder = loaded.model.native_decoder
    assert decoder is not None

    def decode(native: bool) -> torch.Tensor:
        loaded.model.native_decoder = decoder if native else None
        pool = KVPool(loaded.config, 16, 16, torch.float32, torch.device("cpu"))
        runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, torch.float32))
        table = pool.manager.allocate(8)
        runner.run([SeqChunk(list(range(5, 35)), 0, table)])
        return torch.stack([runner.run([SeqChunk([7 + i], 30 + i, table)]) for i in range(12)])

    native, modules = decode(True), decode(False)
    loaded.model.native_decoder = decoder
    # GeGLU's tanhf against torch's tanh: float32 rounding only
    assert (native - modules).abs().max() <= 1e-4 * (modules.max() - modules.min())
