"""runtime/node.py's pure helpers: which transfers exist and who lends a core to whom."""

from __future__ import annotations

import queue
from types import SimpleNamespace

from nodeserve.core.handoff import FreePages
from nodeserve.core.load import Role
from nodeserve.core.scheduler import WorkerLimits
from nodeserve.core.start import DeviceStart
from nodeserve.runtime.lending import slack_lenders
from nodeserve.runtime.node import kv_transfers

LIMITS = WorkerLimits(8, 64, 256)


def _starts(*roles: tuple[str, Role]) -> list[DeviceStart]:
    return [DeviceStart(name, role, LIMITS) for name, role in roles]


def test_prefill_devices_send_to_decode_devices_and_decode_devices_to_each_other_only():
    starts = _starts(("cpu:0", Role.PREFILL), ("cpu:1", Role.DECODE), ("cpu:2", Role.DECODE))
    devices = {s.name: SimpleNamespace(name=s.name) for s in starts}
    pools = {s.name: SimpleNamespace(device=s.name, heads=(range(3),)) for s in starts}
    inboxes = {s.name: queue.SimpleQueue() for s in starts}
    transfers = kv_transfers(starts, devices, pools, inboxes, None)
    assert {src: sorted(t) for src, t in transfers.items()} == \
        {"cpu:0": ["cpu:1", "cpu:2"], "cpu:1": ["cpu:2"], "cpu:2": ["cpu:1"]}
    t = transfers["cpu:0"]["cpu:2"]
    assert (t.src_pool, t.dst_pool) == (pools["cpu:0"], pools["cpu:2"])
    t.free_src_pages([3, 4], "event")  # the copy read the source's pages: they go back through its worker's inbox
    msg = inboxes["cpu:0"].get_nowait()
    assert isinstance(msg, FreePages) and (msg.pages, msg.read) == ([3, 4], "event")
    assert all(q.empty() for q in inboxes.values())


def test_a_decode_core_is_lent_between_steps_only_to_the_prefill_device_borrowing_it():
    assert slack_lenders([("cpu:0", Role.PREFILL), ("cpu:1", Role.DECODE)]) == {"cpu:1": "cpu:0"}
    # cpu:0 borrows cpu:1, cpu:1 borrows cpu:2, cpu:2 borrows cpu:0: only a decode lender of a prefill borrower
    assert slack_lenders([("cpu:0", Role.PREFILL), ("cpu:1", Role.DECODE), ("cpu:2", Role.DECODE)]) == \
        {"cpu:1": "cpu:0"}
    assert slack_lenders([("cpu:0", Role.COLOCATED), ("cpu:1", Role.COLOCATED)]) == {}
