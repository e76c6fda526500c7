"""The FlashInfer backend's host side, on CPU: page indices against hand-computed values, FP8 writes, and
backend selection. The kernels themselves are checked against torch_ref in tests/cuda (GPU only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nodeserve.attention import make_backend
from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.flashinfer_backend import paged_indices, split_indices, write_kv_scaled
from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.config import ConfigError

PAGE_SIZE = 4
CFG = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=8, softmax_scale=8 ** -0.5, window=lambda layer: 0)


def _meta(rows: list[tuple[list[int], int, int]], num_decodes: int, host_tables: bool = True) -> AttentionMetadata:
    """rows: (page table, cached tokens, new tokens) per sequence, decodes first."""
    max_pages = max(len(t) for t, _, _ in rows)
    tables = torch.zeros(len(rows), max_pages, dtype=torch.int64)
    for b, (t, _, _) in enumerate(rows):
        tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for _, c, n in rows]
    return AttentionMetadata(slot_mapping=torch.zeros(sum(n for _, _, n in rows), dtype=torch.int64),
                             page_tables=tables, seq_lens=torch.tensor(seq_lens), query_lens=[n for _, _, n in rows],
                             seq_lens_host=seq_lens, num_decodes=num_decodes, page_size=PAGE_SIZE,
                             page_tables_host=[t for t, _, _ in rows] if host_tables else None)


# Two decodes and two prefill chunks, page size 4:
#   A: decode, 4 cached + 1 new = 5 tokens on pages [7, 2]      -> pages [7, 2], last page holds 1
#   B: decode, 3 cached + 1 new = 4 tokens on pages [3, 9]      -> pages [3] (9 is reserved, not yet used), 4
#   C: prompt of 6, nothing cached, pages [0, 5]                -> pages [0, 5], 2
#   D: chunk of 3 after 8 cached (prefix extension), [1, 4, 6]  -> pages [1, 4, 6], 3
ROWS = [([7, 2], 4, 1), ([3, 9], 3, 1), ([0, 5], 0, 6), ([1, 4, 6], 8, 3)]


def _as_lists(p):
    return [p.qo_indptr.tolist(), p.kv_indptr.tolist(), p.kv_indices.tolist(), p.kv_last_page_len.tolist()]


@pytest.mark.parametrize("host_tables", [True, False])
def test_split_indices_hand_computed(host_tables):
    decode, prefill = split_indices(_meta(ROWS, num_decodes=2, host_tables=host_tables))
    assert _as_lists(decode) == [[0, 1, 2], [0, 2, 3], [7, 2, 3], [1, 4]]
    # Prefill qo_indptr counts from the first prefill token: q[num_decodes:].
    assert _as_lists(prefill) == [[0, 6, 9], [0, 2, 5], [0, 5, 1, 4, 6], [2, 3]]
    for part in (decode, prefill):
        for t in (part.qo_indptr, part.kv_indptr, part.kv_indices, part.kv_last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu"


def test_split_indices_one_kind_only():
    decode, prefill = split_indices(_meta(ROWS[:2], num_decodes=2))
    assert prefill is None and _as_lists(decode)[1] == [0, 2, 3]
    decode, prefill = split_indices(_meta(ROWS[2:], num_decodes=0))
    assert decode is None and _as_lists(prefill)[0] == [0, 6, 9]


@pytest.mark.parametrize("seq_len, pages, last", [(1, 1, 1), (4, 1, 4), (5, 2, 1), (8, 2, 4), (9, 3, 1)])
def test_last_page_len_at_page_edges(seq_len, pages, last):
    p = paged_indices([[10, 11, 12]], [seq_len], [1], PAGE_SIZE)
    assert p.kv_indices.tolist() == [10, 11, 12][:pages] and p.kv_last_page_len.tolist() == [last]


def test_page_table_too_short_is_an_error():
    with pytest.raises(ValueError, match="cannot hold"):
        paged_indices([[0]], [5], [5], PAGE_SIZE)


def test_fp8_write_quantizes_with_scale():
    kv_layer = torch.zeros(3, 2, PAGE_SIZE, 2, 8, dtype=torch.float8_e4m3fn)
    k = torch.randn(2, 2, 8) * 4
    v = torch.randn(2, 2, 8)
    v[0, 0, 0] = 1e4  # beyond e4m3's range at scale 1: saturates to 448 instead of turning into NaN
    slots = torch.tensor([1 * PAGE_SIZE + 2, 2 * PAGE_SIZE])
    write_kv_scaled(kv_layer, k, v, slots, k_scale=2.0, v_scale=1.0)
    k_back = kv_layer[[1, 2], 0, [2, 0]].float() * 2.0
    v_back = kv_layer[[1, 2], 1, [2, 0]].float()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values.
    torch.testing.assert_close(k_back, k, rtol=2 ** -4, atol=2 ** -6 * 2.0)
    assert v_back[0, 0, 0] == 448.0 and not v_back.isnan().any()
    torch.testing.assert_close(v_back.flatten()[1:], v.flatten()[1:], rtol=2 ** -4, atol=2 ** -6)
    assert int((kv_layer.view(torch.uint8) != 0).any(-1).any(-1).sum()) == 4  # 2 K rows + 2 V rows


def test_write_kv_scaled_is_write_kv_for_wide_dtypes():
    kv_layer = torch.zeros(2, 2, PAGE_SIZE, 2, 8)
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    write_kv_scaled(kv_layer, k, v, torch.tensor([5]), k_scale=3.0)  # scales only apply to FP8 pools
    assert torch.equal(kv_layer[1, 0, 1], k[0]) and torch.equal(kv_layer[1, 1, 1], v[0])


def _pool(device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """A stand-in KVPool: make_backend and the reference backend's constructor read only its device, dtype and
    layers."""
    return SimpleNamespace(device=device, dtype=dtype, layers=())


def test_make_backend_on_cpu():
    cpu = _pool(torch.device("cpu"), torch.float32)
    auto = make_backend("auto", cpu, CFG, torch.float32)
    assert isinstance(auto, TorchAttention) and auto.pool is cpu and auto.scale == 8 ** -0.5
    assert isinstance(make_backend("torch", cpu, CFG, torch.float32), TorchAttention)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        make_backend("flashinfer", cpu, CFG, torch.bfloat16)
    with pytest.raises(ConfigError, match="devices.attention"):
        make_backend("triton", cpu, CFG, torch.float32)


# ---- "auto" on a CUDA host: what it picks when it cannot use FlashInfer, and that it says so ------------------

CUDA0 = torch.device("cuda:0")  # a device object only: nothing below touches a GPU
BF16_POOL, FP32_POOL = _pool(CUDA0, torch.bfloat16), _pool(CUDA0, torch.float32)


def test_auto_falls_back_with_a_reason_when_flashinfer_is_missing(monkeypatch):
    import nodeserve.attention as attention

    monkeypatch.setattr(attention, "flashinfer_importable", lambda: False)  # a CUDA host without flashinfer
    reason = attention.auto_fallback("auto", CUDA0, torch.bfloat16)
    assert "flashinfer does not import" in reason and "pip install -e '.[cuda]'" in reason
    assert isinstance(make_backend("auto", BF16_POOL, CFG, torch.bfloat16), TorchAttention)
    monkeypatch.setattr(attention, "flashinfer_importable", lambda: True)
    assert attention.auto_fallback("auto", CUDA0, torch.bfloat16) is None
    # Not a fallback: an explicit choice, or a CPU device where "auto" always means the reference.
    assert attention.auto_fallback("torch", CUDA0, torch.bfloat16) is None
    assert attention.auto_fallback("auto", torch.device("cpu"), torch.float32) is None


def test_a_float32_model_never_reaches_flashinfer(monkeypatch):
    import nodeserve.attention as attention

    monkeypatch.setattr(attention, "flashinfer_importable", lambda: True)
    reason = attention.auto_fallback("auto", CUDA0, torch.float32)
    assert "float32" in reason and "model.dtype" in reason
    assert isinstance(make_backend("auto", FP32_POOL, CFG, torch.float32), TorchAttention)
    with pytest.raises(ConfigError, match="no float32 kernels"):
        make_backend("flashinfer", FP32_POOL, CFG, torch.float32)
