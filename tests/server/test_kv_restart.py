"""A restart keeps the KV cache: a real server with a disk tier is stopped with SIGTERM and started again, and the
same prompt then reports its prefix cached (loaded from disk), with the cold run's greedy text, through the real
openai client."""

from __future__ import annotations

import re

import openai
import pytest


def _complete(server, prompt: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)


@pytest.mark.slow
def test_a_prefix_survives_a_restart_through_the_disk_tier(make_server, tmp_path):
    env = {"NODESERVE_KV_DISK_PATH": str(tmp_path / "kv"), "NODESERVE_KV_DISK_GIB": "1"}
    prompt = "Notes from the harbor master's log. " + " ".join(
        f"Day {i}: the {c} ship came in at dawn with a cargo of {w}." for i, (c, w) in
        enumerate(zip(["red", "blue", "green", "grey"] * 10, ["salt", "tea", "copper", "wool", "glass"] * 8))) + \
        "\nQuestion: what came in on day 3?\nAnswer:"
    first = make_server(env=env)
    cold = _complete(first, prompt)
    assert cold.usage.prompt_tokens >= 400 and cold.usage.prompt_tokens_details.cached_tokens == 0
    first.stop()  # SIGTERM: the pages cached on the devices go to disk
    assert first.proc.returncode == 0, first.output()

    again = make_server(env=env)
    warm = _complete(again, prompt)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= (cold.usage.prompt_tokens - 1) // 16 * 16 - 16, again.output()
    assert warm.choices[0].text == cold.choices[0].text
    assert re.search(rf"{cached} cached \(.*disk {cached}", again.output())  # the request's log line: from disk
