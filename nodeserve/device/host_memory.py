"""Host tensors on transparent huge pages: the weights and KV pools the CPU kernels stream through.

Where the kernel's THP setting is "madvise" (Ubuntu's default), anonymous memory gets 4 KiB pages
unless a range is advised MADV_HUGEPAGE before it is touched. A core's hardware prefetchers stop at every 4 KiB
page boundary and each page costs a TLB entry, so a stream over 4 KiB pages reads slower: one core's sum() over
1 GiB read 25 GB/s on 4 KiB pages and 31-34 GB/s on 2 MiB ones (AMD EPYC Zen 4 VM, kernel 6.18). Where the setting
is "always" this changes nothing; where it is "never", or off Linux, the tensors are plain ones.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller allocations span too few huge pages to matter
MIN_TENSOR_BYTES = 64 << 10  # a model's tensors moved into the arena: its matrices, not its norms' vectors
ALIGN = 4096


def thp_setting() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"), "unavailable" where none is."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from MIN_BYTES up, in a 2 MiB-aligned range advised MADV_HUGEPAGE before any
    of it is touched (the mapping lives as long as the tensor)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advice is None:
        return torch.empty(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which follows shmem_enabled, not the THP setting
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    try:
        buf.madvise(advice, offset, nbytes)
    except OSError:  # THP not built in: 4 KiB pages, as torch.empty would give
        pass
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def move_to_huge_pages(model: nn.Module) -> int:
    """Copies the model's CPU parameters and buffers of 64 KiB or more into one huge-page arena, each at a 4 KiB
    boundary (a layer's matrices are a few hundred KiB each: alone, none would fill a huge page). A tensor shared by
    two modules, as a tied embedding and lm_head, stays shared within this model (a tensor-parallel shard's
    replicated lm_head gets a copy of its own). Call it before anything keeps pointers into them (native decoders,
    CUDA graphs). Returns the bytes moved."""
    # by what a tensor is (a view of the same first bytes with another shape is another tensor)
    found: dict[tuple, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        tensors = [(n, t, True) for n, t in module.named_parameters(recurse=False)] + \
                  [(n, t, False) for n, t in module.named_buffers(recurse=False)]
        for name, t, is_param in tensors:
            if t is not None and t.device.type == "cpu" and t.nbytes >= MIN_TENSOR_BYTES and t.is_contiguous():
                key = (t.data_ptr(), tuple(t.shape), t.dtype, is_param)
                found.setdefault(key, (t, []))[1].append((module, name))
    offsets, total = [], 0
    for t, _ in found.values():
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    if total < MIN_BYTES:
        return 0
    arena = empty((total,), torch.uint8)
    for (*_, is_param), (t, owners), offset in zip(found, found.values(), offsets):
        data = arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
        for module, name in owners:
            setattr(module, name, new)
    return sum(t.nbytes for t, _ in found.values())
