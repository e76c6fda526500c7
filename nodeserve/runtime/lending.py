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

from nodeserve.core.load import Role
from nodeserve.device.cpu import CPUDevice
from nodeserve.kernels import native

log = logging.getLogger(__name__)

# Lending between steps (devices.lend_between_steps): a decode device's streams tolerate inter-token gaps up to
# their TPOT target, and a decode step of 16 streams takes 30-40 ms of a 100 ms target on the 2-core EPYC; the rest
# can go to a prefill device whose queue keeps long prompts past their TTFT target.
LEND_GAP_SHARE = 0.6       # of slo.tpot_s: the inter-token gap lending may stretch a decode batch's to
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
    def build(devices: Sequence) -> CoreLending | None:
        """Helpers for these devices' workers; None when there is nothing to lend (one device, a GPU among them,
        or no native kernels). Call before the workers start."""
        kernels = native.load()
        if len(devices) < 2 or not all(isinstance(d, CPUDevice) for d in devices) or kernels is None:
            log.info("lend_idle_cores: nothing to lend (needs two or more CPU devices and the native kernels)")
            return None
        lending = CoreLending(kernels)
        lib = kernels.lib
        for d in devices:
            h = lib.ns_helper_new(d.core)
            if not h:
                lending.stop()
                log.warning("lend_idle_cores: a helper thread could not start; cores are not lent")
                return None
            lending.helpers.append(h)
        for i, d in enumerate(devices):
            borrowed, own = lending.helpers[lender_of(i, len(devices))], lending.helpers[i]
            d.on_thread_start = lambda h=borrowed: lib.ns_helper_use(h)
            d.on_lend = lambda idle, own=own, borrowed=borrowed: (lib.ns_helper_lend(own, int(idle)),
                                                                  lib.ns_helper_want(borrowed, int(not idle)))
        log.info("lend_idle_cores: %s", ", ".join(f"{d.name} borrows {devices[lender_of(i, len(devices))].name}'s "
                                                  "core while it idles" for i, d in enumerate(devices)))
        return lending

    def lend_between_steps(self, workers: Sequence, max_gap_s: float) -> None:
        """Each decode worker whose core a prefill worker borrows lends it between its steps too (SlackLending).
        workers: in the order of build's devices."""
        for i, borrower in enumerate(workers):
            w = workers[lender_of(i, len(workers))]
            if w.role == Role.DECODE and borrower.role == Role.PREFILL:
                w.slack_lending = SlackLending(lambda b=borrower: b.num_outstanding_prefill_tokens, max_gap_s)
                log.info("lend_between_steps: %s lends its core to %s between steps while %s has %d or more "
                         "prompt tokens queued (inter-token gaps up to %.0f ms)", w.name, borrower.name,
                         borrower.name, MIN_BACKLOG_TOKENS, max_gap_s * 1000)

    def num_jobs(self) -> list[int]:
        """Halves each helper has run (one per device, in build order)."""
        return [self.kernels.lib.ns_helper_jobs(h) for h in self.helpers]

    def stop(self) -> None:
        """After the workers have stopped."""
        for h in self.helpers:
            self.kernels.lib.ns_helper_free(h)
        self.helpers = []


@dataclass
class SlackLending:
    """A decode device's core lent to the prefill device that borrows it, between decode steps, while that
    device has at least MIN_BACKLOG_TOKENS prompt tokens queued: each pause lasts until max_gap_s after the
    step's start, so no stream's inter-token gap grows past it. The pause is the worker's (it sleeps, lent)."""

    backlog: Callable[[], int]  # the borrowing prefill device's queued prompt tokens
    max_gap_s: float

    def pause(self, step_start: float, now: float) -> float:
        """Seconds to lend the core now, after a decode step that started at step_start; 0: none."""
        if self.backlog() < MIN_BACKLOG_TOKENS:
            return 0.0
        seconds = self.max_gap_s - (now - step_start)
        return seconds if seconds >= MIN_SLICE_S else 0.0
