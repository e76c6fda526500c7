"""The model's pointwise kernels (RMSNorm, SiLU-and-mul, RoPE) as a swappable kernel set, and its PyTorch one.

A LlamaModel replica runs these through whatever set it holds (LlamaModel.use_kernels): TorchOps by default,
a faster one on devices that have it (nodeserve/model/flashinfer_ops.py). TorchOps is transformers' math in
transformers' op order, so greedy float32 output matches it token for token.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from nodeserve.model.rope import RotaryEmbedding


class Rotary(Protocol):
    """RoPE prepared for one step's positions, applied to q and k in every layer of that step."""

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KH, D] -> the same shapes, rotated. May rotate in place and return q and k."""
        ...


class Kernels(Protocol):
    """What the model asks of a kernel set. Methods may reuse their inputs' memory: callers pass tensors they
    own and use only what is returned."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x), all [T, hidden]."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate_up[:, :I]) * gate_up[:, I:]; written into out (a contiguous [T, I]) when
        given, and out returned."""
        ...

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """positions: [T] on the model's device; dtype: q and k's."""
        ...


class TorchRotary:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [T, D] each

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return RotaryEmbedding.apply(q, self.cos, self.sin), RotaryEmbedding.apply(k, self.cos, self.sin)


class TorchOps:
    """Plain PyTorch, any device; never writes to its inputs."""

    def __init__(self, rope: RotaryEmbedding):
        self.rope = rope

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x  # rounded to the input dtype before the norm, as transformers does
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return torch.mul(F.silu(gate_up[..., :half]), gate_up[..., half:], out=out)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> TorchRotary:
        # cos/sin once per step, shared by every layer.
        return TorchRotary(*self.rope.cos_sin(positions, dtype))
