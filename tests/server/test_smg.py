"""The multi-node recipe, for real: two one-core nodeserve nodes (cpu:0 and cpu:1) on 127.0.0.1 behind SMG's
`smg launch` (the pinned smg wheel of the test extras), driven with the real openai client.

Shown: SMG registers both nodes with no warning or error about them; chat and completions, streamed or not, come
back through it with the node's own greedy text and usage; with cache_aware a conversation's later turns go to the
node that served its first turn and hit that node's prefix cache (per-node vllm: counters); power_of_two and
least_load read the nodes' loads (a node busy with streams SMG never saw gets none of the new requests); after a
node is SIGKILLed and SMG notices, every request succeeds on the other; a node draining after SIGTERM finishes the
stream it was serving while SMG, once its health check sees the 503, sends new requests to the other node.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

SMG = shutil.which("smg", path=os.path.dirname(sys.executable)) or shutil.which("smg")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SMG is None, reason="the smg binary is not installed: pip install -e '.[test]' "
                                                     "(the test extras pin smg==1.13.0)")]

# One core each: a colocated node with one device. The host KV tier is off (two 2 GiB tiers buy nothing here).
ONE_CORE = 'mode = "colocated"\ndevices = ["cpu:{core}"]'
NODE_ENV = {"NODESERVE_KV_HOST_MEMORY_GIB": "0"}
# The recipe's cache_aware settings (deploy/smg/README.md); without --worker-warmup-divert-every 0 one cache hit
# in eight may go to a node whose index is "thin", away from the conversation's cache.
RECIPE = ["--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "4",
          "--balance-rel-threshold", "1.5", "--worker-warmup-divert-every", "0"]
# Test-only timing: probes and load polls every second, one failed probe is enough, so each wait below is short.
FAST = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
        "--load-monitor-interval", "1", "--shutdown-grace-period-secs", "5"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _poll(what: str, check, timeout: float = 60.0, every: float = 0.2):
    """Calls check() until it returns something truthy (returned) or `timeout` seconds pass (a test failure)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class Router:
    """One `smg launch` process on free loopback ports, its log in a file."""

    def __init__(self, log_path, workers: list[str], args: list[str]):
        self.port, self.metrics_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *workers,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               "--log-level", "info", *args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def workers(self) -> dict[str, dict]:
        """SMG's own view of its workers: url -> {is_healthy, status, engine_load, ...}."""
        if self.proc.poll() is not None:
            pytest.fail(f"smg exited with {self.proc.returncode}: {self.log()[-3000:]}")
        return {w["url"]: w for w in json.loads(_get(self.url + "/workers"))["workers"]}

    def wait_healthy(self, urls: list[str]) -> None:
        # Polled once too: until then SMG scores a node by its own in-flight count instead of the node's report.
        _poll(f"smg to list {urls} healthy and polled", lambda: all(
            w.get("is_healthy") and w.get("status") == "ready" and w.get("engine_load")
            for w in [self.workers().get(u, {}) for u in urls]))

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return ANSI.sub("", f.read())

    def problems(self) -> list[str]:
        """Every WARN or ERROR line but the start-up notice that the gateway itself has no authentication."""
        return [line for line in self.log().splitlines()
                if re.search(r"\s(WARN|ERROR)\s", line) and "SECURITY POSTURE" not in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def smg(tmp_path):
    """smg(workers, args) starts a router and waits until it lists every worker healthy; all stop at teardown."""
    routers: list[Router] = []

    def start(workers: list[str], args: list[str]) -> Router:
        r = Router(tmp_path / f"smg{len(routers)}.log", workers, args)
        routers.append(r)
        r.wait_healthy(workers)
        return r
    yield start
    for r in routers:
        r.stop()


def _two_nodes(make_server):
    return [make_server(devices=ONE_CORE.format(core=core), quantization="auto", env=NODE_ENV) for core in (0, 1)]


def _counters(node) -> dict[str, float]:
    """The vLLM-named counters a router reads from a node, summed over their (one) series."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(_get(node.url + "/metrics")):
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                          "vllm:e2e_request_latency_seconds_count"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _finished(node) -> float:
    return _counters(node)["vllm:e2e_request_latency_seconds_count"]


def _system_prompt(seed: int, words: int = 260) -> str:
    rng = random.Random(seed)
    vocab = ("harbor lantern orchard copper meadow signal river stone cloud engine ledger cargo tide "
             "compass rope salt wool glass timber anchor beacon").split()
    return f"You are assistant #{seed}. Reference notes: " + " ".join(rng.choice(vocab) for _ in range(words))


def _stream_text(stream) -> tuple[str, object, str | None]:
    """(text, usage, finish_reason) of a streamed chat or completion."""
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(getattr(c, "text", None) or getattr(getattr(c, "delta", None), "content", None) or "")
            finish = c.finish_reason or finish
    return "".join(parts), usage, finish


class Streamer(threading.Thread):
    """Reads one streamed completion in the background (so the test can act meanwhile); stop() ends it early."""

    def __init__(self, client, **kwargs):
        super().__init__(daemon=True)
        self.client, self.kwargs = client, kwargs
        self.first = threading.Event()
        self.halt = threading.Event()
        self.text, self.usage, self.finish, self.error, self.worker = [], None, None, None, None

    def run(self):
        try:
            raw = self.client.chat.completions.with_raw_response.create(stream=True, **self.kwargs)
            self.worker = raw.headers.get("x-smg-routed-worker-id")
            stream = raw.parse()
            for chunk in stream:
                self.first.set()
                if self.halt.is_set():
                    stream.close()  # the node sees the disconnect and frees the request
                    return
                self.usage = chunk.usage or self.usage
                for c in chunk.choices:
                    self.text.append(c.delta.content or "")
                    self.finish = c.finish_reason or self.finish
        except Exception as e:  # reported by the test that reads it
            self.error = e
        finally:
            self.first.set()

    def stop(self):
        self.halt.set()
        self.join(timeout=30)


def test_smg_in_front_of_two_one_core_nodes(make_server, smg):
    a, b = _two_nodes(make_server)
    urls = [a.url, b.url]
    router = smg(urls, RECIPE + FAST)

    # Chat and completions, plain and streamed: the router gives back what a node gives back.
    direct = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
    chat = dict(model="smollm2", messages=[{"role": "user", "content": "Name three prime numbers."}],
                max_tokens=12, temperature=0)
    want = direct.chat.completions.create(**chat)
    got = router.client.chat.completions.create(**chat)
    assert got.choices[0].message.content == want.choices[0].message.content and got.choices[0].message.content
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                      want.usage.completion_tokens)
    text, usage, finish = _stream_text(router.client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **chat))
    assert text == want.choices[0].message.content and finish == want.choices[0].finish_reason
    assert usage.completion_tokens == want.usage.completion_tokens
    comp = dict(model="smollm2", prompt="The three primary colours are", max_tokens=10, temperature=0)
    want = direct.completions.create(**comp)
    got = router.client.completions.create(**comp)
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == want.usage.completion_tokens
    text, usage, _ = _stream_text(router.client.completions.create(stream=True,
                                                                   stream_options={"include_usage": True}, **comp))
    assert text == want.choices[0].text and usage.prompt_tokens == want.usage.prompt_tokens

    # cache_aware: a conversation's later turns go where its first turn went, and hit that node's prefix cache.
    nodes = {a.url: a, b.url: b}
    for conv in range(2):
        messages = [{"role": "system", "content": _system_prompt(conv)}]
        home = None
        for turn, question in enumerate(["What is listed first?", "And the second item?", "Say it in French."]):
            messages.append({"role": "user", "content": question})
            before = {u: _counters(n) for u, n in nodes.items()}
            raw = router.client.chat.completions.with_raw_response.create(
                model="smollm2", messages=messages, max_tokens=16, temperature=0)
            reply, served = raw.parse(), raw.headers.get("x-smg-routed-worker-id")
            assert served in nodes, raw.headers
            _poll("the node's request counter", lambda: _finished(nodes[served]) > before[served][
                "vllm:e2e_request_latency_seconds_count"])
            after = {u: _counters(n) for u, n in nodes.items()}
            hits = {u: after[u]["vllm:prefix_cache_hits_total"] - before[u]["vllm:prefix_cache_hits_total"]
                    for u in nodes}
            cached = reply.usage.prompt_tokens_details.cached_tokens
            if turn == 0:
                home = served
            else:
                # The whole previous prompt (its full pages) was cached on the home node; the other saw nothing.
                assert served == home, (conv, turn, served, home)
                assert hits[home] == cached >= previous_prompt // 16 * 16 - 16, (hits, cached, previous_prompt)
                assert all(hits[u] == 0 for u in nodes if u != home), hits
            previous_prompt = reply.usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    # No warning or error in SMG's log so far: both nodes were accepted, probed and polled cleanly.
    assert router.problems() == []

    # power_of_two and least_load read the nodes' loads: node A is busy with streams the routers never saw (their
    # own in-flight counts are 0 for both), so only the loads they poll can steer every new request to node B. Each
    # request goes right after a fresh poll: between polls SMG adds what it dispatched since the last one, so a
    # burst of requests fills node B up to node A's count and then alternates (water-filling, as documented).
    balancers = {policy: smg(urls, ["--policy", policy] + FAST) for policy in ("power_of_two", "least_load")}
    busy = [Streamer(direct, model="smollm2", messages=[{"role": "user", "content": f"Count to a thousand, {i}."}],
                     max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}) for i in range(3)]
    for s in busy:
        s.start()
    try:
        for policy, r in balancers.items():
            _poll(f"{policy} to see node A's running requests", lambda: _running(r, a.url) >= 3)
        b_before, a_before = _finished(b), _finished(a)
        for i in range(5):
            for policy, r in balancers.items():
                polled = _polled_at(r)
                _poll(f"{policy}'s next load poll", lambda: all(t != polled[u] for u, t in _polled_at(r).items()))
                raw = r.client.completions.with_raw_response.create(model="smollm2", prompt=f"{policy} {i}:",
                                                                    max_tokens=2, temperature=0)
                assert raw.headers.get("x-smg-routed-worker-id") == b.url, (policy, i)
                assert raw.parse().usage.completion_tokens >= 1
        assert all(s.is_alive() and s.error is None for s in busy)  # node A stayed busy throughout
        _poll("node B's counter", lambda: _finished(b) - b_before >= 10)
        assert _finished(a) == a_before
    finally:
        for s in busy:
            s.stop()
    for r in balancers.values():
        assert r.problems() == []

    # Kill node B: once SMG marks it unhealthy, every request succeeds on node A, no 5xx.
    b.proc.kill()
    b.proc.wait()
    _poll("smg to mark node B unhealthy", lambda: not router.workers()[b.url]["is_healthy"], timeout=30)
    for i in range(10):
        kwargs = dict(model="smollm2", messages=[{"role": "user", "content": f"Say hello, {i}."}], max_tokens=6,
                      temperature=0)
        if i % 2:
            raw = router.client.chat.completions.with_raw_response.create(**kwargs)
            assert raw.parse().usage.completion_tokens >= 1
        else:
            raw = router.client.chat.completions.with_raw_response.create(stream=True, **kwargs)
            text, _, finish = _stream_text(raw.parse())
            assert text and finish in ("stop", "length")
        assert raw.status_code == 200 and raw.headers.get("x-smg-routed-worker-id") == a.url


def test_a_draining_node_finishes_its_stream_and_smg_routes_around_it(make_server, smg):
    nodes = {n.url: n for n in _two_nodes(make_server)}
    router = smg(list(nodes), RECIPE + FAST)
    # Long enough (hundreds of tokens) to be in flight across the SIGTERM, SMG's next probe and the requests below.
    stream = Streamer(router.client, model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
                      max_tokens=600, temperature=0, extra_body={"ignore_eos": True},
                      stream_options={"include_usage": True})
    stream.start()
    try:
        assert stream.first.wait(60) and stream.error is None, stream.error
        draining = nodes[stream.worker]
        (other,) = [n for u, n in nodes.items() if u != stream.worker]
        draining.proc.send_signal(signal.SIGTERM)
        _poll("the draining node's /health to answer 503", lambda: _health_status(draining) == 503, timeout=10)
        _poll("smg to mark the draining node unhealthy",
              lambda: not router.workers()[draining.url]["is_healthy"], timeout=30)
        for i in range(6):
            raw = router.client.completions.with_raw_response.create(model="smollm2", prompt=f"Item {i}:",
                                                                    max_tokens=4, temperature=0)
            assert raw.status_code == 200 and raw.headers.get("x-smg-routed-worker-id") == other.url
            assert raw.parse().usage.completion_tokens >= 1
        assert stream.is_alive(), "the stream ended before the requests above: they proved nothing about draining"
        stream.join(timeout=120)
    finally:
        stream.stop()
    assert stream.error is None, stream.error
    assert stream.finish == "length" and stream.usage.completion_tokens == 600 and "".join(stream.text)
    assert draining.proc.wait(timeout=60) == 0, draining.output()  # drained, then exited cleanly
    assert router.problems() == [] or all(_about(line, draining.url) for line in router.problems())


def _running(router: Router, url: str) -> int:
    """Running requests in the last load SMG polled from this worker (0 before its first poll)."""
    loads = (router.workers()[url].get("engine_load") or {}).get("loads") or [{}]
    return sum(rank.get("num_running_reqs", 0) for rank in loads)


def _polled_at(router: Router) -> dict[str, str | None]:
    """Each worker's last load report as SMG holds it, by the timestamp the node put in it."""
    return {u: (w.get("engine_load") or {}).get("timestamp") for u, w in router.workers().items()}


def _health_status(node) -> int:
    try:
        with urllib.request.urlopen(node.url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _about(line: str, url: str) -> bool:
    """Whether an SMG log line names this worker (by URL or its port)."""
    return url in line or url.rsplit(":", 1)[1] in line
