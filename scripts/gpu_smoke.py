"""A first end-to-end run of the CUDA path without FlashInfer and without the 94 MB model wheel (neither fits the
GPU lender's 64 MiB transfer): a tiny random Llama checkpoint built here, served by the Engine on one GPU with the
PyTorch attention, against transformers' greedy tokens on the same GPU.

Checks, each printed as PASS / FAIL with its numbers:
  1. colocated on DEVICE, float32: the engine's greedy tokens equal transformers' (full forward each step);
  2. disaggregated, prefill on DEVICE and decode on cpu:0: the same tokens, the KV crossing devices by the
     transfer's copy stream and events;
  3. the prefix cache: the same prompts again, their pages found cached, the same tokens;
  4. bfloat16 colocated: the share of greedy tokens that agree with float32 (reported, not judged);
  5. every pool whole after each engine stops;
  6. `nodeserve run` on DEVICE with that checkpoint: ready, a streamed completion ends with [DONE], /health 200,
     /metrics counts it, SIGTERM exits 0.

    python scripts/gpu_smoke.py                  # DEVICE=cuda:0 by default; DEVICE=cpu:1 runs it on a CPU
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeserve.config import config_from_dict  # noqa: E402
from nodeserve.core.sampling_params import SamplingParams  # noqa: E402
from nodeserve.model.loader import load_model  # noqa: E402
from nodeserve.runtime.engine import Engine  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cuda:0")
NUM_NEW = 16
PROMPTS = ["kalo mine rusa the quick brown fox", "vize quan elor ipus", "stor kalomi nezeru thch",
           "the lazy dog jumps over ka lo mi ne ru sa to vi ze"]
RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def build_checkpoint(path: Path):
    import sentencepiece as spm
    import transformers

    rng = random.Random(0)
    syl = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "an", "el", "or", "ip", "us", "th", "ch", "st"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 15))) for _ in range(3000)]
    lines += ["the quick brown fox jumps over the lazy dog"] * 5
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=300,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    torch.manual_seed(0)
    # A wide init makes the logits peaked, so greedy tokens do not hinge on float rounding between kernels.
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=512, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    hf.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return hf


def hf_greedy(hf, prompt: list[int], device: str) -> list[int]:
    hf = hf.to(device)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_NEW):
            logits = hf(torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def serve(loaded, devices: dict, dtype: str, rounds: int = 1) -> tuple[list[list[list[int]]], dict]:
    cfg = config_from_dict({"model": {"dtype": dtype, "quantization": "none"}, "devices": devices,
                            "kv": {"memory_gib": 0.25, "page_size": 4}, "profile": {"startup": False},
                            "scheduler": {"max_num_batched_tokens": 64}})
    engine = Engine(cfg, loaded)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)

    async def tokens(ids):
        return [ev.token_id async for ev in engine.add_request(ids, params) if ev.token_id is not None]

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            out = []
            for _ in range(rounds):
                out.append(await asyncio.gather(*(tokens(ids) for ids in PROMPT_IDS)))
            for _ in range(100):  # pages come back from the worker threads
                if all(w.kv.num_free == w.kv.num_pages for w in engine.workers) and not engine.streams:
                    break
                await asyncio.sleep(0.05)
            stats = {"whole": all(w.kv.num_free == w.kv.num_pages for w in engine.workers),
                     "hits": sum(s.num_prefix_hit_tokens for s in engine.pool_stats())}
            return out, stats
        finally:
            engine.stop()
    return asyncio.run(main())


def serve_http(path: Path) -> None:
    import signal
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    toml = path / "nodeserve.toml"
    toml.write_text(f'[model]\npath = "{path}"\nname = "tiny"\ndtype = "float32"\nquantization = "none"\n'
                    f'[server]\nport = {port}\n[devices]\nmode = "colocated"\ndevices = ["{DEVICE}"]\n'
                    f'[kv]\nmemory_gib = 0.25\n')
    proc = subprocess.Popen([sys.executable, "-m", "nodeserve", "run", "--config", str(toml)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    ready = False
    while time.monotonic() - start < 180 and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                ready = r.status == 200
                break
        except OSError:
            time.sleep(0.3)
    check("nodeserve run: ready", ready, f"{time.monotonic() - start:.1f} s")
    if ready:
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
        check("streamed completion ends with [DONE]", text.rstrip().endswith("data: [DONE]"),
              f"{text.count('data: ')} events")
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        # the completion stops at max_tokens (a random model never says its end token): one "length" success
        line = next((ln for ln in metrics.splitlines()
                     if ln.startswith('nodeserve:request_success_total{finished_reason="length"')), "")
        check("/metrics counts it", line.endswith(" 1.0"), line or "no length series")
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    out = proc.stdout.read()
    check("SIGTERM exits 0", rc == 0, f"exit {rc}; log tail: {out[-300:]!r}" if rc != 0 else "exit 0")


def main() -> int:
    global PROMPT_IDS
    print("torch", torch.__version__, "cuda", torch.version.cuda, "device", DEVICE,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf = build_checkpoint(path)
        loaded32 = load_model(str(path), torch.float32)
        PROMPT_IDS = [loaded32.tokenizer.encode(p) for p in PROMPTS]
        t0 = time.perf_counter()
        want = [hf_greedy(hf, ids, DEVICE if DEVICE.startswith("cuda") else "cpu") for ids in PROMPT_IDS]
        print(f"transformers reference on {DEVICE}: {time.perf_counter() - t0:.1f} s", flush=True)

        got, stats = serve(loaded32, {"mode": "colocated", "devices": [DEVICE], "attention": "torch"}, "float32",
                           rounds=2)
        check("colocated float32 = transformers", got[0] == want,
              f"{sum(a == b for g, w in zip(got[0], want) for a, b in zip(g, w))}/{NUM_NEW * len(want)} tokens")
        check("prefix cache: the second round hits and gives the same tokens", got[1] == got[0] and stats["hits"] > 0,
              f"{stats['hits']} prompt tokens from the cache")
        check("pools whole (colocated)", stats["whole"], str(stats["whole"]))

        other = "cpu:0" if DEVICE.startswith("cuda") else "cpu:0"
        got, stats = serve(loaded32, {"mode": "disaggregated", "prefill": [DEVICE], "decode": [other],
                                      "attention": "torch"}, "float32")
        check(f"disaggregated {DEVICE} -> {other} float32 = transformers", got[0] == want,
              f"{sum(a == b for g, w in zip(got[0], want) for a, b in zip(g, w))}/{NUM_NEW * len(want)} tokens")
        check("pools whole (disaggregated)", stats["whole"], str(stats["whole"]))

        if DEVICE.startswith("cuda"):
            loaded16 = load_model(str(path), torch.bfloat16)
            got, stats = serve(loaded16, {"mode": "colocated", "devices": [DEVICE], "attention": "torch"},
                               "bfloat16")
            agree = sum(a == b for g, w in zip(got[0], want) for a, b in zip(g, w))
            check("bfloat16 colocated runs (agreement reported)", stats["whole"],
                  f"{agree}/{NUM_NEW * len(want)} tokens equal float32's")
        serve_http(path)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print("ALL PASS" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
