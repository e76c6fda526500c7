"""nodeserve's native CPU kernels (nodeserve/kernels) as a kernel set (nodeserve/model/ops.py): RMSNorm,
add+RMSNorm, SiLU-and-mul and RoPE in one call each, float32 on CPU.

A decode step at batch 1 is a few hundred small ops; as torch ops (4-10 per norm or rotation) their dispatch
cost rivals the weights' read time. Installed on replicas that serve block-quantized weights (the fast path);
the exact path ("quantization = none") keeps TorchOps, transformers' op order, so its greedy output matches
transformers token for token.
"""

from __future__ import annotations

import torch

from nodeserve.kernels.native import NativeKernels
from nodeserve.model.rope import RotaryEmbedding


class NativeRotary:
    def __init__(self, kernels: NativeKernels, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
        self.kernels, self.positions, self.cos_sin_cache = kernels, positions.contiguous(), cos_sin_cache

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.rope(q, k, self.positions, self.cos_sin_cache)  # in place on the fused qkv output's views
        return q, k


class NativeOps:
    def __init__(self, kernels: NativeKernels, rope: RotaryEmbedding, max_positions: int):
        self.kernels = kernels
        self.cos_sin_cache = rope.cos_sin_cache(max_positions, torch.device("cpu"))  # [max_positions, D]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x.contiguous(), residual.contiguous()
        self.kernels.add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up.contiguous(), out)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> NativeRotary:
        if positions.numel() and int(positions.max()) >= len(self.cos_sin_cache):  # C indexes the table unchecked
            raise ValueError(f"position {int(positions.max())} is past the RoPE table ({len(self.cos_sin_cache)})")
        return NativeRotary(self.kernels, positions.to(torch.int64), self.cos_sin_cache)
