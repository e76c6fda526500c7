"""Per-step attention metadata and the contract every attention backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from nodeserve.kv.pool import KVPool


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built on the host by the worker and passed down explicitly.

    The batch is ordered decodes first: sequences [0, num_decodes) have exactly one query token each,
    the rest are prefill chunks. For sequence b:
      # [0, seq_lens[b] - query_lens[b]) is KV already in the pool (cached context)
      # [seq_lens[b] - query_lens[b], seq_lens[b]) is the KV this step writes
    """

    slot_mapping: torch.Tensor    # [T] int64: page * page_size + offset of each new token's K/V
    block_tables: torch.Tensor    # [B, max_pages] int64, rows padded with page 0 (never read past seq_len)
    seq_lens: torch.Tensor        # [B] int64, KV length after this step
    query_lens: list[int]         # [B] on the host
    seq_lens_host: list[int]      # [B] on the host
    num_decodes: int
    page_size: int
    # [B] page lists on the host, when the builder has them: FlashInfer plans from host indices, and reading
    # block_tables back from a GPU would cost a sync per step.
    block_tables_host: Sequence[Sequence[int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    """Writes this step's K/V into one layer's paged pool, then attends over it.

    Pool layout per layer is FlashInfer's NHD: [num_pages, 2, page_size, num_kv_heads, head_dim],
    index 0 of dim 1 holds K and index 1 holds V. forward() is called once per layer with the same `meta`
    object for every layer of a step, so a backend may plan once per step when it sees a new `meta`.
    FP8 pools: K/V are stored quantized with kv_pool's per-layer scales (KVPool.scales_of), 1.0 when unbound.
    """

    kv_pool: KVPool | None  # the pool whose layers forward() is given; ModelRunner binds it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D]; returns [T, H, D]."""
        ...
