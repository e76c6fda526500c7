"""KVTiers: the host and disk tiers under the device pools, and what they serve.

host_tier() and tiered_pool() build the host tier and pools whose evictions (or publications, with kv.host_write
= "through") go into it; the node's assembly (runtime/node.py) adds each device's loader thread, which fills pages
from other devices and tiers, and the router's prefix fetch. The disk tier starts after warm-up, when the FP8
scales its fingerprint names are known, and at a stop takes every page still cached on a device, so a restart
finds it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from nodeserve.kv.disk import MAX_QUEUED_BYTES, DiskTier, DiskTierLocked, model_fingerprint
from nodeserve.kv.host import STORE_AHEAD_WINDOW, HostTier
from nodeserve.kv.manager import KVObservers
from nodeserve.kv.pool import KVPool
from nodeserve.runtime.kv_loader import KVLoader, LoadJob
from nodeserve.runtime.prefix_fetch import PrefixFetch

if TYPE_CHECKING:
    import torch

    from nodeserve.config import Config, KVSection
    from nodeserve.device import Device
    from nodeserve.kv.events import KVEventLog, KVEventSink
    from nodeserve.model.config import ModelConfig
    from nodeserve.model.loader import LoadedModel

log = logging.getLogger(__name__)

AUTO_HOST_POOLS = 2.0     # kv.host_memory_gib = -1: twice the device pools (SGLang HiCache's default ratio) ...
AUTO_HOST_RAM = 0.25      # ... but at most this share of the host's RAM
DISK_STOP_S = 2.0         # at a stop, after the flush: the writer's last page and its join (DiskTier.stop)
STORE_AHEAD_IDLE_S = 0.02  # write-back: how often the store-ahead thread looks again once nothing is left to copy


@dataclass
class TierStats:
    """One tier, for /metrics, /debug/kv and the stats line (cumulative counts since start)."""

    tier: str                 # host | disk
    num_pages: int            # pages it can hold
    num_used: int             # pages it holds
    num_hit_tokens: int       # prompt tokens loaded from it instead of computed
    num_loaded_pages: int
    num_loaded_bytes: int
    load_seconds: float       # loader time, stage by stage, of the loads it took part in
    num_evictions: int
    num_bad_files: int = 0    # disk files skipped (corrupt, truncated, foreign, half-written) and removed
    num_held: int = 0         # pages a request or a load holds now: 0 whenever the server is idle
    num_dropped: int = 0      # pages it did not take: host, evicted past its copy budget; disk, its queue full
    num_write_errors: int = 0  # disk writes that failed (a full disk): each pauses writes for a backoff
    num_read_timeouts: int = 0  # loads that gave up waiting for their disk pages (kv.disk_timeout) or skipped
                                # the disk while a read hung; they computed those pages


class StoreAhead:
    """Write-back ahead of eviction (HostTier.store_ahead) for CPU pools, on a thread of its own: an eviction then
    finds its pages in the host tier already instead of copying them on the event loop. CPU only: there the copy is
    a memcpy of the pages on the loop (~100 ms for a 4,700-token prompt's evictions); from a GPU it is one gather
    and a DMA into pinned memory, and a side thread's copies would need ordering against the workers' streams."""

    def __init__(self, host: HostTier, pools: list):
        self.host, self.pools = host, pools
        # a quarter of the host tier for all the windows: pages copied ahead must not push each other out of it
        self.window = min(STORE_AHEAD_WINDOW, host.num_slots // (4 * len(pools)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-store-ahead", daemon=True)
        self.num_pages = 0  # pages copied ahead of their eviction

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        # Not below the loop's priority, unlike the disk writer: each chunk holds a pool's lock that the loop's
        # placements wait for, and a preempted low-priority holder would stall the loop for its whole wait.
        while not self._stop.is_set():
            try:
                copied = sum(self.host.store_ahead(pool, self.window) for pool in self.pools) if self.window else 0
            except Exception:  # a failed copy only costs the eviction its copy later
                log.exception("KV store-ahead failed")
                copied = 0
            self.num_pages += copied
            # between chunks a short pause, so the pools' locks (held for each chunk) are free most of the time
            self._stop.wait(0.001 if copied else STORE_AHEAD_IDLE_S)


def host_tier_bytes(setting: float, pool_bytes: int, ram_bytes: int) -> int:
    """kv.host_memory_gib in bytes: -1 is AUTO_HOST_POOLS x the device pools, capped at AUTO_HOST_RAM of RAM."""
    if setting == -1:
        return int(min(AUTO_HOST_POOLS * pool_bytes, AUTO_HOST_RAM * ram_bytes))
    return int(setting * 2**30)


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_tier(kv: KVSection, pool_bytes: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
              events: KVEventSink | None = None) -> HostTier | None:
    """The host tier below device pools of pool_bytes in all (kv.host_memory_gib), or None when it is off. Built
    before the pools: they report their evictions (or publications) to it from the moment they exist."""
    num_bytes = host_tier_bytes(kv.host_memory_gib, pool_bytes, host_ram_bytes())
    if num_bytes <= 0:
        return None
    page_bytes = math.prod(page_shape) * dtype.itemsize
    host = HostTier(max(1, num_bytes // page_bytes), page_shape, dtype, pin=pin, events=events)
    log.info("KV host tier: %d pages (%.2f GiB%s), write-%s", host.num_slots, num_bytes / 2**30,
             ", pinned" if pin else "", kv.host_write)
    return host


def tiered_pool(model: ModelConfig, num_pages: int, kv: KVSection, dtype: torch.dtype, device: torch.device,
                host: HostTier | None, events: KVEventSink | None = None,
                shards: Sequence[tuple[torch.device, range]] | None = None, num_window_pages: int = 0,
                max_chunk: int = 0, huge_pages: bool = True) -> KVPool:
    """A device's pool whose cache reports to the host tier (its evictions, or with kv.host_write = "through" its
    publications) and to the node's KV events; shards: a tensor-parallel group's; num_window_pages, max_chunk: its
    windowed layers' pages (KVPool); huge_pages: devices.huge_pages."""
    def on_publish(pages: list[int], hashes: list[bytes]) -> None:
        host.store(pool, pages, hashes)

    def on_evict(evicted: list) -> None:
        host.store_evicted(pool, evicted)

    through = kv.host_write == "through"
    observers = KVObservers(on_evict if host is not None and not through else None,
                            on_publish if host is not None and through else None, events)
    pool = KVPool(model, num_pages, kv.page_size, dtype, device, kv.prefix_cache, observers, shards, num_window_pages,
                  max_chunk, huge_pages)
    return pool


class KVTiers:
    """The tiers below the device pools, built by the node's assembly (runtime/node.py), and their counters."""

    def __init__(self, devices: dict[str, Device], pools: dict[str, KVPool], wake: dict[str, Callable[[], None]],
                 host: HostTier | None, kv: KVSection, events: KVEventLog | None = None):
        """devices, pools: by device name; wake[name]() wakes that device's worker (a load it waits for is ready);
        events: the node's KV events, which the disk tier reports to as well. Builds the router's prefix fetch,
        each device's loader (runtime/kv_loader.py) and, for CPU pools with write-back, the store-ahead thread."""
        self.pools, self.host, self.events = pools, host, events
        self.fetch = PrefixFetch(pools, host)
        self.loaders = {n: KVLoader(d, pools[n], self.fetch, wake[n], self.count, kv.disk_timeout)
                        for n, d in devices.items()}
        cpu_pools = [p for p in pools.values() if p.device.type == "cpu"]
        self.store_ahead = StoreAhead(host, cpu_pools) if host is not None and kv.host_write != "through" \
            and cpu_pools else None
        self.disk: DiskTier | None = None
        self.disk_settings: tuple[str, float] = (kv.disk_path, kv.disk_gib)
        self.stop_flush_timeout = kv.stop_flush_timeout
        self.num_loaded_pages: Counter[str] = Counter()  # by source kind: device, host, disk
        self.load_seconds: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # count() runs on every device's loader thread

    def start(self) -> None:
        if self.store_ahead is not None:
            self.store_ahead.start()
        for loader in self.loaders.values():
            loader.start()

    def start_disk(self, config: Config, loaded: LoadedModel, lock_fd: int | None = None) -> None:
        """Opens the disk tier (kv.disk_path, kv.disk_gib), if set: scans what earlier runs left there. lock_fd:
        the directory's lock, where the server took it before loading the model (kv/disk.lock_path)."""
        path, gib = self.disk_settings
        if not path or gib <= 0 or self.host is None:
            if lock_fd is not None:
                os.close(lock_fd)
            return
        pool = next(iter(self.pools.values()))
        scales = repr((pool.k_scales, pool.v_scales)) if pool.is_fp8 else ""
        fingerprint = model_fingerprint(loaded.path, loaded.config.architecture, str(loaded.model.dtype),
                                        str(pool.dtype), str(pool.page_size), config.quantization, scales)
        # pages queued for the writer hold host slots: at most a quarter of them
        queued = min(MAX_QUEUED_BYTES, self.host.num_slots * self.host.page_nbytes // 4)
        self.disk = DiskTier(path, int(gib * 2**30), fingerprint, self.host.page_nbytes, page_size=pool.page_size,
                             max_queued_bytes=queued,
                             events=self.events.sink("disk", False) if self.events is not None else None,
                             lock_fd=lock_fd)
        try:
            self.disk.start()
        except DiskTierLocked as e:
            from nodeserve.config import ConfigError
            raise ConfigError(str(e)) from None
        self.host.use_disk(self.disk)
        self.fetch.use_disk(self.disk)

    def stop(self, deadline: float | None = None) -> None:
        """Stops the threads (joined until `deadline`, time.monotonic()), then writes the cached pages to disk
        within kv.stop_flush_timeout (DISK_STOP_S more for the writer's last page)."""
        def left() -> float:
            return max(0.1, deadline - time.monotonic()) if deadline is not None else 5.0

        if self.store_ahead is not None:
            self.store_ahead.stop(left())
        for loader in self.loaders.values():
            loader.stop(left())
        if self.disk is not None:
            t0 = time.monotonic()
            num = self.host.flush(list(self.pools.values()), self.stop_flush_timeout)
            self.disk.stop(timeout=max(0.0, self.stop_flush_timeout - (time.monotonic() - t0)))
            log.info("KV disk tier: %d pages cached on the devices taken at stop, %d files kept, in %.1f s", num,
                     self.disk.num_files, time.monotonic() - t0)

    def count(self, job: LoadJob, seconds: float) -> None:
        """A loader finished a job (from its thread)."""
        with self._count_lock:
            for run in job.load.runs:
                kind = run.source.split(":")[0]
                self.num_loaded_pages[kind] += len(run.src)
                self.load_seconds[kind] += seconds

    def stats(self) -> list[TierStats]:
        pools = list(self.pools.values())
        page_bytes = pools[0].bytes_per_page_per_layer * len(pools[0].layers)
        fetched = self.num_loaded_pages["device"]
        out = [TierStats("device", sum(p.manager.num_usable for p in pools), sum(p.manager.num_used for p in pools),
                         fetched * pools[0].page_size, fetched, fetched * page_bytes, self.load_seconds["device"],
                         sum(p.manager.num_evictions for p in pools), 0, sum(p.manager.num_used for p in pools))]
        if self.host is not None:
            idx = self.host.index
            out.append(TierStats("host", idx.num_pages, idx.num_cached,
                                 self.num_loaded_pages["host"] * idx.page_size, self.num_loaded_pages["host"],
                                 self.num_loaded_pages["host"] * page_bytes, self.load_seconds["host"],
                                 idx.num_evictions, 0, idx.num_used, self.host.num_dropped_pages))
        if self.disk is not None:
            d = self.disk
            out.append(TierStats("disk", d.max_bytes // page_bytes, d.num_files,
                                 self.num_loaded_pages["disk"] * self.host.page_size, self.num_loaded_pages["disk"],
                                 d.num_read_bytes, self.load_seconds["disk"], d.num_evictions, d.num_bad_files,
                                 num_dropped=d.num_dropped, num_write_errors=d.num_write_errors,
                                 num_read_timeouts=sum(x.num_disk_timeouts + x.num_disk_skips
                                                       for x in self.loaders.values())))
        return out
