"""`python tests/faults/block_loop.py run --config ...`: nodeserve, with SIGUSR1 blocking its event loop for 1 s
(a time.sleep run on the loop, as a blocking call in a handler would): the fault tests/faults injects from outside."""

import asyncio
import signal
import sys
import time

from nodeserve.cli import main
from nodeserve.server import serve as serve_module

BLOCK_S = 1.0
_serve = serve_module.serve


async def serve(config):
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, time.sleep, BLOCK_S)
    return await _serve(config)


serve_module.serve = serve
sys.exit(main())
