"""The access log (one line per request, never the prompt), the periodic stats line and model aliases, on a
server of their own."""

from __future__ import annotations

import pytest
import time

import openai


@pytest.mark.slow
def test_access_log_stats_line_and_aliases(make_server):
    server = make_server("access_log = true\nstats_interval = 0.5", quantization="auto",
                         env={"NODESERVE_MODEL_ALIASES": '["gpt-4o-mini", "smol"]'})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2", "gpt-4o-mini", "smol"]
    secret = "my secret prompt text"
    reply = client.completions.create(model="gpt-4o-mini", prompt=secret, max_tokens=2,
                                      extra_headers={"X-Request-Id": "req-42"})
    assert reply.model == "smollm2"
    time.sleep(1.5)
    log = server.output()
    line = next(l for l in log.splitlines() if "POST /v1/completions" in l)
    assert " 200 " in line and "rid=req-42" in line and "ms" in line
    assert secret not in log
    stats = [l for l in log.splitlines() if "stats:" in l]
    assert stats and "generation" in stats[-1] and "cpu:1" in stats[-1]
