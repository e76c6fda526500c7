"""KVManager: free list, reference counts, reserved pages, the leak count, errors and thread safety."""

from __future__ import annotations

import random
import threading

import pytest

from nodeserve.kv.manager import KVManager, OutOfPages, hash_pages


def test_allocate_free_round_trip():
    alloc = KVManager(10, 16)
    assert alloc.num_free == 10
    a = alloc.allocate(3)
    b = alloc.allocate(4)
    assert len(a) == 3 and len(b) == 4
    assert len(set(a) | set(b)) == 7 and all(0 <= p < 10 for p in a + b)
    assert alloc.num_free == 3
    alloc.free(a)
    assert alloc.num_free == 6
    alloc.free(b)
    assert alloc.num_free == 10
    # Freed pages come back out again: the whole pool can be taken.
    assert sorted(alloc.allocate(10)) == list(range(10))
    assert alloc.num_free == 0


def test_reserved_pages_leave_circulation_and_the_leak_count_sees_holders():
    kv = KVManager(8, 16)
    assert kv.pages_for(33) == 3 and kv.can_allocate(8) and not kv.can_allocate(9)
    scratch = kv.reserve()
    assert (kv.num_usable, kv.num_free, kv.num_used) == (7, 7, 0)
    held = kv.allocate(3)
    assert scratch not in held and kv.num_used == 3 and not kv.can_allocate(5)
    kv.share(held[:1])
    kv.free(held)
    assert kv.num_used == 1  # one page still has a holder
    kv.free(held[:1])
    assert kv.num_used == 0 and kv.num_free == kv.num_usable == 7


def test_allocate_zero_pages():
    alloc = KVManager(2, 16)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2


def test_out_of_pages_allocates_nothing():
    alloc = KVManager(5, 16)
    held = alloc.allocate(3)
    with pytest.raises(OutOfPages, match="need 3 pages, 2 free"):
        alloc.allocate(3)
    assert alloc.num_free == 2
    rest = alloc.allocate(2)  # exactly what is left still works
    assert set(rest).isdisjoint(held)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(held + rest)
    assert alloc.num_free == 5


def test_shared_page_is_free_after_last_holder():
    alloc = KVManager(4, 16)
    pages = alloc.allocate(2)
    alloc.share(pages)             # a second holder
    alloc.free(pages)
    assert alloc.num_free == 2     # still held once
    alloc.share(pages[:1])         # a third holder of the first page only
    alloc.free(pages)
    assert alloc.num_free == 3     # the second page is back, the first is still held
    alloc.free(pages[:1])
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free(pages[:1])


def test_double_free_raises():
    alloc = KVManager(3, 16)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(pages[:1])
    assert alloc.num_free == 3


def test_free_of_never_allocated_page_raises():
    alloc = KVManager(3, 16)
    with pytest.raises(ValueError):
        alloc.free([1])
    assert alloc.num_free == 3


def test_share_unallocated_page_raises():
    alloc = KVManager(3, 16)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share([0])
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(ValueError):
        alloc.share(pages)


def test_concurrent_allocate_free():
    num_pages = 64
    alloc = KVManager(num_pages, 16)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    in_use: set[int] = set()  # pages some thread holds right now
    in_use_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[list[int]] = []
        try:
            barrier.wait()
            for _ in range(2000):
                if held and (rng.random() < 0.5 or len(held) > 4):
                    pages = held.pop(rng.randrange(len(held)))
                    if rng.random() < 0.2:  # share then free twice
                        alloc.share(pages)
                        alloc.free(pages)
                    with in_use_lock:
                        in_use.difference_update(pages)
                    alloc.free(pages)
                else:
                    try:
                        pages = alloc.allocate(rng.randint(1, 4))
                    except OutOfPages:
                        continue
                    with in_use_lock:
                        assert in_use.isdisjoint(pages), f"pages {sorted(in_use & set(pages))} handed out twice"
                        in_use.update(pages)
                    held.append(pages)
            for pages in held:
                with in_use_lock:
                    in_use.difference_update(pages)
                alloc.free(pages)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert alloc.num_free == num_pages
    owned = alloc.allocate(num_pages)
    assert sorted(owned) == list(range(num_pages))  # no page lost or handed out twice


def test_allocate_tokens_takes_fresh_pages_for_that_many_tokens():
    kv = KVManager(4, 16)
    assert len(kv.allocate_tokens(17)) == 2 and kv.num_free == 2
    with pytest.raises(OutOfPages):
        kv.allocate_tokens(33)
    assert kv.num_free == 2


def test_scrub_takes_a_colliding_page_out_of_the_cache():
    from nodeserve.kv.events import KVEventLog, event_hash

    kv = KVManager(8, 4, prefix_cache=True)
    kv.events = log = KVEventLog(4).sink("d")
    a, b = list(range(12)), list(range(100, 112))
    hashes = hash_pages(a, 4)
    pages, _ = kv.allocate_prompt(hashes, 13, 3)
    kv.publish(pages, hashes, None, a)
    kv.free(pages)
    log.log.take()
    assert kv.scrub(hashes, a) == 0 and kv.num_collisions == 0          # its own tokens: kept
    assert kv.scrub(hashes, a[:4] + b[4:]) == 1 and kv.num_collisions == 1  # page 1 holds other tokens
    assert len(kv.lookup(hashes)) == 1                                      # the match stops before it
    (removed,) = log.log.take()
    assert removed.block_hashes == [event_hash(hashes[1])]
    assert kv.num_free == 8 and kv.num_cached == 2                          # it is free, not cached
    kv.publish(kv.allocate(1), [b"x" * 16])                                 # published without tokens:
    assert kv.scrub([b"x" * 16], b[:4]) == 0                                # taken as it is
