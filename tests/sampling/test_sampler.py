"""Tests for nodeserve.sampling.sampler: greedy, filters, distribution, seeding, penalties, logprobs."""

import math

import pytest
import torch

from nodeserve.sampling.sampler import Sampler, apply_penalties
from nodeserve.core.sampling_params import SamplingParams

CPU = torch.device("cpu")


def run(sampler, logits, params, prompt_ids=None, output_ids=None, generators=None):
    B = logits.shape[0]
    return sampler(
        logits,
        params,
        prompt_ids if prompt_ids is not None else [[] for _ in range(B)],
        output_ids if output_ids is not None else [[] for _ in range(B)],
        generators if generators is not None else [None] * B,
    )


def draw_many(logits_row, params, n, seed=0):
    """n independent draws from one row's distribution: n copies of the row in one batch."""
    sampler = Sampler(CPU, seed=seed)
    logits = logits_row[None, :].expand(n, -1).contiguous()
    return torch.tensor(run(sampler, logits, [params] * n).token_ids)


# Critical value of chi-square with 4 degrees of freedom at p = 1e-6: the survival function is
# exp(-x/2) * (1 + x/2); a correct sampler fails this one in a million runs.
CHI2_DF4_P1E6 = 33.38


def chi_square(tokens, probs):
    n = len(tokens)
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * n
    return float(((observed - expected) ** 2 / expected).sum())


def test_chi2_critical_value():
    x = CHI2_DF4_P1E6
    assert math.exp(-x / 2) * (1 + x / 2) == pytest.approx(1e-6, rel=0.02)


# ---- greedy ---------------------------------------------------------------------------------------

def test_greedy_fast_path_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    out = run(Sampler(CPU), logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_pick_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    out = run(Sampler(CPU), logits, [SamplingParams(temperature=0.0)] * 2)
    assert out.token_ids == [1, 0]
    # Same answer off the fast path (logprobs requested).
    out = run(Sampler(CPU), logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    assert out.token_ids == [1, 0]


def test_greedy_equals_torch_argmax_with_ties_nans_and_strided_rows():
    from nodeserve.sampling.sampler import greedy

    torch.manual_seed(1)
    logits = torch.randn(16, 49152)
    logits[3, 100] = logits[3, 200] = 1e9  # a tie: the first
    logits[5, 7] = float("nan")             # a NaN wins, as in torch
    logits[6] = float("-inf")
    for x in (logits, logits[::2], logits[:, :1000], logits.t().contiguous().t()):
        assert torch.equal(greedy(x), x.argmax(dim=-1))


def test_greedy_rows_in_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = run(Sampler(CPU, seed=0), logits, params)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_filters_that_collapse_to_greedy(params):
    torch.manual_seed(2)
    logits = torch.randn(256, 300)
    out = run(Sampler(CPU, seed=0), logits, [params] * 256)
    assert out.token_ids == logits.argmax(-1).tolist()


# ---- filters exclude exactly the right tokens -------------------------------------------------------

PROBS = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
LOGITS = PROBS.log()


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.5), {0, 1}),          # 0.30 < 0.5 <= 0.55
    (SamplingParams(top_p=0.6), {0, 1, 2}),       # 0.55 < 0.6 <= 0.75
    (SamplingParams(min_p=0.6), {0, 1, 2}),       # keep p >= 0.18
    (SamplingParams(min_p=0.5), {0, 1, 2, 3}),    # keep p >= 0.15
    (SamplingParams(top_k=3, top_p=0.5), {0, 1}),  # top-p of the top-3 renormalised: 0.4, 0.33, 0.27
    (SamplingParams(top_k=4, min_p=0.6), {0, 1, 2}),
    (SamplingParams(temperature=3.0, top_k=3), {0, 1, 2}),
])
def test_filters_never_sample_excluded_tokens(params, allowed):
    tokens = draw_many(LOGITS, params, 5000)
    assert set(tokens.tolist()) == allowed


# ---- sampled frequencies match the distribution --------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_frequencies_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    expected = (logits / temperature).softmax(-1)
    tokens = draw_many(logits, SamplingParams(temperature=temperature), 20_000)
    assert chi_square(tokens, expected) < CHI2_DF4_P1E6
    # The test can fail: the untempered distribution must be rejected when temperature matters.
    if temperature != 1.0:
        assert chi_square(tokens, logits.softmax(-1)) > CHI2_DF4_P1E6


def test_frequencies_after_top_k_renormalise():
    tokens = draw_many(LOGITS, SamplingParams(top_k=3), 20_000)
    kept = PROBS[:3] / PROBS[:3].sum()
    observed = torch.bincount(tokens, minlength=5)
    assert observed[3:].sum() == 0
    n = len(tokens)
    for i in range(3):
        sigma = math.sqrt(n * kept[i] * (1 - kept[i]))
        assert abs(observed[i] - n * kept[i]) < 5 * sigma


def test_frequencies_with_per_row_generators():
    # The seeded path draws noise row by row; it must give the same distribution.
    n = 5000
    sampler = Sampler(CPU)
    logits = LOGITS[None, :].expand(n, -1).contiguous()
    gens = [sampler.new_generator(1000 + i) for i in range(n)]
    tokens = torch.tensor(run(sampler, logits, [SamplingParams()] * n, generators=gens).token_ids)
    assert chi_square(tokens, PROBS) < CHI2_DF4_P1E6


# ---- seeding -------------------------------------------------------------------------------------

def seeded_sequence(seed, position, batch_size, steps=12, V=1000):
    """Tokens a seeded request gets over `steps` steps when it sits at `position` in a batch of others."""
    sampler = Sampler(CPU)
    target_logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(7))
    other = torch.Generator().manual_seed(1000 + batch_size)
    target = SamplingParams(temperature=1.2, top_k=200, top_p=0.95, seed=seed)
    gen = sampler.new_generator(seed)
    other_gens = [sampler.new_generator(i) if i % 2 else None for i in range(batch_size)]
    tokens = []
    for step in range(steps):
        logits = torch.randn(batch_size, V, generator=other) * 3
        logits[position] = target_logits[step]
        params = [SamplingParams(temperature=0.8, top_p=0.9) for _ in range(batch_size)]
        params[position] = target
        gens = list(other_gens)
        gens[position] = gen
        out = run(sampler, logits, params, generators=gens)
        tokens.append(out.token_ids[position])
    return tokens


def test_same_seed_same_tokens_regardless_of_batch():
    alone = seeded_sequence(seed=1234, position=0, batch_size=1)
    assert seeded_sequence(seed=1234, position=2, batch_size=5) == alone
    assert seeded_sequence(seed=1234, position=6, batch_size=7) == alone


def test_different_seeds_differ():
    assert seeded_sequence(seed=1, position=0, batch_size=3) != seeded_sequence(seed=2, position=0, batch_size=3)


def test_new_generator_none_without_seed():
    assert Sampler(CPU).new_generator(None) is None


# ---- penalties -----------------------------------------------------------------------------------

BASE = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
PROMPT = [[0, 1]]
OUTPUT = [[1, 2, 2]]


def test_repetition_penalty_over_prompt_and_output():
    got = apply_penalties(BASE, [SamplingParams(repetition_penalty=2.0)], PROMPT, OUTPUT)
    expected = torch.tensor([[1.0, -2.0, 0.25, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_over_output_only():
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.3)]
    got = apply_penalties(BASE, params, PROMPT, OUTPUT)
    # token 0 is only in the prompt: untouched. token 1 seen once, token 2 twice.
    expected = torch.tensor([[2.0, -1.0 - 0.5 - 0.3, 0.5 - 1.0 - 0.3, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(got, expected)


def test_all_penalties_combined_repetition_first():
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)]
    got = apply_penalties(BASE, params, PROMPT, OUTPUT)
    expected = torch.tensor([[1.0, -2.0 - 0.8, 0.25 - 1.3, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(got, expected)


def test_penalties_per_row_and_input_untouched():
    logits = BASE.repeat(3, 1)
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(repetition_penalty=0.5)]
    got = apply_penalties(logits, params, [[0, 1], [], [4]], [[1], [3, 3], []])
    torch.testing.assert_close(logits, before)
    torch.testing.assert_close(got[0], BASE[0])
    torch.testing.assert_close(got[1], torch.tensor([2.0, -1.0, 0.5, -1.5, 3.0, 0.0]))
    torch.testing.assert_close(got[2], torch.tensor([2.0, -1.0, 0.5, -0.5, 6.0, 0.0]))


def test_penalties_reach_the_sampler():
    # Reported logprobs are of the penalised logits, so they expose the penalty end to end.
    logits = BASE.clone()
    params = [SamplingParams(temperature=0.0, presence_penalty=10.0, logprobs=6)]
    out = run(Sampler(CPU), logits, params, PROMPT, [[4]])
    torch.testing.assert_close(logits, BASE)
    assert out.token_ids == [0]  # token 4 (the argmax) is pushed down by the presence penalty
    expected = torch.tensor([[2.0, -1.0, 0.5, -0.5, -7.0, 0.0]]).log_softmax(-1)[0]
    got = dict(out.top_logprobs[0])
    for tok in range(6):
        assert got[tok] == pytest.approx(float(expected[tok]), abs=1e-5)


# ---- logprobs ------------------------------------------------------------------------------------

def test_logprobs_and_top_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=1.0),             # didn't ask
        SamplingParams(temperature=1.0, top_k=4, logprobs=0),
    ]
    out = run(Sampler(CPU, seed=0), logits, params)
    torch.testing.assert_close(logits, before)
    # Before temperature and filters: plain log_softmax of the logits.
    ref = logits.log_softmax(-1)
    assert len(out.logprobs) == 4
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [3, 5, 0, 0]
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in top] == ref[i].topk(len(top)).indices.tolist()
        for tok, v in top:
            assert v == pytest.approx(float(ref[i, tok]), abs=1e-6)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy pick is the top logprob


def test_no_logprobs_when_none_asked():
    out = run(Sampler(CPU, seed=0), torch.randn(3, 10), [SamplingParams(top_k=3)] * 3)
    assert out.logprobs is None and out.top_logprobs is None
    assert len(out.token_ids) == 3


def test_sampler_does_not_mutate_logits():
    torch.manual_seed(4)
    logits = torch.randn(4, 32)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                             frequency_penalty=0.2, presence_penalty=0.1)] * 4
    run(Sampler(CPU, seed=0), logits, params, [[1, 2]] * 4, [[3, 3, 4]] * 4)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)


def test_tiny_temperature_and_tiny_repetition_penalty_stay_well_defined():
    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 5
    sampler = Sampler(torch.device("cpu"), seed=0)
    tiny_t = SamplingParams(temperature=5e-324)
    tiny_rep = SamplingParams(temperature=0.0, repetition_penalty=5e-324, logprobs=2)
    out = sampler(logits, [tiny_t, tiny_rep], [[1, 2], [3, 4]], [[], [5]], [None, None])
    assert out.token_ids[0] == int(logits[0].argmax())  # underflowing temperatures mean greedy
    assert all(math.isfinite(lp) for lp in out.logprobs)


def test_request_generator_follows_the_request_across_devices():
    from types import SimpleNamespace

    sampler = Sampler(CPU)
    assert sampler.request_generator(None, None, 0) is None
    own = sampler.new_generator(5)
    assert sampler.request_generator(own, 5, 3) is own  # lives here: keeps drawing from it
    # Drawn on another device (the prefill GPU): a fresh generator here, the same one on every rerun, and not
    # the first token's stream over again.
    elsewhere = SimpleNamespace(device=torch.device("cuda", 1))
    a, b = sampler.request_generator(elsewhere, 5, 1), sampler.request_generator(elsewhere, 5, 1)
    assert a.device == CPU and torch.equal(a.get_state(), b.get_state())
    assert not torch.equal(a.get_state(), sampler.new_generator(5).get_state())
    assert torch.equal(sampler.request_generator(None, 5, 0).get_state(), sampler.new_generator(5).get_state())


# ---- logit_bias and min_tokens ----------------------------------------------------------------------

def test_logit_bias_is_added_per_row_greedy_and_sampled():
    torch.manual_seed(2)
    logits = torch.randn(4, 64)
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}),             # forced
              SamplingParams(temperature=0.0, logit_bias={top[1]: -100.0}),       # banned: the runner-up wins
              SamplingParams(temperature=0.0),                                     # untouched
              SamplingParams(temperature=1.0, seed=0, logit_bias={t: -100.0 for t in range(64) if t != 9})]
    gens = [None, None, None, Sampler(CPU).new_generator(0)]
    out = run(Sampler(CPU), logits, params, generators=gens)
    assert out.token_ids == [7, logits[1].topk(2).indices[1].item(), top[2], 9]
    assert torch.equal(logits, before)  # the caller's logits are never modified
    # The bias is in the reported logprobs, like the penalties: token 7 is near-certain in row 0.
    out = run(Sampler(CPU), logits, [SamplingParams(temperature=0.0, logprobs=1, logit_bias={7: 100.0})] * 1)
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos = 2
    logits = torch.full((4, 10), 0.0)
    logits[:, eos] = 10.0  # EOS is the argmax of every row
    logits[:, 5] = 9.0     # then a stop token id
    logits[:, 8] = 8.0
    sampler = Sampler(CPU, eos_token_ids=frozenset({eos}))
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),   # 2 tokens so far: masked
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),   # 3 tokens so far: free
              SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),      # EOS does not end it: kept
              SamplingParams(temperature=1.0, seed=1, min_tokens=1, stop_token_ids=[5, 10**6])]  # id past vocab
    outputs = [[1, 1], [1, 1, 1], [], []]
    out = run(sampler, logits, params, output_ids=outputs,
              generators=[None, None, None, sampler.new_generator(1)])
    assert out.token_ids[:3] == [8, eos, eos]
    assert out.token_ids[3] not in (eos, 5)
    # A sampled row never draws a masked token however often it draws.
    many = run(sampler, logits[3:].expand(256, -1).contiguous(), [params[3]] * 256, output_ids=[[]] * 256)
    assert not {eos, 5} & set(many.token_ids)
