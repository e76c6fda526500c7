"""Prefix fetch: where the prompt pages a request's device lacks can come from instead of being computed.

Runs in the router, at placement. Past the prefix the computing device holds (shared, no copy), the next pages
are looked for, in order, in another device's pool, in the host tier, on disk; each source found is held (its
pages or slots cannot be evicted) until the device's loader has copied it (runtime/kv_loader.py). A page some
other request is still computing is "in flight": core.prefix says whether to wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from nodeserve.core.prefix import PrefixSources

if TYPE_CHECKING:
    from nodeserve.core.request import Request
    from nodeserve.kv.disk import DiskTier
    from nodeserve.kv.host import HostTier
    from nodeserve.kv.pool import KVPool


@dataclass
class LoadRun:
    """Pages [first, first + len(src)) of the request's page table, copied from one source: another device's
    pool (`pool`; src are its page ids) or the host tier (pool None; src are slots). Held until copied."""

    first: int
    src: list[int]
    pool: KVPool | None
    source: str  # "device:<name>" | "host" | "disk": the log line's and the counters' name for it


@dataclass
class PrefixLoad:
    """What a request's device fills before computing the rest: runs, then pages read from disk after them."""

    runs: list[LoadRun]
    disk_first: int = 0
    disk_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(len(r.src) for r in self.runs) + len(self.disk_hashes)


class PrefixFetch:
    def __init__(self, pools: Mapping[str, KVPool], host: HostTier | None = None, disk: DiskTier | None = None):
        """pools: every device's pool, by device name."""
        self.pools, self.host, self.disk = dict(pools), host, disk

    def use_disk(self, disk: DiskTier) -> None:
        """The disk tier, once it is open (after warm-up)."""
        self.disk = disk

    def sources(self, req: Request, device: str, start: int) -> PrefixSources:
        """How far each source would extend the prefix `device` holds (its first `start` pages), and how many
        pages past that other requests are computing now. Holds nothing."""
        hashes, limit = req.page_hashes, loadable_pages(req, self.pools[device].page_size)
        pos = start
        other = max((len(p.manager.lookup(hashes[pos:limit])) for name, p in self.pools.items() if name != device),
                    default=0)
        pos += other
        host = len(self.host.index.lookup(hashes[pos:limit])) if self.host is not None else 0
        pos += host
        disk = self.disk.match(hashes[pos:limit]) if self.disk is not None else 0
        pos += disk
        in_flight = max((p.manager.num_in_flight(hashes[pos:limit]) for p in self.pools.values()), default=0)
        return PrefixSources(start, other, host, disk, in_flight)

    def acquire(self, req: Request, device: str, start: int) -> PrefixLoad | None:
        """Holds the sources of the pages past `start` that `device` lacks; None if there are none."""
        hashes, limit = req.page_hashes, loadable_pages(req, self.pools[device].page_size)
        runs: list[LoadRun] = []
        pos = start
        best = max((name for name in self.pools if name != device),
                   key=lambda name: len(self.pools[name].manager.lookup(hashes[pos:limit])), default=None)
        if best is not None and (pages := self.pools[best].manager.share_prefix(hashes[pos:limit])):
            runs.append(LoadRun(pos, pages, self.pools[best], f"device:{best}"))
            pos += len(pages)
        if self.host is not None and (slots := self.host.hold(hashes[pos:limit])):
            runs.append(LoadRun(pos, slots, None, "host"))
            pos += len(slots)
        load = PrefixLoad(runs, pos)
        if self.disk is not None and self.host is not None:
            load.disk_hashes = list(hashes[pos:pos + self.disk.match(hashes[pos:limit])])
        return load if load.num_pages else None

    def release(self, load: PrefixLoad) -> None:
        """Drops the holds of a load that will not run (the placement fell through) or has run."""
        for run in load.runs:
            if run.pool is not None:
                run.pool.manager.free(run.src)
            else:
                self.host.release(run.src)
        load.runs = []


def loadable_pages(req: Request, page_size: int) -> int:
    """Pages a request may take from a cache: every full prompt page but the one holding its last token, which
    runs again for the first token's logits (as the device pools count it)."""
    return (req.num_prompt_tokens - 1) // page_size
