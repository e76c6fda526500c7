"""nodeserve.attention: pick the attention backend for a device (devices.attention)."""

from __future__ import annotations

import importlib

import torch

from nodeserve.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "flashinfer")


def flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception:  # ImportError, or a broken install failing inside its own import
        return False
    return True


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """"torch": the PyTorch reference; "flashinfer": FlashInfer (CUDA only); "auto": FlashInfer on a CUDA
    device when it imports, the reference otherwise. Raises ConfigError when the choice cannot run here."""
    from nodeserve.config import ConfigError

    if name not in BACKENDS:
        raise ConfigError(f"'devices.attention' must be one of {', '.join(BACKENDS)}, got {name!r}")
    use_flashinfer = name == "flashinfer" or (name == "auto" and device.type == "cuda" and flashinfer_importable())
    if not use_flashinfer:
        from nodeserve.attention.torch_ref import TorchAttention

        return TorchAttention()
    if device.type != "cuda":
        raise ConfigError(f"'devices.attention' = \"flashinfer\" needs a CUDA device, not {device}; "
                          "use \"auto\" or \"torch\"")
    if not flashinfer_importable():
        raise ConfigError("'devices.attention' = \"flashinfer\" but flashinfer does not import; install it with "
                          "pip install -e '.[cuda]', or use \"auto\"")
    from nodeserve.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(device)
