"""One real server for the fault tests: KV events on (bound on 127.0.0.1, a replay socket, a small high-water mark
so a stalled subscriber is behind in seconds), the access log on, and a launcher that can block its event loop."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest

from tests.server.conftest import Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOPIC = "kv@fault-" + "x" * 16_000


class FaultServer(Server):
    """KV events with small buffers on the server's side (hwm 4 batches, a 4 kB kernel send buffer) and a 16 kB
    topic, which every batch carries: a subscriber that never reads fills its ~40 kB of TCP and ZMQ buffers within
    a few batches, not after hours of 100-byte batches (the mechanism is the same, only sooner)."""

    def __init__(self, tmp_dir):
        self.events_port, self.replay_port = free_port(), free_port()
        self.replay = f"tcp://127.0.0.1:{self.replay_port}"
        super().__init__(tmp_dir, 'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]',
                         "access_log = true\n[kv_events]\nenabled = true\n"
                         f'port = {self.events_port}\nreplay_endpoint = "{self.replay}"\nhwm = 4\nsndbuf = 4096\n'
                         f'topic = "{TOPIC}"\n',
                         launcher=(os.path.join(os.path.dirname(__file__), "block_loop.py"),))
        self.events = f"tcp://127.0.0.1:{self.events_port}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def full_log(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    s = FaultServer(tmp_path_factory.mktemp("faults"))
    yield s
    s.stop()
