"""Structured output: the grammar a chat request's output must follow, compiled with llguidance for this model's
vocabulary, and a fresh matcher per choice (the sampler masks and advances it: sampling/constrain.py). llguidance,
not xgrammar: every schema within the limits below compiles in milliseconds (xgrammar took seconds for bounded
strings and arrays, and over 30 s for one 487-byte schema: docs/performance.md), and it installs 3 MB, not 1.2 GB.

What is constrained:
  response_format json_object  -> a JSON object
  response_format json_schema  -> JSON valid against the schema
  tool_choice "required"       -> exactly one call, in the tool format, to one of the tools with valid arguments
  tool_choice named            -> exactly one call to that tool, its arguments valid against its parameters
JSON is generated compactly (no free whitespace, separators ", " and ": "): a small model allowed free whitespace
can fill max_tokens with newlines. Schemas mean what they meant under xgrammar's strict mode (`strict_schema`): an
object schema with `properties` allows no other properties unless it says so, a `prefixItems` array no other items,
and a `pattern` must match the whole string; keywords llguidance does not implement are ignored, as xgrammar did.
Compiling is blocking (milliseconds; a quarter second more for the first request: the vocabulary's token trie):
`compile_async` runs it on this object's own one thread (below the loop's priority, as tokenization's), with a time
cap, and a schema past the size limits below is a 400 naming the limit before anything compiles. Compiled grammars
are cached per (kind, schema).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

from nodeserve.sampling.constrain import GrammarMatcher
from nodeserve.server.offload import offload_executor
from nodeserve.server.protocol import APIError, ChatRequest
from nodeserve.server.tool_parsers import ToolFormat
from nodeserve.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256              # compiled grammars kept, least recently used out first
MAX_CACHED_GRAMMAR_BYTES = 256 * 2**20  # and their estimated memory at most (a big schema's grammar is MBs)
# llguidance does not report a grammar's memory, so it is estimated from the schema's JSON. Measured on SmolLM2's
# vocabulary after one generation through each (the lexer states a grammar builds as it is used, shared by its
# matchers): 0.25 MB for a 130-byte schema, 1.1 MB for 8 long bounded strings (487 bytes), 1.2 MB for 128 tools
# (35 KB). Counted as 1 MiB plus 32 bytes per byte of the schema's JSON, the count limit usually binds first.
GRAMMAR_BASE_BYTES = 2**20
GRAMMAR_BYTES_PER_SCHEMA_BYTE = 32
# Hostile schemas: their size, and the repetition counts and patterns that make a grammar blow up.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_COUNT = 1024          # minItems, maxItems, minLength, maxLength, minProperties, maxProperties
MAX_SCHEMA_PATTERN_CHARS = 512
COMPILE_TIMEOUT_S = 10.0         # a compilation past this is a 400 (it runs on, in its own thread, and is cached)
MAX_QUEUED_COMPILES = 8          # compilations waiting for the compile thread; past this, 503
COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
# llguidance's JSON options: compact JSON with xgrammar's separators (what xgrammar's any_whitespace=False made);
# \uXXXX escapes in strings, as xgrammar allowed (llguidance's default allows only control characters' escapes);
# keywords llguidance does not implement (not, if/then/else, uniqueItems, unknown formats...) ignored rather than
# refused, as xgrammar ignored them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allow_general_unicode_escapes": True, "lenient": True}
# Where a JSON schema holds subschemas (strict_schema walks only these: enum, const, default are data).
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
              "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema_limits(schema: Any, param: str) -> None:
    """A 400 naming the limit for a schema too large, with a repetition count or a pattern past the limits."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise APIError(400, f"'{param}' is {size} bytes of JSON schema; the limit is {MAX_SCHEMA_BYTES}", param=param)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in COUNT_KEYS and isinstance(value, (int, float)) and value > MAX_SCHEMA_COUNT:
                    raise APIError(400, f"'{param}' has {key} = {value}; the limit is {MAX_SCHEMA_COUNT}", param=param)
                if key == "pattern" and isinstance(value, str) and len(value) > MAX_SCHEMA_PATTERN_CHARS:
                    raise APIError(400, f"'{param}' has a pattern of {len(value)} characters; the limit is "
                                        f"{MAX_SCHEMA_PATTERN_CHARS}", param=param)
                stack.append(value)


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` that means to llguidance (which follows JSON Schema) what it meant to xgrammar's strict
    mode, which nodeserve used before: an object schema with `properties` and no `additionalProperties` allows no
    other properties (`unevaluatedProperties`, which llguidance lacks, stands in when given), an array with
    `prefixItems` and no `items` no other items, and a `pattern` is anchored to the whole string. Objects under
    `allOf` keep JSON Schema's reading (extra properties allowed unless the schema says otherwise): strict branches
    would leave an intersection that allows only {}. A client's "x-guidance" (llguidance's compile options) is
    dropped: the options are the server's."""
    schema = json.loads(json.dumps(schema))  # a copy: the client's schema is also the cache key
    if isinstance(schema, dict):
        schema.pop("x-guidance", None)
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (subschema, is it an allOf branch)
    seen: set[int] = set()  # (additionalProperties may now be the unevaluatedProperties schema itself)
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if not in_all_of and "allOf" not in node:
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = node.get("unevaluatedProperties", False)
            if "prefixItems" in node and "items" not in node:
                node["items"] = node.get("unevaluatedItems", False)
        if isinstance(node.get("pattern"), str):
            node["pattern"] = f"^(?:{node['pattern']})$"  # anchors inside keep their meaning
        stack.extend((node[k], False) for k in _SUBSCHEMA if k in node)
        stack.extend((v, k == "allOf") for k in _SUBSCHEMA_LISTS if isinstance(node.get(k), list) for v in node[k])
        stack.extend((v, False) for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict) for v in node[k].values())
    return schema


def grammar_spec(req: ChatRequest, fmt: ToolFormat | None) -> tuple[str, str, Any] | None:
    """(kind, param to blame, payload) of the grammar `req` asks for, or None. Raises APIError(400) when a tool
    call is forced but the server has no tool format (model.tool_parser = "none")."""
    if req.response_format is not None:
        if req.response_format["type"] == "json_object":
            return "json", "response_format", {"type": "object"}
        schema = req.response_format["json_schema"].get("schema") or {"type": "object"}
        return "json", "response_format.json_schema.schema", schema
    if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
        if fmt is None:
            raise APIError(400, "'tool_choice' \"required\" or a named function needs a tool format; this server "
                                "has model.tool_parser = \"none\"", param="tool_choice")
        named = req.named_tool
        fns = [named] if named is not None else [t["function"] for t in req.tools]
        schemas = [fmt.call_schema(f["name"], f.get("parameters")) for f in fns]
        param = "tools" if named is None else f"tools[{[t['function'] for t in req.tools].index(named)}].function.parameters"
        return "tool", param, (fmt.prefix, schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, fmt.suffix)
    return None


class Grammars:
    """Compiles grammars for one model's vocabulary (once each: an LRU cache bounded in count and estimated bytes)
    and makes matchers. A compiled grammar is an llguidance LLMatcher that never matches anything itself: each
    choice gets a deep copy of it (microseconds; the copies share what the grammar has built so far)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS,
                 max_cached_bytes: int = MAX_CACHED_GRAMMAR_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_cached, self.max_cached_bytes = max_cached, max_cached_bytes
        self._ll_tokenizer = None
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (compiled, estimated bytes)
        self.num_cached_bytes = 0
        self.timeout_s = COMPILE_TIMEOUT_S
        self._executor = offload_executor("grammar compile", 1)  # below the loop's priority: server/offload.py
        self._num_queued = 0  # compilations submitted and not finished (event loop only)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    async def compile_async(self, spec: tuple[str, str, Any]) -> Any:
        """compile(spec) on the compile thread, within the limits: 400 past the schema limits or the time cap,
        503 when MAX_QUEUED_COMPILES are already waiting."""
        kind, param, payload = spec
        check_schema_limits(payload if kind == "json" else payload[1], param)
        if self._num_queued >= MAX_QUEUED_COMPILES:
            raise APIError(503, f"{self._num_queued} grammars are already being compiled; retry later")
        self._num_queued += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, self.compile, spec)
        future.add_done_callback(lambda _: setattr(self, "_num_queued", self._num_queued - 1))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(400, f"'{param}' took longer than {self.timeout_s:g} s to compile into a grammar",
                           param=param) from None

    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (a quarter second, once): each id's bytes; special tokens, which
        never appear inside text, as b"\\xff<name>" (no text matches them); ids past the tokenizer's own up to
        the model's vocab_size as unused special tokens; the stop tokens, allowed where the grammar is complete."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance as llg

                tok, stop = self.tokenizer, sorted(self.stop_token_ids)
                token_bytes = tok.token_bytes()[:self.vocab_size]
                tokens, special = [], []
                for i in range(self.vocab_size):
                    b = token_bytes[i] if i < len(token_bytes) else b""
                    if not b:
                        special.append(i)
                        b = b"\xff" + (_special_name(tok, i) or f"<[{i}]>").encode()
                    tokens.append(b)

                class Vocab:  # what llguidance.TokenizerWrapper reads
                    eos_token_id, bos_token_id = (stop[0] if stop else None), tok.bos_token_id
                    special_token_ids = special

                    def __init__(self):
                        self.tokens = tokens

                    def __call__(self, text: str | bytes) -> list[int]:
                        if isinstance(text, bytes):
                            text = text.decode("utf-8", "replace")
                        return tok.encode(text, add_bos=False)

                self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Vocab()), n_vocab=self.vocab_size,
                                                     eos_token=stop)
            return self._ll_tokenizer

    def compile(self, spec: tuple[str, str, Any]) -> Any:
        """The compiled grammar for spec (see grammar_spec). An invalid schema is a 400 naming its field."""
        kind, param, payload = spec
        key = json.dumps([kind, payload], sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        ll_tokenizer = self.ll_tokenizer()
        import llguidance as llg

        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(strict_schema(payload), overrides=JSON_OPTIONS)
            else:
                prefix, schema, suffix = payload
                body = strict_schema(schema)
                if isinstance(body, dict):
                    body["x-guidance"] = JSON_OPTIONS  # how %json takes its options
                parts = [json.dumps(prefix)] * bool(prefix) + ["body"] + [json.dumps(suffix)] * bool(suffix)
                grammar = llg.LLMatcher.grammar_from_lark(f"start: {' '.join(parts)}\nbody: %json {json.dumps(body)}")
            compiled = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
            error = compiled.get_error() if compiled.is_error() else None  # llguidance reports, never raises
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            error = str(e)
        if error is not None:
            raise APIError(400, f"'{param}' is not a JSON schema nodeserve can enforce: {_reason(error)}",
                           param=param)
        size = GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_SCHEMA_BYTE * len(key)
        with self._lock:
            if key not in self._cache:  # (another thread may have compiled it meanwhile)
                self._cache[key] = (compiled, size)
                self.num_cached_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > self.max_cached
                                            or self.num_cached_bytes > self.max_cached_bytes):
                _, (_, old_size) = self._cache.popitem(last=False)
                self.num_cached_bytes -= old_size
        return compiled

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A new matcher (per choice: it holds that choice's position in the grammar)."""
        return GrammarMatcher(compiled.deep_copy(), self.stop_token_ids)


def _special_name(tok: Tokenizer, token_id: int) -> str:
    try:
        return tok.token_text(token_id)
    except Exception:  # an id the tokenizer has no piece for
        return ""


def _reason(error: str) -> str:
    # llguidance's messages may run on with a parser state dump ("<state>..."): keep the first part, on one line.
    text = " ".join(error.split("<state>")[0].split())
    return text[:200] or "unknown error"
