"""The default configuration (model.quantization = "auto": the GGUF's own Q4_1/Q8_0 blocks and the native CPU
kernels) served end to end: answers, concurrency, aborts, and every KV page back."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest

from nodeserve.model import block_quant

pytestmark = pytest.mark.skipif(not block_quant.available(), reason="the native kernels could not be built")


def _pools_whole(url: str, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url + "/debug/kv") as r:
            pools = json.load(r)["pools"]
        if all(p["num_free"] == p["num_pages"] for p in pools) or time.monotonic() > deadline:
            return pools


@pytest.mark.parametrize("devices", ['mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]',
                                     'mode = "colocated"\ndevices = ["cpu:0", "cpu:1"]'])
@pytest.mark.slow
def test_default_quantization_serves_and_frees_every_page(make_server, devices):
    server = make_server(devices=devices, quantization="auto")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content

    async def main():
        async with aiohttp.ClientSession() as s:
            async def stream(prompt: str, max_tokens: int, leave_early: bool = False) -> int:
                body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                        "temperature": 0.7, "seed": max_tokens}
                frames = 0
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        frames += line.startswith(b"data: {")
                        if leave_early and frames == 2:
                            break
                return frames

            prompts = [f"Story {i}: once upon a time" * (1 + 40 * (i % 3 == 0)) for i in range(12)]
            return await asyncio.gather(*(stream(p, 24 + i, leave_early=i == 5) for i, p in enumerate(prompts)))

    frames = asyncio.run(main())
    assert [f for i, f in enumerate(frames) if i != 5] == [24 + i for i in range(12) if i != 5]
    pools = _pools_whole(server.url)
    assert all(p["num_free"] == p["num_pages"] for p in pools), pools
