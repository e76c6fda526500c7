"""A stop at any moment of start-up ends the process cleanly: exit 0, STOPPING=1 sent, no READY=1 after it, and no
abort (a daemon thread in torch code once made the interpreter's shutdown end in SIGABRT, exit 134)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


# Where the signal lands: the STATUS (or READY) datagram the test waits for, then a delay. "starting" comes before
# the config is read and jemalloc's re-exec; "loading weights" while the load thread reads tensors; "warming up"
# while the warm-up thread runs, and half a second in, the start-up profile; "first request" once READY=1 came and
# a streamed request has its first token.
POINTS = [("starting", 0.0), ("loading weights", 0.0), ("warming up", 0.0), ("warming up", 0.5),
          ("first request", 0.0)]


def _config(tmp_path, port: int) -> str:
    path = tmp_path / "nodeserve.toml"
    path.write_text(f"""
[model]
path = "smollm2-135m-instruct"
name = "smollm2"
[server]
host = "127.0.0.1"
port = {port}
drain_timeout = 20.0
[devices]
mode = "disaggregated"
prefill = ["cpu:0"]
decode = ["cpu:1"]
[kv]
memory_gib = 0.25
[profile]
startup = true
""")
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(notify, proc: subprocess.Popen, prefix: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.startswith(prefix) for _, m in notify.messages for line in m.split("\n")):
            return
        assert proc.poll() is None, f"exited with {proc.returncode} before {prefix!r}"
        time.sleep(0.005)
    raise AssertionError(f"no {prefix!r} within {timeout}s: {notify.messages}")


def _first_token_then(url: str, then) -> str:
    """Streams one chat request; calls then() at its first content token; returns the whole SSE body."""
    body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": 48, "temperature": 0,
                       "messages": [{"role": "user", "content": "Count from one to twenty."}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    chunks, signalled = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            chunks.append(line.decode())
            if not signalled and line.startswith(b"data: {") and b'"content"' in line:
                signalled = True
                then()
    return "".join(chunks)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("point,delay", POINTS, ids=[f"{p.replace(' ', '-')}+{d}s" for p, d in POINTS])
def test_a_stop_at_any_point_of_start_up_ends_cleanly(tmp_path, notify_socket, point, delay, sig):
    port = _free_port()
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.path}
    env.pop("WATCHDOG_USEC", None)
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "nodeserve", "run", "--config", _config(tmp_path, port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    body = None
    try:
        if point == "first request":
            _wait_for(notify_socket, proc, "READY=1")
            body = _first_token_then(f"http://127.0.0.1:{port}", lambda: proc.send_signal(sig))
        else:
            _wait_for(notify_socket, proc, "STATUS=" + point)
            time.sleep(delay)
            sent_at = time.monotonic()
            proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    assert code == 0, f"exit {code}:\n{output[-3000:]}"
    assert "Fatal Python error" not in output and "terminate called" not in output, output[-3000:]
    time.sleep(0.1)  # the listener thread reads what is already queued
    assert notify_socket.times("STOPPING=1"), notify_socket.messages
    if body is not None:  # the drain let the request finish: a finish reason, no error event, then [DONE]
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        assert body.rstrip().endswith("data: [DONE]") and not any("error" in e for e in events), body[-1000:]
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), events[-1]
    else:  # never READY after a stop
        assert all(t < sent_at for t in notify_socket.times("READY=1")), notify_socket.messages
