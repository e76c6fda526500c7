"""The step and copy logs: a ring of fixed capacity whose memory is taken up front (runtime/records.py)."""

from __future__ import annotations

import threading
import tracemalloc

import pytest

from nodeserve.runtime.records import RecordLog
from nodeserve.runtime.transfer import CopyRecord
from nodeserve.runtime.worker import StepRecord


def _step(i: int) -> StepRecord:
    return StepRecord(float(i), i + 0.5, i % 7, i % 5, 3 * i, i / 4)


def test_it_keeps_the_last_maxlen_records_in_order_with_their_types():
    log = RecordLog(StepRecord, 10)
    assert len(log) == 0 and list(log) == [] and log.since(-1.0) == []
    for i in range(25):
        log.append(_step(i))
    assert len(log) == 10
    assert list(log) == [_step(i) for i in range(15, 25)]
    assert type(log[-1].num_decodes) is int and type(log[-1].prefill_pairs) is float
    assert log[0] == _step(15) and log[-1] == _step(24) and log[-10] == _step(15)
    with pytest.raises(IndexError):
        log[10]
    with pytest.raises(IndexError):
        log[-11]


def test_since_bisects_on_end_and_builds_only_the_page_asked_for():
    log = RecordLog(CopyRecord, 8)
    for i in range(13):
        log.append(CopyRecord(float(i), i + 0.25, 4096 * i))
    assert [c.end for c in log.since(9.0)] == [9.25, 10.25, 11.25, 12.25]
    assert [c.end for c in log.since(9.25)] == [10.25, 11.25, 12.25]  # strictly after: a page never repeats
    assert [c.end for c in log.since(-1.0, limit=3)] == [5.25, 6.25, 7.25]  # the oldest kept is 5
    assert log.since(100.0) == [] and list(log.since(0.0, limit=0)) == []
    assert list(log.since(11.0)[0]) == [11.0, 11.25, 4096 * 11]


def test_its_memory_is_taken_up_front_and_does_not_grow_as_it_fills():
    # The deque of dataclasses this replaced grew ~23 MiB a device over 100,000 steps (an hour of a soak).
    tracemalloc.start()
    try:
        log = RecordLog(StepRecord, 50_000)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(120_000):
            log.append(_step(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert list(log.since(119_998.0)) == [_step(119_998), _step(119_999)]


def test_a_reader_never_sees_a_half_written_record():
    log = RecordLog(StepRecord, 64)
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            log.append(_step(i))
            i += 1
    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(2000):
            for r in log.since(-1.0):
                i = int(r.start)
                assert r == _step(i)
    finally:
        stop.set()
        writer.join()
