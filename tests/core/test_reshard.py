"""core/reshard.py: every destination head gets the right global head, once, for every pair of TP degrees.

The plans are applied to fake pools whose slots hold global head ids, so a plan that copies the wrong heads
(SGLang#23746) or misses a degree pair (SGLang#24648, Dynamo#2745) fails on the values, not just the shapes."""

from __future__ import annotations

from typing import Sequence

import pytest

from nodeserve.core.reshard import HeadCopy, readers, reshard_plan, whole_pages
from nodeserve.model.tp_layout import tp_layout

DEGREES = range(1, 9)


def kv_heads(num_kv_heads: int, num_ranks: int) -> tuple[range, ...]:
    # 8 query heads per KV head and 8 MLP units: every degree up to 8 is valid
    return tp_layout(num_kv_heads * 8, num_kv_heads, intermediate_size=32 * 8, num_ranks=num_ranks, unit=32).kv_heads


def apply(plan: Sequence[HeadCopy], src: Sequence[range], dst: Sequence[range]) -> list[list[int | None]]:
    """Destination pools after the plan, one slot per head of each rank; each source slot holds its global head."""
    src_pools = [list(heads) for heads in src]
    dst_pools: list[list[int | None]] = [[None] * len(heads) for heads in dst]
    for c in plan:
        assert c.num_heads >= 1, c
        assert 0 <= c.src_head and c.src_head + c.num_heads <= len(src[c.src_rank]), c
        assert 0 <= c.dst_head and c.dst_head + c.num_heads <= len(dst[c.dst_rank]), c
        for i in range(c.num_heads):
            assert dst_pools[c.dst_rank][c.dst_head + i] is None, f"{c} writes a slot twice"
            dst_pools[c.dst_rank][c.dst_head + i] = src_pools[c.src_rank][c.src_head + i]
    return dst_pools


def check(src: Sequence[range], dst: Sequence[range]) -> tuple[HeadCopy, ...]:
    plan = reshard_plan(src, dst)
    assert apply(plan, src, dst) == [list(heads) for heads in dst]
    assert [(c.dst_rank, c.dst_head) for c in plan] == sorted((c.dst_rank, c.dst_head) for c in plan)
    for a, b in zip(plan, plan[1:]):  # merged: no two neighbours that one copy could do
        assert not (a.dst_rank == b.dst_rank and a.src_rank == b.src_rank
                    and a.src_head + a.num_heads == b.src_head), (a, b)
    expected: dict[int, set[int]] = {}
    for c in plan:
        expected.setdefault(c.src_rank, set()).add(c.dst_rank)
    assert readers(plan) == expected
    for c in plan:  # the same-index rank is used whenever it holds the head
        if c.dst_rank < len(src):
            own = src[c.dst_rank]
            first = dst[c.dst_rank].start + c.dst_head
            assert c.src_rank == c.dst_rank or not any(h in own for h in range(first, first + c.num_heads)), c
    identical = list(src) == list(dst)
    if identical:
        assert plan == tuple(HeadCopy(r, 0, r, 0, len(heads)) for r, heads in enumerate(dst))
        assert whole_pages(plan, src, dst)
    return plan


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8])
def test_every_pair_of_degrees_lands_every_head_once(num_kv_heads: int) -> None:
    for src_degree in DEGREES:
        src = kv_heads(num_kv_heads, src_degree)
        for dst_degree in DEGREES:
            dst = kv_heads(num_kv_heads, dst_degree)
            plan = check(src, dst)
            reading = readers(plan)
            for h in range(num_kv_heads):  # replicas of a head share its readers evenly
                holders = [s for s, heads in enumerate(src) if h in heads]
                if len(holders) > 1:
                    loads = [len(reading.get(s, ())) for s in holders]
                    assert max(loads) - min(loads) <= 1, (src_degree, dst_degree, h, loads)
            # the fast path is exactly: each destination rank's heads are one source rank's, whole
            fast = all(sum(1 for c in plan if c.dst_rank == d) == 1 for d in range(dst_degree)) and all(
                c.num_heads == len(src[c.src_rank]) == len(dst[c.dst_rank]) for c in plan)
            assert whole_pages(plan, src, dst) == fast, (src_degree, dst_degree)


def test_a_single_device_copies_all_heads_at_once() -> None:
    assert check([range(8)], [range(8)]) == (HeadCopy(0, 0, 0, 0, 8),)


def test_prefill_tp1_to_decode_tp2_and_back() -> None:
    one, two = kv_heads(2, 1), kv_heads(2, 2)
    assert check(one, two) == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(0, 1, 1, 0, 1))
    assert readers(reshard_plan(one, two)) == {0: {0, 1}}
    assert check(two, one) == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(1, 0, 0, 1, 1))
    assert not whole_pages(reshard_plan(one, two), one, two)


def test_replicated_heads_tp8_over_2_kv_heads() -> None:
    eight = kv_heads(2, 8)
    assert eight == (range(0, 1),) * 4 + (range(1, 2),) * 4
    # decode TP < prefill TP: one replica each, the same-index one where it holds the head
    assert check(eight, kv_heads(2, 2)) == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(4, 0, 1, 0, 1))
    assert check(eight, kv_heads(2, 1)) == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(4, 0, 0, 1, 1))
    # TP 4 holds [0], [0], [1], [1]: ranks 0 and 1 read themselves, ranks 2 and 3 two different replicas of head 1
    plan = check(eight, kv_heads(2, 4))
    assert readers(plan) == {0: {0}, 1: {1}, 4: {2}, 5: {3}}
    # and up: every replica is written, from the one rank holding each head
    plan = check(kv_heads(2, 2), eight)
    assert readers(plan) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert whole_pages(plan, kv_heads(2, 2), eight)


def test_uneven_split_3_kv_heads_on_2_ranks() -> None:
    one, two, four = kv_heads(3, 1), kv_heads(3, 2), kv_heads(3, 4)
    assert two == (range(0, 2), range(2, 3)) and four == (range(0, 1), range(0, 1), range(1, 2), range(2, 3))
    assert check(one, two) == (HeadCopy(0, 0, 0, 0, 2), HeadCopy(0, 2, 1, 0, 1))
    assert check(two, one) == (HeadCopy(0, 0, 0, 0, 2), HeadCopy(1, 0, 0, 2, 1))
    assert check(two, four) == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(0, 0, 1, 0, 1), HeadCopy(0, 1, 2, 0, 1),
                                HeadCopy(1, 0, 3, 0, 1))
    plan = check(four, two)
    assert plan == (HeadCopy(0, 0, 0, 0, 1), HeadCopy(2, 0, 0, 1, 1), HeadCopy(3, 0, 1, 0, 1))
    assert readers(plan) == {0: {0}, 2: {0}, 3: {1}}  # rank 1's replica is read by nobody: freed at once


@pytest.mark.parametrize("src_kv_heads, dst_kv_heads", [(4, 8), (8, 4), (2, 3)])
def test_mismatched_head_counts_raise(src_kv_heads: int, dst_kv_heads: int) -> None:
    with pytest.raises(ValueError, match="different heads"):
        reshard_plan(kv_heads(src_kv_heads, 2), kv_heads(dst_kv_heads, 2))
