"""KV events from the indexes: a page entering a pool, the host tier or the disk tier is reported stored (with
its parent and tokens where known), a page leaving is reported removed, and replaying the events always gives
back exactly what each index holds, whatever the mix of publications, evictions and flushes."""

from __future__ import annotations

import random

import msgspec
import torch

from nodeserve.kv.disk import DiskTier
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
    log = KVEventLog(16)
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
    log = KVEventLog(PAGE)
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
    log = KVEventLog(PAGE)
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
    disk.events = log.sink("disk")
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
    again.events = log.sink("disk")
    log.cleared()  # a restart: the publisher starts with AllBlocksCleared, then the scan reports what is there
    again.start()
    index = {}
    apply(index, log.take())
    assert index["disk"] == {event_hash(h) for h in again.hashes()} and len(index["disk"]) == again.num_files > 0
    again.stop()
