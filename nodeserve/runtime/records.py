"""A fixed-capacity log of small flat records (the workers' step records, the transfers' copy records), stored
in columns allocated up front.

Why not a deque(maxlen=...) of objects: 100,000 dataclass records take ~23 MiB a device and fill over an hour, so
the server's memory grew ~1 MiB a minute until the ring was full, indistinguishable from a leak in a soak. Columns of
machine numbers take a fixed ~5 MiB from the start. The worker thread appends while the event loop reads, so both
go through one lock, held for a copy at most.
"""

from __future__ import annotations

import bisect
import threading
import typing
from array import array
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")

_TYPECODES = {int: "q", float: "d"}


class RecordLog(Generic[T]):
    """The last `maxlen` records of type `cls` (a dataclass or NamedTuple whose fields are all int or float), oldest
    first. Reads give back `cls` instances built from the columns."""

    def __init__(self, cls: type[T], maxlen: int):
        hints = typing.get_type_hints(cls)
        self.cls, self.maxlen = cls, maxlen
        self._fields = tuple(hints)
        self._columns = [array(_TYPECODES[hints[f]], bytes(8 * maxlen)) for f in self._fields]
        self._num_appended = 0
        self._lock = threading.Lock()

    def append(self, record: T) -> None:
        with self._lock:
            i = self._num_appended % self.maxlen
            for column, name in zip(self._columns, self._fields):
                column[i] = getattr(record, name)
            self._num_appended += 1

    def __len__(self) -> int:
        return min(self._num_appended, self.maxlen)

    def _row(self, i: int) -> T:
        return self.cls(*(column[i] for column in self._columns))

    def __getitem__(self, index: int) -> T:
        """The record at `index` (negative: from the newest back), as a list would index it."""
        with self._lock:
            n = min(self._num_appended, self.maxlen)
            if not -n <= index < n:
                raise IndexError("record index out of range")
            return self._row((self._num_appended - n + index % n) % self.maxlen)

    def since(self, end: float, limit: int | None = None) -> list[T]:
        """The first `limit` (all when None) of the records whose `end` field is after `end`, oldest first. Records
        are appended in time order, so they are found by bisection, and only those returned are built."""
        with self._lock:
            ends = self._columns[self._fields.index("end")]
            n, top = min(self._num_appended, self.maxlen), self._num_appended
            first = bisect.bisect_right(range(n), end, key=lambda j: ends[(top - n + j) % self.maxlen])
            last = n if limit is None else min(n, first + limit)
            return [self._row((top - n + j) % self.maxlen) for j in range(first, last)]

    def __iter__(self) -> Iterator[T]:
        """A snapshot of every record kept, oldest first."""
        with self._lock:
            n, top = min(self._num_appended, self.maxlen), self._num_appended
            rows = [self._row((top - n + j) % self.maxlen) for j in range(n)]
        return iter(rows)
