"""PageAllocator: the free list and reference counts of one device's KV pages."""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable


class OutOfPages(Exception):
    """Not enough free pages for an allocation; nothing was allocated."""


class PageAllocator:
    """Hands out page ids of one pool. Reference-counted so that a page can later be shared between requests
    (prefix caching): a page returns to the free list when its last holder frees it.

    Thread-safe: the router reserves from the event loop while workers and the transfer free from their threads.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        with self._lock:
            if num > len(self._free):
                raise OutOfPages(f"need {num} pages, {len(self._free)} free")
            pages = [self._free.popleft() for _ in range(num)]
            for p in pages:
                self._refcount[p] = 1
            return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to pages that are already allocated."""
        with self._lock:
            for p in pages:
                if self._refcount[p] <= 0:
                    raise ValueError(f"page {p} is not allocated")
                self._refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                if self._refcount[p] <= 0:
                    raise ValueError(f"page {p} freed twice")
                self._refcount[p] -= 1
                if self._refcount[p] == 0:
                    self._free.append(p)
