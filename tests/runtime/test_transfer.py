"""KVTransfer ordering on CPU, with a device that records its event calls and random delays injected on both
sides: each layer's copy waits on that layer's event, copies run in layer order, the handoff comes after the
last copy with the destination's event and no host sync, prefill pages go back with the source's event, and
a copy or handoff that raises fails its request alone. (What the decode side does with a request that ended
meanwhile is the decode worker's part: tests/runtime/test_worker.py.)"""

from __future__ import annotations

import itertools
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from nodeserve.device.cpu import CPUDevice
from nodeserve.runtime.transfer import KVTransfer, PageMap, contiguous_runs
from nodeserve.kv.pool import KVPool
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams

NUM_LAYERS, PAGE_SIZE, NUM_PAGES = 4, 4, 32
CFG = SimpleNamespace(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=8)


class RecordingDevice(CPUDevice):
    """A CPU device whose events are ids, and whose event calls go into a shared log as (thread, call, event)."""

    def __init__(self, core: int, log: list):
        super().__init__(core)
        self.log, self._ids = log, itertools.count()
        self.last_event = None

    def record_event(self):
        self.last_event = (self.name, next(self._ids))
        self.log.append((threading.current_thread().name, "record", self.last_event))
        return self.last_event

    def wait_event(self, event) -> None:
        self.log.append((threading.current_thread().name, "wait", event))

    def synchronize_event(self, event) -> None:
        self.log.append((threading.current_thread().name, "sync", event))

    def record_stream(self, tensor) -> None:
        self.log.append((threading.current_thread().name, "record_stream", (self.name, tensor)))


class Harness:
    """A transfer between two recording devices; copies sleep a random time first (seeded)."""

    def __init__(self, seed: int, max_delay: float, max_direct_runs: int = 8):
        self.log: list = []
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.src = RecordingDevice(0, self.log)
        self.dst = RecordingDevice(1, self.log)
        self.src_pool = KVPool(CFG, NUM_PAGES, PAGE_SIZE, torch.float32, torch.device("cpu"))
        self.dst_pool = KVPool(CFG, NUM_PAGES, PAGE_SIZE, torch.float32, torch.device("cpu"))
        self.transfer = KVTransfer(self.src, self.src_pool, self.dst, self.dst_pool, self._free_src)
        self.transfer.max_direct_runs = max_direct_runs  # 0: always through a staging tensor
        copy_pages = self.transfer._copy_pages
        delays = random.Random(seed + 1)

        def slow_copy(layer, pages):
            time.sleep(delays.uniform(0, max_delay))
            self.log.append((threading.current_thread().name, "copy", layer))
            return copy_pages(layer, pages)

        self.transfer._copy_pages = slow_copy
        self.events: dict[tuple[str, int], tuple] = {}  # (request id, layer) -> the event its copy must wait on
        self.expected: dict[str, torch.Tensor] = {}     # request id -> [layers, pages, ...] of what was written
        self.src_pages: dict[str, list[int]] = {}
        self.dst_pages: dict[str, list[int]] = {}
        # (request id, event, src pages free at handoff, error) per on_done call
        self.delivered: list[tuple[str, object, int, str | None]] = []

    def request(self, rid: str, num_tokens: int) -> Request:
        req = Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=4))
        n = -(-num_tokens // PAGE_SIZE)
        self.src_pages[rid] = self.src_pool.manager.allocate(n)
        self.dst_pages[rid] = self.dst_pool.manager.allocate(n + 1)  # prompt + room for the outputs
        return req

    def prefill(self, req: Request) -> None:
        """What a prefill worker does: write layer i's K/V, then enqueue its copy; sleeps stand in for compute."""
        src = self.src_pages[req.request_id]
        pages = self.transfer.page_indices(src, self.dst_pages[req.request_id][:len(src)], (req.request_id,))
        written = []
        for layer in range(NUM_LAYERS):
            time.sleep(self.rng.uniform(0, self.max_delay))
            values = torch.randn(len(src), *self.src_pool.layers[layer].shape[1:])
            self.src_pool.layers[layer][src] = values
            written.append(values)
            self.transfer.copy_layer(layer, pages)
            self.events[(req.request_id, layer)] = self.src.last_event
        self.expected[req.request_id] = torch.stack(written)

    def finish(self, req: Request) -> None:
        rid = req.request_id
        self.transfer.finish(rid, self.src_pages[rid], lambda landed, error: self.on_done(rid, landed, error))

    def _free_src(self, pages: list[int], event) -> None:
        """What the prefill worker does with a FreePages message, minus the hop through its inbox."""
        self.log.append((threading.current_thread().name, "free", event))
        self.src_pool.manager.free(pages)

    def on_done(self, rid: str, landed, error: str | None) -> None:
        """What the decode worker's arrive() gets."""
        self.log.append((threading.current_thread().name, "done", rid))
        self.delivered.append((rid, landed, self.src_pool.manager.num_free, error))

    def run(self, body) -> list:
        """Starts the transfer, runs body(), waits for the queue to drain, stops; returns the copy thread's log."""
        self.transfer.start()
        try:
            body()
        finally:
            self.transfer.stop()
        assert not self.transfer._thread.is_alive()
        return [entry[1:] for entry in self.log if entry[0] == self.transfer.name]


@pytest.mark.parametrize("seed", range(4))
def test_copies_wait_on_their_layer_and_run_in_order(seed):
    h = Harness(seed, max_delay=0.003)
    req = h.request("a", 13)  # 4 pages
    copy_log = h.run(lambda: (h.prefill(req), h.finish(req)))

    copies = [(i, e[1]) for i, e in enumerate(copy_log) if e[0] == "copy"]
    assert [layer for _, layer in copies] == list(range(NUM_LAYERS))
    for i, layer in copies:
        # Just before each copy, on the copy thread: the wait on the event recorded for that layer, then on the
        # destination pool's last free (pages handed over must be quiet there first).
        assert copy_log[i - 2:i] == [("wait", h.events[("a", layer)]), ("wait", h.dst_pool.freed_event)]
    # The handoff: after the last copy, one event on each device's copy stream; the source's goes back with the
    # prefill pages, the destination's goes with the request. No host sync on this path.
    last_copy = copies[-1][0]
    assert [e[0] for e in copy_log[last_copy + 1:]] == ["record", "record", "free", "done"]
    read, landed = copy_log[last_copy + 1][1], copy_log[last_copy + 2][1]
    assert read[0] == "cpu:0" and landed[0] == "cpu:1"
    assert copy_log[last_copy + 3] == ("free", read)
    assert h.delivered == [("a", landed, NUM_PAGES, None)]  # with that event, prefill pages already free
    assert not any(e[0] == "sync" for e in copy_log)
    # The bytes arrived: every layer of the decode pages equals what prefill wrote.
    for layer in range(NUM_LAYERS):
        assert torch.equal(h.dst_pool.layers[layer][h.dst_pages["a"][:4]], h.expected["a"][layer])


@pytest.mark.parametrize("max_direct_runs", [0, 8])
def test_fifo_across_requests_with_delays(max_direct_runs):
    h = Harness(seed=7, max_delay=0.002, max_direct_runs=max_direct_runs)
    reqs = [h.request(f"r{i}", n) for i, n in enumerate([5, 16, 1, 30])]

    def body():
        for r in reqs:
            h.prefill(r)
            h.finish(r)

    copy_log = h.run(body)
    order = [(e[0], e[1]) for e in copy_log if e[0] in ("copy", "done")]
    expected = []
    for r in reqs:
        expected += [("copy", layer) for layer in range(NUM_LAYERS)] + [("done", r.request_id)]
    assert order == expected
    waits = [e[1] for e in copy_log if e[0] == "wait"]
    assert waits == [w for r in reqs for layer in range(NUM_LAYERS)
                     for w in (h.events[(r.request_id, layer)], h.dst_pool.freed_event)]
    assert h.src_pool.manager.num_free == NUM_PAGES
    for r in reqs:
        n = -(-r.num_prompt_tokens // PAGE_SIZE)
        for layer in range(NUM_LAYERS):
            assert torch.equal(h.dst_pool.layers[layer][h.dst_pages[r.request_id][:n]], h.expected[r.request_id][layer])


def test_a_failed_copy_fails_its_request_and_the_pair_keeps_serving():
    h = Harness(seed=5, max_delay=0.001)
    bad, good = h.request("bad", 9), h.request("good", 9)
    copy_pages = h.transfer._copy_pages

    def faulty(layer, pages):
        if "bad" in pages.request_ids and layer == 2:
            raise RuntimeError("injected copy fault")
        return copy_pages(layer, pages)
    h.transfer._copy_pages = faulty

    h.run(lambda: (h.prefill(bad), h.finish(bad), h.prefill(good), h.finish(good)))
    assert [(d[0], d[3]) for d in h.delivered] == [
        ("bad", "KV transfer kv cpu:0->cpu:1 failed (the error is in the server log)"), ("good", None)]
    assert h.src_pool.manager.num_free == NUM_PAGES
    for layer in range(NUM_LAYERS):
        assert torch.equal(h.dst_pool.layers[layer][h.dst_pages["good"][:3]], h.expected["good"][layer])


def test_a_failed_handoff_frees_the_source_once_and_reports_the_error():
    h = Harness(seed=6, max_delay=0.001)
    bad, good = h.request("bad", 9), h.request("good", 9)
    on_done = h.on_done

    def faulty_on_done(rid, landed, error):
        if rid == "bad" and error is None:
            raise RuntimeError("injected handoff fault")
        on_done(rid, landed, error)
    h.on_done = faulty_on_done

    copy_log = h.run(lambda: (h.prefill(bad), h.finish(bad), h.prefill(good), h.finish(good)))
    assert [d[0] for d in h.delivered] == ["bad", "good"]
    assert [e[0] for e in copy_log].count("free") == 2
    assert h.delivered[0][3] is not None and "injected" not in h.delivered[0][3] and h.delivered[1][3] is None
    assert h.src_pool.manager.num_free == NUM_PAGES


@pytest.mark.parametrize("src, dst, runs", [
    ([], [], []),
    ([4], [9], [(4, 9, 1)]),
    ([0, 1, 2], [5, 6, 7], [(0, 5, 3)]),
    ([0, 1, 2], [5, 6, 8], [(0, 5, 2), (2, 8, 1)]),
    ([3, 4, 9, 10, 11], [0, 1, 2, 3, 4], [(3, 0, 2), (9, 2, 3)]),
    ([2, 1, 0], [0, 1, 2], [(2, 0, 1), (1, 1, 1), (0, 2, 1)]),
])
def test_contiguous_runs(src, dst, runs):
    assert contiguous_runs(src, dst) == runs
    assert sum(n for _, _, n in runs) == len(src)


def test_scattered_pages_go_through_a_staging_tensor():
    pool = KVPool(CFG, NUM_PAGES, PAGE_SIZE, torch.float32, torch.device("cpu"))
    transfer = KVTransfer(CPUDevice(0), pool, CPUDevice(1), pool, lambda pages, event: None)
    assert transfer.page_indices([0, 1, 2], [5, 6, 7]) == PageMap([(0, 5, 3)])
    src, dst = list(range(0, 20, 2)), list(range(10))  # ten runs of one page
    staged = transfer.page_indices(src, dst)
    assert staged.runs is None and staged.src.tolist() == src and staged.dst.tolist() == dst


def test_staged_index_tensors_are_recorded_on_the_copy_streams():
    """The page index tensors of a staged copy are made on the prefill worker's thread (its streams); the copy thread
    records them on its own streams before using them, so the caching allocator cannot hand their memory to another
    tensor while the copy still reads it (which would scatter one request's KV into another's pages)."""
    h = Harness(seed=7, max_delay=0.001, max_direct_runs=0)  # every copy through a staging tensor
    reqs = [h.request("a", 9), h.request("b", 13)]
    maps = []
    page_indices = h.transfer.page_indices

    def keep(*args, **kwargs):
        maps.append(page_indices(*args, **kwargs))
        return maps[-1]
    h.transfer.page_indices = keep
    copy_log = h.run(lambda: [(h.prefill(r), h.finish(r)) for r in reqs])
    recorded = [e[1] for e in copy_log if e[0] == "record_stream"]
    assert len(maps) == 2 and all(m.runs is None for m in maps)
    for m in maps:
        assert sum(1 for name, t in recorded if name == "cpu:0" and t is m.src) == NUM_LAYERS, recorded
        assert sum(1 for name, t in recorded if name == "cpu:1" and t is m.dst) == NUM_LAYERS
    # Each layer's copy ("copy" is logged as it starts) records both tensors before it issues anything.
    for i, e in enumerate(copy_log):
        if e[0] == "copy":
            assert [(x[0], x[1][0]) for x in copy_log[i + 1:i + 3]] == [("record_stream", "cpu:0"),
                                                                       ("record_stream", "cpu:1")]


def test_a_copy_into_pages_waits_on_the_destination_pools_last_free():
    """Race: pages freed on the destination device (after its compute wrote them, or after another pair's copy
    read them) can be handed out at once as this pair's destination; the copy must wait on the event its owner
    recorded just before freeing them, or it races what the device still had queued on them."""
    h = Harness(seed=3, max_delay=0.0)
    req = h.request("a", 8)
    freed = h.dst.record_event()
    h.dst_pool.freed_event = freed  # what Worker._free records before kv.free
    copy_log = h.run(lambda: (h.prefill(req), h.finish(req)))
    copies = [i for i, e in enumerate(copy_log) if e[0] == "copy"]
    assert copies and all(("wait", freed) in copy_log[:i] for i in copies)
    assert all(copy_log[i - 1] == ("wait", freed) for i in copies)


def test_a_handoff_that_raises_frees_the_source_pages_after_an_event_not_at_once():
    """Race: _give_up passed None as the `read` event, so the source freed (and could reuse) pages its copies
    were still reading."""
    h = Harness(seed=4, max_delay=0.0)
    req = h.request("a", 8)

    def broken(job):
        raise RuntimeError("injected handoff fault")

    h.transfer._finish = broken
    h.run(lambda: (h.prefill(req), h.finish(req)))
    frees = [e for e in h.log if e[1] == "free"]
    assert len(frees) == 1 and frees[0][2] is not None and frees[0][2][0] == h.src.name
    assert [(rid, error is not None) for rid, _, _, error in h.delivered] == [("a", True)]
    assert h.delivered[0][1] is not None  # the destination's event goes with the failure too


def _group_pool(num_kv_heads: int, num_ranks: int, seed: int | None = None) -> KVPool:
    """A pool split over num_ranks the way a TP group's is (model/tp_layout.py), random K/V if seeded."""
    from nodeserve.model.tp_layout import tp_layout

    cfg = SimpleNamespace(num_layers=NUM_LAYERS, num_kv_heads=num_kv_heads, head_dim=8)
    layout = tp_layout(num_kv_heads * 4, num_kv_heads, 32 * 8, num_ranks, 32)
    pool = KVPool(cfg, NUM_PAGES, PAGE_SIZE, torch.float32, torch.device("cpu"),
                  shards=[(torch.device("cpu"), heads) for heads in layout.kv_heads])
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        whole = torch.randn(NUM_LAYERS, NUM_PAGES, 2, PAGE_SIZE, num_kv_heads, 8, generator=gen)
        every = torch.arange(NUM_PAGES)
        for layer in range(NUM_LAYERS):
            pool.write_layer(layer, every, whole[layer])
    return pool


@pytest.mark.parametrize("num_kv_heads, src_ranks, dst_ranks",
                         [(3, 1, 2), (3, 2, 1), (3, 2, 3), (2, 4, 1), (2, 1, 4), (3, 4, 2), (1, 2, 3)])
@pytest.mark.parametrize("max_direct_runs", [8, 0])
def test_a_handoff_between_groups_of_different_degree_lands_every_head(num_kv_heads, src_ranks, dst_ranks,
                                                                       max_direct_runs):
    """Real tensors through KVTransfer's copy thread: whatever the two layouts (uneven, replicated heads), each page
    arrives whole, every head from where it was, and replicas on the destination all hold their head."""
    src, dst = _group_pool(num_kv_heads, src_ranks, seed=1), _group_pool(num_kv_heads, dst_ranks)
    transfer = KVTransfer(CPUDevice(0), src, CPUDevice(1), dst, lambda pages, event: None)
    transfer.max_direct_runs = max_direct_runs
    transfer.start()
    src_pages, dst_pages = [1, 2, 3, 7], [4, 5, 6, 0]
    pages = transfer.page_indices(src_pages, dst_pages, ("r",))
    for layer in range(NUM_LAYERS):
        transfer.copy_layer(layer, pages)
    done = threading.Event()
    transfer.after_copies(lambda landed: done.set())
    assert done.wait(5)
    transfer.stop()
    s, d = torch.tensor(src_pages), torch.tensor(dst_pages)
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst.read_layer(layer, d), src.read_layer(layer, s))
        for shard in dst.shards:  # replicated heads: every holder was written, not only the first
            want = src.read_layer(layer, s)[:, :, :, shard.heads.start:shard.heads.stop]
            assert torch.equal(shard.layers[layer].index_select(0, d), want)


def test_a_group_pool_reads_and_writes_whole_pages():
    pool = _group_pool(3, 4, seed=2)  # heads [0], [0], [1], [2]: head 0 on two ranks
    assert pool.heads == (range(0, 1), range(0, 1), range(1, 2), range(2, 3))
    pages = torch.tensor([5, 0])
    whole = pool.read_layer(1, pages)
    assert whole.shape == (2, 2, PAGE_SIZE, 3, 8)
    assert torch.equal(pool.shards[0].layers[1][5], pool.shards[1].layers[1][5])  # the replicas agree
    with pytest.raises(TypeError, match="one shard per rank"):
        pool.layers
