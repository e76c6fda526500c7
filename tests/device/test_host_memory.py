"""Host tensors on huge pages (device/host_memory.py): the same values and sharing, 2 MiB-aligned, and where the
kernel lets a range be advised, backed by huge pages."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from nodeserve.device import host_memory


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_empty_and_zeros_give_the_shape_and_dtype_asked():
    big = host_memory.zeros((3, 2 << 20), torch.float16)  # 12 MiB: from the advised range
    assert big.shape == (3, 2 << 20) and big.dtype == torch.float16 and big.is_contiguous()
    assert big.data_ptr() % host_memory.HUGE_PAGE == 0 and not big.any()
    big[2, -1] = 1.5  # writable, to its last element
    assert big.sum().item() == 1.5
    small = host_memory.zeros((4, 4), torch.int64)  # below MIN_BYTES: a plain tensor
    assert small.shape == (4, 4) and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.thp_setting() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages on (always or madvise)")
def test_a_large_tensor_is_backed_by_huge_pages():
    before = _anon_huge_kib()
    t = host_memory.zeros((16 << 20,), torch.float32)  # 64 MiB, touched by zero_()
    # Huge pages are a best effort (memory may be too fragmented for some): most of the range gets them here.
    assert _anon_huge_kib() - before >= (t.nbytes >> 10) // 2


def test_moving_a_model_keeps_its_outputs_and_its_tied_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 512), nn.LayerNorm(512), nn.Linear(512, 4096))
    model[3].weight = nn.Parameter(torch.randn(4096, 512))
    model.register_buffer("table", torch.randn(1 << 20))  # a 4 MiB buffer
    tied = nn.Linear(64, 4096, bias=False)
    tied.weight = model[0].weight
    model.append(tied)
    ids = torch.tensor([1, 7, 4095])
    want = model[:4](ids), tied(model[0](ids))
    old = model[1].weight
    moved = host_memory.move_to_huge_pages(model)
    # every tensor of 64 KiB or more: the embedding once (tied), both linears' weights, the buffer
    assert moved == 4096 * 64 * 4 + 64 * 512 * 4 + 4096 * 512 * 4 + (1 << 22)
    assert model[1].weight is not old and isinstance(model[1].weight, nn.Parameter)
    assert model[4].weight is model[0].weight  # still one parameter
    assert model[2].weight.nbytes < host_memory.MIN_TENSOR_BYTES  # a norm's vector stays where it was
    got = model[:4](ids), tied(model[0](ids))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_view_of_another_tensors_first_bytes_keeps_its_shape():
    module = nn.Module()
    module.register_buffer("whole", torch.arange(1 << 20, dtype=torch.float32))
    module.register_buffer("head", module.whole[:1 << 16])  # the same first address, another shape
    host_memory.move_to_huge_pages(module)
    assert module.whole.shape == (1 << 20,) and module.head.shape == (1 << 16,)
    assert torch.equal(module.head, torch.arange(1 << 16, dtype=torch.float32))
