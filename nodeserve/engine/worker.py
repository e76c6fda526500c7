"""Worker: the thread that owns one device, its model runner, sampler and scheduler, and turns its step loop.

A worker can prefill, decode, or both:
  - a prefill worker (disaggregated) runs prompts in chunks on its own pool, samples the first token,
    and streams the KV layer by layer to the decode device through a KVTransfer;
  - a decode worker runs the continuous decode batch; it prefills only prompts the router sends it
    (colocated mode, or prompts under the conditional threshold), with chunks mixed into decode steps;
  - an adaptive worker does both, each request as the router placed it. Its role (which the router reads and
    changes) never enters its step loop.
One turn: inbox -> drop aborted -> schedule -> forward -> sample -> postprocess -> emit and hand off. Inbox
messages (prompts, arrived KV, pages to free, requests to move elsewhere) are handled between steps only.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from nodeserve.device import Device
from nodeserve.engine.model_runner import ModelRunner
from nodeserve.sampling.sampler import Sampler
from nodeserve.engine.scheduler import Batch, Handoff, Scheduler, Seq, StepOutput, WorkerLimits
from nodeserve.request import Request, RequestState, TokenEvent

if TYPE_CHECKING:
    from nodeserve.engine.transfer import KVTransfer

log = logging.getLogger(__name__)

class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    ADAPTIVE = "adaptive"  # decodes, prefills what it decodes, and may prefill for another device


@dataclass
class StepRecord:
    """What a device did in one step, for the timeline plots and metrics."""

    start: float
    end: float
    num_prefill_tokens: int
    num_decodes: int
    decode_context: int = 0      # tokens the decode rows attend, in total
    prefill_pairs: float = 0.0   # query-key pairs the prefill chunks attend (cost_model.StepShape)


# Inbox messages. None only wakes the loop.
@dataclass
class Prefill:
    seq: Seq


@dataclass
class Arrival:
    """A request prefilled elsewhere whose KV transfer ended: `landed` marks its last copy; error if one failed."""

    req: Request
    blocks: list[int]
    num_cached_blocks: int  # blocks that held its prefix before the copy (from this device's prefix cache)
    landed: Any
    error: str | None


@dataclass
class Migrate:
    """Adaptive mode: a request placed here for decode moves to handoff.target (whose pages the router reserved)
    between steps: decoding, its KV is copied whole; still prefilling, it goes on here and its KV is sent."""

    req: Request
    handoff: Handoff


@dataclass
class FreePages:
    """Pages a transfer has read; free them once this device's stream has waited on `read`."""

    blocks: list[int]
    read: Any


class Worker:
    def __init__(self, device: Device, role: Role, runner: ModelRunner, sampler: Sampler,
                 eos_token_ids: frozenset[int], limits: WorkerLimits,
                 emit_batch: Callable[[list[tuple[Request, TokenEvent]]], None],
                 on_released: Callable[[list[Request]], None]):
        """emit_batch(events) and on_released(requests whose decode pages are given back) are called from this
        worker's thread."""
        self.device, self.role, self.runner, self.sampler = device, role, runner, sampler
        self.pool = runner.pool
        self.kv = runner.pool.manager  # this device's pages: the router reserves here, this worker frees
        self.limits = limits
        self.scheduler = Scheduler(self.kv, limits, eos_token_ids)
        self._emit_batch, self._on_released = emit_batch, on_released
        self.transfers: dict[Worker, KVTransfer] = {}  # decode worker -> transfer, on workers that prefill for others
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.num_outstanding_prefill_tokens = 0        # router's load signal for prefill placement
        self.records: deque[StepRecord] = deque(maxlen=100_000)
        self._last_turn = time.monotonic()             # for the watchdog: updated every loop turn
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"worker {device.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def last_progress(self) -> float:
        """For the watchdog: when this worker's loop last turned, or, if earlier, when a transfer it feeds
        started the job it is still on (a stuck copy stalls this worker's requests as surely as a stuck step)."""
        return min([self._last_turn] + [t.busy_since for t in self.transfers.values() if t.busy_since is not None])

    @property
    def dead(self) -> bool:
        """Its thread ended without being stopped: nothing it holds will move again."""
        return self._thread.ident is not None and not self._thread.is_alive() and not self._stop

    # ---- called from other threads -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def add_prefill(self, req: Request, blocks: list[int], handoff: Handoff | None = None) -> None:
        """A request to prefill here: on `blocks` (its decode pages here), or, when it decodes elsewhere
        (handoff), on pages of this pool taken when it starts."""
        with self._lock:
            self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        req.state = RequestState.PREFILLING
        self._inbox.put(Prefill(Seq(req, blocks, handoff)))

    def send(self, msg: Arrival | FreePages | None) -> None:
        """From a transfer thread: an Arrival or FreePages; None only wakes the loop (e.g. to see an abort)."""
        self._inbox.put(msg)

    # ---- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        self.device.init_worker_thread()
        while not self._stop:
            try:
                self._drain_inbox(block=self.scheduler.idle)
                self._last_turn = time.monotonic()
                if not self._stop:
                    self._finish(self.scheduler.drop_aborted())
                    self._step()
            except Exception:  # a bug outside any one request's forward: fail what is in flight, keep serving
                log.exception("worker %s: step failed", self.name)
                self._finish(self.scheduler.fail_all("internal error in the worker step"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(msg, Prefill):
                    self.scheduler.waiting.append(msg.seq)
                elif isinstance(msg, FreePages):
                    self.device.wait_event(msg.read)
                    self.kv.free(msg.blocks)
                elif isinstance(msg, Arrival):
                    self._receive(msg)
                elif isinstance(msg, Migrate):
                    self._migrate(msg)
                msg = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _receive(self, msg: Arrival) -> None:
        req = msg.req
        if msg.error is None and not (req.aborted or req.finished):
            self.device.wait_event(msg.landed)
            self.scheduler.start_decode(Seq(req, msg.blocks, num_published=msg.num_cached_blocks), time.monotonic())
            return
        # These pages may be reserved again at once, for a copy on another pair's streams: quiet them first.
        self.device.synchronize_event(msg.landed)
        self.kv.free(msg.blocks)
        if msg.error is not None and not (req.aborted or req.finished):
            log.error("worker %s: request %s failed: %s", self.name, req.request_id, msg.error)
            self._emit_batch([(req, TokenEvent(None, finish_reason="error", error=msg.error))])
        req.state = RequestState.FINISHED
        self._on_released([req])

    def _migrate(self, msg: Migrate) -> None:
        req, h = msg.req, msg.handoff
        seq = next((s for s in [*self.scheduler.running, *self.scheduler.waiting] if s.req is req), None)
        if seq is None or seq.handoff is not None or req.aborted or req.finished:
            # Ended, or not here yet (its KV is on its way from another device): it stays; so do the pages.
            h.target.send(FreePages(h.blocks, None))
            return
        seq.handoff = h
        decoding = seq in self.scheduler.running
        log.debug("worker %s: request %s moves to %s (%s)", self.name, req.request_id, h.target.name,
                  "decoding" if decoding else "prefilling")
        if not decoding:
            return  # prefilled here as a prompt bound elsewhere: the layer hook sends every page from the first
        self.scheduler.running.remove(seq)
        num_blocks = self.kv.blocks_for(req.num_computed_tokens)
        transfer = self.transfers[h.target]
        pages = transfer.page_indices(seq.block_table[:num_blocks], h.blocks[:num_blocks], (req.request_id,))
        for layer in range(len(self.pool.layers)):
            transfer.copy_layer(layer, pages)
        h.num_copied_blocks = num_blocks
        req.state = RequestState.TRANSFERRING
        self._hand_off(seq)

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.waiting:
                time.sleep(0.001)  # prompts wait for prefill pages that finished transfers give back
            return
        start = time.monotonic()
        for seq in batch.seqs[batch.num_decodes:]:
            seq.req.prefill_start = seq.req.prefill_start or start
        outcomes = self._sample(batch, self._forward(batch))
        end = time.monotonic()
        decodes, prefills = batch.chunks[:batch.num_decodes], batch.chunks[batch.num_decodes:]
        self.records.append(StepRecord(start, end, sum(len(c.token_ids) for c in prefills), batch.num_decodes,
                                       sum(c.start_pos for c in decodes),
                                       sum(len(c.token_ids) * (c.start_pos + len(c.token_ids) / 2) for c in prefills)))
        self._finish(self.scheduler.postprocess(batch, outcomes, end))

    def _forward(self, batch: Batch) -> list[torch.Tensor | Exception | None]:
        """Per sequence: its logits row, None if it wants none, or the exception that failed it.

        If the batch fails, each sequence is re-run alone, so a fault in one request fails that request only.
        Re-running is safe: K/V writes go to the same slots with the same values.
        """
        chunks = batch.chunks
        try:
            rows = iter(self.runner.run(chunks, self._layer_hook(batch, range(len(chunks)))))
            return [next(rows) if c.want_logits else None for c in chunks]
        except Exception:
            pass  # find which request fails, alone
        results: list[torch.Tensor | Exception | None] = []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, chunks)):
            try:
                logits = self.runner.run([chunk], self._layer_hook(batch, [i]))
                results.append(logits[0] if chunk.want_logits else None)
            except Exception as e:
                log.error("worker %s: request %s failed: %s\n%s", self.name, seq.req.request_id, e,
                          "".join(traceback.format_exception(e)))
                results.append(e)
        return results

    def _sample(self, batch: Batch, results: list[torch.Tensor | Exception | None]) -> list[TokenEvent | Exception | None]:
        """One batched sampler call over the rows that have logits."""
        rows = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        if not rows:
            return list(results)
        reqs = [batch.seqs[i].req for i in rows]
        for req in reqs:
            req.generator = self.sampler.request_generator(req.generator, req.params.seed, len(req.output_ids))
        out = self.sampler(torch.stack([results[i] for i in rows]), [r.params for r in reqs],
                           [r.prompt_ids for r in reqs], [r.output_ids for r in reqs], [r.generator for r in reqs],
                           [r.grammar for r in reqs])
        outcomes: list[TokenEvent | Exception | None] = list(results)
        for k, i in enumerate(rows):
            outcomes[i] = TokenEvent(out.token_ids[k], out.logprobs[k] if out.logprobs is not None else None,
                                     out.top_logprobs[k] if out.top_logprobs is not None else None)
        return outcomes

    def _finish(self, out: StepOutput) -> None:
        """Acts on a step's outcome: hands prefilled requests to their transfers, reports what ended."""
        if out.num_prompt_tokens_done:
            with self._lock:
                self.num_outstanding_prefill_tokens -= out.num_prompt_tokens_done
        for seq in out.handoffs:
            self._hand_off(seq)
        if out.events:
            self._emit_batch(out.events)
        if out.released:
            self._on_released(out.released)

    def _layer_hook(self, batch: Batch, which) -> Callable[[int], None] | None:
        """Per-layer copy of the pages each remote-bound prefill chunk wrote, started as soon as the layer is done."""
        plan: dict[KVTransfer, tuple[list[int], list[int], list[str]]] = {}  # src pages, dst pages, request ids
        page_size = self.pool.page_size
        for i in which:
            seq, n = batch.seqs[i], len(batch.chunks[i].token_ids)
            if i < batch.num_decodes or seq.handoff is None:
                continue
            # From the first page not yet sent whole (on the first chunk, that can be a page this device had
            # cached and the decode device has not) to the last this chunk writes; none the decode device holds.
            h, c = seq.handoff, seq.req.num_computed_tokens
            first, last = h.num_sent_blocks, (c + n - 1) // page_size
            h.num_sent_blocks = max(first, (c + n) // page_size)
            if first > last:
                continue
            h.num_copied_blocks += last + 1 - first
            src, dst, ids = plan.setdefault(self.transfers[h.target], ([], [], []))
            src.extend(seq.block_table[first:last + 1])
            dst.extend(h.blocks[first:last + 1])
            ids.append(seq.req.request_id)
        if not plan:
            return None
        page_maps = [(t, t.page_indices(src, dst, tuple(ids))) for t, (src, dst, ids) in plan.items()]

        def on_layer_done(layer: int) -> None:
            for transfer, pages in page_maps:
                transfer.copy_layer(layer, pages)

        return on_layer_done

    def _hand_off(self, seq: Seq) -> None:
        """Queues the end of a request's transfer, after every copy already queued for it: its prompt pages here
        are freed, and its decode worker receives it (or, if it ended or a copy failed, frees its pages there)."""
        h, req = seq.handoff, seq.req
        src, seq.block_table = seq.block_table, []
        self.transfers[h.target].finish(
            req.request_id, src, lambda landed, error: h.target.send(
                Arrival(req, h.blocks, h.num_cached_blocks, landed, error)), h.num_copied_blocks, h.num_cached_blocks)
