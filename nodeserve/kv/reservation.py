"""Reservations: how code outside kv/ takes pages from the KVManagers (the free lists stay theirs alone).

A placement's reservation spans its devices: the decode pages (prompt + max_tokens) and, when the prompt prefills
on another device, the prompt's pages there. It is taken whole or not at all, so a placement never waits holding
half of what it needs (runtime/router.py says why that rules out deadlock). A move takes fresh pages for the whole
request on its target. Pages no request holds: scratch pages for a throwaway run (warm-up, profiling, FP8
calibration), given back on exit, and the page CUDA-graph padding rows write to, held for the pool's lifetime.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from nodeserve.kv.manager import KVManager, OutOfPages
from nodeserve.kv.window import WindowKV, WindowPages, first_window_page, max_window_pages


@dataclass
class Reservation:
    """The pages one placement took. On the decode device: `pages`, led by those holding the `num_cached_tokens`
    tokens its prefix cache had (shared). On a separate prefill device (prefill_kv None when the request prefills
    where it decodes): `prompt_pages`, with `num_prompt_cached_tokens` likewise. Workers take the page lists as
    they are; release() is only for a placement that falls through before any worker has them."""

    decode_kv: KVManager
    pages: list[int]
    num_cached_tokens: int
    prefill_kv: KVManager | None = None
    prompt_pages: list[int] | None = None
    num_prompt_cached_tokens: int = 0
    # a model's windowed layers' pages (kv/window.py), on the decode device and on a separate prefill device
    window: WindowPages | None = None
    prompt_window: WindowPages | None = None
    released: bool = field(default=False, init=False, repr=False)

    @property
    def num_own_cached_tokens(self) -> int:
        """Cached prompt tokens on the device that computes the prompt: where its prefill starts."""
        return self.num_cached_tokens if self.prefill_kv is None else self.num_prompt_cached_tokens

    def release(self) -> None:
        """Gives every page back, once (a second call does nothing). Nothing wrote them: no stream to wait for."""
        if self.released:
            return
        self.released = True
        self.decode_kv.free(self.pages)
        if self.prefill_kv is not None:
            self.prefill_kv.free(self.prompt_pages)
        for window in (self.window, self.prompt_window):
            if window is not None:
                window.release()


def reserve_prompt(decode_kv: KVManager, prefill_kv: KVManager, hashes: Sequence[bytes], num_prompt_tokens: int,
                   max_total_tokens: int, decode_window: WindowKV | None = None,
                   prefill_window: WindowKV | None = None) -> Reservation | None:
    """Pages for a request that decodes on decode_kv's device and prefills on prefill_kv's (the same manager when
    it prefills where it decodes): max_total_tokens' worth on the decode device, the prompt's on the prefill
    device, each starting with the prefix cached there. For a model with windowed layers, their window pages on
    each too (decode_window, prefill_window: the devices' WindowKV): the device that prefills counts a cached
    prefix only as far as its last window is cached (WindowKV.cached_window), and a decode device the prompt is
    handed to draws now the pages its last window is copied into. None, holding nothing, if either device is
    short: another thread may have taken pages since the placer's snapshot, so the caller tries again later."""
    local = prefill_kv is decode_kv
    held: list = []
    try:
        pages, num_cached, window = _allocate_prompt(decode_kv, decode_window if local else None, hashes,
                                                     num_prompt_tokens, max_total_tokens, held)
        if not local and decode_window is not None:
            window = _reserve_window(decode_window, max_total_tokens, False, held)
            window.advance(num_prompt_tokens, num_prompt_tokens)  # the copy's target
        if local:
            return Reservation(decode_kv, pages, num_cached, window=window)
        prompt_pages, num_prompt_cached, prompt_window = _allocate_prompt(
            prefill_kv, prefill_window, hashes, num_prompt_tokens, num_prompt_tokens, held)
    except OutOfPages:
        for release in reversed(held):
            release()
        return None
    return Reservation(decode_kv, pages, num_cached, prefill_kv, prompt_pages, num_prompt_cached, window, prompt_window)


def _allocate_prompt(kv: KVManager, window_kv: WindowKV | None, hashes: Sequence[bytes], num_prompt_tokens: int,
                     num_tokens: int, held: list) -> tuple[list[int], int, WindowPages | None]:
    """(pages, cached tokens, window pages) for num_tokens on a device, its cached prefix shared; window_kv: that of
    a device that prefills the prompt, whose cached prefix then ends where its windowed layers' pages do. Appends
    how to give each part back to `held`; raises OutOfPages."""
    if window_kv is None:
        pages, num_cached = kv.allocate_prompt(hashes, num_prompt_tokens, kv.pages_for(num_tokens))
        held.append(lambda: kv.free(pages))
        return pages, num_cached, None
    num_hit, cached = window_kv.cached_window(hashes, len(kv.lookup(hashes, num_prompt_tokens)))
    try:
        pages, num_cached = kv.allocate_prompt(hashes[:num_hit], num_prompt_tokens, kv.pages_for(num_tokens))
        if num_cached < num_hit * kv.page_size:  # evicted meanwhile: no prefix then, rather than a window short
            kv.free(pages)
            window_kv.manager.free(cached)
            cached = []
            pages, num_cached = kv.allocate_prompt((), num_prompt_tokens, kv.pages_for(num_tokens))
    except OutOfPages:
        window_kv.manager.free(cached)
        raise
    window = window_kv.reserve_cached(num_tokens, True, first_window_page(num_cached, window_kv.window, kv.page_size),
                                      cached)
    if window is None:
        kv.free(pages)
        window_kv.manager.free(cached)
        raise OutOfPages("window pages")
    held.append(lambda: kv.free(pages))
    held.append(window.release)
    return pages, num_cached, window


def _reserve_window(kv: WindowKV, num_tokens: int, prefills: bool, held: list) -> WindowPages:
    """A request's window pages on a device with windowed layers, appended to `held`; raises OutOfPages."""
    window = kv.reserve(num_tokens, prefills)
    if window is None:
        raise OutOfPages("window pages")
    held.append(window.release)
    return window


def reserve_tokens(kv: KVManager, num_tokens: int) -> list[int] | None:
    """Fresh pages for num_tokens tokens on a move's target (its copies write them whole); None if too few."""
    try:
        return kv.allocate_tokens(num_tokens)
    except OutOfPages:
        return None


def reserve_move(kv: KVManager, window: WindowKV | None, num_tokens: int) -> tuple[list[int], WindowPages | None] | None:
    """A move's target: fresh pages for num_tokens tokens and, where the model has windowed layers, their window
    pages promised (drawn when the request stops on its source). None, taking nothing, if either is short."""
    pages = reserve_tokens(kv, num_tokens)
    if pages is None or window is None:
        return None if pages is None else (pages, None)
    window_pages = window.reserve(num_tokens, prefills=False)
    if window_pages is None:
        kv.free(pages)
        return None
    return pages, window_pages


@contextmanager
def scratch_windows(kv: WindowKV | None, spans: Sequence[tuple[int, int]]) -> Iterator[list[list[int] | None]]:
    """Window tables (SeqChunk.window_table) for throwaway sequences feeding positions [start, end) each (warm-up,
    profiling), given back on exit, even on an error; None each where the pool has no window pages. Raises
    OutOfPages, taking nothing, if too few are free."""
    if kv is None:
        yield [None] * len(spans)
        return
    windows: list[WindowPages] = []
    try:
        for start, end in spans:
            window = kv.promise_pages(max_window_pages(kv.window, kv.page_size, end - start))
            if window is None:
                raise OutOfPages("window pages")
            windows.append(window)
            window.advance(start, end)
        yield [w.table for w in windows]
    finally:
        for window in windows:
            window.release()


@contextmanager
def scratch_pages(kv: KVManager, count: int) -> Iterator[list[int]]:
    """`count` pages for a throwaway sequence (warm-up, profiling, FP8 calibration), given back on exit, even on
    an error. Raises OutOfPages, taking nothing, if too few are free."""
    pages = kv.allocate(count)
    try:
        yield pages
    finally:
        kv.free(pages)


def reserve_padding_page(kv: KVManager) -> int:
    """The page CUDA-graph padding rows write their K/V to. The graphs bake it in and live as long as the pool,
    so it leaves circulation for good (num_usable drops by one) and is never given back."""
    return kv.reserve()
