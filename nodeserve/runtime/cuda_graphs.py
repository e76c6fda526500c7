"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, all in one graph memory pool.

A decode batch of n sequences runs in the graph of the smallest bucket >= n, padded with rows that write
their (ignored) K/V into a scratch page this object owns; batches above the largest bucket run eagerly.
Per step the host copies inputs into static buffers, prepares the bucket's backend (FlashInfer's plan(), which
cannot be captured), and replays one graph of its forward() calls: no per-layer Python, which is what lets one
process drive many GPUs.
GPU-only, and used only with the FlashInfer backend; the bucket and padding logic is plain Python.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.flashinfer_backend import FlashInferAttention
from nodeserve.kv.reservation import reserve_padding_page

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """[1, 2, 4, 8, ..., max_batch]: powers of two below max_batch, then max_batch itself."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None (run eagerly) when it is above the largest."""
    return next((b for b in buckets if b >= batch), None)


def pad_decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int,
                     scratch_page: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Pads a decode-only step to `bucket` rows. Each padding row feeds token 0 at position 0, writes its K/V
    to slot 0 of `scratch_page` (which no sequence owns) and attends over that one slot."""
    n = meta.num_seqs
    pad = bucket - n
    if pad < 0 or meta.num_decodes != n:
        raise ValueError(f"cannot pad a step of {n} rows ({meta.num_decodes} decodes) to a bucket of {bucket}")
    if pad == 0:
        return input_ids, positions, meta

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)])

    tables = meta.page_tables_host if meta.page_tables_host is not None else meta.page_tables.tolist()
    page_tables = padded(meta.page_tables, 0)
    page_tables[n:, 0] = scratch_page
    padded_meta = dataclasses.replace(
        meta,
        slot_mapping=padded(meta.slot_mapping, scratch_page * meta.page_size),
        page_tables=page_tables,
        seq_lens=padded(meta.seq_lens, 1),
        query_lens=list(meta.query_lens) + [1] * pad,
        seq_lens_host=list(meta.seq_lens_host) + [1] * pad,
        num_decodes=bucket,
        page_tables_host=list(tables) + [[scratch_page]] * pad,
    )
    return padded(input_ids, 0), padded(positions, 0), padded_meta


class DecodeGraphs:
    """Captures the model's decode forward once per bucket (capture() at warm-up), replays it in run()."""

    def __init__(self, model, backend: FlashInferAttention, max_batch: int):
        """backend: the device's eager one; each bucket's graph-mode backend shares its pool and workspace (one step
        runs at a time per device)."""
        pool = self.pool = backend.pool
        self.model, self.device = model, pool.device
        self.buckets = graph_buckets(max_batch)
        self.scratch_page = reserve_padding_page(pool.manager)  # padding rows write their K/V here
        largest = self.buckets[-1]
        # Static inputs: every graph reads its first `bucket` rows of these.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.int64, device=self.device)
        # One backend per bucket: a graph-mode wrapper has a fixed batch size. FP8 scales are read at capture and
        # fixed in the graphs from then on.
        self.backends = {b: FlashInferAttention(pool, model.cfg, model.dtype, graph_batch_size=b,
                                                workspace=backend.workspace) for b in self.buckets}
        self.capture_stream: torch.cuda.Stream | None = None  # this device's own, made at capture()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bucket, hidden] per graph, in the shared pool
        self.captured_scales: tuple[list[float], list[float]] | None = None  # the pool's FP8 scales at capture

    def capture(self) -> None:
        """Captures every bucket, largest first so the smaller graphs reuse its memory in the shared pool."""
        mem_pool = torch.cuda.graph_pool_handle()
        self.captured_scales = (list(self.pool.k_scales), list(self.pool.v_scales))
        with torch.cuda.device(self.device):
            # A stream of this device for every capture and its warm-up pass: torch.cuda.graph's default capture
            # stream is made once, on whichever device was current at the first capture in the process, so a
            # second GPU's graphs would be captured on the first GPU's stream.
            self.capture_stream = torch.cuda.Stream(self.device)
            for bucket in reversed(self.buckets):
                meta = AttentionMetadata(
                    slot_mapping=self.slot_mapping[:bucket],
                    page_tables=torch.full((bucket, 1), self.scratch_page, dtype=torch.int64, device=self.device),
                    seq_lens=torch.ones(bucket, dtype=torch.int64, device=self.device),
                    query_lens=[1] * bucket, seq_lens_host=[1] * bucket, num_decodes=bucket,
                    page_size=self.pool.page_size, page_tables_host=[[self.scratch_page]] * bucket)
                self.slot_mapping[:bucket] = self.scratch_page * self.pool.page_size
                backend = self.backends[bucket]
                args = (self.input_ids[:bucket], self.positions[:bucket], backend)
                backend.prepare(meta)  # plan() outside the capture, like every replay's
                # One eager run on the capture stream first: lazy init (cuBLAS handles, JIT) must not be captured.
                side = self.capture_stream
                side.wait_stream(torch.cuda.current_stream(self.device))  # and the plan's copies
                with torch.cuda.stream(side):
                    self.model(*args)
                torch.cuda.current_stream(self.device).wait_stream(side)
                backend.prepare(meta)  # the eager run used up the prepared step; the capture is one more
                graph = torch.cuda.CUDAGraph()
                # thread_local: idle worker threads of other devices may touch CUDA meanwhile.
                with torch.cuda.graph(graph, pool=mem_pool, stream=side, capture_error_mode="thread_local"):
                    self.outputs[bucket] = self.model(*args)
                self.graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
        log.info("%s: captured decode graphs for batch sizes %s", self.device, self.buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only step, or None when it has to run eagerly."""
        bucket = bucket_for(meta.num_seqs, self.buckets)
        if bucket is None or bucket not in self.graphs:
            return None
        if self.captured_scales != (self.pool.k_scales, self.pool.v_scales):
            raise RuntimeError("the KV pool's FP8 scales changed after the decode graphs were captured")
        ids, pos, padded = pad_decode_batch(input_ids, positions, meta, bucket, self.scratch_page)
        self.input_ids[:bucket].copy_(ids)
        self.positions[:bucket].copy_(pos)
        self.slot_mapping[:bucket].copy_(padded.slot_mapping)
        self.backends[bucket].prepare(padded)  # plan() on the host; the graph replays only run()
        self.graphs[bucket].replay()
        return self.outputs[bucket][:meta.num_seqs]
