"""KVLoader: fills a request's pages from another tier while its device computes, layer by layer.

One per device: a copy thread (on CUDA with its own stream). A job runs in two stages:
  1. pages on disk are read into host slots and checked; one that is missing or bad ends the load there, and the
     request computes the rest (its computed-token count is cut back before it ever runs). The request is then
     ready: its device may schedule it.
  2. every layer of every run (another device's pages, host slots) is copied into the request's pages, and
     layer i is marked done (an event on CUDA). The device's forward waits for layer i before running layer i
     (wait_layer, the model's before-layer hook), so the load overlaps with the prefill of the rest.
Then the sources are released (their pages may be evicted again). A copy that raises fails the job: the forward
waiting on it raises, which fails that request alone.

Disk reads run on a thread of their own (DiskReads), which the loader waits for at most `disk_timeout` s a job,
and not at all for a request aborted meanwhile: a read that hangs (a hung network mount) costs a request that
wait and the pages not read yet, which it computes, never the loader. While that read still hangs, later jobs skip
the disk; past DISK_STUCK_S the loader reports itself failed (/health 503, no watchdog ping), as a dead device
does, and recovers by itself if the read ever returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from nodeserve.device import Device
from nodeserve.runtime.prefix_fetch import LoadRun, PrefixFetch, PrefixLoad

if TYPE_CHECKING:
    from nodeserve.core.scheduler import Seq
    from nodeserve.kv.host import HostTier
    from nodeserve.kv.pool import KVPool

log = logging.getLogger(__name__)

DISK_TIMEOUT_S = 5.0   # kv.disk_timeout's default: a job's wait for its disk pages
DISK_STUCK_S = 30.0    # one disk read outstanding this long: the loader is failed (/health, the watchdog)
ABORT_POLL_S = 0.05    # how often a wait for disk pages looks whether its request was aborted


@dataclass(eq=False)
class _Read:
    """One job's disk pages, read by DiskReads' thread; the slots it took are the loader's until it gives up."""
    hashes: list[bytes]
    token_ids: list[int]
    slots: list[int] = field(default_factory=list)
    done: bool = False
    given_up: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, slot: int) -> bool:
        with self.cond:
            if not self.given_up:
                self.slots.append(slot)
            return not self.given_up


class DiskReads:
    """The thread a loader's disk reads run on, one read at a time, so the loader waits for one with a timeout."""

    def __init__(self, host: HostTier, name: str):
        self.host, self.name = host, name
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.busy_since: float | None = None  # when the read in hand started; None: idle

    def read(self, hashes: list[bytes], token_ids: list[int], timeout: float,
             aborted: Callable[[], bool]) -> tuple[list[int], bool]:
        """(the held host slots of the leading pages read, whether the wait ended early: timed out or aborted).
        Pages read after that are let go by the reading thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        r = _Read(hashes, token_ids)
        self._reads.put(r)
        deadline = time.monotonic() + timeout
        with r.cond:
            while not r.done and not aborted() and (left := deadline - time.monotonic()) > 0:
                r.cond.wait(min(left, ABORT_POLL_S))
            r.given_up = not r.done
            return list(r.slots), r.given_up

    def stop(self, timeout: float = 1.0) -> None:
        if self._thread is not None:
            self._reads.put(None)
            self._thread.join(timeout=timeout)  # a read that hangs keeps it: a daemon thread, left to the exit

    def _run(self) -> None:
        while (r := self._reads.get()) is not None:
            self.busy_since = time.monotonic()
            try:
                self.host.read_from_disk(r.hashes, r.token_ids, lambda: r.given_up, r.add)
            except Exception:
                log.exception("%s: reading KV from disk failed", self.name)
            finally:
                self.busy_since = None
                with r.cond:
                    r.done = True
                    r.cond.notify_all()


@dataclass(eq=False)
class LoadJob:
    seq: Seq
    load: PrefixLoad
    layer_events: list[Any] = field(default_factory=list)  # per layer done: its event (None on CPU)
    num_layers: int = 0
    error: str | None = None
    done: threading.Condition = field(default_factory=threading.Condition)

    @property
    def finished(self) -> bool:
        """Every layer issued (or failed): a forward need not wait for it any more."""
        return self.error is not None or len(self.layer_events) == self.num_layers


class LoadFailed(Exception):
    """Filling a request's pages from another tier failed: the request fails."""


class KVLoader:
    def __init__(self, device: Device, pool: KVPool, fetch: PrefixFetch, on_ready: Callable[[], None],
                 on_loaded: Callable[[LoadJob, float], None] = lambda job, seconds: None,
                 disk_timeout: float = DISK_TIMEOUT_S, stuck_after: float = DISK_STUCK_S):
        """on_ready(): a job's request may be scheduled (wakes the worker); on_loaded(job, seconds): every page
        is in, for the counters. Both from the loader's thread. disk_timeout: a job's wait for its disk pages;
        stuck_after: one disk read outstanding this long makes the loader failed (`failure`)."""
        self.device, self.pool, self.fetch = device, pool, fetch
        self.on_ready, self.on_loaded = on_ready, on_loaded
        self.disk_timeout, self.stuck_after = disk_timeout, stuck_after
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.name = f"kv loader {device.name}"
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._disk = DiskReads(fetch.host, f"kv disk reader {device.name}") if fetch.host is not None else None
        self._stopped = False
        self.num_disk_timeouts = 0  # jobs whose disk pages did not come within disk_timeout (they computed them)
        self.num_disk_skips = 0     # jobs that skipped the disk: a read before them still hung

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Joins the loader's thread and its disk reader's, both within `timeout`."""
        deadline = time.monotonic() + timeout
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout=timeout)
        if self._disk is not None:
            self._disk.stop(max(0.0, deadline - time.monotonic()))

    @property
    def failure(self) -> str | None:
        """Why the loader is taken for failed: a disk read outstanding past stuck_after (None when it returns)."""
        since = self._disk.busy_since if self._disk is not None else None
        if since is not None and (age := time.monotonic() - since) > self.stuck_after:
            return f"a disk read has hung for {age:.0f}s (limit {self.stuck_after:g}s): is kv.disk_path's disk up?"
        return None

    @property
    def last_progress(self) -> float:
        """For the watchdog (server/systemd.py WorkersHealth): now, unless its thread died."""
        return 0.0 if self._thread_died else time.monotonic()

    @property
    def _thread_died(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive() and not self._stopped

    @property
    def dead(self) -> bool:
        """Its thread ended without being stopped, or a disk read hangs (failure): /health answers 503 and the
        watchdog's pings stop, as for a dead device."""
        return self._thread_died or self.failure is not None

    def submit(self, seq: Seq) -> LoadJob:
        """From the worker's thread: the request is not ready until the disk stage is done. seq.load is the
        router's PrefixFetch's (the core sees it only as a PageLoad)."""
        if not isinstance(seq.load, PrefixLoad):
            raise TypeError(f"a load from this node's PrefixFetch, got {type(seq.load).__name__}")
        job = LoadJob(seq, seq.load, num_layers=self.pool.num_layers)
        seq.ready = False
        self._jobs.put(job)
        return job

    # ---- from the worker's forward ---------------------------------------------------------------------
    def wait_layer(self, job: LoadJob, layer: int) -> None:
        """Before layer `layer` of a forward that reads the job's pages: blocks (host) until the layer's copy is
        issued, then orders the device's stream after it."""
        with job.done:
            job.done.wait_for(lambda: job.error is not None or len(job.layer_events) > layer)
        if job.error is not None:
            raise LoadFailed(job.error)
        self.device.wait_event(job.layer_events[layer])

    def wait(self, job: LoadJob) -> None:
        """Blocks until the job is over, its sources released (before its pages are freed on a failure path)."""
        with job.done:
            job.done.wait_for(lambda: job.seq.load is None)

    # ---- the loader thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        self.device.init_copy_thread()
        stream = self.device.new_stream()
        with self.device.use_stream(stream):
            while (job := self._jobs.get()) is not None:
                start = time.monotonic()
                try:
                    self._read_disk(job)
                finally:
                    job.seq.ready = True
                    self.on_ready()
                try:
                    self._copy_layers(job)
                    self.on_loaded(job, time.monotonic() - start)
                except Exception as e:
                    log.exception("%s: loading request %s's KV failed", self.name, job.seq.req.request_id)
                    with job.done:
                        job.error = f"loading cached KV failed ({type(e).__name__}: {e})"
                        job.done.notify_all()
                finally:
                    self.device.synchronize_event(self.device.record_event())  # sources read: they may go
                    self.fetch.release(job.load)
                    with job.done:
                        job.seq.load = None  # its pages are its own again (an abort may free them now)
                        job.done.notify_all()
                    self.on_ready()

    def _read_disk(self, job: LoadJob) -> None:
        """Stage 1: disk pages into held host slots (a run like any other); cuts the request back at the first
        page that could not be read."""
        load, req = job.load, job.seq.req
        if not load.disk_hashes:
            return
        ps = self.pool.page_size
        if self._disk is None or req.aborted:
            slots: list[int] = []
        elif self._disk.busy_since is not None:  # an earlier job's read still hangs: this one would queue behind
            slots = []
            self.num_disk_skips += 1
        else:
            first = load.disk_first * ps
            slots, gave_up = self._disk.read(load.disk_hashes, req.prompt_ids[first:first + len(load.disk_hashes) * ps],
                                             self.disk_timeout, lambda: req.aborted)
            if gave_up and not req.aborted:
                self.num_disk_timeouts += 1
                log.warning("%s: request %s's KV pages on disk did not come within %gs (kv.disk_timeout): %d of %d "
                            "read, it computes the rest", self.name, req.request_id, self.disk_timeout, len(slots),
                            len(load.disk_hashes))
        if slots:
            load.runs.append(LoadRun(load.disk_first, slots, None, "disk"))
        if len(slots) < len(load.disk_hashes):
            req.num_computed_tokens = req.num_cached_tokens = (load.disk_first + len(slots)) * ps
            req.cached_from["disk"] = len(slots) * ps
        load.disk_hashes = load.disk_hashes[:len(slots)]

    def _copy_layers(self, job: LoadJob) -> None:
        """Stage 2: each layer of every run, in layer order, each layer marked done as it is issued."""
        table = job.seq.page_table
        # The destination pages were free before the router handed them over: wait for what was queued on them.
        self.device.wait_event(self.pool.freed_event)
        maps = []
        for run in job.load.runs:
            dst = torch.tensor(table[run.first:run.first + len(run.src)], dtype=torch.int64, device=self.pool.device)
            src_device = run.pool.device if run.pool is not None else torch.device("cpu")
            maps.append((run, torch.tensor(run.src, dtype=torch.int64, device=src_device), dst))
        for layer in range(job.num_layers):
            for run, src, dst in maps:
                if run.pool is None:
                    self.fetch.host.copy_layer(layer, src, self.pool, dst)
                else:
                    self.pool.write_layer(layer, dst, run.pool.read_layer(layer, src))
            event = self.device.record_event()
            with job.done:
                job.layer_events.append(event)
                job.done.notify_all()
