"""FlashInferAttention's plumbing on CPU, against a stand-in `flashinfer` module whose wrappers compute paged
attention in plain PyTorch from exactly the plan() arguments FlashInfer documents (indptr / indices /
last_page_len, causal mask aligned to the end of each sequence). It checks what the backend passes and how it
splits and reassembles a step, not FlashInfer's kernels: tests/cuda does that on a GPU."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.kv.pool import KVPool, pages_for

H, KH, D = 8, 2, 32
SCALE = D ** -0.5  # what the backends derive from head_dim
CPU = torch.device("cpu")
CFG = SimpleNamespace(num_heads=H, num_kv_heads=KH, head_dim=D, softmax_scale=D ** -0.5, window=lambda layer: 0)


def _pool(num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32) -> KVPool:
    cfg = SimpleNamespace(num_layers=num_layers, num_kv_heads=KH, head_dim=D)
    return KVPool(cfg, num_pages, page_size, dtype, CPU)


class _FakeWrapper:
    num_plans = 0

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False, use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.prefill = False

    def _plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              kw):
        for t in (qo_indptr, indptr, indices, last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu"  # built on the host, as plan() wants
        assert len(indptr) == len(last_page_len) + 1 == len(qo_indptr)
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()
        self.plan_args = (qo_indptr.tolist(), indptr.tolist(), indices.tolist(), last_page_len.tolist(), page_size)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.kw = kw
        _FakeWrapper.num_plans += 1

    def run(self, q, kv, k_scale=None, v_scale=None):
        qo, indptr, indices, last, page_size = self.plan_args
        assert kv.dtype == self.kw["kv_data_type"] and q.dtype == self.kw["q_data_type"]
        assert q.shape[0] == qo[-1] and q.shape[1:] == (self.heads[0], self.heads[2])
        out = torch.empty_like(q)
        for b in range(len(last)):
            pages = indices[indptr[b]:indptr[b + 1]]
            length = (len(pages) - 1) * page_size + last[b]
            k = kv[pages, 0].reshape(-1, *kv.shape[3:])[:length].float() * (k_scale or 1.0)  # [L, KH, D]
            v = kv[pages, 1].reshape(-1, *kv.shape[3:])[:length].float() * (v_scale or 1.0)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [L, H, D]
            qb = q[qo[b]:qo[b + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", qb, k) * self.kw["sm_scale"]
            q_pos = torch.arange(length - qb.shape[0], length)[:, None]
            if self.prefill and not self.kw["causal"]:
                raise AssertionError("prefill must be planned causal")
            k_pos = torch.arange(length)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            if self.kw.get("window_left", -1) >= 0:  # inclusive: query i sees keys i - window_left .. i
                scores = scores.masked_fill(q_pos - k_pos > self.kw["window_left"], float("-inf"))
            out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, kw)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             causal=False, **kw):
        self.prefill = True
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   dict(kw, causal=causal))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import nodeserve.attention.flashinfer_backend as fb

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    module.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fb, "WORKSPACE_BYTES", 1024)
    _FakeWrapper.num_plans = 0
    return fb.FlashInferAttention


def _ragged(page_size: int, seed: int):
    """A mixed step (decodes first) over shuffled pages with cached prefixes, like test_torch_ref's."""
    from nodeserve.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    seqs = [(0, 1), (15, 1), (16, 1), (0, 7), (20, 13), (63, 2), (100, 37)]
    need = [pages_for(c + n, page_size) for c, n in seqs]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    kv = torch.randn(num_pages, 2, page_size, KH, D, generator=gen)
    tables, slots = [], []
    for (c, n), p in zip(seqs, need):
        table, order = order[:p], order[p:]
        tables.append(table)
        slots += [table[i // page_size] * page_size + i % page_size for i in range(c, c + n)]
    total = sum(n for _, n in seqs)
    page_tables = torch.zeros(len(seqs), max(need), dtype=torch.int64)
    for b, t in enumerate(tables):
        page_tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), page_tables=page_tables,
                             seq_lens=torch.tensor(seq_lens), query_lens=[n for _, n in seqs],
                             seq_lens_host=seq_lens, num_decodes=3, page_size=page_size, page_tables_host=tables)
    q = torch.randn(total, H, D, generator=gen)
    k = torch.randn(total, KH, D, generator=gen)
    v = torch.randn(total, KH, D, generator=gen)
    return kv, q, k, v, meta


def _backends(fake_flashinfer, kv: torch.Tensor, num_layers: int = 1, dtype: torch.dtype = torch.float32,
              cfg=CFG):
    """(FlashInfer, torch reference), each over its own pool whose every layer holds `kv`."""
    pools = [_pool(num_layers, kv.shape[0], kv.shape[2], dtype) for _ in range(2)]
    for pool in pools:
        for layer in pool.layers:
            layer.copy_(kv)
    return fake_flashinfer(pools[0], cfg, torch.float32), TorchAttention(pools[1], cfg, torch.float32)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_matches_torch_reference_and_plans_once_per_step(fake_flashinfer, page_size):
    kv, q, k, v, meta = _ragged(page_size, seed=page_size)
    backend, reference = _backends(fake_flashinfer, kv, num_layers=2)
    reference.prepare(meta)
    ref = reference.forward(0, q, k, v)
    assert _FakeWrapper.num_plans == 0  # nothing before prepare()
    backend.prepare(meta)
    assert _FakeWrapper.num_plans == 2  # decode + prefill, once
    out = backend.forward(0, q, k, v)
    assert torch.equal(backend.pool.layers[0], reference.pool.layers[0])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert backend.prefill[0].kw["causal"] is True and backend.decode[0].kw["sm_scale"] == SCALE
    assert backend.decode[0].kw["window_left"] == backend.prefill[0].kw["window_left"] == -1  # no window
    backend.forward(1, q, k, v)  # the next layer of the same step: no new plan
    assert _FakeWrapper.num_plans == 2
    backend.prepare(_ragged(page_size, seed=page_size)[4])  # a new step: plans again
    assert _FakeWrapper.num_plans == 4


@pytest.mark.parametrize("kind", ["flashinfer", "torch"])
def test_forward_needs_a_prepare_per_step(fake_flashinfer, kind):
    """forward() before prepare(), or a layer run again on one prepare() (a new step that skipped it, which would
    attend with the last step's plan and slots), raises; after prepare() the step runs."""
    kv, q, k, v, meta = _ragged(16, seed=7)
    backend = _backends(fake_flashinfer, kv, num_layers=2)[kind == "torch"]
    with pytest.raises(RuntimeError, match="before prepare"):
        backend.forward(0, q, k, v)
    backend.prepare(meta)
    backend.forward(0, q, k, v)
    backend.forward(1, q, k, v)
    with pytest.raises(RuntimeError, match="already ran"):
        backend.forward(0, q, k, v)  # the next step's layer 0 on this step's prepare
    with pytest.raises(RuntimeError, match="already ran"):
        backend.forward(1, q, k, v)
    backend.prepare(meta)
    backend.forward(0, q, k, v)


def test_fp8_pool_passes_scales(fake_flashinfer):
    """The pool's scales for the layer run: they quantize the write and go to run(); the torch backend reading the
    same bytes with the same scales gets the same result."""
    kv, q, k, v, meta = _ragged(16, seed=5)
    reference = _backends(fake_flashinfer, kv)[1]
    reference.prepare(meta)
    ref = reference.forward(0, q, k, v)
    backend, torch_backend = _backends(fake_flashinfer, kv, num_layers=2, dtype=torch.float8_e4m3fn)
    pools = [backend.pool, torch_backend.pool]
    for pool in pools:
        pool.k_scales, pool.v_scales = [1.0, 2.0], [1.0, 4.0]
        pool.layers[1].view(torch.uint8).copy_(torch.stack([kv[:, 0] / 2.0, kv[:, 1] / 4.0], 1)
                                               .to(torch.float8_e4m3fn).view(torch.uint8))  # the cached prefixes
    backend.prepare(meta)
    out = backend.forward(1, q, k, v)
    assert backend.decode[0].kw["kv_data_type"] == torch.float8_e4m3fn
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.1)
    torch_backend.prepare(meta)
    torch_out = torch_backend.forward(1, q, k, v)
    assert torch.equal(pools[0].data.view(torch.uint8), pools[1].data.view(torch.uint8))  # the same writes
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


WINDOWS = (16, 0, 3, 17, 16)  # five layers, four distinct windows (0: global)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_windowed_layers_plan_a_wrapper_pair_per_distinct_window(fake_flashinfer, page_size):
    """One decode and one prefill wrapper per distinct window, planned once a step with window_left = window - 1
    and the config's scale, over each sequence's pages from its first query's window on (the pages before, NaN
    here, are never listed); each layer runs its window's plan and equals torch_ref with the same windows."""
    kv, q, k, v, meta = _ragged(page_size, seed=20 + page_size)
    cfg = SimpleNamespace(**{**vars(CFG), "softmax_scale": 0.3, "window": WINDOWS.__getitem__})
    backend, reference = _backends(fake_flashinfer, kv, num_layers=len(WINDOWS), cfg=cfg)
    for layer, window in enumerate(WINDOWS):
        for b, (table, seq_len, q_len) in enumerate(zip(meta.page_tables_host, meta.seq_lens_host, meta.query_lens)):
            first_page = max(0, seq_len - q_len - window + 1) // page_size if window else 0
            for pool in (backend.pool, reference.pool):
                pool.layers[layer][table[:first_page]] = float("nan")
    assert sorted(backend.decode) == sorted(backend.prefill) == [0, 3, 16, 17]
    backend.prepare(meta)
    reference.prepare(meta)
    assert _FakeWrapper.num_plans == 8
    for window in (0, 3, 16, 17):
        for wrapper in (backend.decode[window], backend.prefill[window]):
            assert wrapper.kw["window_left"] == (window - 1 if window else -1) and wrapper.kw["sm_scale"] == 0.3
    # window 3, the decode at position 15 (its window: 13 .. 15) and the chunk of 37 after 100 cached (100 - 3 + 1)
    first_pages = {1: 13, 3: 4, 16: 0}[page_size], {1: 98, 3: 32, 16: 6}[page_size]
    assert backend.decode[3].plan_args[2][backend.decode[3].plan_args[1][1]:backend.decode[3].plan_args[1][2]] == \
        meta.page_tables_host[1][first_pages[0]:-(-16 // page_size)]
    prefill_indptr = backend.prefill[3].plan_args[1]
    assert backend.prefill[3].plan_args[2][prefill_indptr[-2]:] == \
        meta.page_tables_host[6][first_pages[1]:-(-137 // page_size)]
    for layer in range(len(WINDOWS)):
        out = backend.forward(layer, q, k, v)
        assert out.isfinite().all()
        torch.testing.assert_close(out, reference.forward(layer, q, k, v), atol=1e-5, rtol=0)
    assert _FakeWrapper.num_plans == 8  # every layer on the step's plans


def test_a_graph_backend_has_a_decode_wrapper_and_buffers_per_window(fake_flashinfer):
    cfg = SimpleNamespace(**{**vars(CFG), "max_position_embeddings": 64, "window": WINDOWS.__getitem__})
    seen = []
    init = _FakeWrapper.__init__

    def record(self, workspace, kv_layout="NHD", **kw):
        seen.append(kw)
        init(self, workspace, kv_layout, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_FakeWrapper, "__init__", record)
        backend = fake_flashinfer(_pool(len(WINDOWS), 8, 16), cfg, torch.float32, graph_batch_size=2)
    assert backend.prefill is None and sorted(backend.decode) == [0, 3, 16, 17]
    buffers = [kw["paged_kv_indices_buffer"] for kw in seen]
    assert len(buffers) == 4 and len({b.data_ptr() for b in buffers}) == 4  # a plan never overwrites another's

def test_model_runner_greedy_tokens_equal_torch_backend(fake_flashinfer, loaded_fp32, prompt_ids, one_thread):
    """The real model through ModelRunner: the metadata hook (host page tables, one plan per step) end to end."""
    def greedy(make) -> list[list[int]]:
        pool = KVPool(loaded_fp32.config, 128, 16, torch.float32, CPU)
        runner = ModelRunner(loaded_fp32.model, make(pool, loaded_fp32.config, torch.float32))
        prompts = prompt_ids[:3]
        tables = [pool.manager.allocate(pages_for(len(p) + 8, 16)) for p in prompts]
        # Chunked prefill of the first prompt (prefix extension) next to whole prompts.
        half = len(prompts[0]) // 2
        runner.run([SeqChunk(prompts[0][:half], 0, tables[0], want_logits=False)])
        logits = runner.run([SeqChunk(prompts[0][half:], half, tables[0])] +
                            [SeqChunk(p, 0, t) for p, t in zip(prompts[1:], tables[1:])])
        out = [[x] for x in logits.argmax(-1).tolist()]
        for step in range(7):
            chunks = [SeqChunk([o[-1]], len(p) + step, t) for p, o, t in zip(prompts, out, tables)]
            for o, x in zip(out, runner.run(chunks).argmax(-1).tolist()):
                o.append(x)
        return out

    assert greedy(fake_flashinfer) == greedy(TorchAttention)


def test_each_plan_waits_for_the_previous_plans_copies(fake_flashinfer):
    """plan() fills a pinned host buffer that the GPU copies later: an event is recorded after every plan and the
    next plan waits on it first, so a step that never syncs (an intermediate prefill chunk) cannot have its plan
    overwritten before the copy ran."""
    log = []

    class Event:
        def __init__(self, n):
            self.n = n
            log.append(("record", n))

        def synchronize(self):
            log.append(("sync", self.n))
    kv, q, k, v, _ = _ragged(16, seed=1)
    backend = _backends(fake_flashinfer, kv, num_layers=2)[0]
    events = iter(range(100))
    backend._record_plan_event = lambda: Event(next(events))
    for wrapper in (backend.decode[0], backend.prefill[0]):
        plan = wrapper.plan
        wrapper.plan = lambda *args, plan=plan, **kw: (log.append(("plan",)), plan(*args, **kw))[1]
    for seed in (1, 2, 3):  # three steps: three plans (decode + prefill each)
        backend.prepare(_ragged(16, seed=seed)[4])
        backend.forward(0, q, k, v)
        backend.forward(1, q, k, v)  # a later layer of the step: no plan, no wait
    assert log == [("plan",), ("plan",), ("record", 0),
                   ("sync", 0), ("plan",), ("plan",), ("record", 1),
                   ("sync", 1), ("plan",), ("plan",), ("record", 2)]


def test_plan_inputs_reach_a_gpu_without_a_host_sync(monkeypatch):
    """On CUDA, kv_indices goes to the GPU (pinned, non-blocking) before plan(), which would copy a host kv_indices
    into a CUDA-graph buffer with non_blocking=False; the indptrs stay on the host (plan() reads them) but pinned."""
    import nodeserve.attention.flashinfer_backend as fb

    pinned = []

    def pin_memory(self):
        out = self.clone()
        pinned.append(out)
        return out
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    uploads = []
    monkeypatch.setattr(fb, "upload", lambda t, device: uploads.append((t, device)) or t.clone())
    indices = fb.paged_indices([[3, 5], [7]], [6, 2], [1, 1], 4)
    cuda = torch.device("cuda", 1)
    got = fb.for_plan(indices, cuda)
    assert [u[1] for u in uploads] == [cuda] and torch.equal(uploads[0][0], indices.kv_indices)
    assert all(any(t is p for p in pinned) for t in (got.qo_indptr, got.kv_indptr, got.kv_last_page_len))
    assert got.kv_indptr.tolist() == indices.kv_indptr.tolist() and got.kv_indices.tolist() == [3, 5, 7]
    assert fb.for_plan(indices, torch.device("cpu")) is indices  # CPU: nothing to move
