"""systemd integration without the systemd package: sd_notify over $NOTIFY_SOCKET, and a watchdog.

The notify protocol is one AF_UNIX SOCK_DGRAM datagram per message of newline-separated `KEY=VALUE`
lines, sent to the path in `$NOTIFY_SOCKET` (a leading `@` names the Linux abstract namespace).
When the variable is unset, e.g. when nodeserve runs outside systemd, every call is a no-op, so
the server can call the notifier unconditionally.

The watchdog (`WatchdogSec=` in the unit) wants a `WATCHDOG=1` ping at least every
`WATCHDOG_USEC`. `watchdog_loop` pings only while a health check passes: a wedged device step
stops a worker's `last_progress`, the pings stop, and systemd kills and restarts the service,
which a loop that only proves the event loop is alive would never do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Callable, Iterable, Mapping, Protocol

log = logging.getLogger(__name__)

# A datagram send only blocks when systemd's receive queue is full. Waiting briefly beats dropping
# READY=1 (the start would time out), and the bound keeps a stuck systemd from stalling the event loop.
_SEND_TIMEOUT_S = 0.5


def _socket_address(value: str) -> str | None:
    """Maps `$NOTIFY_SOCKET` to an AF_UNIX address, or None for a form we cannot use."""
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace: no file, the name starts with a NUL byte
    if value.startswith("/"):
        return value
    return None  # e.g. systemd's `vsock:` form for VMs, which has no AF_UNIX meaning


class Notifier:
    """Sends sd_notify messages to the service manager; disabled (all no-ops) without a socket."""

    def __init__(self, address: str | None) -> None:
        """Args: address: an AF_UNIX datagram address (abstract names start with `\\0`), or None to disable."""
        self.address = address
        self.enabled = address is not None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # notify() may be called from worker threads as well as the loop
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Notifier":
        """The notifier for `$NOTIFY_SOCKET`; disabled when it is unset or empty."""
        value = environ.get("NOTIFY_SOCKET", "")
        if not value:
            return cls(None)
        address = _socket_address(value)
        if address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an @abstract name: systemd notifications disabled", value)
        return cls(address)

    def notify(self, message: str) -> None:
        """Sends one message, e.g. "READY=1" or "STATUS=loading". Never raises: systemd is advisory to us."""
        if not self.enabled:
            return
        try:
            data = message.encode("utf-8")
            with self._lock:
                if self._sock is None:
                    # Created on first use so that constructing a Notifier has no side effects.
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    sock.settimeout(_SEND_TIMEOUT_S)
                    self._sock = sock
                self._sock.sendto(data, self.address)
        except (OSError, ValueError) as e:  # ValueError: unencodable text or a NUL in a path
            if not self._warned:
                # Once only: a missing socket fails every watchdog ping, which would flood the log.
                self._warned = True
                log.warning("systemd notify to %r failed (%s); further failures are not logged",
                            self.address, e)

    def ready(self, status: str | None = None) -> None:
        """Tells systemd that start-up is done (Type=notify), optionally with a status line."""
        self.notify("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        """Sets the free-form status shown by `systemctl status`."""
        self.notify(f"STATUS={_one_line(text)}")

    def stopping(self) -> None:
        """Tells systemd that shutdown (the drain) has begun."""
        self.notify("STOPPING=1")

    def extend_timeout(self, seconds: float) -> None:
        """Asks for `seconds` more before the current start/stop timeout fires, counted from now."""
        self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog_interval(self, environ: Mapping[str, str] = os.environ) -> float | None:
        """Seconds between watchdog pings (half of `WATCHDOG_USEC`), or None when no watchdog applies to us.

        The watchdog applies when `WATCHDOG_USEC` is a positive integer and `WATCHDOG_PID` is unset or our pid
        (a different pid means the variables were inherited from a parent that systemd is watching).
        """
        if not self.enabled:
            return None
        try:
            usec = int(environ.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        if usec <= 0:
            return None
        pid = environ.get("WATCHDOG_PID")
        if pid is not None:
            try:
                if int(pid) != os.getpid():
                    return None
            except ValueError:
                return None
        # Half the timeout, as sd_watchdog_enabled(3) advises, so one late ping does not get us killed.
        return usec / 2 / 1e6

    def close(self) -> None:
        """Closes the socket and disables further messages."""
        with self._lock:
            self.enabled = False
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _one_line(text: str) -> str:
    # A newline inside a value would start a new KEY=VALUE assignment in the datagram.
    return " ".join(text.splitlines())


class _HasProgress(Protocol):
    name: str
    last_progress: float


class WorkersHealth:
    """The check `workers_healthy` returns: True while every worker made progress within `max_stall` s and none has
    its device taken for dead (`failure`: every request of its last few steps failed).

    After a failing call, `last_reason` names the stalled or failed workers, for `watchdog_loop`'s warning.
    """

    def __init__(self, workers: Iterable[_HasProgress], max_stall: float) -> None:
        self.workers = tuple(workers)  # a tuple so a generator is not used up by the first check
        self.max_stall = max_stall
        self.last_reason: str | None = None

    def __call__(self) -> bool:
        now = time.monotonic()
        stalled = [(getattr(w, "name", repr(w)), now - w.last_progress) for w in self.workers
                   if now - w.last_progress > self.max_stall]
        failed = [(getattr(w, "name", repr(w)), w.failure) for w in self.workers if getattr(w, "failure", None)]
        if not stalled and not failed:
            self.last_reason = None
            return True
        reasons = [f"worker {name} made no progress for {age:.1f}s (limit {self.max_stall:g}s)" for name, age in stalled]
        self.last_reason = ", ".join(reasons + [f"worker {name}'s device failed: {why}" for name, why in failed])
        return False


def workers_healthy(workers: Iterable[_HasProgress], max_stall: float) -> Callable[[], bool]:
    """A health check that is True when every worker's `last_progress` is within `max_stall` s of now.

    Args:
        workers: objects with `last_progress` (a `time.monotonic()` stamp) and, for messages, `name`.
        max_stall: the longest a worker may go without progress; it must exceed the longest legitimate
            single step (a long prefill chunk, a CUDA graph capture), or a slow step reads as a hang.
    """
    return WorkersHealth(workers, max_stall)


async def watchdog_loop(notifier: Notifier, interval: float, is_healthy: Callable[[], bool]) -> None:
    """Sends WATCHDOG=1 every `interval` s while `is_healthy()`; runs until cancelled.

    While the check fails, pings are withheld, so systemd's watchdog fires and restarts the service.
    A warning is logged once when a stall begins (naming why, when the check offers `last_reason`),
    and once when it ends.
    """
    if interval <= 0:
        raise ValueError(f"watchdog interval must be positive, got {interval}")
    stalled_since: float | None = None
    while True:
        try:
            healthy = bool(is_healthy())
            reason = getattr(is_healthy, "last_reason", None) or "the health check failed"
        except Exception as e:  # a broken check must not kill the loop; treat it as unhealthy
            healthy, reason = False, f"the health check raised {type(e).__name__}: {e}"
        if healthy:
            notifier.notify("WATCHDOG=1")
            if stalled_since is not None:
                log.warning("watchdog: healthy again after %.1fs; pinging resumed", time.monotonic() - stalled_since)
                stalled_since = None
        elif stalled_since is None:
            stalled_since = time.monotonic()
            log.warning("watchdog: withholding pings so systemd restarts us: %s", reason)
        await asyncio.sleep(interval)
