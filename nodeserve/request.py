"""Request: one generation as the engine tracks it, and TokenEvent: what its stream receives after each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from nodeserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nodeserve.engine.worker import Worker


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
    transfer, then a decode worker), and only the holder frees its pages. An abort only sets `aborted`;
    the holder sees it at its next step and frees everything it holds, on both devices."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None] = field(repr=False, default=lambda ev: None)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0       # tokens of this request whose KV is in the pool it is computing on
    decode_worker: Worker | None = field(default=None, repr=False)
    prefill_worker: Worker | None = field(default=None, repr=False)  # None: prefilled on the decode worker
    pages: list[int] = field(default_factory=list)          # decode pool pages, reserved at admission
    prefill_pages: list[int] = field(default_factory=list)  # prefill pool pages while prefilling elsewhere
    generator: Any = field(default=None, repr=False)
    grammar: Any = field(default=None, repr=False)  # structured output: this choice's grammar matcher (the sampler's)
    aborted: bool = False
    finished: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV may ever be needed: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def prefill_elsewhere(self) -> bool:
        return self.prefill_worker is not None and self.prefill_worker is not self.decode_worker
