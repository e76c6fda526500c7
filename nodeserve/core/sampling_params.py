"""SamplingParams: what a request asks of the sampler and of the stop checks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings. Validated by the API layer before they get here.

    temperature < 1e-5 (0 in practice) means greedy. top_k <= 0 and top_p == 1.0 and min_p == 0.0 disable those filters.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob plus top-k alternatives
    min_tokens: int = 0          # EOS (unless ignore_eos) and stop_token_ids are not sampled before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, before sampling

    @property
    def greedy(self) -> bool:
        # As in vLLM: temperatures this small underflow logits / T in float32, so they mean greedy.
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
