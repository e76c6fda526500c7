"""How close a server's greedy output stays to the float32 reference, over a fixed prompt set.

The reference is nodeserve itself on its exact path (`model.quantization = "none"`, `model.dtype =
"float32"`), which the parity tests hold to transformers token for token, started through
bench/local_server.py. Its greedy continuation of each prompt (up to `--max-tokens` tokens, or to the end of
sequence) is the reference continuation. Any OpenAI-compatible server is then scored on two numbers:

(a) greedy prefix: the server's own greedy continuation (temperature 0, the same max_tokens) keeps how many
    tokens of the reference continuation before its first difference. Reported as the mean over prompts of
    kept / reference length, and the number of prompts whose continuation is identical.
(b) teacher-forced top-1 agreement: for every position i of the reference continuation, the server gets
    prompt + reference[:i] with max_tokens 1 and temperature 0, and its token is compared with reference[i]
    (the end of sequence counts as a token: predicting it means finish_reason "stop" with no text token).
    Unlike (a), one early difference does not hide every later position.

The model: `--model`, a bundled model name or a .gguf path (default the bundled SmolLM2-135M-Instruct Q4_1);
nodeserve's [model] path and llama-server's -m are the same file (bench/llama_server.py gguf_path).

Prompts: PROMPTS, 5 chat (rendered with the GGUF's chat template, else its architecture's from
nodeserve/model/registry.py, as nodeserve serves it: Gemma 3's GGUF carries none) and 5 raw text, tokenized
once here with the GGUF's own tokenizer (nodeserve.tokenizer), BOS included where that tokenizer adds one
(Gemma, not SmolLM2), and sent to every server as token-id lists on /v1/completions, so every server sees
exactly the same ids whatever it would do with text (nodeserve and llama-server both take a list of ids as
`prompt` as it is, adding no BOS). Tokens come back through `logprobs: 1`, one entry per generated token: as
token ids where the server gives them (llama-server), else as token texts; both are compared as the GGUF
tokenizer's text of the token, and the reference's texts are mapped back to ids through that tokenizer's
vocabulary (a text that several ids share, e.g. a lone byte of a multi-byte character, ends the reference's
teacher-forced positions there; the count is reported; a SentencePiece byte token whose text a piece also has,
Gemma's <0x0A> and piece "\\n", counts as the piece). Any of the tokenizer's end ids (Gemma: <eos> and
<end_of_turn>) is the end of sequence.

`--cpu-class avx2`: every server as an AVX2-only CPU runs it (bench/cpu_class.py; a proxy on a CPU with more).

Targets: `nodeserve-default` (nodeserve's default config, plus `--default-extra` TOML lines for its [model]
table), `nodeserve-none` (`quantization = "none"`, dtype auto: float32 on a CPU without hardware bf16, where it
must score 100 %, a check of this harness) and `llama-server` (llama.cpp's server on the same GGUF, via
bench/llama_server.py, with `cache_prompt: false`).

    python bench/quality.py                                   # ~10-15 min on the 2-core machine
    python bench/quality.py --num-prompts 2 --max-tokens 16   # a smoke run
    python bench/quality.py --model gemma-3-270m              # the same on the bundled Gemma 3 270M Q4_K_M
    python bench/quality.py --default-extra 'quantization = "int8"' --targets nodeserve-default \
        --reuse bench/results/quality/quality.json   # one target again; the reference and the rest from before

Writes --out-dir (default $NODESERVE_BENCH_DIR/quality, else ~/.cache/nodeserve/bench/quality; quality-<model> for
another --model, e.g. quality-gemma-3-270m): quality.json (command, machine, date, the model and its file, prompts
and their ids, the reference continuation, every target's outputs and per-position results) and table.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import load_json, out_path  # noqa: E402
import llama_server as L  # noqa: E402  (bench/ is scripts, not a package)
import serve  # noqa: E402
from local_server import start_server  # noqa: E402
from cpu_class import CPU_CLASS_ENV, class_is_proxy, class_text, nodeserve_env  # noqa: E402

EOS = "<end of sequence>"  # the pseudo-token a continuation ends with when the server stopped on its own

SYSTEM = "You are a helpful assistant."
PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "What is the capital of France?"),
    ("chat", "Write a short poem about the sea."),
    ("chat", "Explain in two sentences why the sky is blue."),
    ("chat", "Give me three tips for learning a new language."),
    ("chat", "What is 17 times 23? Show your steps."),
    ("raw", "The history of the printing press begins"),
    ("raw", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("raw", "Once upon a time, in a small village at the edge of a forest,"),
    ("raw", "The three primary colors are"),
    ("raw", "Photosynthesis is the process by which"),
)


@dataclass(frozen=True)
class Target:
    name: str
    kind: str              # "nodeserve" | "llama-server"
    dtype: str = "auto"
    model_extra: str = ""  # TOML lines for nodeserve's [model] table
    kv_extra: str = ""     # ... and its [kv] table


# ---- pure: token keys and scores --------------------------------------------------------------------------

def continuation(choice: dict, text_of_id) -> tuple[list[str], bool]:
    """A completion choice's generated tokens as texts, and whether it stopped on its own (end of sequence).

    Reads `logprobs` in either shape servers use: the legacy completions shape (`tokens`: texts) or the chat
    shape (`content`: entries with `token` and, from llama-server, `id`); an id wins over a text, through
    text_of_id. An end-of-sequence token some servers list last (any of text_of_id.eos_texts) is dropped: the
    flag says it instead.
    """
    lp = choice.get("logprobs") or {}
    if lp.get("content") is not None:
        keys = [text_of_id(e["id"]) if e.get("id") is not None else e["token"] for e in lp["content"]]
    else:
        keys = list(lp.get("tokens") or [])
    stopped = choice.get("finish_reason") == "stop"
    if stopped and keys and (keys[-1] == "" or keys[-1] in text_of_id.eos_texts):
        keys.pop()
    return keys, stopped


def with_eos(keys: list[str], stopped: bool) -> list[str]:
    return keys + [EOS] if stopped else list(keys)


def prefix_len(ref: list[str], out: list[str]) -> int:
    """How many leading tokens of `ref` `out` keeps before the first difference."""
    n = 0
    for a, b in zip(ref, out):
        if a != b:
            break
        n += 1
    return n


def score(prompts: list[dict], refs: list[list[str]], greedy: list[list[str]] | None,
          forced: list[list[bool]] | None) -> dict:
    """Greedy-prefix and teacher-forced figures over all prompts and per prompt kind ("chat", "raw").

    refs[k], greedy[k]: prompt k's reference and server continuations (token texts, EOS last if stopped);
    forced[k]: for each scored position of refs[k], whether the server's teacher-forced token matched.
    """
    def agg(idx: list[int]) -> dict:
        out: dict = {"prompts": len(idx)}
        if greedy is not None:
            kept = [prefix_len(refs[k], greedy[k]) for k in idx]
            out["greedy_prefix_mean"] = (sum(n / len(refs[k]) for n, k in zip(kept, idx) if refs[k])
                                         / max(1, sum(1 for k in idx if refs[k])))
            out["greedy_tokens_kept"] = sum(kept)
            out["reference_tokens"] = sum(len(refs[k]) for k in idx)
            out["identical"] = sum(1 for k in idx if greedy[k] == refs[k])
        if forced is not None:
            pos = [m for k in idx for m in forced[k]]
            out["forced_positions"] = len(pos)
            out["forced_matches"] = sum(pos)
            out["forced_top1"] = sum(pos) / len(pos) if pos else None
        return out

    every = list(range(len(prompts)))
    res = {"all": agg(every)}
    for kind in sorted({p["kind"] for p in prompts}):
        res[kind] = agg([k for k in every if prompts[k]["kind"] == kind])
    return res


def table(rows: list[tuple[str, str, dict]]) -> str:
    """Markdown: one row per target (name, config, score())."""
    def pct(v):
        return "-" if v is None else f"{v * 100:.1f} %"

    lines = ["| target | config | greedy prefix kept (mean) | identical | teacher-forced top-1 | chat / raw top-1 |",
             "|---|---|---:|---:|---:|---:|"]
    for name, config, s in rows:
        a = s["all"]
        ident = f"{a['identical']}/{a['prompts']}" if "identical" in a else "-"
        tf = (f"{pct(a.get('forced_top1'))} ({a['forced_matches']}/{a['forced_positions']})"
              if a.get("forced_positions") else "-")
        kinds = " / ".join(pct(s[k].get("forced_top1")) for k in ("chat", "raw") if k in s)
        lines.append(f"| {name} | {config} | {pct(a.get('greedy_prefix_mean'))} | {ident} | {tf} | {kinds or '-'} |")
    return "\n".join(lines) + "\n"


# ---- tokenizer --------------------------------------------------------------------------------------------

BYTE_TOKEN = 6  # tokenizer.ggml.token_type of a SentencePiece byte-fallback token ("<0x0A>")


class Vocab:
    """The GGUF's tokenizer as nodeserve builds it (the chat template its architecture supplies when the file has
    none): prompt ids, token id -> text (callable), text -> id where that is unique, and the end-of-sequence texts
    (every id nodeserve stops on: the file's EOS and end-of-turn ids)."""

    def __init__(self, path: str):
        from nodeserve.model import registry
        from nodeserve.model.gguf_header import read_header
        from nodeserve.tokenizer import Tokenizer

        meta = read_header(path).metadata
        family = registry.by_gguf_name(meta.get("general.architecture"), path)
        self.tok = Tokenizer.from_gguf_metadata(meta, family.chat_template)
        size = len(meta["tokenizer.ggml.tokens"])
        texts = [self.tok.token_text(i) for i in range(size)]
        self._text = texts
        self.ids = text_ids(texts, meta.get("tokenizer.ggml.token_type") or [])
        self.eos_texts = frozenset(texts[i] for i in self.tok.eos_token_ids)

    def __call__(self, token_id: int) -> str:
        return self._text[int(token_id)]

    def encode_prompt(self, kind: str, text: str) -> list[int]:
        if kind == "chat":
            text = self.tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": text}])
        return self.tok.encode(text)


def text_ids(texts: list[str], types: list[int]) -> dict[str, int | None]:
    """Each token text -> its id, None where several ids share it. A byte-fallback token whose text a piece also
    has (Gemma: <0x0A> and the piece "\\n", both "\\n") leaves it to the piece: SentencePiece falls back to bytes only
    for characters no piece holds. A byte that is not a whole character ("\\ufffd") stays ambiguous."""
    ids: dict[str, int | None] = {}
    fallback = []
    for i, t in enumerate(texts):
        if i < len(types) and types[i] == BYTE_TOKEN and t != "\ufffd":
            fallback.append(i)
            continue
        ids[t] = None if t in ids else i  # None: several ids share this text
    for i in fallback:
        ids.setdefault(texts[i], i)  # ... unless no piece has it
    return ids


def reference_ids(vocab: Vocab, keys: list[str]) -> list[int]:
    """The ids of a reference continuation's texts, up to (not including) the first text no single id has."""
    ids = []
    for k in keys:
        i = vocab.ids.get(k)
        if i is None:
            break
        ids.append(i)
    return ids


# ---- I/O --------------------------------------------------------------------------------------------------

def complete(url: str, model: str, prompt: list[int], max_tokens: int, extra: dict, timeout: float = 600) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "stream": False, **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)["choices"][0]


def run_greedy(url: str, model: str, prompts: list[dict], max_tokens: int, extra: dict, vocab: Vocab
               ) -> list[list[str]]:
    """Each prompt's greedy continuation, one request at a time (token texts, EOS last if it stopped)."""
    return [with_eos(*continuation(complete(url, model, p["ids"], max_tokens, extra), vocab)) for p in prompts]


def run_forced(url: str, model: str, prompts: list[dict], refs: list[list[str]], ref_ids: list[list[int]],
               extra: dict, vocab: Vocab, concurrency: int) -> list[list[bool]]:
    """For each prompt k and each position i <= len(ref_ids[k]) of refs[k]: whether the server's one greedy token
    after prompt + ref_ids[k][:i] is refs[k][i]. Requests go `concurrency` at a time."""
    jobs = [(k, i) for k in range(len(prompts)) for i in range(min(len(refs[k]), len(ref_ids[k]) + 1))]

    def one(job: tuple[int, int]) -> bool:
        k, i = job
        keys, stopped = continuation(complete(url, model, prompts[k]["ids"] + ref_ids[k][:i], 1, extra), vocab)
        got = with_eos(keys, stopped)
        return bool(got) and got[0] == refs[k][i]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        hits = list(pool.map(one, jobs))
    out: list[list[bool]] = [[] for _ in prompts]
    for (k, _), h in zip(jobs, hits):
        out[k].append(h)
    return out


def _start(target: Target, args, gguf: str, tmp: str, log: str):
    """(process, url, config text) of a started target, serving the model file `gguf`."""
    if target.kind == "llama-server":
        srv = L.start(slots=4, slot_ctx=1024, threads=args.llama_threads, log_path=log, passive=args.llama_passive,
                      gguf=gguf, cpu_class=args.cpu_class)
        return srv.proc, srv.url, f"{srv.version}, -t {args.llama_threads}"
    proc, url = start_server(args.mode, target.dtype, tmp, log, model_extra=target.model_extra,
                             kv_extra=target.kv_extra, model_path=gguf, env=nodeserve_env(args.cpu_class))
    lines = [ln.strip() for ln in target.model_extra.splitlines() if ln.strip()]
    lines += ["kv." + ln.strip() for ln in target.kv_extra.splitlines() if ln.strip()]
    extra = "; ".join(lines)
    return proc, url, f"nodeserve {args.mode}, dtype {target.dtype}" + (f"; {extra}" if extra else " (defaults)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=L.DEFAULT_MODEL,
                    help="a bundled model name (smollm2-135m-instruct, gemma-3-270m) or a .gguf path; every server, "
                         "the reference and the prompts' tokenizer use its file")
    ap.add_argument("--targets", default="nodeserve-default,nodeserve-none,llama-server")
    ap.add_argument("--default-extra", default="",
                    help="TOML lines for nodeserve-default's [model] table (default: none, i.e. nodeserve's defaults)")
    ap.add_argument("--default-kv-extra", default="", help="... and for its [kv] table, e.g. 'dtype = \"float16\"'")
    ap.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated", "tp2"],
                    help="nodeserve's devices.mode for the reference and the nodeserve targets")
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                    help=f"first N of the {len(PROMPTS)} prompts, chat and raw alternating")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4, help="teacher-forced requests in flight")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--llama-passive", action="store_true", help="OMP_WAIT_POLICY=passive (see llama_server.py)")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), default=None,
                    help="every server as that class of CPU runs it (bench/compare.py --cpu-class): nodeserve and "
                         "its reference forced to the class's kernels, llama-server built for it")
    ap.add_argument("--reuse", default=None, metavar="QUALITY_JSON",
                    help="take the reference continuations and the targets not in --targets from this earlier "
                         "quality.json (same prompts and --max-tokens), instead of starting the reference again")
    ap.add_argument("--out-dir", default=None,
                    help="default $NODESERVE_BENCH_DIR/quality (else ~/.cache/nodeserve/bench/quality), "
                         "quality-<model> for another --model")
    args = ap.parse_args()
    args.out_dir = args.out_dir or out_path(L.results_name("quality" + (f"-{args.cpu_class}" if args.cpu_class
                                                                            else ""), args.model))

    known = {"nodeserve-default": Target("nodeserve-default", "nodeserve", "auto", args.default_extra,
                                         args.default_kv_extra),
             "nodeserve-none": Target("nodeserve-none", "nodeserve", "auto", 'quantization = "none"'),
             "llama-server": Target("llama-server", "llama-server")}
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not names or any(n not in known for n in names):
        ap.error(f"--targets must name some of {', '.join(known)}")
    if not 1 <= args.num_prompts <= len(PROMPTS) or args.max_tokens < 1 or args.concurrency < 1:
        ap.error(f"need 1 <= --num-prompts <= {len(PROMPTS)}, --max-tokens >= 1, --concurrency >= 1")
    try:
        gguf = L.gguf_path(args.model)
    except Exception as e:  # nodeserve's LoadError names the bundled models
        ap.error(f"--model {args.model}: {e}")
    os.makedirs(os.path.join(args.out_dir, "logs"), exist_ok=True)

    t_all = time.perf_counter()
    vocab = Vocab(gguf)
    chosen = [PROMPTS[k] for k in sorted(range(len(PROMPTS)), key=lambda k: (k % 5, k))][:args.num_prompts]
    prompts = [{"kind": kind, "text": text, "ids": vocab.encode_prompt(kind, text)} for kind, text in chosen]
    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + [shlex.quote(a) for a in sys.argv]),
                     "machine": serve.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args),
                     "model": {"name": args.model, "file": gguf}, "prompts": prompts, "targets": {}}
    if args.cpu_class:
        results["cpu_class"] = {"class": args.cpu_class, "nodeserve_env": CPU_CLASS_ENV[args.cpu_class],
                                "proxy": class_is_proxy(args.cpu_class, L.build_llama.cpu_flags_line())}
    reference = Target("reference", "nodeserve", "float32", 'quantization = "none"')
    runs = [reference] + [known[n] for n in names]
    if args.reuse:
        earlier = load_json(args.reuse)
        if [p["ids"] for p in earlier["prompts"]] != [p["ids"] for p in prompts] or \
                earlier["args"]["max_tokens"] != args.max_tokens or \
                earlier["args"].get("model", L.DEFAULT_MODEL) != args.model:
            ap.error(f"{args.reuse} was run on other prompts, another --max-tokens or another --model")
        results["reference"] = {**earlier["reference"], "reused_from": earlier["command"]}
        refs, ref_ids = results["reference"]["continuations"], results["reference"]["ids"]
        for name, res in earlier["targets"].items():
            if name not in names:
                results["targets"][name] = {**res, "reused_from": earlier["command"]}
        runs = runs[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for target in runs:
            t = time.perf_counter()
            proc, url, config = _start(target, args, gguf, tmp,
                                       os.path.join(args.out_dir, "logs", f"{target.name}.log"))
            try:
                print(f"{target.name}: {config}, up in {time.perf_counter() - t:.1f} s", flush=True)
                extra = {"cache_prompt": False} if target.kind == "llama-server" else {}
                model = serve.default_model(url, {})
                greedy = run_greedy(url, model, prompts, args.max_tokens, extra, vocab)
                if target is reference:
                    refs = greedy
                    ref_ids = [reference_ids(vocab, r[:-1] if r and r[-1] == EOS else r) for r in refs]
                    results["reference"] = {"config": config, "continuations": refs, "ids": ref_ids,
                                            "texts": [vocab.tok.decode(i) for i in ref_ids]}
                    short = sum(1 for r, i in zip(refs, ref_ids) if len(i) < len([x for x in r if x != EOS]))
                    print(f"  reference: {sum(map(len, refs))} tokens over {len(refs)} prompts"
                          + (f"; {short} continuation(s) hold a token text no single id has" if short else ""),
                          flush=True)
                    continue
                forced = run_forced(url, model, prompts, refs, ref_ids, extra, vocab, args.concurrency)
            finally:
                L.stop(proc, timeout=60)
            s = score(prompts, refs, greedy, forced)
            results["targets"][target.name] = {"config": config, "target": asdict(target), "score": s,
                                               "greedy": greedy, "forced": forced,
                                               "wall_s": time.perf_counter() - t}
            a = s["all"]
            print(f"  {target.name}: greedy prefix kept {a['greedy_prefix_mean'] * 100:.1f} % (identical "
                  f"{a['identical']}/{a['prompts']}), teacher-forced top-1 {a['forced_top1'] * 100:.1f} % "
                  f"({a['forced_matches']}/{a['forced_positions']}) in {time.perf_counter() - t:.0f} s", flush=True)
    results["wall_s"] = time.perf_counter() - t_all
    md = table([(n, r["config"], r["score"]) for n, r in results["targets"].items()])
    reused = [n for n, r in results["targets"].items() if r.get("reused_from")]
    named = "" if args.model.lower() == L.DEFAULT_MODEL else f" on {L.model_tag(args.model)}"
    header = (f"# Quality against the float32 reference{named}, {results['date']}\n\n`{results['command']}`\n\n"
              + (f"Model: `{gguf}`.\n\n" if named else "")
              + (class_text(results["cpu_class"]) + "\n\n" if args.cpu_class else "")
              + (f"The reference{''.join(', ' + n for n in reused)} come from the earlier run "
                 f"`{results['reference']['reused_from']}`.\n\n" if args.reuse else "")
              + f"Reference: {results['reference']['config']}. {len(prompts)} prompts "
              f"({sum(p['kind'] == 'chat' for p in prompts)} chat, {sum(p['kind'] == 'raw' for p in prompts)} raw), "
              f"up to {args.max_tokens} tokens each, {sum(map(len, refs))} reference tokens in all. "
              f"Wall time {results['wall_s'] / 60:.1f} min.\n\n")
    with open(os.path.join(args.out_dir, "quality.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(header + md)
    print("\n" + md)
    print(f"-> {os.path.join(args.out_dir, 'quality.json')}\n-> {os.path.join(args.out_dir, 'table.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
