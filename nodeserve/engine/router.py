"""Router: admits requests, reserves their decode pages up front, and picks the devices.

Runs on the event loop thread. Reserving the decode pages at admission means a finished prefill never waits
for space and an abort has exactly one reservation to give back. The router's record of each placed request
(which decode device holds a seat for it) ends when that device reports its pages given back (release()).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Callable

from nodeserve.engine.scheduler import Handoff
from nodeserve.engine.worker import Migrate, Worker
from nodeserve.kv.manager import hash_blocks
from nodeserve.request import Request


class QueueFull(Exception):
    """Too many requests are waiting for pages; the client should retry later (503)."""


class TooLarge(Exception):
    """The request can never fit in a device's KV pool (400)."""


class Router:
    # Called as admission(router, req) before a request queues; may raise QueueFull (adaptive/admission.py).
    admission: Callable[[Router, Request], None] | None = None
    # adaptive mode: observe(req) at admission, place(router, req) -> (prefill, decode) or None (adaptive/placer.py).
    placer: Any = None

    def __init__(self, prefill_workers: list[Worker], decode_workers: list[Worker],
                 local_prefill_threshold: int, max_waiting: int, max_queued_tokens: int):
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        self.local_prefill_threshold, self.max_waiting = local_prefill_threshold, max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.pending: deque[Request] = deque()
        self.page_size = decode_workers[0].kv.page_size  # one page size on every device (kv.page_size)
        self.placements: dict[str, Worker] = {}  # request id -> its decode worker, from placement to release
        self.placed: dict[str, Request] = {}     # request id -> the request, for the same time
        self.num_seats_taken: Counter[Worker] = Counter()  # per decode worker: requests placed there, not released

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens admitted but not yet prefilled, here and on every worker."""
        queued = sum(r.num_prompt_tokens for r in self.pending)
        return queued + sum(w.num_outstanding_prefill_tokens for w in self.prefill_workers + self.decode_workers)

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens of KV one request can ever hold: a whole decode pool."""
        return max(w.kv.num_usable * w.kv.page_size for w in self.decode_workers)

    def admit(self, req: Request) -> None:
        if req.max_total_tokens > self.max_seq_tokens:
            raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens but a device's KV cache holds at most "
                           f"{self.max_seq_tokens}")
        if self.prefill_workers and req.num_prompt_tokens >= self.local_prefill_threshold:
            capacity = min(w.kv.num_usable * w.kv.page_size for w in self.prefill_workers)
            if req.num_prompt_tokens > capacity:
                raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens but a prefill device holds at most "
                               f"{capacity}")
        if req.num_prompt_tokens > self.max_queued_tokens:
            raise TooLarge(f"the prompt has {req.num_prompt_tokens} tokens, more than server.max_queued_tokens "
                           f"({self.max_queued_tokens})")
        if len(self.pending) >= self.max_waiting:
            raise QueueFull(f"{len(self.pending)} requests are already waiting")
        if self.num_queued_tokens + req.num_prompt_tokens > self.max_queued_tokens:
            raise QueueFull(f"{self.num_queued_tokens} prompt tokens are already queued")
        req.block_hashes = hash_blocks(req.prompt_ids, self.page_size)
        if self.placer is not None:
            self.placer.observe(req)
        if self.admission is not None:
            self.admission(self, req)
        self.pending.append(req)
        self.dispatch()

    def abort_pending(self, req: Request) -> bool:
        """Drops a request that has not been placed yet. Returns False if it already left the router."""
        if req not in self.pending:
            return False
        self.pending.remove(req)
        return True

    def dispatch(self) -> None:
        """Places waiting requests, oldest first, while their decode pages can be reserved."""
        while self.pending:
            req = self.pending[0]
            hashes, n = req.block_hashes, req.num_prompt_tokens
            if self.placer is not None:
                placed = self.placer.place(self, req)
                prefill, worker = placed if placed is not None else (None, None)
            else:
                # Decode: a device with a free seat in its batch (so its own short prefills always find one and
                # nothing it holds waits behind the batch), then the longest cached prefix, then the most free pages.
                seats = self.num_seats_taken
                prefill, worker = None, max((w for w in self.decode_workers if seats[w] < w.limits.max_num_seqs),
                                            key=lambda w: (len(w.kv.lookup(hashes, n)), w.kv.num_free, -seats[w]),
                                            default=None)
            num_blocks = worker.kv.blocks_for(req.max_total_tokens) if worker else 0
            if worker is None or not worker.kv.can_allocate(num_blocks):  # as if nothing were cached: a bound
                return
            blocks, num_cached_tokens = worker.kv.allocate_prompt(hashes, n, num_blocks)
            self.pending.popleft()
            self.placements[req.request_id], self.placed[req.request_id] = worker, req
            self.num_seats_taken[worker] += 1
            if prefill is None and self.prefill_workers and n - num_cached_tokens >= self.local_prefill_threshold:
                # Prefill: the least work ahead, counting what its own cache saves.
                prefill = min(self.prefill_workers, key=lambda w: w.num_outstanding_prefill_tokens
                              - len(w.kv.lookup(hashes, n)) * self.page_size)
            if prefill is not None and prefill is not worker:
                prefill.add_prefill(req, [], Handoff(worker, blocks, num_cached_tokens // self.page_size))
            else:
                req.num_computed_tokens = req.num_cached_tokens = num_cached_tokens
                worker.add_prefill(req, blocks)

    def release(self, req: Request) -> None:
        """Its decode device gave back every page it held: its seat is free."""
        worker = self.placements.pop(req.request_id, None)
        self.placed.pop(req.request_id, None)
        if worker is not None:
            self.num_seats_taken[worker] -= 1

    def move_decodes(self, source: Worker, targets: list[Worker]) -> int:
        """Adaptive mode, `source` just dedicated to prefill: every request placed there for decode moves to the
        target with the most free pages that has a seat and room for it; the source's worker moves it between
        steps (Migrate). A request that turns out not to be decoding there (it ended, or its KV is still on its
        way from another device) stays, and the reserved pages are given back. Returns how many were sent."""
        moved = 0
        for rid, worker in list(self.placements.items()):
            req = self.placed[rid]
            fits = [t for t in targets if self.num_seats_taken[t] < t.limits.max_num_seqs
                    and t.kv.can_allocate(t.kv.blocks_for(req.max_total_tokens))]
            if worker is not source or req.finished or req.aborted or not fits:
                continue
            target = max(fits, key=lambda t: t.kv.num_free)
            blocks = target.kv.allocate(target.kv.blocks_for(req.max_total_tokens))
            self.placements[rid] = target
            self.num_seats_taken[source] -= 1
            self.num_seats_taken[target] += 1
            source.send(Migrate(req, Handoff(target, blocks)))
            moved += 1
        return moved

    @property
    def num_pending(self) -> int:
        return len(self.pending)
