"""The pending queue's dispatch order: oldest first, a request that does not fit is passed over (for a bounded
scan), and one passed over MAX_OVERTAKES times holds the queue until it is placed."""

from __future__ import annotations

from nodeserve.core.pending import MAX_OVERTAKES, MAX_SCAN, PendingQueue


def test_requests_that_fit_go_past_one_that_does_not_and_it_keeps_its_place():
    q: PendingQueue[str] = PendingQueue()
    for r in ["big", "a", "b"]:
        q.append(r)
    tried = []
    q.dispatch(lambda r: tried.append(r) or r != "big")
    assert tried == ["big", "a", "b"] and list(q) == ["big"] and q.num_overtaken[id("big")] == 2


def test_the_scan_past_a_blocked_request_is_bounded():
    q: PendingQueue[int] = PendingQueue()
    items = [1000 + i for i in range(MAX_SCAN + 10)]
    for r in items:
        q.append(r)
    tried = []
    q.dispatch(lambda r: tried.append(r) or False)  # nothing fits
    assert tried == items[:MAX_SCAN + 1] and len(q) == len(items)


def test_a_request_overtaken_often_enough_holds_the_queue_until_it_is_placed():
    q: PendingQueue[str] = PendingQueue()
    q.append("big")
    fits = {"big": False}
    for i in range(MAX_OVERTAKES + 3):
        q.append(f"s{i}")
        q.dispatch(lambda r: fits.get(r, True))
    # The first MAX_OVERTAKES went past it; the three after wait behind it.
    assert list(q) == ["big"] + [f"s{i}" for i in range(MAX_OVERTAKES, MAX_OVERTAKES + 3)]
    assert q.num_overtaken[id("big")] == MAX_OVERTAKES
    fits["big"] = True
    q.dispatch(lambda r: fits.get(r, True))
    assert len(q) == 0 and not q.num_overtaken
