"""speculative/prompt_lookup.py: the longest tail n-gram's latest earlier occurrence, updated as tokens arrive."""

from __future__ import annotations

import pytest

from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.core.speculation import SeqSpeculation
from nodeserve.speculative.prompt_lookup import NgramIndex, PromptLookup


def test_the_longest_match_wins_then_the_latest_occurrence():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    assert index.propose(2) == [9, 2]      # (1, 2, 3) last occurred at the start: 9 followed it
    index = NgramIndex(1, 3)
    index.extend([5, 2, 3, 8, 6, 2, 3, 4, 0, 2, 3])
    assert index.propose(3) == [4, 0, 2]   # no 3-gram; (2, 3) twice: the later one, followed by 4


def test_no_match_below_min_n_and_the_tail_never_matches_itself():
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == []          # (3, 4) only at the tail
    index.extend([7, 3, 4])
    assert index.propose(4) == [7, 3, 4]   # now it occurred before, the guesses may run into the tail
    assert index.propose(0) == []


def test_extending_token_by_token_gives_what_one_extend_gives():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    whole, steps = NgramIndex(2, 3), NgramIndex(2, 3)
    for n in range(1, len(tokens) + 1):
        steps.extend(tokens[n - 1:n])
        whole = NgramIndex(2, 3)
        whole.extend(tokens[:n])
        assert steps.propose(5) == whole.propose(5)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_the_drafter_indexes_prompt_then_output_and_respects_each_cap():
    req = Request("r", [10, 11, 12, 13, 10, 11], SamplingParams(max_tokens=8))
    state = SeqSpeculation()
    lookup = PromptLookup(2, 3)
    assert lookup.propose([state], [req], [3]) == [[12, 13, 10]]
    req.output_ids += [12, 13]
    assert lookup.propose([state], [req], [2]) == [[10, 11]]  # (11, 12, 13) -> 10, 11
    assert lookup.propose([SeqSpeculation()], [req], [0]) == [[]]
