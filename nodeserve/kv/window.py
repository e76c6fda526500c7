"""Window pages: the KV of a model's sliding-window layers, held for each request's window only.

A layer with window W reads, for a query at position q, the keys at [q - W + 1, q]; nothing before that is read
again by any later query. So the windowed layers keep their K/V in a page space of their own (the pool's window
part, one KVManager), apart from the full layers' pages, and a request's window table maps its logical pages
(position // page_size) to window pages only while they can still be read: before each step the pages wholly
before the window of its first query go back (advance), the pages the step writes are drawn. The full layers
keep every page, as for any model. llama.cpp's separate SWA cache and vLLM's hybrid allocator do the same; this
one is sized per request, so the ratio of held pages to a full cache's is (full layers + windowed layers' window)
/ (all layers' context), within a page per layer.

A placement never waits for pages (kv/reservation.py): a request promises, when placed, the most window pages it
can hold at once on a device (its window and one chunk: max_window_pages), and draws them as it advances; pages it
slides past go back to the free list, still promised to it. A prompt that prefills on a device promises for its
largest chunk there; once it decodes, it keeps a window and one token's page (shrink).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from nodeserve.kv.manager import KVManager, OutOfPages


def max_window_pages(window: int, page_size: int, num_tokens: int) -> int:
    """Pages one sequence holds at once when a step feeds it `num_tokens` tokens: the positions they write and the
    window before the first of them, window + num_tokens - 1 positions, lie on at most this many pages."""
    return -(-(window + num_tokens - 2) // page_size) + 1


def first_window_page(position: int, window: int, page_size: int) -> int:
    """The first logical page a query at `position` reads in a layer with this window."""
    return max(0, position - window + 1) // page_size


class WindowKV:
    """One device's window pages: the manager of their page space, the layers' window (the largest, when they
    differ), and the largest prompt chunk a step feeds here (what a prompt that prefills here promises for)."""

    def __init__(self, manager: KVManager, window: int, max_chunk: int):
        self.manager, self.window, self.max_chunk = manager, window, max_chunk
        self.page_size = manager.page_size

    def num_pages_for(self, num_tokens: int, prefills: bool) -> int:
        """The most window pages a request of num_tokens tokens in all holds at once here, prefilling here or not."""
        most = max_window_pages(self.window, self.page_size, self.max_chunk if prefills else 1)
        return min(most, self.manager.pages_for(num_tokens))

    def reserve(self, num_tokens: int, prefills: bool) -> WindowPages | None:
        """A request's window pages here, promised (none drawn yet); None, promising nothing, if too few are free."""
        return self.promise_pages(self.num_pages_for(num_tokens, prefills))

    def reserve_cached(self, num_tokens: int, prefills: bool, first: int, cached: list[int]) -> WindowPages | None:
        """reserve(), the request already holding `cached`: its logical pages [first, first + len(cached)), shared
        from the prefix cache (WindowKV.cached_window)."""
        count = self.num_pages_for(num_tokens, prefills)
        try:
            self.manager.promise(count - len(cached))
        except OutOfPages:
            return None
        return WindowPages(self, count, count - len(cached), [-1] * first + cached, len(cached), first)

    def cached_window(self, hashes: Sequence[bytes], num_cached_pages: int) -> tuple[int, list[int]]:
        """The longest cached prefix of at most num_cached_pages pages (those the full layers have cached) whose
        windowed layers' pages are cached too: the window before its end, which its first new query reads. vLLM's
        rule for sliding-window groups: the full layers need every page of the prefix, the windowed layers only
        its last window's. Returns (its length in pages, the window pages of its last window, a holder added)."""
        for k in range(num_cached_pages, 0, -1):
            first = first_window_page(k * self.page_size, self.window, self.page_size)
            pages = self.manager.share_all(hashes[first:k])
            if pages is not None:
                return k, pages
        return 0, []

    def promise_pages(self, count: int) -> WindowPages | None:
        """Window pages of which `count` may be held at once, promised; None, promising nothing, if too few are free."""
        try:
            self.manager.promise(count)
        except OutOfPages:
            return None
        return WindowPages(self, count)


@dataclass(eq=False)
class WindowPages:
    """One request's window pages on one device. table[p]: the window page holding its logical page p, -1 where it
    holds none (slid past, or not reached yet). It may hold up to max_pages at once: those it holds and
    num_promised more it may draw."""

    kv: WindowKV
    max_pages: int
    num_promised: int = -1  # -1: max_pages (nothing drawn yet)
    table: list[int] = field(default_factory=list)
    num_held: int = 0
    num_passed: int = 0  # logical pages below this were given back (or never held)

    def __post_init__(self) -> None:
        if self.num_promised < 0:
            self.num_promised = self.max_pages

    def advance(self, first_query: int, end: int) -> None:
        """Before a step that feeds positions [first_query, end): gives back the pages before first_query's window
        and draws the ones the step writes that are not held yet."""
        kv = self.kv
        first = first_window_page(first_query, kv.window, kv.page_size)
        if first > self.num_passed:
            passed = [b for b in self.table[self.num_passed:first] if b >= 0]
            self.table[self.num_passed:first] = [-1] * len(self.table[self.num_passed:first])
            self.num_passed = first
            if passed:
                self.num_held -= len(passed)
                # promised again up to what it may hold: after shrink(), fewer than it gave back
                again = max(0, min(len(passed), self.max_pages - self.num_held - self.num_promised))
                kv.manager.free_to_promise(passed, again)
                self.num_promised += again
        num_pages = kv.manager.pages_for(end)
        self.table += [-1] * (num_pages - len(self.table))
        missing = [p for p in range(self.num_passed, num_pages) if self.table[p] < 0]
        if not missing:
            return
        if len(missing) > self.num_promised:
            raise RuntimeError(f"a window needs {len(missing)} more pages, {self.num_promised} promised: its chunk is "
                               "longer than the one it was placed for")
        for p, b in zip(missing, kv.manager.draw(len(missing))):
            self.table[p] = b
        self.num_promised -= len(missing)
        self.num_held += len(missing)

    def shrink(self, num_tokens: int) -> None:
        """A prompt that prefilled here decodes on: it keeps what one token a step needs (what it holds beyond
        that goes back as it slides past it)."""
        self.max_pages = self.kv.num_pages_for(num_tokens, prefills=False)
        extra = max(0, min(self.num_promised, self.num_held + self.num_promised - self.max_pages))
        if extra:
            self.kv.manager.unpromise(extra)
            self.num_promised -= extra

    def live_pages(self, end: int) -> range:
        """The logical pages a query at position `end` (the next token) reads, up to the one holding end - 1."""
        kv = self.kv
        return range(first_window_page(end, kv.window, kv.page_size), kv.manager.pages_for(end))

    def release(self) -> None:
        """Gives back every page it holds and what is left of its promise (once; a second call does nothing)."""
        held = [b for b in self.table[self.num_passed:] if b >= 0]
        self.table, self.num_passed, self.num_held, self.max_pages = [], 0, 0, 0
        if held:
            self.kv.manager.free(held)
        if self.num_promised:
            self.kv.manager.unpromise(self.num_promised)
            self.num_promised = 0


def split_pages(num_pages: int, num_layers: int, num_window_layers: int, window: int, page_size: int,
                max_num_seqs: int, max_chunk: int) -> tuple[int, int]:
    """The bytes of num_pages whole-model pages split into (full-layer pages, window pages). The window part is
    sized for every decode seat's window plus four prompts' chunks, at most three quarters of the bytes: what
    windows cannot use is worth more as full layers' context. With no full layer (every layer windowed) the full
    pages hold no bytes, and their count only bounds admission as the bytes would have."""
    num_full_layers = num_layers - num_window_layers
    budget = num_pages * num_layers  # in pages of one layer
    wanted = max_num_seqs * max_window_pages(window, page_size, 1) + 4 * max_window_pages(window, page_size, max_chunk)
    num_window = max(1, min(wanted, budget * 3 // 4 // num_window_layers))
    if not num_full_layers:
        return budget, num_window
    return max(1, (budget - num_window * num_window_layers) // num_full_layers), num_window
