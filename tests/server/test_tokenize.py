"""/tokenize, /detokenize (vLLM's shapes), /version and /openapi.json against the real server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai

from nodeserve import __version__


def _call(server, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_tokenize_is_what_generation_counts(server, loaded_fp32):
    tok = loaded_fp32.tokenizer
    status, body = _call(server, "/tokenize", {"prompt": "The capital of France is"})
    assert status == 200 and body["tokens"] == tok.encode("The capital of France is")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat = _call(server, "/tokenize", {"messages": messages})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    status, no_prompt = _call(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_prompt["count"] < chat["count"]


def test_detokenize_round_trips(server, loaded_fp32):
    ids = loaded_fp32.tokenizer.encode("Paris is lovely in spring.")
    status, body = _call(server, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": "Paris is lovely in spring."}


def test_bad_bodies_get_openai_errors(server):
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {}, "tokens"),
                              ("/detokenize", {"tokens": [1, 10**8]}, "tokens[1]"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens[0]")):
        status, err = _call(server, path, body)
        assert status == 400 and err["error"]["param"] == param, (path, body, err)
    status, err = _call(server, "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert status == 404


def test_version_and_openapi(server):
    assert _call(server, "/version") == (200, {"version": __version__})
    status, doc = _call(server, "/openapi.json")
    assert status == 200 and {"/tokenize", "/detokenize", "/version", "/v1/chat/completions"} <= set(doc["paths"])


def test_request_ids_are_echoed_and_made(server):
    req = urllib.request.Request(server.url + "/version", headers={"X-Request-Id": "abc-123"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["X-Request-Id"] == "abc-123"
    with urllib.request.urlopen(server.url + "/version") as r:
        assert len(r.headers["X-Request-Id"]) == 32
