"""The Llama-layout decoder (Llama 1/2/3, Mistral, Qwen2, SmolLM) over a paged KV cache, in plain PyTorch."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nodeserve.attention.base import AttentionBackend, AttentionMetadata
from nodeserve.model.config import ModelConfig
from nodeserve.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, device="meta")


def _fused(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of the given ones' outputs (same input)."""
    weight = torch.cat([m.weight for m in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if linears[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.attention_bias)
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.o_proj = _linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> None:
        """Replaces q/k/v with one [q; k; v] projection: one GEMM instead of three per layer."""
        self.qkv_proj = _fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = backend.forward(q, k, v, kv_layer, meta, self.scale)    # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_layer, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Parameters are named as in HF checkpoints, minus the leading "model."; lm_head is tied when the config says so."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def fuse(self) -> None:
        """Fuses q/k/v and gate/up projections; call once the checkpoint's (unfused) weights are loaded."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[torch.Tensor], backend: AttentionBackend,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. Returns hidden states [T, hidden].

        on_layer_done(i) is called once layer i's K/V is in the pool, so a transfer can start copying it
        while later layers still compute.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_layers[i], meta, backend)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()
