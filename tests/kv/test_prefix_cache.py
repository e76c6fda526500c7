"""KVManager's prefix cache: chained page hashes, publication, lookups, sharing, LRU eviction and the counts
admission relies on."""

from __future__ import annotations

import pytest

from nodeserve.kv.manager import KVManager, hash_pages

PAGE = 4


def _published(kv: KVManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocates pages for `tokens`, publishes the full ones (as a finished prefill would), frees them."""
    hashes = hash_pages(tokens, PAGE)
    pages = kv.allocate(kv.pages_for(len(tokens)))
    kv.publish(pages[:len(hashes)], hashes)
    kv.free(pages)
    return pages, hashes


def test_hashes_name_the_whole_prefix_and_only_full_pages():
    a = hash_pages([1, 2, 3, 4, 5, 6, 7, 8, 9], PAGE)
    assert len(a) == 2  # the ninth token's page is not full
    assert hash_pages([1, 2, 3, 4, 5, 6, 7, 8], PAGE) == a
    b = hash_pages([0, 2, 3, 4, 5, 6, 7, 8], PAGE)  # same second page, different first: a different prefix
    assert b[0] != a[0] and b[1] != a[1]
    assert hash_pages([5, 6, 7, 8], PAGE, parent=a[0]) == a[1:]  # extends a chain page by page


def test_a_published_prefix_is_found_and_shared_and_the_longest_match_stops_at_the_first_miss():
    kv = KVManager(8, PAGE, prefix_cache=True)
    pages, hashes = _published(kv, list(range(12)))
    assert kv.num_free == 8 and kv.num_used == 0 and kv.num_cached == 3  # cached pages count as free
    other = hash_pages(list(range(8)) + [99, 98, 97, 96], PAGE)
    assert kv.lookup(other) == pages[:2]
    got, cached = kv.allocate_prompt(other, 13, 4)
    assert got[:2] == pages[:2] and cached == 8 and kv.num_used == 4 and kv.num_free == 4
    assert set(got[2:]).isdisjoint(pages)  # the cached third page is a different prefix: not reused
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (13, 8)
    kv.free(got)
    # A prompt that ends on a page boundary never gets its last page from the cache: its last token runs again.
    whole, cached = kv.allocate_prompt(hashes, 12, 3)
    assert whole[:2] == pages[:2] and whole[2] != pages[2] and cached == 8 and kv.lookup(hashes, 12) == pages[:2]
    kv.free(whole)
    assert kv.num_used == 0 and kv.lookup(hashes) == pages


def test_unpublished_pages_are_never_found_and_a_disabled_cache_finds_nothing():
    kv = KVManager(8, PAGE, prefix_cache=True)
    pages = kv.allocate(2)
    kv.free(pages)  # freed without publishing, e.g. an aborted prefill
    assert kv.lookup(hash_pages(list(range(8)), PAGE)) == [] and kv.num_cached == 0
    off = KVManager(8, PAGE, prefix_cache=False)
    _, hashes = _published(off, list(range(8)))
    got, cached = off.allocate_prompt(hashes, 9, 3)
    assert off.lookup(hashes) == [] and cached == 0 and off.num_queried_tokens == 0
    off.free(got)


def test_eviction_takes_free_pages_first_then_the_least_recently_used_cached_leaf():
    kv = KVManager(6, PAGE, prefix_cache=True)
    old, old_hashes = _published(kv, list(range(8)))         # 2 pages
    new, new_hashes = _published(kv, list(range(100, 108)))  # 2 more, freed later
    taken = kv.allocate(2)
    assert set(taken).isdisjoint(old + new) and kv.num_cached == 4  # the two never-used pages went first
    one = kv.allocate(1)
    # The least recently freed prefix goes first, and within it its last page (a leaf) before its first.
    assert one == [old[1]] and kv.lookup(old_hashes) == [old[0]] and kv.lookup(new_hashes) == new
    kv.free(taken + one)


def test_a_held_cached_page_is_never_evicted_and_admission_counts_stay_exact():
    kv = KVManager(4, PAGE, prefix_cache=True)
    pages, hashes = _published(kv, list(range(16)))  # the whole pool is cached, none held
    held, cached = kv.allocate_prompt(hashes, 9, 2)  # 9 tokens: its first 2 pages can come from the cache
    assert held == pages[:2] and cached == 8
    assert kv.num_free == 2 and kv.can_allocate(2) and not kv.can_allocate(3)
    fresh = kv.allocate(2)
    assert set(fresh) == set(pages[2:]) and kv.lookup(hashes) == held  # evicted the unheld ones only
    kv.free(fresh + held)
    assert kv.num_used == 0 and kv.num_free == 4


def test_the_first_page_published_under_a_hash_wins_and_publishing_needs_a_holder():
    kv = KVManager(8, PAGE, prefix_cache=True)
    hashes = hash_pages(list(range(4)), PAGE)
    first, second = kv.allocate(1), kv.allocate(1)
    kv.publish(first, hashes)
    kv.publish(second, hashes)  # computed the same prefix at the same time: stays private
    kv.free(first + second)
    assert kv.lookup(hashes) == first and kv.num_cached == 1 and kv.num_free == 8
    with pytest.raises(ValueError):
        kv.publish(second, hash_pages(list(range(4, 8)), PAGE))
