"""CUDA graph buckets on CPU: which graph a batch replays, and how a batch is padded up to it."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.flashinfer_backend import split_indices
from nodeserve.runtime.cuda_graphs import bucket_for, graph_buckets, pad_decode_batch

PAGE_SIZE = 4


@pytest.mark.parametrize("max_batch, buckets", [
    (1, [1]),
    (2, [1, 2]),
    (8, [1, 2, 4, 8]),
    (64, [1, 2, 4, 8, 16, 32, 64]),
    (48, [1, 2, 4, 8, 16, 32, 48]),
    (5, [1, 2, 4, 5]),
])
def test_graph_buckets(max_batch, buckets):
    assert graph_buckets(max_batch) == buckets


def test_bucket_for():
    buckets = graph_buckets(48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 4, 5, 9, 16, 17, 33, 48)] == [1, 2, 4, 4, 8, 16, 16, 32, 48, 48]
    assert bucket_for(49, buckets) is None  # above the largest: eager


def _decode_meta(tables: list[list[int]], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    slots = [t[(n - 1) // PAGE_SIZE] * PAGE_SIZE + (n - 1) % PAGE_SIZE for t, n in zip(tables, seq_lens)]
    max_pages = max(len(t) for t in tables)
    page_tables = torch.zeros(len(tables), max_pages, dtype=torch.int64)
    for b, t in enumerate(tables):
        page_tables[b, :len(t)] = torch.tensor(t)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), page_tables=page_tables,
                             seq_lens=torch.tensor(seq_lens), query_lens=[1] * len(tables), seq_lens_host=seq_lens,
                             num_decodes=len(tables), page_size=PAGE_SIZE, page_tables_host=tables)
    ids = torch.tensor([11, 12, 13][:len(tables)])
    return ids, torch.tensor([n - 1 for n in seq_lens]), meta


def test_pad_decode_batch_to_bucket():
    scratch = 9
    ids, pos, meta = _decode_meta([[3, 5], [7], [1]], [6, 2, 4])
    bucket = bucket_for(meta.num_seqs, graph_buckets(8))  # 3 rows replay the graph of 4
    assert bucket == 4
    p_ids, p_pos, p_meta = pad_decode_batch(ids, pos, meta, bucket, scratch)
    # The real rows are untouched, in order; the padding row feeds token 0 at position 0 into the scratch page.
    assert p_ids.tolist() == [11, 12, 13, 0] and p_pos.tolist() == [5, 1, 3, 0]
    assert p_meta.slot_mapping.tolist() == meta.slot_mapping.tolist() + [scratch * PAGE_SIZE]
    assert p_meta.num_seqs == p_meta.num_decodes == 4 and p_meta.query_lens == [1, 1, 1, 1]
    assert p_meta.seq_lens_host == [6, 2, 4, 1] and p_meta.seq_lens.tolist() == [6, 2, 4, 1]
    assert p_meta.page_tables.tolist() == [[3, 5], [7, 0], [1, 0], [scratch, 0]]
    # What FlashInfer is planned with: the padding row attends over its one slot of the scratch page.
    decode, prefill = split_indices(p_meta)
    assert prefill is None
    assert decode.kv_indptr.tolist() == [0, 2, 3, 4, 5] and decode.kv_indices.tolist() == [3, 5, 7, 1, scratch]
    assert decode.kv_last_page_len.tolist() == [2, 2, 4, 1]
    # The input metadata is not modified.
    assert meta.num_seqs == 3 and meta.page_tables_host == [[3, 5], [7], [1]]


def test_pad_decode_batch_exact_bucket_and_errors():
    ids, pos, meta = _decode_meta([[3, 5], [7]], [6, 2])
    assert pad_decode_batch(ids, pos, meta, 2, 9)[2] is meta
    with pytest.raises(ValueError):
        pad_decode_batch(ids, pos, meta, 1, 9)  # bucket smaller than the batch
    meta.num_decodes = 1  # a prefill chunk in the step: graphs are decode-only
    with pytest.raises(ValueError):
        pad_decode_batch(ids, pos, meta, 4, 9)


# ---- capture streams, with torch.cuda stood in for: which stream each capture and warm-up pass ran on ---------

class _Stream:
    def __init__(self, device=None):
        self.device = torch.device(device)

    def wait_stream(self, other) -> None:
        pass


def _graphs(device: torch.device, log: list, current: list):
    """A DecodeGraphs without FlashInfer: its model logs the stream each forward ran on, its backends each prepare
    (with the stream current then: None outside any capture or stream context)."""
    from nodeserve.runtime.cuda_graphs import DecodeGraphs

    g = DecodeGraphs.__new__(DecodeGraphs)

    class Model:
        dtype = torch.bfloat16  # the activations' (LlamaModel.dtype)

        def __call__(self, input_ids, positions, backend):
            log.append((g, "forward", backend, current[-1] if current else None))
            return torch.zeros(len(input_ids), 4)
    g.model, g.device = Model(), device
    g.pool = SimpleNamespace(k_scales=[], v_scales=[], page_size=PAGE_SIZE, layers=[], dtype=torch.bfloat16)
    g.buckets, g.scratch_page = [1, 2, 4], 7
    g.input_ids, g.positions, g.slot_mapping = (torch.zeros(4, dtype=torch.int64) for _ in range(3))
    g.backends = {}
    for b in g.buckets:
        backend = g.backends[b] = SimpleNamespace()
        backend.prepare = lambda meta, backend=backend: log.append(
            (g, "prepare", backend, current[-1] if current else None, meta.num_seqs))
    g.graphs, g.outputs, g.capture_stream = {}, {}, None
    return g


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda stood in for: (the stack of current streams, the stream each capture ran on)."""
    current, captures = [], []

    @contextlib.contextmanager
    def use(stream):
        current.append(stream)
        yield
        current.pop()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        captures.append(stream)
        with use(stream):
            yield
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return current, captures


def test_each_device_captures_on_a_stream_of_its_own(fake_cuda):
    """torch.cuda.graph's default capture stream is made once, on the device current at the first capture: a second
    GPU must pass its own stream, and run its warm-up pass on it too."""
    current, captures = fake_cuda
    log = []
    first, second = _graphs(torch.device("cpu"), log, current), _graphs(torch.device("meta"), log, current)
    for g in (first, second):
        g.capture()
    assert len(captures) == 6 and sorted(first.graphs) == sorted(second.graphs) == [1, 2, 4]
    for g in (first, second):
        assert isinstance(g.capture_stream, _Stream) and g.capture_stream.device == g.device
        # Every forward of this object's capture (3 warm-up passes, 3 captures) ran on its own capture stream.
        assert [e[3] for e in log if e[0] is g and e[1] == "forward"] == [g.capture_stream] * 6
    assert captures == [first.capture_stream] * 3 + [second.capture_stream] * 3
    assert first.capture_stream is not second.capture_stream


def test_every_pass_is_prepared_outside_the_capture(fake_cuda):
    """FlashInfer's plan() cannot be captured: each bucket's backend is prepared, outside any capture or stream
    context, before its warm-up pass and again before its captured pass; a replay is prepared with the padded step
    first, and replays a graph that the Python forward does not run again."""
    current, _ = fake_cuda
    log = []
    g = _graphs(torch.device("cpu"), log, current)
    g.capture()
    for bucket in (4, 2, 1):  # largest first
        backend = g.backends[bucket]
        assert [e[1:] for e in log[:4]] == [("prepare", backend, None, bucket), ("forward", backend, g.capture_stream),
                                           ("prepare", backend, None, bucket), ("forward", backend, g.capture_stream)]
        del log[:4]
    assert not log
    g.graphs = {b: SimpleNamespace(replay=lambda b=b: log.append((g, "replay", b))) for b in g.graphs}
    ids, pos, meta = _decode_meta([[3, 5], [7], [1]], [6, 2, 4])
    assert g.run(ids, pos, meta).shape == (3, 4)  # 3 rows replay the graph of 4
    assert [e[1:] for e in log] == [("prepare", g.backends[4], None, 4), ("replay", 4)]
