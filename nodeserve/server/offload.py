"""Thread pools for the server's work off the event loop (tokenization, grammar compilation), run below it.

On a small node the device workers are pinned one to a core and the event loop is not: a hostile request that
tokenizes for seconds in two more threads left the loop a third of a core, and every stream and /health with it
(stalls of 100-650 ms in bench/hostile.py). These threads run at a lower priority (a higher nice value), so the
loop and the workers win a contended core, and there are few of them: extra ones would only queue CPU work.
"""

from __future__ import annotations

import concurrent.futures

from nodeserve.device.cpu import lower_thread_priority


def offload_executor(name: str, max_workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `max_workers` threads named `name`, each at device.cpu.BACKGROUND_NICE below the loop."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                                 initializer=lower_thread_priority)
