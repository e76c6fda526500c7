"""The KV handoff between two devices, in one place: what a request's move carries, the messages a worker
receives, which pages each step copies, and the rounds of a live migration.

A request moves from a source device to a target device in one of two ways:
  - prefilled on the source for the target (disaggregated, or an adaptive cross placement): each prefill chunk's
    pages are copied layer by layer as the forward writes them (`copy_plan`), then `finish` hands it over;
  - decoding on the source, moved live (adaptive mode: the source was dedicated to prefill, or an operator asked):
    rounds of pre-copy send the pages filled since the last round while it keeps decoding there; once a round
    leaves at most STOP_PAGES to send, it leaves the source's batch between two steps, the rest is copied, and it
    resumes on the target (`next_migration_step`). Downtime is that last copy, not the whole context's.
Pages on the target are reserved before anything is copied (by the router), so a move never waits for space.
A copy is only committed to a handoff's counters once the forward that wrote its pages succeeded: a failed
batch's solo retry sends them again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

from nodeserve.core.request import Request

STOP_PAGES = 2    # a round that leaves at most this many pages to send ends the pre-copy: stop and copy the rest
MAX_ROUNDS = 8    # pre-copy rounds before a migration that does not converge is given up (the request stays)


class HandoffTarget(Protocol):
    """Where a handoff's KV goes, as the device sending it sees it: a name (its transfer there is found by it) and
    an inbox (what ended: the pages it may free, the request's arrival). core.serving_unit.ServingUnit is one."""

    @property
    def name(self) -> str: ...

    def send(self, msg: Arrival | FreePages | Migrate | None) -> None: ...


@dataclass
class Handoff:
    """Where a request's KV goes: the target device's worker and the pages reserved there, the first
    num_cached_pages of which already hold its prefix (shared from the target's prefix cache)."""

    target: HandoffTarget
    pages: list[int]
    num_cached_pages: int = 0
    window: Any = None  # kv.window.WindowPages: its windowed layers' pages on the target, if the model has some
    num_sent_pages: int = field(init=False)  # pages below this are there whole, cached or copied
    num_copied_pages: int = 0  # pages copied so far, counting a partly written page each time it is sent

    def __post_init__(self) -> None:
        self.num_sent_pages = self.num_cached_pages


class MigrationOutcome(enum.StrEnum):
    MOVED = "moved"            # it resumed on the target
    FINISHED = "finished"      # it ended (or was aborted) on the source first
    NOT_RUNNING = "not_running"  # it was not decoding on the source (its KV still on its way there)
    NO_CONVERGENCE = "no_convergence"  # MAX_ROUNDS passed with more than STOP_PAGES left each time
    FAILED = "failed"          # a copy failed: the request fails with it


@dataclass
class Migration:
    """A live migration in progress on the source device."""

    handoff: Handoff
    live: bool = True           # False: stop and copy at once (the old behaviour, for comparison)
    num_rounds: int = 0
    round_done: bool = True     # the last round's copies have run (set from the copy thread)


class MigrationStep(enum.Enum):
    WAIT = "wait"      # a round is still copying
    ROUND = "round"    # pre-copy the pages filled since the last round
    STOP = "stop"      # stop decoding here, copy the rest, resume on the target
    GIVE_UP = "give_up"


def next_migration_step(m: Migration, num_computed_tokens: int, page_size: int) -> MigrationStep:
    """What a migrating request does between two steps, from its KV written so far."""
    if not m.round_done:
        return MigrationStep.WAIT
    left = -(-num_computed_tokens // page_size) - m.handoff.num_sent_pages  # the partial page counts
    if not m.live or left <= STOP_PAGES:
        return MigrationStep.STOP
    if m.num_rounds >= MAX_ROUNDS:
        return MigrationStep.GIVE_UP
    return MigrationStep.ROUND


# ---- worker inbox messages. None only wakes the loop. -------------------------------------------------------
@dataclass
class Prefill:
    seq: Any  # scheduler.Seq


@dataclass
class Arrival:
    """A request whose KV transfer ended: `landed` marks its last copy; error if one failed."""

    req: Request
    pages: list[int]
    num_cached_pages: int  # pages that held its prefix before the copy (from this device's prefix cache)
    landed: Any
    error: str | None
    migrated_at: float | None = None  # a live migration's stop, for its downtime
    num_copied_pages: int = 0
    window: Any = None  # kv.window.WindowPages: its windowed layers' pages here (Handoff.window)


@dataclass
class Migrate:
    """A request placed on this device for decode moves to handoff.target (whose pages the router reserved):
    decoding, live (Migration); still prefilling here, its KV is sent by the layer hook from the first page."""

    req: Request
    handoff: Handoff
    live: bool = True


@dataclass
class FreePages:
    """Pages to free once this device's stream has waited on `read` (a transfer read them, or wrote them)."""

    pages: list[int]
    read: Any
    window: Any = None  # kv.window.WindowPages to release with them


# ---- which pages a step copies ---------------------------------------------------------------------------
@dataclass
class PageCopy:
    """Pages one step sends to one target, for every layer as the forward finishes it."""

    target: HandoffTarget
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


@dataclass
class CopyPlan:
    copies: list[PageCopy]
    # (handoff, num_sent_pages, pages copied) to commit per batch index, once that sequence's forward succeeded
    commits: dict[int, tuple[Handoff, int, int]]

    def commit(self, which: Iterable[int]) -> None:
        for i in which:
            if i in self.commits:
                h, sent, copied = self.commits[i]
                h.num_sent_pages = sent
                h.num_copied_pages += copied


def copy_plan(items: Iterable[tuple[int, str, Sequence[int], Handoff, int, int]], page_size: int) -> CopyPlan:
    """items: (batch index, request id, page table, handoff, num_computed_tokens, chunk tokens) of each chunk bound
    for another device. Sends from the first page not yet there whole (on the first chunk, that can be a page the
    source had cached and the target has not) to the last this chunk writes; none the target holds."""
    by_target: dict[int, PageCopy] = {}
    commits: dict[int, tuple[Handoff, int, int]] = {}
    for i, request_id, table, h, computed, n in items:
        first, last = h.num_sent_pages, (computed + n - 1) // page_size
        commits[i] = (h, max(first, (computed + n) // page_size), max(last + 1 - first, 0))
        if first > last:
            continue
        c = by_target.setdefault(id(h.target), PageCopy(h.target))
        c.src.extend(table[first:last + 1])
        c.dst.extend(h.pages[first:last + 1])
        c.request_ids.append(request_id)
    return CopyPlan(list(by_target.values()), commits)
