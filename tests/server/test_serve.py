"""nodeserve.server.serve in process: a signal during the model load or the warm-up stops the server at once
(no READY=1 after it, no wait for the loading thread), and the start-up warning for an exposed server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from nodeserve.server import serve as serve_module


HOLD_S = 20.0  # how long the stand-in load / warm-up blocks; a server that waits for it takes at least this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_signalled(notify, monkeypatch, status: str, host: str = "127.0.0.1",
                           then: str | None = None) -> tuple[int, float, list]:
    """Runs serve() with NOTIFY_SOCKET, sends SIGTERM once STATUS=<status> arrives (and, if given, a message
    starting with `then` after it); returns (exit code, seconds from the signal until asyncio.run returned, the
    notify messages)."""
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    config = config_from_dict({"model": {"dtype": "float32"}, "server": {"host": host, "port": _free_port()},
                               "kv": {"memory_gib": 0.25}})
    signalled = []

    def lines() -> list[str]:
        return [line for _, m in notify.messages for line in m.split("\n")]

    async def scenario():
        server = asyncio.create_task(serve_module.serve(config))
        deadline = time.monotonic() + 120
        def arrived() -> bool:
            seen = lines()
            at = next((i for i, m in enumerate(seen) if m.startswith(f"STATUS={status}")), None)
            return at is not None and (then is None or any(m.startswith(then) for m in seen[at:]))
        while not arrived():
            assert time.monotonic() < deadline and not server.done(), notify.messages
            await asyncio.sleep(0.05)
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        return await server
    code = asyncio.run(scenario())
    seconds = time.monotonic() - signalled[0]
    time.sleep(0.2)  # let the listener read what was sent last
    return code, seconds, lines()


def test_a_signal_during_the_model_load_exits_without_waiting_for_it(notify_socket, monkeypatch, caplog):
    release = threading.Event()

    def slow_load(*args, **kwargs):
        release.wait(HOLD_S)
        raise RuntimeError("the test's stand-in load")
    monkeypatch.setattr(serve_module, "load_model", slow_load)
    try:
        with caplog.at_level(logging.WARNING, logger="nodeserve"):
            code, seconds, messages = _serve_until_signalled(notify_socket, monkeypatch, "loading", host="0.0.0.0")
    finally:
        release.set()
    assert code == 0 and seconds < 5.0, seconds
    assert "STOPPING=1" in messages and "READY=1" not in messages
    assert any("not a loopback address, without an API key" in r.getMessage() for r in caplog.records)


def test_a_signal_during_warmup_is_not_overwritten_by_ready(notify_socket, monkeypatch, loaded_fp32):
    release = threading.Event()
    monkeypatch.setattr(serve_module, "load_model", lambda *args, **kwargs: loaded_fp32)
    monkeypatch.setattr(Engine, "warmup", lambda self: release.wait(HOLD_S))
    monkeypatch.setattr(serve_module, "EXTEND_STEP_S", 0.2)
    try:
        code, seconds, messages = _serve_until_signalled(notify_socket, monkeypatch, "warming up",
                                                         then="EXTEND_TIMEOUT_USEC=400000")
    finally:
        release.set()
    assert code == 0 and seconds < 5.0, seconds
    assert "STOPPING=1" in messages and "READY=1" not in messages, messages
    # The start timeout was pushed back while the warm-up ran, and not after the stop.
    warming = messages.index("STATUS=warming up")
    assert "EXTEND_TIMEOUT_USEC=400000" in messages[warming:], messages
    assert not any(m.startswith("EXTEND_TIMEOUT_USEC") for m in messages[messages.index("STOPPING=1"):])


@pytest.mark.parametrize("server, warns", [
    ({"host": "0.0.0.0"}, True), ({"host": "192.168.1.5"}, True), ({"host": "::"}, True),
    ({"host": "0.0.0.0", "api_key": "k"}, False), ({"host": "127.0.0.1"}, False), ({"host": "::1"}, False),
    ({"host": "localhost"}, False),
])
def test_exposure_warning(server, warns, monkeypatch):
    monkeypatch.delenv("NODESERVE_API_KEY", raising=False)
    warning = serve_module.exposure_warning(config_from_dict({"server": server}, check_devices=False))
    assert (warning is not None) == warns


class _Engine:
    """What drain() and wire_metrics() read of an engine."""

    def __init__(self, num_streams: int, finish_after: float | None):
        self.streams = {f"r{i}": object() for i in range(num_streams)}
        self.failed: list[str] = []
        self.kv_events = None
        self.num_pending = 3
        if finish_after is not None:
            asyncio.get_running_loop().call_later(finish_after, self.streams.clear)

    def fail_all(self, message: str) -> None:
        self.failed.append(message)
        self.streams.clear()

    def pool_stats(self):
        return []

    def tier_stats(self):
        return []

    def node_load(self):
        return None


def test_drain_waits_for_the_streams_and_fails_only_what_outlives_the_timeout():
    async def scenario(finish_after: float | None) -> list[str]:
        engine = _Engine(2, finish_after)
        await serve_module.drain(engine, timeout=0.5)
        return engine.failed
    assert asyncio.run(scenario(0.1)) == []
    assert asyncio.run(scenario(None)) == ["the server is shutting down"]


def test_a_second_signal_is_not_a_second_drain(monkeypatch):
    """stop_on_signals: the first SIGTERM sets the stop event and turns the server to draining; the second exits."""
    exits = []
    monkeypatch.setattr(serve_module.os, "_exit", exits.append)
    state = SimpleNamespace(status="ready")

    async def scenario():
        stop = serve_module.stop_on_signals(asyncio.get_running_loop(), state, 1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
        assert state.status == "draining" and exits == []
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.1)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
    asyncio.run(scenario())
    assert exits == [1]
