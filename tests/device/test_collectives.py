"""The tensor-parallel all-reduces (nodeserve/device/collectives.py): N rank threads, more than this machine's cores
too, get the fixed-order sum bit for bit; an abort frees ranks waiting on one that never comes; reset recovers."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Callable

import pytest
import torch

from nodeserve.device import collectives
from nodeserve.device.collectives import (CPUAllReduce, NCCLAllReduce, RankComm, RankThreadsNCCL, ThreadAllReduce,
                                          make_all_reduce)
from nodeserve.kernels import native

kernels = native.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the native kernels could not be built (no C compiler?)")


def make(kind: str, num_ranks: int):
    return CPUAllReduce(num_ranks, kernels) if kind == "native" else ThreadAllReduce(num_ranks)


KINDS = [pytest.param("native", marks=needs_kernels), "thread"]


def run_ranks(group, ranks: list[int], body: Callable[[int], object], timeout: float = 60.0) -> dict[int, object]:
    """body(rank) on one thread per rank; each rank's return value or exception. A rank still running after
    `timeout` aborts the group (so no thread outlives the test) and fails it."""
    out: dict[int, object] = {}

    def target(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        group.abort()
        for t in threads:
            t.join(5)
        pytest.fail(f"ranks still running after {timeout} s")
    return out


def fixed_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    want = xs[0].clone()
    for x in xs[1:]:
        want += x
    return want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])  # 3 and 4: more ranks than the 2-core CI machine's cores
def test_every_rank_gets_the_fixed_order_sum_bit_for_bit(kind, num_ranks):
    """Calls back to back with sizes changing between them (a slice of 1 float, slices shorter than a rank's
    share, sizes not a multiple of anything), each equal to rank 0 + rank 1 + ... in float32 on every rank."""
    group = make(kind, num_ranks)
    sizes = [1, 7, 4096, 100003, 7, 1, 4096] * 5
    gen = torch.Generator().manual_seed(num_ranks)
    # magnitudes far apart, so the order of the additions shows in the low bits
    inputs = [[torch.randn(n, generator=gen) * 10.0 ** (3 * r) for r in range(num_ranks)] for n in sizes]

    def body(rank: int) -> list[torch.Tensor]:
        outs = []
        for xs in inputs:
            x = xs[rank].clone()
            assert group(rank, x) is x
            outs.append(x)
        return outs

    got = run_ranks(group, list(range(num_ranks)), body)
    for i, xs in enumerate(inputs):
        want = fixed_order_sum(xs)
        for rank in range(num_ranks):
            assert isinstance(got[rank], list), got[rank]
            assert torch.equal(got[rank][i], want), (i, rank)


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_are_summed_elementwise_whatever_the_shape(kind):
    group = make(kind, 2)
    xs = [torch.randn(3, 576), torch.randn(3, 576)]
    got = run_ranks(group, [0, 1], lambda r: group(r, xs[r].clone()))
    want = fixed_order_sum(xs)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_frees_the_ranks_waiting_for_one_that_never_comes_and_reset_recovers(kind):
    group = make(kind, 3)
    xs = [torch.randn(1000) for _ in range(3)]
    waiting = [x.clone() for x in xs]
    started = time.monotonic()
    aborter = threading.Timer(0.2, group.abort)
    aborter.start()
    got = run_ranks(group, [0, 1], lambda r: group(r, waiting[r]), timeout=10)  # rank 2 never arrives
    elapsed = time.monotonic() - started
    aborter.join()
    for rank in (0, 1):
        assert isinstance(got[rank], RuntimeError) and "peer failed" in str(got[rank])
        assert torch.equal(waiting[rank], xs[rank])  # untouched
    assert elapsed < 1.2, elapsed  # the abort at 0.2 s, the ranks out well within a second of it
    with pytest.raises(RuntimeError, match="peer failed"):  # and every later call, at once, until reset
        group(2, xs[2].clone())
    group.reset()
    got = run_ranks(group, [0, 1, 2], lambda r: group(r, xs[r].clone()), timeout=10)
    want = fixed_order_sum(xs)
    assert all(torch.equal(got[r], want) for r in range(3))


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_mid_call_leaves_the_group_usable_after_reset(kind):
    """An abort racing a stream of calls: both ranks complete the same calls and raise in the same one (the
    barrier completes for all ranks or for none), none hangs, and after reset the group sums again."""
    group = make(kind, 2)
    xs = [torch.randn(4096) for _ in range(2)]
    want = fixed_order_sum(xs)

    def body(rank: int) -> int:
        done = 0
        for _ in range(100000):
            x = xs[rank].clone()
            try:
                group(rank, x)
            except RuntimeError:
                return done
            assert torch.equal(x, want)
            done += 1
        return done

    aborter = threading.Timer(0.1, group.abort)
    aborter.start()
    got = run_ranks(group, [0, 1], body, timeout=20)
    aborter.join()
    assert all(isinstance(got[r], int) for r in (0, 1)), got
    assert got[0] == got[1] > 0, got  # both ranks finished the same calls, then both raised in the next
    group.reset()
    got = run_ranks(group, [0, 1], lambda r: group(r, xs[r].clone()), timeout=10)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_of_one_returns_its_tensor_and_still_honours_abort(kind):
    group = make(kind, 1)
    x = torch.randn(10)
    want = x.clone()
    assert torch.equal(group(0, x), want)
    group.abort()
    with pytest.raises(RuntimeError):
        group(0, x)
    group.reset()
    assert torch.equal(group(0, x), want)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_calls_are_refused_before_any_rank_waits(kind):
    group = make(kind, 2)
    with pytest.raises(ValueError, match="rank 2"):
        group(2, torch.zeros(4))
    with pytest.raises(ValueError, match="float32"):
        group(0, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="strided"):
        group(0, torch.zeros(4, 4).t())


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_pass_different_sizes_all_get_an_error(kind):
    group = make(kind, 2)
    got = run_ranks(group, [0, 1], lambda r: group(r, torch.zeros(10 + r)), timeout=10)
    assert all(isinstance(got[r], ValueError) and "differ in size" in str(got[r]) for r in (0, 1)), got
    got = run_ranks(group, [0, 1], lambda r: group(r, torch.ones(10)), timeout=10)  # no reset needed
    assert all(torch.equal(got[r], torch.full((10,), 2.0)) for r in (0, 1))


@needs_kernels
def test_native_group_has_a_handle_until_closed():
    group = CPUAllReduce(2, kernels)
    assert isinstance(group.handle, int) and group.handle
    comm = RankComm(group, 1)
    assert comm.handle == group.handle and comm.num_ranks == 2 and comm.rank == 1
    group.close()
    assert group.handle is None
    with pytest.raises(RuntimeError, match="closed"):
        group(0, torch.zeros(4))
    group.close()  # twice is fine
    assert ThreadAllReduce(2).handle is None


def test_rank_comm_calls_its_group_with_its_rank():
    group = ThreadAllReduce(2)
    xs = [torch.randn(5), torch.randn(5)]
    comms = [RankComm(group, r) for r in (0, 1)]
    got = run_ranks(group, [0, 1], lambda r: comms[r](xs[r].clone()), timeout=10)
    assert torch.equal(got[1], fixed_order_sum(xs))


def test_make_all_reduce_takes_the_native_group_where_the_kernels_build(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="nodeserve.device.collectives"):
        group = make_all_reduce("cpu", 2)
    if kernels is not None:
        assert isinstance(group, CPUAllReduce) and group.handle
        assert "tensor-parallel all-reduce: native fixed-order sum over 2 ranks" in caplog.text
    monkeypatch.setattr(collectives.native, "load", lambda: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nodeserve.device.collectives"):
        fallback = make_all_reduce("cpu", 3)
    assert isinstance(fallback, ThreadAllReduce) and fallback.num_ranks == 3 and fallback.handle is None
    assert "torch fixed-order sum over 3 ranks" in caplog.text
    cuda = make_all_reduce("cuda", 2, devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    assert isinstance(cuda, RankThreadsNCCL) and cuda.num_ranks == 2 and cuda.handle is None
    with pytest.raises(ValueError, match="no tensor-parallel all-reduce"):
        make_all_reduce("mps", 2)


def test_the_rank_thread_nccl_adapter_rendezvous_and_abort(monkeypatch):
    """Without GPUs: the adapter's rendezvous with NCCL's call replaced by a sum over the deposited tensors, and an
    abort that releases a rank whose peer never comes."""
    group = RankThreadsNCCL([0, 1])
    calls = []

    def fake(tensors, streams):
        calls.append(len(tensors))
        total = sum(t.clone() for t in tensors)
        for t in tensors:
            t.copy_(total)
    monkeypatch.setattr(group._nccl, "all_reduce", fake)
    xs = [torch.full((4,), float(r + 1)) for r in range(2)]
    threads = [threading.Thread(target=group, args=(r, xs[r])) for r in range(2)]
    [t.start() for t in threads]
    [t.join(5) for t in threads]
    assert calls == [2] and all(torch.equal(x, torch.full((4,), 3.0)) for x in xs)
    timer = threading.Timer(0.2, group.abort)
    timer.start()
    with pytest.raises(RuntimeError, match="peer failed"):
        group(0, xs[0])
    group.reset()


def test_nccl_all_reduce_checks_its_arguments_and_matches_torchs_signature():
    """No GPU here: only what runs without one. torch.cuda.nccl.all_reduce(inputs, outputs=None, ...) is the call
    NCCLAllReduce makes."""
    from torch.cuda import nccl

    params = list(inspect.signature(nccl.all_reduce).parameters)
    assert params[:2] == ["inputs", "outputs"]
    group = NCCLAllReduce([0, "cuda:1"])
    assert group.num_ranks == 2 and group.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="one per GPU"):
        group.all_reduce([torch.zeros(2)])
    with pytest.raises(ValueError, match="want cuda:0"):
        group.all_reduce([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="CUDA devices"):
        NCCLAllReduce(["cpu:0"])
