"""The reference attention backend: paged KV in plain PyTorch. Runs on CPU and CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nodeserve.attention.base import AttentionMetadata


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KH, D] each) into the pool at the given flat slots."""
    page_size = kv_layer.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    kv_layer[pages, 0, offsets] = k
    kv_layer[pages, 1, offsets] = v


def gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one or more sequences: block_table [B, P] -> ([B, length, KH, D], [B, length, KH, D])."""
    b, num_pages = block_table.shape
    kv = kv_layer[block_table]  # [B, P, 2, page_size, KH, D]
    kv = kv.transpose(1, 2).reshape(b, 2, num_pages * kv_layer.shape[2], *kv_layer.shape[3:])
    return kv[:, 0, :length], kv[:, 1, :length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float) -> torch.Tensor:
    """q [B, Lq, H, D], k/v [B, Lk, KH, D] -> [B, Lq, H, D]; grouped-query heads are expanded like HF's repeat_kv."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


class TorchAttention:
    """Decodes are batched in one padded SDPA call; each prefill chunk runs alone so no one pads to the longest prompt."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_layer, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_host[:nd])
            num_pages = -(-max_len // meta.page_size)
            kd, vd = gather_kv(kv_layer, meta.block_tables[:nd, :num_pages], max_len)  # [nd, L, KH, D]
            positions = torch.arange(max_len, device=q.device)
            mask = (positions[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]  # [nd, 1, 1, L]
            out[:nd] = attend(q[:nd, None], kd, vd, mask, False, scale)[:, 0]
        start = nd
        for b in range(nd, meta.num_seqs):
            q_len, seq_len = meta.query_lens[b], meta.seq_lens_host[b]
            num_pages = -(-seq_len // meta.page_size)
            kp, vp = gather_kv(kv_layer, meta.block_tables[b:b + 1, :num_pages], seq_len)
            qp = q[None, start:start + q_len]  # [1, q_len, H, D]
            if q_len == seq_len:
                out[start:start + q_len] = attend(qp, kp, vp, None, True, scale)[0]
            else:
                # Query i sits at position (seq_len - q_len + i) and sees every key up to and including it.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                k_pos = torch.arange(seq_len, device=q.device)
                mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, q_len, seq_len]
                out[start:start + q_len] = attend(qp, kp, vp, mask, False, scale)[0]
            start += q_len
        return out
