"""Running as a service: systemd notify and watchdog, graceful drain, API key, Prometheus metrics."""

from __future__ import annotations

import pytest
import asyncio
import gc
import json
import os
import signal
import socket
import threading
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from nodeserve.config import config_from_dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_systemd_ready_watchdog_stopping_and_a_stalled_worker_stops_the_pings(notify_socket, monkeypatch):
    from nodeserve.server import serve as serve_module

    notify = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setattr(serve_module, "WORKER_STALL_S", 1.0)
    port = _free_port()
    config = config_from_dict({"model": {"dtype": "float32"}, "server": {"port": port, "drain_timeout": 2.0},
                               "kv": {"memory_gib": 0.25}})
    ready_state = []
    release = threading.Event()

    async def scenario():
        server = asyncio.create_task(serve_module.serve(config, on_ready=ready_state.append))
        while not ready_state:
            await asyncio.sleep(0.1)
        # READY=1 is sent before on_ready runs, but the listener thread may not have read it yet.
        for _ in range(50):
            if notify.times("READY=1"):
                break
            await asyncio.sleep(0.1)
        assert notify.times("READY=1"), notify.messages
        # start-up's objects (model, tokenizer, vocabularies) are frozen: the collector's full passes skip them
        assert gc.get_freeze_count() > 50_000
        await asyncio.sleep(1.0)
        healthy_pings = len(notify.times("WATCHDOG=1"))
        assert healthy_pings >= 3

        # Wedge the decode worker inside a step: its loop stops turning and the pings must stop.
        worker = ready_state[0].engine.decode_workers[0]
        run = worker.runner.run

        def wedged(*args, **kwargs):
            release.wait(timeout=30)
            return run(*args, **kwargs)
        worker.runner.run = wedged
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"http://127.0.0.1:{port}/v1/completions",
                                             json={"prompt": "hi", "max_tokens": 4}))
            await asyncio.sleep(2.5)
            stalled_at = time.monotonic()
            await asyncio.sleep(1.0)
            pings_while_stalled = [t for t in notify.times("WATCHDOG=1") if t > stalled_at]
            release.set()
            worker.runner.run = run
            resp = await req
            assert resp.status == 200
            await asyncio.sleep(0.8)
            recovered = [t for t in notify.times("WATCHDOG=1") if t > stalled_at + 1.0]
        os.kill(os.getpid(), signal.SIGTERM)
        return await server, pings_while_stalled, recovered

    try:
        code, stalled, recovered = asyncio.run(scenario())
    finally:
        release.set()
        gc.unfreeze()  # the rest of this test process collects as usual
    assert code == 0
    assert stalled == []
    assert recovered, "pings resume once the worker makes progress again"
    assert notify.times("STOPPING=1")
    assert any(m.startswith("STATUS=loading") for _, m in notify.messages)


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(make_server):
    server = make_server("drain_timeout = 60.0")

    async def main():
        async with aiohttp.ClientSession() as s:
            async def stream():
                body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True,
                        "temperature": 0}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    return await r.read()
            tasks = [asyncio.create_task(stream()) for _ in range(3)]
            await asyncio.sleep(1.5)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with s.post(server.url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}) as r:
                refused = (r.status, r.headers.get("Retry-After"), await r.json())
            async with s.get(server.url + "/health") as r:
                health = r.status
            return await asyncio.gather(*tasks), refused, health
    bodies, refused, health = asyncio.run(main())
    assert server.proc.wait(timeout=60) == 0
    for raw in bodies:
        frames = raw.split(b"\n\n")
        assert frames[-2] == b"data: [DONE]"
        events = [json.loads(f[6:]) for f in frames[:-2]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all("error" not in e for e in events)  # no error event: every stream ended intact
    assert refused[0] == 503 and refused[1] is not None and refused[2]["error"]["code"] == 503
    assert health == 503


@pytest.mark.slow
def test_drain_timeout_ends_streams_with_an_error_event_and_exits_0(make_server):
    server = make_server("drain_timeout = 1.0")

    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                await r.content.readline()
                server.proc.send_signal(signal.SIGTERM)
                return await r.read()
    raw = asyncio.run(main())
    assert server.proc.wait(timeout=60) == 0
    frames = raw.split(b"\n\n")
    assert frames[-2] == b"data: [DONE]"
    assert json.loads(frames[-3][6:])["error"]["message"] == "generation failed: the server is shutting down"


@pytest.mark.slow
def test_api_key_and_metrics_agree_with_traffic(make_server):
    server = make_server('api_key = "sekrit"\nopen_metrics = true')

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                no_key = (r.status, await r.json())
            bad = {"Authorization": "Bearer wrong"}
            async with s.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=bad) as r:
                wrong_key = r.status
            good = {"Authorization": "Bearer sekrit"}
            sent = []
            for i, n in enumerate((3, 5, 7)):
                body = {"prompt": f"Say {i}", "max_tokens": n, "ignore_eos": True, "stream": i == 1}
                async with s.post(server.url + "/v1/completions", json=body, headers=good) as r:
                    assert r.status == 200
                    await r.read()
                    sent.append(n)
            # The token counters count tokens as they come, not when their request ends (vLLM counts per step).
            body = {"prompt": "Say 3", "max_tokens": 40, "ignore_eos": True, "stream": True}
            async with s.post(server.url + "/v1/completions", json=body, headers=good) as r:
                chunks = 0
                async for line in r.content:
                    chunks += line.startswith(b"data: {")
                    if chunks == 4:
                        async with s.get(server.url + "/metrics") as m:
                            midway = await m.text()
                sent.append(40)
            async with s.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1},
                              headers=good) as r:
                assert r.status == 400
            async with s.get(server.url + "/health") as r:
                health = r.status
            async with s.get(server.url + "/metrics") as r:
                metrics = await r.text()
            return no_key, wrong_key, health, sent, metrics, midway
    no_key, wrong_key, health, sent, metrics, midway = asyncio.run(main())
    assert no_key[0] == 401 and no_key[1]["error"]["type"] == "AuthenticationError"
    assert wrong_key == 401 and health == 200
    samples = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))] = \
                sample.value
    assert samples[("nodeserve:generation_tokens_total", ())] == samples[("vllm:generation_tokens_total", ())] \
        == sum(sent)
    done = sum(sent[:-1])  # the streamed 40-token request had sent 4 chunks: 4 tokens or more, not all 40
    counted = [s.value for f in text_string_to_metric_families(midway) for s in f.samples
               if s.name in ("nodeserve:generation_tokens_total", "vllm:generation_tokens_total")]
    assert len(counted) == 2 and all(done + 4 <= c < done + 40 for c in counted), (done, counted)
    assert samples[("nodeserve:request_success_total", (("finished_reason", "length"),))] == len(sent)
    assert samples[("nodeserve:time_to_first_token_seconds_count", ())] == len(sent)
    assert samples[("nodeserve:inter_token_latency_seconds_count", ())] == sum(n - 1 for n in sent)
    assert samples[("nodeserve:request_rejected_total", (("reason", "unauthorized"),))] == 2
    assert samples[("nodeserve:request_rejected_total", (("reason", "bad_request"),))] == 1
    assert samples[("nodeserve:kv_transfer_time_seconds_count", ())] == len(sent)
    assert samples[("nodeserve:kv_pages_used", (("device", "cpu:1"),))] == 0
