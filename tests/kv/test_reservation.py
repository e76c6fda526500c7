"""Reservations: a placement's pages across its devices taken whole or not at all and given back once, a move's
target pages, scratch pages and the CUDA-graph padding page."""

from __future__ import annotations

import pytest

from nodeserve.kv.manager import KVManager, OutOfPages, hash_pages
from nodeserve.kv.reservation import reserve_padding_page, reserve_prompt, reserve_tokens, scratch_pages

PAGE = 4
PROMPT = list(range(13))  # 3 full pages and one token: at most 3 pages can come from a cache


def _with_cached_prefix(num_pages: int, num_cached_pages: int) -> KVManager:
    """A prefix-caching manager holding the first num_cached_pages pages of PROMPT, cached and unheld."""
    kv = KVManager(num_pages, PAGE, prefix_cache=True)
    hashes = hash_pages(PROMPT, PAGE)[:num_cached_pages]
    pages = kv.allocate(num_cached_pages)
    kv.publish(pages, hashes)
    kv.free(pages)
    return kv


def test_a_local_reservation_takes_what_the_manager_would_with_the_cached_prefix_first():
    kv, twin = _with_cached_prefix(10, 2), _with_cached_prefix(10, 2)
    hashes = hash_pages(PROMPT, PAGE)
    r = reserve_prompt(kv, kv, hashes, len(PROMPT), 21)
    expected, num_cached = twin.allocate_prompt(hashes, len(PROMPT), twin.pages_for(21))
    assert (r.pages, r.num_cached_tokens) == (expected, num_cached) and num_cached == 2 * PAGE
    assert len(r.pages) == 6 and r.prefill_kv is None and r.prompt_pages is None
    assert r.num_own_cached_tokens == 2 * PAGE
    assert (kv.num_free, kv.num_hit_tokens) == (twin.num_free, twin.num_hit_tokens) == (4, 8)
    assert kv.num_in_flight(hashes[2:]) == twin.num_in_flight(hashes[2:]) == 1  # the third page, to be computed


def test_a_cross_reservation_takes_the_decode_pages_and_the_prompt_pages_each_with_its_own_prefix():
    decode, prefill, twin = KVManager(10, PAGE, prefix_cache=True), _with_cached_prefix(6, 3), _with_cached_prefix(6, 3)
    hashes = hash_pages(PROMPT, PAGE)
    r = reserve_prompt(decode, prefill, hashes, len(PROMPT), 21)
    expected, num_cached = twin.allocate_prompt(hashes, len(PROMPT), twin.pages_for(len(PROMPT)))
    assert len(r.pages) == decode.pages_for(21) == 6 and r.num_cached_tokens == 0
    assert r.prefill_kv is prefill and (r.prompt_pages, r.num_prompt_cached_tokens) == (expected, num_cached)
    assert len(r.prompt_pages) == 4 and r.num_own_cached_tokens == num_cached == 3 * PAGE
    assert (decode.num_used, prefill.num_used) == (6, 4)


def test_a_prefill_device_short_of_pages_leaves_the_decode_device_as_it_was():
    decode, prefill = _with_cached_prefix(10, 2), KVManager(3, PAGE, prefix_cache=True)  # the prompt needs 4
    hashes = hash_pages(PROMPT, PAGE)
    assert reserve_prompt(decode, prefill, hashes, len(PROMPT), 21) is None
    assert (decode.num_free, decode.num_used, decode.num_cached) == (10, 0, 2)
    assert len(decode.lookup(hashes)) == 2 and decode.num_in_flight(hashes[2:]) == 0  # nothing left in flight
    assert prefill.num_free == 3


def test_a_decode_device_short_of_pages_takes_nothing_anywhere():
    decode, prefill = KVManager(5, PAGE), KVManager(10, PAGE)  # 21 tokens need 6 decode pages
    assert reserve_prompt(decode, prefill, hash_pages(PROMPT, PAGE), len(PROMPT), 21) is None
    assert (decode.num_free, prefill.num_free) == (5, 10)


def test_release_gives_every_page_back_once():
    decode, prefill = _with_cached_prefix(10, 2), _with_cached_prefix(8, 3)
    hashes = hash_pages(PROMPT, PAGE)
    r = reserve_prompt(decode, prefill, hashes, len(PROMPT), 21)
    assert (decode.num_free, prefill.num_free) == (4, 4)
    r.release()
    assert (decode.num_free, decode.num_used, prefill.num_free, prefill.num_used) == (10, 0, 8, 0)
    assert (decode.num_cached, prefill.num_cached) == (2, 3)  # the shared prefixes stay cached
    r.release()  # a second free of these pages would raise "freed twice"
    assert r.released and (decode.num_free, prefill.num_free) == (10, 8)
    local = reserve_prompt(decode, decode, hashes, len(PROMPT), 21)
    local.release()
    local.release()
    assert decode.num_used == 0


def test_reserve_tokens_takes_fresh_pages_or_nothing():
    kv = _with_cached_prefix(6, 3)
    pages = reserve_tokens(kv, 17)
    assert len(pages) == 5 and kv.num_used == 5 and kv.num_cached == 1  # fresh: two cached pages evicted
    assert reserve_tokens(kv, 5) is None and kv.num_used == 5
    kv.free(pages)
    assert kv.num_used == 0


def test_scratch_pages_come_back_on_exit_and_on_error():
    kv = KVManager(8, PAGE)
    with scratch_pages(kv, 3) as pages:
        assert len(set(pages)) == 3 and kv.num_used == 3
    assert kv.num_free == 8
    with pytest.raises(RuntimeError, match="boom"):
        with scratch_pages(kv, 8):
            raise RuntimeError("boom")
    assert kv.num_free == 8
    with pytest.raises(OutOfPages):
        with scratch_pages(kv, 9):
            pass
    assert kv.num_free == 8


def test_the_padding_page_leaves_circulation_for_good():
    kv = KVManager(4, PAGE)
    page = reserve_padding_page(kv)
    assert (kv.num_usable, kv.num_free, kv.num_used) == (3, 3, 0)
    assert page not in kv.allocate(3)
