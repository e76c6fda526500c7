"""Per-step attention metadata and the contract every attention backend implements."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch


class KVPoolLike(Protocol):
    """What attention reads of a kv.pool.KVPool, declared here since kv is a layer above attention."""

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def page_size(self) -> int: ...
    @property
    def layers(self) -> Sequence[torch.Tensor]: ...
    @property
    def is_fp8(self) -> bool: ...
    @property
    def k_scales(self) -> Sequence[float]: ...
    @property
    def v_scales(self) -> Sequence[float]: ...
    @property
    def window_layers(self) -> frozenset[int]:
        """Layers whose K/V lie in window pages (kv/window.py): they read AttentionMetadata.for_window()."""
        ...


class ModelConfigLike(Protocol):
    """What attention reads of a model.config.ModelConfig, declared here since model is a layer above attention."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def softmax_scale(self) -> float: ...

    def window(self, layer: int) -> int:
        """How many most recent positions layer `layer` attends to, the query's own included; 0: all of them."""
        ...


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built on the host by the worker and passed down explicitly.

    The batch is ordered decodes first: sequences [0, num_decodes) have exactly one query token each,
    the rest are prefill chunks. For sequence b:
      # [0, seq_lens[b] - query_lens[b]) is KV already in the pool (cached context)
      # [seq_lens[b] - query_lens[b], seq_lens[b]) is the KV this step writes
    """

    slot_mapping: torch.Tensor    # [T] int64: page * page_size + offset of each new token's K/V
    page_tables: torch.Tensor    # [B, max_pages] int64, rows padded with page 0 (never read past seq_len)
    seq_lens: torch.Tensor        # [B] int64, KV length after this step
    query_lens: list[int]         # [B] on the host
    seq_lens_host: list[int]      # [B] on the host
    num_decodes: int
    page_size: int
    # [B] page lists on the host, when the builder has them: FlashInfer plans from host indices, and reading
    # page_tables back from a GPU would cost a sync per step.
    page_tables_host: Sequence[Sequence[int]] | None = None
    # The windowed layers' slots and pages where the pool keeps them apart (kv/window.py), else None. Their
    # tables hold page 0 where a sequence holds no page (before its window: never read).
    window_slot_mapping: torch.Tensor | None = None
    window_page_tables: torch.Tensor | None = None
    window_page_tables_host: Sequence[Sequence[int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def for_window(self) -> AttentionMetadata:
        """The step as the windowed layers see it: their own slots and pages where the pool keeps them apart."""
        if self.window_page_tables is None:
            return self
        return replace(self, slot_mapping=self.window_slot_mapping, page_tables=self.window_page_tables,
                       page_tables_host=self.window_page_tables_host, window_slot_mapping=None,
                       window_page_tables=None, window_page_tables_host=None)


class AttentionBackend(Protocol):
    """Attends over one device's paged KV pool. Pool layout per layer is FlashInfer's NHD:
    pool.layers[i] is [num_pages, 2, page_size, num_kv_heads, head_dim], K at [:, 0] and V at [:, 1].

    Lifecycle:
      - built once with its pool and what it needs of the model (heads, head_dim, the softmax scale, each layer's
        sliding window, dtype);
      - prepare(meta) once per step, before the model's forward and outside any CUDA-graph capture: whatever
        depends only on the step is built there (FlashInfer's plan(), torch_ref's decode groups);
      - forward(layer_id, q, k, v) for each layer of that step, in increasing layer order: writes the step's K/V
        into pool.layers[layer_id] (FP8 pools: quantized with that layer's k_scales / v_scales) and attends.
    forward() before any prepare(), or on a layer that already ran since the last prepare() (a new step that
    skipped it), raises instead of attending with a stale plan.

    Sliding windows (cfg.window(layer) > 0): a query at position i sees key j iff j <= i and i - j < window. Slots
    before the window of a step's earliest query of a sequence are never read, so their pages may be freed and
    reused (and hold anything, NaN included).
    """

    pool: KVPoolLike
    meta: AttentionMetadata | None  # the step prepare() was last given
    prompt_kernel: str              # how prompt chunks attend here, for the start-up log

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D]; returns [T, H, D]."""
        ...


class PagedAttention:
    """The lifecycle both backends share: their pool, the prepared step, and the check that forward() runs on it."""

    def __init__(self, pool: KVPoolLike) -> None:
        self.pool = pool
        self.meta: AttentionMetadata | None = None
        self.window_meta: AttentionMetadata | None = None  # meta as the pool's window_layers read it
        self._next_layer = 0  # the lowest layer that has not run on `meta`

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta, self.window_meta, self._next_layer = meta, meta.for_window(), 0

    def step_for(self, layer_id: int) -> AttentionMetadata:
        """The prepared step's metadata, for a layer that has not run on it yet."""
        if self.meta is None:
            raise RuntimeError("attention forward() before prepare(): prepare(meta) once per step comes first")
        if layer_id < self._next_layer:
            raise RuntimeError(f"layer {layer_id} already ran on the prepared step: a new step needs prepare(meta)")
        self._next_layer = layer_id + 1
        return self.window_meta if layer_id in self.pool.window_layers else self.meta  # type: ignore[return-value]

    def scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer: the pool's for FP8, 1.0 for a wide pool (which stores values as they are)."""
        if not self.pool.is_fp8:
            return 1.0, 1.0
        return self.pool.k_scales[layer_id], self.pool.v_scales[layer_id]
