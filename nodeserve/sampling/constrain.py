"""Grammar-constrained sampling: each constrained row's allowed next tokens as a token bitmask (llguidance fills
it, one row at a time, in Rust), applied to the batch's logits with plain torch ops (CPU or GPU, nothing to build
at first use), and each sampled token fed back to its row's matcher. The matchers come from the server
(server/structured.py, which says why llguidance); rows without one are untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

# A row's mask fill over this in one step ends its request (with a message naming the limit): a fill is one
# uninterruptible Rust call on the worker thread, so a pathological grammar would otherwise stall the whole
# device every step. A typical fill takes well under a millisecond.
MASK_FILL_BUDGET_S = 0.25


class GrammarMatcher:
    """One choice's position in its grammar: an llguidance LLMatcher, and whether the choice is done with it.

    llguidance's is_stopped() is already true once the grammar is complete (only a stop token may follow), so
    done-ness is kept here: a matcher is finished once it consumed a stop token (the request may keep going under
    ignore_eos or min_tokens: what follows is unconstrained, as it was with xgrammar) or once it is in error (a
    token outside the grammar, or a step past llguidance's own limits: it stays in error, and the output leaves the
    grammar from there)."""

    __slots__ = ("ll", "stop_token_ids", "stopped")

    def __init__(self, ll: Any, stop_token_ids: Collection[int]):
        self.ll = ll
        self.stop_token_ids = stop_token_ids
        self.stopped = False

    def is_finished(self) -> bool:
        return self.stopped or self.ll.is_error()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (CPU, int32, one bit per token)."""
        v = bitmask[row]
        self.ll.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        if self.ll.is_error():
            raise RuntimeError(f"grammar matcher error: {self.error()}")

    def consume_token(self, token: int) -> bool:
        """Advances past `token`; False (and finished) when the grammar does not allow it."""
        if not self.ll.consume_token(token):
            return False
        self.stopped = token in self.stop_token_ids
        return True

    def error(self) -> str:
        """Why the matcher is in error, on one line ("" when it is not)."""
        return _first_line(self.ll.get_error()) if self.ll.is_error() else ""


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """[batch, ceil(vocab_size / 32)] int32 on the CPU, every token allowed (-1: all bits set)."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets logits[rows[k], t] to -inf, in place, for every token t whose bit in bitmask[k] is 0. Plain torch, on
    the logits' device: llguidance.torch's own apply is torch.compile'd (seconds, and a compiler, at first use).
    On a CPU it costs about what xgrammar's C++ apply did (bench/results/grammar_backends.json, "apply")."""
    device, vocab_size = logits.device, logits.shape[1]
    words = bitmask.to(device, non_blocking=True)                                    # [R, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    disallowed = (((words.unsqueeze(-1) >> shifts) & 1) == 0).view(len(rows), -1)[:, :vocab_size]
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        logits[index] = logits[index].masked_fill_(disallowed, float("-inf"))


def apply_grammar_masks(
    logits: torch.Tensor,                  # [B, V]
    grammars: Sequence[Any | None],        # per row: a GrammarMatcher or None
    budget_s: float = MASK_FILL_BUDGET_S,
) -> tuple[torch.Tensor, dict[int, float]]:
    """Returns `logits` itself when no row is constrained, else a copy with each constrained row's disallowed
    tokens at -inf; and the rows whose fill took longer than budget_s, with the seconds it took. A matcher that
    already finished (its stop token sampled, the request kept going under ignore_eos or min_tokens; or in error)
    constrains nothing."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_finished()]
    if not rows:
        return logits, {}
    bitmask = allocate_token_bitmask(len(rows), logits.shape[1])   # bitmask[k] is row rows[k]'s
    slow: dict[int, float] = {}
    for k, i in enumerate(rows):
        start = time.perf_counter()
        try:
            grammars[i].fill_next_token_bitmask(bitmask, k)
        except Exception:  # one request's broken matcher must not fail the whole batch: that row goes unmasked
            log.exception("grammar matcher failed; row %d is sampled unconstrained this step", i)
            bitmask[k].fill_(-1)  # all allowed, whatever the failed fill wrote
        if (took := time.perf_counter() - start) > budget_s:
            slow[i] = took
    logits = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    return logits, slow


def warm_masks(device: torch.device, vocab_size: int) -> None:
    """Applies one mask on `device` and checks the result. Nothing is compiled (plain torch ops); this loads the
    ops' kernels before the first structured-output request's step and finds a broken device path at start."""
    logits = torch.zeros(1, vocab_size, device=device)
    bitmask = allocate_token_bitmask(1, vocab_size)
    bitmask.fill_(0)
    bitmask[0, 0] = 1  # only token 0 allowed
    apply_token_bitmask(logits, bitmask, [0])
    if not (torch.isinf(logits[0, 1:]).all() and logits[0, 0] == 0):
        raise RuntimeError("the grammar mask gave a wrong result in its warm-up")


def accept_tokens(grammars: Sequence[Any | None], token_ids: Sequence[int]) -> None:
    """Advances each row's matcher past its sampled token."""
    for g, token in zip(grammars, token_ids):
        if g is not None and not g.is_finished() and not g.consume_token(token):
            # Only when every allowed token was masked by something else (min_tokens, logit_bias -inf), or the
            # row's fill failed: the output leaves the grammar from here on; say so rather than fail the request.
            log.warning("sampled token %d is outside the request's grammar; the rest of its output is "
                        "unconstrained (%s)", token, g.error())


def _first_line(error: str) -> str:
    return (error.split("<state>")[0].strip().splitlines() or ["no message"])[0][:300]
