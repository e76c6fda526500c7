"""The adaptive role policy on a synthetic cost model: when a device is dedicated to prefill, which one, when it
is given back, and the roles one request's placement sees."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.load import DeviceLoad, SloTarget, StepLimits
from nodeserve.core.placement import choose_placement
from nodeserve.core.roles import LONG_PREFILL_TPOTS, RolePolicy

DEVICES = ("d0", "d1", "d2")
PER_TOKEN = 0.004  # seconds per prompt token: a 1,000-token prompt prefills in 4 s


def _policy(devices=DEVICES, tpot_s=0.1) -> RolePolicy:
    cost = CostModel({d: StepModel([0.01, PER_TOKEN, 0.0, 0.005, 1e-6]) for d in devices})
    return RolePolicy(cost, StepLimits(512, 64), SloTarget(2.5, tpot_s), list(devices))


def _loads(decodes=(3, 1, 2), seats=(60, 60, 60), queued=(0, 0, 0)):
    return [DeviceLoad(d, "adaptive", q, n, 100 * n, s) for d, n, s, q in zip(DEVICES, decodes, seats, queued)]


def test_a_prompt_is_long_when_its_prefill_alone_outlasts_the_tpot_budget():
    p = _policy()
    limit = LONG_PREFILL_TPOTS * 0.1  # 3.2 s of prefill
    assert not p.is_long(int(limit / PER_TOKEN) - 50)
    assert p.is_long(int(limit / PER_TOKEN) + 50)
    assert not _policy(tpot_s=1.0).is_long(int(limit / PER_TOKEN) + 50)  # a looser TPOT tolerates more


def test_short_prompts_never_dedicate_a_device():
    p = _policy()
    for t in range(100):
        assert not p.observe(t * 0.1, 150)
        assert p.update(t * 0.1, _loads()) == []
    assert p.prefill == set()


def test_a_long_prompt_dedicates_the_device_with_the_fewest_decodes_at_once():
    p = _policy()
    assert p.observe(0.0, 2000)
    changes = p.update(0.0, _loads(decodes=(3, 1, 2)))
    assert [(c.device, c.role) for c in changes] == [("d1", "prefill")]
    assert p.prefill == {"d1"}


def test_demand_sets_how_many_devices_prefill_but_one_always_decodes():
    p = _policy()
    for t in range(200):  # 8 s of prefill every 0.15 s: far more than two devices can do
        p.observe(t * 0.15, 2000)
    p.update(30.0, _loads())
    assert len(p.prefill) == len(DEVICES) - 1


def test_a_device_goes_back_within_seconds_once_long_prompts_stop_and_its_queue_is_empty():
    p = _policy()
    for t in range(0, 10, 2):  # a 3.6 s prompt every 2 s (under a device's worth): one device stays dedicated
        p.observe(float(t), 900)
        changes = p.update(t + 1.0, _loads())
        assert changes == [] if t else [(c.device, c.role) for c in changes] == [("d1", "prefill")]
    assert p.prefill == {"d1"}
    last = 8.0
    assert p.update(last + p.idle_s / 2, _loads()) == []       # the last long prompt is recent
    assert p.update(last + p.idle_s, _loads()) == []           # demand gone: the hold starts
    busy = _loads(queued=(0, 3000, 0))
    assert p.update(last + p.idle_s + p.hold_s, busy) == []    # still prefilling: it keeps its role
    changes = p.update(last + p.idle_s + p.hold_s + 0.5, _loads())
    assert [(c.device, c.role) for c in changes] == [("d1", "adaptive")] and p.prefill == set()
    assert last + p.idle_s + p.hold_s + 0.5 - last <= 5.0     # the target: back within 5 s
    p.observe(40.0, 2000)  # and dedicated again at once by the next long prompt
    assert [(c.device, c.role) for c in p.update(40.0, _loads())] == [("d1", "prefill")]


def test_request_roles_long_prompts_prefill_on_a_prefill_device_short_ones_stay_colocated():
    p = _policy()
    p.observe(0.0, 2000)
    p.update(0.0, _loads(decodes=(3, 1, 2)))
    slo, limits = p.slo, p.limits
    long = choose_placement(p.cost, limits, slo, p.request_loads(_loads(decodes=(3, 1, 2)), long=True), 2000, 128)
    assert long.prefill == "d1" and long.decode in ("d0", "d2")
    short = choose_placement(p.cost, limits, slo, p.request_loads(_loads(decodes=(3, 1, 2)), long=False), 100, 64)
    assert short.prefill == short.decode and short.decode != "d1"  # a prefill device takes no new decodes


def test_a_short_prompt_prefills_on_the_prefill_device_when_its_own_queue_would_miss_the_ttft():
    """While d1 is dedicated, a short prompt behind 1,000 queued prompt tokens on each decoding device (4.2 s)
    prefills on d1 instead: it waits there for the running chunk of d1's long prompt (512 tokens), not for all
    of it (deadline order sets the long prompt aside), and decodes on another device. With nothing queued where
    it decodes it stays colocated."""
    p = _policy()
    p.observe(0.0, 2000)
    p.update(0.0, _loads())
    assert p.prefill == {"d1"}
    slo, limits = p.slo, p.limits
    busy = [replace(x, queued_prompts=(x.queued_prefill_tokens,)) for x in _loads(queued=(1000, 2000, 1000))]
    short = choose_placement(p.cost, limits, slo, p.request_loads(busy, long=False), 50, 64)
    assert short.prefill == "d1" and short.decode in ("d0", "d2") and short.ttft < slo.ttft_s
    idle = [replace(x, queued_prompts=(2000,) if x.name == "d1" else ()) for x in _loads(queued=(0, 2000, 0))]
    short = choose_placement(p.cost, limits, slo, p.request_loads(idle, long=False), 50, 64)
    assert short.prefill == short.decode and short.decode != "d1"


@pytest.mark.parametrize("queued", [(0, 0, 0), (0, 5000, 0)])
def test_give_back_picks_the_prefill_device_with_the_least_queued(queued):
    p = _policy()
    p.prefill = {"d1", "d2"}
    c = p.give_back(0.0, _loads(queued=queued), "test")
    assert c.role == "adaptive" and c.device == ("d1" if queued == (0, 0, 0) else "d2")


def test_a_seat_is_freed_only_by_a_prefill_device_with_nothing_queued():
    p = _policy()
    p.prefill = {"d1"}
    assert p.free_a_seat(0.0, _loads(queued=(0, 2000, 0))) is None  # still prefilling: it keeps its role
    assert p.prefill == {"d1"}
    c = p.free_a_seat(0.0, _loads())
    assert (c.device, c.role) == ("d1", "adaptive") and p.prefill == set()
    assert p.free_a_seat(0.0, _loads()) is None  # none dedicated


def test_a_device_given_back_for_seats_is_not_dedicated_again_at_once_and_the_hold_doubles():
    # Seats run out while long prompts keep coming: before the hold, each long prompt re-dedicated the device
    # and the next placement gave it back (two role changes a second in the one-hour soak).
    p = _policy(devices=("d0", "d1"))
    loads = [DeviceLoad("d0", "adaptive", 0, 4, 400, 0), DeviceLoad("d1", "adaptive", 0, 1, 100, 0)]
    changes, t = 0, 0.0
    while t < 60.0:
        p.observe(t, 2000)
        changes += len(p.update(t, loads))
        if p.prefill and (c := p.free_a_seat(t, loads)) is not None:
            changes += 1
            assert "no dedication for" in c.reason
        t += 0.5
    # dedicated at 0, back at 0, then again after 5, 10, 20 s holds: 8 changes in a minute instead of 240
    assert changes == 8
    assert p.seat_hold_s == 40.0
    # Once seats stop running out for a while, the hold starts small again.
    p.prefill = {"d1"}
    p.free_a_seat(200.0, loads)
    assert p.seat_hold_s == 5.0 and p.seat_held_until == 205.0
    assert p.update(204.0, loads) == [] and p.prefill == set()
    p.observe(205.0, 2000)
    assert [c.role for c in p.update(205.0, loads)] == ["prefill"]
