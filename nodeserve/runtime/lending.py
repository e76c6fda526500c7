"""Idle CPU cores lent to busy devices (`devices.lend_idle_cores`): each CPU device's worker borrows a helper
thread pinned to the next device's core, and that device lends its core while its worker waits for work. The
native GEMMs then split their output rows with the helper (kernels/csrc/lend.c), so one decode stream or one long
prompt reads the weights with two cores' bandwidth while the other device idles, and gives the core back before
the other device's next step. CPU only: a GPU's kernels already use the whole device.

A disaggregated decode device also lends its core between its steps to the prefill device that borrows it
(`devices.lend_between_steps`, SlackLending), within its streams' TPOT target."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

from nodeserve.core.load import GAP_SHARE, Role
from nodeserve.kernels import native

log = logging.getLogger(__name__)

# Lending between steps (devices.lend_between_steps): a decode device's streams tolerate inter-token gaps up to
# their TPOT target, and a decode step of 16 streams takes 30-40 ms of a 100 ms target on the 2-core EPYC; the rest
# can go to a prefill device whose queue keeps long prompts past their TTFT target.
LEND_GAP_SHARE = GAP_SHARE  # of slo.tpot_s: the inter-token gap lending may stretch a decode batch's to
MIN_BACKLOG_TOKENS = 1024  # prompt tokens queued on the prefill device (one full step) before it is worth it:
                           # a short prompt's prefill ends before a lent slice helps it
MIN_SLICE_S = 0.005        # shorter slices are not worth waking the helper for


def lender_of(i: int, num_devices: int) -> int:
    """The device whose core device i borrows (build order): the next one."""
    return (i + 1) % num_devices


@dataclass
class CoreLending:
    kernels: native.NativeKernels
    helpers: list[int] = field(default_factory=list)  # ns_helper pointers, one per device, pinned to its core

    @staticmethod
    def build(device_names: Sequence[str]) -> CoreLending | None:
        """Helpers for these devices, one pinned to each one's core; None when there is nothing to lend (one
        device, a GPU among them, or no native kernels). Before the devices are built: they take hooks(i)."""
        kernels = native.load()
        if len(device_names) < 2 or not all(n.startswith("cpu:") for n in device_names) or kernels is None:
            log.info("lend_idle_cores: nothing to lend (needs two or more CPU devices and the native kernels)")
            return None
        lending = CoreLending(kernels)
        for name in device_names:
            h = kernels.lib.ns_helper_new(int(name[4:]))
            if not h:
                lending.stop()
                log.warning("lend_idle_cores: a helper thread could not start; cores are not lent")
                return None
            lending.helpers.append(h)
        log.info("lend_idle_cores: %s", ", ".join(
            f"{n} borrows {device_names[lender_of(i, len(device_names))]}'s core while it idles"
            for i, n in enumerate(device_names)))
        return lending

    def hooks(self, i: int) -> tuple[Callable[[], None], Callable[[bool], None]]:
        """Device i's (on_thread_start, on_lend) for its CPUDevice: its worker thread borrows the next device's
        helper, and lends its own core's helper while it idles."""
        lib = self.kernels.lib
        borrowed, own = self.helpers[lender_of(i, len(self.helpers))], self.helpers[i]
        return (lambda: lib.ns_helper_use(borrowed),
                lambda idle: (lib.ns_helper_lend(own, int(idle)), lib.ns_helper_want(borrowed, int(not idle))))

    def num_jobs(self) -> list[int]:
        """Halves each helper has run (one per device, in build order)."""
        return [self.kernels.lib.ns_helper_jobs(h) for h in self.helpers]

    def stop(self) -> None:
        """After the workers have stopped."""
        for h in self.helpers:
            self.kernels.lib.ns_helper_free(h)
        self.helpers = []


def slack_lenders(roles: Sequence[tuple[str, Role]]) -> dict[str, str]:
    """devices.lend_between_steps: each decode device whose core a prefill device borrows (lender_of) lends it
    between its steps too. `roles`: (device, role) in the order lending was built; returns {lender: borrower}."""
    pairs = {}
    for i, (borrower, role) in enumerate(roles):
        lender, lender_role = roles[lender_of(i, len(roles))]
        if lender_role == Role.DECODE and role == Role.PREFILL:
            pairs[lender] = borrower
    return pairs


@dataclass
class SlackLending:
    """A decode device's core lent to the prefill device that borrows it, between decode steps, while that
    device has at least MIN_BACKLOG_TOKENS prompt tokens queued: each pause lasts until max_gap_s after the
    step's start, so no stream's inter-token gap grows past it. The pause is the worker's (it sleeps, lent)."""

    backlog: Callable[[], int]  # the borrowing prefill device's queued prompt tokens
    max_gap_s: float

    def wanted(self) -> bool:
        """Whether the borrower's backlog asks for the core between steps now."""
        return self.backlog() >= MIN_BACKLOG_TOKENS

    def pause(self, step_start: float, now: float) -> float:
        """Seconds to lend the core now, after a decode step that started at step_start; 0: none."""
        if not self.wanted():
            return 0.0
        seconds = self.max_gap_s - (now - step_start)
        return seconds if seconds >= MIN_SLICE_S else 0.0
