"""Thread pools for the server's work off the event loop (tokenization, grammar compilation), run below it.

On a small node the device workers are pinned one to a core and the event loop is not: a hostile request that
tokenizes for seconds in two more threads left the loop a third of a core, and every stream and /health with it
(stalls of 100-650 ms in bench/hostile.py). These threads run at a lower priority (a higher nice value), so the
loop and the workers win a contended core, and there are few of them: extra ones would only queue CPU work.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

log = logging.getLogger(__name__)

OFFLOAD_NICE = 10  # CFS weight 110 against the loop's 1024: ~10 % of a core the loop also wants


def lower_thread_priority(nice: int = OFFLOAD_NICE) -> bool:
    """Raises the calling thread's nice value by `nice` (Linux: priorities are per thread; raising the value needs
    no privilege). Returns whether it did."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except OSError as e:
        log.debug("could not lower a thread's priority: %s", e)
        return False


def offload_executor(name: str, max_workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `max_workers` threads named `name`, each at OFFLOAD_NICE below the loop."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                                 initializer=lower_thread_priority)
