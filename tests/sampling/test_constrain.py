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

    def is_finished(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        time.sleep(self.seconds)

    def consume_token(self, token: int) -> bool:
        return True


def test_a_fill_over_its_budget_is_reported_for_its_row_only(grammars):
    compiled = grammars.compile(("json", "response_format", SCHEMA))
    logits = torch.randn(3, 49152)
    _, slow = apply_grammar_masks(logits, [grammars.matcher(compiled), _SlowMatcher(0.05), None], budget_s=0.02)
    assert list(slow) == [1] and slow[1] >= 0.05


def _random_walks(grammars, tok, schema, seed, num_rows=4, max_steps=200, bias=None):
    """Samples num_rows outputs from random logits (plus `bias`, [V], if given) under the schema's grammar: half at
    temperature 1, half greedy; each row's tokens."""
    compiled = grammars.compile(("json", "response_format", schema))
    sampler = Sampler(torch.device("cpu"), seed=seed, eos_token_ids=tok.eos_token_ids)
    matchers = [grammars.matcher(compiled) for _ in range(num_rows)]
    outputs: list[list[int]] = [[] for _ in matchers]
    half = num_rows // 2
    params = [SamplingParams(temperature=1.0)] * half + [SamplingParams(temperature=0.0)] * (num_rows - half)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        live = [i for i, o in enumerate(outputs) if not (o and o[-1] in tok.eos_token_ids)]
        if not live:
            break
        logits = torch.randn(len(live), 49152, generator=gen) * 5
        if bias is not None:
            logits += bias
        out = sampler(logits, [params[i] for i in live], [[1]] * len(live), [outputs[i] for i in live],
                      [None] * len(live), [matchers[i] for i in live])
        for i, t in zip(live, out.token_ids):
            outputs[i].append(t)
    assert all(not m.ll.is_error() for m in matchers)
    return outputs


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_give_valid_json(grammars, smollm2_tokenizer, seed):
    tok = smollm2_tokenizer
    for o in _random_walks(grammars, tok, SCHEMA, seed):
        assert o[-1] in tok.eos_token_ids, "the grammar ended every row with a stop token"
        jsonschema.validate(json.loads(tok.decode(o)), SCHEMA)


def test_the_schema_xgrammar_took_over_30_s_for_compiles_at_once_and_holds(grammars, smollm2_tokenizer):
    """8 required strings with distinct maxLength 1017..1024 (under 500 bytes, within every limit): xgrammar compiled
    each bound apart and took over 30 s (past the 10 s cap, holding the only compile thread: with 8 such requests
    queued, everyone got 503s). llguidance compiles it in milliseconds; random logits under it give valid JSON, and
    at a string's bound only the closing quote is allowed."""
    tok = smollm2_tokenizer
    hostile = {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 1017 + i} for i in range(8)},
               "required": [f"s{i}" for i in range(8)]}
    fresh = Grammars(tok, 49152)
    fresh.ll_tokenizer()  # the vocabulary, once per server
    start = time.perf_counter()
    compiled = fresh.compile(("json", "response_format", hostile))
    took = time.perf_counter() - start
    assert took < 2.0, f"compiling took {took:.2f} s"
    # Random logits almost never close a string (a few of 49152 tokens hold a quote): tokens with a quote get a
    # bonus, so rows end within a few hundred steps; each one is then valid JSON for the schema.
    vocab = tok.token_bytes()
    bias = torch.tensor([18.0 if b'"' in b else 0.0 for b in vocab])
    for o in _random_walks(fresh, tok, hostile, seed=0, max_steps=400, bias=bias):
        assert o[-1] in tok.eos_token_ids, "the grammar ended every row with a stop token"
        jsonschema.validate(json.loads(tok.decode(o)), hostile)
    # At a string's bound the mask allows only its closing quote; one character past it is refused.
    m = fresh.matcher(compiled)
    assert m.ll.consume_tokens(tok.encode('{"s0": "' + "x" * 1017, add_bos=False))
    masked, _ = apply_grammar_masks(torch.zeros(1, 49152), [m])
    allowed = (masked[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all(vocab[t].startswith(b'"') for t in allowed)
    instance = {f"s{i}": "x" * (1017 + i) if i % 2 else "hello, world" for i in range(8)}
    for value, ok in ((instance, True), ({**instance, "s0": "x" * 1018}, False)):
        m = fresh.matcher(compiled)
        text = json.dumps(value)
        assert (m.ll.consume_tokens(tok.encode(text, add_bos=False)) and m.ll.is_accepting()) == ok


def test_warm_masks_applies_a_real_mask_on_the_device():
    from nodeserve.sampling.constrain import warm_masks

    warm_masks(torch.device("cpu"), 49152)  # raises if the kernel's result were wrong


def test_warmup_checks_the_mask_on_a_gpu_and_survives_its_failure(monkeypatch, caplog):
    from types import SimpleNamespace

    from nodeserve.kv.manager import KVManager
    from nodeserve.runtime import warmup

    kv = KVManager(4, 16)
    calls = []
    runner = SimpleNamespace(device=torch.device("cuda", 0), pool=SimpleNamespace(manager=kv, window=None), graphs=None,
                             run=lambda chunks: None, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=7)))
    monkeypatch.setattr(warmup.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(warmup.torch.cuda, "synchronize", lambda d: None)
    monkeypatch.setattr(warmup, "warm_masks", lambda device, vocab: calls.append((device, vocab)))
    warmup.warmup_runner(runner)
    assert calls == [(torch.device("cuda", 0), 7)] and kv.num_used == 0  # its scratch pages came back

    def broken(device, vocab):
        raise RuntimeError("no device")
    monkeypatch.setattr(warmup, "warm_masks", broken)
    warmup.warmup_runner(runner)  # logs, does not fail the start
    assert any("grammar mask" in r.getMessage() for r in caplog.records)
