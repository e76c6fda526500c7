"""The FlashInfer attention backend (CUDA only): torch_ref's contract and pool layout, FlashInfer's paged kernels.

One plan per step: the first forward() of a step (layer 0) builds the page indices on the host and plans the
decode and prefill wrappers; every later layer of the step reuses that plan. FlashInfer's plan() copies its
inputs to the GPU and cannot be captured in a CUDA graph; run() can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.torch_ref import is_fp8, layer_scales, write_kv_scaled
from nodeserve.device import upload

if TYPE_CHECKING:
    from nodeserve.kv.pool import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partial results)


@dataclass
class PagedIndices:
    """FlashInfer's description of a slice of the batch, int32 tensors on the host. For sequence b:
      # its query rows are [qo_indptr[b], qo_indptr[b+1]) of the slice's q
      # its pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]], and the last one holds kv_last_page_len[b] tokens
    """

    qo_indptr: torch.Tensor         # [B + 1]
    kv_indptr: torch.Tensor         # [B + 1]
    kv_indices: torch.Tensor        # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B], each in [1, page_size]


def paged_indices(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], query_lens: Sequence[int],
                  page_size: int) -> PagedIndices:
    """Index tensors for sequences whose KV (after this step's write) is seq_lens[b] tokens on block_tables[b]."""
    qo, kv, indices, last = [0], [0], [], []
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
        num_pages = -(-seq_len // page_size)
        if len(table) < num_pages:
            raise ValueError(f"a block table of {len(table)} pages cannot hold {seq_len} tokens")
        indices.extend(table[:num_pages])
        kv.append(kv[-1] + num_pages)
        qo.append(qo[-1] + q_len)
        last.append(seq_len - (num_pages - 1) * page_size)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedIndices(i32(qo), i32(kv), i32(indices), i32(last))


def for_plan(indices: PagedIndices, device: torch.device) -> PagedIndices:
    """The tensors as plan() takes them without a host sync on a GPU: indptrs and last_page_len stay on the host
    (plan() reads them there) but pinned, so its copies of them do not block; kv_indices, which plan() only copies,
    goes to the GPU first from pinned memory, since plan() copies a host kv_indices into a CUDA-graph buffer with
    non_blocking=False (FlashInfer 0.7.2), a wait for all queued GPU work every decode step."""
    if device.type != "cuda":
        return indices
    return PagedIndices(indices.qo_indptr.pin_memory(), indices.kv_indptr.pin_memory(),
                        upload(indices.kv_indices, device), indices.kv_last_page_len.pin_memory())


def _recorded_cuda_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def split_indices(meta: AttentionMetadata) -> tuple[PagedIndices | None, PagedIndices | None]:
    """(decode rows [0, num_decodes), prefill rows [num_decodes, B)) of a step; None for an empty part.
    Prefill qo_indptr counts from the first prefill token, i.e. it indexes q[num_decodes:]."""
    tables = meta.block_tables_host if meta.block_tables_host is not None else meta.block_tables.tolist()
    nd, b = meta.num_decodes, meta.num_seqs

    def part(lo: int, hi: int) -> PagedIndices | None:
        if lo == hi:
            return None
        return paged_indices(tables[lo:hi], meta.seq_lens_host[lo:hi], meta.query_lens[lo:hi], meta.page_size)

    return part(0, nd), part(nd, b)


class FlashInferAttention:
    """Decodes go through BatchDecodeWithPagedKVCacheWrapper, prefill chunks (whole prompts, and chunks
    extending a cached prefix) through BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask puts
    the queries at the end of the sequence, as torch_ref does.

    graph_batch_size: build a decode-only backend for one CUDA graph bucket, whose wrapper keeps its index
    tensors in fixed buffers (max_num_pages bounds the pages one step may index).
    workspace: share another backend's float workspace; safe when both run in turn on one stream.
    FP8 pools: K/V are quantized with the bound pool's per-layer scales, and the same scales go to run() as
    Python floats, which a captured CUDA graph keeps: calibrate before capturing (engine/warmup.py).
    """

    def __init__(self, device: torch.device, graph_batch_size: int | None = None, max_num_pages: int = 0,
                 workspace: torch.Tensor | None = None):
        import flashinfer  # optional dependency ([cuda] extra); its kernels and wrappers need a GPU

        self.device = device
        self.kv_pool: KVPool | None = None  # whose per-layer FP8 scales forward() uses (ModelRunner binds it)
        self._meta: AttentionMetadata | None = None
        # plan() fills a pinned host buffer and copies it to the GPU asynchronously: planning again before that
        # copy has run would overwrite the previous step's plan. An event after each plan, waited on before the next
        # (steps that do not sample, like intermediate prefill chunks, never sync otherwise).
        self._record_plan_event = (lambda: _recorded_cuda_event(device)) if device.type == "cuda" else (lambda: None)
        self._plan_event = None
        self.workspace = workspace if workspace is not None else \
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        graph = {}
        if graph_batch_size is not None:
            graph = dict(use_cuda_graph=True,
                         paged_kv_indptr_buffer=torch.zeros(graph_batch_size + 1, dtype=torch.int32, device=device),
                         paged_kv_indices_buffer=torch.zeros(max_num_pages, dtype=torch.int32, device=device),
                         paged_kv_last_page_len_buffer=torch.zeros(graph_batch_size, dtype=torch.int32,
                                                                   device=device))
        # Tensor cores: the prefill-kernel decode path takes any GQA group size (SmolLM2's is 3) and is the
        # faster one for groups of 4 and more.
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True,
                                                                    **graph)
        self.prefill = None if graph_batch_size is not None else \
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def plan(self, meta: AttentionMetadata, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """Plans both wrappers for this step; forward() then runs every layer on that plan."""
        decode, prefill = (None if part is None else for_plan(part, self.device) for part in split_indices(meta))
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=q_dtype, sm_scale=scale)
        if self._plan_event is not None:
            self._plan_event.synchronize()  # the previous plan's copies have run: its host buffer is free
        if decode is not None:
            self.decode.plan(decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, num_qo_heads,
                             num_kv_heads, head_dim, meta.page_size, pos_encoding_mode="NONE", **common)
        if prefill is not None:
            if self.prefill is None:
                raise ValueError("a CUDA-graph decode backend cannot run prefill chunks")
            self.prefill.plan(prefill.qo_indptr, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len,
                              num_qo_heads, num_kv_heads, head_dim, meta.page_size, causal=True, **common)
        self._plan_event = self._record_plan_event()
        self._meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D]; returns [T, H, D]."""
        if meta is not self._meta:  # layer 0 of a new step (holding the old meta keeps its id from being reused)
            self.plan(meta, q.shape[1], k.shape[1], q.shape[2], q.dtype, kv_layer.dtype, scale)
        k_scale, v_scale = layer_scales(self.kv_pool, kv_layer)
        write_kv_scaled(kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if is_fp8(kv_layer) else {}
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self.decode.run(q, kv_layer, **scales)
        if nd == 0:
            return self.prefill.run(q, kv_layer, **scales)
        out = torch.empty_like(q)
        out[:nd] = self.decode.run(q[:nd], kv_layer, **scales)
        out[nd:] = self.prefill.run(q[nd:], kv_layer, **scales)
        return out
