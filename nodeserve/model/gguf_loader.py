"""GGUF checkpoints: metadata to ModelConfig, and every tensor dequantized into the serving dtype, or kept in its
blocks (model/block_quant.py) when the caller serves that block type. A type the gguf package cannot dequantize
either (Q8_K, Q1_0, integer tensors) is a LoadError naming the tensor and the type."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

import numpy as np
import torch

from nodeserve.model import registry
from nodeserve.model.block_quant import QuantizedWeight, to_kernel_layout
from nodeserve.model.config import LoadError, ModelConfig
from nodeserve.model.gguf_header import Header, read_header

log = logging.getLogger(__name__)

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: dequantized to the serving dtype whatever keep_blocks says

# GGUF tensor name -> our parameter name (the HF name without "model."), for the Llama layout; a family's own
# names (registry.Architecture.gguf_tensors) take precedence.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def read_metadata(header: Header) -> dict[str, Any]:
    return header.metadata


def open_reader(path: str) -> Header:
    size = os.path.getsize(path)
    try:
        header = read_header(path)
    except Exception as e:
        raise LoadError(f"{path}: not a readable GGUF file, it is truncated or corrupt ({type(e).__name__}: {e})") from None
    for t in header.tensors:
        if t.data_offset + t.n_bytes > size:
            raise LoadError(f"{path}: file is truncated: tensor '{t.name}' ends at byte {t.data_offset + t.n_bytes}, "
                            f"the file has {size}")
    return header


def config_from_metadata(meta: dict[str, Any], path: str) -> ModelConfig:
    try:
        family = registry.by_gguf_name(meta.get("general.architecture"), path)
    except ValueError as e:
        raise LoadError(str(e)) from None
    arch = family.gguf_name

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise LoadError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    fields = dict(
        architecture=family.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=False,  # set by load_gguf from whether output.weight exists
        rope_scaling=scaling,
    )
    try:
        fields.update(family.gguf_fields(meta, arch))
    except KeyError as e:
        raise LoadError(f"{path}: GGUF metadata lacks '{e.args[0]}'") from None
    return ModelConfig(**fields)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute(), which interleaves the two rotary halves of each head's rows:
    it maps [H, 2, D/2] to [H, D/2, 2]; this maps back."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _dequantize(t, path: str) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise LoadError(f"{path}: tensor '{t.name}' has quantization type {t.tensor_type.name}, "
                        "which the gguf package cannot dequantize") from None
    except (ValueError, TypeError) as e:
        known = t.tensor_type in gguf.GGMLQuantizationType
        what = f"quantization type {t.tensor_type.name}" if known else "an unknown quantization type"
        raise LoadError(f"{path}: tensor '{t.name}' ({what}) could not be dequantized: {e}") from None


def load_gguf(path: str, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None,
              keep_blocks: frozenset[int] = frozenset()) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Returns (config, state dict in `dtype`, raw metadata for the tokenizer).

    Matrices whose ggml type is in `keep_blocks` come as QuantizedWeight (the file's bytes, rows un-permuted
    like the dense ones, in block_quant.to_kernel_layout's type), not dequantized. With keep_blocks, a block type
    outside it is dequantized to float32, which the log says once a type."""
    reader = open_reader(path)
    meta = read_metadata(reader)
    cfg = config_from_metadata(meta, path)
    family = registry.ARCHITECTURES[cfg.architecture]
    layer_names = {**_LAYER_NAMES, **family.gguf_tensors}
    state: dict[str, torch.Tensor] = {}
    dense_types: set[str] = set()  # block types keep_blocks lacks, dequantized (logged once each)
    for i, t in enumerate(reader.tensors):
        if m := _LAYER_RE.match(t.name):
            layer, part, kind = m.groups()
            if part not in layer_names:
                raise LoadError(f"{path}: unexpected tensor '{t.name}' for architecture '{cfg.architecture}'")
            name = f"layers.{layer}.{layer_names[part]}.{kind}"
        else:
            base, _, kind = t.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                if base == "rope_freqs":  # llama3 frequency factors: folded into the config below
                    continue
                raise LoadError(f"{path}: unexpected tensor '{t.name}'")
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        blocks = int(t.tensor_type) in keep_blocks and len(t.shape) == 2 and name.endswith(".weight")
        if keep_blocks and not blocks and int(t.tensor_type) not in _FLOAT_TYPES \
                and t.tensor_type.name not in dense_types:
            dense_types.add(t.tensor_type.name)
            log.warning("%s: tensors of type %s (first '%s') have no native kernel: dequantized to float32 at "
                        "load (4 bytes a weight)", path, t.tensor_type.name, t.name)
        # blocks: [rows, row bytes] as stored; a block never straddles rows, so rows permute like dense ones
        w = np.array(t.data) if blocks else _dequantize(t, path)
        w = w.reshape(int(t.shape[1]), -1) if blocks else \
            w.reshape([int(d) for d in reversed(t.shape)] if len(t.shape) > 1 else [-1])
        if family.unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif family.unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        if blocks:
            state[name] = to_kernel_layout(QuantizedWeight(
                int(t.tensor_type), torch.from_numpy(np.ascontiguousarray(w)), (int(t.shape[1]), int(t.shape[0]))))
        else:
            state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)
        if progress is not None:
            progress(i + 1, len(reader.tensors))
    if "lm_head.weight" not in state:
        if "embed_tokens.weight" not in state:
            raise LoadError(f"{path}: GGUF file has neither 'token_embd.weight' nor 'output.weight'")
        state["lm_head.weight"] = state["embed_tokens.weight"]
        cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        cfg = ModelConfig(**{**cfg.__dict__, "rope_scaling": {"rope_type": "factors",
                                                              "factors": _dequantize(rope_freqs, path).tolist()}})
    return cfg, state, meta
