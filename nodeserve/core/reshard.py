"""Moving a request's KV between two device groups whose tensor-parallel degrees differ (prefill TP 1 -> decode
TP 2, decode TP < prefill TP, ...): which heads of which source rank's pool each destination rank's pool gets.

Each rank's pool holds only its own KV heads (model/tp_layout.py decides which), in global head order, so a
copy is a run of heads from one source rank to one destination rank, the same for every page and layer moved.
The plan is pure data; the runtime applies it per layer and frees a source rank's pages once its `readers` are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class HeadCopy:
    """Heads [src_head, src_head + num_heads) of source rank src_rank's pool go to heads [dst_head, dst_head +
    num_heads) of destination rank dst_rank's pool (offsets within each rank's own heads), for every page and layer
    being moved."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    num_heads: int


def reshard_plan(src: Sequence[range], dst: Sequence[range]) -> tuple[HeadCopy, ...]:
    """src[r] / dst[r]: the global KV heads rank r holds on each side (contiguous ranges). Every head every
    destination rank holds is written exactly once, from a source rank that holds it.

    Which source rank, where several hold a head (KV heads replicated on a degree above their count): the one with
    the destination's own index when it holds the head (identical layouts then copy rank to rank); otherwise, in
    destination order, the holder the fewest destination ranks read from so far (those same-index reads counted
    first), the lowest rank on a tie. The destination ranks sharing a head then read it from different replicas
    (with model/tp_layout's layouts, the numbers of readers of a head's holders differ by at most one).

    Consecutive heads read from one source rank are one HeadCopy; copies are ordered by destination rank, then
    destination head. Raises ValueError when the two sides do not hold the same heads (different models).
    """
    for side, ranges in (("source", src), ("destination", dst)):
        for r, heads in enumerate(ranges):
            if heads.step != 1:
                raise ValueError(f"{side} rank {r} holds {heads}: a rank's KV heads must be a contiguous range")
    src_heads = {h for heads in src for h in heads}
    dst_heads = {h for heads in dst for h in heads}
    if src_heads != dst_heads:
        raise ValueError(f"cannot reshard KV between groups holding different heads (different models?): the source "
                         f"ranks hold {_ranges(src)} and the destination ranks {_ranges(dst)}; heads only on the "
                         f"destination: {sorted(dst_heads - src_heads)}, only on the source: "
                         f"{sorted(src_heads - dst_heads)}")
    # source rank -> destination ranks reading it; same-index reads first, so the others go around them
    reading: dict[int, set[int]] = {d: {d} for d in range(min(len(src), len(dst))) if _overlap(src[d], dst[d])}
    plan: list[HeadCopy] = []
    for d, heads in enumerate(dst):
        for dst_head, h in enumerate(heads):
            s = _source(src, d, h, reading)
            reading.setdefault(s, set()).add(d)
            src_head = h - src[s].start
            last = plan[-1] if plan else None
            if (last is not None and last.dst_rank == d and last.src_rank == s
                    and last.src_head + last.num_heads == src_head):
                # dst heads of one rank are visited in order, so only the source side can break the run
                plan[-1] = HeadCopy(s, last.src_head, d, last.dst_head, last.num_heads + 1)
            else:
                plan.append(HeadCopy(s, src_head, d, dst_head, 1))
    return tuple(plan)


def _source(src: Sequence[range], dst_rank: int, head: int, reading: dict[int, set[int]]) -> int:
    if dst_rank < len(src) and head in src[dst_rank]:
        return dst_rank
    holders = [s for s, heads in enumerate(src) if head in heads]
    return min(holders, key=lambda s: (len(reading.get(s, ())), s))


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


def _ranges(ranks: Sequence[range]) -> str:
    return "[" + ", ".join(f"[{r.start}, {r.stop})" for r in ranks) + "]"


def readers(plan: Sequence[HeadCopy]) -> dict[int, set[int]]:
    """Source rank -> the destination ranks that read from it. A source rank no copy reads is absent: its pages can
    be freed at once."""
    out: dict[int, set[int]] = {}
    for c in plan:
        out.setdefault(c.src_rank, set()).add(c.dst_rank)
    return out


def whole_pages(plan: Sequence[HeadCopy], src: Sequence[range], dst: Sequence[range]) -> bool:
    """True when each destination rank gets one copy holding all its heads, all the heads of its source rank: the
    runtime then copies whole pages (one block per page) instead of slicing heads. Identical layouts always are."""
    return (len(plan) == len(dst)
            and all(c.dst_rank == d and c.src_head == 0 and c.dst_head == 0
                    and c.num_heads == len(src[c.src_rank]) == len(dst[d])
                    for d, c in enumerate(plan)))
