"""Prometheus metrics for nodeserve, named like vLLM's with a `nodeserve:` prefix.

Each Metrics owns a private CollectorRegistry rather than the process-global one, so several servers (or
tests) in one process never collide over metric names. Nothing is registered at import time.

Request-level numbers (latency histograms, token and outcome counters) are pushed once per finished request
by the server from the request's timestamps. Device-level numbers (running/waiting requests, KV pages) are
pulled at scrape time from a callback, see _StateCollector.

Exposed names (histograms add _bucket/_count/_sum, counters add _total):
  histograms  nodeserve:time_to_first_token_seconds, nodeserve:inter_token_latency_seconds,
              nodeserve:request_time_per_output_token_seconds, nodeserve:e2e_request_latency_seconds,
              nodeserve:request_queue_time_seconds, nodeserve:request_prefill_time_seconds,
              nodeserve:request_decode_time_seconds, nodeserve:kv_transfer_time_seconds,
              nodeserve:kv_transfer_bytes,
              nodeserve:ttft_prediction_error_seconds (actual - predicted)         {model_name}
  counters    nodeserve:prompt_tokens_total, nodeserve:generation_tokens_total      {model_name}
              (as tokens are made, as vLLM counts per step: a prompt at its first token, each output
              token as it comes; at a request's end a 1,000-token answer read 0 tok/s for its whole run)
              nodeserve:request_success_total                        {model_name, finished_reason}
              nodeserve:request_rejected_total                       {model_name, reason}
  gauges      nodeserve:num_requests_running, nodeserve:num_requests_waiting   {model_name, device, role}
              (num_requests_waiting also has device="router", role="admission": requests the router holds
              until a decode device has pages and a batch seat for them, so its sum is every waiting request)
              nodeserve:kv_pages_used, nodeserve:kv_pages_free,
              nodeserve:kv_cache_usage_perc (a fraction 0..1, as in vLLM)      {model_name, device}
  counters    nodeserve:prefix_cache_queries_total, nodeserve:prefix_cache_hits_total (tokens),
              nodeserve:device_role_changes_total (adaptive mode)               {model_name, device}
              nodeserve:prompt_tokens_computed_total (prefilled, not cached)    {model_name, device}
  KV tiers    gauges nodeserve:kv_tier_pages_used, nodeserve:kv_tier_pages_free; counters
              nodeserve:kv_tier_hit_tokens_total, nodeserve:kv_tier_loaded_pages_total,
              nodeserve:kv_tier_loaded_bytes_total, nodeserve:kv_tier_load_seconds_total,
              nodeserve:kv_tier_evictions_total, nodeserve:kv_tier_bad_files_total,
              nodeserve:kv_tier_write_errors_total, nodeserve:kv_tier_read_timeouts_total
              {model_name, tier}: tier "device" is every pool (hits: fetched from another device),
              "host" and "disk" the tiers below (runtime/kv_tiers.py)
  KV events   counters nodeserve:kv_events_batches_total, nodeserve:kv_events_total,
              nodeserve:kv_events_dropped_batches_total, nodeserve:kv_events_replays_total,
              nodeserve:kv_events_replays_refused_total, nodeserve:kv_events_replays_abandoned_total,
              nodeserve:kv_events_lost_total {model_name}
              (only with [kv_events] on)
  vLLM's names, for routers in front of several nodes (SMG, the Inference Extension's endpoint picker,
  production-stack): each ONE series labelled model_name only, the node seen as one worker
  (runtime.loads.NodeLoad): gauges vllm:num_requests_running, vllm:num_requests_waiting,
  vllm:kv_cache_usage_perc and vllm:gpu_cache_usage_perc (the decode pools), vllm:cache_config_info{block_size,
  num_gpu_blocks} = 1; counters vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total and their gpu_
  forms (tokens, every cache tier); histograms vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds, vllm:request_prompt_tokens, vllm:request_generation_tokens; counters
  vllm:prompt_tokens_total, vllm:generation_tokens_total
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

__all__ = ["Metrics", "PoolStats", "FINISH_REASONS", "REJECT_REASONS"]

PREFIX = "nodeserve:"
VLLM = "vllm:"

FINISH_REASONS = ("stop", "length", "abort", "error")
STALL_CAUSES = ("busy", "starved", "blocked", "unseen", "gc")  # server/loop_monitor.py
REJECT_REASONS = ("queue_full", "slo", "too_large", "bad_request", "unauthorized", "draining")
MIGRATION_OUTCOMES = ("moved", "finished", "not_running", "no_convergence", "failed")  # core.handoff.MigrationOutcome

# Latency buckets span ~1 ms (a GPU decode step) to ~60 s (a long CPU prefill); finer where token-level
# latencies cluster (1-100 ms on GPU, 50 ms-1 s on CPU). Anything slower still lands in +Inf.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                    0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 40.0, 60.0)
# Tokens per request, vLLM's 1-2-5 series (to a million: any context length this server runs).
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
# Whole requests (e2e, queueing, decode) on CPU can run for minutes; a few more buckets keep them apart.
_REQUEST_BUCKETS = _LATENCY_BUCKETS + (120.0, 300.0, 600.0)
# One KV copy (a layer, or a whole request) can take well under a millisecond on GPU.
_TRANSFER_TIME_BUCKETS = (0.0001, 0.00025, 0.0005) + _LATENCY_BUCKETS
# Actual minus predicted TTFT: either sign, 10 ms to a minute.
_ERROR_BUCKETS = tuple(sorted({-b for b in _LATENCY_BUCKETS[4:]} | {0.0} | set(_LATENCY_BUCKETS[4:])))
# 4 KiB .. 4 GiB in powers of 4: a few pages of one layer up to a long prompt's full KV.
_LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_BYTES_BUCKETS = tuple(float(4096 * 4**i) for i in range(11))


@dataclass
class PoolStats:
    """One device's pool and load as seen at scrape time (Engine.pool_stats; /metrics, /debug/kv, the stats line)."""

    device: str
    role: str
    num_pages: int
    num_free: int
    num_running: int
    num_waiting: int
    num_prefix_queried_tokens: int = 0  # cumulative, per device: prompt tokens looked up in its prefix cache
    num_prefix_hit_tokens: int = 0      # ... and found there
    num_role_changes: int = 0           # cumulative: role changes (adaptive mode)
    num_batch_failures: int = 0         # cumulative: batched forwards that raised (each request then re-run alone)
    num_evictions: int = 0              # cumulative: cached pages its pool evicted
    num_computed_prompt_tokens: int = 0  # cumulative: prompt tokens prefilled here (not taken from a cache)
    lent_seconds: float = 0.0           # cumulative: its core lent to another device between its steps
    # its windowed layers' pages (kv/window.py; 0 where it has none): all, and those neither held nor promised
    num_window_pages: int = 0
    num_window_free: int = 0
    # cumulative, speculative decoding (core/speculation.SpecCounts): request-steps that verified guesses, the
    # guesses, those accepted, and those accepted per position
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        """Every page free again, window pages included: what an idle device shows (no page leaked)."""
        return self.num_free == self.num_pages and self.num_window_free == self.num_window_pages


class _StateCollector(Collector):
    """Gauges read from a callback at scrape time: the numbers live in worker threads and change every
    step, so reading them when Prometheus asks is cheaper and never stale, unlike pushing on each step."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], Sequence[Any]] | None = None
        self.pending: Callable[[], int] | None = None

    def _families(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        dr = ["model_name", "device", "role"]
        d = ["model_name", "device"]
        return (
            GaugeMetricFamily(PREFIX + "num_requests_running", "Requests running on a device (in its batch).",
                              labels=dr),
            GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting on a device for a batch slot, or "
                              "(device \"router\", role \"admission\") for KV pages in the router's queue.", labels=dr),
            GaugeMetricFamily(PREFIX + "kv_pages_used", "KV cache pages in use on a device.", labels=d),
            GaugeMetricFamily(PREFIX + "kv_pages_free", "KV cache pages free on a device.", labels=d),
            GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV cache usage on a device (1 means 100 percent).",
                              labels=d),
            CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in a device's prefix cache.",
                                labels=d),
            CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in a device's prefix cache.",
                                labels=d),
            CounterMetricFamily(PREFIX + "device_role_changes", "Role changes of a device (adaptive mode).",
                                labels=d),
            CounterMetricFamily(PREFIX + "batch_failures", "Batched forwards on a device that raised; each of their "
                                "requests was then run alone (slower), and only those failing again ended.",
                                labels=d),
            CounterMetricFamily(PREFIX + "prompt_tokens_computed", "Prompt tokens a device prefilled (not taken "
                                "from a cache of any tier).", labels=d),
            CounterMetricFamily(PREFIX + "core_lent_between_steps_seconds", "Seconds a decode device's CPU core "
                                "was lent to a prefill device between its decode steps (devices.lend_between_steps).",
                                labels=d),
        )

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Lets the registry check names without calling the source (which may not be set yet).
        return self._families()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        running, waiting, used, free, usage, queries, hits, role_changes, batch_failures, computed, lent = fams = \
            self._families()
        states: Sequence[Any] = ()
        num_pending = None
        if self.source is not None:
            try:
                states = list(self.source())
                num_pending = self.pending() if self.pending is not None else None
            except Exception:  # a failing source must not break the whole scrape
                log.exception("metrics: state source failed")
        if num_pending is not None:
            waiting.add_metric([self.model_name, "router", "admission"], num_pending)
        # Sum by label set: one sample per series even if a device ever hosts two workers.
        by_role: dict[tuple[str, str], list[int]] = {}
        by_dev: dict[str, list] = {}  # pages, free, queried, hit, role changes, batch failures, computed, lent s
        for s in states:
            r = by_role.setdefault((s.device, s.role), [0, 0])
            r[0] += s.num_running
            r[1] += s.num_waiting
            p = by_dev.setdefault(s.device, [0, 0, 0, 0, 0, 0, 0, 0.0])
            p[0] += s.num_pages
            p[1] += s.num_free
            p[2] += getattr(s, "num_prefix_queried_tokens", 0)
            p[3] += getattr(s, "num_prefix_hit_tokens", 0)
            p[4] += getattr(s, "num_role_changes", 0)
            p[5] += getattr(s, "num_batch_failures", 0)
            p[6] += getattr(s, "num_computed_prompt_tokens", 0)
            p[7] += getattr(s, "lent_seconds", 0.0)
        for (dev, role), (n_run, n_wait) in by_role.items():
            running.add_metric([self.model_name, dev, role], n_run)
            waiting.add_metric([self.model_name, dev, role], n_wait)
        for dev, (n_pages, n_free, n_queried, n_hit, n_roles, n_failures, n_computed, lent_s) in by_dev.items():
            computed.add_metric([self.model_name, dev], n_computed)
            lent.add_metric([self.model_name, dev], lent_s)
            queries.add_metric([self.model_name, dev], n_queried)
            hits.add_metric([self.model_name, dev], n_hit)
            role_changes.add_metric([self.model_name, dev], n_roles)
            batch_failures.add_metric([self.model_name, dev], n_failures)
            used.add_metric([self.model_name, dev], n_pages - n_free)
            free.add_metric([self.model_name, dev], n_free)
            usage.add_metric([self.model_name, dev], (n_pages - n_free) / n_pages if n_pages else 0.0)
        return fams


class _TierCollector(Collector):
    """The KV tiers, read at scrape time from TierStats-like objects (runtime/kv_tiers.py)."""

    FIELDS = (("kv_tier_pages_used", "gauge", "num_used", "KV pages a tier holds."),
              ("kv_tier_pages_free", "gauge", None, "KV pages a tier can still take without evicting."),
              ("kv_tier_hit_tokens", "counter", "num_hit_tokens", "Prompt tokens loaded from a tier instead of "
               "computed (tier device: from another device's pool)."),
              ("kv_tier_loaded_pages", "counter", "num_loaded_pages", "KV pages loaded from a tier."),
              ("kv_tier_loaded_bytes", "counter", "num_loaded_bytes", "Bytes of KV loaded from a tier."),
              ("kv_tier_load_seconds", "counter", "load_seconds", "Loader time spent on loads from a tier."),
              ("kv_tier_evictions", "counter", "num_evictions", "KV pages a tier evicted (device pools: to the "
               "host tier when there is one)."),
              ("kv_tier_bad_files", "counter", "num_bad_files", "Disk tier files skipped and removed: corrupt, "
               "truncated, of another model, or half-written."),
              ("kv_tier_dropped_pages", "counter", "num_dropped", "KV pages a tier did not take: the host tier, "
               "evicted pages past its per-eviction copy budget; the disk tier, pages not written (queue full, write failed)."),
              ("kv_tier_write_errors", "counter", "num_write_errors", "Disk tier writes that failed (a full disk): "
               "each pauses writes for a backoff, after which they resume."),
              ("kv_tier_read_timeouts", "counter", "num_read_timeouts", "Loads that gave up waiting for their disk "
               "pages (kv.disk_timeout), or skipped the disk while a read hung; they computed those pages."))

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], Sequence[Any]] | None = None

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return [(GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(PREFIX + name, doc,
                                                                                 labels=["model_name", "tier"])
                for name, kind, _, doc in self.FIELDS]

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fams = self._families()
        try:
            tiers = list(self.source()) if self.source is not None else []
        except Exception:
            log.exception("metrics: tier source failed")
            tiers = []
        for t in tiers:
            for fam, (_, _, attr, _) in zip(fams, self.FIELDS):
                value = getattr(t, attr) if attr is not None else t.num_pages - t.num_used
                fam.add_metric([self.model_name, t.tier], value)
        return fams


class _KVEventsCollector(Collector):
    """The KV-event publisher's counters (runtime/kv_events.py), when [kv_events] is on."""

    FIELDS = (("kv_events_batches", "num_batches", "KV-event batches numbered, sent or dropped."),
              ("kv_events", "num_events", "KV events (BlockStored, BlockRemoved, AllBlocksCleared) published."),
              ("kv_events_dropped_batches", "num_dropped_batches", "KV-event batches some subscriber lost at its "
               "high-water mark (the others got them; replay still has them)."),
              ("kv_events_replays", "num_replays", "Replay requests served."),
              ("kv_events_replays_refused", "num_replays_refused", "Replay requests answered with the end marker "
               "alone: a peer asking too often, or too many replays under way."),
              ("kv_events_replays_abandoned", "num_replays_abandoned", "Replays given up: their peer stopped "
               "reading or left."),
              ("kv_events_lost", "num_lost_events", "KV events dropped before publishing (the event log was full): "
               "subscribers see a sequence gap that replay cannot fill."))

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], dict] | None = None

    def describe(self) -> Iterable[CounterMetricFamily]:
        return [CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]) for name, _, doc in self.FIELDS]

    def collect(self) -> Iterable[CounterMetricFamily]:
        if self.source is None:
            return []
        stats = self.source()
        fams = self.describe()
        for fam, (_, key, _) in zip(fams, self.FIELDS):
            fam.add_metric([self.model_name], stats[key])
        return fams


class _SpecCollector(Collector):
    """Speculative decoding's counters from the same PoolStats, per device under our names and for the node under
    vLLM's (vllm:spec_decode_*, which dashboards built for vLLM read)."""

    def __init__(self, model_name: str, state: _StateCollector):
        self.model_name, self.state = model_name, state

    def _families(self) -> tuple[CounterMetricFamily, ...]:
        m, d = ["model_name"], ["model_name", "device"]
        fams = []
        for prefix, labels, scope in ((PREFIX, d, "on a device"), (VLLM, m, "on the node")):
            fams += [
                CounterMetricFamily(prefix + "spec_decode_num_drafts", f"Request-steps {scope} that verified at "
                                    "least one guessed token (speculative decoding).", labels=labels),
                CounterMetricFamily(prefix + "spec_decode_num_draft_tokens", f"Guessed tokens verified {scope}.",
                                    labels=labels),
                CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens", f"Guessed tokens accepted {scope}.",
                                    labels=labels),
                CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos", "Guessed tokens accepted "
                                    f"{scope}, by position in the guess (0: the first).", labels=labels + ["position"]),
            ]
        return tuple(fams)

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families()

    def collect(self) -> Iterable[CounterMetricFamily]:
        fams = self._families()
        states: Sequence[Any] = ()
        if self.state.source is not None:
            try:
                states = list(self.state.source())
            except Exception:
                log.exception("metrics: state source failed")
        node = [0, 0, 0]
        node_pos: list[int] = []
        for s in states:
            values = [getattr(s, "num_spec_drafts", 0), getattr(s, "num_spec_draft_tokens", 0),
                      getattr(s, "num_spec_accepted_tokens", 0)]
            labels = [self.model_name, s.device]
            for fam, v in zip(fams[:3], values):
                fam.add_metric(labels, v)
            per_pos = getattr(s, "spec_accepted_per_pos", ())
            for j, v in enumerate(per_pos):
                fams[3].add_metric(labels + [str(j)], v)
            node = [a + b for a, b in zip(node, values)]
            node_pos = [a + b for a, b in zip(node_pos + [0] * len(per_pos), list(per_pos) + [0] * len(node_pos))]
        for fam, v in zip(fams[4:7], node):
            fam.add_metric([self.model_name], v)
        for j, v in enumerate(node_pos):
            fams[7].add_metric([self.model_name, str(j)], v)
        return fams


class _VllmCollector(Collector):
    """vLLM's load gauges and prefix counters, one series each, read at scrape time from a NodeLoad-like object."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], Any] | None = None
        self._snapshot: Any = None  # read on the event loop just before a scrape (the router is the loop's)

    def snapshot(self) -> None:
        try:
            self._snapshot = self.source() if self.source is not None else None
        except Exception:
            log.exception("metrics: node source failed")
            self._snapshot = None

    def _families(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        m = ["model_name"]
        usage = "KV-cache usage of the node's decode pools (1 means 100 percent)."
        return (
            GaugeMetricFamily(VLLM + "num_requests_running", "Requests prefilling or decoding on the node, each "
                              "counted once.", labels=m),
            GaugeMetricFamily(VLLM + "num_requests_waiting", "Requests queued on the node, admission included.",
                              labels=m),
            GaugeMetricFamily(VLLM + "kv_cache_usage_perc", usage, labels=m),
            GaugeMetricFamily(VLLM + "gpu_cache_usage_perc", usage + " vLLM v0's name.", labels=m),
            GaugeMetricFamily(VLLM + "cache_config_info", "KV cache configuration (the value is 1).",
                              labels=m + ["block_size", "num_gpu_blocks"]),
            CounterMetricFamily(VLLM + "prefix_cache_queries", "Prompt tokens placed.", labels=m),
            CounterMetricFamily(VLLM + "prefix_cache_hits", "Prompt tokens of those taken from a cache of any "
                                "tier.", labels=m),
            CounterMetricFamily(VLLM + "gpu_prefix_cache_queries", "As vllm:prefix_cache_queries (vLLM v0's name).",
                                labels=m),
            CounterMetricFamily(VLLM + "gpu_prefix_cache_hits", "As vllm:prefix_cache_hits (vLLM v0's name).",
                                labels=m),
        )

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fams = self._families()
        node = self._snapshot
        if node is None and threading.current_thread() is threading.main_thread():  # a scrape without snapshot()
            try:
                node = self.source() if self.source is not None else None
            except Exception:
                log.exception("metrics: node source failed")
        if node is None:
            return fams
        running, waiting, usage, gpu_usage, info, queries, hits, gpu_queries, gpu_hits = fams
        name = [self.model_name]
        running.add_metric(name, node.num_running)
        waiting.add_metric(name, node.num_waiting)
        usage.add_metric(name, node.kv_usage)
        gpu_usage.add_metric(name, node.kv_usage)
        info.add_metric(name + [str(node.page_size), str(node.num_pages)], 1)
        for fam, value in ((queries, node.num_prefix_queried_tokens), (hits, node.num_prefix_hit_tokens),
                           (gpu_queries, node.num_prefix_queried_tokens), (gpu_hits, node.num_prefix_hit_tokens)):
            fam.add_metric(name, value)
        return fams


class Metrics:
    """All of one server's metrics, in its own registry. Safe to call from any thread (prometheus_client's
    metrics lock internally), e.g. observe_transfer from a transfer thread."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float], prefix: str = PREFIX) -> Any:
            return Histogram(prefix + name, doc, m, registry=reg, buckets=buckets).labels(model_name)

        # vLLM's request histograms and token counters under vLLM's names (routers and dashboards built for vLLM).
        self.vllm_ttft = hist("time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY_BUCKETS,
                              VLLM)
        self.vllm_itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _LATENCY_BUCKETS, VLLM)
        self.vllm_e2e = hist("e2e_request_latency_seconds", "Arrival to last token, in seconds.", _REQUEST_BUCKETS,
                             VLLM)
        self.vllm_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                       _TOKEN_BUCKETS, VLLM)
        self.vllm_generation_tokens = hist("request_generation_tokens", "Generated tokens per finished request.",
                                           _TOKEN_BUCKETS, VLLM)
        self.vllm_prompt_tokens_total = Counter(VLLM + "prompt_tokens", "Number of prefill tokens processed.", m,
                                                registry=reg).labels(model_name)
        self.vllm_generation_tokens_total = Counter(VLLM + "generation_tokens", "Number of generation tokens "
                                                    "processed.", m, registry=reg).labels(model_name)

        self.time_to_first_token = hist("time_to_first_token_seconds", "Time to first token in seconds.",
                                        _LATENCY_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                        _LATENCY_BUCKETS)
        self.time_per_output_token = hist("request_time_per_output_token_seconds",
                                          "Per request: (e2e - ttft) / (output tokens - 1).", _LATENCY_BUCKETS)
        self.e2e_latency = hist("e2e_request_latency_seconds", "Arrival to last token, in seconds.",
                                _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time a request waited before its prefill began.",
                               _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "Time a request spent in prefill.",
                                 _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "Time a request spent in decode.", _REQUEST_BUCKETS)
        self.kv_transfer_time = hist("kv_transfer_time_seconds", "Duration of one KV cache copy between devices.",
                                     _TRANSFER_TIME_BUCKETS)
        self.ttft_prediction_error = hist("ttft_prediction_error_seconds", "Per request admitted with a "
                                          "predicted TTFT: actual minus predicted TTFT.", _ERROR_BUCKETS)
        self.kv_transfer_bytes = hist("kv_transfer_bytes", "Bytes moved by one KV cache copy between devices.",
                                      _BYTES_BUCKETS)
        self.event_loop_lag = hist("event_loop_lag_seconds", "How late the event loop ran a timer (every 50 ms): "
                                   "what every request's handling waited on top of its own work.", _LOOP_LAG_BUCKETS)
        self.migration_downtime = hist("migration_downtime_seconds", "Per request moved between devices: from "
                                       "its last step on the source to its resumption on the target.",
                                       _TRANSFER_TIME_BUCKETS)

        # Counter names drop the "_total" that prometheus_client appends on exposition.
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", m,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens produced.", m,
                                         registry=reg).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                m + ["finished_reason"], registry=reg)
        self._rejected = Counter(PREFIX + "request_rejected", "Requests refused before they ran, by reason.",
                                 m + ["reason"], registry=reg)
        self.kv_transfer_saved_bytes = Counter(PREFIX + "kv_transfer_saved_bytes",
                                               "KV bytes not copied because the decode device had them cached.", m,
                                               registry=reg).labels(model_name)
        self._migrations = Counter(PREFIX + "migrations", "Requests moved (or not) between devices, by outcome.",
                                   m + ["outcome"], registry=reg)
        self.migration_pages = Counter(PREFIX + "migration_pages", "KV pages copied by moves between devices.", m,
                                       registry=reg).labels(model_name)
        self._loop_stalls = Counter(PREFIX + "event_loop_stalls", "Event-loop lags past 100 ms, by cause: busy "
                                    "(running Python), starved (no CPU free), blocked (the GIL or a lock), unseen, "
                                    "gc (the garbage collector).", m + ["cause"], registry=reg)
        # Structured output's compiled-grammar cache: bounded (server/structured.py), so it fills, then holds.
        self._grammar_entries = Gauge(PREFIX + "grammar_cache_entries", "Compiled grammars cached.", m,
                                      registry=reg).labels(model_name)
        self._grammar_bytes = Gauge(PREFIX + "grammar_cache_bytes", "Estimated memory of the cached grammars.", m,
                                    registry=reg).labels(model_name)
        self._loop_stalls_by = {c: self._loop_stalls.labels(model_name, c) for c in STALL_CAUSES}
        self._migrations_by = {o: self._migrations.labels(model_name, o) for o in MIGRATION_OUTCOMES}
        # Create every label set now so each series exists (at 0) from the first scrape: rate() and
        # dashboards then see a reason's first occurrence as an increase, not as a new series.
        self._success_by = {r: self._success.labels(model_name, r) for r in FINISH_REASONS}
        self._rejected_by = {r: self._rejected.labels(model_name, r) for r in REJECT_REASONS}

        self._state = _StateCollector(model_name)
        reg.register(self._state)
        reg.register(_SpecCollector(model_name, self._state))
        self._tiers = _TierCollector(model_name)
        reg.register(self._tiers)
        self._kv_events = _KVEventsCollector(model_name)
        reg.register(self._kv_events)
        self._node = _VllmCollector(model_name)
        reg.register(self._node)

    # ---- pushed ------------------------------------------------------------------------------------------
    def observe_request(self, *, prompt_tokens: int, completion_tokens: int, finish_reason: str,
                        arrival: float, first_token: float | None, finished: float, token_times: list[float],
                        queue_time: float | None = None, prefill_time: float | None = None,
                        decode_time: float | None = None, predicted_ttft: float | None = None) -> None:
        """Records one finished request. Times are time.monotonic(); token_times holds the emission time of
        each output token in order (the first being the first token), so its gaps are the inter-token
        latencies. first_token None (no token produced) records no TTFT/TPOT. predicted_ttft: what SLO admission
        predicted at arrival (core/admission.py), if it did."""
        if first_token is None and token_times:
            first_token = token_times[0]
        e2e = finished - arrival
        self.e2e_latency.observe(max(e2e, 0.0))
        self.vllm_e2e.observe(max(e2e, 0.0))
        self.vllm_prompt_tokens.observe(max(prompt_tokens, 0))
        self.vllm_generation_tokens.observe(max(completion_tokens, 0))
        if first_token is not None:
            ttft = first_token - arrival
            self.time_to_first_token.observe(max(ttft, 0.0))
            self.vllm_ttft.observe(max(ttft, 0.0))
            if predicted_ttft is not None:
                self.ttft_prediction_error.observe(ttft - predicted_ttft)
            if completion_tokens > 1:
                self.time_per_output_token.observe(max(e2e - ttft, 0.0) / (completion_tokens - 1))
        for prev, cur in zip(token_times, token_times[1:]):
            self.inter_token_latency.observe(max(cur - prev, 0.0))
            self.vllm_itl.observe(max(cur - prev, 0.0))
        if queue_time is not None:
            self.queue_time.observe(max(queue_time, 0.0))
        if prefill_time is not None:
            self.prefill_time.observe(max(prefill_time, 0.0))
        if decode_time is not None:
            self.decode_time.observe(max(decode_time, 0.0))
        # Unknown reasons fold into "error" so a caller's typo can't grow label cardinality.
        self._success_by.get(finish_reason, self._success_by["error"]).inc()

    def observe_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens as they are made: a request's prompt with its first token, then each output token (the token
        counters; observe_request records the rest at its end)."""
        for counters, n in (((self.prompt_tokens, self.vllm_prompt_tokens_total), prompt_tokens),
                            ((self.generation_tokens, self.vllm_generation_tokens_total), generation_tokens)):
            if n > 0:
                for c in counters:
                    c.inc(n)

    def observe_transfer(self, seconds: float, num_bytes: int, num_saved_bytes: int = 0) -> None:
        """One request's KV copy between devices (callable from the transfer thread); num_saved_bytes: the part
        of its prompt's KV the decode device had cached, which was not copied."""
        self.kv_transfer_time.observe(max(seconds, 0.0))
        self.kv_transfer_bytes.observe(max(num_bytes, 0))
        self.kv_transfer_saved_bytes.inc(max(num_saved_bytes, 0))

    def observe_migration(self, outcome: str, downtime: float, num_pages: int) -> None:
        """A move between devices ended (from the event loop); downtime only counts for one that resumed."""
        self._migrations_by.get(outcome, self._migrations_by["failed"]).inc()
        self.migration_pages.inc(max(num_pages, 0))
        if outcome == "moved":
            self.migration_downtime.observe(max(downtime, 0.0))

    def observe_loop_stall(self, seconds: float, cause: str) -> None:
        """An event-loop stall past server/loop_monitor's threshold and why (one of STALL_CAUSES)."""
        self._loop_stalls_by.get(cause, self._loop_stalls_by["unseen"]).inc()

    def rejected(self, reason: str) -> None:
        """A request refused before it ran; reason is one of REJECT_REASONS (others count as bad_request)."""
        self._rejected_by.get(reason, self._rejected_by["bad_request"]).inc()

    # ---- pulled ------------------------------------------------------------------------------------------
    def set_state_source(self, fn: Callable[[], Sequence[Any]], pending: Callable[[], int] | None = None) -> None:
        """fn returns PoolStats (engine.pool_stats); pending, the number of requests in the
        router's admission queue. Called from the scraping thread, so they should only read (a slightly torn
        read across workers is fine for gauges)."""
        self._state.source = fn
        self._state.pending = pending

    def set_node_source(self, fn: Callable[[], Any]) -> None:
        """fn returns a NodeLoad-like object (engine.node_load), read at scrape time for vLLM's gauges."""
        self._node.source = fn

    def set_grammar_source(self, entries: Callable[[], float], num_bytes: Callable[[], float]) -> None:
        """The grammar cache's size, read at scrape time."""
        self._grammar_entries.set_function(entries)
        self._grammar_bytes.set_function(num_bytes)

    def set_tier_source(self, fn: Callable[[], Sequence[Any]]) -> None:
        """fn returns TierStats-like objects (engine.tier_stats), read at scrape time."""
        self._tiers.source = fn

    def set_kv_events_source(self, fn: Callable[[], dict]) -> None:
        """fn returns the KV-event publisher's stats() dict, read at scrape time."""
        self._kv_events.source = fn

    # ---- exposition --------------------------------------------------------------------------------------
    def handler(self):
        """An aiohttp handler for GET /metrics serving this registry. The scrape (every collector, the text
        encoding) runs in the loop's default executor, so a slow one never stalls streams or /health: only the
        node's load, which reads the router's loop-owned state, is read on the loop first."""
        import asyncio

        from aiohttp import web
        from prometheus_client.exposition import choose_encoder

        async def metrics_handler(request: web.Request) -> web.Response:
            self._node.snapshot()
            names = request.query.getall("name[]", [])
            registry = self.registry.restricted_registry(names) if names else self.registry
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            body = await asyncio.get_running_loop().run_in_executor(None, encoder, registry)
            response = web.Response(body=body, headers={"Content-Type": content_type})
            response.enable_compression()
            return response

        return metrics_handler
