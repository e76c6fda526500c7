"""The real server in a subprocess, driven by the official openai client and by raw aiohttp."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import pytest

GREEDY = {"temperature": 0.0, "max_tokens": 32}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _kv(server) -> list[dict]:
    with urllib.request.urlopen(server.url + "/debug/kv") as r:
        return json.load(r)["pools"]


def _assert_pools_whole(server, timeout=20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        pools = _kv(server)
        if all(p["num_free"] == p["num_pages"] and p["num_window_free"] == p["num_window_pages"] for p in pools):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV pages leaked: {pools}")
        time.sleep(0.1)


# ---- same output through the API -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("which", ["server", "colocated_server"])
def test_greedy_output_matches_transformers(which, request, loaded_fp32, chat_prompts, prompt_ids, hf_greedy):
    server = request.getfixturevalue(which)
    client = _client(server)
    tok = loaded_fp32.tokenizer

    def one(i: int):
        if i < len(chat_prompts):
            messages = [{"role": "user", "content": chat_prompts[i]}]
            return client.chat.completions.create(model="smollm2", messages=messages, extra_body={"ignore_eos": True},
                                                  **GREEDY)
        return client.completions.create(model="smollm2", prompt=prompt_ids[i], extra_body={"ignore_eos": True},
                                         **GREEDY)

    # All at once (a batch is token-for-token a request alone: test_one_request_alone_equals_it_among_31_*).
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        responses = list(pool.map(one, range(len(prompt_ids))))
    for i, r in enumerate(responses[:len(chat_prompts)]):
        assert r.choices[0].message.content == tok.decode(hf_greedy[i])
        assert r.usage.prompt_tokens == len(prompt_ids[i]) and r.usage.completion_tokens == 32
    for i, r in enumerate(responses[len(chat_prompts):], start=len(chat_prompts)):
        assert r.choices[0].text == tok.decode(hf_greedy[i])
        assert r.choices[0].finish_reason == "length"
    _assert_pools_whole(server)


def test_streamed_equals_non_streamed(server, loaded_fp32, chat_prompts, hf_greedy):
    client = _client(server)
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": chat_prompts[0]}],
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == loaded_fp32.tokenizer.decode(hf_greedy[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32

    stream = client.completions.create(model="smollm2", prompt="Once upon a time", stream=True, **GREEDY)
    text = "".join(c.choices[0].text for c in stream)
    full = client.completions.create(model="smollm2", prompt="Once upon a time", **GREEDY)
    assert text == full.choices[0].text and text


@pytest.mark.slow
def test_one_request_alone_equals_it_among_31_concurrent(server, loaded_fp32, prompt_ids, hf_greedy):
    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                body = {"model": "smollm2", "prompt": prompt_ids[i % 8], "ignore_eos": True, **GREEDY}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return (await r.json())["choices"][0]["text"]
            alone = await one(0)
            together = await asyncio.gather(*(one(i) for i in range(32)))
            return alone, together
    alone, together = asyncio.run(main())
    tok = loaded_fp32.tokenizer
    assert alone == tok.decode(hf_greedy[0])
    assert together == [tok.decode(hf_greedy[i % 8]) for i in range(32)]


# ---- SSE framing and the API's shape -----------------------------------------------------------------

async def _raw_stream(server, path: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["Cache-Control"] == "no-cache"
            return await r.read()


def test_sse_framing_is_exact(server):
    raw = asyncio.run(_raw_stream(server, "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "n": 2, **GREEDY}))
    assert raw.endswith(b"data: [DONE]\n\n") and b"\r" not in raw
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    events = []
    for f in frames[:-2]:
        assert f.startswith(b"data: ") and b"\n" not in f
        events.append(json.loads(f[6:]))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    for index in (0, 1):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert all(e["choices"][0]["finish_reason"] is None for e in mine[:-1])
        assert all(e["choices"][0]["delta"].get("content") for e in mine[1:-1])  # no empty chunks
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == \
        usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]


def test_models_and_health(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200 and json.load(r)["status"] == "ready"


def test_sampling_parameters_and_logprobs(server):
    client = _client(server)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12)
    a = client.chat.completions.create(temperature=0.9, top_p=0.9, seed=7, **kw)
    b = client.chat.completions.create(temperature=0.9, top_p=0.9, seed=7, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # a seed reproduces
    r = client.chat.completions.create(temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1}, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    r = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                  stop=[" 7"])
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text and " 6" in r.choices[0].text
    r = client.completions.create(model="smollm2", prompt=["Hello", "Goodbye"], n=2, max_tokens=3, temperature=0)
    assert len(r.choices) == 4 and r.usage.completion_tokens == 12
    _assert_pools_whole(server)


# ---- errors -------------------------------------------------------------------------------------------

async def _post(server, path: str, data) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        kwargs = {"data": data} if isinstance(data, (bytes, str)) else {"json": data}
        async with s.post(server.url + path, headers={"Content-Type": "application/json"}, **kwargs) as r:
            return r.status, await r.json(), dict(r.headers)


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "JSON"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "nope"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 10_000}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "maximum context length is 8192 tokens"),
])
def test_bad_requests_get_openai_errors(server, body, status, words):
    code, payload, _ = asyncio.run(_post(server, "/v1/chat/completions", body))
    assert code == status
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert words in err["message"]


def test_prompt_too_long_states_both_numbers(server):
    code, payload, _ = asyncio.run(_post(server, "/v1/completions", {"prompt": [5] * 9000, "max_tokens": 4}))
    assert code == 400
    assert "8192" in payload["error"]["message"] and "9000" in payload["error"]["message"]


def test_openai_client_raises_typed_errors(server):
    client = _client(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=0)


# ---- no lost pages, load ------------------------------------------------------------------------------

def test_disconnects_aborts_and_failures_leave_no_pages(server, prompt_ids):
    async def main():
        async with aiohttp.ClientSession() as s:
            async def disconnect_mid_stream(prompt):
                body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    async for _ in r.content:
                        break  # leave after the first frame

            async def complete(prompt):
                body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    return r.status

            async def bad(prompt):
                body = {"prompt": prompt + [10**6], "max_tokens": 8}  # a token id outside the vocabulary
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    return r.status

            long = (prompt_ids[6] * 80)[:1500]
            tasks = [disconnect_mid_stream(long), disconnect_mid_stream(prompt_ids[0])]
            tasks += [complete(prompt_ids[i]) for i in range(4)] + [bad(prompt_ids[1])]
            results = await asyncio.gather(*tasks)
            # A non-streamed request whose client gives up before the answer.
            try:
                await asyncio.wait_for(complete((prompt_ids[5] * 50)[:1800]), timeout=0.3)
            except asyncio.TimeoutError:
                pass
            return results
    results = asyncio.run(main())
    assert results[2:] == [200, 200, 200, 200, 400]
    _assert_pools_whole(server)


@pytest.mark.slow
def test_64_concurrent_streams_with_bimodal_prompts(server, loaded_fp32):
    rng = random.Random(0)
    vocab = range(300, 40000)
    # 60 short prompts and 4 of two prefill chunks (max_num_batched_tokens = 1024)
    lengths = [rng.randint(16, 64) for _ in range(60)] + [rng.randint(1030, 1100) for _ in range(4)]
    rng.shuffle(lengths)
    prompts = [[rng.choice(vocab) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(8, 24) for _ in range(64)]

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            async def one(prompt, n):
                body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    frames = (await r.read()).split(b"\n\n")
                    assert frames[-2] == b"data: [DONE]"
                    return json.loads(frames[-3][6:])["usage"]
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
    usages = asyncio.run(main())
    for u, p, n in zip(usages, prompts, max_tokens):
        assert (u["prompt_tokens"], u["completion_tokens"]) == (len(p), n)
    _assert_pools_whole(server)


def test_decode_device_never_prefills_and_kv_moves_layer_by_layer(server, prompt_ids):
    since = json.load(urllib.request.urlopen(server.url + "/debug/steps"))["now"]
    client = _client(server)
    # Two prefill chunks of at most 1024 tokens, of ids no other test sends: nothing of it is in the prefix cache.
    long_prompt = random.Random(1200).choices(range(1000, 20000), k=1200)
    r = client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    with urllib.request.urlopen(f"{server.url}/debug/steps?since={since}") as resp:
        steps = json.load(resp)
    by_role = {d["role"]: d["steps"] for d in steps["devices"]}
    assert sum(s[2] for s in by_role["prefill"]) == len(long_prompt)
    assert all(s[3] == 0 for s in by_role["prefill"])          # the prefill device never decodes
    assert by_role["decode"] and all(s[2] == 0 for s in by_role["decode"])  # the decode device never prefills
    copies = steps["transfers"][0]["copies"]
    num_layers = 30
    assert len(copies) == 2 * num_layers                       # one copy per layer per prefill chunk
    assert all(c[2] > 0 for c in copies)
    first_decode_start = min(s[0] for s in by_role["decode"])
    assert max(c[1] for c in copies) <= first_decode_start     # every layer landed before decoding began


def _counter(server, name: str, device: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"nodeserve:{name}{{") and f'device="{device}"' in line)


def test_a_repeated_prefix_is_served_from_the_cache_and_reported_as_openai_and_vllm_do(server):
    client = _client(server)
    words = random.Random(7).choices(["alpha", "beta", "gamma", "delta", "omega", "sigma"], k=120)
    messages = [{"role": "system", "content": " ".join(words)}, {"role": "user", "content": "Say hi."}]
    hits = _counter(server, "prefix_cache_hits_total", "cpu:0")
    first = client.chat.completions.create(model="smollm2", messages=messages, **GREEDY)
    again = client.chat.completions.create(model="smollm2", messages=messages, **GREEDY)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every full page but the one holding the last prompt token (which runs again for the first token's logits).
    assert cached == (again.usage.prompt_tokens - 1) // 16 * 16 and cached >= 112
    # The prefill device counted the same tokens as hits (vLLM's metric names, in tokens).
    assert _counter(server, "prefix_cache_hits_total", "cpu:0") - hits == cached
    _assert_pools_whole(server)


@pytest.mark.slow
def test_adaptive_mode_matches_transformers_and_reports_its_role_changes(make_server, loaded_fp32, chat_prompts,
                                                                        hf_greedy):
    # A TPOT target of 2 ms makes every prompt here "long" (its prefill outlasts 32 TPOTs): one device is
    # dedicated to prefill at the first request, and every answer's KV crosses to the other.
    server = make_server('[slo]\ntpot_s = 0.002\n', devices='mode = "adaptive"\ndevices = ["cpu:0", "cpu:1"]')
    client = _client(server)
    for i, text in enumerate(chat_prompts[:3]):
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                           extra_body={"ignore_eos": True}, **GREEDY)
        assert r.choices[0].message.content == loaded_fp32.tokenizer.decode(hf_greedy[i])
    _assert_pools_whole(server)
    with urllib.request.urlopen(server.url + "/debug/steps") as r:
        steps = json.load(r)
    assert [c[2] for c in steps["role_changes"]] == ["prefill"]
    assert {d["role"] for d in steps["devices"]} == {"prefill", "adaptive"}
    assert sum(len(t["copies"]) for t in steps["transfers"]) > 0
    with urllib.request.urlopen(server.url + "/metrics") as r:
        metrics = r.read().decode()
    device = steps["role_changes"][0][1]
    assert f'nodeserve:device_role_changes_total{{device="{device}",model_name="smollm2"}} 1.0' in metrics
