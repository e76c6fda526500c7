"""The off-loop thread pools run below the event loop's priority."""

from __future__ import annotations

import os
import threading

import pytest

from nodeserve.device.cpu import BACKGROUND_NICE
from nodeserve.server.offload import offload_executor


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities are a Linux feature")
def test_offload_threads_run_at_a_higher_nice_value_than_the_thread_that_made_them():
    mine = _nice()
    pool = offload_executor("test offload", 2)
    try:
        theirs = {pool.submit(_nice).result() for _ in range(4)}
    finally:
        pool.shutdown()
    assert theirs == {min(19, mine + BACKGROUND_NICE)}
    assert _nice() == mine  # the caller's own priority is untouched
