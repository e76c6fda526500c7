"""nodeserve.attention: pick the attention backend for a device (devices.attention)."""

from __future__ import annotations

import importlib

import torch

from nodeserve.attention.base import AttentionBackend, KVPoolLike, ModelConfigLike

BACKENDS = ("auto", "torch", "flashinfer")


def flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception:  # ImportError, or a broken install failing inside its own import
        return False
    return True


def auto_fallback(name: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why "auto" runs the PyTorch reference (and so no CUDA graphs) on a CUDA device, or None when it does not:
    said once at start and in /health, since a GPU host without FlashInfer is otherwise slow without a word."""
    if name != "auto" or device.type != "cuda":
        return None
    if dtype == torch.float32:
        return ("the model is float32 and FlashInfer has no float32 kernels, so CUDA devices run the PyTorch reference "
                "attention without CUDA graphs; set model.dtype = \"bfloat16\" (or \"auto\") for FlashInfer")
    if not flashinfer_importable():
        return ("flashinfer does not import, so CUDA devices run the PyTorch reference attention without CUDA "
                "graphs; install it with pip install -e '.[cuda]'")
    return None


def make_backend(name: str, pool: KVPoolLike, cfg: ModelConfigLike, dtype: torch.dtype,
                 prompt_attention: str = "float32") -> AttentionBackend:
    """The backend over `pool` for a model of config `cfg` whose activations are `dtype`. "torch": the PyTorch
    reference; "flashinfer": FlashInfer (CUDA only, bf16/fp16 models); "auto": FlashInfer on a CUDA device when it
    imports and the model is not float32, the reference otherwise. prompt_attention (model.prompt_attention, as
    Config.prompt_attention resolves it): "bfloat16" / "auto", the reference's native prefill kernel multiplies in
    bf16 where the CPU can (elsewhere it changes nothing). Raises ConfigError when the choice cannot run here."""
    from nodeserve.config import FLASHINFER_FLOAT32, ConfigError

    device = pool.device
    if name not in BACKENDS:
        raise ConfigError(f"'devices.attention' must be one of {', '.join(BACKENDS)}, got {name!r}")
    use_flashinfer = name == "flashinfer" or (name == "auto" and device.type == "cuda"
                                              and auto_fallback(name, device, dtype) is None)
    if not use_flashinfer:
        from nodeserve.attention.torch_ref import TorchAttention

        return TorchAttention(pool, cfg, dtype, prompt_attention)
    if device.type != "cuda":
        raise ConfigError(f"'devices.attention' = \"flashinfer\" needs a CUDA device, not {device}; "
                          "use \"auto\" or \"torch\"")
    if dtype == torch.float32:
        raise ConfigError(FLASHINFER_FLOAT32)
    if not flashinfer_importable():
        raise ConfigError("'devices.attention' = \"flashinfer\" but flashinfer does not import; install it with "
                          "pip install -e '.[cuda]', or use \"auto\"")
    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(pool, cfg, dtype)
