"""Grammar-constrained sampling: each constrained row's allowed next tokens as a token bitmask, applied to the
batch's logits in one call (xgrammar's kernel: C++ on CPU, CUDA/Triton on GPU), and each sampled token fed back
to its row's matcher. The matchers come from the server (server/structured.py); rows without one are untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

# A row's mask fill over this in one step ends its request (with a message naming the limit): a fill is one
# uninterruptible C++ call on the worker thread, so a pathological grammar would otherwise stall the whole
# device every step. A typical fill takes well under a millisecond.
MASK_FILL_BUDGET_S = 0.25


def apply_grammar_masks(
    logits: torch.Tensor,                  # [B, V]
    grammars: Sequence[Any | None],        # per row: an xgrammar GrammarMatcher or None
    budget_s: float = MASK_FILL_BUDGET_S,
) -> tuple[torch.Tensor, dict[int, float]]:
    """Returns `logits` itself when no row is constrained, else a copy with each constrained row's disallowed
    tokens at -inf; and the rows whose fill took longer than budget_s, with the seconds it took. A matcher that
    already ended (its stop token sampled, the request kept going under ignore_eos or min_tokens) constrains
    nothing."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
    if not rows:
        return logits, {}
    import xgrammar as xgr

    B, V = logits.shape
    bitmask = xgr.allocate_token_bitmask(B, V)                           # [B, ceil(V / 32)] int32, all allowed
    slow: dict[int, float] = {}
    for i in rows:
        start = time.perf_counter()
        try:
            grammars[i].fill_next_token_bitmask(bitmask, i)
        except Exception:  # one request's broken matcher must not fail the whole batch: that row goes unmasked
            log.exception("grammar matcher failed; row %d is sampled unconstrained this step", i)
            bitmask[i].fill_(-1)  # all allowed, whatever the failed fill wrote
        if (took := time.perf_counter() - start) > budget_s:
            slow[i] = took
    logits = logits.clone()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return logits, slow


def warm_masks(device: torch.device, vocab_size: int) -> None:
    """Applies one mask on `device` so its kernel is built now: on a GPU xgrammar compiles it at first use (seconds,
    and a compiler), which would otherwise land on the worker thread in the middle of the first structured-output
    request's step."""
    import xgrammar as xgr

    logits = torch.zeros(1, vocab_size, device=device)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    bitmask.fill_(0)
    bitmask[0, 0] = 1  # only token 0 allowed
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(device), indices=[0])
    if not (torch.isinf(logits[0, 1:]).all() and logits[0, 0] == 0):
        raise RuntimeError("the grammar mask kernel gave a wrong result in its warm-up")


def accept_tokens(grammars: Sequence[Any | None], token_ids: Sequence[int]) -> None:
    """Advances each row's matcher past its sampled token."""
    for g, token in zip(grammars, token_ids):
        if g is not None and not g.is_terminated() and not g.accept_token(token):
            # Only when every allowed token was masked by something else (min_tokens, logit_bias -inf): the
            # output leaves the grammar from here on; say so rather than fail the request.
            log.warning("sampled token %d is outside the request's grammar", token)
