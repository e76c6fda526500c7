"""sampling/constrain.py and the sampler with grammars: one batched mask, only constrained rows change, and random
logits under a JSON-schema grammar still give schema-valid JSON."""

from __future__ import annotations

import time

import json

import jsonschema
import pytest
import torch

from nodeserve.sampling.constrain import apply_grammar_masks
from nodeserve.sampling.sampler import Sampler
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.server.structured import Grammars

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb"]}},
          "required": ["name", "ok", "kind"]}


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    return Grammars(smollm2_tokenizer, 49152)


def test_only_constrained_rows_are_masked(grammars, smollm2_tokenizer):
    compiled = grammars.compile(("json", "response_format", SCHEMA))
    logits = torch.randn(3, 49152)
    masked, slow = apply_grammar_masks(logits, [None, grammars.matcher(compiled), None])
    assert slow == {} and masked is not logits and torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = (masked[1] > float("-inf")).nonzero().flatten().tolist()
    vocab = smollm2_tokenizer.token_bytes()
    assert allowed and all(vocab[t].startswith(b"{") for t in allowed)  # a JSON object opens with {
    assert apply_grammar_masks(logits, [None, None, None]) == (logits, {})


class _SlowMatcher:
    """A matcher whose fill takes `seconds` (a pathological grammar) and allows every token."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        time.sleep(self.seconds)

    def accept_token(self, token: int) -> bool:
        return True


def test_a_fill_over_its_budget_is_reported_for_its_row_only(grammars):
    compiled = grammars.compile(("json", "response_format", SCHEMA))
    logits = torch.randn(3, 49152)
    _, slow = apply_grammar_masks(logits, [grammars.matcher(compiled), _SlowMatcher(0.05), None], budget_s=0.02)
    assert list(slow) == [1] and slow[1] >= 0.05


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_give_valid_json(grammars, smollm2_tokenizer, seed):
    tok = smollm2_tokenizer
    compiled = grammars.compile(("json", "response_format", SCHEMA))
    sampler = Sampler(torch.device("cpu"), seed=seed, eos_token_ids=tok.eos_token_ids)
    matchers = [grammars.matcher(compiled) for _ in range(4)]
    outputs: list[list[int]] = [[] for _ in matchers]
    params = [SamplingParams(temperature=1.0)] * 2 + [SamplingParams(temperature=0.0)] * 2
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        live = [i for i, o in enumerate(outputs) if not (o and o[-1] in tok.eos_token_ids)]
        if not live:
            break
        logits = torch.randn(len(live), 49152, generator=gen) * 5
        out = sampler(logits, [params[i] for i in live], [[1]] * len(live), [outputs[i] for i in live],
                      [None] * len(live), [matchers[i] for i in live])
        for i, t in zip(live, out.token_ids):
            outputs[i].append(t)
    for o in outputs:
        assert o[-1] in tok.eos_token_ids, "the grammar ended every row with a stop token"
        jsonschema.validate(json.loads(tok.decode(o)), SCHEMA)


def test_warm_masks_applies_a_real_mask_on_the_device():
    from nodeserve.sampling.constrain import warm_masks

    warm_masks(torch.device("cpu"), 49152)  # raises if the kernel's result were wrong


def test_warmup_builds_the_mask_kernel_on_a_gpu_and_survives_its_failure(monkeypatch, caplog):
    from types import SimpleNamespace

    from nodeserve.runtime import warmup

    class Kv:
        def pages_for(self, n):
            return 1

        def borrow(self, n):
            import contextlib
            return contextlib.nullcontext([0])
    calls = []
    runner = SimpleNamespace(device=torch.device("cuda", 0), pool=SimpleNamespace(manager=Kv()), graphs=None,
                             run=lambda chunks: None, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=7)))
    monkeypatch.setattr(warmup.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(warmup.torch.cuda, "synchronize", lambda d: None)
    monkeypatch.setattr(warmup, "warm_masks", lambda device, vocab: calls.append((device, vocab)))
    warmup.warmup_runner(runner)
    assert calls == [(torch.device("cuda", 0), 7)]

    def broken(device, vocab):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(warmup, "warm_masks", broken)
    warmup.warmup_runner(runner)  # logs, does not fail the start
    assert any("grammar mask kernel" in r.getMessage() for r in caplog.records)
