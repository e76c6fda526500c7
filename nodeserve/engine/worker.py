"""Worker: the thread that owns one device, its model replica and KV pool, and runs its step loop.

A worker can prefill, decode, or both:
  - a prefill worker (disaggregated) runs prompts in chunks on its own pool, samples the first token,
    and streams the KV layer by layer to the decode device through a KVTransfer;
  - a decode worker runs the continuous decode batch; it prefills only prompts the router sends it
    (colocated mode, or prompts under the conditional threshold), with chunks mixed into decode steps.
One step: drop aborted requests -> schedule (all decodes + prefill chunks within the token budget)
-> one forward -> sample -> emit tokens -> free what finished.
"""

from __future__ import annotations

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
from nodeserve.engine.model_runner import ModelRunner, SeqChunk
from nodeserve.engine.sampler import Sampler
from nodeserve.kv.manager import KVManager
from nodeserve.kv.pool import KVPool
from nodeserve.request import Request, TokenEvent

if TYPE_CHECKING:
    from nodeserve.engine.transfer import KVTransfer

log = logging.getLogger(__name__)

FORWARD_FAILED = "the model's forward pass failed for this request (the error is in the server log)"


@dataclass
class StepRecord:
    """What a device did in one step, for the timeline plots and metrics."""

    start: float
    end: float
    num_prefill_tokens: int
    num_decodes: int


@dataclass
class WorkerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Worker:
    def __init__(self, device: Device, role: str, runner: ModelRunner, sampler: Sampler,
                 eos_token_ids: frozenset[int], limits: WorkerLimits,
                 emit_batch: Callable[[list[tuple[Request, TokenEvent]]], None],
                 on_pages_freed: Callable[[], None]):
        self.device, self.role, self.runner, self.sampler = device, role, runner, sampler
        self.pool: KVPool = runner.pool
        self.kv: KVManager = runner.pool.manager  # this device's pages: the router reserves here, this worker frees
        self.eos_token_ids, self.limits = eos_token_ids, limits
        self._emit_batch, self._on_pages_freed = emit_batch, on_pages_freed
        self.transfers: dict[Worker, KVTransfer] = {}  # decode worker -> transfer, on prefill workers
        self.waiting: deque[Request] = deque()         # to prefill here
        self.running: list[Request] = []               # decoding here
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.num_outstanding_prefill_tokens = 0        # router's load signal for prefill placement
        self.num_assigned = 0                          # requests placed here for decode and not yet finished
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

    def add_prefill(self, req: Request) -> None:
        with self._lock:
            self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        self._inbox.put(("prefill", req, None))

    def add_decode(self, req: Request, ready_event: Any) -> None:
        """A request whose KV has landed in this worker's pool (ready_event marks the last copy)."""
        self._inbox.put(("decode", req, ready_event))

    def release_pages(self, pages: list[int], read_event: Any) -> None:
        """Frees pages of this worker's pool that a transfer copied out, once this worker's stream has waited
        on read_event: a later step writing them is then ordered after the copy, with no host sync."""
        self._inbox.put(("free", pages, read_event))

    def wake(self) -> None:
        self._inbox.put(None)

    def assign(self, req: Request) -> None:
        with self._lock:
            self.num_assigned += 1

    # ---- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        self.device.init_worker_thread()
        while not self._stop:
            try:
                self._drain_inbox(block=not (self.waiting or self.running))
                self._last_turn = time.monotonic()
                if not self._stop:
                    self._drop_aborted()
                    self._step()
            except Exception:  # a bug outside any one request's forward: fail what is in flight, keep serving
                log.exception("worker %s: step failed", self.name)
                self._fail_all("internal error in the worker step")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    kind, payload, event = item
                    if kind == "prefill":
                        self.waiting.append(payload)
                    elif kind == "free":
                        self.device.wait_event(event)
                        self.kv.free(payload)
                    else:
                        self.device.wait_event(event)
                        payload.num_computed_tokens = payload.num_prompt_tokens
                        payload.timings["decode_start"] = time.monotonic()
                        self.running.append(payload)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _step(self) -> None:
        decodes = self.running[: self.limits.max_num_seqs]
        budget = self.limits.max_num_batched_tokens - len(decodes)
        prefills: list[tuple[Request, int]] = []
        for req in self.waiting:
            if budget <= 0 or len(decodes) + len(prefills) >= self.limits.max_num_seqs:
                break
            if not self._ensure_prefill_pages(req):
                break  # FIFO: later prompts wait for pages behind this one
            n = min(req.num_prompt_tokens - req.num_computed_tokens, budget)
            req.timings.setdefault("prefill_start", time.monotonic())
            prefills.append((req, n))
            budget -= n
        if not decodes and not prefills:
            if self.waiting:
                time.sleep(0.001)  # prompts wait for prefill pages that finished transfers give back
            return
        start = time.monotonic()
        chunks = [SeqChunk([r.output_ids[-1]], r.num_computed_tokens, r.pages) for r in decodes]
        for req, n in prefills:
            c, table = req.num_computed_tokens, req.prefill_pages if req.prefill_elsewhere else req.pages
            chunks.append(SeqChunk(req.prompt_ids[c:c + n], c, table, want_logits=c + n == req.num_prompt_tokens))
        items = list(decodes) + [r for r, _ in prefills]
        results = self._forward(items, chunks, prefills)
        end = time.monotonic()
        self.records.append(StepRecord(start, end, sum(n for _, n in prefills), len(decodes)))
        self._process(items, chunks, prefills, results, end)

    def _forward(self, items: list[Request], chunks: list[SeqChunk],
                 prefills: list[tuple[Request, int]]) -> list[torch.Tensor | Exception | None]:
        """Per item: its logits row, None if it wants none, or the exception that failed it.

        If the batch fails, each item is re-run alone, so a fault in one request fails that request only.
        Re-running is safe: K/V writes go to the same slots with the same values.
        """
        try:
            logits = self.runner.run(chunks, self._layer_hook(prefills))
            rows = iter(logits)
            return [next(rows) if c.want_logits else None for c in chunks]
        except Exception:
            pass  # find which request fails, alone
        results: list[torch.Tensor | Exception | None] = []
        for req, chunk in zip(items, chunks):
            own = [(r, n) for r, n in prefills if r is req]
            try:
                logits = self.runner.run([chunk], self._layer_hook(own))
                results.append(logits[0] if chunk.want_logits else None)
            except Exception as e:
                log.error("worker %s: request %s failed: %s\n%s", self.name, req.request_id, e,
                          "".join(traceback.format_exception(e)))
                results.append(e)
        return results

    def _process(self, items, chunks, prefills, results, now: float) -> None:
        events: list[tuple[Request, TokenEvent]] = []
        num_decodes = len(items) - len(prefills)
        sample_reqs, sample_rows = [], []
        for i, (req, result) in enumerate(zip(items, results)):
            if isinstance(result, Exception):
                # The exception is in the log (above); the client gets no raw exception text.
                events.append((req, TokenEvent(None, finish_reason="error", error=FORWARD_FAILED)))
                self._retire(req)
                continue
            if i >= num_decodes:
                n = prefills[i - num_decodes][1]
                req.num_computed_tokens += n
                with self._lock:
                    self.num_outstanding_prefill_tokens -= n
            else:
                req.num_computed_tokens += 1
            if result is not None:
                sample_reqs.append(req)
                sample_rows.append(result)
        if sample_reqs:
            for req in sample_reqs:
                req.generator = self.sampler.request_generator(req.generator, req.params.seed, len(req.output_ids))
            out = self.sampler(torch.stack(sample_rows), [r.params for r in sample_reqs],
                               [r.prompt_ids for r in sample_reqs], [r.output_ids for r in sample_reqs],
                               [r.generator for r in sample_reqs], [r.grammar for r in sample_reqs])
            for k, req in enumerate(sample_reqs):
                first = not req.output_ids
                req.output_ids.append(out.token_ids[k])
                if first:
                    req.timings["prefill_end"] = now
                    self.waiting.remove(req)
                finish = self._finish_reason(req)
                events.append((req, TokenEvent(out.token_ids[k],
                                               out.logprobs[k] if out.logprobs is not None else None,
                                               out.top_logprobs[k] if out.top_logprobs is not None else None,
                                               finish)))
                if finish is not None:
                    self._retire(req)
                elif first and req.prefill_elsewhere:
                    self._hand_off(req)
                elif first:
                    req.timings["decode_start"] = time.monotonic()
                    self.running.append(req)
        if events:
            self._emit_batch(events)

    def _finish_reason(self, req: Request) -> str | None:
        tok, p = req.output_ids[-1], req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    # ---- pages ---------------------------------------------------------------------------------------
    def _ensure_prefill_pages(self, req: Request) -> bool:
        if not req.prefill_elsewhere or req.prefill_pages:
            return True
        num_blocks = self.kv.blocks_for(req.num_prompt_tokens)
        if self.kv.can_allocate(num_blocks):  # only this thread allocates here: the check holds
            req.prefill_pages = self.kv.allocate(num_blocks)
        return bool(req.prefill_pages)

    def _layer_hook(self, prefills: list[tuple[Request, int]]) -> Callable[[int], None] | None:
        """Per-layer copy of the pages each remote-bound prefill chunk wrote, started as soon as the layer is done."""
        plan: dict[KVTransfer, tuple[list[int], list[int], list[str]]] = {}  # src pages, dst pages, request ids
        page_size = self.pool.page_size
        for req, n in prefills:
            if not req.prefill_elsewhere:
                continue
            first, last = req.num_computed_tokens // page_size, (req.num_computed_tokens + n - 1) // page_size
            src, dst, ids = plan.setdefault(self.transfers[req.decode_worker], ([], [], []))
            src.extend(req.prefill_pages[first:last + 1])
            dst.extend(req.pages[first:last + 1])
            ids.append(req.request_id)
        if not plan:
            return None
        page_maps = [(t, t.page_indices(src, dst, tuple(ids))) for t, (src, dst, ids) in plan.items()]

        def on_layer_done(layer: int) -> None:
            for transfer, pages in page_maps:
                transfer.copy_layer(layer, pages)

        return on_layer_done

    def _hand_off(self, req: Request) -> None:
        """Queues the end of req's transfer: after its last copy it goes to its decode worker, or, if it finished,
        was aborted or lost a copy meanwhile, gives back its pages there."""
        d = req.decode_worker
        self.transfers[d].finish(req, d.add_decode, d.release_reserved, d.fail_handoff)

    def fail_handoff(self, req: Request, error: str) -> None:
        """Ends a request whose KV did not arrive (its pages are already given back). Called from a copy thread."""
        req.finished = True
        log.error("worker %s: request %s failed: %s", self.name, req.request_id, error)
        self._emit_batch([(req, TokenEvent(None, finish_reason="error", error=error))])

    def release_reserved(self, req: Request) -> None:
        """Frees a request's decode pages. Called on its decode worker's pool, from the thread holding it."""
        if req.pages:
            self.kv.free(req.pages)
            req.pages = []
        with self._lock:
            self.num_assigned -= 1
        self._on_pages_freed()

    def _retire(self, req: Request) -> None:
        """Takes a finished, failed or aborted request out of this worker and frees what it holds."""
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
            with self._lock:
                self.num_outstanding_prefill_tokens -= req.num_prompt_tokens - req.num_computed_tokens
        if req.prefill_elsewhere and req.decode_worker is not self:
            # The transfer queue may still hold copies of this request: free both sides after them.
            self._hand_off(req)
        else:
            req.decode_worker.release_reserved(req)

    def _drop_aborted(self) -> None:
        for req in [r for r in self.running if r.aborted] + [r for r in self.waiting if r.aborted]:
            self._retire(req)

    def _fail_all(self, message: str) -> None:
        events = []
        for req in list(self.running) + list(self.waiting):
            events.append((req, TokenEvent(None, finish_reason="error", error=message)))
            self._retire(req)
        if events:
            self._emit_batch(events)
