"""How a tensor-parallel group splits a model: which KV heads, query heads and MLP columns each rank holds.

Megatron's split, with the head rule vLLM and SGLang use, widened so that a degree which does not divide the head
count still works (llama.cpp splits by ratio; vLLM and SGLang refuse):
  - num_ranks <= num_kv_heads: each rank holds whole KV-head groups, contiguous, as evenly as the count allows
    (3 KV heads on 2 ranks: [0, 1] and [2]); its query heads are those groups' heads.
  - num_ranks > num_kv_heads: KV heads are replicated, and rank r holds head r * num_kv_heads // num_ranks (with a
    degree that divides, r // (num_ranks / num_kv_heads): vLLM's and SGLang's owner rule, "NOT modulo"). The
    ranks holding one KV head split its group's query heads between them, in rank order.
  - MLP columns (gate/up rows, down columns) split in units of `unit` (a quantization block: 32): evenly, or,
    given head_dim and heads that split unevenly, so that every rank reads about as many weights per layer (a
    rank with more heads takes fewer columns; each all-reduce waits for the slowest rank).
  - The vocabulary (lm_head rows) splits evenly: a CPU group computes the logits vocab-parallel, each rank its
    slice, written into one shared tensor (no gather needed in one address space).
A rank must hold at least one query head, so the degree is at most the number of query heads.
"""

from __future__ import annotations

from dataclasses import dataclass


def even_split(n: int, parts: int) -> list[range]:
    """[0, n) in `parts` contiguous ranges whose sizes differ by at most one, the larger first."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + size + (p < extra)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class RankShard:
    """One rank's share of every layer: global head ids and intermediate columns, each a contiguous range."""

    rank: int
    kv_heads: range
    q_heads: range
    mlp: range
    vocab: range = range(0)


@dataclass(frozen=True)
class TPLayout:
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    ranks: tuple[RankShard, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def kv_heads(self) -> tuple[range, ...]:
        """Global KV heads per rank: what a pool of this group holds where (core/reshard.py plans from it)."""
        return tuple(r.kv_heads for r in self.ranks)


def tp_layout(num_heads: int, num_kv_heads: int, intermediate_size: int, num_ranks: int, unit: int = 1,
              vocab_size: int = 0, head_dim: int = 0) -> TPLayout:
    """Raises ValueError, naming the degrees that work, when `num_ranks` cannot split this model."""
    if num_ranks < 1 or num_ranks > num_heads or intermediate_size % unit or intermediate_size // unit < num_ranks:
        valid = valid_degrees(num_heads, num_kv_heads, intermediate_size, unit)
        raise ValueError(f"a tensor-parallel degree of {num_ranks} cannot split {num_heads} query heads and "
                         f"{intermediate_size} MLP columns (in units of {unit}); valid degrees up to 8: "
                         f"{', '.join(map(str, valid)) or 'none'}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_ranks <= num_kv_heads:
        kv = even_split(num_kv_heads, num_ranks)
        q = [range(r.start * group, r.stop * group) for r in kv]
    else:
        owner = [r * num_kv_heads // num_ranks for r in range(num_ranks)]
        kv = [range(h, h + 1) for h in owner]
        q = []
        for r, h in enumerate(owner):
            holders = [s for s in range(num_ranks) if owner[s] == h]
            if len(holders) > group:
                raise ValueError(f"a tensor-parallel degree of {num_ranks} gives KV head {h} {len(holders)} ranks "
                                 f"but it has only {group} query heads; valid degrees up to 8: "
                                 f"{', '.join(map(str, valid_degrees(num_heads, num_kv_heads, intermediate_size, unit)))}")
            part = even_split(group, len(holders))[holders.index(r)]
            q.append(range(h * group + part.start, h * group + part.stop))
    sizes = [len(r) for r in even_split(intermediate_size // unit, num_ranks)]
    if head_dim:
        sizes = _balanced_mlp(q, kv, head_dim, intermediate_size // unit, unit) or sizes
    starts = [sum(sizes[:r]) * unit for r in range(num_ranks)]
    mlp = [range(s, s + n * unit) for s, n in zip(starts, sizes)]
    vocab = even_split(vocab_size, num_ranks)
    return TPLayout(num_heads, num_kv_heads, intermediate_size,
                    tuple(RankShard(r, kv[r], q[r], mlp[r], vocab[r]) for r in range(num_ranks)))


def valid_degrees(num_heads: int, num_kv_heads: int, intermediate_size: int, unit: int = 1,
                  max_degree: int = 8) -> list[int]:
    group = num_heads // num_kv_heads
    return [n for n in range(1, max_degree + 1)
            if n <= num_heads and not intermediate_size % unit and intermediate_size // unit >= n
            and (n <= num_kv_heads or -(-n // num_kv_heads) <= group)]


def _balanced_mlp(q: list[range], kv: list[range], head_dim: int, num_units: int, unit: int) -> list[int] | None:
    """MLP units per rank such that every rank reads about as many weights per layer, where the heads split
    unevenly: a rank with more heads takes fewer MLP columns. Per layer a rank reads q + k + v rows and o columns
    (2 * (q heads + KV heads) * head_dim vectors of the hidden size) and 3 per MLP column (gate, up, down), and
    every rank waits for the slowest at each all-reduce. None when the heads split evenly (the even split is it)."""
    attn = [2 * (len(qr) + len(kr)) * head_dim for qr, kr in zip(q, kv)]
    if len(set(attn)) == 1:
        return None
    target = (sum(attn) + 3 * num_units * unit) / len(q)
    want = [max(1.0, (target - a) / (3 * unit)) for a in attn]  # units, at least one each
    scale = num_units / sum(want)
    exact = [w * scale for w in want]
    sizes = [max(1, int(e)) for e in exact]
    for r in sorted(range(len(q)), key=lambda r: exact[r] - int(exact[r]), reverse=True):  # largest remainders
        if sum(sizes) >= num_units:
            break
        sizes[r] += 1
    while sum(sizes) > num_units:  # the max(1, ...) floors overshot: take from the largest
        sizes[sizes.index(max(sizes))] -= 1
    return sizes
