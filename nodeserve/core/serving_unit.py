"""ServingUnit: a device as the control plane sees it. The seam between the policy (router, placer, load snapshots,
the simulator) and execution (a worker thread on a device).

The router places requests on serving units, reserves pages in their page-id space, sends them prompts and moves,
and changes their roles; runtime/loads.py reads their load. It never touches a device, a pool's tensors or a
thread. Two classes implement it: the runtime's Worker (one device, one thread) and the simulator's SimDevice (a
virtual device on a virtual clock). A tensor-parallel group (several devices that run one model shard each but
share one page-id space and one scheduler) is a third: the router needs no change for it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from nodeserve.core.handoff import Arrival, FreePages, Handoff, Migrate
from nodeserve.core.load import Role
from nodeserve.core.request import Request
from nodeserve.core.scheduler import PageLoad, Scheduler, WorkerLimits
from nodeserve.kv.manager import KVManager
from nodeserve.kv.window import WindowKV, WindowPages


class StepTiming(Protocol):
    """What load snapshots read of one step (runtime/loads.prefill_share)."""

    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def num_prefill_tokens(self) -> int: ...


class StepRecords(Protocol):
    """A unit's recent steps, oldest first (runtime/records.RecordLog)."""

    def since(self, end: float) -> Sequence[StepTiming]: ...


class ServingUnit(Protocol):
    """What the control plane reads of and does to one place a request can run.

    Read: `name`, `role` (the router also sets it, on a placer's role change), `limits` (its decode seats), `kv` (its
    pages: the router reserves there, the unit frees them), `scheduler` (its running and waiting sequences, for load
    snapshots), `records` (its recent steps), `num_outstanding_prefill_tokens` (prompt tokens sent, not yet
    prefilled), `failure` (why it is taken for dead, or None). Done to it: add_prefill (a placed prompt) and send (a
    move elsewhere). Both return at once; the unit acts on them between its steps, on its own thread or clock. In
    adaptive mode the router also switches its scheduler's cap on prompt tokens beside decodes with the roles
    (Router.cap_prompts_beside_decodes), read at its next step."""

    @property
    def name(self) -> str: ...
    role: Role
    @property
    def limits(self) -> WorkerLimits: ...
    @property
    def kv(self) -> KVManager: ...
    @property
    def window(self) -> WindowKV | None: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def records(self) -> StepRecords: ...
    @property
    def num_outstanding_prefill_tokens(self) -> int: ...
    @property
    def failure(self) -> str | None: ...

    def add_prefill(self, req: Request, pages: list[int], handoff: Handoff | None = None,
                    load: PageLoad | None = None, num_own_pages: int = -1, window: WindowPages | None = None) -> None:
        """Prefill `req` here on `pages` (reserved by the router): its decode pages, or with a handoff its prompt's
        pages, whose KV then goes to handoff.target. The first num_own_pages were cached here; `load` fills the
        pages after them from other devices or tiers first; `window`: its windowed layers' pages here, if any."""

    def send(self, msg: Arrival | FreePages | Migrate | None) -> None:
        """Migrate: move a request decoding here to msg.handoff.target (pages reserved there). The others are what a
        unit sending this one KV tells it (core/handoff.py): a ServingUnit is a HandoffTarget too."""
