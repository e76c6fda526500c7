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

import functools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Sequence, cast

import torch

from nodeserve.core.handoff import (Arrival, CopyPlan, FreePages, Handoff, Migrate, Migration, MigrationOutcome,
                                    MigrationStep, Prefill, copy_plan, next_migration_step)
from nodeserve.core.load import Role
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.scheduler import (Batch, PageLoad, SamplingFailed, SamplingLimit, Scheduler, Seq, SeqChunk, StepOutput,
                                      WorkerLimits)
from nodeserve.device import Device
from nodeserve.runtime.model_runner import ModelRunner
from nodeserve.runtime.records import RecordLog
from nodeserve.sampling.constrain import MASK_FILL_BUDGET_S
from nodeserve.sampling.sampler import Sampler, greedy

if TYPE_CHECKING:
    from nodeserve.kv.window import WindowPages
    from nodeserve.kv.pool import KVPool
    from nodeserve.runtime.kv_loader import KVLoader, LoadJob
    from nodeserve.runtime.lending import SlackLending
    from nodeserve.runtime.transfer import KVTransfer

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive steps in which every request failed: the device is taken for dead
MAX_STEP_RECORDS = 100_000  # kept for /debug/steps and the profiler: about an hour of steps, ~5 MiB

def _plain_greedy(req: Request) -> bool:
    """Its token is the argmax of its logits as they are: greedy with nothing that changes them (penalties, biases,
    min_tokens, a grammar) and no logprobs asked."""
    p = req.params
    return p.greedy and not p.has_penalties and not p.logit_bias and not p.min_tokens and p.logprobs is None and \
        req.grammar is None


def _per_chunk(chunks: list[SeqChunk], logits: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """The runner's logits split by chunk: a row [V] for a chunk with logits, rows [k + 1, V] for a decode with k
    guesses, None for a chunk without (ModelRunner.run's order)."""
    r = 0
    for c in chunks:
        n = (1 + c.num_draft_tokens) if c.want_logits else 0
        yield None if not n else logits[r] if not c.num_draft_tokens else logits[r:r + n]
        r += n


__all__ = ["Arrival", "FreePages", "Handoff", "Migrate", "Role", "StepRecord", "Worker", "WorkerLimits"]


@dataclass
class StepRecord:
    """What a device did in one step, for the timeline plots and metrics."""

    start: float
    end: float
    num_prefill_tokens: int
    num_decodes: int
    decode_context: int = 0      # tokens the decode rows attend, in total
    prefill_pairs: float = 0.0   # query-key pairs the prefill chunks attend (cost_model.StepShape)
    num_decode_tokens: int = -1  # tokens the decode rows made (a verify step's: fewer than its rows); -1: one a row
    num_guess_rows: int = 0      # of the decode rows, those that verified guesses (core/speculation.py)


class Worker:
    def __init__(self, device: Device, role: Role, runner: ModelRunner, sampler: Sampler,
                 eos_token_ids: frozenset[int], limits: WorkerLimits,
                 emit_batch: Callable[[list[tuple[Request, TokenEvent]]], None],
                 on_released: Callable[[list[Request]], None],
                 on_migrated: Callable[[Request, MigrationOutcome, float, int], None] = lambda *args: None,
                 inbox: queue.SimpleQueue | None = None, transfers: Mapping[str, KVTransfer] | None = None,
                 loader: KVLoader | None = None, slack_lending: SlackLending | None = None,
                 on_room: Callable[[], None] = lambda: None):
        """emit_batch(events), on_released(requests whose decode pages are given back), on_migrated(request,
        outcome, downtime seconds, pages copied) of a move that ended, and on_room() (this device has room it had
        not, with no request ended: prompts it prefilled for others left its queue, or their copied pages came
        back) are called from this worker's thread.

        inbox: where send() puts messages, made before this worker when others (its transfers, its loader) must
        reach it; transfers: by target device name, on a worker that prefills for others; loader: fills pages from
        other devices and tiers (None: no tiers); slack_lending: a decode worker lending its core between steps."""
        self.device, self.role, self.runner, self.sampler = device, role, runner, sampler
        # runner.pool is attention's view of it (KVPoolLike); the runtime builds every runner over a KVPool (node.py)
        self.pool = cast("KVPool", runner.pool)
        self.kv = self.pool.manager  # this device's pages: the router reserves here, this worker frees
        self.window = self.pool.window  # its windowed layers' pages, where the pool keeps them apart (kv/window.py)
        self.limits = limits
        self.scheduler = Scheduler(self.kv, limits, eos_token_ids, free=self._give_back)
        self._emit_batch, self._on_released, self._on_migrated = emit_batch, on_released, on_migrated
        self._on_room = on_room
        self.transfers = dict(transfers or {})
        self.loader, self.slack_lending = loader, slack_lending
        self._loads: dict[Seq, LoadJob] = {}           # requests here whose pages are being filled
        self._inbox: queue.SimpleQueue = inbox if inbox is not None else queue.SimpleQueue()
        self._lock = threading.Lock()
        self.num_outstanding_prefill_tokens = 0        # router's load signal for prefill placement
        self.num_batch_failures = 0                    # batched forwards that raised (/metrics)
        self.num_computed_prompt_tokens = 0            # prompt tokens prefilled here (/metrics)
        self.num_failed_steps = 0                      # consecutive steps in which every request failed
        self.failure: str | None = None                # why this device is taken for dead
        self.records = RecordLog(StepRecord, MAX_STEP_RECORDS)
        self._last_turn = time.monotonic()             # for the watchdog: updated every loop turn
        self._step_start = 0.0                         # when the last step started
        self.lent_seconds = 0.0                        # spent lent between steps (/metrics)
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
        """Its thread ended without being stopped (nothing it holds will move again), or its device failed every
        request of MAX_FAILED_STEPS steps in a row (a sticky device error: illegal address, ECC): /health answers
        503, the watchdog stops, systemd restarts the service."""
        return self.failure is not None or (self._thread.ident is not None and not self._thread.is_alive()
                                            and not self._stop)

    # ---- called from other threads -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=timeout)

    def add_prefill(self, req: Request, pages: list[int], handoff: Handoff | None = None,
                    load: PageLoad | None = None, num_own_pages: int = -1, window: WindowPages | None = None) -> None:
        """A request to prefill here on `pages` (taken by the router): its decode pages here, or, when it decodes
        elsewhere (handoff), its prompt's pages in this pool. The first num_own_pages were cached here; `load`
        fills pages after them from other devices or tiers."""
        with self._lock:
            self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        self._inbox.put(Prefill(Seq(req, pages, handoff, load=load, num_published=num_own_pages, window=window)))

    def send(self, msg: Arrival | FreePages | Migrate | None) -> None:
        """From another thread: an Arrival, FreePages or Migrate; None only wakes the loop (e.g. to see an abort)."""
        self._inbox.put(msg)

    # ---- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        self.device.init_worker_thread()
        while not self._stop:
            try:
                idle = not self.scheduler.has_work
                if idle:
                    self.device.lend(True)  # this core may help another device while nothing is to do here
                self._drain_inbox(block=idle)  # a loader wakes it when a prompt is ready
                if idle:
                    self.device.lend(False)
                self._last_turn = time.monotonic()
                if not self._stop:
                    self._finish(self.scheduler.drop_aborted())
                    self._advance_migrations()
                    self._step()
                    if self.slack_lending is not None and self.scheduler.running and not self.scheduler.waiting:
                        self._lend_between_steps()  # (prompts of its own come first)
            except Exception as e:  # a bug outside any one request's forward: fail what is in flight, keep serving
                log.exception("worker %s: step failed", self.name)
                self._wait_loads()
                self._finish(self.scheduler.fail_all("internal error in the worker step"))
                self._count_failed_step(True, e)

    def _lend_between_steps(self) -> None:
        """Sleeps lent for as long as the decode batch's inter-token gap allows (runtime/lending.py)."""
        if self.slack_lending is None:
            return
        pause = self.slack_lending.pause(self._step_start, time.monotonic())
        if pause > 0:
            self.device.lend(True)
            time.sleep(pause)
            self.device.lend(False)
            self.lent_seconds += pause

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(msg, Prefill):
                    if msg.seq.load is not None:
                        if self.loader is None:  # the router loads from other tiers only with the tiers on
                            raise RuntimeError(f"{self.name}: a request to load from other tiers, and no loader")
                        self._loads[msg.seq] = self.loader.submit(msg.seq)
                    self.scheduler.waiting.append(msg.seq)
                elif isinstance(msg, FreePages):
                    self.device.wait_event(msg.read)
                    self._give_back(msg.pages)
                    if msg.window is not None:
                        msg.window.release()
                    self._on_room()
                elif isinstance(msg, Arrival):
                    self._receive(msg)
                elif isinstance(msg, Migrate):
                    self._migrate(msg)
                msg = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _give_back(self, pages: list[int]) -> None:
        """Gives pages back once everything queued on this device's stream so far is behind them: a transfer that
        is handed them next as its destination waits on pool.freed_event (recorded first, then the pages freed)."""
        self.pool.freed_event = self.device.record_event()
        self.kv.free(pages)

    def _receive(self, msg: Arrival) -> None:
        req = msg.req
        if msg.error is None and not (req.aborted or req.finished):
            self.device.wait_event(msg.landed)
            now = time.monotonic()
            self.scheduler.start_decode(Seq(req, msg.pages, num_published=msg.num_cached_pages, window=msg.window),
                                        now)
            if msg.migrated_at is not None:
                self._on_migrated(req, MigrationOutcome.MOVED, now - msg.migrated_at, msg.num_copied_pages)
            return
        # These pages may be reserved again at once, for a copy on another pair's streams: quiet them first.
        self.device.synchronize_event(msg.landed)
        self._give_back(msg.pages)
        if msg.window is not None:
            msg.window.release()
        if msg.error is not None and not (req.aborted or req.finished):
            log.error("worker %s: request %s failed: %s", self.name, req.request_id, msg.error)
            self._emit_batch([(req, TokenEvent(None, finish_reason="error", error=msg.error))])
            if msg.migrated_at is not None:
                self._on_migrated(req, MigrationOutcome.FAILED, 0.0, msg.num_copied_pages)
        req.finished = True
        self._on_released([req])

    # ---- moving a request to another device ----------------------------------------------------------
    def _migrate(self, msg: Migrate) -> None:
        req, h = msg.req, msg.handoff
        seq = next((s for s in [*self.scheduler.running, *self.scheduler.waiting] if s.req is req), None)
        if seq is None or seq.handoff is not None or seq.migration is not None or req.aborted or req.finished:
            # Ended (its release is on its way), or not here yet (its KV is on its way from another device): it
            # stays where it is, and the target's pages go back.
            h.target.send(FreePages(h.pages, None, h.window))
            if not (req.aborted or req.finished):
                self._on_migrated(req, MigrationOutcome.NOT_RUNNING, 0.0, 0)
            return
        if seq in self.scheduler.running:
            log.debug("worker %s: request %s moves to %s (%s)", self.name, req.request_id, h.target.name,
                      "live" if msg.live else "stop and copy")
            seq.migration = Migration(h, live=msg.live)
            self._advance_migrations()
            return
        # Still prefilling here: the layer hook sends every page from the first, then the handoff.
        seq.handoff = h
        self._on_migrated(req, MigrationOutcome.MOVED, 0.0, 0)

    def _advance_migrations(self) -> None:
        """Between two steps: each migrating request pre-copies the pages it filled since the last round, or, once
        few are left, stops here and moves (next_migration_step)."""
        for seq, m in [(s, s.migration) for s in self.scheduler.running if s.migration is not None]:
            req = seq.req
            step = next_migration_step(m, req.num_computed_tokens, self.pool.page_size)
            if step is MigrationStep.WAIT:
                continue
            if step is MigrationStep.GIVE_UP:
                seq.migration = None
                self._release_target(m.handoff)
                self._on_migrated(req, MigrationOutcome.NO_CONVERGENCE, 0.0, m.handoff.num_copied_pages)
                continue
            h, transfer = m.handoff, self.transfers[m.handoff.target.name]
            if step is MigrationStep.STOP:  # copy the rest, partial page included, and hand it off
                self.scheduler.running.remove(seq)
                self.scheduler.release_speculation(seq)
                seq.handoff, seq.migration = h, None
                self._copy_pages(seq, h, -(-req.num_computed_tokens // self.pool.page_size))
                self._hand_off(seq, migrated_at=time.monotonic())
                continue
            m.num_rounds += 1
            m.round_done = False
            self._copy_pages(seq, h, req.num_computed_tokens // self.pool.page_size)  # full pages only
            transfer.after_copies(functools.partial(self._round_done_after, m))

    def _round_done_after(self, m: Migration, landed: object) -> None:
        self._round_done(m)

    def _round_done(self, m: Migration) -> None:
        """From the copy thread: a round's copies are issued (on CPU: done); wake the loop for the next."""
        m.round_done = True
        self._inbox.put(None)

    def _copy_pages(self, seq: Seq, h: Handoff, end: int) -> None:
        """Copies pages [h.num_sent_pages, end) of a decoding request to its target, every layer (full pages are
        never written again; a partial one is sent only when it stops here)."""
        first = h.num_sent_pages
        if end <= first:
            return
        transfer = self.transfers[h.target.name]
        pages = transfer.page_indices(seq.page_table[first:end], h.pages[first:end], (seq.req.request_id,))
        for layer in range(self.pool.num_layers):
            if layer not in self.pool.window_layers:  # their last window goes when it stops here (_copy_window)
                transfer.copy_layer(layer, pages)
        h.num_sent_pages = end
        h.num_copied_pages += end - first

    def _release_target(self, h: Handoff) -> None:
        """Gives a move's pages on the target back, after every copy already queued into them."""
        self.transfers[h.target.name].after_copies(lambda landed: h.target.send(FreePages(h.pages, landed,
                                                                                         h.window)))

    # ---- steps ---------------------------------------------------------------------------------------
    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if batch is None:
            return
        start = self._step_start = time.monotonic()
        for seq in batch.seqs[batch.num_decodes:]:
            if seq.req.prefill_start is None:
                seq.req.prefill_start = start
        if self.failure is not None:  # what the router placed here before it saw the device dead
            self._wait_loads()
            self._finish(self.scheduler.fail_all(f"device {self.name} failed (the error is in the server log)"))
            return
        outcomes = self._sample(batch, self._forward(batch))
        self._loads = {seq: job for seq, job in self._loads.items() if seq.load is not None}
        # A sampling failure is the request's own (its parameters, its grammar); a forward failing for every
        # request, step after step, is the device's.
        forward_failed = [o for o in outcomes if isinstance(o, Exception) and not isinstance(o, SamplingFailed)]
        self._count_failed_step(len(forward_failed) == len(outcomes), next(iter(forward_failed), None))
        end = time.monotonic()
        decodes, prefills = batch.chunks[:batch.num_decodes], batch.chunks[batch.num_decodes:]
        self.num_computed_prompt_tokens += sum(len(c.token_ids) for c in prefills)
        # a verify step's guesses are decode rows: the cost model sees each (a row attends up to its position)
        self.records.append(StepRecord(start, end, sum(len(c.token_ids) for c in prefills),
                                       sum(len(c.token_ids) for c in decodes),
                                       sum(len(c.token_ids) * c.start_pos + c.num_draft_tokens * (c.num_draft_tokens + 1) // 2
                                           for c in decodes),
                                       sum(len(c.token_ids) * (c.start_pos + len(c.token_ids) / 2) for c in prefills),
                                       sum(len(o) if isinstance(o, list) else 1 for o in outcomes[:batch.num_decodes]),
                                       sum(c.num_draft_tokens for c in decodes)))
        self._finish(self.scheduler.postprocess(batch, outcomes, end))

    def _count_failed_step(self, failed: bool, error: BaseException | None) -> None:
        self.num_failed_steps = self.num_failed_steps + 1 if failed else 0
        if self.num_failed_steps >= MAX_FAILED_STEPS and self.failure is None:
            self.failure = f"every request of its last {MAX_FAILED_STEPS} steps failed ({type(error).__name__}: " \
                           f"{error})"
            log.error("worker %s: device taken for dead: %s; /health now answers 503 and the watchdog stops, so "
                      "systemd restarts the service", self.name, self.failure)

    def _forward(self, batch: Batch) -> list[torch.Tensor | Exception | None]:
        """Per sequence: its logits row, None if it wants none, or the exception that failed it.

        If the batch fails, each sequence is re-run alone, so a fault in one request fails that request only.
        Re-running is safe: K/V writes go to the same slots with the same values. The pages a chunk sends to
        another device count as sent only once its forward succeeded, so a retry sends them again.
        """
        chunks = batch.chunks
        plan = self._copy_plan(batch, range(len(chunks)))
        try:
            logits = self.runner.run(chunks, self._layer_hook(plan), self._load_hook(batch.seqs))
            results: list[torch.Tensor | Exception | None] = list(_per_chunk(chunks, logits))
            plan.commit(range(len(chunks)))
            return results
        except Exception as e:  # find which request fails, alone: slower, so say so every time
            self.num_batch_failures += 1
            log.warning("worker %s: a batch of %d sequences failed (%s: %s); running each alone", self.name,
                        len(chunks), type(e).__name__, e)
        results = []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, chunks)):
            plan = self._copy_plan(batch, [i])
            try:
                logits = self.runner.run([chunk], self._layer_hook(plan), self._load_hook([seq]))
                results.append(next(_per_chunk([chunk], logits)))
                plan.commit([i])
            except Exception as e:
                log.error("worker %s: request %s failed: %s\n%s", self.name, seq.req.request_id, e,
                          "".join(traceback.format_exception(e)))
                results.append(e)
        return results

    def _sample(self, batch: Batch, results: list[torch.Tensor | Exception | None]
                ) -> list[TokenEvent | list[TokenEvent] | Exception | None]:
        """Samples every row that has logits. A decode with guesses (a verify step) is sampled position by
        position, as decoding would, from the logits its guesses gave: while the token sampled equals the next
        guess (and does not end the request), the next position's logits stand and are sampled too; its outcome
        is the tokens kept. Sampling draws from the request's own generator and advances its grammar only for
        tokens kept, so nothing is rolled back: seeded output is the same with speculation on or off, and at any
        temperature each token comes from the target distribution."""
        outcomes: list[TokenEvent | list[TokenEvent] | Exception | None] = \
            [None if isinstance(r, torch.Tensor) else r for r in results]
        live = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        kept: dict[int, list[TokenEvent]] = {i: [] for i in live if batch.chunks[i].num_draft_tokens}
        for i in [i for i in kept if _plain_greedy(batch.seqs[i].req)]:
            outcomes[i] = self._verify_greedy(batch.seqs[i].req, batch.chunks[i].token_ids[1:],
                                              cast(torch.Tensor, results[i]))
            del kept[i]
            live.remove(i)
        depth = 0
        while live:
            sampled = self._sample_depth(batch, results, live, depth, kept)
            next_live = []
            for i in live:
                event = sampled[i]
                if i not in kept or isinstance(event, Exception):
                    outcomes[i] = event
                    continue
                kept[i].append(event)
                req, drafts = batch.seqs[i].req, batch.chunks[i].token_ids[1:]
                num_output = len(req.output_ids) + len(kept[i])
                if depth < len(drafts) and event.token_id == drafts[depth] and event.token_id is not None and \
                        self.scheduler.finish_reason(req, event.token_id, num_output) is None:
                    next_live.append(i)
                else:
                    outcomes[i] = kept[i]
            live, depth = next_live, depth + 1
        return outcomes

    def _verify_greedy(self, req: Request, drafts: Sequence[int], logits: torch.Tensor) -> list[TokenEvent]:
        """_sample's loop for a request whose next token is its logits' argmax and nothing else: every position's
        argmax in one call, the same tokens the loop's one call a position gives."""
        events = []
        for depth, token in enumerate(greedy(logits).tolist()):
            events.append(TokenEvent(token))
            if depth >= len(drafts) or token != drafts[depth] or \
                    self.scheduler.finish_reason(req, token, len(req.output_ids) + depth + 1) is not None:
                break
        return events

    def _sample_depth(self, batch: Batch, results: list, rows: list[int], depth: int,
                      kept: dict[int, list[TokenEvent]]) -> dict[int, TokenEvent | Exception]:
        """One batched sampler call over rows (at `depth` of the verify steps'); if it raises, each row alone, so
        a request whose sampling fails (its parameters, its grammar) fails alone, as a failed forward does."""
        try:
            return self._sample_rows(batch, results, rows, depth, kept)
        except Exception:
            pass
        outcomes: dict[int, TokenEvent | Exception] = {}
        for i in rows:
            try:
                outcomes.update(self._sample_rows(batch, results, [i], depth, kept))
            except Exception as e:
                log.error("worker %s: sampling request %s failed: %s\n%s", self.name,
                          batch.seqs[i].req.request_id, e, "".join(traceback.format_exception(e)))
                outcomes[i] = SamplingFailed(str(e))
        return outcomes

    def _sample_rows(self, batch: Batch, results: list, rows: list[int], depth: int = 0,
                     kept: Mapping[int, list[TokenEvent]] | None = None) -> dict[int, TokenEvent | Exception]:
        reqs = [batch.seqs[i].req for i in rows]
        kept = kept or {}
        extra = [len(kept.get(i, ())) for i in rows]  # tokens kept before this position
        # what each row's request has output before this position, copied only where the sampler reads more than
        # its length-independent parts (penalties count it; min_tokens reads its length): never the hot greedy case
        outputs = [r.output_ids + [e.token_id for e in kept[i] if e.token_id is not None]
                   if n and (r.params.has_penalties or len(r.output_ids) < r.params.min_tokens) else r.output_ids
                   for i, r, n in zip(rows, reqs, extra)]
        for req, n in zip(reqs, extra):
            req.generator = self.sampler.request_generator(req.generator, req.params.seed, len(req.output_ids) + n)
        logits = torch.stack([results[i] if results[i].dim() == 1 else results[i][depth] for i in rows])
        out = self.sampler(logits, [r.params for r in reqs], [r.prompt_ids for r in reqs], outputs,
                           [r.generator for r in reqs], [r.grammar for r in reqs])
        outcomes: dict[int, TokenEvent | Exception] = {
            i: TokenEvent(out.token_ids[k], out.logprobs[k] if out.logprobs is not None else None,
                          out.top_logprobs[k] if out.top_logprobs is not None else None)
            for k, i in enumerate(rows)}
        for k, seconds in out.slow_grammar_rows.items():
            log.warning("worker %s: request %s's grammar mask took %.0f ms in one step; the request is ended",
                        self.name, reqs[k].request_id, seconds * 1000)
            outcomes[rows[k]] = SamplingLimit(
                f"structured output: computing the grammar's allowed tokens took {seconds * 1000:.0f} ms in one "
                f"step, over the limit of {MASK_FILL_BUDGET_S * 1000:.0f} ms; simplify the schema or grammar")
        return outcomes

    def _finish(self, out: StepOutput) -> None:
        """Acts on a step's outcome: hands prefilled requests to their transfers, reports what ended."""
        if out.num_prompt_tokens_done:
            with self._lock:
                self.num_outstanding_prefill_tokens -= out.num_prompt_tokens_done
        for seq in out.handoffs:
            self._hand_off(seq)
        if out.handoffs:  # a request waiting for a seat may go now: see Engine._room
            self._on_room()
        if out.events:
            self._emit_batch(out.events)
        for seq in out.migrations_ended:
            num_copied = seq.handoff.num_copied_pages if seq.handoff is not None else 0
            self._on_migrated(seq.req, MigrationOutcome.FINISHED, 0.0, num_copied)
        if out.released:
            self._on_released(out.released)

    def _copy_plan(self, batch: Batch, which: Iterable[int]) -> CopyPlan:
        return copy_plan([(i, batch.seqs[i].req.request_id, batch.seqs[i].page_table, h,
                           batch.seqs[i].req.num_computed_tokens, len(batch.chunks[i].token_ids))
                          for i in which if i >= batch.num_decodes and (h := batch.seqs[i].handoff) is not None],
                         self.pool.page_size)

    def _layer_hook(self, plan: CopyPlan) -> Callable[[int], None] | None:
        """Per-layer copy of the pages each remote-bound prefill chunk writes, started as soon as the layer is done."""
        if not plan.copies:
            return None
        page_maps = [(self.transfers[c.target.name], self.transfers[c.target.name].page_indices(c.src, c.dst,
                                                                                         tuple(c.request_ids)))
                     for c in plan.copies]

        window_layers = self.pool.window_layers  # their pages go at the handoff, the last window only

        def on_layer_done(layer: int) -> None:
            if layer in window_layers:
                return
            for transfer, pages in page_maps:
                transfer.copy_layer(layer, pages)

        return on_layer_done

    def _load_hook(self, seqs: list[Seq]) -> Callable[[int], None] | None:
        """Before each layer: wait for that layer of the pages still being loaded for these sequences."""
        jobs = [job for s in seqs if (job := self._loads.get(s)) is not None and not job.finished]
        if not jobs:
            return None

        loader = self.loader
        if loader is None:  # jobs exist only where a loader made them
            return None

        def before_layer(layer: int) -> None:
            for job in jobs:
                loader.wait_layer(job, layer)

        return before_layer

    def _wait_loads(self) -> None:
        """Before failing every request here: loads still writing into their pages end first."""
        if self.loader is not None:
            for job in self._loads.values():
                self.loader.wait(job)
        self._loads.clear()

    def _hand_off(self, seq: Seq, migrated_at: float | None = None) -> None:
        """Queues the end of a request's transfer, after every copy already queued for it: its pages here are
        freed, and its target receives it (or, if it ended or a copy failed, frees its pages there)."""
        h, req = seq.handoff, seq.req
        if h is None:
            raise RuntimeError(f"request {req.request_id} has no handoff to finish")
        src, seq.page_table = seq.page_table, []
        transfer = self.transfers[h.target.name]
        if seq.window is not None:  # the windowed layers' last window, then this device's window pages go back
            self._copy_window(seq, h, transfer)
        transfer.finish(
            req.request_id, src, lambda landed, error: h.target.send(
                Arrival(req, h.pages, h.num_cached_pages, landed, error, migrated_at, h.num_copied_pages, h.window)),
            h.num_copied_pages, h.num_cached_pages)

    def _copy_window(self, seq: Seq, h: Handoff, transfer: KVTransfer) -> None:
        """Copies the windowed layers' pages the target's first query reads (the last window: a prompt's after its
        prefill, a decoding request's when it stops here to move), then gives this device's window pages back once
        the copies have read them."""
        window, target, req = seq.window, h.window, seq.req
        seq.window = None
        if window is None:
            return
        # Only a prompt prefilled whole goes on (a handoff after its prefill, or a move while it decodes).
        if target is not None and req.num_computed_tokens >= req.num_prompt_tokens and not req.finished:
            target.advance(req.num_computed_tokens, req.num_computed_tokens)  # drawn at placement for a handoff
            live = target.live_pages(req.num_computed_tokens)
            pages = transfer.page_indices([window.table[p] for p in live], [target.table[p] for p in live],
                                          (req.request_id,))
            for layer in sorted(self.pool.window_layers):
                transfer.copy_layer(layer, pages)
        transfer.after_copies(lambda landed: self.send(FreePages([], landed, window)))
