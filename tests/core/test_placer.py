"""The static placer: its decode device (where a request ends soonest, or the cache within a few seats of the
least loaded), and its conditional disaggregation: a short prompt prefills beside its decodes only while the
prefill devices are busy; long prompts, and short ones while a prefill device is free, go to a prefill device."""

from __future__ import annotations

from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.load import DeviceLoad, Role, SloTarget, StepLimits
from nodeserve.core.placer import (MIN_BALANCE, AdaptivePlacer, Decision, PlacerTiming, Seated, StaticPlacer,
                                   num_uncached, plan_balance)
from nodeserve.core.roles import HOLD_S, IDLE_S
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams


def _req(num_prompt_tokens: int) -> Request:
    return Request("r", [7] * num_prompt_tokens, SamplingParams(max_tokens=16))


def _loads(prefill_queued: int, decode_queued: int = 0) -> list[DeviceLoad]:
    return [DeviceLoad("cpu:0", "prefill", queued_prefill_tokens=prefill_queued),
            DeviceLoad("cpu:1", "decode", queued_prefill_tokens=decode_queued)]


def test_a_short_prompt_prefills_on_its_decode_device_only_while_the_prefill_device_is_busy():
    placer = StaticPlacer(local_prefill_when_busy=512)
    assert placer.place(0, _loads(0), _req(100)).prefill == "cpu:0"         # idle prefill device: disaggregated
    assert placer.place(0, _loads(300), _req(100)).prefill == "cpu:0"       # a short queue there: still
    assert placer.place(0, _loads(2000), _req(100)).prefill == "cpu:1"      # a long prompt ahead: here
    assert placer.place(0, _loads(2000), _req(600)).prefill == "cpu:0"      # not a short prompt
    assert placer.place(0, _loads(2000, 2500), _req(100)).prefill == "cpu:0"  # more queued here than there
    assert placer.num_busy_local == 1
    d = placer.place(0, _loads(2000), _req(100))
    assert (d.prefill, d.decode) == ("cpu:1", "cpu:1")


def test_off_by_default_and_the_plain_threshold_still_applies():
    placer = StaticPlacer()
    assert placer.place(0, _loads(5000), _req(100)).prefill == "cpu:0"
    assert StaticPlacer(local_prefill_threshold=200).place(0, _loads(0), _req(100)).prefill == "cpu:1"


def _timing(rel_error: float = 0.05) -> PlacerTiming:
    # 2 ms a prompt token or a decode row, 5 ms a step: 16 decodes take 37 ms of a 60 ms side budget, so a decode
    # device beside them prefills 11 tokens a step (~190 tok/s), an idle one 500 tok/s
    model = StepModel(coef=[0.005, 0.002, 0.0, 0.002, 0.0], rel_error=rel_error)
    cost = CostModel({"cpu:0": model, "cpu:1": model})
    return PlacerTiming(lambda: cost, StepLimits(1024, 64), 0.06)


def _busy_loads(decode_queued: int, num_decodes: int, num_incoming: int = 0) -> list[DeviceLoad]:
    return [DeviceLoad("cpu:0", Role.PREFILL, queued_prefill_tokens=600),
            DeviceLoad("cpu:1", Role.DECODE, queued_prefill_tokens=decode_queued, num_decodes=num_decodes,
                       decode_context=num_decodes * 100, num_incoming=num_incoming, incoming_context=num_incoming * 30)]


def test_with_step_models_a_busy_time_prompt_stays_only_where_its_prefill_ends_sooner():
    timed, counted = StaticPlacer(local_prefill_when_busy=512, timing=_timing()), StaticPlacer(local_prefill_when_busy=512)
    # 200 tokens queued beside 16 decodes: 28 side steps (1.7 s) against the prefill device's 700 tokens (1.4 s);
    # by tokens alone (200 < 600) it stayed
    assert counted.place(0, _busy_loads(200, 16), _req(100)).prefill == "cpu:1"
    assert timed.place(0, _busy_loads(200, 16), _req(100)).prefill == "cpu:0"
    # ... the same prompt alone beside those decodes: 10 side steps (0.6 s): here
    assert timed.place(0, _busy_loads(0, 16), _req(100)).prefill == "cpu:1"
    # requests whose prefill elsewhere ends first join the batch its chunks are sized beside: 8 tokens a step
    # beside 24 (25 steps, 1.7 s)
    assert timed.place(0, _busy_loads(100, 0, num_incoming=24), _req(100)).prefill == "cpu:0"
    # with nothing to decode it prefills whole chunks: 300 tokens, 0.6 s
    assert timed.place(0, _busy_loads(200, 0), _req(100)).prefill == "cpu:1"
    assert timed.num_busy_local == 2


def test_a_step_model_off_by_too_much_falls_back_to_queued_tokens():
    placer = StaticPlacer(local_prefill_when_busy=512, timing=_timing(rel_error=0.5))
    assert placer.place(0, _busy_loads(200, 16), _req(100)).prefill == "cpu:1"


def _colocated(cached: tuple[int, int], taken: tuple[int, int]) -> list[DeviceLoad]:
    return [DeviceLoad(f"cpu:{i}", Role.COLOCATED, free_seats=64 - taken[i], num_decodes=taken[i],
                       decode_context=taken[i] * 100, cached_tokens=cached[i]) for i in (0, 1)]


def test_with_step_models_a_decode_device_is_where_the_request_ends_soonest():
    placer = StaticPlacer(timing=_timing())
    # a chat template's 32 cached tokens save 64 ms of prefill once; a 17th row costs every one of 16 steps 2 ms
    # more than the idle device's first (the burst that stacked on one device)
    assert placer.place(0, _colocated((32, 0), (16, 0)), _req(100)).decode == "cpu:1"
    # over 16 tokens the 64 ms are worth one row more there (32 ms), not three (96 ms)
    assert placer.place(0, _colocated((32, 0), (8, 7)), _req(100)).decode == "cpu:0"
    assert placer.place(0, _colocated((32, 0), (8, 5)), _req(100)).decode == "cpu:1"
    # a long cached prefix saves seconds: worth a batch far larger than the other device's
    assert placer.place(0, _colocated((2000, 0), (16, 0)), _req(2100)).decode == "cpu:0"
    # equal loads: the cache decides
    assert placer.place(0, _colocated((0, 32), (4, 4)), _req(100)).decode == "cpu:1"


def test_without_step_models_the_cache_decides_within_a_few_seats_of_the_least_loaded():
    for placer in (StaticPlacer(), StaticPlacer(timing=_timing(rel_error=0.5))):
        assert placer.place(0, _colocated((32, 0), (4, 0)), _req(100)).decode == "cpu:0"
        assert placer.place(0, _colocated((32, 0), (5, 0)), _req(100)).decode == "cpu:1"
        assert placer.place(0, _colocated((2000, 0), (16, 0)), _req(2100)).decode == "cpu:1"


def test_one_model_the_best_fitted_prices_every_decode_device():
    # cpu:0's refits priced its rows at a quarter of cpu:1's (steps its refits saw and cpu:1's did not): by its own
    # model it would take the 11th stream beside cpu:1's 8
    cheap = StepModel(coef=[0.005, 0.002, 0.0, 0.0005, 0.0], rel_error=0.2)
    fitted = StepModel(coef=[0.005, 0.002, 0.0, 0.002, 0.0], rel_error=0.05)
    cost = CostModel({"cpu:0": cheap, "cpu:1": fitted})
    placer = StaticPlacer(timing=PlacerTiming(lambda: cost, StepLimits(1024, 64), 0.06))
    assert placer.place(0, _colocated((0, 0), (10, 8)), _req(100)).decode == "cpu:1"
    assert placer.place(0, _colocated((0, 0), (8, 10)), _req(100)).decode == "cpu:0"


# ---- a device given back takes a share of the decodes -----------------------------------------------------------

def _seated(prefix: str, lefts: list[int], num_tokens: int = 100) -> list[Seated]:
    return [Seated(f"{prefix}{i}", num_tokens, left) for i, left in enumerate(lefts)]


def test_a_device_given_back_takes_decodes_until_the_batches_are_about_even():
    target = DeviceLoad("cpu:0", Role.ADAPTIVE, free_seats=64)
    moves = plan_balance(target, {"cpu:1": _seated("b", [10, 200, 50, 120, 5, 90, 30, 60])})
    # 8 against 0: four move, the ones with the most output left first; 4 against 4 stays
    assert moves == [("b1", "cpu:0"), ("b3", "cpu:0"), ("b5", "cpu:0"), ("b7", "cpu:0")]
    # from the device with the most, one at a time: 6 and 3 against 1 -> 4, 3 against 3
    target = DeviceLoad("cpu:0", Role.ADAPTIVE, num_decodes=1, free_seats=64)
    moves = plan_balance(target, {"cpu:1": _seated("b", [1] * 6), "cpu:2": _seated("c", [1] * 3)})
    assert [name for name, _ in moves] == ["b0", "b1"]
    assert plan_balance(DeviceLoad("cpu:0", Role.ADAPTIVE, num_decodes=3), {"cpu:1": _seated("b", [1] * 4)}) == []


def test_a_device_given_back_takes_no_more_than_its_seats_and_kv_hold():
    target = DeviceLoad("cpu:0", Role.ADAPTIVE, free_seats=2)
    assert len(plan_balance(target, {"cpu:1": _seated("b", [1] * 10)})) == 2
    target = DeviceLoad("cpu:0", Role.ADAPTIVE, free_seats=64, free_tokens=250)
    big = [Seated("big", 1000, 500)] + _seated("b", [1] * 9)
    assert [rid for rid, _ in plan_balance(target, {"cpu:1": big})] == ["b0", "b1"]  # the big one does not fit


def test_the_adaptive_placer_gives_a_device_back_with_no_request_to_place():
    cost = CostModel({d: StepModel([0.0, 0.001, 0.0, 0.004, 0.0]) for d in ("cpu:0", "cpu:1")})
    placer = AdaptivePlacer(lambda: cost, StepLimits(2048, 64), SloTarget(2.5, 0.1), ["cpu:0", "cpu:1"])
    loads = [DeviceLoad("cpu:0", Role.ADAPTIVE), DeviceLoad("cpu:1", Role.ADAPTIVE, num_decodes=8)]
    placer.observe(0.0, loads, _req(3000))  # 3 s of prefill: long
    first = placer.place(0.0, loads, _req(3000))
    assert first.moves_from == ("cpu:0",) and first.prefill == "cpu:0"
    loads[0] = DeviceLoad("cpu:0", Role.PREFILL)
    assert placer.roles(1.0, loads).role_changes == ()  # demand still asks for it
    assert placer.roles(IDLE_S + 0.1, loads).role_changes == ()  # demand asks for none from now: the hold starts
    decision = placer.roles(IDLE_S + HOLD_S + 0.2, loads)  # ... and has passed, with nothing queued
    assert [(c.device, c.role) for c in decision.role_changes] == [("cpu:0", Role.ADAPTIVE)]
    assert decision.moves_to == ("cpu:0",) and not decision.placed
    assert StaticPlacer().roles(0.0, loads) == Decision(None, None)


def test_a_long_prompt_mostly_cached_is_not_long_for_the_adaptive_placer():
    # A multi-turn prompt of 3,000 tokens whose first 2,960 cpu:1 caches: 40 tokens to compute, so no device is
    # dedicated and it stays where its prefix is.
    cost = CostModel({d: StepModel([0.0, 0.001, 0.0, 0.004, 0.0]) for d in ("cpu:0", "cpu:1")})
    placer = AdaptivePlacer(lambda: cost, StepLimits(2048, 64), SloTarget(2.5, 0.1), ["cpu:0", "cpu:1"])
    loads = [DeviceLoad("cpu:0", Role.ADAPTIVE), DeviceLoad("cpu:1", Role.ADAPTIVE, num_decodes=8, cached_tokens=2960)]
    placer.observe(0.0, loads, _req(3000))
    decision = placer.place(0.0, loads, _req(3000))
    assert decision.role_changes == () and (decision.prefill, decision.decode) == ("cpu:1", "cpu:1")
    assert not placer.policy.demand
    assert num_uncached(loads, _req(3000)) == 40
    # where the prefix is cached there is no room for the prompt: it is computed whole elsewhere, and long
    full = [loads[0], DeviceLoad("cpu:1", Role.ADAPTIVE, num_decodes=8, cached_tokens=2960, free_tokens=1000)]
    assert num_uncached(full, _req(3000)) == 3000
    # uncached, the same prompt is long: demand, and a device dedicated to it
    cold = [DeviceLoad("cpu:0", Role.ADAPTIVE), DeviceLoad("cpu:1", Role.ADAPTIVE, num_decodes=8)]
    placer.observe(1.0, cold, _req(3000))
    assert placer.place(1.0, cold, _req(3000)).moves_from == ("cpu:0",)


def test_with_nothing_due_the_lightest_adaptive_device_takes_decodes_once_batches_differ_by_min_balance():
    cost = CostModel({d: StepModel([0.0, 0.001, 0.0, 0.004, 0.0]) for d in ("cpu:0", "cpu:1", "cpu:2")})
    placer = AdaptivePlacer(lambda: cost, StepLimits(2048, 64), SloTarget(2.5, 0.1), ["cpu:0", "cpu:1", "cpu:2"])

    def loads(*batches, queued=(0, 0, 0)):
        return [DeviceLoad(f"cpu:{i}", Role.ADAPTIVE, q, n) for i, (n, q) in enumerate(zip(batches, queued))]

    assert placer.roles(0.0, loads(10, 10 - MIN_BALANCE + 1, 10)).moves_to == ()
    assert placer.roles(0.0, loads(10, 10 - MIN_BALANCE, 9)).moves_to == ("cpu:1",)
    # a device prefilling its own prompts is not where decodes go to even out
    assert placer.roles(0.0, loads(10, 2, 6, queued=(0, 500, 0))).moves_to == ("cpu:2",)
