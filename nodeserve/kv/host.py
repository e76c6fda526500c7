"""HostTier: the node's KV pages in host memory, one store below every device's pool.

Slots are pages across every layer, contiguous: data is [num_slots, num_layers, 2, page_size, num_kv_heads,
head_dim] (a slot is one disk file as it is). A KVManager indexes the slots under the same chained page hashes
as the device pools, so LRU order, reference counts ("never evicted while being loaded or written") and the
leak invariant are the pools' own. Pages come in when a device pool evicts them (write-back) or publishes them
(write-through), leave by LRU, and every page that comes in is also handed to the disk tier, when there is one.
On CUDA nodes the slots are pinned, so copies to and from a GPU are asynchronous DMA.
"""

from __future__ import annotations

import functools
import threading
import time
from array import array
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from nodeserve.kv.manager import KVManager, KVObservers, OutOfPages
from nodeserve.kv.pool import KVPool

if TYPE_CHECKING:
    from nodeserve.kv.disk import DiskTier
    from nodeserve.kv.events import KVEventSink

FLUSH_CHUNK = 128  # pages copied in per step of a stop's flush without a disk tier (with one: its queue)
STORE_AHEAD_WINDOW = 512  # write-back: the next pages to evict a pool keeps copied here ahead of time
# Pages a store_ahead() copies under the pool's lock, which the router's placements on the event loop wait for:
# ~3 MB, about a millisecond, for SmolLM2 (16 pages let a busy core stretch a chunk past 100 ms: bench/hostile.py)
STORE_AHEAD_CHUNK = 4
# Write-back at eviction runs inside an allocation (on the event loop, under the pool's lock): at most this many
# bytes are copied there, the most recently used pages first, and the rest dropped (counted). On CPU, 290 pages of
# a 4,700-token prompt copied there stalled every stream 100-650 ms; 16 MiB is a few ms of memcpy. From a GPU the
# copy is a gather and a DMA at ~25 GB/s: 256 MiB is ~10 ms.
MAX_EVICT_COPY_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}


class HostTier:
    def __init__(self, num_slots: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False,
                 disk: DiskTier | None = None, events: KVEventSink | None = None):
        """page_shape: a device pool's page, [num_layers, 2, page_size, kv heads, head dim] (every pool shares it,
        and its dtype); events: told every hash entering or leaving this tier ([kv_events])."""
        num_layers, two, page_size, heads, dim = page_shape
        self.page_size, self.num_layers, self.disk = page_size, num_layers, disk
        # empty, not zeros: on a CPU node only slots written take memory.
        self.data = torch.empty(num_slots, num_layers, two, page_size, heads, dim, dtype=dtype, pin_memory=pin)
        # evictions need no copy: see store()
        self.index = KVManager(num_slots, page_size, prefix_cache=True, observers=KVObservers(events=events))
        self.page_nbytes = self.data[0].numel() * self.data.element_size()
        self._lock = threading.Lock()  # the counters, bumped from several threads
        self.num_stored_pages = 0     # pages copied in from a device pool
        self.num_dropped_pages = 0    # evicted pages not copied in: past MAX_EVICT_COPY_BYTES at their eviction
        self.num_loaded_pages = 0     # pages copied out to a device pool
        self.num_hit_tokens = 0       # prompt tokens served from here instead of computed
        self.load_seconds = 0.0

    @classmethod
    def like(cls, num_slots: int, pool: KVPool, pin: bool = False, disk: DiskTier | None = None) -> HostTier:
        """A host tier for pages of `pool`'s shape and dtype."""
        shard = pool.shards[0].data  # [L, pages, 2, P, H of the shard, D]; a host page holds every head
        return cls(num_slots, (pool.num_layers, 2, pool.page_size, pool.num_kv_heads, shard.shape[-1]), pool.dtype,
                   pin, disk)

    def use_disk(self, disk: DiskTier) -> None:
        """The disk tier below this one, once it is open (after warm-up: its fingerprint names the FP8 scales)."""
        self.disk = disk

    @property
    def num_slots(self) -> int:
        return self.index.num_pages

    def store(self, pool: KVPool, pages: Sequence[int], hashes: Sequence[bytes],
              tokens: Sequence[array | None] = (), max_new: int | None = None, drop_oldest: bool = False) -> int:
        """Copies device pages (full, published: their KV never changes) into slots under their hashes, skipping
        those already here. tokens: each page's tokens where the pool knew them, so a prompt that meets a page
        here under its hash with other tokens (a collision) does not take it (KVManager.scrub). max_new: copy at
        most this many of the pages not here yet, the first ones, or with drop_oldest the last ones (pages come
        oldest first), counting the others as dropped. Returns how many were copied; fewer when every slot is held
        by a load. Each page copied in goes to the disk tier too, when there is one and its tokens are known."""
        # not given: the pool's own record of them (callers inside the pool's lock, evictions, pass them)
        tokens = tokens or pool.manager.tokens_of(pages)
        new = [(p, h, t) for p, h, t in zip(pages, hashes, tokens) if not self.index.lookup([h])]
        if max_new is not None and len(new) > max_new:
            if drop_oldest:
                with self._lock:
                    self.num_dropped_pages += len(new) - max_new
            new = new[-max_new:] if drop_oldest else new[:max_new]
        if not new:
            return 0
        try:
            slots = self.index.allocate(min(len(new), self.index.num_free))
        except OutOfPages:  # loads took the last free slots since num_free was read
            return 0
        new = new[:len(slots)]
        src = torch.tensor([p for p, _, _ in new], dtype=torch.int64, device=pool.device)
        if len(pool.shards) == 1:
            # [L, n, 2, P, H, D] -> [n, L, 2, P, H, D]; on a GPU one gather and one copy to pinned memory
            self.data[slots] = pool.data.index_select(1, src).transpose(0, 1).to("cpu")
        else:  # a group's page: every head, whatever the sharding (one hash, one whole page)
            self.data[slots] = torch.stack([pool.read_layer(i, src) for i in range(pool.num_layers)], 1).to("cpu")
        page_tokens = [t for _, _, t in new]
        self.index.publish(slots, [h for _, h, _ in new], page_tokens=page_tokens)
        # to disk before the slots are let go: a slot freed first could be reused, and another page's KV written
        # under this hash
        self._to_disk(slots, [h for _, h, _ in new], page_tokens)
        self.index.free(slots)
        with self._lock:
            self.num_stored_pages += len(slots)
        return len(slots)

    def _to_disk(self, slots: Sequence[int], hashes: Sequence[bytes], tokens: Sequence[array | None]) -> None:
        """Hands published slots to the disk tier's writer, each held until written (no copy: the queue is bounded
        in bytes, and the pages it waits on are host-tier pages, inside kv.host_memory_gib). Pages whose tokens
        are unknown stay off the disk: a page there is served only to a prompt with its tokens."""
        disk = self.disk
        if disk is None:
            return
        for s, h, t in zip(slots, hashes, tokens):
            if t is not None and h not in disk:  # put() counts what it refuses (queue full, writes paused)
                self.index.share([s])
                disk.put(h, self.page_bytes(s), t, functools.partial(self.index.free, [s]))

    def store_evicted(self, pool: KVPool, evicted: list[tuple[int, bytes, array | None]],
                      max_bytes: int | None = None) -> None:
        """A device pool's on_evict: write-back. Pages store_ahead() copied already cost nothing; of the rest, the
        most recently used that fit in max_bytes (default: MAX_EVICT_COPY_BYTES for the pool's device) are copied
        and the older ones dropped (their KV is recomputed if asked for again), so an allocation never waits on a
        large copy."""
        if not evicted:
            return
        if max_bytes is None:
            max_bytes = MAX_EVICT_COPY_BYTES.get(pool.device.type, MAX_EVICT_COPY_BYTES["cpu"])
        self.store(pool, *zip(*evicted), max_new=max(1, max_bytes // self.page_nbytes), drop_oldest=True)

    def store_ahead(self, pool: KVPool, window: int = STORE_AHEAD_WINDOW, max_pages: int = STORE_AHEAD_CHUNK) -> int:
        """Write-back ahead of eviction: copies up to max_pages of the pool's `window` next pages to evict (its least
        recently used cached ones) that are not here yet, under the pool's lock (they cannot be handed out
        meanwhile). Returns how many were copied. Why: an allocation evicting hundreds of pages copied them all
        inside the router's placement, on the event loop (a 4,700-token prompt: a 250 ms stall of every stream and
        of /health); with this run from a thread, evictions find their pages here already."""
        copied = 0

        def copy(cached: list[tuple[int, bytes, array | None]]) -> None:
            nonlocal copied
            if cached:
                copied = self.store(pool, *zip(*cached), max_new=max_pages)
        pool.manager.visit_evictable(window, copy)
        return copied

    def page_bytes(self, slot: int) -> torch.Tensor:
        """A slot's bytes, as the disk tier reads and writes them: [page_nbytes] uint8, a view."""
        return self.data[slot].view(-1).view(torch.uint8)

    def hold(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the longest prefix of `hashes` held here, each with a holder added (release() them)."""
        return self.index.share_prefix(hashes)

    def release(self, slots: Sequence[int]) -> None:
        self.index.free(slots)

    def read_from_disk(self, hashes: Sequence[bytes], token_ids: Sequence[int],
                       cancelled: Callable[[], bool] = lambda: False, on_page: Callable[[int], bool] | None = None
                       ) -> list[int]:
        """Reads pages from the disk tier into fresh slots, published here and held for the caller; stops at the
        first miss, bad file (one holding other tokens than token_ids, page by page, included), when no slot is
        free, or once cancelled(). on_page(slot): each slot read, as it is; False means the caller no longer
        takes it (it gave up waiting), and the slot is let go here. Returns the held slots, one per leading hash
        read."""
        slots: list[int] = []
        ps = self.page_size
        for i, h in enumerate(hashes):
            if self.disk is None or cancelled() or not self.index.can_allocate(1):
                break
            try:
                slot = self.index.allocate(1)[0]
            except OutOfPages:
                break
            tokens = array("q", token_ids[i * ps:(i + 1) * ps])
            if not self.disk.get(h, self.page_bytes(slot), tokens):
                self.index.free([slot])
                break
            self.index.publish([slot], [h], page_tokens=[tokens])
            if on_page is not None and not on_page(slot):
                self.index.free([slot])
                break
            slots.append(slot)
        return slots

    def copy_layer(self, layer: int, slots: torch.Tensor, pool: KVPool, pages: torch.Tensor) -> None:
        """Copies layer `layer` of host slots into a device pool's pages (slots on the host, pages on the pool's
        device; non-blocking from pinned memory on a GPU, on the calling thread's current stream)."""
        src = self.data[:, layer].index_select(0, slots)  # [n, 2, P, H, D]
        pool.write_layer(layer, pages, src)

    def count_load(self, num_pages: int, seconds: float) -> None:
        with self._lock:
            self.num_loaded_pages += num_pages
            self.num_hit_tokens += num_pages * self.page_size
            self.load_seconds += seconds

    def flush(self, pools: Sequence[KVPool], timeout: float = 30.0) -> int:
        """Before a stop, with the workers stopped: every page cached in a device pool comes in here and, with a
        disk tier, every page here that is not on disk yet is written there, so a restart keeps it. Within
        `timeout` s, most valuable first (by_value): a device's pages before the host tier's (the host's were
        handed to the disk as they came in). Returns the pages copied in from the devices."""
        deadline, num = time.monotonic() + timeout, 0

        def wait_for_room() -> bool:
            """The disk's queue emptied (the writer took the last chunk); False when time ran out."""
            left = deadline - time.monotonic()
            return self.disk is None or (left > 0 and self.disk.flush(left))

        chunk = self.disk.max_queued if self.disk is not None else FLUSH_CHUNK
        for pool in pools:
            cached = by_value(pool.manager, pool.manager.cached_pages())
            for i in range(0, len(cached), chunk):
                part = cached[i:i + chunk]
                num += self.store(pool, [p for p, _ in part], [h for _, h in part])
                if not wait_for_room():
                    return num
        if self.disk is not None:
            mine = [(s, h) for s, h in by_value(self.index, self.index.cached_pages()) if h not in self.disk]
            for i in range(0, len(mine), chunk):
                slots = [s for s, _ in mine[i:i + chunk]]  # nothing else runs at a stop: they stay these pages
                self._to_disk(slots, [h for _, h in mine[i:i + chunk]], self.index.tokens_of(slots))
                if not wait_for_room():
                    return num
        return num


def by_value(manager: KVManager, cached: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Cached (page, hash) pairs most hit first, then most recently used first. A page's prefix is hit whenever it
    is, so it comes first: a page on disk without its prefix is worth nothing (a load stops at the first miss)."""
    recent = cached[::-1]  # a request's pages are freed last first: its prefix is the most recent, and leads here
    hits = manager.hits_of([p for p, _ in recent])
    return [recent[i] for i in sorted(range(len(recent)), key=lambda i: -hits[i])]
