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

import pytest

from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from nodeserve.server import serve as serve_module


class NotifySocket:
    """The datagram socket systemd would own (as in test_service.py): collects what the server sends."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.extend((time.monotonic(), line) for line in data.decode().split("\n"))

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()

HOLD_S = 20.0  # how long the stand-in load / warm-up blocks; a server that waits for it takes at least this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_signalled(tmp_path, monkeypatch, status: str, host: str = "127.0.0.1",
                           then: str | None = None) -> tuple[int, float, list]:
    """Runs serve() with NOTIFY_SOCKET, sends SIGTERM once STATUS=<status> arrives (and, if given, a message
    starting with `then` after it); returns (exit code, seconds from the signal until asyncio.run returned, the
    notify messages)."""
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    config = config_from_dict({"model": {"dtype": "float32"}, "server": {"host": host, "port": _free_port()},
                               "kv": {"memory_gib": 0.25}})
    signalled = []

    async def scenario():
        server = asyncio.create_task(serve_module.serve(config))
        deadline = time.monotonic() + 120
        def arrived() -> bool:
            seen = [m for _, m in notify.messages]
            at = next((i for i, m in enumerate(seen) if m.startswith(f"STATUS={status}")), None)
            return at is not None and (then is None or any(m.startswith(then) for m in seen[at:]))
        while not arrived():
            assert time.monotonic() < deadline and not server.done(), notify.messages
            await asyncio.sleep(0.05)
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        return await server
    try:
        code = asyncio.run(scenario())
        seconds = time.monotonic() - signalled[0]
        time.sleep(0.2)  # let the listener read what was sent last
    finally:
        notify.close()
    return code, seconds, [m for _, m in notify.messages]


def test_a_signal_during_the_model_load_exits_without_waiting_for_it(tmp_path, monkeypatch, caplog):
    release = threading.Event()

    def slow_load(*args, **kwargs):
        release.wait(HOLD_S)
        raise RuntimeError("the test's stand-in load")
    monkeypatch.setattr(serve_module, "load_model", slow_load)
    try:
        with caplog.at_level(logging.WARNING, logger="nodeserve"):
            code, seconds, messages = _serve_until_signalled(tmp_path, monkeypatch, "loading", host="0.0.0.0")
    finally:
        release.set()
    assert code == 0 and seconds < 5.0, seconds
    assert "STOPPING=1" in messages and "READY=1" not in messages
    assert any("not a loopback address, without an API key" in r.getMessage() for r in caplog.records)


def test_a_signal_during_warmup_is_not_overwritten_by_ready(tmp_path, monkeypatch, loaded_fp32):
    release = threading.Event()
    monkeypatch.setattr(serve_module, "load_model", lambda *args, **kwargs: loaded_fp32)
    monkeypatch.setattr(Engine, "warmup", lambda self: release.wait(HOLD_S))
    monkeypatch.setattr(serve_module, "EXTEND_STEP_S", 0.2)
    try:
        code, seconds, messages = _serve_until_signalled(tmp_path, monkeypatch, "warming up",
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
