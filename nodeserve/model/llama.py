"""The Llama-layout decoder (Llama 1/2/3, Mistral, Qwen2, SmolLM) over a paged KV cache, in plain PyTorch, with
what Qwen3 and Gemma 3 add to it switched on by their ModelConfig fields (model/registry.py says which).

Projections are nn.Linear, or QuantLinear for block-quantized weights (model/block_quant.py); the pointwise ops
(norms, SiLU-and-mul, RoPE) go through the replica's kernel set (nodeserve/model/ops.py), which each forward
passes down to the layers.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nodeserve.attention.base import AttentionBackend
from nodeserve.model import block_quant
from nodeserve.model.config import ModelConfig
from nodeserve.model.ops import Kernels, Rotary, TorchOps
from nodeserve.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)


class AllReduceFn(Protocol):
    """One rank's all-reduce (runtime/tp_group.py): sums x over the group in place, the same on every rank."""

    handle: int | None  # the native group the C decode layer reduces through; None: only this call does
    rank: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """The weight and eps; the math is the kernel set's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     ops: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one kernel where the set fuses them. May overwrite x and residual."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, device="meta")


def _project(linear: nn.Module, x: torch.Tensor, prompt_from: int | None) -> torch.Tensor:
    """linear(x); a block-quantized one learns where the prompt rows start (QuantLinear.forward)."""
    return linear(x, prompt_from) if isinstance(linear, block_quant.QuantLinear) else linear(x)


@functools.cache
def _say_fused_dense(types: tuple[int, ...]) -> None:
    """Logged once a process per mix: the operator sees why a quantized model holds float32 projections."""
    log.warning("projections in GGUF types %s have no lossless common block type: fused as float32 (4 bytes a "
                "weight)", "/".join(block_quant.type_name(t) for t in types))


def _fused(*linears: nn.Module) -> nn.Module:
    """One Linear whose output is the concatenation of the given ones' outputs (same input); block-quantized
    ones stay in their blocks when they share a format, else become float32."""
    if (fused := block_quant.fuse(list(linears))) is not None:
        return fused
    if types := tuple(m.qtype for m in linears if isinstance(m, block_quant.QuantLinear)):
        _say_fused_dense(types)
    linears = tuple(block_quant.dense(m) if isinstance(m, block_quant.QuantLinear) else m for m in linears)
    weight = torch.cat([m.weight for m in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if linears[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id  # which of the backend's pool layers holds this layer's K/V
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.attention_bias)
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.o_proj = _linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.qkv_proj: nn.Module | None = None  # set by fuse()
        if cfg.qk_norm:  # one weight over head_dim, shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """Replaces q/k/v with one [q; k; v] projection: one GEMM instead of three per layer."""
        self.qkv_proj = _fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rotary: Rotary, backend: AttentionBackend, ops: Kernels,
                prompt_from: int | None = None) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = _project(self.qkv_proj, x, prompt_from).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        if hasattr(self, "q_norm"):  # per head, before RoPE
            q = self.q_norm(q.reshape(-1, self.head_dim), ops).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim), ops).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, k)
        out = backend.forward(self.layer_id, q, k, v)  # [T, H, D]
        return _project(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), prompt_from)


# A prefill chunk's gate/up output is its biggest activation (1024 tokens x 2 x 1536 float32 = 12 MiB for
# SmolLM2); computed by blocks of rows it stays under memory.MMAP_THRESHOLD_BYTES, so no layer maps and faults in
# fresh pages for it, and no block that size settles in the C heap. Only on the block-quantized path: the exact
# path keeps transformers' one GEMM per projection.
MAX_MLP_ROWS = 256


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, ops: Kernels, prompt_from: int | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.hidden_act == "gelu_tanh":  # GeGLU (Gemma): transformers' op, no kernel set has it fused
            y = _project(gate_up, x, prompt_from)  # [T, 2I]
            act = F.gelu(y[:, :self.intermediate_size], approximate="tanh") * y[:, self.intermediate_size:]
        elif x.shape[0] <= MAX_MLP_ROWS or not isinstance(gate_up, block_quant.QuantLinear):
            act = ops.silu_and_mul(_project(gate_up, x, prompt_from))  # [T, 2I] -> [T, I]
        else:  # each block's SiLU straight into its rows of act (a cat of the blocks took 19 ms a 2k prompt)
            act = torch.empty(x.shape[0], self.intermediate_size, dtype=torch.float32,  # QuantLinear's outputs'
                              device=x.device)
            for start, y in zip(range(0, x.shape[0], MAX_MLP_ROWS),
                                gate_up.row_blocks(x, MAX_MLP_ROWS, prompt_from)):
                ops.silu_and_mul(y, out=act[start:start + y.shape[0]])
        return _project(self.down_proj, act, prompt_from)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        # the Llama layout's norm before the MLP; with sandwich norms (Gemma), the norm of attention's output
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich_norm = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rotary, backend, ops, prompt_from: int | None = None,
                all_reduce: AllReduceFn | None = None):
        # x: [T, hidden], the residual stream; this layer owns it (add_and_norm may update it in place).
        # Rows from prompt_from on are prompt tokens, before them the step's decode rows (None: not said).
        # all_reduce: on a tensor-parallel rank, o_proj's and down_proj's outputs are partial sums over its heads
        # and columns; summed over the group, every rank holds the same residual stream again.
        attn = self.self_attn(self.input_layernorm(x, ops), rotary, backend, ops, prompt_from)
        if all_reduce is not None:
            attn = all_reduce(attn)
        if self.sandwich_norm:
            attn = self.post_attention_layernorm(attn, ops)
            h, x = self.pre_feedforward_layernorm.add_and_norm(attn, x, ops)  # x += norm(attn); h = norm(x)
            mlp = self.mlp(h, ops, prompt_from)
            return x + self.post_feedforward_layernorm(mlp if all_reduce is None else all_reduce(mlp), ops)
        h, x = self.post_attention_layernorm.add_and_norm(attn, x, ops)  # x += attn; h = norm(x)
        mlp = self.mlp(h, ops, prompt_from)
        return x + (mlp if all_reduce is None else all_reduce(mlp))


class LlamaModel(nn.Module):
    """Parameters are named as in HF checkpoints, minus the leading "model."; lm_head is tied when the config says so."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight skips nn.Embedding's normal_() init, which on the meta device imports torch._dynamo (~1-2.5 s
        # of every start); the checkpoint's table replaces it anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # the windowed layers' own RoPE base, unscaled (Gemma 3), or None: every layer takes `rope`
        self.local_rope = None if cfg.rope_local_theta is None else \
            RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, None)
        self.ops: Kernels = TorchOps(self.rope)
        self.local_ops: Kernels | None = None if self.local_rope is None else TorchOps(self.local_rope)
        self.native_decoder: Callable | None = None  # decode-only steps in one native call per layer (CPU)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and a wide KV pool's) dtype; the norms are never quantized."""
        return self.norm.weight.dtype

    def use_kernels(self, make: Callable[[RotaryEmbedding], Kernels]) -> None:
        """Runs this replica's norms, SiLU-and-mul and RoPE with the kernel set make(rope) builds (once more for
        the windowed layers' RoPE where they have their own); call before capturing CUDA graphs."""
        self.ops = make(self.rope)
        self.local_ops = None if self.local_rope is None else make(self.local_rope)

    def fuse(self) -> None:
        """Fuses q/k/v and gate/up projections; call once the checkpoint's (unfused) weights are loaded."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                on_layer_done: Callable[[int], None] | None = None,
                before_layer: Callable[[int], None] | None = None,
                all_reduce: AllReduceFn | None = None) -> torch.Tensor:
        """input_ids, positions: [T], the step `backend` was prepared for. Returns hidden states [T, hidden].

        on_layer_done(i) is called once layer i's K/V is in the pool, so a transfer can start copying it
        while later layers still compute; before_layer(i) before layer i runs, so KV being loaded into the
        pool from another tier can land layer by layer while earlier layers compute. all_reduce: this model is
        one rank's shard of a tensor-parallel group (model/tensor_parallel.py; runtime/tp_group.py runs them).
        """
        ops = self.ops
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.cfg.embed_scale != 1.0:  # the scale rounded to x's dtype first, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        native_reduce = all_reduce is None or all_reduce.handle is not None  # the C layer reduces natively only
        if self.native_decoder is not None and before_layer is None and native_reduce and \
                self.native_decoder.takes(x, backend):
            return self.norm(self.native_decoder(x, positions, backend, on_layer_done, all_reduce), ops)
        rotary = ops.rotary(positions, x.dtype)
        local_rotary = rotary if self.local_ops is None else self.local_ops.rotary(positions, x.dtype)
        prompt_from = backend.meta.num_decodes if backend.meta is not None else None  # decodes come first
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, local_rotary if self.cfg.window(i) else rotary, backend, ops, prompt_from, all_reduce)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(x, ops)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()
