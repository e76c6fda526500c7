"""ModelRunner: turns one step's sequence chunks into tensors, runs the model over a device's KV pool, returns logits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch

from nodeserve.attention.base import AttentionBackend, AttentionMetadata
from nodeserve.core.scheduler import SeqChunk
from nodeserve.device import upload
from nodeserve.model.llama import LlamaModel

if TYPE_CHECKING:
    from nodeserve.kv.manager import KVManager
    from nodeserve.kv.pool import KVPool
    from nodeserve.runtime.cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, graphs: DecodeGraphs | None = None):
        """backend: attention over this device's KV pool; graphs: CUDA graphs that decode-only steps replay when
        captured (CUDA + FlashInfer only)."""
        self.model, self.pool, self.backend, self.graphs = model, backend.pool, backend, graphs
        self.device = self.pool.device

    @property
    def kv(self) -> KVManager:
        """The pages of the pool it runs over (a KVPool's manager)."""
        return cast("KVPool", self.pool).manager

    def prepare(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Chunks must be ordered with every decode chunk first (SeqChunk.is_decode: those attend as one batched
        decode)."""
        page_size = self.pool.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_rows = [], [], []
        max_pages = max(len(c.page_table) for c in chunks)
        page_tables = torch.zeros(len(chunks), max_pages, dtype=torch.int64)
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, c.start_pos + n)
            positions.extend(pos)
            table = c.page_table
            slots.extend(table[p // page_size] * page_size + p % page_size for p in pos)
            page_tables[b, :len(table)] = torch.as_tensor(table, dtype=torch.int64)
            query_lens.append(n)
            seq_lens.append(c.start_pos + n)
            if c.want_logits:
                logits_rows.append(len(input_ids) - 1)
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].is_decode:
            num_decodes += 1
        window = self._window_tables(chunks) if self.pool.window_layers else (None, None, None)
        meta = AttentionMetadata(
            slot_mapping=upload(slots, self.device, torch.int64),
            page_tables=upload(page_tables, self.device),
            seq_lens=upload(seq_lens, self.device, torch.int64),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            page_size=page_size,
            page_tables_host=[c.page_table for c in chunks],
            window_slot_mapping=window[0], window_page_tables=window[1], window_page_tables_host=window[2],
        )
        ids = upload(input_ids, self.device, torch.int64)
        pos_t = upload(positions, self.device, torch.int64)
        return ids, pos_t, meta, logits_rows

    def _window_tables(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, list[Sequence[int]]]:
        """(slot_mapping, page_tables, host page lists) of the windowed layers' pages (SeqChunk.window_table); the
        tables hold page 0 where a sequence holds none (before its window: never read), the host lists -1."""
        page_size, slots, tables = self.pool.page_size, [], []
        for c in chunks:
            table = c.window_table
            if table is None:
                raise ValueError("a pool with window pages needs each chunk's window_table (kv/window.py)")
            slots.extend(table[p // page_size] * page_size + p % page_size
                         for p in range(c.start_pos, c.start_pos + len(c.token_ids)))
            tables.append(table)
        padded = torch.zeros(len(chunks), max(len(t) for t in tables), dtype=torch.int64)
        for b, t in enumerate(tables):
            padded[b, :len(t)] = torch.as_tensor(t, dtype=torch.int64)
        return upload(slots, self.device, torch.int64), upload(padded.clamp_(min=0), self.device), tables

    def run(self, chunks: Sequence[SeqChunk], on_layer_done: Callable[[int], None] | None = None,
            before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Returns float32 logits [N, vocab], one row per chunk with want_logits and one per token fed for a
        decode with guesses (a verify step), in chunk order. The hooks: see LlamaModel.forward."""
        chunks = verify_rows(chunks)
        order = sorted(range(len(chunks)), key=lambda i: not chunks[i].is_decode)  # stable: decodes first
        ordered = [chunks[i] for i in order]
        ids, positions, meta, rows = self.prepare(ordered)
        hidden = None
        if self.graphs is not None and on_layer_done is None and before_layer is None and \
                meta.num_decodes == meta.num_seqs:
            hidden = self.graphs.run(ids, positions, meta)  # None: no graph for this batch size, run eagerly
        if hidden is None:
            self.backend.prepare(meta)
            hidden = self.model(ids, positions, self.backend, on_layer_done, before_layer)
        # rows: a device index (a Python list would be a blocking copy on CUDA, see device.upload)
        logits = self.model.compute_logits(hidden[upload(rows, self.device, torch.int64)])  # [N, V]
        wanted = [i for i in order if chunks[i].want_logits]
        if wanted == sorted(wanted):
            return logits
        # row k of `logits` belongs to chunk wanted[k]; put the rows back in chunk order
        return logits[upload(sorted(range(len(wanted)), key=wanted.__getitem__), self.device, torch.int64)]


def verify_rows(chunks: Sequence[SeqChunk]) -> Sequence[SeqChunk]:
    """Each decode with guesses as one decode row per token fed, over the same pages: row j attends the first
    start_pos + j + 1 positions, so it reads what the rows before it wrote this step and nothing after. As decode
    rows they run the very kernels (and rounding) a plain decode step does, so a verify step's logits for a
    position equal the ones decoding it alone would give: greedy output is the same token for token."""
    if not any(c.num_draft_tokens for c in chunks):
        return chunks
    return [row for c in chunks for row in (
        [SeqChunk([t], c.start_pos + j, c.page_table, window_table=c.window_table) for j, t in enumerate(c.token_ids)]
        if c.num_draft_tokens else [c])]
