"""Prompt lookup (n-gram) drafts: the tokens that followed the last earlier occurrence of the sequence's tail.

An index per request maps every n-gram of its tokens (n in [min_n, max_n]) to where its latest occurrence ends,
updated as tokens arrive: a lookup is one dict probe per n, so a 4,000-token prompt costs its index once (~n x
4,000 inserts) and nothing per step after. The longest n that matches wins (vLLM's prompt_lookup_max first, down
to prompt_lookup_min); among its occurrences the latest, where the text being copied most likely continues.
"""

from __future__ import annotations

from typing import Sequence

from nodeserve.core.request import Request
from nodeserve.core.speculation import SeqSpeculation


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # per n: n-gram -> the position just after its latest occurrence that has a token after it
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens. An n-gram enters the index once a token follows it (the tail itself never matches)."""
        old = len(self.tokens)
        self.tokens.extend(tokens)
        t = self.tokens
        for end in range(max(old, 1), len(t)):  # n-grams ending at `end` now have t[end] after them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[n][tuple(t[end - n:end])] = end

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest matching tail."""
        t = self.tokens
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, len(t)), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(t[len(t) - n:]))
            if end is not None:
                return t[end:end + max_tokens]
        return []


class PromptLookup:
    """The drafter (core/speculation.Drafter) over each request's own prompt and output."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, states: Sequence[SeqSpeculation], reqs: Sequence[Request],
                max_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for state, req, m in zip(states, reqs, max_tokens):
            if m <= 0:
                out.append([])
                continue
            if state.state is None:
                state.state = NgramIndex(self.min_n, self.max_n)
                state.state.extend(req.prompt_ids)
            index: NgramIndex = state.state
            index.extend(req.output_ids[len(index) - req.num_prompt_tokens:])
            out.append(index.propose(m))
        return out

    def release(self, state: SeqSpeculation) -> None:
        state.state = None  # the index is plain memory: dropped with it
