"""All-reduce between the ranks of a tensor-parallel device group (`cpu:0+cpu:1`): the sum after o_proj and after
down_proj of each layer (Megatron).

CPU ranks are threads of this process, so the reduce is over shared memory: CPUAllReduce runs the native one
(kernels/csrc/allreduce.c, which the native decoder also calls inside its layer call); ThreadAllReduce is the same
algorithm in torch for when the kernels cannot be built. Both add in rank order (rank 0 + rank 1 + ... in
float32), so every rank holds bitwise the same sum and a rank's output does not depend on timing. Both can be
aborted, so a rank whose forward raised does not leave its peers waiting forever. NCCLAllReduce is the GPU one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from nodeserve.kernels import native
from nodeserve.kernels.native import NativeKernels

log = logging.getLogger(__name__)

_PEER_FAILED = "a tensor-parallel peer failed"
# A waiting rank spins (~100 us of pause on Zen 4) before it sleeps on a futex: a rank waits for its peer at every
# reduce for about their difference in work, and a futex wake costs tens of us in a VM. On the 2-vCPU Zen 4 a
# SmolLM2 Q4_1 decode step on cpu:0+cpu:1 took 4.8 ms at 4096 spins, 5.1 ms spinning only, 15.8 ms at 0 and 256
# (sleeping at almost every reduce); one core alone 6.0-7.0 ms. Ranks that share a core spin SHARED_CORE_SPINS.
SPINS_BEFORE_SLEEP = 4096
SHARED_CORE_SPINS = 64
_SIZES_DIFFER = "all-reduce: the ranks' tensors differ in size"


class AllReduce(Protocol):
    """Sum over the ranks of a CPU group, each rank calling from its own thread, all in lockstep (one call in flight
    per group)."""

    name: str
    num_ranks: int

    @property
    def handle(self) -> int | None:
        """The native group's pointer, for the native decoder to reduce inside its layer call; None if not native."""
        ...

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous float32 on the CPU, the same shape on every rank) replaced in place by the sum over ranks;
        returns x. Raises RuntimeError when the group is aborted."""
        ...

    def abort(self) -> None:
        """Every rank waiting in a call, and every later call, raises until reset()."""
        ...

    def reset(self) -> None:
        """Clears an abort; only once every rank has returned (the group's owner, between steps)."""
        ...


@dataclass(frozen=True)
class RankComm:
    """One rank's view of a group: what a rank's forward (and NativeDecoder's `comm`) is given."""

    group: AllReduce
    rank: int

    @property
    def handle(self) -> int | None:
        return self.group.handle

    @property
    def num_ranks(self) -> int:
        return self.group.num_ranks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(self.rank, x)


def _check(rank: int, num_ranks: int, x: torch.Tensor) -> None:
    # C reads raw pointers: a wrong dtype or a strided view would be summed as garbage, or past its end
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not in a group of {num_ranks}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"all-reduce takes contiguous float32 CPU tensors, got {x.dtype} on {x.device}"
                         f"{'' if x.is_contiguous() else ' (strided)'}")


class CPUAllReduce:
    """The native all-reduce (kernels/csrc/allreduce.c) over num_ranks threads. close() frees the group; no rank may
    be in a call then."""

    def __init__(self, num_ranks: int, kernels: NativeKernels, spins: int = SPINS_BEFORE_SLEEP):
        """spins: pause iterations a waiting rank spins before it sleeps on a futex (allreduce.c)."""
        self.name, self.num_ranks, self._lib = "native", num_ranks, kernels.lib
        self._handle: int | None = kernels.lib.ns_group_new(num_ranks)
        if self._handle is None:
            raise MemoryError(f"ns_group_new({num_ranks}) failed")
        kernels.lib.ns_group_spins(self._handle, spins)

    @property
    def handle(self) -> int | None:
        return self._handle

    def _live(self) -> int:
        if self._handle is None:
            raise RuntimeError("the all-reduce group is closed")
        return self._handle

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        _check(rank, self.num_ranks, x)
        err = self._lib.ns_group_allreduce(self._live(), rank, x.data_ptr(), x.numel())
        if err == -2:
            raise ValueError(_SIZES_DIFFER)
        if err:
            raise RuntimeError(_PEER_FAILED)
        return x

    def abort(self) -> None:
        self._lib.ns_group_abort(self._live())

    def reset(self) -> None:
        self._lib.ns_group_reset(self._live())

    def close(self) -> None:
        if self._handle is not None:
            self._lib.ns_group_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class _Barrier:
    """threading.Barrier with the native group's abort rule. threading.Barrier's abort can break a barrier the last
    rank already passed (it returns while its peers raise); here a barrier completes for every rank or for none,
    and the second barrier of a call ignores an abort, since every rank past the first is already summing."""

    def __init__(self, parties: int):
        self._cond = threading.Condition()
        self._parties, self._count, self._generation, self.aborted = parties, 0, 0, False

    def wait(self, honour_abort: bool) -> bool:
        """True once every rank arrived; False when honour_abort and the group was aborted first."""
        with self._cond:
            if honour_abort and self.aborted:
                return False
            generation = self._generation
            self._count += 1
            if self._count == self._parties:
                self._count, self._generation = 0, generation + 1
                self._cond.notify_all()
                return True
            self._cond.wait_for(lambda: self._generation != generation or (honour_abort and self.aborted))
            return self._generation != generation

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self.aborted, self._count = False, 0
            self._generation += 1


class ThreadAllReduce:
    """The native algorithm in torch (publish, barrier, each rank sums its slice into every buffer, barrier), for
    when the native kernels cannot be built: the same sums bit for bit, at Python's cost per call."""

    handle = None

    def __init__(self, num_ranks: int):
        self.name, self.num_ranks = "thread", num_ranks
        self._bufs: list[torch.Tensor | None] = [None] * num_ranks
        self._barrier = _Barrier(num_ranks)

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        _check(rank, self.num_ranks, x)
        n = self.num_ranks
        if n == 1:
            if self._barrier.aborted:
                raise RuntimeError(_PEER_FAILED)
            return x
        self._bufs[rank] = flat = x.view(-1)
        if not self._barrier.wait(honour_abort=True):
            raise RuntimeError(_PEER_FAILED)
        bufs = [b for b in self._bufs if b is not None]
        same = len(bufs) == n and all(b.numel() == flat.numel() for b in bufs)  # every rank sees the same answer
        if same:
            chunk = (-(-flat.numel() // n) + 15) // 16 * 16  # the native slices (64-byte aligned)
            begin, end = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
            if begin < end:
                acc = bufs[0][begin:end].clone()
                for b in bufs[1:]:
                    acc += b[begin:end]
                for b in bufs:
                    b[begin:end] = acc
        self._barrier.wait(honour_abort=False)
        if not same:
            raise ValueError(_SIZES_DIFFER)
        return x

    def abort(self) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        self._bufs = [None] * self.num_ranks
        self._barrier.reset()


class NCCLAllReduce:
    """The GPU all-reduce: torch.cuda.nccl.all_reduce over one tensor per GPU, called from one thread (torch wraps
    the per-GPU calls in an NCCL group and keeps one communicator per device set), eager, on each GPU's current
    stream, in place. NCCL's summation order is its own (ring or tree), though every GPU gets the same values.

    UNTESTED on GPUs: written against torch.cuda.nccl's signature; the test suite only imports it and checks its
    argument checks (the machine it was written on has no GPU)."""

    def __init__(self, devices: Sequence[torch.device | str | int]):
        self.devices = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
        if not self.devices or any(d.type != "cuda" or d.index is None for d in self.devices):
            raise ValueError(f"NCCLAllReduce takes CUDA devices with indices, got {list(devices)}")
        self.name, self.num_ranks = "nccl", len(self.devices)

    def all_reduce(self, tensors: list[torch.Tensor], streams: list | None = None) -> None:
        """tensors[i] (contiguous, on devices[i], all the same shape and dtype) replaced by the sum over i, issued on
        streams[i] (default: the calling thread's current stream of each GPU)."""
        if len(tensors) != self.num_ranks:
            raise ValueError(f"all_reduce takes {self.num_ranks} tensors, one per GPU, got {len(tensors)}")
        for t, d in zip(tensors, self.devices):
            if t.device != d or not t.is_contiguous():
                raise ValueError(f"all_reduce: a tensor on {t.device} (contiguous: {t.is_contiguous()}), want {d}")
        from torch.cuda import nccl

        nccl.all_reduce(tensors, streams=streams)  # outputs=None: in place


class RankThreadsNCCL:
    """NCCLAllReduce behind the rank-per-thread AllReduce interface a group's shards call (runtime/tp_group.py): each
    rank's thread leaves its tensor and waits; the last to arrive issues the one NCCL call over every GPU; a second
    barrier hands the tensors back. Eager only (NCCL under graph capture from one process may deadlock: see
    ../shared/notes/tensor-parallel.md). Each rank's thread computes on its own current stream (CUDADevice gives
    its worker thread one), so each rank leaves that stream with its tensor and NCCL is issued on it: it runs after
    the kernels that wrote the tensor, and the rank's next kernels after it.

    UNTESTED on GPUs, like NCCLAllReduce."""

    handle = None

    def __init__(self, devices: Sequence[torch.device | str | int]):
        self._nccl = NCCLAllReduce(devices)
        self.name, self.num_ranks = "nccl (eager, one thread per rank)", self._nccl.num_ranks
        self._tensors: list[torch.Tensor | None] = [None] * self.num_ranks
        self._streams: list = [None] * self.num_ranks
        self._barrier = _Barrier(self.num_ranks)
        self._error: BaseException | None = None

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self._tensors[rank] = x
        self._streams[rank] = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
        if not self._barrier.wait(honour_abort=True):
            raise RuntimeError(_PEER_FAILED)
        if rank == 0:
            try:
                streams = None if None in self._streams else list(self._streams)
                self._nccl.all_reduce([t for t in self._tensors if t is not None], streams)
                self._error = None
            except BaseException as e:  # every rank fails this step alike
                self._error = e
        self._barrier.wait(honour_abort=False)
        if self._error is not None:
            raise RuntimeError(f"NCCL all-reduce failed: {self._error}")
        return x

    def abort(self) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        self._tensors = [None] * self.num_ranks
        self._barrier.reset()


def make_all_reduce(device_type: str, num_ranks: int, shares_cores: bool = False,
                    devices: Sequence[torch.device] = ()) -> AllReduce:
    """The CPU group's all-reduce: the native one where the kernels build, else the torch fallback. GPU groups reduce
    all ranks' tensors from one thread instead, through NCCLAllReduce(devices). shares_cores: a rank shares its core
    with another device's thread, so waiting ranks sleep soon rather than spin through the core's time."""
    if device_type == "cuda":
        log.info("tensor-parallel all-reduce: NCCL, eager, over %d GPUs", num_ranks)
        return RankThreadsNCCL(devices)
    if device_type != "cpu":
        raise ValueError(f"no tensor-parallel all-reduce for {device_type} devices")
    kernels = native.load()
    group: AllReduce
    if kernels is not None:
        group = CPUAllReduce(num_ranks, kernels, SHARED_CORE_SPINS if shares_cores else SPINS_BEFORE_SLEEP)
        log.info("tensor-parallel all-reduce: native fixed-order sum over %d ranks", num_ranks)
    else:
        group = ThreadAllReduce(num_ranks)
        log.info("tensor-parallel all-reduce: torch fixed-order sum over %d ranks (native kernels unavailable)",
                 num_ranks)
    return group
