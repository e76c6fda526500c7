"""Idle CPU cores lent to busy devices (`devices.lend_idle_cores`): each CPU device's worker borrows a helper
thread pinned to the next device's core, and that device lends its core while its worker waits for work. The
native GEMMs then split their output rows with the helper (kernels/csrc/lend.c), so one decode stream or one long
prompt reads the weights with two cores' bandwidth while the other device idles, and gives the core back before
the other device's next step. CPU only: a GPU's kernels already use the whole device."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from nodeserve.device.cpu import CPUDevice
from nodeserve.kernels import native

log = logging.getLogger(__name__)


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
            borrowed, own = lending.helpers[(i + 1) % len(devices)], lending.helpers[i]
            d.on_thread_start = lambda h=borrowed: lib.ns_helper_use(h)
            d.on_lend = lambda idle, own=own, borrowed=borrowed: (lib.ns_helper_lend(own, int(idle)),
                                                                  lib.ns_helper_want(borrowed, int(not idle)))
        log.info("lend_idle_cores: %s", ", ".join(f"{d.name} borrows {devices[(i + 1) % len(devices)].name}'s "
                                                  "core while it idles" for i, d in enumerate(devices)))
        return lending

    def num_jobs(self) -> list[int]:
        """Halves each helper has run (one per device, in build order)."""
        return [self.kernels.lib.ns_helper_jobs(h) for h in self.helpers]

    def stop(self) -> None:
        """After the workers have stopped."""
        for h in self.helpers:
            self.kernels.lib.ns_helper_free(h)
        self.helpers = []
