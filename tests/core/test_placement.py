"""Placement on a synthetic profile: colocated-like under uniform short load, a dedicated prefill device for long
prompts, roles respected, and predictions that follow the cost model by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodeserve.core.cost_model import CostModel, StepModel, StepShape
from nodeserve.core.placement import (DeviceLoad, SloTarget, StepLimits, candidates, choose_placement,
                                          prefill_steps, predict)

COEF = [0.02, 0.005, 1e-7, 0.004, 2e-6]  # a CPU core: ~5 ms per prompt token, ~4 ms per decode row
LIMITS = StepLimits(max_num_batched_tokens=1024, max_num_seqs=64)
SLO = SloTarget(ttft_s=2.5, tpot_s=0.1, ttft_per_token_s=0.01)


def cost(names=("d0", "d1")) -> CostModel:
    return CostModel({n: StepModel(coef=list(COEF)) for n in names},
                     {(a, b): 5e9 for a in names for b in names if a != b}, kv_bytes_per_token=46080, num_layers=30)


def load(name, role="adaptive", queued=0, decodes=0, context_each=300, prefill_share=0.0):
    return DeviceLoad(name, role, queued, decodes, decodes * context_each, LIMITS.max_num_seqs - decodes,
                      prefill_share)


def test_prefill_steps_by_hand():
    # 1,500 queued tokens then 600 of ours, budget 1024 - 2 decodes = 1022 a step: 1022 + 478 | 600 (own, from 0).
    d = load("d0", queued=1500, decodes=2, context_each=100)
    seconds, steps, longest = prefill_steps(cost(), d, LIMITS, 600)
    dec = [100.0, 100.0]
    want = [StepShape.of([(1022, 0)], dec), StepShape.of([(478, 0)], dec), StepShape.of([(600, 0)], dec)]
    t = [cost().step_time("d0", s) for s in want]
    assert steps == 3 and seconds == pytest.approx(sum(t)) and longest == pytest.approx(max(t))


def test_uniform_short_load_prefills_on_the_decode_device():
    loads = [load("d0", queued=100, decodes=8, prefill_share=0.2), load("d1", queued=100, decodes=8, prefill_share=0.2)]
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=120, max_tokens=128)
    assert pl.prefill == pl.decode  # no handoff to pay for
    assert pl.transfer == 0 and pl.num_misses(SLO, 120) == 0


def test_idle_decode_device_is_still_used_for_short_prompts():
    # One device busy decoding, the other idle: the short prompt goes to the idle one, prefill and decode both.
    loads = [load("d0", decodes=30), load("d1")]
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=100, max_tokens=64)
    assert (pl.prefill, pl.decode) == ("d1", "d1")


def test_long_prompt_goes_to_a_dedicated_prefill_device():
    # d0 has been prefilling long prompts (90 % of its time) and decodes nothing; d1 holds the decode batch.
    loads = [load("d0", queued=2500, prefill_share=0.9), load("d1", decodes=12)]
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=2800, max_tokens=128)
    assert (pl.prefill, pl.decode) == ("d0", "d1")
    assert pl.transfer > 0
    # The same prompt prefilled on d1 would stall its 12 decodes: predicted, and why it was not chosen.
    on_d1 = predict(cost(), LIMITS, {x.name: x for x in loads}, "d1", "d1", 2800, 128)
    assert on_d1.others_tpot > SLO.tpot_s and on_d1.num_misses(SLO, 2800) >= 12


def test_a_prompt_mostly_cached_on_a_device_is_predicted_and_placed_by_what_is_left_to_compute():
    # The same long prompt, but d1's prefix cache holds all of it except its last turn: 100 tokens to compute there.
    loads = [load("d0", queued=2500, prefill_share=0.9), replace(load("d1", decodes=12), cached_tokens=2700)]
    by_name = {x.name: x for x in loads}
    on_d1 = predict(cost(), LIMITS, by_name, "d1", "d1", 2800, 128)
    assert on_d1.ttft == pytest.approx(prefill_steps(cost(), loads[1], LIMITS, 2800, 2700)[0])
    assert on_d1.ttft < predict(cost(), LIMITS, {**by_name, "d1": load("d1", decodes=12)}, "d1", "d1", 2800, 128).ttft / 10
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=2800, max_tokens=128)
    assert (pl.prefill, pl.decode) == ("d1", "d1") and pl.num_misses(SLO, 2800) == 0
    # a cache on the device that does not prefill it saves nothing: d0 prefills all of it for d1
    d0_cached = [load("d0", queued=2500, prefill_share=0.9), load("d1", decodes=12)]
    assert predict(cost(), LIMITS, {x.name: x for x in d0_cached}, "d0", "d1", 2800, 128).ttft == pytest.approx(
        prefill_steps(cost(), d0_cached[0], LIMITS, 2800)[0])


def test_long_prompt_stalls_the_fewest_decodes():
    loads = [load("d0", queued=2500, decodes=1, prefill_share=0.9), load("d1", decodes=12)]
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=2800, max_tokens=128)
    assert (pl.prefill, pl.decode) == ("d0", "d1")


def test_short_prompt_avoids_the_device_busy_with_long_prefills():
    loads = [load("d0", queued=2500), load("d1", decodes=12)]
    pl = choose_placement(cost(), LIMITS, SLO, loads, num_prompt_tokens=100, max_tokens=128)
    assert (pl.prefill, pl.decode) == ("d1", "d1")


def test_candidates_follow_roles():
    dis = [load("p", role="prefill"), load("d", role="decode")]
    assert candidates(dis, 100) == [("p", "d")]
    assert candidates(dis, 100, local_prefill_threshold=200) == [("d", "d")]  # conditional disaggregation
    col = [load("a", role="colocated"), load("b", role="colocated")]
    assert candidates(col, 100) == [("a", "a"), ("b", "b")]
    ada = [load("a"), load("b")]
    assert sorted(candidates(ada, 100)) == [("a", "a"), ("a", "b"), ("b", "a"), ("b", "b")]
    full = [DeviceLoad("a", "colocated", free_seats=0), load("b", role="colocated")]
    assert candidates(full, 100) == [("b", "b")]


def test_no_seat_no_placement():
    loads = [DeviceLoad("a", "colocated", free_seats=0)]
    assert choose_placement(cost(("a",)), LIMITS, SLO, loads, 100, 10) is None


def test_ttft_grows_with_the_queue_and_the_prompt():
    c, by = cost(), lambda *xs: {x.name: x for x in xs}
    base = predict(c, LIMITS, by(load("d0"), load("d1")), "d0", "d0", 500, 64).ttft
    assert predict(c, LIMITS, by(load("d0", queued=1000), load("d1")), "d0", "d0", 500, 64).ttft > base
    assert predict(c, LIMITS, by(load("d0"), load("d1")), "d0", "d0", 900, 64).ttft > base
    assert base == pytest.approx(c.step_time("d0", StepShape.of([(500, 0)])))


def test_decoding_where_prefills_keep_coming_is_slower():
    c, by = cost(), lambda *xs: {x.name: x for x in xs}
    quiet = predict(c, LIMITS, by(load("d0"), load("d1")), "d1", "d0", 100, 64).tpot
    busy = predict(c, LIMITS, by(load("d0", prefill_share=0.5), load("d1")), "d1", "d0", 100, 64).tpot
    queued = predict(c, LIMITS, by(load("d0", queued=3000), load("d1")), "d1", "d0", 100, 64).tpot
    assert quiet < busy and quiet < queued


def test_an_unfitted_model_predicts_without_dividing_by_zero():
    c = CostModel({n: StepModel() for n in ("d0", "d1")}, {}, 0, 1)
    pl = choose_placement(c, LIMITS, SLO, [load("d0", prefill_share=0.5), load("d1")], 100, 10)
    assert pl is not None and pl.ttft == 0 and pl.tpot == 0


def test_requests_on_their_way_to_decode_slow_the_batch_they_will_join():
    c, by = cost(), lambda *xs: {x.name: x for x in xs}
    alone = predict(c, LIMITS, by(load("d0"), load("d1")), "d1", "d1", 100, 64).tpot
    d1 = DeviceLoad("d1", "adaptive", num_incoming=3, incoming_context=6000)  # three long prompts prefill elsewhere
    joined = predict(c, LIMITS, by(load("d0"), d1), "d1", "d1", 100, 64).tpot
    want = c.step_time("d1", StepShape(num_decodes=4, decode_context=6000 + 100 + 32))
    assert alone < joined == pytest.approx(want)
