"""Thread pools for the server's work off the event loop (tokenization, grammar compilation), run below it.

On a small node the device workers are pinned one to a core and the event loop is not: a hostile request that
tokenizes for seconds in two more threads left the loop a third of a core, and every stream and /health with it
(stalls of 100-650 ms in bench/hostile.py). These threads run at a lower priority (a higher nice value), so the
loop and the workers win a contended core, and there are few of them: extra ones would only queue CPU work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable

from nodeserve.device.cpu import lower_thread_priority


def offload_executor(name: str, max_workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `max_workers` threads named `name`, each at device.cpu.BACKGROUND_NICE below the loop."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                                 initializer=lower_thread_priority)


class OffloadFull(Exception):
    """An OffloadQueue already holds max_jobs jobs."""


class OffloadQueue:
    """An executor's jobs, queued or running, at most max_jobs: past it run() fails at once (the caller answers
    503) instead of queueing without limit. A job counts until its thread finishes it, even when the request that
    asked for it has gone (a cancelled await does not stop a running thread)."""

    def __init__(self, executor: concurrent.futures.Executor, max_jobs: int):
        self.executor, self.max_jobs = executor, max_jobs
        self.num_jobs = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self.num_jobs >= self.max_jobs:
                raise OffloadFull
            self.num_jobs += 1
        try:
            job = self.executor.submit(fn)
        except BaseException:
            self._done(None)
            raise
        job.add_done_callback(self._done)
        return await asyncio.wrap_future(job)

    def _done(self, _job: object) -> None:
        with self._lock:
            self.num_jobs -= 1
