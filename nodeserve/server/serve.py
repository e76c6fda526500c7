"""Runs the server: bind the socket, load the model off the loop, start the engine, serve until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from aiohttp import web

from nodeserve.config import Config
from nodeserve.engine.engine import Engine
from nodeserve.model.loader import load_model, parse_dtype
from nodeserve.server.app import ServerState, create_app

log = logging.getLogger("nodeserve")

DRAIN_TIMEOUT_S = 30.0


def _progress_logger(what: str):
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] > 2.0:
            last[0] = now
            log.info("%s: %d/%d tensors", what, done, total)
    return progress


async def serve(config: Config) -> int:
    loop = asyncio.get_running_loop()
    state = ServerState(config)
    app = create_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()  # /health answers 503 while the model loads
    log.info("listening on http://%s:%d, loading %s", config.server.host, config.server.port, config.model.path)

    stop = asyncio.Event()
    signals = [0]

    def on_signal() -> None:
        signals[0] += 1
        if signals[0] > 1:
            log.warning("second signal: exiting now")
            sys.exit(1)
        log.info("signal received: draining")
        state.status = "draining"
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    start = time.monotonic()
    load = loop.run_in_executor(None, lambda: load_model(config.model.path, parse_dtype(config.model.dtype),
                                                         _progress_logger("loading weights")))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await runner.cleanup()
        return 0
    loaded = load.result()
    engine = Engine(config, loaded)
    engine.start(loop)
    state.engine = engine
    state.status = "ready"
    roles = ", ".join(f"{w.name}={w.role}" for w in engine.workers)
    print(f"nodeserve ready on http://{config.server.host}:{config.server.port} model={state.model_name} "
          f"mode={config.devices.mode} devices: {roles} (loaded in {time.monotonic() - start:.1f}s)", flush=True)

    await stop.wait()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while engine.streams and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await runner.cleanup()
    engine.stop()
    log.info("stopped")
    return 0


def run(config: Config) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
