"""The simulator on synthetic profiles: a tiny case by hand, batching and the handoff as the worker does them,
goodput that moves the obvious ways, and the policy core it runs: the placers on the runtime's load snapshots, the
pending queue's order, moves, and every page given back."""

from __future__ import annotations

import pytest

from nodeserve import workloads
from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.handoff import STOP_PAGES, MigrationOutcome
from nodeserve.core.load import DeviceLoad, Role
from nodeserve.core.pending import MAX_OVERTAKES
from nodeserve.core.placement import SloTarget, StepLimits
from nodeserve.core.placer import AdaptivePlacer, StaticPlacer
from nodeserve.core.roles import ROLE_TICK_S
from nodeserve.plan.simulate import (PAGE_SIZE, Mode, SimRequest, Simulation, attainment, candidate_modes,
                                     predict_goodput, records, simulate)

LIMITS = StepLimits(max_num_batched_tokens=1024, max_num_seqs=64)
SLO = SloTarget(ttft_s=2.5, tpot_s=0.1, ttft_per_token_s=0.01)
CPU = [0.02, 0.005, 1e-7, 0.004, 2e-6]  # a CPU core: ~5 ms per prompt token, ~4 ms per decode row


def cost(coef, names=("a", "b"), bandwidth=5e9, kv_bytes_per_token=46080, num_layers=30) -> CostModel:
    return CostModel({n: StepModel(coef=list(coef)) for n in names},
                     {(x, y): bandwidth for x in names for y in names if x != y}, kv_bytes_per_token, num_layers)


COLOC1 = Mode("colocated", {"a": "colocated"})
SPLIT = Mode("1P:1D", {"a": "prefill", "b": "decode"})


def test_one_request_by_hand():
    # 0.1 s a step + 0.01 s a prompt token: prefill 10 tokens = 0.2 s, then decode steps of 0.1 s.
    c = cost([0.1, 0.01, 0, 0, 0], names=("a",))
    [r] = simulate(c, COLOC1, LIMITS, SLO, [(10, 3)], [0.0])
    assert r["ttft"] == pytest.approx(0.2) and r["e2e"] == pytest.approx(0.4) and r["tpot"] == pytest.approx(0.1)
    assert r["n_out"] == 3 and r["ok"]


def test_batching_and_chunking_by_hand():
    # Oldest prompt first (deadline order would put B first: its TTFT limit is shorter). Budget 8 tokens a step.
    # t=0: A (12 tokens) gets 8, B waits. 0.1+0.08 -> 0.18: A's last 4 + B's 4 = 8 tokens
    # (0.18 s) -> 0.36: A's first token; B 2 more ... per-token cost only: decodes are free but 0.1 a step.
    c = cost([0.1, 0.01, 0, 0, 0], names=("a",))
    limits = StepLimits(max_num_batched_tokens=8, max_num_seqs=4)
    ra, rb = simulate(c, COLOC1, limits, SLO, [(12, 2), (6, 2)], [0.0, 0.0], prefill_order="fifo")
    # step 1 [0, .18]: A 8. step 2 [.18, .36]: A 4 + B 4 -> A's first token at .36.
    # step 3 [.36, .48]: A decodes (1 row, budget 7) + B's last 2 tokens (0.1 + 0.02) -> A done, B first token.
    # step 4 [.48, .58]: B decodes -> done.
    assert ra["ttft"] == pytest.approx(0.36) and ra["e2e"] == pytest.approx(0.48)
    assert rb["ttft"] == pytest.approx(0.48) and rb["e2e"] == pytest.approx(0.58)


def test_a_mode_is_the_one_its_devices_section_serves():
    from nodeserve.config import config_from_dict

    for mode in candidate_modes(["cpu:0", "cpu:1", "cpu:2"]):
        section = config_from_dict({"devices": mode.devices_section()}, check_devices=False).devices
        assert Mode.of_section(section).roles == mode.roles, mode.name


def test_a_request_dispatched_by_a_finish_waits_for_the_step_to_be_counted():
    # Oldest prompt first. Two seats, 8 tokens a step. A arrives first and steps alone [0, .12] (B, 10 ms later,
    # waits for the next step, as a worker sees a message only between steps). Step 2 [.12, .29]: A decodes + B's
    # first 7 tokens; A ends and its seat goes to C, which must not start a step before B's 7 are counted.
    # Step 3 [.29, .47]: B's last 5 + C's 3. Step 4 [.47, .58]: B decodes (ends) + C's last 1. Step 5: C.
    c = cost([0.1, 0.01, 0, 0, 0], names=("a",))
    limits = StepLimits(max_num_batched_tokens=8, max_num_seqs=2)
    ra, rb, rc = simulate(c, COLOC1, limits, SLO, [(2, 2), (12, 2), (4, 2)], [0.0, 0.01, 0.02],
                          prefill_order="fifo")
    assert ra["e2e"] == pytest.approx(0.29) and rb["ttft"] == pytest.approx(0.47 - 0.01)
    assert rb["e2e"] == pytest.approx(0.58 - 0.01) and rc["ttft"] == pytest.approx(0.58 - 0.02)
    assert rc["e2e"] == pytest.approx(0.68 - 0.02)


def test_handoff_waits_for_the_transfer_tail():
    # 1,000 tokens x 1,000 B at 1 MB/s = 1 s of copy; the 0.2 s prefill hides 0.2 of it: a 0.8 s tail.
    c = cost([0.1, 0.01, 0, 0, 0], bandwidth=1e6, kv_bytes_per_token=1000, num_layers=10)
    [r] = simulate(c, SPLIT, LIMITS, SLO, [(10, 3)], [0.0])
    assert r["ttft"] == pytest.approx(0.2)  # the first token comes from the prefill device at once
    tail = max(10 * 1000 / 1e6 / 10, 10 * 1000 / 1e6 - 0.2)
    assert r["e2e"] == pytest.approx(0.2 + tail + 0.2)


def test_seats_bound_the_decode_batch():
    c = cost([0.1, 0.0, 0, 0, 0], names=("a",))
    limits = StepLimits(max_num_batched_tokens=64, max_num_seqs=1)
    r1, r2 = simulate(c, COLOC1, limits, SLO, [(4, 2), (4, 2)], [0.0, 0.0])
    assert r2["ttft"] == pytest.approx(r1["e2e"] + 0.1)  # waits in the router for the only seat


def test_candidate_modes():
    names = [m.name for m in candidate_modes(["cpu:0", "cpu:1", "cpu:2"])]
    assert names == ["colocated", "1P:2D", "2P:1D", "adaptive"]
    assert Mode("x", {"a": "prefill", "b": "decode"}).config_lines() == [
        'mode = "disaggregated"', 'prefill = ["a"]', 'decode = ["b"]']


def _work(name="bimodal", n=60):
    return [(r.prompt_len, r.max_tokens) for r in workloads.generate(name, n, seed=1)]


def test_attainment_falls_with_the_rate():
    work, modes = _work(), candidate_modes(["a", "b"])
    for mode in modes:
        att = [attainment(cost(CPU), mode, LIMITS, SLO, work, workloads.arrival_times("poisson", len(work), r, 1))
               for r in (0.05, 0.3, 2.0)]
        assert att[0] >= att[1] >= att[2], (mode.name, att)
        assert att[0] > att[2]


def test_goodput_rises_with_a_faster_device_and_a_looser_slo():
    work, mode = _work("agent"), candidate_modes(["a", "b"])[0]
    base = predict_goodput(cost(CPU), mode, LIMITS, SLO, work).goodput
    faster = predict_goodput(cost([c / 2 for c in CPU]), mode, LIMITS, SLO, work).goodput
    looser = predict_goodput(cost(CPU), mode, LIMITS, SloTarget(5.0, 0.2, 0.02), work).goodput
    assert 0 < base < faster and base < looser
    # Every time and every SLO halved: the same schedule at twice the rate (arrivals of one seed scale with it).
    scaled = predict_goodput(cost([c / 2 for c in CPU]), mode, LIMITS, SloTarget(1.25, 0.05, 0.005), work).goodput
    assert scaled == pytest.approx(2 * base, rel=0.05)


def test_short_uniform_chat_prefers_colocated_to_a_split():
    work = _work("agent")
    by = {m.name: predict_goodput(cost(CPU), m, LIMITS, SLO, work).goodput for m in candidate_modes(["a", "b"])}
    assert by["colocated"] > by["1P:1D"]
    assert by["adaptive"] >= 0.95 * by["colocated"]


def _run(work, mode, rate, coef=CPU):
    sim = Simulation(cost(coef), mode, LIMITS, SLO)
    sim.run([SimRequest(t, p, m) for (p, m), t in zip(work, workloads.arrival_times("poisson", len(work), rate))])
    return sim


def test_adaptive_dedicates_a_device_to_long_prompts_and_never_for_short_ones():
    adaptive = candidate_modes(["a", "b"])[-1]
    bimodal = _run(_work("bimodal"), adaptive, 0.2)
    assert bimodal.role_changes and bimodal.role_changes[0].role == "prefill"
    short = _run(_work("short"), adaptive, 0.5)
    assert short.role_changes == []


# ---- the simulator runs the engine's policy core -------------------------------------------------------------

def _sim(mode, work, arrivals, limits=LIMITS, coef=(0.1, 0.01, 0, 0, 0), **kw):
    sim = Simulation(cost(coef, names=tuple(mode.roles)), mode, limits, SLO, **kw)
    return sim, sim.run([SimRequest(t, p, m) for (p, m), t in zip(work, arrivals)])


def test_the_placer_is_the_cores_on_the_loads_the_runtime_builds():
    # B is placed while A's prompt is still queued on the prefill device and A holds a seat on the decode device.
    sim = Simulation(cost([0.1, 0.01, 0, 0, 0]), SPLIT, LIMITS, SLO, capacity_tokens=100 * PAGE_SIZE)
    assert isinstance(sim.placer, StaticPlacer)
    seen, place = [], sim.placer.place

    def spy(now, loads, req):
        seen.append((now, loads, req.num_prompt_tokens))
        return place(now, loads, req)

    sim.placer.place = spy
    sim.run([SimRequest(0.0, 10, 3), SimRequest(0.05, 20, 5)])
    assert [(now, n) for now, _, n in seen] == [(0.0, 10), (0.05, 20)]
    assert seen[1][1] == [  # A's prompt pages taken on a, its decode pages (12 tokens) on b
        DeviceLoad("a", Role.PREFILL, queued_prefill_tokens=10, free_seats=64, free_tokens=99 * PAGE_SIZE,
                   queued_prompts=(10,)),
        DeviceLoad("b", Role.DECODE, free_seats=63, free_tokens=99 * PAGE_SIZE, num_incoming=1, incoming_context=10)]
    assert isinstance(Simulation(cost(CPU), candidate_modes(["a", "b"])[-1], LIMITS, SLO).placer, AdaptivePlacer)


def test_the_decode_device_is_the_static_placers_most_free_kv():
    # A holds 14 pages on d1, B one on d2: C goes where the most KV is free (d2 again), not where fewer requests are.
    mode = Mode("1P:2D", {"p": "prefill", "d1": "decode", "d2": "decode"})
    _, (a, b, c) = _sim(mode, [(10, 200), (10, 5), (10, 5)], [0.0, 0.01, 0.02])
    assert (a.decode_dev, b.decode_dev, c.decode_dev) == ("d1", "d2", "d2")
    assert a.prefill_dev == b.prefill_dev == c.prefill_dev == "p"


def test_a_request_that_does_not_fit_yet_is_passed_over_by_smaller_ones():
    # 10 pages of 16 tokens. A takes 4 (16 + 40 - 1 tokens), B would need 7: it waits for A's end while C (1 page)
    # is placed past it, as the runtime router passes it over.
    limits = StepLimits(max_num_batched_tokens=64, max_num_seqs=8)
    _, (a, b, c) = _sim(COLOC1, [(16, 40), (16, 90), (8, 4)], [0.0, 0.01, 0.02], limits, capacity_tokens=160)
    assert c.end < a.end < b.first_token
    assert b.first_token == pytest.approx(a.end + 0.1 + 16 * 0.01)  # placed at A's release, prefilled alone


def test_a_request_passed_over_max_overtakes_times_holds_the_queue():
    # A holds 64 of 70 pages for a long decode; B needs 14 and waits for A's end. Small requests (1 page each) go
    # past B until MAX_OVERTAKES have (and those placed in the same pass); the rest wait behind B. (The device
    # prefills oldest first: in deadline order, the smalls' shorter TTFT limits would put them before B there.)
    limits = StepLimits(max_num_batched_tokens=256, max_num_seqs=256)
    smalls = [(8, 2)] * (MAX_OVERTAKES + 10)
    _, (a, b, *s) = _sim(COLOC1, [(16, 1000), (16, 200)] + smalls, [0.0, 0.0005] + [0.001] * len(smalls), limits,
                         coef=(0.01, 0.001, 0, 0, 0), capacity_tokens=70 * PAGE_SIZE, prefill_order="fifo")
    before = [r for r in s if r.first_token < b.first_token]
    assert a.end < b.first_token
    assert MAX_OVERTAKES <= len(before) < len(s)
    assert all(r.end <= a.end for r in before) and all(r.first_token > a.end for r in s[len(before):])


def test_a_request_that_can_never_fit_is_refused_not_queued():
    # As the router's TooLarge: before, it held the queue forever and every request behind it.
    _, (big, small) = _sim(COLOC1, [(100, 4), (10, 4)], [0.0, 0.0], capacity_tokens=64)
    assert big.refused and small.end is not None
    assert [r["ok"] for r in records([big, small])] == [False, True]


@pytest.mark.parametrize("capacity", [float("inf"), 40_000])
def test_every_page_and_seat_is_given_back(capacity):
    work = _work("bimodal", 80)
    for mode in candidate_modes(["a", "b", "c"]):
        sim, reqs = _sim(mode, work, workloads.arrival_times("poisson", len(work), 0.6, 1), coef=CPU,
                         capacity_tokens=capacity)
        assert all(r.end is not None and r.num_out == r.max_tokens for r in reqs), mode.name
        assert [d.kv.num_used for d in sim.devices.values()] == [0, 0, 0], mode.name
        r = sim.router
        assert not r.placements and not r.moving and not r.pending and not +r.num_seats_taken


def test_a_device_dedicated_to_prefill_moves_its_decodes_live():
    # A slow link (a 50-token context takes 12 ms to copy): the pre-copy rounds run while the request keeps decoding
    # on the source, and only its last pages' copy stops it.
    work, c = _work("bimodal"), cost(CPU, bandwidth=2e8)
    sim = Simulation(c, candidate_modes(["a", "b"])[-1], LIMITS, SLO)
    sim.run([SimRequest(t, p, m) for (p, m), t in zip(work, workloads.arrival_times("poisson", len(work), 0.3))])
    assert sim.role_changes[0].role == "prefill"
    assert sim.num_migrations[MigrationOutcome.MOVED] == len(sim.migration_downtimes) > 0
    assert all(0 < t <= c.transfer_time("a", "b", STOP_PAGES * PAGE_SIZE) for t in sim.migration_downtimes)


def test_deadline_order_keeps_more_prompts_within_their_ttft():
    # One prefill device at 1 ms a prompt token, four long prompts at once: oldest first, the 2,900-token one
    # (2.9 s) makes every one behind it miss 2.5 s too; deadline order sets it aside and the other three (2.4 s
    # in all) make it.
    c = cost([0.0, 0.001, 0, 0.001, 0])
    slo = SloTarget(ttft_s=2.5, tpot_s=0.1)
    work = [(2900, 4), (700, 4), (800, 4), (900, 4)]
    at = [0.0] * 4
    fifo = simulate(c, SPLIT, LIMITS, slo, work, at, prefill_order="fifo")
    deadline = simulate(c, SPLIT, LIMITS, slo, work, at)
    assert sum(r["ttft"] <= 2.5 for r in fifo) == 0
    assert sum(r["ttft"] <= 2.5 for r in deadline) == 3 and deadline[0]["ok"]  # the long one still ends


def test_stopping_a_probe_that_cannot_meet_the_target_finds_the_same_goodput():
    """stop_early (the TP planner's): a probe ends once too many requests are sure misses; only the missing probes'
    attainments change (they become bounds), so the search takes the same steps to the same goodput."""
    work = _work("bimodal", 40)
    for mode in (COLOC1, SPLIT):
        full = predict_goodput(cost(CPU), mode, LIMITS, SLO, work, rel_tol=0.1)
        fast = predict_goodput(cost(CPU), mode, LIMITS, SLO, work, rel_tol=0.1, stop_early=True)
        assert fast.goodput == full.goodput and fast.bracket == full.bracket, mode.name
        assert [r for r, _ in fast.points] == [r for r, _ in full.points]
        assert all((a >= 0.9) == (b >= 0.9) for (_, a), (_, b) in zip(fast.points, full.points))
    sim = Simulation(cost(CPU), SPLIT, LIMITS, SLO, stop_below=0.9)
    sim.run([SimRequest(t, p, m) for (p, m), t in zip(work, workloads.arrival_times("poisson", len(work), 20.0))])
    assert sim.stopped_early


def test_each_device_may_have_its_own_pool():
    """capacity_tokens per device (TP groups of different degrees): a 100-token prompt is refused by a 64-token
    decode pool, and by a 64-token prefill pool, and served when both hold it."""
    for pools, refused in (({"a": 1024, "b": 64}, True), ({"a": 64, "b": 1024}, True),
                           ({"a": 1024, "b": 1024}, False)):
        sim, (big, small) = _sim(SPLIT, [(100, 4), (10, 4)], [0.0, 0.0], capacity_tokens=pools)
        assert [d.kv.num_pages for d in sim.devices.values()] == [pools["a"] // PAGE_SIZE, pools["b"] // PAGE_SIZE]
        assert big.refused == refused and small.end is not None


def test_a_request_waiting_for_a_seat_goes_when_the_prefill_device_is_done_as_in_the_engine():
    """tests/runtime/test_adaptive.py's case on the virtual clock: two seats a device, one decode on each; a long
    prompt dedicates one device and takes the other's last seat; a short prompt waits. The router places it when
    the long prompt is handed off (Engine._room), not when the first decode ends."""
    adaptive = candidate_modes(["a", "b"])[-1]
    limits = StepLimits(max_num_batched_tokens=1024, max_num_seqs=2)
    sim = Simulation(cost(CPU), adaptive, limits, SLO)
    held = [SimRequest(0.0, 20, 400), SimRequest(0.01, 20, 400)]
    long, short = SimRequest(1.0, 1000, 400), SimRequest(1.1, 20, 10)
    sim.run([*held, long, short])
    assert sorted(r.decode_dev for r in held) == ["a", "b"] and long.prefill_dev != long.decode_dev
    assert [c.role for c in sim.role_changes][:1] == ["prefill"]
    assert long.first_token is not None and short.first_token is not None
    assert long.first_token < short.first_token < min(r.end for r in [*held, long] if r.end is not None)


def test_a_device_given_back_on_the_role_tick_takes_half_of_a_burst_placed_while_it_was_dedicated():
    """As the engine's role tick (Engine._role_tick): a long prompt dedicates a; sixteen short requests arrive
    while it prefills (5 s) and all decode on b (a few prefilled on a, behind its running chunk). Demand ends 3 s
    after the long prompt; a goes back at the first tick after its last prefill, not when the first short request
    ends (~17 s on), and the batches are evened out (AdaptivePlacer.roles)."""
    adaptive = candidate_modes(["a", "b"])[-1]
    work = [(1000, 4)] + [(100, 200)] * 16
    at = [0.0] + [2.0] * 16
    sim = Simulation(cost(CPU), adaptive, LIMITS, SLO)
    done = sim.run([SimRequest(t, p, m) for (p, m), t in zip(work, at)])
    [back] = [c for c in sim.role_changes if c.role == "adaptive"]
    last_prefill_on_a = max(r.first_token for r in done if r.prefill_dev == "a")
    assert sim.role_changes[0].role == "prefill" and back.device == "a"
    assert last_prefill_on_a < back.time <= last_prefill_on_a + ROLE_TICK_S
    assert back.time < min(r.end for r in done[1:])
    # moves at once and on later ticks as b's requests decode: even batches, so the sixteen equal requests end
    # together (without the moves: 16.7 s to 25.5 s)
    assert sim.num_migrations[MigrationOutcome.MOVED] >= 8
    ends = [r.end for r in done[1:]]
    assert max(ends) - min(ends) < 1.0
