"""Speculative decoding end to end on the real model: with prompt lookup on, every request's tokens (and logprobs)
are what they are with it off, greedy or seeded, under penalties, biases, grammars and limits, in both modes; an
abort in the middle of verification leaves no page held; and the pages written by verify steps that a later prompt
finds in the prefix cache hold exactly the KV computing them gives."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from nodeserve.config import config_from_dict
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.runtime.engine import Engine

CODE = '''def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    out.extend(a[i:]); out.extend(b[j:])
    return out
'''
ASKS = [
    "Rewrite this function, renaming `out` to `result`. Reply with the code only.\n\n" + CODE,
    "Repeat this text exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the "
    "lazy dog, the quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
]
MODES = {"disaggregated": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"]},
         "colocated": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]},
         "one device": {"mode": "colocated", "devices": ["cpu:0"]}}


@pytest.fixture(scope="module")
def loaded_auto(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, quantization="auto")


@pytest.fixture(scope="module")
def asks(loaded_auto) -> list[list[int]]:
    tok = loaded_auto.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in ASKS]


def _config(method: str, mode: str = "disaggregated", quantization: str = "auto", draft: str = "", **kv):
    model = {"quantization": quantization, **({"dtype": "float32"} if quantization == "none" else {})}
    return config_from_dict({"model": model, "devices": MODES[mode], "kv": {"memory_gib": 0.25, **kv},
                             "speculative": {"method": method, "adaptive": False, "draft_model": draft}})


def _run(config, loaded, body, draft=None):
    """Starts an engine, runs body(engine), checks every pool is whole again; returns (result, counts of every
    speculating device added up)."""
    async def main():
        engine = Engine(config, loaded, draft=draft)
        engine.start(asyncio.get_running_loop())
        try:
            result = await body(engine)
            for _ in range(200):
                if all(s.whole for s in engine.pool_stats()):
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"KV pages leaked: {engine.pool_stats()}")
            speculators = [w.scheduler.speculator for w in engine.workers if w.scheduler.speculator is not None]
            for sp in speculators:  # a draft model's own pool: every page back too
                kv = getattr(sp.drafter, "kv", None)
                assert kv is None or kv.num_free == kv.num_usable, "draft pages leaked"
            counts = [sp.counts for sp in speculators]
            return result, (sum(c.num_draft_tokens for c in counts), sum(c.num_accepted_tokens for c in counts))
        finally:
            engine.stop()
    return asyncio.run(main())


async def _events(stream) -> list:
    return [ev async for ev in stream]


def _tokens(events) -> tuple[list[int], list, str | None]:
    return ([e.token_id for e in events if e.token_id is not None],
            [(e.logprob, e.top_logprobs) for e in events if e.token_id is not None], events[-1].finish_reason)


def _on_and_off(loaded, prompts, params, mode="disaggregated", quantization="auto", grammar=None):
    async def body(engine):
        results = await asyncio.gather(*(_events(engine.add_request(ids, p, grammar=grammar() if grammar else None))
                                         for ids, p in zip(prompts, params)))
        return [_tokens(r) for r in results]
    on, counts = _run(_config("prompt_lookup", mode, quantization), loaded, body)
    off, none = _run(_config("off", mode, quantization), loaded, body)
    assert none == (0, 0)
    return on, off, counts


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_greedy_tokens_are_the_same_with_speculation(mode, loaded_auto, asks):
    params = [SamplingParams(max_tokens=96, temperature=0.0)] * len(asks)
    on, off, (drafted, accepted) = _on_and_off(loaded_auto, asks, params, mode)
    assert [t for t, _, _ in on] == [t for t, _, _ in off] and [f for _, _, f in on] == [f for _, _, f in off]
    assert 0 < accepted < drafted  # guesses were verified, kept and rejected (rolled back)


@pytest.mark.needs_cpu("avx2", "fma", "f16c")
def test_greedy_with_int8_decode_rows_is_the_same_with_speculation(gguf_path, asks):
    """model.decode_activations = "int8": verify rows round as decode rows do (int8), so speculation still changes
    no token."""
    from nodeserve.kernels import native
    from nodeserve.model.loader import load_model

    loaded = load_model(gguf_path, torch.float32, quantization="auto", decode_activations="int8")
    assert loaded.model.layers[0].mlp.gate_up_proj.decode_flag == native.ACT8
    params = [SamplingParams(max_tokens=64, temperature=0.0)] * len(asks)
    on, off, (drafted, accepted) = _on_and_off(loaded, asks, params)
    assert [t for t, _, _ in on] == [t for t, _, _ in off] and 0 < accepted < drafted


def test_greedy_on_the_exact_path_is_the_same_with_speculation(loaded_fp32, asks):
    params = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)] * 2
    on, off, (drafted, accepted) = _on_and_off(loaded_fp32, asks[:2], params, quantization="none")
    assert [t for t, _, _ in on] == [t for t, _, _ in off] and 0 < accepted < drafted


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(loaded_auto, asks):
    """Each position is sampled from its own logits with the request's generator, drawn only for tokens kept:
    the draws are the very ones decoding makes, so seeded output (and its logprobs) does not change."""
    params = [SamplingParams(max_tokens=80, temperature=t, top_p=0.95, top_k=40, seed=s, logprobs=3)
              for t, s in ((0.3, 1), (0.7, 2), (1.0, 3))]
    on, off, (drafted, accepted) = _on_and_off(loaded_auto, asks, params)
    assert on == off and 0 < accepted < drafted


def test_penalties_bias_min_tokens_and_stop_ids_hold_at_every_guess(loaded_auto, asks):
    tok = loaded_auto.tokenizer
    result_id = tok.encode("result")[0]
    params = [SamplingParams(max_tokens=60, temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.1,
                             presence_penalty=0.1, logit_bias={result_id: 3.0}),
              SamplingParams(max_tokens=60, temperature=0.0, min_tokens=40, stop_token_ids=[tok.encode(" lazy")[0]]),
              SamplingParams(max_tokens=7, temperature=0.0)]
    on, off, (drafted, _) = _on_and_off(loaded_auto, asks, params)
    assert on == off and drafted > 0
    assert len(on[2][0]) <= 7


def test_a_grammar_is_applied_at_every_guess(loaded_auto, smollm2_tokenizer):
    """Extraction to JSON, the output quoting the input: guesses are verified under the grammar's mask, the
    matcher advanced by kept tokens only; the output is the same and valid."""
    from nodeserve.server.structured import Grammars

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "job": {"type": "string"}}, "required": ["name", "city", "job"]}
    grammars = Grammars(smollm2_tokenizer, loaded_auto.config.vocab_size)
    compiled = grammars.compile(("json", "response_format", schema))
    tok = loaded_auto.tokenizer
    text = ('Example: {"name": "Bob Jones", "city": "Paris", "job": "baker"}. In the same form, extract name, city '
            'and job from: Margaret Smith lives in Cambridge and works as a software engineer.')
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    params = [SamplingParams(max_tokens=80, temperature=0.0)]
    on, off, (drafted, accepted) = _on_and_off(loaded_auto, [ids], params, grammar=lambda: grammars.matcher(compiled))
    assert on == off and accepted > 0
    jsonschema.validate(json.loads(tok.decode(on[0][0])), schema)


def test_aborts_in_the_middle_of_verification_leave_no_page(loaded_auto, asks):
    async def body(engine):
        async def cut(ids, after):
            stream = engine.add_request(ids, SamplingParams(max_tokens=120, temperature=0.0))
            n = 0
            async for ev in stream:
                n += ev.token_id is not None
                if n >= after:
                    engine.abort(stream)
                    break
        await asyncio.gather(*(cut(asks[i % len(asks)], after) for i, after in enumerate([1, 3, 5, 9, 17, 30, 2, 4])))
    _, (drafted, _) = _run(_config("prompt_lookup"), loaded_auto, body)
    assert drafted > 0


def test_cached_pages_written_by_verify_steps_hold_the_right_kv(loaded_auto, asks):
    """A second prompt that is the first one plus its answer finds the pages verify steps wrote (rejected
    guesses' K/V went to slots past the kept tokens, rewritten before their page was published): its greedy
    continuation equals the one an engine without speculation or a cache computes."""
    async def twice(engine):
        first = _tokens(await _events(engine.add_request(asks[0], SamplingParams(max_tokens=80, temperature=0.0))))
        follow = asks[0] + first[0]
        stream = engine.add_request(follow, SamplingParams(max_tokens=24, temperature=0.0))
        second = await _events(stream)
        # its cached prefix runs past the first prompt, into pages the verify steps wrote
        assert stream.request.num_cached_tokens >= len(asks[0]) + 32
        return follow, _tokens(second)[0]

    (follow, cached), (drafted, _) = _run(_config("prompt_lookup", "one device"), loaded_auto, twice)
    assert drafted > 0

    async def fresh(engine):
        return _tokens(await _events(engine.add_request(follow, SamplingParams(max_tokens=24, temperature=0.0))))[0]
    computed, _ = _run(_config("off", "one device", prefix_cache=False), loaded_auto, fresh)
    assert cached == computed


def test_a_draft_model_gives_the_same_tokens_and_its_pages_back(loaded_auto, asks):
    """The served model as its own draft (SmolLM2-135M has no smaller sibling here): guesses are mostly right, the
    outputs the same as without speculation, and the draft's pool whole again after finished and aborted ones."""
    from nodeserve.speculative.draft_model import load_draft

    cfg = _config("draft", draft="smollm2-135m-instruct")
    draft = load_draft(cfg, loaded_auto)
    params = [SamplingParams(max_tokens=48, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.8, seed=5),
              SamplingParams(max_tokens=48, temperature=0.0)]

    async def body(engine):
        streams = [engine.add_request(ids, p) for ids, p in zip(asks, params)]
        cut = engine.add_request(asks[0], SamplingParams(max_tokens=100, temperature=0.0))
        results = [await _events(s) for s in streams]
        async for ev in cut:
            engine.abort(cut)
            break
        return [_tokens(r) for r in results]
    on, (drafted, accepted) = _run(cfg, loaded_auto, body, draft)
    off, _ = _run(_config("off"), loaded_auto, body)
    assert on == off and accepted > drafted / 2


def test_a_draft_model_with_another_tokenizer_is_refused(loaded_auto):
    from nodeserve.config import ConfigError
    from nodeserve.speculative.draft_model import load_draft

    with pytest.raises(ConfigError, match="tokenizer"):
        load_draft(_config("draft", draft="gemma-3-270m"), loaded_auto)
