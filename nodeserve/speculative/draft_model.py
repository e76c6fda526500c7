"""Draft-model guesses: a smaller model with the served model's tokenizer guesses each request's next k tokens
greedily, on the decode device, over a KV pool of its own.

Per request the draft holds pages for prompt + max_tokens (taken at its first guess, given back when the request
leaves the device) and the count of tokens whose K/V it has. Each step it first catches up on the tokens it has
not seen (the prompt the first time, in chunks of at most MAX_CATCH_UP tokens a step so a long prompt does not
stall the decode batch; the tokens kept since its last guesses after that: its guesses past the kept ones are
simply written over), then guesses one token a forward for every request at once. Exactness never depends on
it: every guess is verified by the served model (core/speculation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from nodeserve.config import Config, ConfigError
from nodeserve.core.request import Request
from nodeserve.core.scheduler import SeqChunk, token_range
from nodeserve.core.speculation import SeqSpeculation
from nodeserve.kv.reservation import reserve_tokens
from nodeserve.kv.manager import KVManager
from nodeserve.model.loader import LoadedModel, load_model
from nodeserve.sampling.sampler import greedy

MAX_CATCH_UP = 256  # prompt tokens a request's draft computes in one step before it guesses
# What the draft's tokenizer must encode as the served model's does (ids are what guesses are)
PROBE_TEXT = "The quick brown fox: 12,345 {\"key\": [1, 2]} \u00e9t\u00e9 \u4e2d\u6587\n\tdef f(x): return x"


def load_draft(cfg: Config, target: LoadedModel) -> LoadedModel:
    """speculative.draft_model, loaded as the served model is (dtype, quantization), checked to share its
    tokenizer: a ConfigError names what differs."""
    path = cfg.speculative.draft_model
    draft = load_model(path, torch.float32 if cfg.quantization != "none" else target.model.dtype,
                       quantization=cfg.quantization, huge_pages=cfg.huge_pages)
    ours, theirs = target.tokenizer, draft.tokenizer
    if ours.encode(PROBE_TEXT) != theirs.encode(PROBE_TEXT) or ours.eos_token_ids != theirs.eos_token_ids or \
            draft.config.vocab_size > target.config.vocab_size:
        raise ConfigError(f"'speculative.draft_model' {path!r} does not share the served model's tokenizer (its "
                          f"token ids or end-of-sequence ids differ): a draft model must use the same vocabulary")
    return draft


class DraftRunner(Protocol):
    """What the draft needs of runtime/model_runner.ModelRunner: its pool's pages and a forward over chunks."""

    @property
    def kv(self) -> KVManager: ...

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor: ...


@dataclass
class DraftSeq:
    pages: list[int]
    num_computed: int = 0  # tokens whose K/V the draft holds


class DraftModel:
    def __init__(self, runner: DraftRunner):
        """runner: the draft model over its own pool on the decode device (no prefix cache)."""
        self.runner = runner
        self.kv = runner.kv

    def propose(self, states: Sequence[SeqSpeculation], reqs: Sequence[Request],
                max_tokens: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        chunks, rows = [], []
        for i, (state, req, m) in enumerate(zip(states, reqs, max_tokens)):
            if m <= 0:
                continue
            if state.state is None:
                pages = reserve_tokens(self.kv, req.max_total_tokens)
                if pages is None:  # its pool is full: no guesses for this one until a seat frees
                    continue
                state.state = DraftSeq(pages)
            d: DraftSeq = state.state
            end = min(req.num_tokens, d.num_computed + MAX_CATCH_UP)
            chunks.append(SeqChunk(token_range(req, d.num_computed, end), d.num_computed, d.pages,
                                   want_logits=end == req.num_tokens))
            if end == req.num_tokens:
                rows.append(i)
            d.num_computed = end
        if not chunks:
            return out
        # catching up, and the first guess of those caught up (a chunk's last token is the request's last)
        for i, token in zip(rows, greedy(self.runner.run(chunks)).tolist()):
            out[i].append(token)
        for step in range(1, max((max_tokens[i] for i in rows), default=0)):
            live = [i for i in rows if len(out[i]) < max_tokens[i]]
            if not live:
                break
            feed = [SeqChunk([out[i][-1]], reqs[i].num_tokens + step - 1, states[i].state.pages) for i in live]
            for i, token in zip(live, greedy(self.runner.run(feed)).tolist()):
                out[i].append(token)
        return out

    def release(self, state: SeqSpeculation) -> None:
        if isinstance(state.state, DraftSeq):
            self.kv.free(state.state.pages)
            state.state = None
