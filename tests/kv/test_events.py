"""KV events from the indexes: a page entering a pool, the host tier or the disk tier is reported stored (with
its parent and tokens where known), a page leaving is reported removed, and replaying the events always gives
back exactly what each index holds, whatever the mix of publications, evictions and flushes."""

from __future__ import annotations

import random

import msgspec
import torch

from nodeserve.kv.disk import DiskTier
from nodeserve.kv.host import HostTier
from nodeserve.kv.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventBatch, KVEventLog,
                                 event_hash)
from nodeserve.kv.manager import KVManager, hash_pages

PAGE = 4


def apply(index: dict[str, set[int]], events) -> None:
    """What a subscriber does with events: one set of page hashes per medium."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            index.setdefault(e.medium, set()).update(e.block_hashes)
        else:
            index.setdefault(e.medium, set()).difference_update(e.block_hashes)


def _cached(kv: KVManager) -> set[int]:
    return {event_hash(h) for _, h in kv.cached_pages()}


def test_the_wire_layout_is_vllms_arrays():
    log = KVEventLog(16, include_tokens=True)
    log.sink("cpu:0").stored([b"\x00" * 7 + b"\x05" + b"x" * 8], None, list(range(16)))
    log.sink("host").removed([b"\x00" * 7 + b"\x05" + b"y" * 8])
    log.cleared()
    raw = msgspec.msgpack.encode(EventBatch(1.5, log.take(), 0))
    assert msgspec.msgpack.decode(raw) == [1.5, [["BlockStored", [5], None, list(range(16)), 16, None, "cpu:0", None],
                                                 ["BlockRemoved", [5], "host"], ["AllBlocksCleared"]], 0]
    assert isinstance(msgspec.msgpack.decode(raw, type=KVEventBatch).events[1], BlockRemoved)
    assert log.take() == []


def test_a_publication_is_reported_with_its_parent_and_tokens_and_an_eviction_as_removed():
    kv = KVManager(4, PAGE, prefix_cache=True)
    log = KVEventLog(PAGE, include_tokens=True)
    kv.events = log.sink("cpu:0")
    tokens = list(range(12))
    hashes = hash_pages(tokens, PAGE)
    pages, _ = kv.allocate_prompt(hashes, len(tokens) + 1, 3)
    kv.publish(pages[:1], hashes[:1], None, tokens[:4])
    kv.publish(pages[1:], hashes[1:], hashes[0], tokens[4:])
    first, rest = log.take()
    assert first.block_hashes == [event_hash(hashes[0])] and first.parent_block_hash is None
    assert first.token_ids == tokens[:4] and first.medium == "cpu:0" and first.block_size == PAGE
    assert rest.block_hashes == [event_hash(h) for h in hashes[1:]] and rest.token_ids == tokens[4:]
    assert rest.parent_block_hash == event_hash(hashes[0])
    kv.free(pages)
    assert log.take() == []  # freed pages stay cached: nothing left the index
    kv.allocate(3)  # 1 free page, then the two least recently used cached ones (the tail, freed first)
    (removed,) = log.take()
    assert removed == BlockRemoved([event_hash(hashes[2]), event_hash(hashes[1])], "cpu:0")


def test_a_page_already_cached_elsewhere_splits_the_run():
    kv = KVManager(8, PAGE, prefix_cache=True)
    log = KVEventLog(PAGE, include_tokens=True)
    kv.events = log.sink("d")
    tokens = list(range(12))
    hashes = hash_pages(tokens, PAGE)
    a = kv.allocate(3)
    kv.publish(a[1:2], hashes[1:2], hashes[0], tokens[4:8])  # another request got page 1 in first
    log.take()
    kv.publish(a, hashes, None, tokens)
    one, three = log.take()
    assert one.block_hashes == [event_hash(hashes[0])] and one.token_ids == tokens[:4]
    assert three.block_hashes == [event_hash(hashes[2])] and three.parent_block_hash == event_hash(hashes[1])
    assert three.token_ids == tokens[8:]


def test_replayed_events_equal_the_index_after_random_work():
    rng = random.Random(7)
    kv = KVManager(24, PAGE, prefix_cache=True)
    log = KVEventLog(PAGE)
    kv.events = log.sink("cpu:1")
    index: dict[str, set[int]] = {}
    held: list[list[int]] = []
    for step in range(600):
        op = rng.random()
        if op < 0.5:
            stem = rng.randrange(6)  # a few shared stems, so prefixes are shared and re-published
            tokens = [stem] * PAGE + [rng.randrange(50) for _ in range(rng.randrange(0, 4 * PAGE))]
            hashes = hash_pages(tokens, PAGE)
            if hashes and kv.can_allocate(len(hashes)):
                pages, num_cached = kv.allocate_prompt(hashes, len(tokens) + 1, len(hashes))
                first = num_cached // PAGE
                kv.publish(pages[first:], hashes[first:], None, tokens[first * PAGE:len(hashes) * PAGE])
                held.append(pages)
        elif op < 0.9 and held:
            kv.free(held.pop(rng.randrange(len(held))))
        elif op < 0.95:
            kv.drop_cached()
        apply(index, log.take())
        assert index.get("cpu:1", set()) == _cached(kv), step
    for pages in held:
        kv.free(pages)
    kv.drop_cached()
    apply(index, log.take())
    assert index["cpu:1"] == set() and kv.num_used == 0


def test_the_disk_tier_reports_its_scan_its_writes_and_its_evictions(tmp_path):
    page_nbytes = 64
    fp = "ab" * 16
    log = KVEventLog(PAGE)
    disk = DiskTier(str(tmp_path), 3 * (page_nbytes + 64 + 8 * PAGE + 32), fp, page_nbytes, page_size=PAGE)
    disk.events = log.sink("disk", chained=False)
    disk.start()
    hashes = [bytes([i]) * 16 for i in range(5)]
    for h in hashes:
        disk.put(h, torch.full((page_nbytes,), 1, dtype=torch.uint8), [0] * PAGE)
        assert disk.flush(5)
    disk.stop()
    index: dict[str, set[int]] = {}
    apply(index, log.take())
    assert index["disk"] == {event_hash(h) for h in disk.hashes()} and disk.num_evictions > 0

    again = DiskTier(str(tmp_path), 3 * (page_nbytes + 64 + 8 * PAGE + 32), fp, page_nbytes, page_size=PAGE)
    again.events = log.sink("disk", chained=False)
    log.cleared()  # a restart: the publisher starts with AllBlocksCleared, then the scan reports what is there
    again.start()
    index = {}
    events = log.take()
    apply(index, events)
    scan = [e for e in events if isinstance(e, BlockStored)]
    assert len(scan) == again.num_files > 1  # files in no particular order: one page an event, no chain claimed
    assert all(len(e.block_hashes) == 1 and e.parent_block_hash is None for e in scan)
    assert index["disk"] == {event_hash(h) for h in again.hashes()} and len(index["disk"]) == again.num_files > 0
    again.stop()


def test_token_ids_are_sent_only_when_asked_for():
    tokens = list(range(8))
    hashes = hash_pages(tokens, PAGE)
    quiet, loud = KVEventLog(PAGE), KVEventLog(PAGE, include_tokens=True)
    for log in (quiet, loud):
        log.sink("cpu:0").stored(hashes, None, tokens)
    (q,), (l,) = quiet.take(), loud.take()
    assert q.token_ids == [] and q.block_hashes == l.block_hashes  # the default: hashes, never the text
    assert l.token_ids == tokens


def _claimed_links(events) -> set[tuple[int | None, int]]:
    """(parent, page) pairs the BlockStored events claim: each page follows the one before it in its list."""
    links = set()
    for e in events:
        if isinstance(e, BlockStored):
            for parent, h in zip([e.parent_block_hash] + e.block_hashes[:-1], e.block_hashes):
                if parent is not None:
                    links.add((parent, h))
    return links


def _true_links(*prompts: list[int]) -> set[tuple[int, int]]:
    links = set()
    for tokens in prompts:
        hashes = [event_hash(h) for h in hash_pages(tokens, PAGE)]
        links |= set(zip(hashes, hashes[1:]))
    return links


def test_host_tier_events_claim_no_prefix_chain_that_does_not_exist():
    from tests.kv.test_host import _pool, _publish
    pool = _pool(8)
    host = HostTier.like(32, pool)
    log = KVEventLog(PAGE)
    pool.manager.events, host.index.events = log.sink("cpu:0"), log.sink("host", chained=False)
    pool.manager.on_evict = lambda evicted: host.store_evicted(pool, evicted)
    a, b = list(range(16)), list(range(100, 116))
    _publish(pool, a)
    _publish(pool, b)
    taken = pool.manager.allocate(8)  # evicts all eight, least recently used first: not in prefix order
    events = log.take()
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]
    assert len(stored) == host.num_stored_pages == 8
    assert _claimed_links(events) <= _true_links(a, b)  # the pool's chains are real; the host claims none
    index: dict[str, set[int]] = {}
    apply(index, events)
    assert index["host"] == {event_hash(h) for h in hash_pages(a, PAGE) + hash_pages(b, PAGE)}
    pool.manager.free(taken)
