"""Rotary position embeddings: inverse frequencies (with Llama-3 / linear scaling) and the rotation."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32, computed the way transformers does so that outputs match exactly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "factors":  # llama.cpp's rope_freqs tensor: the llama3 scaling, precomputed per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`; short ones kept; the band between is interpolated.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope_scaling type '{kind}' (supported: default, linear, llama3)")


class RotaryEmbedding:
    """Applies RoPE in the rotate-half layout that HF checkpoints use (GGUF Q/K rows are un-permuted at load).

    A plain object, not an nn.Module, so model.to(device) leaves inv_freq on the CPU: each device gets its own
    copy on first use instead (a copy per step would be a host-to-device transfer in every forward, and one
    that a CUDA graph cannot capture). The first forward on a device is always eager: warm-up, and the eager
    run DecodeGraphs does before each capture.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)  # [D/2], on the CPU
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {self.inv_freq.device: self.inv_freq}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """inv_freq [D/2] on `device`, copied there once."""
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[device] = self.inv_freq.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq_on(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                          # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_cache(self, max_positions: int, device: torch.device) -> torch.Tensor:
        """[max_positions, D] float32: row p is cos of position p's angles, then their sin (the table that
        FlashInfer's and vLLM's rope kernels index by position). Same angles as cos_sin(), so any rope scaling
        in inv_freq carries over."""
        positions = torch.arange(max_positions, device=device)
        freqs = positions.float()[:, None] * self.inv_freq_on(device)[None, :]  # [P, D/2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos/sin: [T, D]
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
