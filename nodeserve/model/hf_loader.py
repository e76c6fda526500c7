"""Hugging Face checkpoint directories: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from nodeserve.model import registry
from nodeserve.model.config import LoadError, ModelConfig, config_from_hf


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
    plus_one = registry.ARCHITECTURES[cfg.architecture].norm_plus_one
    state: dict[str, torch.Tensor] = {}
    files = _safetensors_files(path)
    for i, file in enumerate(files):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if "rotary_emb.inv_freq" in key:
                        continue
                    tensor = f.get_tensor(name)
                    if plus_one and key.endswith("norm.weight"):  # computed as 1 + w (float32, as HF does)
                        tensor = 1.0 + tensor.float()
                    state[key] = tensor.to(dtype)
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
