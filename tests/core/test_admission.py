"""SLO admission on fake workers and a synthetic profile: reject on a predicted TTFT or TPOT miss or when no seat
is left, admit otherwise, predict even when off, and read a device's load from the router and its step records."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from nodeserve.core.admission import QueueFull, SloAdmission, SloMiss
from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.load import SloTarget, StepLimits
from nodeserve.core.scheduler import Seq
from nodeserve.runtime.loads import prefill_share, snapshot
from nodeserve.runtime.records import RecordLog
from nodeserve.runtime.worker import StepRecord, WorkerLimits
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams

COEF = [0.02, 0.005, 1e-7, 0.004, 2e-6]  # ~5 ms per prompt token


class _Worker(SimpleNamespace):
    __hash__ = object.__hash__  # snapshots group seats per worker object


def _log(records) -> RecordLog:
    log = RecordLog(StepRecord, 1000)
    for r in records:
        log.append(r)
    return log


def worker(name, role, queued=0, records=()):
    return _Worker(name=name, role=role, num_outstanding_prefill_tokens=queued, failure=None,
                   scheduler=SimpleNamespace(running=[], waiting=[]), limits=WorkerLimits(64, 1024, 8192),
                   records=_log(records), kv=SimpleNamespace(num_free=1000, page_size=16))


def loads(queued=0, seated=()):
    """A prefill device with `queued` prompt tokens and a decode device where `seated` requests hold seats, none
    decoding yet, as the runtime snapshots them."""
    p, d = worker("cpu:0", "prefill", queued), worker("cpu:1", "decode")
    return snapshot([p, d], [(d, r) for r in seated], now=0.0)


def request(num_prompt_tokens, max_tokens=16, request_id="r"):
    return Request(request_id, [1000] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens))


COST = CostModel({n: StepModel(coef=list(COEF)) for n in ("cpu:0", "cpu:1")}, {("cpu:0", "cpu:1"): 5e9}, 46080, 30)


def admission(admission="off", ttft_s=2.5, tpot_s=0.1, ttft_per_token_s=0.0, margin=0.25):
    return SloAdmission(SloTarget(ttft_s, tpot_s, ttft_per_token_s), admission == "reject", margin,
                        StepLimits(1024, 64), lambda: COST)


def test_rejects_when_the_predicted_ttft_misses_by_more_than_the_margin():
    adm = admission(admission="reject", ttft_s=2.5, margin=0.25)
    req = request(100)  # ~0.5 s on an idle prefill device: admitted
    adm.check(loads(), req)
    assert 0.4 < req.predicted_ttft < 0.7
    # 1,000 tokens queued ahead: ~5.5 s predicted > 2.5 x 1.25.
    with pytest.raises(SloMiss, match="predicted time to first token") as e:
        adm.check(loads(queued=1000), request(100))
    assert isinstance(e.value, QueueFull) and e.value.reject_reason == "slo"


def test_requests_the_router_still_holds_count_as_work_ahead():
    adm = admission(admission="reject", ttft_s=2.5, margin=0.25)
    adm.check(loads(), request(100), backlog_tokens=100)  # 200 tokens over two devices: still ~1 s
    with pytest.raises(SloMiss):
        adm.check(loads(), request(100), backlog_tokens=2000)


def test_margin_and_per_token_target_loosen_it():
    adm = admission(admission="reject", ttft_s=2.5, margin=1.5)  # 6.25 s: 5.5 s fits
    adm.check(loads(queued=1000), request(100))
    adm = admission(admission="reject", ttft_s=2.5, ttft_per_token_s=0.01, margin=0.0)  # 2.5 + 30 s for 3,000
    adm.check(loads(), request(3000))
    with pytest.raises(SloMiss):
        admission(admission="reject", ttft_s=2.5, margin=0.0).check(loads(), request(3000))


def test_off_predicts_and_never_rejects():
    adm = admission()
    req = request(3000)
    adm.check(loads(queued=100_000), req)
    assert req.predicted_ttft > 100


def test_prefill_share_from_step_records():
    now = 100.0
    recs = [StepRecord(80.0, 85.0, 512, 0),    # before the 10 s window
            StepRecord(89.0, 91.0, 512, 0),    # 1 s of it inside
            StepRecord(91.0, 92.0, 0, 8),      # decode only
            StepRecord(95.0, 98.0, 100, 8)]    # 3 s
    assert prefill_share(_log(recs), now) == pytest.approx(0.4)
    assert prefill_share(_log([]), now) == 0


def test_rejects_when_the_batch_it_joins_would_miss_the_tpot_target():
    # 4 ms a decode row + 2 us a context token: 40 seated 1,000-token requests make a ~0.26 s step.
    adm = admission(admission="reject", ttft_s=2.5, tpot_s=0.1, margin=0.25)
    adm.check(loads(seated=[request(1000, request_id=str(i)) for i in range(5)]), request(100))
    with pytest.raises(SloMiss, match="time per output token"):
        adm.check(loads(seated=[request(1000, request_id=str(i)) for i in range(40)]), request(100))
    admission(tpot_s=0.1).check(loads(seated=[request(1000, request_id=str(i)) for i in range(40)]), request(100))


def test_rejects_at_once_when_no_seat_is_left_and_queues_when_off():
    full = [request(10, request_id=str(i)) for i in range(64)]
    with pytest.raises(SloMiss, match="no device has a decode seat"):
        admission(admission="reject", tpot_s=10.0).check(loads(seated=full), request(10))
    req = request(10)
    admission(tpot_s=10.0).check(loads(seated=full), req)
    assert req.predicted_ttft is None


def test_snapshot_reads_workers():
    a, b = request(50, request_id="a"), request(300, request_id="b")
    a.num_computed_tokens = 50  # prefilled: its next decode row attends these
    p, d = worker("cpu:0", "prefill", 700), worker("cpu:1", "decode")
    d.scheduler.running = [Seq(a, [])]  # "a" decodes; "b" prefills on cpu:0
    p, d = snapshot([p, d], [(d, a), (d, b)], now=0.0)
    assert (p.role, p.queued_prefill_tokens, p.num_decodes) == ("prefill", 700, 0)
    assert (d.role, d.num_decodes, d.decode_context, d.free_seats, d.free_tokens) == ("decode", 1, 50, 62, 16000)
    assert (d.num_incoming, d.incoming_context) == (1, 300)
