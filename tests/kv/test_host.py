"""The host tier: pages evicted from a device pool keep their KV there, loads hold their slots against eviction,
disk pages come back through it, and the page-manager hooks (evictions, publications, in-flight prefixes) it
relies on."""

from __future__ import annotations

import threading
import time

import torch

from nodeserve.kv.disk import DiskTier
from nodeserve.kv.host import HostTier
from nodeserve.kv.manager import KVManager, hash_pages
from nodeserve.kv.pool import KVPool
from nodeserve.model.config import ModelConfig

PAGE = 4


def _pool(num_pages: int = 8) -> KVPool:
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=True)
    pool = KVPool(cfg, num_pages, PAGE, torch.float32, torch.device("cpu"), prefix_cache=True)
    pool.data.copy_(torch.randn_like(pool.data))
    return pool


def _publish(pool: KVPool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A request's pages for `tokens`, written (random KV) and published, then freed: cached, evictable."""
    hashes = hash_pages(tokens, PAGE)
    pages, _ = pool.manager.allocate_prompt(hashes, len(tokens) + 1, len(hashes))
    pool.manager.publish(pages, hashes, token_ids=tokens)
    pool.manager.free(pages)
    return pages, hashes


def _held_with(host: HostTier, hashes: list[bytes], before: torch.Tensor) -> list[int]:
    """The host slots under `hashes`, held, after checking they hold `before` ([L, n, ...] pool layout)."""
    slots = host.hold(hashes)
    assert len(slots) == len(hashes) and torch.equal(host.data[slots].transpose(0, 1), before)
    return slots


def _release_all(host: HostTier, pool: KVPool, slots: list[int], taken: list[int]) -> None:
    host.release(slots)
    pool.manager.free(taken)
    assert host.index.num_used == 0 and pool.manager.num_used == 0


def test_a_page_evicted_from_a_pool_keeps_its_kv_in_the_host_tier():
    pool = _pool(4)
    host = HostTier.like(16, pool)
    pool.manager.on_evict = lambda evicted: host.store_evicted(pool, evicted)
    pages, hashes = _publish(pool, list(range(16)))        # 4 pages, cached
    before = pool.data[:, pages].clone()
    taken = pool.manager.allocate(4)                         # evicts all four ...
    pool.data[:, taken] = 0.0                                # ... and their new holder overwrites them
    slots = _held_with(host, hashes, before)
    assert pool.manager.num_evictions == 4
    dst = torch.tensor(taken)
    for layer in range(host.num_layers):                     # and they load back, layer by layer
        host.copy_layer(layer, torch.tensor(slots), pool, dst)
    assert torch.equal(pool.data[:, taken], before)
    _release_all(host, pool, slots, taken)


def test_an_eviction_copies_at_most_its_byte_budget_keeping_the_most_recently_used_pages():
    pool = _pool(8)
    host = HostTier.like(32, pool)
    pool.manager.on_evict = lambda evicted: host.store_evicted(pool, evicted, max_bytes=3 * host.page_nbytes)
    _, old = _publish(pool, list(range(16)))          # 4 pages, freed first: least recently used
    _, new = _publish(pool, list(range(100, 116)))    # 4 more, freed after them
    taken = pool.manager.allocate(8)                  # evicts all eight in one allocation
    assert host.num_stored_pages == 3 and host.num_dropped_pages == 5
    stored = [h for h in old + new if host.index.lookup([h])]
    assert len(stored) == 3 and set(stored) <= set(new)  # only pages of the later prompt were kept
    pool.manager.free(taken)
    assert host.index.num_used == 0 and pool.manager.num_used == 0


def test_a_slot_held_by_a_load_is_never_evicted_under_it():
    pool = _pool(8)
    host = HostTier.like(4, pool)
    _, first = _publish(pool, list(range(16)))
    host.store(pool, *zip(*pool.manager.cached_pages()))
    held = host.hold(first[:2])
    kept = host.data[held].clone()
    pool.manager.allocate(8)                                   # the pool's pages are all taken now
    other = _pool(8)
    _, hashes = _publish(other, list(range(100, 132)))         # 8 new pages want the 4 slots
    assert host.store(other, *zip(*other.manager.cached_pages())) == 2  # only the unheld 2 slots were free
    assert host.hold(first[:2]) == held and torch.equal(host.data[held], kept)
    host.release(held + held)


def test_write_through_sees_every_published_page_once():
    pool = _pool(8)
    seen = []
    pool.manager.on_publish = lambda pages, hashes: seen.extend(hashes)
    _, hashes = _publish(pool, list(range(16)))
    _publish(pool, list(range(16)))  # the same prefix again: already cached, not entered twice
    assert seen == hashes


def test_disk_pages_come_back_through_held_host_slots_and_a_bad_one_ends_the_run(tmp_path):
    pool = _pool(8)
    host = HostTier.like(8, pool)
    disk = DiskTier(str(tmp_path), 10 * (host.page_nbytes + 512), "ab" * 16, host.page_nbytes, page_size=PAGE)
    disk.start()
    host.disk = disk
    pages, hashes = _publish(pool, list(range(16)))
    host.store(pool, pages, hashes)
    assert disk.flush(10)
    fresh = HostTier.like(8, pool, disk=disk)  # a restart: nothing in host memory
    with open(f"{disk.dir}/{hashes[2].hex()}.kvp", "r+b") as f:  # a bad third page (garbage header)
        f.write(b"garbage")
    slots = fresh.read_from_disk(hashes, list(range(16)))
    assert len(slots) == 2 and disk.num_bad_files == 1
    assert torch.equal(fresh.data[slots].transpose(0, 1), pool.data[:, pages[:2]])
    assert fresh.index.num_used == 2  # held for the caller
    fresh.release(slots)
    disk.stop()


def test_a_page_waiting_for_the_disk_writer_keeps_its_slot(tmp_path, monkeypatch):
    """kv/host.py used to free a slot, then clone it for the disk: in between, another page could take the slot
    and be written under the first page's hash. Now the slot is held, uncopied, until the writer is done."""
    pool = _pool(8)
    host = HostTier.like(4, pool)
    disk = DiskTier(str(tmp_path), 1 << 20, "ab" * 16, host.page_nbytes, page_size=PAGE)
    entered, release = threading.Event(), threading.Event()
    real = disk._write

    def blocked(h, page, tokens):
        entered.set()
        release.wait(10)
        return real(h, page, tokens)
    monkeypatch.setattr(disk, "_write", blocked)
    disk.start()
    host.disk = disk
    pages, hashes = _publish(pool, list(range(8)))  # 2 pages
    before = pool.data[:, pages].clone()
    assert host.store(pool, pages, hashes) == 2 and entered.wait(5)
    assert host.index.num_used == 2  # both held for the writer
    other_pages, other = _publish(pool, list(range(100, 116)))  # 4 pages for 2 free slots
    assert host.store(pool, other_pages, other) == 2  # only the free slots: the held ones are not reused
    release.set()
    assert disk.flush(10) and host.index.num_used == 0
    fresh = HostTier.like(4, pool, disk=disk)
    slots = fresh.read_from_disk(hashes, list(range(8)))
    assert len(slots) == 2 and torch.equal(fresh.data[slots].transpose(0, 1), before)
    fresh.release(slots)
    disk.stop()


def test_pages_of_unknown_tokens_stay_off_the_disk(tmp_path):
    pool = _pool(8)
    host = HostTier.like(8, pool)
    disk = DiskTier(str(tmp_path), 1 << 20, "ab" * 16, host.page_nbytes, page_size=PAGE)
    disk.start()
    host.disk = disk
    hashes = hash_pages(list(range(8)), PAGE)
    pages, _ = pool.manager.allocate_prompt(hashes, 9, 2)
    pool.manager.publish(pages, hashes)  # no tokens told
    pool.manager.free(pages)
    assert host.store(pool, pages, hashes) == 2 and disk.flush(5)
    assert disk.num_files == 0 and host.index.num_used == 0
    disk.stop()


def test_a_prompt_being_computed_is_in_flight_until_published_or_freed():
    kv = KVManager(16, PAGE, prefix_cache=True)
    hashes = hash_pages(list(range(20)), PAGE)  # 5 full pages
    pages, cached = kv.allocate_prompt(hashes, 20, 6)
    assert cached == 0 and kv.num_in_flight(hashes) == 5
    kv.publish(pages[:2], hashes[:2])          # its first chunk is done
    assert kv.num_in_flight(hashes) == 0 and kv.num_in_flight(hashes[2:]) == 3
    kv.free(pages)                             # aborted before the rest
    assert kv.num_in_flight(hashes[2:]) == 0
    again, cached = kv.allocate_prompt(hashes, 20, 6)
    assert cached == 2 * PAGE and kv.num_in_flight(hashes[2:]) == 3
    kv.free(again)
    assert kv.num_used == 0


def test_share_prefix_holds_what_it_finds_and_nothing_past_a_miss():
    kv = KVManager(8, PAGE, prefix_cache=True)
    hashes = hash_pages(list(range(16)), PAGE)
    pages, _ = kv.allocate_prompt(hashes, 17, 4)
    kv.publish(pages[:3], hashes[:3])
    kv.free(pages)
    held = kv.share_prefix(hashes)
    assert held == pages[:3] and kv.num_used == 3
    assert kv.num_free == 5  # held pages are not evictable
    kv.free(held)
    assert kv.num_used == 0


def test_drop_cached_frees_every_unheld_cached_page_and_keeps_held_ones():
    kv = KVManager(8, PAGE, prefix_cache=True)
    hashes = hash_pages(list(range(16)), PAGE)
    pages, _ = kv.allocate_prompt(hashes, 17, 4)
    kv.publish(pages, hashes)
    kv.free(pages[2:])                       # two cached and unheld, two still held
    assert kv.drop_cached() == 2 and kv.num_cached == 2
    assert kv.lookup(hashes) == pages[:2]    # the held prefix is still found
    kv.free(pages[:2])
    assert kv.num_used == 0 and kv.num_free == 8


def test_store_ahead_copies_the_next_pages_to_evict_so_their_eviction_copies_nothing():
    pool = _pool(8)
    host = HostTier.like(32, pool)
    pool.manager.on_evict = lambda evicted: host.store_evicted(pool, evicted)
    old_pages, old_hashes = _publish(pool, list(range(16)))         # 4 pages, least recently used
    new_pages, new_hashes = _publish(pool, list(range(100, 116)))   # 4 more, cached after them
    before = pool.data[:, old_pages].clone()
    assert host.store_ahead(pool, window=4, max_pages=3) == 3       # the three oldest, only
    assert host.store_ahead(pool, window=4, max_pages=3) == 1       # then the fourth
    assert host.store_ahead(pool, window=4, max_pages=3) == 0       # the window holds nothing new
    assert host.num_stored_pages == 4 and not host.index.lookup(new_hashes[:1])
    taken = pool.manager.allocate(4)                                # evicts the old four: nothing left to copy
    pool.data[:, taken] = 0.0
    assert sorted(taken) == sorted(old_pages) and host.num_stored_pages == 4
    _release_all(host, pool, _held_with(host, old_hashes, before), taken)


def test_store_ahead_leaves_pages_someone_holds():
    pool = _pool(8)
    host = HostTier.like(32, pool)
    pages, hashes = _publish(pool, list(range(16)))
    held = pool.manager.share_prefix(hashes)                         # a request shares the prefix again
    assert host.store_ahead(pool) == 0
    pool.manager.free(held)
    assert host.store_ahead(pool) == 4


def test_pages_carry_their_tokens_into_the_host_tier_so_a_colliding_prompt_cannot_take_them():
    pool = _pool(8)
    host = HostTier.like(32, pool)
    pool.manager.on_evict = lambda evicted: host.store_evicted(pool, evicted)
    tokens = list(range(16))
    hashes = hash_pages(tokens, PAGE)
    pages, _ = pool.manager.allocate_prompt(hashes, len(tokens) + 1, len(hashes))
    pool.manager.publish(pages, hashes, token_ids=tokens)
    pool.manager.free(pages)
    host.store_ahead(pool, max_pages=2)                   # two pages copied ahead ...
    pool.manager.free(pool.manager.allocate(8))           # ... two by their eviction
    assert len(host.index.lookup(hashes)) == 4
    assert host.index.scrub(hashes, tokens, stop_at_miss=False) == 0   # its own tokens: kept
    other = tokens[:8] + [99] * 8                         # the same hashes (forced), other tokens from page 2 on
    assert host.index.scrub(hashes, other, stop_at_miss=False) == 1
    assert len(host.index.lookup(hashes)) == 2 and host.index.num_collisions == 1


def test_the_stop_flush_is_bounded_and_writes_the_most_hit_pages_first(tmp_path, monkeypatch):
    pool = _pool(16)
    host = HostTier.like(16, pool)
    disk = DiskTier(str(tmp_path), 1 << 20, "ab" * 16, host.page_nbytes, page_size=PAGE,
                    max_queued_bytes=2 * host.page_nbytes)
    written: list[bytes] = []
    real = disk._write

    def slow(h, page, tokens):
        time.sleep(0.2)  # a slow disk: 0.2 s a page
        written.append(h)
        return real(h, page, tokens)
    monkeypatch.setattr(disk, "_write", slow)
    disk.start()
    host.disk = disk
    _, old = _publish(pool, list(range(16)))         # 4 pages
    _, new = _publish(pool, list(range(100, 116)))   # 4 more
    for hashes in (old[:2], old[:2], new[:2]):       # prefix hits: old's first two twice, then new's once (last)
        pool.manager.free(pool.manager.share_prefix(hashes))
    t0 = time.monotonic()
    host.flush([pool], timeout=0.7)
    assert time.monotonic() - t0 < 0.7 + 0.3  # the timeout, and at most the page being written
    disk.stop(timeout=0)
    # most hit first (not most recent: new's were hit last), then most recently used, each request prefix first
    assert 2 <= len(written) <= 5 and written == (old[:2] + new + old[2:])[:len(written)], len(written)
    assert host.index.num_used == 0  # every slot the writer held is let go, written or not
