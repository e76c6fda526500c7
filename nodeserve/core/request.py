"""Request: one generation as plain data (tokens, params, counts); TokenEvent: what its stream receives
after each step. Where a request runs and which pages hold its KV live in the runtime's records, not here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nodeserve.core.sampling_params import SamplingParams


@dataclass
class TokenEvent:
    """One new token, or the end of the request. finish_reason is "stop", "length", "abort" or "error"."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """Ownership: exactly one thread holds a request at a time (router, then a prefill worker, then the
    transfer, then a decode worker), and only the holder changes it. An abort only sets `aborted`;
    the holder sees it at its next step and frees everything the request holds, on every device."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None] = field(repr=False, default=lambda ev: None)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0       # tokens of this request whose KV is in the pool it is computing on
    num_cached_tokens: int = 0         # prompt tokens whose KV it did not compute: its device's cache, or loaded
    cached_from: dict[str, int] = field(default_factory=dict)  # those tokens by source: device, device:<name>,
                                                               # host, disk (the request's log line)
    page_hashes: list[bytes] = field(default_factory=list, repr=False)  # per full page of its tokens, chained
    finished: bool = False  # ended (stop, length, abort or error) and released by whoever held it
    grammar: Any = field(default=None, repr=False)  # structured output: its grammar matcher (the sampler's)
    aborted: bool = False
    generator: Any = field(default=None, repr=False)  # the sampler's per-request RNG, when seeded
    prefill_start: float | None = None  # monotonic times of the phases, for metrics and the timeline
    prefill_end: float | None = None    # the first token is sampled
    decode_start: float | None = None
    predicted_ttft: float | None = None  # SLO admission's prediction, for the prediction-error metric

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Its output limit, as Engine.add_request resolved it (core/sampling_params.resolve_max_tokens)."""
        if self.params.max_tokens is None:
            raise ValueError(f"request {self.request_id}: max_tokens was never resolved (resolve_max_tokens)")
        return self.params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV may ever be needed: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.max_tokens - 1
