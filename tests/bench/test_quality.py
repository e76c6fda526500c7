"""bench/quality.py's pure parts: reading generated tokens from either logprobs shape, greedy-prefix length,
the scores and the table, and mapping reference texts back to ids."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def Q(load_bench):
    return load_bench("quality")


class FakeVocab:
    """ids 0..4 -> texts; 'é' is shared by ids 3 and 4 (like lone bytes of a multi-byte character)."""

    _text = {0: "<eos>", 1: " Paris", 2: ".", 3: "\ufffd", 4: "\ufffd"}
    eos_text = "<eos>"
    ids = {"<eos>": 0, " Paris": 1, ".": 2, "\ufffd": None}

    def __call__(self, i):
        return self._text[i]


def test_continuation_legacy_and_chat_shapes(Q):
    v = FakeVocab()
    legacy = {"finish_reason": "length", "logprobs": {"tokens": [" Paris", "."], "token_logprobs": [-0.1, -0.2]}}
    assert Q.continuation(legacy, v) == ([" Paris", "."], False)
    # llama-server's shape: ids win over texts
    chat = {"finish_reason": "stop", "logprobs": {"content": [{"id": 1, "token": "?"}, {"id": 2, "token": "?"}]}}
    assert Q.continuation(chat, v) == ([" Paris", "."], True)
    # an end-of-sequence entry listed last is dropped; the flag says it
    eos = {"finish_reason": "stop", "logprobs": {"tokens": [" Paris", "<eos>"]}}
    assert Q.continuation(eos, v) == ([" Paris"], True)
    assert Q.continuation({"finish_reason": "stop", "logprobs": None}, v) == ([], True)
    assert Q.continuation({"finish_reason": "length", "logprobs": {"content": [{"token": "."}]}}, v) == (["."], False)
    assert Q.with_eos([" Paris"], True) == [" Paris", Q.EOS] and Q.with_eos(["."], False) == ["."]


def test_prefix_len(Q):
    assert Q.prefix_len(["a", "b", "c"], ["a", "b", "c"]) == 3
    assert Q.prefix_len(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert Q.prefix_len(["a", "b", "c"], ["a", "b"]) == 2        # stopped early
    assert Q.prefix_len(["a", Q.EOS], ["a", "b", "c"]) == 1      # went on where the reference stopped
    assert Q.prefix_len([], ["a"]) == 0


def test_score_and_table(Q):
    prompts = [{"kind": "chat"}, {"kind": "raw"}, {"kind": "raw"}]
    refs = [["a", "b", Q.EOS], ["c", "d", "e", "f"], ["g", "h"]]
    greedy = [["a", "b", Q.EOS], ["c", "x", "e", "f"], ["g", "h"]]
    forced = [[True, True, True], [True, False, True, True], [True, True]]
    s = Q.score(prompts, refs, greedy, forced)
    a = s["all"]
    assert a["prompts"] == 3 and a["identical"] == 2
    assert a["greedy_prefix_mean"] == pytest.approx((1 + 0.25 + 1) / 3)
    assert a["greedy_tokens_kept"] == 3 + 1 + 2 and a["reference_tokens"] == 9
    assert (a["forced_matches"], a["forced_positions"]) == (8, 9) and a["forced_top1"] == pytest.approx(8 / 9)
    assert s["chat"]["forced_top1"] == 1.0 and s["raw"]["forced_top1"] == pytest.approx(5 / 6)
    assert s["raw"]["identical"] == 1
    lines = Q.table([("t", "cfg", s)]).splitlines()
    assert lines[2] == "| t | cfg | 75.0 % | 2/3 | 88.9 % (8/9) | 100.0 % / 83.3 % |"
    # the reference scored against itself: everything agrees
    same = Q.score(prompts, refs, refs, [[True] * len(r) for r in refs])["all"]
    assert same["greedy_prefix_mean"] == 1.0 and same["identical"] == 3 and same["forced_top1"] == 1.0


def test_reference_ids_stop_at_an_ambiguous_text(Q):
    v = FakeVocab()
    assert Q.reference_ids(v, [" Paris", "."]) == [1, 2]
    assert Q.reference_ids(v, [" Paris", "\ufffd", "."]) == [1]
    assert Q.reference_ids(v, ["unknown"]) == []


def test_prompt_set_is_fixed(Q):
    kinds = [k for k, _ in Q.PROMPTS]
    assert len(Q.PROMPTS) == 10 and kinds.count("chat") == 5 and kinds.count("raw") == 5
