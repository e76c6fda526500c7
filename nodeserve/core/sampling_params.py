"""SamplingParams: what a request asks of the sampler and of the stop checks; resolve_max_tokens: how many tokens
it may generate."""

from __future__ import annotations

from dataclasses import dataclass, field

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as in OpenAI and vLLM


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. Validated by the API layer before they get here. Frozen: a change is a new
    object (dataclasses.replace), so no holder sees another's edit.

    temperature < 1e-5 (0 in practice) means greedy. top_k <= 0 and top_p == 1.0 and min_p == 0.0 disable those filters.
    """

    max_tokens: int | None = None  # None: the client gave none; Engine.add_request resolves it (resolve_max_tokens)
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


def resolve_max_tokens(requested: int | None, *, route_default: int | None, server_limit: int, context_len: int,
                       max_kv_tokens: int, num_prompt_tokens: int) -> int:
    """The one rule for a request's max_tokens, applied once, when the engine admits it:

        min(requested, or else the route's default, or else the server limit;
            the server limit;
            min(context_len, max_kv_tokens + 1) - num_prompt_tokens),  and at least 1.

    - requested: the client's max_tokens (chat: max_completion_tokens wins over it), None when it gave none.
    - route_default: /v1/completions COMPLETION_MAX_TOKENS (16), /v1/chat/completions server.default_max_tokens;
      None (a direct engine caller): as many as fit.
    - server_limit: server.max_tokens_limit. A client value above it never gets here (the API layer answers 400);
      it caps a default that is larger.
    - context minus prompt: generation stops with "length" at the context (prompt + output <= context_len) and at
      what a decode pool can ever hold (max_kv_tokens; the last sampled token is never fed back, so it needs no
      KV: + 1). A request without max_tokens runs to there instead of getting a 400 about a value it never sent.
    - at least 1: a prompt that leaves no room in the pool is then refused by the router naming the prompt
      (TooLarge); one that fills the context was already refused (PromptTooLong).
    """
    if requested is None:
        requested = server_limit if route_default is None else route_default
    room = min(context_len, max_kv_tokens + 1) - num_prompt_tokens
    return max(1, min(requested, server_limit, room))
