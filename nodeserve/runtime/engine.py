"""Engine: owns the devices' workers and transfers; the event loop's way to add, stream and abort requests."""

from __future__ import annotations

import asyncio
import itertools
from functools import partial
import os
import logging
import time
from dataclasses import replace
from typing import Any, Callable

from nodeserve.config import Config, ConfigError
from nodeserve.core.admission import QueueFull, SloAdmission, TooLarge
from nodeserve.core.cost_model import FEATURES, StepModel
from nodeserve.core.handoff import MigrationOutcome
from nodeserve.core.load import SloTarget, StepLimits
from nodeserve.core.placer import AdaptivePlacer, Placer, PlacerTiming, StaticPlacer
from nodeserve.core.prefill_order import DeadlineOrder
from nodeserve.core.roles import ROLE_TICK_S
from nodeserve.core.side_prefill import SidePrefill
from nodeserve.core.request import Request, TokenEvent
from nodeserve.metrics import PoolStats
from nodeserve.core.sampling_params import SamplingParams, resolve_max_tokens
from nodeserve.kv.events import event_hash
from nodeserve.model.config import ModelConfig
from nodeserve.model.loader import LoadedModel
from nodeserve.runtime.kv_events import KVEventPublisher
from nodeserve.runtime.kv_tiers import KVTiers
from nodeserve.runtime.lending import CoreLending
from nodeserve.runtime.loads import NodeLoad, decode_rate
from nodeserve.runtime.node import NodeEvents, build_node
from nodeserve.runtime.router import Router, role_changes_since
from nodeserve.runtime.stream import RequestStream
from nodeserve.runtime.transfer import KVTransfer
from nodeserve.runtime.worker import Worker

log = logging.getLogger(__name__)

REFINE_INTERVAL_S = 1.0  # refit the cost model from fresh step records at most this often
STOP_JOIN_S = 5.0  # at a stop, the workers', transfers' and loaders' threads are joined within this, together
PREFIX_RETRY_S = 0.02    # while a request waits for a prefix another is computing, dispatch again this often

__all__ = ["Engine", "RequestStream", "QueueFull", "TooLarge", "PromptTooLong"]


class PromptTooLong(Exception):
    """The prompt does not fit in the model's context (400)."""


PLACEMENT_FAILED = "placing the request on a device failed (the error is in the server log)"


def window_config(config: Config, model: ModelConfig) -> Config:
    """The config a model with sliding-window layers runs under: with kv.window_pages = "free" those layers keep
    only their window's pages (kv/window.py). The prefix cache keeps both kinds on each device, handoffs and live
    moves carry the last window; the host and disk tiers and the fetch across devices, which move whole-model
    pages, are off (said once at start).
    Raises ConfigError where [kv_events] asks for whole-model pages."""
    if config.kv.window_pages != "free" or not any(model.window(i) for i in range(model.num_layers)):
        return config
    if config.kv_events.enabled:
        raise ConfigError("KV events report whole-model pages, which a model with sliding-window layers keeps only "
                          "with kv.window_pages = \"keep\" (every layer keeps every page)")
    if config.kv.prefix_cache and (config.kv.host_memory_gib != 0 or config.kv.disk_gib > 0):
        log.warning("this model has sliding-window layers, which keep only their window's KV pages "
                    "(kv.window_pages = \"free\"): the prefix cache stays on each device, but its host and disk "
                    "tiers and fetching prefixes across devices are off; kv.window_pages = \"keep\" keeps every "
                    "page and them")
    return replace(config, kv=replace(config.kv, host_memory_gib=0.0, disk_gib=0.0, disk_path=""))


MAX_SPEC_FIT_ERROR = 0.3  # the profile fit's RMS relative error past which speculation does not weigh by it


class Engine:
    def __init__(self, config: Config, loaded: LoadedModel,
                 on_transfer: Callable[[float, int, int], None] | None = None,
                 on_migration: Callable[[str, float, int], None] | None = None, draft: LoadedModel | None = None,
                 disk_lock: int | None = None):
        """on_transfer(seconds, bytes copied, bytes the decode device already held) is called from transfer
        threads once per handed-off request; on_migration(outcome, downtime seconds, pages copied) from the event
        loop once per move between devices. draft: speculative.method = "draft"'s model, loaded here if None;
        disk_lock: kv.disk_path's lock, where the server took it before the model load (kv/disk.lock_path)."""
        self.disk_lock = disk_lock
        self.config, self.loaded = window_config(config, loaded.config), loaded
        if config.speculative.method == "draft" and draft is None:
            from nodeserve.speculative.draft_model import load_draft

            draft = load_draft(config, loaded)
        self.draft = draft
        self.on_transfer, self.on_migration = on_transfer, on_migration
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.model.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.prefill_workers: list[Worker] = []
        self.decode_workers: list[Worker] = []
        self.transfers: list[KVTransfer] = []
        self.streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.router: Router | None = None
        self.warnings: list[str] = []  # said at start and shown in /health: e.g. a CUDA host without FlashInfer
        self.profiler = None  # the cost model (runtime/profiler.py), measured at the end of warmup()
        self._refined = 0.0
        self.tiers: KVTiers | None = None  # the host and disk tiers and the loaders (prefix_cache on)
        self._prefix_retry_armed = False
        self._room_due = False  # a _room call is scheduled on the loop
        self._stopped = False
        self.kv_events: KVEventPublisher | None = None  # [kv_events]
        self.lending: CoreLending | None = None         # devices.lend_idle_cores

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Builds the node (runtime/node.py) and starts its threads."""
        self._loop = loop
        node = build_node(self.config, self.loaded, self.max_model_len, NodeEvents(
            self._emit_batch_threadsafe, self._released_threadsafe, self._migrated_threadsafe, self.on_transfer,
            self.on_migration or (lambda outcome, downtime, num_pages: None), self._arm_prefix_retry,
            self._placement_failed, self._room_threadsafe), self.draft)
        self.prefill_workers, self.decode_workers, self.transfers = node.prefill_workers, node.decode_workers, \
            node.transfers
        self.router, self.tiers, self.kv_events, self.lending = node.router, node.tiers, node.kv_events, node.lending
        self.warnings = node.warnings
        node.start()
        if self.config.devices.mode == "adaptive":
            loop.call_later(ROLE_TICK_S, self._role_tick)

    def warmup(self) -> None:
        """Before serving: FP8 KV scales for every FP8 pool, then on CUDA one prefill and decode per device
        (FlashInfer JIT) and the decode graphs. Blocking (minutes on a cold JIT cache); seconds on CPU.

        The scales are measured once, on the first FP8 pool's device, and copied to every other pool: the
        transfer moves raw bytes, so a prefill pool and a decode pool must read them with the same scales,
        which two measurements on different GPUs need not give bit for bit."""
        from nodeserve.runtime.kv_calibration import calibrate_kv_scales, calibration_token_ids
        from nodeserve.runtime.warmup import warmup_runner

        fp8_workers = [w for w in self.workers if w.pool.is_fp8]
        if fp8_workers:
            first = fp8_workers[0]
            start = time.monotonic()
            ids = calibration_token_ids(self.tokenizer)
            calibrate_kv_scales(first.runner.model, first.pool, ids)
            for w in fp8_workers[1:]:
                w.pool.use_scales(first.pool.k_scales, first.pool.v_scales)
            log.info("FP8 KV scales from %d calibration tokens on %s in %.1fs: K %.3g to %.3g, V %.3g to %.3g",
                     len(ids), first.name, time.monotonic() - start, min(first.pool.k_scales),
                     max(first.pool.k_scales), min(first.pool.v_scales), max(first.pool.v_scales))
        for w in self.workers:
            warmup_runner(w.runner)
        if self.tiers is not None:  # the disk's fingerprint names the FP8 scales, known from here on
            self.tiers.start_disk(self.config, self.loaded, self.disk_lock)
        elif self.disk_lock is not None:  # no tiers after all (no prefix cache, window pages)
            os.close(self.disk_lock)
        self.disk_lock = None
        self._install_policy()

    def _install_policy(self) -> None:
        """The cost model (measured unless profile.startup is false) and, with a profile, SLO admission and, in
        adaptive mode, the adaptive placer. /debug/profile reads the profiler."""
        from nodeserve.runtime.profiler import Profiler

        cfg = self.config
        self.profiler = Profiler(self.workers)
        if not cfg.profile.startup:
            return
        self.profiler.measure(cfg.profile.budget_s)
        for w in self.workers:  # speculation weighs guesses by the device's own step times
            m = self.profiler.model.devices.get(w.name)
            # The profile's fit, kept: its decode batches of 1 to N rows tell a row's cost from a step's; the
            # online refits see mostly one batch size and can move cost between the two at will. A fit that
            # finds rows free, or misses by more than MAX_SPEC_FIT_ERROR (a profile taken on a starved core),
            # is not used: guesses are then kept by their odds alone.
            if w.scheduler.speculator is not None and m is not None and m.rel_error is not None and \
                    m.rel_error <= MAX_SPEC_FIT_ERROR and m.coef[FEATURES.index("decodes")] > 0:
                fitted = StepModel(coef=list(m.coef), kernels=m.kernels)
                w.scheduler.speculator.use_step_model(lambda fitted=fitted: fitted)
            elif w.scheduler.speculator is not None:
                log.info("%s: speculation keeps guesses by their odds alone (the start-up profile's fit is %s)",
                         w.name, "missing" if m is None else f"off by {m.rel_error or 0:.0%} or finds rows free")
        limits = StepLimits(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
        slo = SloTarget(cfg.slo.ttft_s, cfg.slo.tpot_s, cfg.slo.ttft_per_token_s)
        cost = self.cost_model
        adaptive = AdaptivePlacer(cost, limits, slo, [w.name for w in self.workers]) \
            if cfg.devices.mode == "adaptive" else None
        placer: Placer | None = adaptive
        if adaptive is None:
            # the decode device is where a request ends soonest by the step models; a short prompt stays on its
            # decode device while the prefill device is busy only if it ends sooner there beside the decodes (its
            # chunks sized as below; by tokens where decode_prefill_chunk fixes them)
            side_step_s = slo.max_side_step_s if cfg.scheduler.decode_prefill_chunk == 0 else None
            placer = StaticPlacer(cfg.devices.local_prefill_threshold, cfg.devices.local_prefill_when_busy,
                                  PlacerTiming(cost, limits, side_step_s))
        self.router.use_policy(SloAdmission(slo, cfg.slo.admission == "reject", cfg.slo.margin, limits, cost,
                                            cfg.devices.local_prefill_threshold, adaptive), placer)
        if cfg.scheduler.decode_prefill_chunk == 0:  # auto: sized by each decode device's own step model
            for w in self.workers:
                if w.scheduler.limits.max_prefill_with_decodes:
                    w.scheduler.use_side_prefill(SidePrefill(
                        partial(self._step_model, w.name), slo.max_side_step_s,
                        w.scheduler.limits.max_prefill_with_decodes))
        if cfg.scheduler.prefill_order == "deadline":
            # Workers read the model as it stands (the router's thread refits it): a refit swaps whole lists.
            for w in self.workers:
                w.scheduler.use_order(DeadlineOrder(w.name, slo, limits, lambda: self.profiler.model,
                                                    time.monotonic))

    def _step_model(self, device: str) -> StepModel | None:
        """One device's step model as the profiler holds it now (refitted online)."""
        return self.profiler.model.devices.get(device) if self.profiler is not None else None

    def cost_model(self):
        """The cost model as the profiler holds it, refitted from fresh step records at most once a second."""
        now = time.monotonic()
        if now - self._refined > REFINE_INTERVAL_S:
            self.profiler.refine()
            self._refined = now
        return self.profiler.model

    def stop(self, join_timeout: float = STOP_JOIN_S) -> None:
        """Stops every thread, all joined within join_timeout s together; then, with a disk tier, writes the pages
        cached on the devices there (a restart finds them) within kv.stop_flush_timeout."""
        self._stopped = True
        deadline = time.monotonic() + join_timeout

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        for w in self.workers:
            w.stop(left())
        for t in self.transfers:
            t.stop(left())
        if self.lending is not None:
            self.lending.stop()
        if self.tiers is not None:
            self.tiers.stop(deadline)
        if self.kv_events is not None:  # last: the stop's own flush to disk is reported too
            self.kv_events.stop()

    @property
    def workers(self) -> list[Worker]:
        return self.prefill_workers + self.decode_workers

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    grammar: Any = None, default_max_tokens: int | None = None) -> RequestStream:
        """Admits a request (grammar: its structured-output matcher, or None; default_max_tokens: its route's, for
        resolve_max_tokens). Raises PromptTooLong, TooLarge (both 400) or QueueFull (503)."""
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLong(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"request has {len(prompt_ids)} input tokens. Please reduce the length of the input.")
        if any(t < 0 or t >= self.loaded.config.vocab_size for t in prompt_ids):
            raise PromptTooLong(f"the prompt has token ids outside the vocabulary [0, {self.loaded.config.vocab_size})")
        params = replace(params, max_tokens=resolve_max_tokens(
            params.max_tokens, route_default=default_max_tokens, server_limit=self.config.server.max_tokens_limit,
            context_len=self.max_model_len, max_kv_tokens=self.router.max_seq_tokens,
            num_prompt_tokens=len(prompt_ids)))
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, grammar=grammar)
        stream = RequestStream(req)
        req.emit = stream.put
        self.streams[req.request_id] = stream
        try:
            self.router.admit(req)
        except (QueueFull, TooLarge):
            del self.streams[req.request_id]
            raise
        return stream

    def fail_all(self, message: str) -> None:
        """Ends every in-flight request with an error event (the drain timeout ran out) and frees its pages."""
        for stream in list(self.streams.values()):
            stream.put(TokenEvent(None, finish_reason="error", error=message))
            self.abort(stream)  # the stream is closed: only the pages are left to free

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Ends a request now; its pages on every device are freed by whoever holds it, at its next step."""
        req = stream.request
        self.streams.pop(req.request_id, None)
        if req.finished or req.aborted:
            return
        stream.put(TokenEvent(None, finish_reason=reason))  # wakes a reader waiting on the next event
        req.aborted = True
        if self.router.abort_pending(req):
            return
        for w in self.workers:
            w.send(None)

    # ---- from worker threads ---------------------------------------------------------------------------
    def _emit_batch_threadsafe(self, events: list[tuple[Request, TokenEvent]]) -> None:
        self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[tuple[Request, TokenEvent]]) -> None:
        for req, event in events:
            req.emit(event)
            if event.finish_reason is not None:
                self.streams.pop(req.request_id, None)
        if self.router.waiting_for_prefix:  # a step published pages: a request waiting for them may go now
            self.router.dispatch()

    def _placement_failed(self, req: Request) -> None:
        """From inside the router's dispatch: only ends the stream (_deliver would dispatch again, re-entering)."""
        req.emit(TokenEvent(None, finish_reason="error", error=PLACEMENT_FAILED))
        self.streams.pop(req.request_id, None)

    def _released_threadsafe(self, requests: list[Request]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._released, requests)

    def _migrated_threadsafe(self, req: Request, outcome: MigrationOutcome, downtime: float, num_pages: int) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.router.on_migrated, req, outcome, downtime, num_pages)

    def migrate(self, request_id: str, device: str, live: bool = True) -> bool:
        """Moves a running request's decode to `device` (live: pre-copy rounds; else stop and copy). From the
        event loop. False if it cannot start (not placed, already moving, no seat or pages there)."""
        req, target = self.router.placed.get(request_id), self.router.workers.get(device)
        return req is not None and target is not None and target in self.decode_workers and \
            self.router.migrate(req, target, live)

    def _arm_prefix_retry(self) -> None:
        """A request waits for pages another is computing. Pages published reach the router with their step's
        tokens (_deliver), but pages freed unpublished (an abort) may be freed after the last event the router
        sees: a timer makes sure the wait ends either way."""
        if not self._prefix_retry_armed:
            self._prefix_retry_armed = True
            self._loop.call_later(PREFIX_RETRY_S, self._prefix_retry)

    def _prefix_retry(self) -> None:
        self._prefix_retry_armed = False
        if self.router.waiting_for_prefix:
            self.router.dispatch()  # arms the timer again if a request still waits

    def _room_threadsafe(self) -> None:
        if not self._room_due and self._loop is not None and not self._loop.is_closed():
            self._room_due = True  # a burst of frees (one a copied prompt) asks for one dispatch
            self._loop.call_soon_threadsafe(self._room)

    def _room(self) -> None:
        """A device has room that no ended request made: prompts it prefilled left its queue, or its copied pages
        came back. A request waiting for that (a prefill device's pages; in adaptive mode a decode seat, which a
        prefill device with nothing queued gives back: core/roles.py free_a_seat) is placed now, not at the next
        request's end, which under long decodes came ~45 s later while the prefill device idled."""
        self._room_due = False
        if self.router.num_pending:
            self.router.dispatch()

    def _role_tick(self) -> None:
        """Adaptive mode: the role changes due with no request to place (a dedicated device given back once its
        demand ended, taking a share of the decodes), every ROLE_TICK_S while the engine runs."""
        if self._stopped or self._loop is None or self._loop.is_closed() or self.router is None:
            return
        try:
            self.router.update_roles()
        except Exception:  # a policy fault must not stop the ticks; placements still run the policy
            log.exception("updating adaptive roles failed")
        self._loop.call_later(ROLE_TICK_S, self._role_tick)

    def _released(self, requests: list[Request]) -> None:
        for req in requests:
            self.router.release(req)
        self.router.dispatch()

    # ---- introspection -------------------------------------------------------------------------------
    def pool_stats(self) -> list[PoolStats]:
        changes = self.router.num_role_changes if self.router else {}
        return [PoolStats(w.name, str(w.role), w.kv.num_usable, w.kv.num_free, len(w.scheduler.running),
                          len(w.scheduler.waiting), w.kv.num_queried_tokens, w.kv.num_hit_tokens,
                          changes.get(w.name, 0), w.num_batch_failures, w.kv.num_evictions,
                          w.num_computed_prompt_tokens, w.lent_seconds,
                          *((w.window.manager.num_usable, w.window.manager.num_available) if w.window else (0, 0)),
                          *_spec_counts(w))
                for w in self.workers]

    def node_load(self) -> NodeLoad:
        """The node as one worker (from the event loop): what vLLM's gauges and SMG's /v1/loads report."""
        r, now = self.router, time.monotonic()
        started = sum(1 for req in r.placed.values() if req.prefill_start is not None)
        pools = [w.kv for w in self.decode_workers]
        return NodeLoad(started, r.num_pending + len(r.placed) - started, r.num_queued_tokens,
                        sum(kv.num_usable for kv in pools), sum(kv.num_free for kv in pools), pools[0].page_size,
                        self.config.scheduler.max_num_seqs * len(pools), r.num_prefix_queried_tokens,
                        r.num_prefix_hit_tokens, sum(decode_rate(w.records, now) for w in self.workers))

    def flush_cache(self) -> int:
        """Drops every cached page no request holds, in every pool and the host tier (not the disk tier: a
        restart's cache). Returns the pages dropped."""
        num = sum(w.kv.drop_cached() + (w.window.manager.drop_cached() if w.window is not None else 0)
                  for w in self.workers)
        if self.tiers is not None and self.tiers.host is not None:
            num += self.tiers.host.index.drop_cached()
        return num

    def kv_index(self) -> dict[str, list[int]]:
        """Every cached page hash (as the KV events carry it) by where it is: each device, "host", "disk". What a
        subscriber to the KV events should hold once they are all delivered."""
        index = {w.name: [h for _, h in w.kv.cached_pages()] for w in self.workers}
        if self.tiers is not None and self.tiers.host is not None:
            index["host"] = [h for _, h in self.tiers.host.index.cached_pages()]
        if self.tiers is not None and self.tiers.disk is not None:
            index["disk"] = self.tiers.disk.hashes()
        return {medium: sorted(event_hash(h) for h in hashes) for medium, hashes in index.items()}

    def tier_stats(self) -> list:
        """The device pools as one tier (hits: prompt tokens fetched from another device), then the host and
        disk tiers; empty with the prefix cache off."""
        return self.tiers.stats() if self.tiers is not None else []

    def role_changes(self, since: float = 0.0) -> list[list]:
        """Adaptive mode's role changes at or after `since`: [time, device, new role, reason] (server clock)."""
        return role_changes_since(self.router.role_changes, since) if self.router else []

    def watched(self) -> list:
        """What the systemd watchdog checks (last_progress, failure): the workers and the KV loaders."""
        return [*self.workers, *(w.loader for w in self.workers if w.loader is not None)]

    def dead_threads(self) -> list[str]:
        """Workers and transfers whose thread died (what they hold never moves again), and workers whose device
        was taken for dead, with why: /health answers 503."""
        loaders = [w.loader for w in self.workers if w.loader is not None]
        return [x.name + (f": {x.failure}" if getattr(x, "failure", None) else "")
                for x in [*self.workers, *self.transfers, *loaders] if x.dead]

    @property
    def num_pending(self) -> int:
        return self.router.num_pending if self.router else 0



def _spec_counts(w: Worker) -> tuple[int, int, int, tuple[int, ...]]:
    """A worker's speculative decoding counters for PoolStats (zeros where it does not speculate)."""
    sp = w.scheduler.speculator
    if sp is None:
        return 0, 0, 0, ()
    c = sp.counts
    return c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, tuple(c.accepted_per_pos)
