"""Hugging Face checkpoint directories: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from nodeserve.model.config import LoadError, ModelConfig

# HF architectures class name -> our layout name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def config_from_hf(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise LoadError(f"{path}: no config.json in this checkpoint directory")
    try:
        with open(config_path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{config_path}: cannot read it ({e})") from None
    names = c.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[n] for n in names if n in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise LoadError(f"{path}: unsupported architecture {names or c.get('model_type')} "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    num_heads = c["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        rope_scaling=c.get("rope_scaling") or _rope_parameters_scaling(c),
    )


def _rope_parameters_scaling(c: dict) -> dict | None:
    # transformers >= 5 writes rope settings under "rope_parameters" instead of "rope_scaling".
    params = c.get("rope_parameters") or {}
    if params.get("rope_type", "default") == "default":
        return None
    return params


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise LoadError(f"{path}: shard {os.path.basename(missing[0])} listed in the index is missing")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise LoadError(f"{path}: no *.safetensors files in this checkpoint directory")
    return files


def load_hf(path: str, dtype: torch.dtype,
            progress: Callable[[int, int], None] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    cfg = config_from_hf(path)
    state: dict[str, torch.Tensor] = {}
    files = _safetensors_files(path)
    for i, file in enumerate(files):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if "rotary_emb.inv_freq" in key:
                        continue
                    state[key] = f.get_tensor(name).to(dtype)
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"{file}: cannot read safetensors file, it is truncated or corrupt ({e})") from None
        if progress is not None:
            progress(i + 1, len(files))
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings and "embed_tokens.weight" not in state:
            raise LoadError(f"{path}: checkpoint has neither lm_head.weight nor embed_tokens.weight")
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return cfg, state
