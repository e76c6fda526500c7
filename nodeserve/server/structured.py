"""Structured output: the grammar a chat request's output must follow, compiled with xgrammar for this model's
vocabulary, and a fresh matcher per choice (the sampler masks and advances it: sampling/constrain.py).

What is constrained:
  response_format json_object  -> a JSON object
  response_format json_schema  -> JSON valid against the schema
  tool_choice "required"       -> exactly one call, in the tool format, to one of the tools with valid arguments
  tool_choice named            -> exactly one call to that tool, its arguments valid against its parameters
JSON is generated compactly (no free whitespace): a small model allowed free whitespace can fill max_tokens
with newlines. Compiling is blocking (milliseconds; seconds for the first request: xgrammar's import and the
vocabulary): `compile_async` runs it on this object's own bounded executor (tokenization keeps the default one),
with a time cap, and a schema past the size limits below is a 400 naming the limit before anything compiles.
Compiled grammars are cached per (kind, schema).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from nodeserve.server.protocol import APIError, ChatRequest
from nodeserve.server.tool_parsers import ToolFormat
from nodeserve.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256              # compiled grammars kept, least recently used out first
MAX_CACHED_GRAMMAR_BYTES = 256 * 2**20  # and their memory at most (a big schema's compiled form is MBs)
# Hostile schemas: their size, and the repetition counts and patterns that make a grammar blow up.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_COUNT = 1024          # minItems, maxItems, minLength, maxLength, minProperties, maxProperties
MAX_SCHEMA_PATTERN_CHARS = 512
COMPILE_TIMEOUT_S = 10.0         # a compilation past this is a 400 (it runs on, in its own thread, and is cached)
MAX_QUEUED_COMPILES = 8          # compilations waiting for the compile thread; past this, 503
COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


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
    """Compiles grammars for one model's vocabulary (once each: an LRU cache bounded in count and bytes) and makes
    matchers. xgrammar's own compile cache is off: unbounded by default and keyed by the grammar, it kept every
    distinct client schema for good, whatever this LRU evicted."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS,
                 max_cached_bytes: int = MAX_CACHED_GRAMMAR_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_cached, self.max_cached_bytes = max_cached, max_cached_bytes
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.num_cached_bytes = 0
        self.timeout_s = COMPILE_TIMEOUT_S
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar compile")
        self._num_queued = 0  # compilations submitted and not finished (event loop only)

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

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # seconds (it imports transformers): only when a request first needs it

                info = xgr.TokenizerInfo(self.tokenizer.token_bytes(), xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=sorted(self.tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: tuple[str, str, Any]) -> Any:
        """The compiled grammar for spec (see grammar_spec). An invalid schema is a 400 naming its field."""
        kind, param, payload = spec
        key = json.dumps([kind, payload], sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self.compiler()
        import xgrammar as xgr

        try:
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(payload, any_whitespace=False)
            else:
                prefix, schema, suffix = payload
                parts = [xgr.Grammar.from_json_schema(schema, any_whitespace=False)]
                if prefix:
                    parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
                if suffix:
                    parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
                grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise APIError(400, f"'{param}' is not a JSON schema nodeserve can enforce: {_reason(e)}",
                           param=param) from None
        with self._lock:
            if key not in self._cache:  # (another thread may have compiled it meanwhile)
                self._cache[key] = compiled
                self.num_cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (len(self._cache) > self.max_cached
                                            or self.num_cached_bytes > self.max_cached_bytes):
                _, old = self._cache.popitem(last=False)
                self.num_cached_bytes -= old.memory_size_bytes
        return compiled

    @staticmethod
    def matcher(compiled: Any) -> Any:
        """A new matcher (per choice: it holds that choice's position in the grammar)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def _reason(e: Exception) -> str:
    # xgrammar's messages start with "[12:00:00] /project/cpp/file.cc:123: "; keep what follows.
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip()).strip()
    return text[:200] or type(e).__name__
