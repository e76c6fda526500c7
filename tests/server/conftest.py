"""A real nodeserve server in a subprocess on a free loopback port, float32, for the API tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_dir, devices: str, extra: str = "", quantization: str = "none", profile: bool = False,
                 model: str = "smollm2-135m-instruct", name: str = "smollm2",
                 launcher: tuple[str, ...] = ("-m", "nodeserve")):
        """launcher: what runs nodeserve's command line under this Python (tests/faults wraps it to inject faults)."""
        profile = profile or "adaptive" in devices  # adaptive mode places requests with the profile
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = os.path.join(tmp_dir, "nodeserve.toml")
        with open(self.config, "w") as f:
            f.write(f"""
[model]
path = "{model}"
name = "{name}"
dtype = "float32"
quantization = "{quantization}"  # "none", the exact path, unless a test asks: its greedy output is transformers'
[server]
host = "127.0.0.1"
port = {self.port}
{extra}
[devices]
{devices}
[kv]
memory_gib = 1.0
""" + ("" if "[profile]" in extra + devices else f"[profile]\nstartup = {str(profile).lower()}\n"))
        self.log = open(os.path.join(tmp_dir, "server.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, *launcher, "run", "--config", self.config],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not become ready: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class NotifySocket:
    """The datagram socket systemd would own; collects every message the server sends."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
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
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, message: str) -> list[float]:
        """When each datagram carrying `message` as one of its lines arrived."""
        return [t for t, m in self.messages if message in m.split("\n")]

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    """A NotifySocket at a path for NOTIFY_SOCKET; closed after the test."""
    sock = NotifySocket(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # The one server with the start-up profile (GET /debug/profile, SLO admission's predictions); the others skip
    # its ~2 s.
    s = Server(tmp_path_factory.mktemp("disagg"), 'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]',
               profile=True)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def colocated_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("coloc"), 'mode = "colocated"\ndevices = ["cpu:0", "cpu:1"]')
    yield s
    s.stop()


@pytest.fixture
def make_server(tmp_path):
    """Starts extra servers with their own config lines; stops them at the end of the test."""
    started = []

    def make(extra: str = "", devices: str = 'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]',
             env: dict | None = None, quantization: str = "none", profile: bool = False) -> Server:
        sub = tmp_path / f"server{len(started)}"
        sub.mkdir()
        old = dict(os.environ)
        os.environ.update(env or {})
        try:
            s = Server(sub, devices, extra, quantization, profile)
        finally:
            os.environ.clear()
            os.environ.update(old)
        started.append(s)
        return s
    yield make
    for s in started:
        s.stop()
