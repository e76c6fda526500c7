"""bench/timeline.py's pure parts on synthetic /debug/steps snapshots: step classification, idle filling and
clipping to the window, and busy shares; plus one plot to a temp file."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def T(load_bench):
    return load_bench("timeline")


def _snapshot():
    # server clock: the run starts at 100.0 and the snapshot is taken at 110.0
    return {"now": 110.0,
            "devices": [{"device": "cpu:0", "role": "prefill", "steps": [[101.0, 103.0, 512, 0], [104.0, 105.0, 64, 0]]},
                        {"device": "cpu:1", "role": "decode",
                         "steps": [[99.0, 100.5, 0, 4], [100.5, 101.0, 16, 3], [101.0, 110.0, 0, 8]]}],
            "transfers": [{"name": "kv cpu:0->cpu:1", "copies": [[103.0, 103.5, 1000], [103.2, 103.7, 10], [105.0, 105.1, 5]]}]}


def test_classify(T):
    assert T.classify(128, 0) == "prefill"
    assert T.classify(0, 5) == "decode"
    assert T.classify(7, 5) == "mixed"
    assert T.classify(0, 0) == "idle"


def test_busy_intervals_fill_and_clip(T):
    ivs = T.busy_intervals([(12.0, 13.0, "decode"), (9.0, 11.0, "prefill"), (19.0, 25.0, "decode")], 10.0, 20.0)
    got = [(i.start, i.end, i.kind) for i in ivs]
    # the first span is clipped at the window start, the last at its end; gaps are idle
    assert got == [(0.0, 1.0, "prefill"), (1.0, 2.0, "idle"), (2.0, 3.0, "decode"), (3.0, 9.0, "idle"),
                   (9.0, 10.0, "decode")]


def test_busy_intervals_empty_window_is_idle(T):
    ivs = T.busy_intervals([(0.0, 1.0, "decode")], 5.0, 7.0)
    assert [(i.start, i.end, i.kind) for i in ivs] == [(0.0, 2.0, "idle")]


def test_parse_rows_and_shares(T):
    rows = T.parse(_snapshot(), t0=100.0)
    assert [r.label for r in rows] == ["cpu:0 (prefill)", "cpu:1 (decode)", "kv cpu:0->cpu:1"]
    prefill, decode, transfer = rows
    assert [(i.start, i.end, i.kind) for i in prefill.intervals] == [
        (0.0, 1.0, "idle"), (1.0, 3.0, "prefill"), (3.0, 4.0, "idle"), (4.0, 5.0, "prefill"), (5.0, 10.0, "idle")]
    sh = T.busy_shares(prefill)
    assert sh["busy"] == pytest.approx(0.3) and sh["prefill"] == pytest.approx(0.3)
    sh = T.busy_shares(decode)
    # 0.5 s decode (clipped from 99.0), 0.5 s mixed, 9 s decode: busy the whole 10 s
    assert sh["busy"] == pytest.approx(1.0)
    assert sh["decode"] == pytest.approx(0.95) and sh["mixed"] == pytest.approx(0.05)
    # overlapping copies 103.0-103.5 and 103.2-103.7 count once: 0.7 s + 0.1 s
    assert T.busy_shares(transfer)["busy"] == pytest.approx(0.08)
    assert set(T.summary(rows)) == {r.label for r in rows}


def test_parse_defaults_to_snapshot_now_and_rejects_reversed_window(T):
    rows = T.parse(_snapshot(), t0=105.0)
    assert max(i.end for i in rows[0].intervals) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        T.parse(_snapshot(), t0=120.0)


def test_busy_shares_of_empty_row(T):
    assert T.busy_shares(T.Row("x", [])) == {"busy": 0.0}


def test_plot_writes_png(T, tmp_path):
    path = T.plot(T.parse(_snapshot(), t0=100.0), str(tmp_path / "t.png"), title="synthetic")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_role_spans_follow_the_changes_in_the_window(T):
    snap = {"now": 110.0, "devices": [{"device": "cpu:0", "role": "adaptive", "steps": []},
                                      {"device": "cpu:1", "role": "adaptive", "steps": []}],
            "role_changes": [[102.0, "cpu:0", "prefill", "demand"], [106.0, "cpu:0", "adaptive", "hold"],
                             [120.0, "cpu:0", "prefill", "after the window"]]}
    spans = T.role_spans(snap, 100.0, 110.0)
    # Before its first change cpu:0 held the other role; cpu:1 never changed and keeps the snapshot's.
    assert spans["cpu:0"] == [(0.0, 2.0, "adaptive"), (2.0, 6.0, "prefill"), (6.0, 10.0, "adaptive")]
    assert spans["cpu:1"] == [(0.0, 10.0, "adaptive")]


def test_plot_snapshot_draws_the_role_strips(T, tmp_path):
    snap = dict(_snapshot(), role_changes=[[104.5, "cpu:0", "prefill", "demand"]])
    path = T.plot_snapshot(snap, str(tmp_path / "roles.png"), title="roles")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_step_stats_split_a_devices_steps_by_kind_and_time_the_pauses_between_decodes(T):
    snap = {"now": 10.0, "devices": [{"device": "cpu:1", "role": "decode", "steps": [
        [0.2, 0.3, 0, 4],                      # before the window: left out
        [1.0, 1.05, 0, 4], [1.06, 1.2, 16, 4], [1.25, 1.3, 0, 4], [1.3, 1.4, 100, 0]]}]}
    st = T.step_stats(snap, 0.5)["cpu:1 (decode)"]
    assert st["decode"]["n"] == 2 and abs(st["decode"]["max_ms"] - 50) < 1e-6
    assert st["mixed"]["n"] == 1 and abs(st["mixed"]["p50_ms"] - 140) < 1e-6
    assert st["mixed_prompt_tokens"] == {"n": 1, "p50": 16.0, "p99": 16.0, "max": 16.0}
    # between decoding steps only: 10 ms and 50 ms (the prefill-only step's pause does not count)
    assert st["between_decode_steps"]["n"] == 2 and abs(st["between_decode_steps"]["max_ms"] - 50) < 1e-6
