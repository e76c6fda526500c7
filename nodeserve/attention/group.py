"""A tensor-parallel group's attention: one backend per rank over its shard of the group's pool.

prepare(meta) keeps the step; each rank prepares its own backend in its own thread (runtime/tp_group.py), with
the step's tensors on its device. Layers attend per rank, through ranks[r].forward, never through the group.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from nodeserve.attention.base import AttentionBackend, AttentionMetadata
from nodeserve.kv.pool import KVPool


class GroupAttention:
    def __init__(self, pool: KVPool, ranks: Sequence[AttentionBackend]):
        self.pool, self.ranks = pool, list(ranks)
        self.meta: AttentionMetadata | None = None
        self.prompt_kernel = self.ranks[0].prompt_kernel

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def prepare_rank(self, rank: int) -> None:
        """Rank `rank`'s backend prepared for the kept step, from that rank's thread."""
        if self.meta is None:
            raise RuntimeError("attention forward() before prepare(): prepare(meta) once per step comes first")
        device = self.pool.shards[rank].device
        meta = self.meta
        if meta.slot_mapping.device != device:  # a group of GPUs: each rank reads the step from its own memory
            meta = replace(meta, slot_mapping=meta.slot_mapping.to(device), page_tables=meta.page_tables.to(device),
                           seq_lens=meta.seq_lens.to(device))
        self.ranks[rank].prepare(meta)

    def forward(self, layer_id, q, k, v):
        raise TypeError("a tensor-parallel group attends per rank: use ranks[r].forward")
