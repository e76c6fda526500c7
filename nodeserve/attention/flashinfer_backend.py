"""The FlashInfer attention backend (CUDA only): torch_ref's contract and pool layout, FlashInfer's paged kernels.

One plan per step and window: prepare() builds the page indices on the host and plans the decode and prefill
wrappers; every layer's forward() runs on its window's plan. window_left is a plan() argument, so layers with
different sliding windows (Gemma 3: five of 512 to one global) need wrappers of their own, one pair per distinct
window. FlashInfer's plan() copies its inputs to the GPU and cannot be captured in a
CUDA graph; run() can, so the graph path prepares outside capture and replay (runtime/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from nodeserve.attention.base import AttentionMetadata, KVPoolLike, ModelConfigLike, PagedAttention
from nodeserve.attention.torch_ref import write_kv_scaled
from nodeserve.device import upload

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


def paged_indices(page_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], query_lens: Sequence[int],
                  page_size: int, window: int = 0) -> PagedIndices:
    """Index tensors for sequences whose KV (after this step's write) is seq_lens[b] tokens on page_tables[b].
    window > 0: each sequence's pages from the one holding its first query's window start: the kernel never reads
    the pages before (they may be freed), and since positions count from the first page listed and the masks
    (causal, window_left) only compare them, dropping whole pages shifts nothing."""
    qo, kv, indices, last = [0], [0], [], []
    for table, seq_len, q_len in zip(page_tables, seq_lens, query_lens):
        num_pages = -(-seq_len // page_size)
        if len(table) < num_pages:
            raise ValueError(f"a page table of {len(table)} pages cannot hold {seq_len} tokens")
        first_page = max(0, seq_len - q_len - window + 1) // page_size if window else 0
        indices.extend(table[first_page:num_pages])
        kv.append(kv[-1] + num_pages - first_page)
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


def split_indices(meta: AttentionMetadata, window: int = 0) -> tuple[PagedIndices | None, PagedIndices | None]:
    """(decode rows [0, num_decodes), prefill rows [num_decodes, B)) of a step, for layers of sliding window
    `window` (0: none); None for an empty part. Prefill qo_indptr counts from the first prefill token, i.e. it
    indexes q[num_decodes:]."""
    tables = meta.page_tables_host if meta.page_tables_host is not None else meta.page_tables.tolist()
    nd, b = meta.num_decodes, meta.num_seqs

    def part(lo: int, hi: int) -> PagedIndices | None:
        if lo == hi:
            return None
        return paged_indices(tables[lo:hi], meta.seq_lens_host[lo:hi], meta.query_lens[lo:hi], meta.page_size,
                             window)

    return part(0, nd), part(nd, b)


class FlashInferAttention(PagedAttention):
    """Decodes go through BatchDecodeWithPagedKVCacheWrapper, prefill chunks (whole prompts, and chunks
    extending a cached prefix) through BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask puts
    the queries at the end of the sequence, as torch_ref does.

    dtype: the model's activations' (q's and the output's); the pool's dtype is the KV's.
    graph_batch_size: build a decode-only backend for one CUDA graph bucket, whose wrapper keeps its index
    tensors in fixed buffers (the pool's pages, plus one scratch page per padding row, bound what a step indexes).
    workspace: share another backend's float workspace; safe when both run in turn on one stream.
    FP8 pools: K/V are quantized with each layer's scales, and the same scales go to run() as Python floats,
    which a captured CUDA graph keeps: calibrate before capturing (runtime/warmup.py).
    Sliding windows: decode[w] and prefill[w] serve the layers of window w (0: none), planned with
    window_left = w - 1 (FlashInfer's window is inclusive on the left: query i sees keys i - window_left .. i) over
    the pages from the window's first on. The wrappers share the float workspace: they run in turn on one stream.
    """

    prompt_kernel = "flashinfer"

    def __init__(self, pool: KVPoolLike, cfg: ModelConfigLike, dtype: torch.dtype, graph_batch_size: int | None = None,
                 workspace: torch.Tensor | None = None):
        import flashinfer  # optional dependency ([cuda] extra); its kernels and wrappers need a GPU

        super().__init__(pool)
        device = self.device = pool.device
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.dtype, self.scale = dtype, cfg.softmax_scale
        self.windows = [cfg.window(i) for i in range(len(pool.layers))]
        # plan() fills a pinned host buffer and copies it to the GPU asynchronously: planning again before that
        # copy has run would overwrite the previous step's plan. An event after each plan, waited on before the next
        # (steps that do not sample, like intermediate prefill chunks, never sync otherwise).
        self._record_plan_event = (lambda: _recorded_cuda_event(device)) if device.type == "cuda" else (lambda: None)
        self._plan_event = None
        self.workspace = workspace if workspace is not None else \
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

        def graph_buffers() -> dict:
            """A CUDA-graph decode wrapper's own index buffers (each wrapper's plan() fills its own)."""
            if graph_batch_size is None:
                return {}
            # Pages may repeat within a step (requests sharing a cached prefix list the same pages), so the index
            # buffer is sized for every row at the model's longest context, not for the pool: ~128 KiB at 64 rows.
            max_num_pages = graph_batch_size * -(-cfg.max_position_embeddings // pool.page_size) + graph_batch_size
            return dict(use_cuda_graph=True,
                        paged_kv_indptr_buffer=torch.zeros(graph_batch_size + 1, dtype=torch.int32, device=device),
                        paged_kv_indices_buffer=torch.zeros(max_num_pages, dtype=torch.int32, device=device),
                        paged_kv_last_page_len_buffer=torch.zeros(graph_batch_size, dtype=torch.int32,
                                                                  device=device))
        windows = sorted(set(self.windows))
        # Tensor cores: the prefill-kernel decode path takes any GQA group size (SmolLM2's is 3) and is the
        # faster one for groups of 4 and more.
        self.decode = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True,
                                                                        **graph_buffers()) for w in windows}
        self.prefill = None if graph_batch_size is not None else \
            {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for w in windows}

    def prepare(self, meta: AttentionMetadata) -> None:
        """Plans the decode and prefill wrappers of every window for this step; forward() then runs each layer on
        its window's plan."""
        if meta.num_decodes < meta.num_seqs and self.prefill is None:
            raise ValueError("a CUDA-graph decode backend cannot run prefill chunks")
        if self._plan_event is not None:
            self._plan_event.synchronize()  # the previous plan's copies have run: its host buffers are free
        for window, decode_wrapper in self.decode.items():
            # windowed layers read their own pages where the pool keeps them apart (kv/window.py)
            decode, prefill = (None if part is None else for_plan(part, self.device)
                               for part in split_indices(meta.for_window() if window else meta, window))
            common = dict(q_data_type=self.dtype, kv_data_type=self.pool.dtype, o_data_type=self.dtype,
                          sm_scale=self.scale, window_left=window - 1 if window else -1)
            if decode is not None:
                decode_wrapper.plan(decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, *self.heads,
                                    meta.page_size, pos_encoding_mode="NONE", **common)
            if prefill is not None and self.prefill is not None:
                self.prefill[window].plan(prefill.qo_indptr, prefill.kv_indptr, prefill.kv_indices,
                                          prefill.kv_last_page_len, *self.heads, meta.page_size, causal=True,
                                          **common)
        self._plan_event = self._record_plan_event()
        super().prepare(meta)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KH, D]; returns [T, H, D]."""
        meta, kv_layer = self.step_for(layer_id), self.pool.layers[layer_id]
        k_scale, v_scale = self.scales(layer_id)
        write_kv_scaled(kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.pool.is_fp8 else {}
        window, nd = self.windows[layer_id], meta.num_decodes
        decode = self.decode[window]
        if nd == q.shape[0]:
            return decode.run(q, kv_layer, **scales)
        if self.prefill is None:  # prepare() refused this step already; a stale plan must not run either
            raise ValueError("a CUDA-graph decode backend cannot run prefill chunks")
        prefill = self.prefill[window]
        if nd == 0:
            return prefill.run(q, kv_layer, **scales)
        out = torch.empty_like(q)
        out[:nd] = decode.run(q[:nd], kv_layer, **scales)
        out[nd:] = prefill.run(q[nd:], kv_layer, **scales)
        return out
