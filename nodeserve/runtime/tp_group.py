"""A tensor-parallel group's shards run as one model, so a ModelRunner (and everything above it) sees one device.

Rank 0 runs on the calling thread (the group's worker); rank r > 0 on a thread of its own, set up by its device
(on CPU: pinned to its core, one intra-op thread). Each step every rank runs its shard over its share of the KV
pool (GroupAttention: one backend per rank), and they meet twice per layer at the group's all-reduce
(device/collectives.py). Every rank then holds the same residual stream, so rank 0's hidden states are the
group's. The logits: on CPU vocab-parallel, each rank its slice of one tensor; on GPUs rank 0's whole lm_head. A
rank that raises aborts the all-reduce, so the others return instead of waiting forever; the step fails (its
requests fail, as on a single device) and the group serves the next one.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn

from nodeserve.attention.base import AttentionBackend, AttentionMetadata
from nodeserve.device import Device
from nodeserve.device.collectives import AllReduce, RankComm
from nodeserve.kv.pool import KVPool
from nodeserve.model.config import ModelConfig
from nodeserve.model.llama import LlamaModel
from nodeserve.model.tensor_parallel import layout_for


class GroupAttention:
    """A group's attention: one backend per rank over its shard of the group's pool. prepare(meta) keeps the step;
    each rank prepares its own backend in its own thread, with the step's tensors on its device. Layers attend per
    rank (ranks[r].forward), never through the group."""

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


class _RankThread:
    """Runs one rank's part of each step, in order; set up once by its device."""

    def __init__(self, device: Device, name: str):
        self.device = device
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def result(self) -> BaseException | None:
        return self._results.get()

    def _run(self) -> None:
        self.device.init_worker_thread()
        while True:
            job = self._jobs.get()
            try:
                with torch.inference_mode():  # thread-local: the worker's mode does not reach this thread
                    job()
                self._results.put(None)
            except BaseException as e:  # handed to rank 0, which fails the step
                self._results.put(e)


class TPGroupModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shards: Sequence[LlamaModel], devices: Sequence[Device],
                 all_reduce: AllReduce):
        """cfg: the whole model's; shards[r] runs on devices[r]; all_reduce joins them (one slot per rank)."""
        super().__init__()
        self.cfg = cfg
        self.shards = nn.ModuleList(shards)
        self.devices = list(devices)
        self.all_reduce = all_reduce
        self.reduces = [RankComm(all_reduce, r) for r in range(len(shards))]
        self._barrier_tokens = [torch.zeros(1, device=d.torch_device) for d in self.devices]
        self._threads: list[_RankThread] = []  # started by the first step, from the worker's thread

    @property
    def num_ranks(self) -> int:
        return len(self.shards)

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    def kv_shards(self) -> list[tuple[torch.device, range]]:
        """(device, global KV heads) of each rank: the group's pool holds its heads of every page there."""
        return [(d.torch_device, layout_for(self.cfg, self.num_ranks).ranks[r].kv_heads)
                for r, d in enumerate(self.devices)]

    def _start_threads(self) -> None:
        """Ranks 1.. get their threads at the first step, from the worker's thread (after its device set-up)."""
        if not self._threads:
            self._threads = [_RankThread(d, f"tp {d.name}") for d in self.devices[1:]]

    def _barrier(self, rank: int) -> None:
        self.reduces[rank](self._barrier_tokens[rank])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: GroupAttention,
                on_layer_done: Callable[[int], None] | None = None,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """LlamaModel.forward for the group: [T] ids and positions -> rank 0's hidden states [T, hidden]. The hooks
        run on rank 0; on_layer_done(i) comes after layer i's second all-reduce, so every rank's K/V of layer i is
        written by then; before_layer(i) is followed by a barrier, so no rank reads layer i before it loaded."""
        self._start_threads()

        def hooks(rank: int) -> Callable[[int], None] | None:
            if before_layer is None:
                return None
            if rank == 0:
                return lambda i: (before_layer(i), self._barrier(0))[0]
            return lambda i: self._barrier(rank)

        def run(rank: int) -> torch.Tensor:
            device = self.devices[rank].torch_device
            backend.prepare_rank(rank)
            return self.shards[rank](input_ids.to(device), positions.to(device), backend.ranks[rank],
                                     on_layer_done if rank == 0 else None, hooks(rank), self.reduces[rank])

        for rank, t in enumerate(self._threads, start=1):
            t.submit(lambda rank=rank: run(rank))
        error: BaseException | None = None
        hidden = None
        try:
            hidden = run(0)
        except BaseException as e:
            error = e
            self.all_reduce.abort()  # the other ranks stop at their next all-reduce
        peer_errors = [e for e in (t.result() for t in self._threads) if e is not None]
        if error is not None or peer_errors:
            self.all_reduce.reset()
            # A rank's own error says what went wrong; the others only saw the abort.
            raise (peer_errors[0] if peer_errors and _is_abort(error) else error or peer_errors[0])
        assert hidden is not None
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. A CPU group: vocab-parallel, each rank writing its slice of one
        tensor (no gather in one address space); a GPU group: rank 0's whole lm_head."""
        if any(d.torch_device.type != "cpu" for d in self.devices):
            return self.shards[0].compute_logits(hidden)
        logits = torch.empty(hidden.shape[0], self.cfg.vocab_size, dtype=torch.float32)

        def part(rank: int) -> None:
            head = self.shards[rank].lm_head_part
            start = self.cfg.vocab_size - sum(s.lm_head_part.out_features for s in self.shards[rank:])
            logits[:, start:start + head.out_features] = head(hidden)

        self._on_every_rank(part)
        return logits

    def _on_every_rank(self, fn: Callable[[int], None]) -> None:
        """fn(rank) on each rank's thread (rank 0: this one); raises the first error once all are done."""
        self._start_threads()
        for rank, t in enumerate(self._threads, start=1):
            t.submit(lambda rank=rank: fn(rank))
        error = None
        try:
            fn(0)
        except BaseException as e:
            error = e
        errors = [e for e in (t.result() for t in self._threads) if e is not None]
        if error is not None or errors:
            raise error or errors[0]


def _is_abort(error: BaseException | None) -> bool:
    return error is None or "tensor-parallel peer failed" in str(error)
