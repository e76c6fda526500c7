"""The queue of admitted requests waiting for a placement, and the order dispatch tries them in.

Oldest first. One that cannot be placed now (no seat, or not its pages) is passed over for up to MAX_SCAN later
ones, so a request with a huge max_tokens does not hold up the small ones behind it; once MAX_OVERTAKES placements
have passed it, it holds the queue until it is placed, so it is never starved. The runtime's router and the
simulator both dispatch through this one queue.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from typing import Callable, Generic, Iterator, TypeVar

MAX_SCAN = 16        # requests dispatch tries past the first one that cannot be placed now
MAX_OVERTAKES = 64   # a request overtaken this often holds the queue until it is placed

R = TypeVar("R")


class PendingQueue(Generic[R]):
    def __init__(self) -> None:
        self.items: deque[R] = deque()
        self.num_overtaken: Counter[int] = Counter()  # id(request) -> placements made past it while it waited

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[R]:
        return iter(self.items)

    def __contains__(self, item: R) -> bool:
        return item in self.items

    def append(self, item: R) -> None:
        self.items.append(item)

    def remove(self, item: R) -> None:
        self.items.remove(item)
        self.num_overtaken.pop(id(item), None)

    def dispatch(self, try_place: Callable[[R], bool]) -> None:
        """Calls try_place(request) in dispatch order; a request it places (True) leaves the queue."""
        i = 0
        while i < len(self.items) and i <= MAX_SCAN:
            item = self.items[i]
            if try_place(item):
                del self.items[i]
                self.num_overtaken.pop(id(item), None)
                for earlier in itertools.islice(self.items, i):
                    self.num_overtaken[id(earlier)] += 1
                continue
            if self.num_overtaken[id(item)] >= MAX_OVERTAKES:
                return
            i += 1
