"""OpenAI wire format: request parsing and validation, response and SSE builders, errors.

Pure functions and dataclasses only (no aiohttp, no engine), so every rule here is unit-testable.
Conventions follow OpenAI's API reference and vLLM's OpenAI server.

Validation is hand-written rather than pydantic: it keeps the dependency list to what the project
already has, and gives OpenAI-shaped 400s whose message and `param` name the offending field.

Rules shared by both routes:
  - A field sent as JSON null counts as absent (SDK-generated clients send nulls for unset fields).
  - Unknown fields are accepted and ignored; known OpenAI fields nodeserve does not implement (best_of, suffix,
    functions, audio, prediction, ...; see CHAT_FIELDS) are a 400 naming them.
  - Integers must be JSON integers (5.0 is accepted as 5; true, 5.5 and "5" are not).
  - Floats accept integers; NaN and infinities are rejected (Python's json parser accepts them).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from nodeserve.core.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str | None = None, reject_reason: str | None = None):
        super().__init__(message)
        self.status = status
        # The metrics' rejection reason, when it is not the one the status implies (a prompt too large for
        # the context is a 400 counted as "too_large", once).
        self.reject_reason = reject_reason
        self.message = message
        self.param = param
        # Statuses without their own name (413, 422, ...) fall back by class, like the openai SDK.
        self.type = type or _ERROR_TYPES.get(status) or (
            "InternalServerError" if status >= 500 else "BadRequestError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# A \uXXXX escape for a UTF-16 surrogate (U+D800..U+DFFF); a pair of them is one valid character.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(raw: bytes) -> object:
    """Decode a request body. Bad JSON is a 400, not the 500 an uncaught ValueError would become."""
    try:
        body = json.loads(raw)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; very deep nesting is a RecursionError.
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"Request body is not valid JSON: {e}") from None
    # json.loads turns a lone surrogate escape ("\ud800"), or its raw bytes (it decodes bytes with
    # "surrogatepass"), into a str that cannot be encoded as UTF-8, so the tokenizer, or a response that
    # echoes it, would fail with a 500. An ASCII body without such an escape can't hold one: skip the check.
    if isinstance(raw, str) or not raw.isascii() or _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "Request body is not valid JSON: it contains a lone UTF-16 surrogate "
                                "(U+D800 to U+DFFF not part of a pair)") from None
        except RecursionError:
            raise APIError(400, "Request body is not valid JSON: it is nested too deeply") from None
    return body


# --------------------------------------------------------------------------------------------
# Field readers: each takes the raw JSON value and the param name to blame.
# --------------------------------------------------------------------------------------------

_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
              dict: "object", type(None): "null"}

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT32_MAX = 2**31 - 1


def _kind(value: object) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    # Clients can send 4,000-digit numbers; don't echo them back in full.
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _range_error(param: str, value: object, lo, hi, lo_open: bool = False) -> APIError:
    low = f"greater than {lo}" if lo_open else f"at least {lo}"
    if hi is None:
        return _bad(param, f"'{param}' must be {low}, got {_show(value)}")
    return _bad(param, f"'{param}' must be {low} and at most {hi}, got {_show(value)}")


def _as_int(value: object, param: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # some clients serialize every number as a float
    # type() not isinstance(): bool is an int in Python, but `true` is not a number to a client.
    if type(value) is not int:
        raise _bad(param, f"'{param}' must be an integer, got {_kind(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _range_error(param, value, lo, hi)
    return value


def _as_float(value: object, param: str, lo: float, hi: float | None = None,
              lo_open: bool = False) -> float:
    if type(value) not in (int, float):
        raise _bad(param, f"'{param}' must be a number, got {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(param, f"'{param}' must be a finite number, got {value}")
    # Compare before float(): float(10**400) would raise OverflowError.
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise _range_error(param, value, lo, hi, lo_open)
    return float(value)


def _as_bool(value: object, param: str) -> bool:
    if type(value) is not bool:
        raise _bad(param, f"'{param}' must be a boolean, got {_kind(value)}")
    return value


def _as_str(value: object, param: str) -> str:
    if type(value) is not str:
        raise _bad(param, f"'{param}' must be a string, got {_kind(value)}")
    return value


def _as_list(value: object, param: str) -> list:
    if type(value) is not list:
        raise _bad(param, f"'{param}' must be an array, got {_kind(value)}")
    return value


def _as_object(value: object, param: str) -> dict:
    if type(value) is not dict:
        raise _bad(param, f"'{param}' must be an object, got {_kind(value)}")
    return value


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """Per-server caps on what one request may ask for (from config)."""

    max_n: int = 16
    max_stop: int = 16
    max_stop_bytes: int = 1024   # all stop strings together, UTF-8: every token re-searches the held-back text
    max_logprobs: int = 20
    max_tokens: int = 1_000_000  # a larger max_tokens is a 400; below it resolve_max_tokens decides
    max_prompts: int = 64        # prompts in one completions batch

    def __post_init__(self):
        for name in ("max_n", "max_stop", "max_stop_bytes", "max_tokens", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"Limits.max_logprobs must be >= 0, got {self.max_logprobs}")


@dataclass
class CompletionRequest:
    """POST /v1/completions, validated."""

    model: str | None                 # None: the served model
    prompts: list[str | list[int]]    # each prompt is text or token ids
    params: SamplingParams            # max_tokens as the client gave it (None: the engine resolves it)
    n: int
    stream: bool
    include_usage: bool
    echo: bool


@dataclass
class ChatRequest:
    """POST /v1/chat/completions, validated."""

    model: str | None                 # None: the served model
    messages: list[dict]              # roles checked; text parts joined so content is str (or None)
    params: SamplingParams            # max_tokens as the client gave it (None: the engine resolves it)
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool                    # when true, params.logprobs = top_logprobs (default 0)
    tools: list[dict] = field(default_factory=list)  # [{"type": "function", "function": {name, parameters, ...}}]
    tool_choice: str | dict = "auto"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    chat_template_kwargs: dict = field(default_factory=dict)  # vLLM's: extra variables for the chat template

    @property
    def named_tool(self) -> dict | None:
        """The tool a named tool_choice forces, else None."""
        if not isinstance(self.tool_choice, dict):
            return None
        name = self.tool_choice["function"]["name"]
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _get(body: dict, name: str, reader, *args, default=None, **kwargs):
    """Read an optional field; JSON null counts as absent."""
    value = body.get(name)
    return default if value is None else reader(value, name, *args, **kwargs)


def _parse_stop(value: object, limits: Limits) -> list[str]:
    stops = [value] if isinstance(value, str) else _as_list(value, "stop")
    if len(stops) > limits.max_stop:
        raise _bad("stop", f"'stop' may have at most {limits.max_stop} entries, got {len(stops)}")
    for s in stops:
        # An empty stop string would match at every position and end generation at once.
        if type(s) is not str or not s:
            raise _bad("stop", "'stop' must be a non-empty string or an array of non-empty strings")
    num_bytes = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
    if num_bytes > limits.max_stop_bytes:  # held-back text is re-searched for every stop string on every token
        raise _bad("stop", f"'stop' strings may total at most {limits.max_stop_bytes} bytes (UTF-8), got {num_bytes}")
    return stops


def _parse_stop_token_ids(value: object) -> list[int]:
    ids = _as_list(value, "stop_token_ids")
    return [_as_int(t, f"stop_token_ids[{i}]", 0, INT32_MAX) for i, t in enumerate(ids)]


def _parse_max_tokens(body: dict, name: str, limits: Limits) -> int | None:
    return _get(body, name, _as_int, 1, limits.max_tokens)


def _parse_stream(body: dict) -> tuple[bool, bool]:
    """Returns (stream, include_usage)."""
    stream = _get(body, "stream", _as_bool, default=False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    # vLLM and OpenAI both 400 here rather than silently dropping the usage the client asked for.
    if not stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    options = _as_object(options, "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is None:
        return stream, False
    return stream, _as_bool(include_usage, "stream_options.include_usage")


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows; each costs the sampler a little every step
_TOKEN_ID_KEY = re.compile(r"(0|[1-9][0-9]{0,8})")  # a token id as a JSON object key; the vocabulary check is later


def _parse_logit_bias(value: object, param: str) -> dict[int, float]:
    bias = _as_object(value, param)
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(param, f"'{param}' may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out = {}
    for key, b in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise _bad(param, f"'{param}' keys must be token ids (decimal integers), got {_show(key)}")
        out[int(key)] = _as_float(b, param, -100.0, 100.0)
    return out


def _reject_unsupported(body: dict, fields: tuple[str, ...]) -> None:
    """Fields nodeserve does not implement are a 400 naming them, never silently ignored. The values that mean
    "nothing asked" (best_of 1, modalities ["text"], store false) are accepted."""
    if "response_format" in fields and body.get("response_format") is not None:
        fmt = _as_object(body["response_format"], "response_format")
        if fmt.get("type") != "text":
            raise _bad("response_format", "'response_format' other than {\"type\": \"text\"} is only supported on "
                                          "/v1/chat/completions")
    if "best_of" in fields and body.get("best_of") is not None:
        if _as_int(body["best_of"], "best_of") != 1:
            raise _bad("best_of", "'best_of' other than 1 is not supported; use 'n'")
    if "suffix" in fields and body.get("suffix") is not None:
        raise _bad("suffix", "'suffix' is not supported (no fill-in-the-middle)")
    for name in fields:
        why = _REFUSED.get(name)
        if why is not None and body.get(name) is not None:
            raise _bad(name, f"'{name}' is not supported: {why}")
    if "modalities" in fields and body.get("modalities") is not None:
        if body["modalities"] != ["text"]:
            raise _bad("modalities", "'modalities' other than [\"text\"] is not supported (text output only)")
    if "store" in fields and body.get("store") is not None:
        if _as_bool(body["store"], "store"):
            raise _bad("store", "'store' true is not supported: nodeserve keeps no completions")


# Chat fields refused whenever they are not null, and why.
_REFUSED = {
    "functions": "it is deprecated; send 'tools'",
    "function_call": "it is deprecated; send 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this server runs no reasoning models",
    "verbosity": "this server does not support it",
    "moderation": "this server does not moderate",
}

# Every field of the openai SDK's ChatCompletionCreateParams / CompletionCreateParams, and what nodeserve does
# with it: "implemented", "ignored" (an identifier or a billing hint that changes no output), or "refused" (a
# 400 naming it unless null or the value that asks for nothing). tests/server/test_protocol.py checks the SDK's
# keys against these tables.
CHAT_FIELDS = {
    **dict.fromkeys(("messages", "model", "n", "temperature", "top_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
                     "max_completion_tokens", "stream", "stream_options", "tools", "tool_choice",
                     "parallel_tool_calls", "response_format"), "implemented"),
    **dict.fromkeys(("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options"), "ignored"),
    **dict.fromkeys((*_REFUSED, "modalities", "store"), "refused"),
}
COMPLETION_FIELDS = {
    **dict.fromkeys(("prompt", "model", "n", "temperature", "top_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "stream", "stream_options",
                     "echo"), "implemented"),
    "user": "ignored",
    **dict.fromkeys(("best_of", "suffix"), "refused"),
}

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128  # as OpenAI allows


def _parse_tools(value: object, param: str = "tools") -> list[dict]:
    tools = _as_list(value, param)
    if len(tools) > MAX_TOOLS:
        raise _bad(param, f"'{param}' may have at most {MAX_TOOLS} entries, got {len(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        at = f"{param}[{i}]"
        tool = _as_object(tool, at)
        if tool.get("type") != "function":
            raise _bad(f"{at}.type", f"'{at}.type' must be \"function\", got {_show(tool.get('type'))}")
        if tool.get("function") is None:
            raise _bad(f"{at}.function", f"'{at}.function' is required")
        fn = _as_object(tool["function"], f"{at}.function")
        name = fn.get("name")
        if type(name) is not str or not _TOOL_NAME.fullmatch(name):
            raise _bad(f"{at}.function.name", f"'{at}.function.name' must be 1 to 64 letters, digits, '_', '.' or "
                                              f"'-', got {_show(name)}")
        if name in names:
            raise _bad(f"{at}.function.name", f"'{at}.function.name' {name!r} is given twice")
        names.add(name)
        for key, reader in (("description", _as_str), ("parameters", _as_object), ("strict", _as_bool)):
            if fn.get(key) is not None:
                reader(fn[key], f"{at}.function.{key}")
    return tools


def _parse_tool_choice(value: object, tools: list[dict]) -> str | dict:
    if type(value) is str:
        if value not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_show(value)}")
        if value == "required" and not tools:
            raise _bad("tool_choice", "'tool_choice' \"required\" needs a non-empty 'tools'")
        return value
    choice = _as_object(value, "tool_choice")
    fn = choice.get("function")
    if choice.get("type") != "function" or type(fn) is not dict or type(fn.get("name")) is not str:
        raise _bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if all(t["function"]["name"] != fn["name"] for t in tools):
        raise _bad("tool_choice", f"'tool_choice' names function {_show(fn['name'])}, which is not in 'tools'")
    return choice


def _parse_response_format(value: object) -> dict | None:
    """None for plain text, else {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""
    fmt = _as_object(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return fmt
    if kind != "json_schema":
        raise _bad("response_format.type", "'response_format.type' must be \"text\", \"json_object\" or "
                                           f"\"json_schema\", got {_show(kind)}")
    if fmt.get("json_schema") is None:
        raise _bad("response_format.json_schema", "'response_format.json_schema' is required with type json_schema")
    spec = _as_object(fmt["json_schema"], "response_format.json_schema")
    name = spec.get("name")
    if type(name) is not str or not _TOOL_NAME.fullmatch(name):
        raise _bad("response_format.json_schema.name", "'response_format.json_schema.name' must be 1 to 64 letters, "
                                                       f"digits, '_', '.' or '-', got {_show(name)}")
    for key, reader in (("schema", _as_object), ("description", _as_str), ("strict", _as_bool)):
        if spec.get(key) is not None:
            reader(spec[key], f"response_format.json_schema.{key}")
    return fmt


def _check_body(body: object) -> dict:
    if type(body) is not dict:
        raise APIError(400, f"Request body must be a JSON object, got {_kind(body)}")
    return body


def _parse_common(body: dict, limits: Limits) -> tuple[str | None, int, SamplingParams]:
    """Fields both routes share. Returns (model, n, params); the caller adds max_tokens and logprobs."""
    model = _get(body, "model", _as_str)
    n = _get(body, "n", _as_int, 1, limits.max_n, default=1)
    top_k = _get(body, "top_k", _as_int, -1, INT32_MAX, default=0)
    stop = body.get("stop")
    stop_token_ids = body.get("stop_token_ids")
    params = SamplingParams(
        # vLLM allows temperatures above OpenAI's 2; 100 is already a uniform distribution.
        temperature=_get(body, "temperature", _as_float, 0.0, 100.0, default=1.0),
        top_p=_get(body, "top_p", _as_float, 0.0, 1.0, lo_open=True, default=1.0),
        top_k=max(top_k, 0),  # -1 and 0 both mean off; store 0 so -1 never travels further
        min_p=_get(body, "min_p", _as_float, 0.0, 1.0, default=0.0),
        seed=_get(body, "seed", _as_int, INT64_MIN, INT64_MAX),
        presence_penalty=_get(body, "presence_penalty", _as_float, -2.0, 2.0, default=0.0),
        frequency_penalty=_get(body, "frequency_penalty", _as_float, -2.0, 2.0, default=0.0),
        repetition_penalty=_get(body, "repetition_penalty", _as_float, 0.0, 10.0, lo_open=True,
                                default=1.0),
        stop=[] if stop is None else _parse_stop(stop, limits),
        stop_token_ids=[] if stop_token_ids is None else _parse_stop_token_ids(stop_token_ids),
        ignore_eos=_get(body, "ignore_eos", _as_bool, default=False),
        min_tokens=_get(body, "min_tokens", _as_int, 0, limits.max_tokens, default=0),
        logit_bias=_get(body, "logit_bias", _parse_logit_bias, default={}),
    )
    return model, n, params


# ---- completions ----

def _parse_token_ids(ids: list, param: str) -> list[int]:
    if not ids:
        raise _bad(param, f"'{param}' must not be empty")
    for j, t in enumerate(ids):
        if not (type(t) is int and 0 <= t <= INT32_MAX):
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]' must be a token id (an integer from 0 to "
                                        f"{INT32_MAX}), got {_show(t)}")
    return ids


def _parse_prompts(value: object, limits: Limits) -> list[str | list[int]]:
    """Accepts a string, a list of strings, a list of token ids, or a list of token id lists."""
    if value is None:
        raise _bad("prompt", "'prompt' is required")
    if type(value) is str:
        if not value:
            raise _bad("prompt", "'prompt' must not be empty")
        return [value]
    if type(value) is not list:
        raise _bad("prompt", "'prompt' must be a string, an array of strings, an array of token "
                             f"ids or an array of token id arrays, got {_kind(value)}")
    if not value:
        raise _bad("prompt", "'prompt' must not be empty")
    if type(value[0]) not in (str, list):
        return [_parse_token_ids(value, "prompt")]  # one prompt given as token ids
    if len(value) > limits.max_prompts:
        raise _bad("prompt", f"'prompt' may have at most {limits.max_prompts} prompts, "
                             f"got {len(value)}")
    prompts: list[str | list[int]] = []
    for i, p in enumerate(value):
        name = f"prompt[{i}]"
        if type(p) is list:
            prompts.append(_parse_token_ids(p, name))
        elif type(p) is str and p:
            prompts.append(p)
        else:
            raise _bad(name, f"'{name}' must be a non-empty string or an array of token ids, "
                             f"got {_show(p) if type(p) is str else _kind(p)}")
    return prompts


def parse_completion_request(body: object, limits: Limits) -> CompletionRequest:
    """Validate a /v1/completions body. Raises APIError(400) naming the first bad field."""
    body = _check_body(body)
    model, n, params = _parse_common(body, limits)
    _reject_unsupported(body, ("response_format", "best_of", "suffix"))
    prompts = _parse_prompts(body.get("prompt"), limits)
    params = replace(params, max_tokens=_parse_max_tokens(body, "max_tokens", limits),
                     logprobs=_get(body, "logprobs", _as_int, 0, limits.max_logprobs))
    stream, include_usage = _parse_stream(body)
    echo = _get(body, "echo", _as_bool, default=False)
    return CompletionRequest(model=model, prompts=prompts, params=params, n=n, stream=stream,
                             include_usage=include_usage, echo=echo)


# ---- chat ----

def _parse_content(value: object, param: str, role: str) -> str | None:
    if value is None:
        # Assistant turns that only carried tool calls have null content.
        if role == "assistant":
            return None
        raise _bad(param, f"'{param}' is required for role '{role}'")
    if type(value) is str:
        return value
    parts = _as_list(value, param)
    texts = []
    for j, part in enumerate(parts):
        part = _as_object(part, f"{param}[{j}]")
        if part.get("type") != "text":
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]': only text content is supported, "
                                        f"got part type {_show(part.get('type'))}")
        texts.append(_as_str(part.get("text"), f"{param}[{j}].text"))
    # Most chat templates expect a string; vLLM joins text parts with newlines too.
    return "\n".join(texts)


def _parse_history_tool_calls(value: object, param: str) -> None:
    """An assistant turn's tool calls, as OpenAI returned them: the template renders them back."""
    for j, call in enumerate(_as_list(value, param)):
        call = _as_object(call, f"{param}[{j}]")
        fn = call.get("function")
        if type(fn) is not dict or type(fn.get("name")) is not str or type(fn.get("arguments")) is not str:
            raise _bad(f"{param}[{j}].function", f"'{param}[{j}].function' must be an object with string 'name' "
                                                  "and 'arguments'")


def _parse_messages(value: object) -> list[dict]:
    if value is None:
        raise _bad("messages", "'messages' is required")
    messages = _as_list(value, "messages")
    if not messages:
        raise _bad("messages", "'messages' must not be empty")
    out = []
    for i, m in enumerate(messages):
        m = _as_object(m, f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            roles = ", ".join(f"'{r}'" for r in CHAT_ROLES)
            raise _bad(f"messages[{i}].role",
                       f"'messages[{i}].role' must be one of {roles}, got {_show(role)}")
        # Keep other keys (name, tool_calls, tool_call_id): chat templates may read them.
        content = _parse_content(m.get("content"), f"messages[{i}].content", role)
        if m.get("tool_calls") is not None:
            _parse_history_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append({**m, "content": content})
    return out


def parse_chat_request(body: object, limits: Limits) -> ChatRequest:
    """Validate a /v1/chat/completions body. Raises APIError(400) naming the first bad field."""
    body = _check_body(body)
    model, n, params = _parse_common(body, limits)
    _reject_unsupported(body, tuple(f for f, what in CHAT_FIELDS.items() if what == "refused"))
    messages = _parse_messages(body.get("messages"))
    tools = _get(body, "tools", _parse_tools, default=[])
    tool_choice = "auto" if body.get("tool_choice") is None else _parse_tool_choice(body["tool_choice"], tools)
    response_format = _get(body, "response_format", lambda v, _: _parse_response_format(v))
    if response_format is not None and (tool_choice == "required" or isinstance(tool_choice, dict)):
        raise _bad("response_format", "'response_format' json_object/json_schema cannot be combined with "
                                      "'tool_choice' \"required\" or a named function: both constrain the output")
    # max_completion_tokens replaced max_tokens in OpenAI's API (LangChain sends it); it wins.
    max_tokens = _parse_max_tokens(body, "max_tokens", limits)
    max_completion_tokens = _parse_max_tokens(body, "max_completion_tokens", limits)
    max_tokens = max_completion_tokens if max_completion_tokens is not None else max_tokens
    logprobs = _get(body, "logprobs", _as_bool, default=False)
    top_logprobs = _get(body, "top_logprobs", _as_int, 0, limits.max_logprobs)
    if top_logprobs is not None and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    params = replace(params, max_tokens=max_tokens, logprobs=(top_logprobs or 0) if logprobs else None)
    stream, include_usage = _parse_stream(body)
    return ChatRequest(model=model, messages=messages, params=params, n=n, stream=stream,
                       include_usage=include_usage, logprobs=logprobs, tools=tools, tool_choice=tool_choice,
                       parallel_tool_calls=_get(body, "parallel_tool_calls", _as_bool, default=True),
                       response_format=response_format,
                       chat_template_kwargs=_get(body, "chat_template_kwargs", _as_object, default={}))


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None            # exactly one of prompt and messages
    messages: list[dict] | None
    add_special_tokens: bool      # prompt: the model's BOS, as /v1/completions adds it
    add_generation_prompt: bool   # messages: the assistant turn's opening, as /v1/chat/completions renders it


def parse_tokenize_request(body: object) -> TokenizeRequest:
    """Validate a /tokenize body (vLLM's shape): {"prompt": str} or {"messages": [...]}."""
    body = _check_body(body)
    model = _get(body, "model", _as_str)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise _bad("prompt", "give exactly one of 'prompt' (a string) and 'messages' (a chat)")
    return TokenizeRequest(
        model=model, prompt=None if prompt is None else _as_str(prompt, "prompt"),
        messages=None if messages is None else _parse_messages(messages),
        add_special_tokens=_get(body, "add_special_tokens", _as_bool, default=True),
        add_generation_prompt=_get(body, "add_generation_prompt", _as_bool, default=True))


def parse_detokenize_request(body: object) -> tuple[str | None, list[int]]:
    """Validate a /detokenize body: {"tokens": [ids]} -> (model, ids)."""
    body = _check_body(body)
    if body.get("tokens") is None:
        raise _bad("tokens", "'tokens' is required: a list of token ids")
    return _get(body, "model", _as_str), _parse_token_ids(_as_list(body["tokens"], "tokens"), "tokens")


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(request_id: str, model: str, created: int, choices: list[dict],
                        usage: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_choice(index: int, content: str | None, finish_reason: str | None,
                logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(request_id: str, model: str, created: int, choices: list[dict],
                  usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, created: int, object: str, usage: dict) -> dict:
    """The extra last chunk of a stream with stream_options.include_usage: usage, no choices."""
    return {"id": request_id, "object": object, "created": created, "model": model,
            "choices": [], "usage": usage}


# vLLM's floor: a -inf logprob (a token masked by top-k/top-p) would serialize as invalid JSON.
_MIN_LOGPROB = -9999.0


def _lp(logprob: float) -> float:
    # Written so NaN floors too (max(nan, x) is nan): logits that overflowed (e.g. under a tiny
    # repetition_penalty) must still give valid JSON, not a 500 from to_json.
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _lp(logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict:
    """Chat logprobs from (token, logprob, [(alt_token, alt_logprob), ...]) per generated token."""
    return {"content": [
        {**_chat_token(tok, lp), "top_logprobs": [_chat_token(t, l) for t, l in top]}
        for tok, lp, top in entries]}


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]],
                        text_offset_start: int) -> dict:
    """Legacy completions logprobs. text_offset_start is where the first token starts in the
    choice's text (non-zero for later stream chunks, or after an echoed prompt)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = text_offset_start
    for tok, lp, top in entries:
        tokens.append(tok)
        token_logprobs.append(_lp(lp))
        alts = {t: _lp(l) for t, l in top}
        # OpenAI's legacy format always includes the sampled token (up to logprobs + 1 entries).
        alts.setdefault(tok, _lp(lp))
        top_logprobs.append(alts)
        text_offset.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def to_json(payload: dict) -> str:
    """Compact UTF-8 JSON. allow_nan=False: a NaN/inf that slipped through is a bug, not output."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sse(payload: dict | str) -> bytes:
    """One server-sent event: exactly b"data: <json>\\n\\n".

    Never \\r\\n: some benchmark clients split frames on \\n\\n only.
    """
    data = payload if isinstance(payload, str) else to_json(payload)
    return b"data: " + data.encode("utf-8") + b"\n\n"
