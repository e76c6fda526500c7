"""The seam's two implementations: the runtime's Worker and the simulator's SimDevice are ServingUnits. mypy checks
this file (pyproject.toml [tool.mypy] files): a member either drops or retypes fails the type check in CI; the test
below checks the same members exist at run time."""

from __future__ import annotations

import inspect

from nodeserve.core.handoff import HandoffTarget
from nodeserve.core.serving_unit import ServingUnit
from nodeserve.plan.simulate import SimDevice
from nodeserve.runtime.worker import Worker


def as_units(worker: Worker, device: SimDevice) -> tuple[ServingUnit, ServingUnit, HandoffTarget, HandoffTarget]:
    """Never called: the type checker's proof that both classes implement the seam (and take a handoff's KV)."""
    return worker, device, worker, device


def test_both_implementations_have_every_member_of_the_seam():
    members = {n for n in vars(ServingUnit) if not n.startswith("_")} | set(ServingUnit.__annotations__)
    assert members >= {"name", "role", "limits", "kv", "scheduler", "records", "num_outstanding_prefill_tokens",
                       "failure", "add_prefill", "send"}
    for cls in (Worker, SimDevice):
        init = inspect.getsource(cls.__init__)
        missing = [m for m in members if not hasattr(cls, m) and f"self.{m}" not in init]
        assert missing == [], (cls.__name__, missing)
