"""Runs the server: bind the socket, load the model off the loop, start the engine, serve, drain on a signal.

Start-up and shutdown talk to systemd when NOTIFY_SOCKET is set: STATUS while loading, READY once the model
is loaded and the socket bound, WATCHDOG while every worker makes progress, STOPPING on shutdown.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from aiohttp import web

from nodeserve.config import Config
from nodeserve.runtime.engine import STOP_JOIN_S, Engine
from nodeserve.runtime.kv_tiers import DISK_STOP_S
from nodeserve.runtime.memory import allocator_in_use, heap_trim_loop
from nodeserve.model.loader import load_model, parse_dtype
from nodeserve.server.app import AccessLogger, ServerState, create_app, is_loopback
from nodeserve.server.stats_line import StatsLine, stats_loop
from nodeserve.server.loop_monitor import LoopMonitor
from nodeserve.server.systemd import Notifier, watchdog_loop, workers_healthy

log = logging.getLogger("nodeserve")

WORKER_STALL_S = 30.0  # a worker loop that has not turned for this long counts as wedged
STALL_DUMP_S = 0.3  # server.stall_dumps: every thread's stack this far into an event-loop stall
HTTP_SHUTDOWN_S = 5.0  # after the drain: aiohttp's wait for handlers still writing
KV_EVENTS_STOP_S = 2.0  # the KV-event publisher's last sends (runtime/kv_events.py stop's default)
# The whole stop from SIGTERM, every phase bounded (stop_phases): under deploy/nodeserve.service's TimeoutStopSec,
# with room for the interpreter's exit, so systemd never SIGKILLs a stop mid-flush
STOP_BUDGET_S = 60.0


def stop_phases(config: Config) -> dict[str, float]:
    """Each phase of a stop and the most it may take, in order; their sum is the stop's bound."""
    phases = {"drain": config.server.drain_timeout, "http shutdown": HTTP_SHUTDOWN_S, "thread joins": STOP_JOIN_S}
    if config.kv.disk_gib > 0:
        phases.update({"kv flush to disk": config.kv.stop_flush_timeout, "disk writer": DISK_STOP_S})
    if config.kv_events.enabled:
        phases["kv events"] = KV_EVENTS_STOP_S
    return phases


class _Progress:
    """Loading progress: a bar on a TTY, a log line every few seconds otherwise, and systemd STATUS lines."""

    def __init__(self, notifier: Notifier):
        self.notifier, self.last = notifier, 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            width = 30
            filled = width * done // total
            sys.stderr.write(f"\rloading weights [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        now = time.monotonic()
        if done == total or now - self.last > 2.0:
            self.last = now
            if not self.tty:
                log.info("loading weights: %d/%d tensors", done, total)
            self.notifier.status(f"loading weights {done}/{total}")


def in_daemon_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], name: str) -> asyncio.Future:
    """fn() in a daemon thread, as a future of this loop. Not the loop's executor: asyncio.run waits for the
    executor's threads at exit, so a signal during a load or warm-up of minutes would wait for it to finish."""
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            result = (True, fn())
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass
    threading.Thread(target=target, name=name, daemon=True).start()
    return future


# While the model loads and warms up (a cold FlashInfer JIT takes many minutes), systemd's TimeoutStartSec is
# pushed back a step at a time, so only a start-up that stalls for good (over MAX_START_EXTENSION_S) times out.
EXTEND_STEP_S = 30.0
MAX_START_EXTENSION_S = 3600.0


async def _extend_start_timeout(notifier: Notifier) -> None:
    """Until cancelled (at READY=1 or a stop): EXTEND_TIMEOUT_USEC every EXTEND_STEP_S, each asking for two steps
    from now, for at most MAX_START_EXTENSION_S."""
    deadline = time.monotonic() + MAX_START_EXTENSION_S
    while time.monotonic() < deadline:
        notifier.extend_timeout(2 * EXTEND_STEP_S)
        await asyncio.sleep(EXTEND_STEP_S)


async def _unless_stopped(future: asyncio.Future, stop: asyncio.Event) -> bool:
    """Waits for future or for a stop signal; True if the future finished and no signal came."""
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([future, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return not stop.is_set()


def exposure_warning(config: Config) -> str | None:
    """A warning when the API is reachable from other machines without a key."""
    if is_loopback(config.server.host) or config.api_key:
        return None
    return (f"listening on {config.server.host}, not a loopback address, without an API key: anyone who can reach "
            f"port {config.server.port} can use this server; set server.api_key (or NODESERVE_API_KEY)")


async def serve(config: Config, on_ready: Callable[[ServerState], None] | None = None) -> int:
    """Serves until SIGTERM/SIGINT, then drains. on_ready(state) runs once the engine is up (tests use it)."""
    notifier, state, start = Notifier.from_env(), ServerState(config), time.monotonic()
    runner = await listen(config, state)  # /health answers 503 while the model loads
    notifier.status(f"loading {config.model.path}")
    stop = stop_on_signals(asyncio.get_running_loop(), state, config.server.drain_timeout)
    engine = await start_engine(config, state, notifier, stop)
    if engine is None:  # a signal during the load or the warm-up: no READY=1 after it
        notifier.stopping()
        await runner.cleanup()
        return 0
    go_ready(config, state, engine, notifier, time.monotonic() - start)
    if on_ready is not None:
        on_ready(state)
    tasks = background_tasks(config, state, engine, notifier)
    await stop.wait()
    notifier.stopping()
    await drain(engine, config.server.drain_timeout)
    for task in tasks:
        task.cancel()
    await runner.cleanup()
    engine.stop()
    notifier.close()
    log.info("stopped")
    return 0


async def listen(config: Config, state: ServerState) -> web.AppRunner:
    """The HTTP server, listening: aiohttp's app on config.server's address."""
    # The drain happens before cleanup; aiohttp's own shutdown wait only covers handlers still writing.
    access_log = logging.getLogger("nodeserve.access") if config.server.access_log else None
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=access_log,
                           access_log_class=AccessLogger, shutdown_timeout=HTTP_SHUTDOWN_S)
    await runner.setup()
    await web.TCPSite(runner, config.server.host, config.server.port).start()
    log.info("listening on http://%s:%d, loading %s as %s; malloc: %s", config.server.host, config.server.port,
             config.model.path, config.dtype, allocator_in_use())
    if (warning := exposure_warning(config)) is not None:
        log.warning(warning)
    if (total := sum(stop_phases(config).values())) > STOP_BUDGET_S:
        log.warning("a stop may take %.0f s (%s), past the %.0f s the shipped unit's TimeoutStopSec allows for: "
                    "systemd may SIGKILL it mid-flush; lower server.drain_timeout or kv.stop_flush_timeout", total,
                    ", ".join(f"{k} {v:g}s" for k, v in stop_phases(config).items()), STOP_BUDGET_S)
    return runner


def stop_on_signals(loop: asyncio.AbstractEventLoop, state: ServerState, drain_timeout: float) -> asyncio.Event:
    """The event SIGTERM / SIGINT set (the server turns to draining); a second signal exits at once."""
    stop = asyncio.Event()
    signals = [0]

    def on_signal() -> None:
        signals[0] += 1
        if signals[0] > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("signal received: draining for up to %gs", drain_timeout)
        state.status = "draining"
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop


def take_disk_lock(config: Config) -> int | None:
    """kv.disk_path's lock (kv/disk.lock_path) where the disk tier is configured; ConfigError (one line, exit 2)
    when another server holds it."""
    from nodeserve.config import ConfigError
    from nodeserve.kv.disk import DiskTierLocked, lock_path

    kv = config.kv
    if not kv.disk_path or kv.disk_gib <= 0:
        return None
    try:
        return lock_path(kv.disk_path)
    except DiskTierLocked as e:
        raise ConfigError(str(e)) from None
    except OSError:  # the tier itself says why it is off, later, in one warning
        return None


async def start_engine(config: Config, state: ServerState, notifier: Notifier, stop: asyncio.Event) -> Engine | None:
    """Loads the model, starts the engine and warms it up, each off the loop in a daemon thread; None if a signal
    came first (the threads are left to die with the process: the cli ends it without waiting for them)."""
    loop = asyncio.get_running_loop()
    # kv.disk_path's lock first: a second server on one directory stops now, not after loading its model
    disk_lock = take_disk_lock(config)
    keep_alive = asyncio.create_task(_extend_start_timeout(notifier))
    try:
        load = in_daemon_thread(loop, lambda: load_model(config.model.path, parse_dtype(config.dtype),
                                                         _Progress(notifier), config.quantization,
                                                         config.model.prompt_activations, config.tp_degrees,
                                                         config.huge_pages, config.model.decode_activations),
                                "load")
        if not await _unless_stopped(load, stop):
            return None
        draft = None
        if config.speculative.method == "draft":
            from nodeserve.speculative.draft_model import load_draft

            loaded = load.result()
            load_d = in_daemon_thread(loop, lambda: load_draft(config, loaded), "load draft")
            if not await _unless_stopped(load_d, stop):
                return None
            draft = load_d.result()
        engine = Engine(config, load.result(), on_transfer=state.metrics.observe_transfer,
                        on_migration=state.metrics.observe_migration, draft=draft, disk_lock=disk_lock)
        engine.start(loop)
        notifier.status("warming up")

        # CUDA: FlashInfer JIT + decode graphs (minutes when cold); CPU: FP8 scales and the profile.
        def warm_up() -> None:
            engine.warmup()
            # llguidance's view of the vocabulary: built on the first structured request otherwise, holding the GIL
            # (and so the event loop) for ~0.3 s
            state.chat_tools(engine)[1].ll_tokenizer()
        warm = in_daemon_thread(loop, warm_up, "warmup")
        if not await _unless_stopped(warm, stop):
            engine.stop()
            return None
        warm.result()  # a warm-up that raised stops the start-up here
        return engine
    finally:
        keep_alive.cancel()


def go_ready(config: Config, state: ServerState, engine: Engine, notifier: Notifier, seconds: float) -> None:
    """Hands the engine to the routes and the metrics, then says ready: the log line and READY=1."""
    # Everything built so far (model, tokenizer, vocabularies: ~200k objects) lives as long as the process; frozen,
    # the collector's full passes skip it. Each took ~140 ms holding the GIL, so stalling the loop (loop_monitor.py).
    gc.collect()
    gc.freeze()
    state.engine = engine
    wire_metrics(state, engine)
    state.status = "ready"
    roles = ", ".join(f"{w.name}={w.role}" for w in engine.workers)
    url = f"http://{config.server.host}:{config.server.port}"
    print(f"nodeserve ready on {url} model={state.model_name} dtype={config.dtype} mode={config.devices.mode} "
          f"devices: {roles} (loaded in {seconds:.1f}s)", flush=True)
    notifier.ready(f"serving {state.model_name} on {url}")


def wire_metrics(state: ServerState, engine: Engine) -> None:
    """The gauges /metrics reads at scrape time: pools, tiers, grammars, the node, KV events."""
    metrics = state.metrics
    metrics.set_state_source(engine.pool_stats, pending=lambda: engine.num_pending)
    metrics.set_tier_source(engine.tier_stats)
    grammars = state.chat_tools(engine)[1]
    metrics.set_grammar_source(lambda: grammars.num_cached, lambda: grammars.num_cached_bytes)
    metrics.set_node_source(engine.node_load)
    if engine.kv_events is not None:
        metrics.set_kv_events_source(engine.kv_events.stats)


def background_tasks(config: Config, state: ServerState, engine: Engine, notifier: Notifier) -> list[asyncio.Task]:
    """While serving: the stats line, glibc's heap trim, the event-loop monitor and the systemd watchdog."""
    tasks = [asyncio.create_task(LoopMonitor(on_lag=state.metrics.event_loop_lag.observe,
                                             on_stall=state.metrics.observe_loop_stall,
                                             dump_after_s=STALL_DUMP_S if config.server.stall_dumps
                                             else None).run())]
    if config.server.stats_interval > 0:
        tasks.append(asyncio.create_task(stats_loop(StatsLine(state.metrics, engine), config.server.stats_interval)))
    if allocator_in_use() == "glibc":  # jemalloc purges on its own thread; glibc's arenas need malloc_trim
        tasks.append(asyncio.create_task(heap_trim_loop()))
    if (interval := notifier.watchdog_interval()) is not None:
        tasks.append(asyncio.create_task(watchdog_loop(notifier, interval,
                                                       workers_healthy(engine.watched(), WORKER_STALL_S))))
    return tasks


async def drain(engine: Engine, timeout: float) -> None:
    """Waits up to `timeout` for the requests in flight to finish, then ends the rest with an error event."""
    deadline = time.monotonic() + timeout
    while engine.streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.streams:
        log.warning("drain timeout: ending %d requests", len(engine.streams))
        engine.fail_all("the server is shutting down")
        await asyncio.sleep(0.2)  # let their handlers write the final error event


def run(config: Config) -> int:
    # A fatal signal (a SIGSEGV in native code) writes every thread's Python stack to stderr, i.e. the journal,
    # instead of leaving the log silent.
    faulthandler.enable(all_threads=True)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
