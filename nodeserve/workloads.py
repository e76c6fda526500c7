"""Seedable workloads and arrival patterns for the load generator (bench/serve.py) and the simulator behind
`nodeserve plan` (plan/simulate.py). Pure: no I/O.

A workload is a list of `Request`s (prompt, max_tokens, kind). Prompts are either token ids drawn uniformly
from a vocabulary range (`mode="ids"`, the default: exact lengths, no tokenizer needed; the server's
`/v1/completions` accepts a list of ids as the prompt) or text (`mode="text"`: words drawn from a fixed list,
one word per target token; for a BPE tokenizer like SmolLM2's, common short English words with a leading
space are about one token each, so text lengths are approximate).

Workloads (lengths are inclusive ranges, drawn uniformly):

- ``bimodal``: chat. A share `long_share` (default 0.2; the issue asks for 10–30 %) of the requests get a
  1,500–3,000-token prompt, the rest 50–200 tokens; outputs 32–256 tokens. The long share is exact:
  round(long_share * n) requests are long, at seeded random positions.
- ``summarization``: prompts 1,500–3,000 tokens, outputs 32–96.
- ``agent``: an agent loop's many small calls: prompts 50–300 tokens, outputs 16–64.
- ``short``: uniform short chat, bimodal's short requests alone: prompts 50–200 tokens, outputs 32–256.
- ``multiturn``: chat conversations (`multi_turn`) for prefix-cache work: 2–6 turns each; turn 0's prompt is
  100–400 tokens (system prompt and first user message), and turn t's prompt is turn t-1's prompt + turn t-1's
  answer + a new user message of 20–150 tokens; answers (max_tokens) 32–256. The answer inside the next
  prompt is a seeded stand-in of the previous turn's length, not what the server said, so the workload is
  fixed and the same for every server: a prefix cache can reuse each turn's whole previous prompt, not the
  answer. Requests carry `conversation` and `turn`; bench/serve.py sends a conversation's turns in order,
  each after the previous one ended. `num_requests` counts turns (the last conversation may be cut short).

The same seed gives the same requests, whatever the arrival pattern or rate.

Arrivals (`arrival_times`): ``poisson`` at `rate` req/s (exponential gaps; the first request at t=0; the
gaps are unit exponentials from the seed divided by the rate, so two rates with the same seed give the same
pattern, scaled), ``burst`` (every request at t=0). Fixed concurrency has no schedule: N clients each send
their next request as soon as the previous one ends (bench/serve.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Token ids drawn from [VOCAB_LO, VOCAB_HI): clear of the special / byte tokens at the bottom of most
# vocabularies and inside SmolLM2's 49,152.
VOCAB_LO, VOCAB_HI = 1000, 40000

WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "that", "this",
         "it", "are", "was", "be", "or", "an", "not", "we", "can", "all", "one", "new", "more", "time", "day",
         "data", "work", "water", "city", "house", "light", "world", "music", "paper", "river", "stone",
         "market", "system", "report", "number", "school", "table", "window", "garden", "signal", "energy")


@dataclass(frozen=True)
class Spec:
    """Length ranges (inclusive) of one workload."""

    prompt: tuple[int, int]
    output: tuple[int, int]
    long_prompt: tuple[int, int] | None = None  # bimodal only
    long_share: float = 0.0


WORKLOADS: dict[str, Spec] = {
    "bimodal": Spec(prompt=(50, 200), output=(32, 256), long_prompt=(1500, 3000), long_share=0.2),
    "summarization": Spec(prompt=(1500, 3000), output=(32, 96)),
    "agent": Spec(prompt=(50, 300), output=(16, 64)),
    "short": Spec(prompt=(50, 200), output=(32, 256)),
}


@dataclass(frozen=True)
class MultiTurnSpec:
    """Length ranges (inclusive) of the multi-turn chat workload."""

    first: tuple[int, int] = (100, 400)   # turn 0's prompt: system prompt + first user message
    user: tuple[int, int] = (20, 150)     # each later user message
    output: tuple[int, int] = (32, 256)   # each answer (max_tokens)
    turns: tuple[int, int] = (2, 6)       # turns per conversation


MULTITURN = MultiTurnSpec()
WORKLOAD_NAMES = (*WORKLOADS, "multiturn")


@dataclass
class Request:
    prompt: list[int] | str
    prompt_len: int      # target prompt length in tokens (exact for ids, approximate for text)
    max_tokens: int
    kind: str            # "short" | "long" (bimodal), else the workload name
    conversation: int | None = None  # multiturn: the conversation and the turn in it (from 0)
    turn: int | None = None


def make_prompt(rng: random.Random, n: int, mode: str = "ids", vocab: tuple[int, int] = (VOCAB_LO, VOCAB_HI)
                ) -> list[int] | str:
    if mode == "ids":
        return [rng.randrange(vocab[0], vocab[1]) for _ in range(n)]
    if mode == "text":
        return " ".join(rng.choice(WORDS) for _ in range(n))
    raise ValueError(f"unknown prompt mode {mode!r} (ids | text)")


def generate(workload: str | Spec, num_requests: int, seed: int = 0, mode: str = "ids",
             long_share: float | None = None, vocab: tuple[int, int] = (VOCAB_LO, VOCAB_HI)) -> list[Request]:
    """`num_requests` requests of `workload` (a name, or a Spec of one's own: kind "custom"), deterministic in
    `seed`."""
    if isinstance(workload, Spec):
        return _from_spec(workload, "custom", num_requests, seed, mode, long_share, vocab)
    if workload not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOAD_NAMES)}")
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not 0 <= vocab[0] < vocab[1]:
        raise ValueError(f"bad vocab range {vocab}")
    if workload == "multiturn":
        if long_share is not None:
            raise ValueError("--long-share applies to the bimodal workload only, not 'multiturn'")
        out: list[Request] = []
        conv = 0
        while len(out) < num_requests:
            out += multi_turn(1, seed, mode, vocab, first_conversation=conv)
            conv += 1
        return out[:num_requests]
    return _from_spec(WORKLOADS[workload], workload, num_requests, seed, mode, long_share, vocab)


def _from_spec(spec: Spec, workload: str, num_requests: int, seed: int, mode: str, long_share: float | None,
               vocab: tuple[int, int]) -> list[Request]:
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    share = spec.long_share if long_share is None else long_share
    if spec.long_prompt is None and long_share is not None:
        raise ValueError(f"--long-share applies to the bimodal workload only, not {workload!r}")
    if not 0 <= share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {share}")
    rng = random.Random(seed)
    num_long = round(share * num_requests) if spec.long_prompt is not None else 0
    long_idx = set(rng.sample(range(num_requests), num_long))
    out = []
    for i in range(num_requests):
        is_long = i in long_idx
        lo, hi = spec.long_prompt if is_long else spec.prompt
        n = rng.randint(lo, hi)
        max_tokens = rng.randint(*spec.output)
        kind = ("long" if is_long else "short") if spec.long_prompt is not None else workload
        out.append(Request(make_prompt(rng, n, mode, vocab), n, max_tokens, kind))
    return out


def multi_turn(num_conversations: int, seed: int = 0, mode: str = "ids",
               vocab: tuple[int, int] = (VOCAB_LO, VOCAB_HI), spec: MultiTurnSpec = MULTITURN,
               first_conversation: int = 0) -> list[Request]:
    """Conversations first_conversation .. first_conversation + num_conversations - 1, turns in order.

    Each conversation has its own seed (from `seed` and its number), so conversation k is the same whichever
    slice of conversations is asked for.
    """
    if num_conversations < 0:
        raise ValueError("num_conversations must be >= 0")
    out = []
    for c in range(first_conversation, first_conversation + num_conversations):
        rng = random.Random(f"multiturn-{seed}-{c}")
        num_turns = rng.randint(*spec.turns)
        prompt = make_prompt(rng, rng.randint(*spec.first), mode, vocab)
        answer: list[int] | str = []
        for t in range(num_turns):
            if t:
                user = make_prompt(rng, rng.randint(*spec.user), mode, vocab)
                prompt = prompt + answer + user if mode == "ids" else " ".join((prompt, answer, user))
            max_tokens = rng.randint(*spec.output)
            n = len(prompt) if mode == "ids" else len(prompt.split())
            out.append(Request(prompt, n, max_tokens, "multiturn", c, t))
            answer = make_prompt(rng, max_tokens, mode, vocab)  # stands in for what the server answers
    return out


def arrival_times(pattern: str, num_requests: int, rate: float | None = None, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start, non-decreasing, for "poisson" (needs rate > 0) or "burst"."""
    if pattern == "burst":
        return [0.0] * num_requests
    if pattern != "poisson":
        raise ValueError(f"unknown arrival pattern {pattern!r} (poisson | burst)")
    if rate is None or rate <= 0:
        raise ValueError("poisson arrivals need rate > 0")
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for i in range(num_requests):
        if i:
            t += rng.expovariate(1.0) / rate
        out.append(t)
    return out
