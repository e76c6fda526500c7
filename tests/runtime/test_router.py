"""Router: admission, decode seats and pages, device choice; on stub workers, no model and no threads."""

from __future__ import annotations

import pytest

from types import SimpleNamespace

from nodeserve.core.handoff import Handoff, Migrate, MigrationOutcome
from nodeserve.core.load import Role
from nodeserve.core.placer import Decision
from nodeserve.core.roles import RoleChange
from nodeserve.core.pending import MAX_OVERTAKES
from nodeserve.runtime.router import QueueFull, Router, TooLarge
from nodeserve.runtime.records import RecordLog
from nodeserve.runtime.worker import StepRecord, WorkerLimits
from nodeserve.kv.manager import KVManager, OutOfPages
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams


class StubWorker:
    """A serving unit (core/serving_unit.py): what the router reads and calls on a worker."""

    def __init__(self, name: str, num_pages: int, max_num_seqs: int = 64, role: Role = Role.DECODE):
        self.name, self.role = name, role
        self.kv = KVManager(num_pages, 16)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.records = RecordLog(StepRecord, 100)
        self.sent = []
        self.send = self.sent.append
        self.limits = WorkerLimits(max_num_seqs, 1024, 8192)
        self.num_outstanding_prefill_tokens = 0
        self.failure = None
        self.window = None  # no windowed layers
        self.prefills: list[tuple[Request, list[int], Handoff | None]] = []

    def add_prefill(self, req: Request, pages: list[int], handoff: Handoff | None = None, load=None,
                    num_own_pages: int = -1, window=None) -> None:
        self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        self.prefills.append((req, pages, handoff))

    def __repr__(self) -> str:
        return self.name


def _req(rid: str, num_prompt_tokens: int, max_tokens: int = 16) -> Request:
    return Request(rid, [1] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens))


def _finish(router: Router, worker: StubWorker, req: Request, pages: list[int]) -> None:
    """What the decode worker holding a finished request does: free its pages and report the release."""
    worker.kv.free(pages)
    router.release(req)
    router.dispatch()


def test_a_decode_device_takes_no_more_requests_than_it_can_batch():
    """Short prompts prefilled on their decode device (local_prefill_threshold) must not starve behind handoffs:
    a decode device is assigned at most max_num_seqs requests, so its batch always has a seat for them."""
    prefill, decode = StubWorker("cpu:0", 100, role=Role.PREFILL), StubWorker("cpu:1", 100, max_num_seqs=2)
    router = Router([prefill], [decode], local_prefill_threshold=64, max_waiting=8, max_queued_tokens=10_000)
    longs = [_req(f"long{i}", 100) for i in range(3)]
    short = _req("short", 10)
    for r in longs + [short]:
        router.admit(r)
    assert router.num_seats_taken[decode] == 2 and router.num_pending == 2
    assert [p[0] for p in prefill.prefills] == longs[:2] and decode.prefills == []
    # A remote prefill carries its decode pages in its handoff, and its prompt pages there are taken with them.
    req, pages, handoff = prefill.prefills[0]
    assert len(pages) == prefill.kv.pages_for(100) and handoff.target is decode
    assert len(handoff.pages) == decode.kv.pages_for(115)
    _finish(router, decode, longs[0], handoff.pages)
    assert router.num_seats_taken[decode] == 2 and [p[0] for p in prefill.prefills] == longs
    assert router.num_pending == 1
    _finish(router, decode, longs[1], prefill.prefills[1][2].pages)
    assert router.num_seats_taken[decode] == 2 and router.num_pending == 0
    assert [(p[0], p[2]) for p in decode.prefills] == [(short, None)] and len(decode.prefills[0][1]) == 2


def test_requests_wait_for_decode_pages_and_go_to_the_device_with_the_most_free():
    a, b = StubWorker("cpu:0", 10), StubWorker("cpu:1", 12)
    router = Router([], [a, b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000)
    first, second, third = _req("1", 100, 60), _req("2", 100, 60), _req("3", 100, 60)  # 10 pages each
    for r in (first, second, third):
        router.admit(r)
    assert [p[0] for p in b.prefills] == [first] and [p[0] for p in a.prefills] == [second]
    assert router.num_pending == 1 and router.placements == {"1": b, "2": a}
    _finish(router, a, second, a.prefills[0][1])
    assert [p[0] for p in a.prefills] == [second, third] and router.num_pending == 0
    assert a.kv.num_used == 10 and b.kv.num_used == 10


def test_admission_refuses_what_can_never_fit_and_what_would_overflow_the_queue():
    decode = StubWorker("cpu:0", 4)  # 64 tokens
    router = Router([], [decode], local_prefill_threshold=0, max_waiting=1, max_queued_tokens=100)
    with pytest.raises(TooLarge):
        router.admit(_req("big", 60, max_tokens=10))
    router.admit(_req("fits", 40, max_tokens=10))  # 49 tokens: 4 pages, placed at once
    router.admit(_req("waits", 40, max_tokens=10))
    with pytest.raises(QueueFull):
        router.admit(_req("full", 5))
    assert router.num_pending == 1 and not router.abort_pending(_req("other", 1))


def test_a_request_goes_where_its_prefix_is_cached_and_shares_those_pages():
    from nodeserve.kv.manager import hash_pages

    a, b = StubWorker("cpu:0", 40), StubWorker("cpu:1", 30)
    for w in (a, b):
        w.kv.prefix_cache = True
    prompt = list(range(100))  # 6 full pages of 16, and 4 tokens
    held = b.kv.allocate(7)
    b.kv.publish(held[:6], hash_pages(prompt, 16))
    b.kv.free(held)
    router = Router([], [a, b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000)
    req = Request("r", prompt + [7] * 20, SamplingParams(max_tokens=16))
    router.admit(req)
    # cpu:1 has fewer free pages but holds the first 6 pages of the prompt: they are its first 6 pages.
    assert b.prefills == [(req, held[:6] + b.prefills[0][1][6:], None)] and a.prefills == []
    assert req.num_cached_tokens == req.num_computed_tokens == 96 and b.kv.num_hit_tokens == 96
    # A prefill placed elsewhere carries the decode side's hit in its handoff, so only the rest is copied.
    p = StubWorker("cpu:2", 40, role=Role.PREFILL)
    router2 = Router([p], [b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000)
    other = Request("o", prompt + [9] * 20, SamplingParams(max_tokens=16))
    router2.admit(other)
    assert p.prefills[0][2].num_cached_pages == 6 and other.num_computed_tokens == 0


class PlacerStub:
    """A placer that sends every request to a fixed (prefill, decode) pair and counts observations."""

    def __init__(self, prefill: StubWorker, decode: StubWorker):
        self.pair, self.observed = (prefill, decode), []

    def observe(self, now, loads, req: Request) -> None:
        self.observed.append(req.request_id)

    def place(self, now, loads, req: Request) -> Decision:
        return Decision(self.pair[0].name, self.pair[1].name)


def test_a_placer_picks_both_devices_and_a_cross_placement_carries_the_decode_pages():
    a, b = StubWorker("cpu:0", 20), StubWorker("cpu:1", 20)
    router = Router([], [a, b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000,
                    placer=PlacerStub(a, b))
    cross = _req("x", 40)
    router.admit(cross)
    router.placer.pair = (b, b)
    local = _req("l", 40)
    router.admit(local)
    assert router.placer.observed == ["x", "l"]
    [(req, pages, handoff)] = a.prefills
    assert req is cross and len(pages) == 3 and handoff.target is b and len(handoff.pages) == b.kv.pages_for(55)
    assert [(p[0], p[2]) for p in b.prefills] == [(local, None)]
    assert router.placements == {"x": b, "l": b} and router.num_seats_taken[b] == 2 and a.kv.num_used == 3


def test_a_cross_placement_that_fails_to_send_gives_back_its_pages_on_both_devices():
    a, b = StubWorker("cpu:0", 20), StubWorker("cpu:1", 20)
    router = Router([], [a, b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000,
                    placer=PlacerStub(a, b))
    failed = []
    router.on_placement_failed = failed.append

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    a.add_prefill = broken
    req = _req("x", 40)
    router.admit(req)
    assert failed == [req] and router.num_pending == 0
    assert (a.kv.num_used, b.kv.num_used) == (0, 0) and router.placements == {} and router.num_seats_taken[b] == 0


def _adaptive(*sizes):
    workers = [StubWorker(f"cpu:{i}", n, role=Role.ADAPTIVE) for i, n in enumerate(sizes)]
    return workers, Router([], workers, local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000,
                           placer=PlacerStub(workers[0], workers[0]))


def test_move_decodes_reserves_on_the_target_and_holds_both_seats_until_the_source_says():
    (a, b, c), router = _adaptive(20, 20, 6)
    reqs = [_req(str(i), 40) for i in range(3)]
    for r in reqs:
        router.admit(r)
    reqs[2].finished = True  # ended meanwhile: its release is on its way, it does not move
    assert router.move_decodes(a) == 2
    moves = a.sent
    assert [m.req for m in moves] == reqs[:2] and all(isinstance(m, Migrate) and m.live for m in moves)
    # b has the most free pages for both (c is smaller); a seat is held on both sides while they move.
    assert [m.handoff.target for m in moves] == [b, b] and b.kv.num_used == 2 * b.kv.pages_for(55)
    assert router.placements == {"0": a, "1": a, "2": a}
    assert router.num_seats_taken[a] == 3 and router.num_seats_taken[b] == 2
    router.on_migrated(reqs[0], MigrationOutcome.MOVED, 0.02)
    assert router.placements["0"] is b and router.num_seats_taken[a] == 2 and router.num_seats_taken[b] == 2
    router.release(reqs[1])  # ended while moving: both its seats go
    assert router.num_seats_taken[a] == 1 and router.num_seats_taken[b] == 1
    assert router.num_migrations == {MigrationOutcome.MOVED: 1} and list(router.migration_downtimes) == [0.02]


class RolePlacerStub(PlacerStub):
    """Places every request on the first device and makes the role changes queued in `changes`."""

    def __init__(self, device: StubWorker):
        super().__init__(device, device)
        self.changes: list[RoleChange] = []

        self.moves_from: tuple[str, ...] = ()

    def place(self, now, loads, req: Request) -> Decision:
        changes, self.changes = tuple(self.changes), []
        moves, self.moves_from = self.moves_from, ()
        return Decision(self.pair[0].name, self.pair[1].name, changes, moves)


def test_adaptive_devices_cap_prompts_beside_decodes_only_while_another_device_prefills_for_them():
    (a, b, c), router = _adaptive(20, 20, 20)
    router.placer = placer = RolePlacerStub(a)
    assert [w.scheduler.caps_prefill_with_decodes for w in (a, b, c)] == [False] * 3  # colocated mode's way
    placer.changes = [RoleChange(0.0, "cpu:2", Role.PREFILL, "long prompts")]
    router.admit(_req("r1", 40))
    assert c.role is Role.PREFILL and [a.scheduler.caps_prefill_with_decodes, b.scheduler.caps_prefill_with_decodes] \
        == [True, True]  # a disaggregated decode device's way
    placer.changes = [RoleChange(1.0, "cpu:2", Role.ADAPTIVE, "no long prompt")]
    router.admit(_req("r2", 40))
    assert [w.scheduler.caps_prefill_with_decodes for w in (a, b, c)] == [False] * 3


def test_a_request_placed_as_its_prefill_device_is_dedicated_keeps_the_seat_the_moves_would_take():
    """Two seats a device, one request decoding on each; a long prompt dedicates cpu:0 and is to decode on cpu:1.
    Its seat is taken before cpu:0's decode moves, so that one finds no seat and stays (decoding beside the
    prefills) instead of pushing cpu:1 to three requests, one more than a step takes."""
    a, b = StubWorker("cpu:0", 40, max_num_seqs=2, role=Role.ADAPTIVE), StubWorker("cpu:1", 40, max_num_seqs=2,
                                                                                 role=Role.ADAPTIVE)
    router = Router([], [a, b], local_prefill_threshold=0, max_waiting=8, max_queued_tokens=10_000)
    router.placer = placer = RolePlacerStub(a)
    router.admit(_req("on-a", 20))
    placer.pair = (b, b)
    router.admit(_req("on-b", 20))
    placer.pair, placer.changes, placer.moves_from = (a, b), [RoleChange(0.0, "cpu:0", Role.PREFILL, "long")], \
        ("cpu:0",)
    router.admit(_req("long", 100))
    assert router.placements["long"] is b and a.sent == [] and router.moving == {}
    assert router.num_seats_taken[b] == 2 and router.num_seats_taken[a] == 1


class TickPlacerStub(RolePlacerStub):
    """... and makes them between placements too (Placer.roles), a device given back taking decodes."""

    def roles(self, now, loads) -> Decision:
        changes, self.changes = tuple(self.changes), []
        return Decision(None, None, changes, moves_to=tuple(c.device for c in changes if c.role == Role.ADAPTIVE))


def test_a_device_given_back_between_placements_takes_a_share_of_the_other_devices_decodes():
    """A burst placed while cpu:0 was dedicated all decodes on cpu:1; cpu:0, given back by the role tick with no
    request to place, takes the requests with the most output left until the batches are about even."""
    (a, b), router = _adaptive(40, 40)
    router.placer = placer = TickPlacerStub(b)
    a.role = Role.PREFILL
    reqs = [_req(str(i), 20, max_tokens=10 + i) for i in range(6)]
    for r in reqs:
        router.admit(r)
    for r in reqs[:5]:
        r.output_ids.append(1)  # decoding; the last one is still prefilling and stays
    assert router.update_roles() and a.sent == b.sent == []  # nothing due: cpu:0 stays dedicated
    placer.changes = [RoleChange(5.0, "cpu:0", Role.ADAPTIVE, "no long prompt")]
    assert not router.update_roles()  # no device dedicated any more
    assert a.role is Role.ADAPTIVE and [m.req for m in b.sent] == [reqs[4], reqs[3]]
    assert all(isinstance(m, Migrate) and m.live and m.handoff.target is a for m in b.sent)
    assert router.num_seats_taken[a] == 2 and router.num_seats_taken[b] == 6  # both held until the moves end


def test_a_move_of_a_request_whose_kv_is_in_flight_leaves_its_seat_and_frees_the_target_seat():
    """Race: moving a request not decoding on its source yet (its KV on its way there) moved its placement and
    seat at once; it then decoded on the source uncounted (over max_num_seqs) and skewed admission."""
    (a, b), router = _adaptive(20, 20)
    req = _req("r", 40)
    router.admit(req)
    assert router.migrate(req, b)
    assert router.num_seats_taken[a] == 1 and router.num_seats_taken[b] == 1
    router.on_migrated(req, MigrationOutcome.NOT_RUNNING, 0.0)  # what the source's worker answers
    assert router.placements == {"r": a} and router.num_seats_taken[a] == 1 and router.num_seats_taken[b] == 0
    router.release(req)
    assert router.num_seats_taken[a] == 0 and router.num_seats_taken[b] == 0


class RacingKV(KVManager):
    """A pool whose pages another thread takes between the snapshot and the allocation (adaptive mode: the worker
    thread allocates too): num_free says there is room, the allocation raises."""

    def allocate_prompt(self, hashes, num_prompt_tokens, count):
        raise OutOfPages("taken meanwhile")


def test_pages_taken_between_the_snapshot_and_the_allocation_leave_the_request_queued():
    """Race: OutOfPages between can_allocate and allocate escaped dispatch: a 500 for the request, which stayed
    in router.pending."""
    (a,), router = _adaptive(20)
    a.kv = RacingKV(20, 16)
    req = _req("r", 40)
    router.admit(req)  # no exception
    assert router.num_pending == 1 and a.prefills == [] and router.num_seats_taken[a] == 0
    a.kv = KVManager(20, 16)
    router.dispatch()
    assert router.num_pending == 0 and [p[0] for p in a.prefills] == [req]


def test_cross_placements_take_their_prompt_pages_at_once_so_two_devices_cannot_deadlock():
    """Race: A prefilling for B and B for A, each pool full of decode reservations for prompts that must prefill
    on the other, and no prompt page left on either: nothing moves again. A placement now takes the prompt's pages
    on the prefill device with the decode pages, or waits."""
    (a, b), router = _adaptive(4, 4)
    x, y = _req("x", 30, max_tokens=35), _req("y", 30, max_tokens=35)  # 4 decode pages, 2 prompt pages
    router.placer.pair = (a, b)
    router.admit(x)
    router.placer.pair = (b, a)
    router.admit(y)
    [(req, prompt_pages, handoff)] = a.prefills
    assert req is x and len(prompt_pages) == 2 and len(handoff.pages) == 4
    assert b.prefills == [] and router.num_pending == 1  # y waits: b has no room for its prompt


def test_a_request_that_does_not_fit_now_does_not_hold_up_those_behind_it_for_ever():
    (a,), router = _adaptive(20)
    router.admit(_req("first", 100, max_tokens=100))      # 13 pages
    huge = _req("huge", 20, max_tokens=200)                 # 14 pages: not now
    router.admit(huge)
    small = [_req(f"s{i}", 20, max_tokens=20) for i in range(3)]  # 3 pages each
    for r in small:
        router.admit(r)
    assert [p[0].request_id for p in a.prefills] == ["first", "s0", "s1"] and list(router.pending) == [huge, small[2]]
    # Passed over MAX_OVERTAKES times, it holds the queue: later requests wait behind it until it fits.
    router.pending.num_overtaken[id(huge)] = MAX_OVERTAKES
    _finish(router, a, small[0], a.prefills[1][1])
    assert list(router.pending) == [huge, small[2]]
