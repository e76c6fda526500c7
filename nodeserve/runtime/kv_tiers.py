"""KVTiers: puts the host and disk tiers under the device pools, and counts what they serve.

Wires, for every device: its pool's evictions (or publications, with kv.host_write = "through") into the host
tier, a loader thread that fills pages from other devices and tiers, and the router's prefix fetch. The disk
tier starts after warm-up, when the FP8 scales its fingerprint names are known, and at a stop takes every page
still cached on a device, so a restart finds it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodeserve.kv.disk import DiskTier, model_fingerprint
from nodeserve.kv.host import STORE_AHEAD_WINDOW, HostTier
from nodeserve.runtime.kv_loader import KVLoader, LoadJob
from nodeserve.runtime.prefix_fetch import PrefixFetch

if TYPE_CHECKING:
    from nodeserve.config import Config, KVSection
    from nodeserve.kv.events import KVEventLog
    from nodeserve.model.loader import LoadedModel
    from nodeserve.runtime.router import Router
    from nodeserve.runtime.worker import Worker

log = logging.getLogger(__name__)

AUTO_HOST_POOLS = 2.0     # kv.host_memory_gib = -1: twice the device pools (SGLang HiCache's default ratio) ...
AUTO_HOST_RAM = 0.25      # ... but at most this share of the host's RAM
STOP_FLUSH_S = 30.0       # at a stop, time given to writing cached pages to disk
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

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

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


class KVTiers:
    def __init__(self, workers: list[Worker], fetch: PrefixFetch, host: HostTier | None):
        self.workers, self.fetch, self.host = workers, fetch, host
        self.store_ahead: StoreAhead | None = None
        self.disk: DiskTier | None = None
        self.events: KVEventLog | None = None  # the node's KV events, when on: the disk tier reports there too
        self.disk_settings: tuple[str, float] = ("", 0.0)  # kv.disk_path, kv.disk_gib
        self.num_loaded_pages: Counter[str] = Counter()  # by source kind: device, host, disk
        self.load_seconds: Counter[str] = Counter()

    @classmethod
    def build(cls, kv: KVSection, workers: list[Worker], router: Router) -> KVTiers:
        pools = [w.pool for w in workers]
        pool_bytes = sum(p.data.numel() * p.data.element_size() for p in pools)
        num_bytes = host_tier_bytes(kv.host_memory_gib, pool_bytes, host_ram_bytes())
        host = None
        if num_bytes > 0:
            page_bytes = pools[0].data[:, 0].numel() * pools[0].data.element_size()
            pin = any(p.device.type == "cuda" for p in pools)
            host = HostTier(max(1, num_bytes // page_bytes), pools[0], pin=pin)
            log.info("KV host tier: %d pages (%.2f GiB%s), write-%s", host.num_slots, num_bytes / 2**30,
                     ", pinned" if pin else "", kv.host_write)
            for w in workers:
                if kv.host_write == "through":
                    w.kv.on_publish = lambda pages, hashes, pool=w.pool: host.store(pool, pages, hashes)
                else:
                    w.kv.on_evict = lambda evicted, pool=w.pool: host.store_evicted(pool, evicted)
        tiers = cls(workers, PrefixFetch(workers, host), host)
        cpu_pools = [p for p in pools if p.device.type == "cpu"]
        if host is not None and kv.host_write != "through" and cpu_pools:
            tiers.store_ahead = StoreAhead(host, cpu_pools)
            tiers.store_ahead.start()
        router.fetch = tiers.fetch
        for w in workers:
            w.loader = KVLoader(w.device, w.pool, tiers.fetch, lambda w=w: w.send(None), tiers._count)
            w.loader.start()
        tiers.disk_settings = (kv.disk_path, kv.disk_gib)
        return tiers

    def start_disk(self, config: Config, loaded: LoadedModel) -> None:
        """Opens the disk tier (kv.disk_path, kv.disk_gib), if set: scans what earlier runs left there."""
        path, gib = self.disk_settings
        if not path or gib <= 0 or self.host is None:
            return
        pool = self.workers[0].pool
        scales = repr((pool.k_scales, pool.v_scales)) if pool.is_fp8 else ""
        fingerprint = model_fingerprint(loaded.path, loaded.config.architecture, str(loaded.model.dtype),
                                        str(pool.dtype), str(pool.page_size), config.quantization, scales)
        self.disk = DiskTier(path, int(gib * 2**30), fingerprint, self.host.page_nbytes)
        if self.events is not None:
            self.disk.events = self.events.sink("disk")
        self.disk.start()
        self.host.disk = self.fetch.disk = self.disk

    def stop(self) -> None:
        if self.store_ahead is not None:
            self.store_ahead.stop()
        for w in self.workers:
            if w.loader is not None:
                w.loader.stop()
        if self.disk is not None:
            num = self.host.flush([w.pool for w in self.workers], STOP_FLUSH_S)
            self.disk.stop(STOP_FLUSH_S)
            log.info("KV disk tier: %d pages cached on the devices written at stop; %d files kept", num,
                     self.disk.num_files)

    def _count(self, job: LoadJob, seconds: float) -> None:
        """A loader finished a job (from its thread)."""
        for run in job.load.runs:
            kind = run.source.split(":")[0]
            self.num_loaded_pages[kind] += len(run.src)
            self.load_seconds[kind] += seconds

    def stats(self) -> list[TierStats]:
        pools = [w.pool for w in self.workers]
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
                                 num_dropped=d.num_dropped))
        return out
