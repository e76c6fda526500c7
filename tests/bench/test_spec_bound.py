"""bench/spec_bound.py: verify steps priced by their rows, and the oracle that bounds any draft-length policy."""

from __future__ import annotations

import pytest

from nodeserve.config import SpeculativeSection
from nodeserve.core.cost_model import LinearKernels, StepModel


@pytest.fixture(scope="module")
def B(load_bench):
    return load_bench("spec_bound")


def _steps(*groups: tuple[int, int, float]) -> dict:
    """(count, rows, ms) groups of decode-only steps on one device, and one prompt step that must be ignored."""
    steps = [[0.0, 0.5, 100, 0]]
    for count, rows, ms in groups:
        steps += [[0.0, ms / 1e3, 0, rows]] * count
    return {"devices": [{"device": "cpu:1", "steps": steps}]}


def test_prices_come_from_row_counts_seen_often_and_the_line_between_them(B):
    prices = B.row_prices([_steps((5, 1, 4.0), (5, 4, 7.0)), _steps((6, 8, 11.0), (1, 6, 50.0))])
    ms = [round(1e3 * p, 6) for p in prices]
    assert ms[1] == 4.0 and ms[4] == 7.0 and ms[8] == 11.0
    assert ms[2] == 5.0 and ms[6] == 9.0  # a 6-row step seen once is no price
    assert ms[B.MAX_GUESSES + 1] == 11.0 and len(prices) == B.MAX_GUESSES + 2
    with pytest.raises(RuntimeError):
        B.row_prices([_steps((4, 1, 4.0), (5, 4, 7.0))])


def test_the_oracle_wastes_nothing_and_no_fixed_length_or_policy_beats_it(B):
    copied = list(range(100, 140))
    prompt = [1, 2, 3, *copied, 4, 5]
    out = copied[:25] + [7, 8, 9] + copied[25:]  # a copy with an insertion: guesses miss there
    prices = [0.0] + [0.004 + 0.001 * (r - 1) for r in range(1, B.MAX_GUESSES + 2)]
    model = StepModel(coef=[0.003, 0, 0, 0.001, 0, 0, 0], kernels=LinearKernels())
    result = B.bound([(prompt, out)], prices, model, SpeculativeSection())
    ways = result["ways"]
    assert ways["oracle"]["wasted_rows"] == 0 and ways["fixed 15"]["wasted_rows"] > 0
    assert abs(result["plain_decode_s"] - 0.004 * len(out)) < 1e-9
    best = ways["oracle"]["decode_speedup"]
    assert best > 2.0  # most of the output is copied
    assert all(w["decode_speedup"] <= best + 1e-9 for w in ways.values())
    assert ways["policy"]["decode_speedup"] > ways["fixed 1"]["decode_speedup"]
