"""bench/speculative.py's summary of alternating rounds: medians, paired ratios, and which outputs differ."""

from __future__ import annotations

import pytest


def _run(S, rep: float, chat32: float, gap99: float, texts: list[str]) -> dict:
    return {"repetition": {"tok_s": rep, "decode_tok_s": 2 * rep, "tokens": [256] * len(S.REPETITION)},
            "chat_1": {"tok_s": 100.0},
            "chat_32": {"tok_s": chat32, "gap_p50_ms": 30.0, "gap_p99_ms": gap99},
            "spec_counters": {"vllm:spec_decode_num_draft_tokens_total": 10.0},
            "texts": texts}


@pytest.fixture(scope="module")
def S(load_bench):
    return load_bench("speculative")


def test_ratios_are_medians_of_paired_rounds_and_differing_outputs_are_named(S):
    n = len(S.REPETITION) + len(S.CHAT) + 32
    same = [f"t{i}" for i in range(n)]
    other = list(same)
    other[len(S.REPETITION) + len(S.CHAT) + 3] = "changed"  # the 4th answer of the 32-stream burst
    # a slow round (machine drift) hits both servers of it: paired ratios see 2x in every round
    rounds = [{"off": _run(S, 100.0, 500.0, 70.0, same), "prompt_lookup": _run(S, 200.0, 500.0, 80.0, same)},
              {"off": _run(S, 50.0, 400.0, 90.0, same), "prompt_lookup": _run(S, 100.0, 440.0, 60.0, other)},
              {"off": _run(S, 120.0, 600.0, 65.0, same), "prompt_lookup": _run(S, 240.0, 540.0, 75.0, same)}]
    out = S.summarize(rounds, ["prompt_lookup"])
    on = out["prompt_lookup"]
    assert on["speedup"]["repetition_1"] == pytest.approx(2.0)
    assert on["speedup_rounds"]["chat_32"] == pytest.approx([1.0, 1.1, 0.9])
    assert on["speedup"]["chat_32"] == pytest.approx(1.0)
    assert out["off"]["repetition"]["tok_s"] == 100.0 and on["repetition"]["tok_s_rounds"] == [200.0, 100.0, 240.0]
    assert on["chat_32"]["gap_p99_ms"] == 75.0
    assert (on["outputs_identical"], on["outputs"]) == (3 * n - 1, 3 * n)
    assert on["differing"] == [{"round": 1, "part": "chat_32", "index": len(S.REPETITION) + len(S.CHAT) + 3}]
    assert on["spec_counters"]["vllm:spec_decode_num_draft_tokens_total"] == 30.0


def test_another_repetition_set_names_its_differing_outputs_by_its_own_length(S):
    # --repetition with 2 prompts: the third text is the first chat answer
    n = 2 + len(S.CHAT) + 32
    same = [f"t{i}" for i in range(n)]
    other = list(same)
    other[2] = "changed"
    rounds = [{"off": _run(S, 100.0, 500.0, 70.0, same), "prompt_lookup": _run(S, 150.0, 500.0, 70.0, other)}]
    on = S.summarize(rounds, ["prompt_lookup"], num_repetition=2)["prompt_lookup"]
    assert on["differing"] == [{"round": 0, "part": "chat_1", "index": 2}]
    assert (on["outputs_identical"], on["outputs"]) == (n - 1, n)


def test_the_unseen_repetition_set_is_a_list_of_prompts():
    import json
    import pathlib
    prompts = json.loads((pathlib.Path(__file__).resolve().parents[2] / "bench" / "prompts" /
                          "repetition-unseen.json").read_text())
    assert len(prompts) >= 5 and all(isinstance(p, str) and len(p) > 200 for p in prompts)
