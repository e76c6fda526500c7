"""nodeserve/server/openapi.json: valid, complete, and accurate to protocol.py's rules and the real server.

A small JSON Schema (2020-12 subset) checker below lets the document's schemas be checked against the
parser (differential: the schema and protocol.py must accept exactly the same bodies) and against real
responses, without a jsonschema dependency.
"""

from __future__ import annotations

import http.client
import importlib.resources
import json
import math
import re
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeserve.config import config_from_dict
from nodeserve.server.app import ServerState, create_app
from nodeserve.server.protocol import APIError, Limits, parse_chat_request, parse_completion_request

LIMITS = Limits()
ROUTES = {  # request schema name -> (path, parser, smallest valid body)
    "ChatCompletionRequest": ("/v1/chat/completions", parse_chat_request,
                              {"messages": [{"role": "user", "content": "hi"}]}),
    "CompletionRequest": ("/v1/completions", parse_completion_request, {"prompt": "hi"}),
}


@pytest.fixture(scope="module")
def doc() -> dict:
    text = importlib.resources.files("nodeserve.server").joinpath("openapi.json").read_text(encoding="utf-8")
    return json.loads(text)


# ---- a JSON Schema subset: the keywords openapi.json uses ---------------------------------------------

_ANNOTATIONS = {"description", "examples", "default", "format", "title", "deprecated"}
_KNOWN = _ANNOTATIONS | {
    "$ref", "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "items", "properties", "required", "additionalProperties",
    "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "maxProperties", "propertyNames"}


def _is_type(v, t: str) -> bool:
    if t == "integer":  # JSON Schema: 5.0 is an integer; true is not a number
        return type(v) is int or (type(v) is float and math.isfinite(v) and v.is_integer())
    return {"null": v is None, "boolean": type(v) is bool, "number": type(v) in (int, float),
            "string": type(v) is str, "array": type(v) is list, "object": type(v) is dict}[t]


def _same(a, b) -> bool:
    """JSON equality: true is not 1."""
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    return a == b


def schema_errors(v, schema: dict, doc: dict, path: str = "$") -> list[str]:
    """Why v does not match schema (empty: it matches)."""
    unknown = set(schema) - _KNOWN
    assert not unknown, f"schema keywords this checker does not know at {path}: {unknown}"
    if "$ref" in schema:
        target = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        errs = schema_errors(v, target, doc, path)
        if errs:
            return errs
    errs: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(v, t) for t in types):
            return [f"{path}: {v!r:.60} is not {types}"]
    if "enum" in schema and not any(_same(v, e) for e in schema["enum"]):
        errs.append(f"{path}: {v!r:.60} not in {schema['enum']}")
    if "const" in schema and not _same(v, schema["const"]):
        errs.append(f"{path}: {v!r:.60} != {schema['const']!r}")
    if type(v) in (int, float):
        if "minimum" in schema and v < schema["minimum"]:
            errs.append(f"{path}: {v!r:.60} < {schema['minimum']}")
        if "maximum" in schema and v > schema["maximum"]:
            errs.append(f"{path}: {v!r:.60} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and v <= schema["exclusiveMinimum"]:
            errs.append(f"{path}: {v!r:.60} <= {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and v >= schema["exclusiveMaximum"]:
            errs.append(f"{path}: {v!r:.60} >= {schema['exclusiveMaximum']}")
    if type(v) is str:
        if len(v) < schema.get("minLength", 0) or len(v) > schema.get("maxLength", math.inf):
            errs.append(f"{path}: string length {len(v)} out of range")
        if "pattern" in schema and not re.search(schema["pattern"], v):
            errs.append(f"{path}: {v!r:.60} does not match {schema['pattern']}")
    if type(v) is list:
        if len(v) < schema.get("minItems", 0) or len(v) > schema.get("maxItems", math.inf):
            errs.append(f"{path}: {len(v)} items out of range")
        if "items" in schema:
            for i, item in enumerate(v):
                errs += schema_errors(item, schema["items"], doc, f"{path}[{i}]")
    if type(v) is dict:
        errs += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in v]
        if len(v) > schema.get("maxProperties", math.inf):
            errs.append(f"{path}: {len(v)} properties, more than {schema['maxProperties']}")
        if "propertyNames" in schema:
            for k in v:
                errs += schema_errors(k, schema["propertyNames"], doc, f"{path}[{k!r:.40}]")
        props = schema.get("properties", {})
        for k, item in v.items():
            if k in props:
                errs += schema_errors(item, props[k], doc, f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected {k!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += schema_errors(item, schema["additionalProperties"], doc, f"{path}.{k}")
    if "anyOf" in schema and not any(not schema_errors(v, s, doc, path) for s in schema["anyOf"]):
        errs.append(f"{path}: {v!r:.60} matches none of anyOf")
    if "oneOf" in schema and sum(not schema_errors(v, s, doc, path) for s in schema["oneOf"]) != 1:
        errs.append(f"{path}: {v!r:.60} does not match exactly one of oneOf")
    for s in schema.get("allOf", []):
        errs += schema_errors(v, s, doc, path)
    if "not" in schema and not schema_errors(v, schema["not"], doc, path):
        errs.append(f"{path}: {v!r:.60} matches a 'not'")
    if "if" in schema:
        branch = schema.get("then") if not schema_errors(v, schema["if"], doc, path) else schema.get("else")
        if branch is not None:
            errs += schema_errors(v, branch, doc, path)
    return errs


def test_schema_checker_sanity(doc):
    err = doc["components"]["schemas"]["ErrorResponse"]
    good = {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}
    assert schema_errors(good, err, doc) == []
    assert schema_errors({"error": {**good["error"], "extra": 1}}, err, doc)
    assert schema_errors({"error": {**good["error"], "code": True}}, err, doc)
    assert schema_errors(5.0, {"type": "integer"}, doc) == [] and schema_errors(True, {"type": "integer"}, doc)


# ---- the document --------------------------------------------------------------------------------------

def _walk(node, path=""):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


def _resolve(doc: dict, ref: str):
    target = doc
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return target


def test_document_is_openapi_31_with_resolvable_refs(doc):
    assert doc["openapi"].startswith("3.1.")
    assert doc["info"]["title"] == "nodeserve" and doc["info"]["version"]
    for where, node in _walk(doc):
        if isinstance(node, dict) and "$ref" in node:
            assert node["$ref"].startswith("#/"), where
            _resolve(doc, node["$ref"])  # KeyError: a dangling reference
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    for schema_name in ROUTES:  # unknown fields are ignored, so the schema must allow them
        assert doc["components"]["schemas"][schema_name]["additionalProperties"] is True


def _documented(doc: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def test_every_registered_route_is_documented(doc):
    app = create_app(ServerState(config_from_dict({}, check_devices=False)))
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = _documented(doc)
    assert registered <= documented, f"undocumented routes: {registered - documented}"
    assert documented - registered <= {("GET", "/debug/kv")}, f"documented but not served: {documented - registered}"


def test_error_responses_have_the_openai_shape(doc):
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses)
        ok = responses["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        for code, resp in responses.items():
            if code.startswith(("4", "5")):
                resp = _resolve(doc, resp["$ref"]) if "$ref" in resp else resp
                assert resp["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in _resolve(doc, responses["503"]["$ref"])["headers"]
    error = doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


# ---- request parameters vs protocol.py -------------------------------------------------------------------

def _request_schema(doc, name):
    return doc["components"]["schemas"][name]


def _companions(schema: dict, field: str) -> dict:
    """Fields another field needs (stream_options -> stream: true), from the schema's if/then rules."""
    out = {}
    for rule in schema.get("allOf", []):
        if field in rule.get("if", {}).get("required", []):
            out.update({k: v["const"] for k, v in rule["then"]["properties"].items()})
    return out


def _parse(name: str, body: dict):
    return ROUTES[name][1](body, LIMITS)


@pytest.mark.parametrize("name", ROUTES)
def test_every_documented_parameter_is_accepted_with_its_example(doc, name):
    schema = _request_schema(doc, name)
    base = ROUTES[name][2]
    assert set(schema["required"]) <= set(base)
    for field, prop in schema["properties"].items():
        assert prop.get("examples"), f"{name}.{field} has no example"
        for example in prop["examples"]:
            body = {**base, **_companions(schema, field), field: example}
            assert schema_errors(body, schema, doc) == [], (field, example)
            req = _parse(name, body)  # raises APIError if protocol.py disagrees with the document
            got = getattr(req, field, getattr(req.params, field, None))
            if field not in ("stop", "logprobs", "stream_options", "logit_bias") and got is not None:
                assert got == example, (field, got, example)
        # null counts as absent for every optional field
        if field not in schema["required"]:
            _parse(name, {**base, field: None})
    example = doc["paths"][ROUTES[name][0]]["post"]["requestBody"]["content"]["application/json"]["example"]
    assert schema_errors(example, schema, doc) == []
    _parse(name, example)


def _bounds(prop: dict) -> dict:
    """The numeric bounds of a property (inside anyOf for nullable ones)."""
    return {k: prop[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in prop}


@pytest.mark.parametrize("name", ROUTES)
def test_documented_ranges_are_protocol_ranges(doc, name):
    """Each bound is accepted and the value just past it is a 400 naming the field, as documented."""
    schema = _request_schema(doc, name)
    base = ROUTES[name][2]
    checked = 0
    for field, prop in schema["properties"].items():
        types = prop.get("type", [])
        if "integer" in types:
            step = 1
        elif "number" in types:
            step = 1e-6
        else:
            continue
        for key, bound in _bounds(prop).items():
            inside = bound + (step if key == "exclusiveMinimum" else 0)
            outside = bound + (step if key == "maximum" else -step if key == "minimum" else 0)
            body = {**base, **_companions(schema, field)}
            _parse(name, {**body, field: inside})
            assert schema_errors({**body, field: inside}, schema, doc) == []
            with pytest.raises(APIError) as e:
                _parse(name, {**body, field: outside})
            assert e.value.status == 400 and e.value.param == field
            assert schema_errors({**body, field: outside}, schema, doc)
            checked += 1
    assert checked >= 12


# Values both valid and invalid for most fields; the schema and the parser must agree on each body.
_ANY = [None, True, False, 0, 1, -1, 2, 0.5, 1.0, 5.0, -0.5, 2.5, 16, 17, 20, 21, 100, 100.5, 2**31 - 1, 2**31,
        2**63 - 1, 2**63, -2**63, -2**63 - 1, 10**30, 1e300, -1e300, 1e-300, "", "x", "5", "smollm2", [], [1],
        [0, 2**31 - 1], [2**31], [-1], [1.0], [True], ["a"], [""], ["a"] * 16, ["a"] * 17, {}, {"include_usage": True},
        {"include_usage": 1}, {"include_usage": None, "other": 1}]
_PROMPTS = ["hi", ["a", "b"], [1, 2], [[1], [2, 3]], [[]], [["a"]], ["a", [1]], [1, "a"], ["a", 1], [["a", 1]],
            ["a"] * 64, ["a"] * 65, [[1]] * 65, [None], [{}], [1, None], ["a", ""], [[1, -1]], [[2**31]]]
_MESSAGES = [
    [{"role": "user", "content": "hi"}], [{"role": r, "content": "x"} for r in ("system", "developer", "tool")],
    [{"role": "assistant"}], [{"role": "assistant", "content": None}], [{"role": "user"}],
    [{"role": "user", "content": None}], [{"role": "bot", "content": "x"}], [{"role": None, "content": "x"}],
    [{"role": ["user"], "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": {}}], [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": 1}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    [{"role": "user", "content": ["a"]}], [{"role": "user", "content": "hi", "name": "bob", "tool_calls": []}],
    [{"role": "user", "content": "a"}, 5], [[]],
]
_EXTRA = {"prompt": _PROMPTS, "messages": _MESSAGES, "stop": ["\n", ["\n", "x"], [1], ["a", ""]],
          "stop_token_ids": [[0, 5], [1.5], ["1"], [None]],
          "logit_bias": [{"2": 5}, {"02": 1}, {"2": 101}, {"-1": 0}, {"2": "x"}],
          "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "text", "x": 1}],
          "tool_choice": ["none", "auto", "required", {"type": "function"}],
          "tools": [[{"type": "function"}]]}
_UNKNOWN = ["foo", "functions", "echo", "max_completion_tokens", "top_logprobs", "best_of"]


def _float_token_ids(prompt) -> bool:
    """Token ids written as 1.0: a 400, though JSON Schema counts 1.0 as an integer (documented in words)."""
    if not isinstance(prompt, list) or not prompt:
        return False
    if type(prompt[0]) not in (str, list):
        return any(type(t) is float for t in prompt)
    return any(isinstance(p, list) and any(type(t) is float for t in p) for p in prompt)


def _body_strategy(schema: dict, base: dict):
    # `user` is documented as a string but never read, so any value is accepted: leave it out.
    fields = [f for f in schema["properties"] if f != "user"] + _UNKNOWN
    patch = st.dictionaries(st.sampled_from(fields),
                            st.sampled_from(_ANY) | st.sampled_from(sum(_EXTRA.values(), [])),
                            min_size=1, max_size=3)
    return patch.map(lambda p: {**base, **p})


@pytest.mark.parametrize("name", ROUTES)
def test_schema_and_parser_agree_on_random_bodies(doc, name):
    """Differential: the documented schema accepts a body exactly when protocol.py does."""
    schema = _request_schema(doc, name)
    tried = [0, 0]

    @settings(max_examples=600, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_body_strategy(schema, ROUTES[name][2]))
    def run(body):
        if _float_token_ids(body.get("prompt")):
            return
        errors = schema_errors(body, schema, doc)
        try:
            _parse(name, body)
            accepted = True
        except APIError as e:
            assert e.status == 400
            accepted = False
        tried[0] += 1
        tried[1] += accepted
        assert accepted == (not errors), (body, errors)

    run()
    print(f"\nopenapi[{name}]: schema and parser agreed on {tried[0]} bodies ({tried[1]} valid)")
    assert tried[0] >= 300 and 0 < tried[1] < tried[0]


# ---- responses vs the real server --------------------------------------------------------------------------

def _call(server, method: str, path: str, body: dict | None = None) -> tuple[int, str, bytes]:
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def _response_schema(doc, path, method, status, media="application/json"):
    resp = doc["paths"][path][method]["responses"][str(status)]
    resp = _resolve(doc, resp["$ref"]) if "$ref" in resp else resp
    return resp["content"][media]


def test_real_responses_match_the_documented_schemas(doc, server):
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "n": 2, "logprobs": True,
            "top_logprobs": 2, "stop": ["\n"]}
    completion = {"prompt": ["Once upon", [1, 2, 3]], "max_tokens": 3, "echo": True, "logprobs": 2}
    cases = [("get", "/v1/models", None), ("get", "/health", None), ("get", "/debug/kv", None),
             ("get", "/debug/profile", None), ("get", "/v1/loads", None),
             ("post", "/v1/chat/completions", chat), ("post", "/v1/completions", completion)]
    for method, path, body in cases:
        status, ctype, data = _call(server, method.upper(), path, body)
        assert status == 200 and ctype.startswith("application/json"), (path, status, data[:300])
        schema = _response_schema(doc, path, method, 200)["schema"]
        assert schema_errors(json.loads(data), schema, doc) == [], path
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        status, ctype, data = _call(server, "POST", path, {**body, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        assert status == 200 and ctype.startswith("text/event-stream")
        events = _response_schema(doc, path, "post", 200, "text/event-stream")["x-sse-data"]
        frames = data.split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""]
        for frame in frames[:-1]:
            assert frame.startswith(b"data: ")
            payload = frame[6:].decode()
            value = payload if payload == "[DONE]" else json.loads(payload)
            assert schema_errors(value, events, doc) == [], payload
        assert "usage" in json.loads(frames[-3][6:])
    # errors
    for path, body, code in (("/v1/chat/completions", {"messages": []}, 400),
                             ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404)):
        status, _, data = _call(server, "POST", path, body)
        assert status == code
        assert schema_errors(json.loads(data), _response_schema(doc, path, "post", code)["schema"], doc) == []
