"""A tensor-parallel rank's shard of a LlamaModel, Megatron style; model/tp_layout.py says which heads and
columns each rank holds.

  q/k/v, gate/up   column-parallel: the rank's rows (its query and KV heads; its MLP columns)
  o_proj, down     row-parallel: the rank's input columns; their outputs are partial sums, all-reduced by the
                   group (LlamaModel.forward's all_reduce), one all-reduce each per layer
  norms, embedding replicated, and shared (the same tensors) with the full model: on CPU they cost no memory,
                   and every rank holds the same residual stream after each all-reduce
  lm_head          replicated (the whole model's, shared) and vocab-parallel: `lm_head_part` holds the rank's
                   vocabulary rows; a CPU group computes each slice on its rank (runtime/tp_group.py)

Sharded before fuse() and repack(), from the checkpoint's own tensors: GGUF blocks split on block boundaries
(rows anywhere; columns at multiples of 32), so a shard's weights are the file's bytes, never requantized.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nodeserve.model.tp_layout import RankShard, TPLayout, tp_layout, valid_degrees
from nodeserve.kernels import native
from nodeserve.model import block_quant
from nodeserve.model.config import LoadError, ModelConfig
from nodeserve.model.llama import LlamaModel, RMSNorm


def layout_for(cfg: ModelConfig, num_ranks: int) -> TPLayout:
    """The split of `cfg` over `num_ranks`: MLP columns in whole 32-column blocks where the size allows (a GGUF
    block never straddles two ranks). Raises LoadError naming the valid degrees."""
    unit = native.BLOCK_SIZE if cfg.intermediate_size % native.BLOCK_SIZE == 0 else 1
    try:
        return tp_layout(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, num_ranks, unit, cfg.vocab_size,
                         cfg.head_dim)
    except ValueError as e:
        raise LoadError(str(e)) from None


def shard_model(model: LlamaModel, shard: RankShard) -> LlamaModel:
    """Rank `shard`'s part of `model`, whose projections are not fused yet (load_model shards before fuse())."""
    cfg, d = model.cfg, model.cfg.head_dim
    rank_cfg = replace(cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                       intermediate_size=len(shard.mlp))
    out = LlamaModel(rank_cfg)
    out.embed_tokens, out.norm, out.lm_head, out.rope = model.embed_tokens, model.norm, model.lm_head, model.rope
    # its own copy: repack() keys matrices by data pointer, and rank 0's rows start where the whole table does
    out.lm_head_part = _rows(model.lm_head, shard.vocab, copy=True)
    q = range(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    for full, part in zip(model.layers, out.layers):
        for name, norm in full.named_children():  # every norm (Gemma's four too), shared
            if isinstance(norm, RMSNorm):
                setattr(part, name, norm)
        a, b = full.self_attn, part.self_attn
        if hasattr(a, "q_norm"):  # over head_dim: the same for every head
            b.q_norm, b.k_norm = a.q_norm, a.k_norm
        b.q_proj, b.k_proj, b.v_proj = _rows(a.q_proj, q), _rows(a.k_proj, kv), _rows(a.v_proj, kv)
        b.o_proj = _columns(a.o_proj, q)
        m, n = full.mlp, part.mlp
        n.gate_proj, n.up_proj = _rows(m.gate_proj, shard.mlp), _rows(m.up_proj, shard.mlp)
        n.down_proj = _columns(m.down_proj, shard.mlp)
    return out


def _rows(linear: nn.Module, rows: range, copy: bool = False) -> nn.Module:
    """Output features `rows` of a projection (a view of its weight unless `copy`, for block-quantized ones)."""
    bias = None if linear.bias is None else linear.bias.detach()[rows.start:rows.stop]
    if isinstance(linear, block_quant.QuantLinear):
        w = linear.quantized
        data = w.data[rows.start:rows.stop]
        return block_quant.QuantLinear(block_quant.QuantizedWeight(
            w.qtype, data.clone() if copy else data, (len(rows), w.shape[1])), bias)
    return _dense(linear.weight.detach()[rows.start:rows.stop], bias)  # dense: never repacked, a view will do


def _columns(linear: nn.Module, cols: range) -> nn.Module:
    """Input features `cols` of a row-parallel projection; its bias (none in these layouts) would be added once."""
    if linear.bias is not None:
        raise LoadError("a row-parallel projection (o_proj / down_proj) with a bias cannot be split yet")
    if isinstance(linear, block_quant.QuantLinear):
        w = linear.quantized
        if w.qtype not in native.BLOCK_LAYOUTS:  # sharded before repack(): the file's own block layout
            raise LoadError(f"GGUF type {w.qtype} cannot be split for tensor parallelism")
        block, per = native.BLOCK_LAYOUTS[w.qtype]
        if cols.start % block or cols.stop % block:
            raise LoadError(f"a tensor-parallel split at input column {cols.start}-{cols.stop} cuts a {block}-weight "
                            "GGUF block; choose a degree from the valid ones the log names, or "
                            "quantization = \"none\"")
        data = w.data[:, cols.start // block * per:cols.stop // block * per].contiguous()
        return block_quant.QuantLinear(block_quant.QuantizedWeight(w.qtype, data, (w.shape[0], len(cols))))
    return _dense(linear.weight.detach()[:, cols.start:cols.stop].contiguous(), None)


def _dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def shard_models(model: LlamaModel, num_ranks: int) -> list[LlamaModel]:
    layout = layout_for(model.cfg, num_ranks)
    return [shard_model(model, r) for r in layout.ranks]


__all__ = ["layout_for", "shard_model", "shard_models", "valid_degrees"]
