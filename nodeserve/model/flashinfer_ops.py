"""FlashInfer's fused RMSNorm, add+RMSNorm, SiLU-and-mul and RoPE kernels as a kernel set (nodeserve/model/ops.py).

CUDA only, float16/bfloat16 only (FlashInfer's kernels dispatch on those), and flashinfer is imported when the
set is built, never at import time. Every call is capturable in a CUDA graph: no host syncs, and the RoPE
table is allocated here, before any capture.
"""

from __future__ import annotations

import torch

from nodeserve.model.rope import RotaryEmbedding

DTYPES = (torch.float16, torch.bfloat16)


class FlashInferRotary:
    def __init__(self, apply_inplace, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
        self._apply_inplace = apply_inplace
        self.positions = positions          # [T], int64 or int32, contiguous
        self.cos_sin_cache = cos_sin_cache  # [max_positions, D] float32

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KH, D], typically views into the fused qkv output, so rows are strided. The
        # kernel reads each tensor's row and head strides and needs only the last dim contiguous: it rotates
        # in place without copies. It wants [T, heads * D]; merging heads and D is a view for such tensors.
        t, d = q.shape[0], q.shape[-1]
        self._apply_inplace(self.positions, q.view(t, -1), k.view(t, -1), d, self.cos_sin_cache, is_neox=True)
        return q, k


class FlashInferOps:
    """Kernel set for one replica: rope's cos/sin table for positions [0, max_positions) lives on `device`.

    is_neox=True is the rotate-half layout TorchOps uses (dims i and i + D/2 rotate together); the table is
    built from rope's inv_freq, so llama3 / linear scaling carries over.
    """

    def __init__(self, rope: RotaryEmbedding, max_positions: int, device: torch.device):
        from flashinfer.activation import silu_and_mul
        from flashinfer.norm import fused_add_rmsnorm, rmsnorm
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

        self._rmsnorm, self._fused_add_rmsnorm = rmsnorm, fused_add_rmsnorm
        self._silu_and_mul = silu_and_mul
        self._rope_inplace = apply_rope_with_cos_sin_cache_inplace
        self.cos_sin_cache = rope.cos_sin_cache(max_positions, device)  # [max_positions, D] float32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # In place, one kernel: residual += x, then x = rms_norm(residual).
        self._fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._silu_and_mul(gate_up, out)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> FlashInferRotary:
        return FlashInferRotary(self._rope_inplace, positions, self.cos_sin_cache)
