"""systemd notify and watchdog, against real datagram sockets the tests own (no systemd needed)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
import uuid

import pytest

from nodeserve.server.systemd import Notifier, watchdog_loop, workers_healthy


@pytest.fixture
def path_socket(tmp_path):
    """A bound datagram socket at a filesystem path; yields (socket, NOTIFY_SOCKET value)."""
    path = str(tmp_path / "notify")
    if len(path.encode()) >= 100:  # sun_path holds 108 bytes; pytest's tmp dirs can be deep
        path = os.path.join(tempfile.mkdtemp(prefix="ns-"), "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()
    os.unlink(path)


@pytest.fixture
def abstract_socket():
    """A bound datagram socket in the abstract namespace; yields (socket, "@name")."""
    name = f"nodeserve-test-{os.getpid()}-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    yield sock, "@" + name
    sock.close()


def _drain(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued on `sock`, without waiting."""
    got = []
    sock.setblocking(False)
    try:
        while True:
            got.append(sock.recv(4096))
    except BlockingIOError:
        return got
    finally:
        sock.settimeout(2.0)


def _send_all(notifier: Notifier) -> None:
    notifier.ready()
    notifier.ready("serving smollm2")
    notifier.status("draining 3 streams")
    notifier.notify("WATCHDOG=1")
    notifier.extend_timeout(2.5)
    notifier.stopping()


EXPECTED = [b"READY=1", b"READY=1\nSTATUS=serving smollm2", b"STATUS=draining 3 streams", b"WATCHDOG=1",
            b"EXTEND_TIMEOUT_USEC=2500000", b"STOPPING=1"]


@pytest.mark.parametrize("fixture", ["path_socket", "abstract_socket"])
def test_messages_arrive_exactly_one_datagram_each(fixture, request):
    sock, value = request.getfixturevalue(fixture)
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    assert notifier.enabled
    _send_all(notifier)
    assert [sock.recv(4096) for _ in EXPECTED] == EXPECTED
    assert _drain(sock) == []
    notifier.close()


def test_abstract_name_maps_to_nul():
    assert Notifier.from_env({"NOTIFY_SOCKET": "@abc"}).address == "\0abc"
    assert Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify"}).address == "/run/systemd/notify"


def test_status_newlines_cannot_inject_assignments(path_socket):
    sock, value = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    notifier.status("line one\nREADY=1")
    assert sock.recv(4096) == b"STATUS=line one READY=1"


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "vsock:2:1234"}])
def test_disabled_without_a_usable_socket(environ):
    notifier = Notifier.from_env(environ)
    assert not notifier.enabled
    _send_all(notifier)  # no-ops, no errors
    assert notifier.watchdog_interval({"WATCHDOG_USEC": "30000000"}) is None
    notifier.close()


def test_notify_never_raises_and_warns_once(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with caplog.at_level(logging.WARNING, logger="nodeserve.server.systemd"):
        for _ in range(5):
            notifier.notify("WATCHDOG=1")
        notifier.status("bad \udc80 surrogate")  # unencodable text is swallowed too
    assert len([r for r in caplog.records if "notify" in r.getMessage()]) == 1


def test_close_disables(path_socket):
    sock, value = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    notifier.ready()
    notifier.close()
    notifier.stopping()
    assert not notifier.enabled
    assert _drain(sock) == [b"READY=1"]


@pytest.mark.parametrize("watchdog_env, expected", [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
    ({"WATCHDOG_USEC": "100000"}, 0.05),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # meant for another process
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_interval(watchdog_env, expected):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "@unused"})
    assert notifier.watchdog_interval(watchdog_env) == expected


class FakeWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.last_progress = time.monotonic()


def test_workers_healthy_names_the_stalled_worker():
    a, b = FakeWorker("prefill0"), FakeWorker("decode0")
    check = workers_healthy((w for w in (a, b)), 1.0)  # a generator must survive repeated checks
    assert check() and check()
    b.last_progress -= 10.0
    assert not check()
    assert "decode0" in check.last_reason and "prefill0" not in check.last_reason
    b.last_progress = time.monotonic()
    assert check() and check.last_reason is None
    assert workers_healthy([], 1.0)()


def test_watchdog_loop_stops_pinging_while_stalled_and_resumes(path_socket, caplog):
    sock, value = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    worker = FakeWorker("decode0")
    interval, max_stall = 0.05, 0.15

    async def scenario() -> None:
        alive = [True]

        async def work() -> None:  # stands in for the worker thread's loop turns
            while True:
                if alive[0]:
                    worker.last_progress = time.monotonic()
                await asyncio.sleep(0.01)

        busy = asyncio.ensure_future(work())
        dog = asyncio.ensure_future(watchdog_loop(notifier, interval, workers_healthy([worker], max_stall)))

        await asyncio.sleep(0.3)
        healthy_pings = _drain(sock)
        assert len(healthy_pings) >= 3 and set(healthy_pings) == {b"WATCHDOG=1"}

        alive[0] = False  # the step wedges
        await asyncio.sleep(max_stall + 2 * interval)  # long enough for the check to notice
        _drain(sock)
        await asyncio.sleep(0.4)
        assert _drain(sock) == []  # silence: systemd would now time out and restart us

        alive[0] = True  # progress again
        await asyncio.sleep(0.25)
        assert len(_drain(sock)) >= 2

        dog.cancel()
        busy.cancel()
        for task in (dog, busy):
            with pytest.raises(asyncio.CancelledError):
                await task

    with caplog.at_level(logging.WARNING, logger="nodeserve.server.systemd"):
        asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    withheld = [m for m in messages if "withholding" in m]
    assert len(withheld) == 1 and "decode0" in withheld[0]  # once per stall, naming why
    assert len([m for m in messages if "resumed" in m]) == 1


def test_watchdog_loop_survives_a_raising_check(path_socket, caplog):
    sock, value = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    calls = [0]

    def check() -> bool:
        calls[0] += 1
        if calls[0] <= 3:
            raise RuntimeError("boom")
        return True

    async def scenario() -> None:
        dog = asyncio.ensure_future(watchdog_loop(notifier, 0.02, check))
        await asyncio.sleep(0.15)
        dog.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dog

    with caplog.at_level(logging.WARNING, logger="nodeserve.server.systemd"):
        asyncio.run(scenario())
    assert calls[0] > 3
    assert len(_drain(sock)) == calls[0] - 3  # a ping for each passing check only
    assert any("RuntimeError: boom" in r.getMessage() for r in caplog.records)


def test_watchdog_loop_rejects_a_bad_interval():
    with pytest.raises(ValueError):
        asyncio.run(watchdog_loop(Notifier(None), 0, lambda: True))
