"""KVManager: the one owner of a device's KV pages. Everything else holds block ids it was given.

Interface in block ids: allocate / free / reserve / can_allocate / num_free, reference-counted so that a page
can have several holders. A prefix cache fits behind the same calls: allocate would first reuse full pages
whose content hash matches, free would park a cached page whose last holder left in an LRU of evictable pages,
and num_free / can_allocate would count those as free.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable


class OutOfPages(Exception):
    """Not enough free pages for an allocation; nothing was allocated."""


class KVManager:
    """Thread-safe: the router reserves from the event loop while workers and transfers free from their threads.
    The page-leak invariant lives here: `num_used` is 0 once every request has ended (tests and /debug/kv read
    it), and freeing a page twice or one never handed out raises."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._lock = threading.Lock()
        self.num_reserved = 0  # pages taken out of circulation for good (reserve)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages requests can ever hold: what admission and the page stats count."""
        return self.num_pages - self.num_reserved

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """num_blocks page ids, each with one holder; raises OutOfPages (allocating nothing) if too few are free."""
        with self._lock:
            if num_blocks > len(self._free):
                raise OutOfPages(f"need {num_blocks} pages, {len(self._free)} free")
            blocks = [self._free.popleft() for _ in range(num_blocks)]
            for b in blocks:
                self._refcount[b] = 1
            return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Adds a holder to pages that are already allocated."""
        with self._lock:
            for b in blocks:
                if self._refcount[b] <= 0:
                    raise ValueError(f"page {b} is not allocated")
                self._refcount[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one holder of each page; a page with none left is free again."""
        with self._lock:
            for b in blocks:
                if self._refcount[b] <= 0:
                    raise ValueError(f"page {b} freed twice")
                self._refcount[b] -= 1
                if self._refcount[b] == 0:
                    self._free.append(b)

    def reserve(self) -> int:
        """Takes one page out of circulation for the manager's lifetime (CUDA graph padding rows write there)."""
        block = self.allocate(1)[0]
        self.num_reserved += 1
        return block
