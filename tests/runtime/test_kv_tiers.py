"""The KV tiers end to end on the real model: pages evicted from a small device pool come back from the host tier,
a prefix cached on one device is fetched by another, requests arriving together with one prompt compute it once,
a restart finds the disk tier's pages, and bad files are skipped. Greedy tokens never change, and every pool and
the host tier are whole again after finished, aborted and failed requests."""

from __future__ import annotations

import asyncio
import os
import random
import stat

import pytest

from nodeserve.config import config_from_dict
from nodeserve.kv.manager import hash_pages
from nodeserve.runtime.engine import Engine
from nodeserve.server.systemd import workers_healthy
from tests.runtime.test_engine import MODES, _greedy, _tokens, _wait_pools_whole

PAGE = 16


def _config(mode: str, memory_gib: float, host_gib: float, disk_path: str = "", **kv):
    disk = {"disk_path": disk_path, "disk_gib": 1.0} if disk_path else {}
    return config_from_dict({"model": {"dtype": "float32", "quantization": "none"}, "devices": MODES[mode],
                             "kv": {"memory_gib": memory_gib, "page_size": PAGE, "host_memory_gib": host_gib,
                                    **disk, **kv},
                             "scheduler": {"max_num_batched_tokens": 64}, "profile": {"startup": False}})


def _run(config, loaded, body, warmup: bool = False):
    """Runs body(engine) on a fresh engine; checks every device pool and the host tier are whole after it."""
    async def main():
        engine = Engine(config, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            if warmup:
                engine.warmup()
            result = await body(engine)
            await _wait_pools_whole(engine)
            if engine.tiers is not None and engine.tiers.host is not None:
                # the store-ahead thread holds the slots of the chunk it is copying: whole once it is between chunks
                for _ in range(200):
                    if engine.tiers.host.index.num_used == 0:
                        break
                    await asyncio.sleep(0.05)
                assert engine.tiers.host.index.num_used == 0, "a host-tier slot is still held"
            return result
        finally:
            engine.stop()
    return asyncio.run(main())


def _long_prompt(tok, seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    words = ["river", "stone", "market", "engine", "violet", "harbor", "lantern", "quiet", "copper", "meadow"]
    ids = tok.encode(" ".join(rng.choice(words) for _ in range(num_tokens)))
    return ids[:num_tokens]


@pytest.fixture(scope="module")
def convo(loaded_fp32):
    """Three unrelated 200-token contexts, and a follow-up of the first."""
    tok = loaded_fp32.tokenizer
    a, b, c = (_long_prompt(tok, s, 200) for s in (1, 2, 3))
    return a, b, c, a + tok.encode(" And then what happened next?")


async def _evict_and_return(engine, convo):
    """a, then b and c (which push a's pages out of a 16-page pool), then a's follow-up."""
    a, b, c, follow = convo
    out = []
    for prompt in (a, b, c, follow):
        stream = engine.add_request(prompt, _greedy(max_tokens=6))
        out.append((await _tokens(stream))[0])
    last = stream.request
    return out, last.num_cached_tokens, dict(last.cached_from)


@pytest.mark.parametrize("mode, write", [("colocated", "back"), ("disaggregated", "back"), ("colocated", "through")])
def test_pages_evicted_from_a_device_come_back_from_the_host_tier(mode, write, loaded_fp32, convo):
    pool_gib = 16 * 737_280 / 2**30  # 16 float32 pages per device: a 200-token prompt fills most of one
    off, cached_off, _ = _run(_config(mode, pool_gib, 0), loaded_fp32, lambda e: _evict_and_return(e, convo))
    on, cached_on, sources = _run(_config(mode, pool_gib, 0.05, host_write=write), loaded_fp32,
                                  lambda e: _evict_and_return(e, convo))
    assert on == off  # exact greedy parity with the tier on
    assert cached_off < PAGE * 4  # without the tier a's pages were gone
    assert cached_on >= (200 // PAGE) * PAGE - PAGE and sources.get("host", 0) > 0, sources


def test_write_back_copies_cached_pages_ahead_of_their_eviction(loaded_fp32, convo):
    """The store-ahead thread (CPU pools, write-back) copies a finished prompt's cached pages into the host tier
    before anything evicts them, so the eviction that comes later has nothing left to copy on the event loop."""
    pool_gib = 16 * 737_280 / 2**30

    async def body(engine):
        await _tokens(engine.add_request(convo[0], _greedy(max_tokens=2)))
        host, ahead = engine.tiers.host, engine.tiers.store_ahead
        for _ in range(200):  # the thread looks every 20 ms
            if host.num_stored_pages > 0:
                break
            await asyncio.sleep(0.01)
        return host.num_stored_pages, ahead.num_pages, engine.workers[0].kv.num_evictions

    stored, ahead, evictions = _run(_config("colocated", pool_gib, 0.05), loaded_fp32, body)
    assert evictions == 0 and stored > 0 and ahead == stored


def test_requests_with_one_prompt_arriving_together_compute_it_once(loaded_fp32, convo):
    prompt = convo[0] * 3  # 600 tokens

    async def body(engine):
        streams = [engine.add_request(prompt, _greedy(max_tokens=4)) for _ in range(8)]
        outs = await asyncio.gather(*(_tokens(s) for s in streams))
        computed = sum(r.num_prefill_tokens for w in engine.workers for r in w.records)
        return [o[0] for o in outs], computed, engine.router.num_prefix_waits

    outs, computed, waits = _run(_config("colocated", 0.25, 0.05), loaded_fp32, body)
    assert all(o == outs[0] for o in outs)
    assert computed <= 1.5 * len(prompt), computed  # 8 x 600 without the wait
    assert waits > 0


def test_a_restart_finds_the_disk_tier_and_bad_files_are_skipped(loaded_fp32, convo, tmp_path):
    a, _, _, follow = convo
    disk = str(tmp_path / "kv")

    async def first(engine):
        return (await _tokens(engine.add_request(a, _greedy(max_tokens=4))))[0]

    async def again(engine):
        stream = engine.add_request(follow, _greedy(max_tokens=8))
        tokens = (await _tokens(stream))[0]
        return tokens, stream.request.num_cached_tokens, dict(stream.request.cached_from), engine.tiers.disk

    cold, cached_cold, _, _ = _run(_config("colocated", 0.25, 0.05), loaded_fp32, again)
    _run(_config("colocated", 0.25, 0.05, disk), loaded_fp32, first, warmup=True)
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(disk) for f in fs if f.endswith(".kvp")]
    assert len(files) >= 200 // PAGE - 1
    warm, cached_warm, sources, _ = _run(_config("colocated", 0.25, 0.05, disk), loaded_fp32, again, warmup=True)
    assert cached_cold == 0 and warm == cold
    assert cached_warm >= (200 // PAGE - 1) * PAGE and sources.get("disk", 0) > 0, sources

    # A corrupt 6th page and a truncated 7th: the 5 before load, the rest are computed, the tokens do not change.
    by_name = {os.path.basename(p): p for p in files}
    corrupt, truncated = (by_name[h.hex() + ".kvp"] for h in hash_pages(a, PAGE)[5:7])
    with open(corrupt, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(truncated, "r+b") as f:
        f.truncate(100)
    repaired, cached, sources, disk_tier = _run(_config("colocated", 0.25, 0.05, disk), loaded_fp32, again,
                                                warmup=True)
    assert repaired == cold
    assert disk_tier.num_bad_files == 2 and cached == 5 * PAGE and sources == {"disk": 5 * PAGE}


def test_random_aborts_with_evictions_and_loads_leak_no_page(loaded_fp32, convo):
    a, b, c, follow = convo
    rng = random.Random(7)

    async def body(engine):
        streams = []
        for i in range(24):
            base = rng.choice([a, b, c, follow])
            streams.append(engine.add_request(base[:rng.randrange(40, len(base))], _greedy(max_tokens=rng.randrange(1, 8))))
            await asyncio.sleep(rng.random() * 0.05)
            if rng.random() < 0.4:
                engine.abort(rng.choice(streams))
        for s in streams:
            await _tokens(s)
        return engine.tiers.host.num_stored_pages

    stored = _run(_config("disaggregated", 16 * 737_280 / 2**30, 0.05), loaded_fp32, body)
    assert stored > 0  # evictions happened throughout


def test_the_auto_host_tier_is_twice_the_pools_at_most_a_quarter_of_ram():
    from nodeserve.runtime.kv_tiers import host_tier_bytes

    gib = 2**30
    assert host_tier_bytes(-1, 4 * gib, 24 * gib) == 6 * gib        # this repo's box: two 2 GiB pools, 24 GiB
    assert host_tier_bytes(-1, 2 * gib, 100 * gib) == 4 * gib
    assert host_tier_bytes(-1, 640 * gib, 2048 * gib) == 512 * gib  # a DGX: the RAM cap
    assert host_tier_bytes(0, 4 * gib, 24 * gib) == 0 and host_tier_bytes(1.5, 4 * gib, 24 * gib) == 1.5 * gib


def test_a_request_waiting_for_a_prefix_goes_when_those_pages_are_freed_unpublished(loaded_fp32, convo):
    """Race (found by a soak): the request computing a prefix was aborted and its pages freed by a worker after the
    last event the router saw, so the request waiting for them waited for ever. The engine retries on a timer."""
    prompt = convo[0] + convo[1]

    async def body(engine):
        kv = engine.workers[0].kv
        hashes = hash_pages(prompt, PAGE)
        pages, _ = kv.allocate_prompt(hashes, len(prompt), len(hashes))  # as if a request were computing them
        waiting = engine.add_request(prompt, _greedy(max_tokens=4))
        await asyncio.sleep(0.3)
        assert engine.router.num_pending == 1 and engine.router.num_prefix_waits >= 1
        await asyncio.get_running_loop().run_in_executor(None, kv.free, pages)  # freed unpublished, elsewhere
        return (await asyncio.wait_for(_tokens(waiting), 30))[1]

    assert _run(_config("colocated", 0.25, 0.05), loaded_fp32, body) == "length"


# ---- a disk that hangs: loads time out or are abandoned, the loader says so, nothing leaks ---------------------

def _fill_disk(loaded, convo, disk: str) -> list[int]:
    """Runs `a` once on a server with a disk tier (its pages go there at the stop); returns the cold greedy tokens
    of the follow-up, computed without any tier."""
    a, _, _, follow = convo

    async def first(engine):
        return (await _tokens(engine.add_request(a, _greedy(max_tokens=4))))[0]

    async def cold(engine):
        return (await _tokens(engine.add_request(follow, _greedy(max_tokens=8))))[0]
    _run(_config("colocated", 0.25, 0.05, disk), loaded, first, warmup=True)
    return _run(_config("colocated", 0.25, 0.05), loaded, cold)


class HungRead:
    """DiskTier.get, injected: the first `num_hung` reads block until released (a hung network mount)."""

    def __init__(self, tier, num_hung: int = 1):
        self.real, self.num_hung, self.num_calls = tier.get, num_hung, 0
        self.entered, self.release = asyncio.Event(), __import__("threading").Event()
        self.loop = asyncio.get_running_loop()

    def __call__(self, h, out, tokens):
        self.num_calls += 1
        if self.num_calls <= self.num_hung:
            self.loop.call_soon_threadsafe(self.entered.set)
            self.release.wait(60)
        return self.real(h, out, tokens)


def test_a_hung_disk_read_times_out_the_load_and_fails_the_loader_until_it_returns(loaded_fp32, convo, tmp_path):
    disk = str(tmp_path / "kv")
    cold = _fill_disk(loaded_fp32, convo, disk)
    follow = convo[3]

    async def body(engine):
        hung = HungRead(engine.tiers.disk)
        engine.tiers.disk.get = hung
        for x in engine.tiers.loaders.values():
            x.stuck_after = 1.0
        t0 = asyncio.get_running_loop().time()
        stream = engine.add_request(follow, _greedy(max_tokens=8))
        tokens = (await _tokens(stream))[0]
        waited = asyncio.get_running_loop().time() - t0
        assert tokens == cold and waited < 0.5 + 10  # the timeout, then the prompt computed
        assert stream.request.cached_from.get("disk", 0) == 0
        assert sum(x.num_disk_timeouts for x in engine.tiers.loaders.values()) == 1
        await asyncio.sleep(1.2)  # the read still hangs past stuck_after: the loader is failed
        dead = engine.dead_threads()
        assert len(dead) == 1 and "disk read has hung" in dead[0], dead
        watchdog = workers_healthy(engine.watched(), 30.0)  # the check serve.py's watchdog pings by
        assert not watchdog() and "disk read has hung" in watchdog.last_reason
        # Meanwhile another request skips the disk instead of queueing behind the hung read.
        engine.flush_cache()  # the first computed the prefix: out of the pools, it is on disk only again
        again = engine.add_request(follow, _greedy(max_tokens=8))
        assert (await _tokens(again))[0] == cold
        stats = {t.tier: t for t in engine.tier_stats()}
        assert stats["disk"].num_read_timeouts == 2
        hung.release.set()
        for _ in range(100):
            if not engine.dead_threads():
                break
            await asyncio.sleep(0.05)
        assert engine.dead_threads() == [] and watchdog(), "the loader recovers once the read returns"
    _run(_config("colocated", 0.25, 0.05, disk, disk_timeout=0.5), loaded_fp32, body, warmup=True)


def test_an_aborted_request_does_not_wait_for_its_hung_disk_load(loaded_fp32, convo, tmp_path):
    disk = str(tmp_path / "kv")
    _fill_disk(loaded_fp32, convo, disk)
    follow = convo[3]

    async def body(engine):
        hung = HungRead(engine.tiers.disk)
        engine.tiers.disk.get = hung
        stream = engine.add_request(follow, _greedy(max_tokens=8))
        await asyncio.wait_for(hung.entered.wait(), 10)
        engine.abort(stream)
        await _wait_pools_whole(engine, timeout=2.0)  # well inside disk_timeout = 30 s: the pages are freed now
        assert sum(x.num_disk_timeouts for x in engine.tiers.loaders.values()) == 0  # abandoned, not timed out
        hung.release.set()
    _run(_config("colocated", 0.25, 0.05, disk, disk_timeout=30.0), loaded_fp32, body, warmup=True)


def test_a_fifo_in_place_of_a_page_file_is_removed_and_the_prompt_computed(loaded_fp32, convo, tmp_path):
    disk = str(tmp_path / "kv")
    cold = _fill_disk(loaded_fp32, convo, disk)
    a, follow = convo[0], convo[3]
    files = {f: os.path.join(dp, f) for dp, _, fs in os.walk(disk) for f in fs if f.endswith(".kvp")}
    fifo = files[hash_pages(a, PAGE)[3].hex() + ".kvp"]

    async def body(engine):
        os.remove(fifo)  # after the start's scan (which would remove it): get() meets it
        os.mkfifo(fifo)
        stream = engine.add_request(follow, _greedy(max_tokens=8))
        tokens = (await asyncio.wait_for(_tokens(stream), 30))[0]
        return tokens, dict(stream.request.cached_from), engine.tiers.disk.num_bad_files
    tokens, sources, num_bad = _run(_config("colocated", 0.25, 0.05, disk), loaded_fp32, body, warmup=True)
    assert tokens == cold and sources == {"disk": 3 * PAGE} and num_bad == 1
    assert stat.S_ISREG(os.lstat(fifo).st_mode)  # the FIFO removed; the page computed again and written at the stop
