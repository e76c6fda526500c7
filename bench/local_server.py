"""Starts a real nodeserve server subprocess on a free loopback port for the benchmarks, and waits until ready."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

MODES = {
    "disaggregated": 'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]',
    "colocated": 'mode = "colocated"\ndevices = ["cpu:0", "cpu:1"]',
    "adaptive": 'mode = "adaptive"\ndevices = ["cpu:0", "cpu:1"]',
    "tp2": 'mode = "colocated"\ndevices = ["cpu:0+cpu:1"]',  # one tensor-parallel group over both cores
}


def config_text(mode: str, dtype: str, port: int, model_name: str = "m", model_extra: str = "",
                kv_memory_gib: float = 2.0, kv_extra: str = "", extra: str = "",
                model_path: str = "smollm2-135m-instruct", devices_extra: str = "") -> str:
    """The TOML start_server writes (its arguments, and the port)."""
    # a JSON string is a TOML basic string: the default reads path = "smollm2-135m-instruct" as it always has
    return (f'[model]\npath = {json.dumps(model_path)}\nname = "{model_name}"\ndtype = "{dtype}"\n'
            + (model_extra.strip() + "\n" if model_extra.strip() else "") +
            f'[server]\nport = {port}\n[devices]\n{MODES[mode]}\n'
            + (devices_extra.strip() + "\n" if devices_extra.strip() else "") +
            f'[kv]\nmemory_gib = {kv_memory_gib}\n'
            f'{kv_extra.strip()}\n{extra}')


def start_server(mode: str, dtype: str, tmp: str, log_path: str | None = None,
                 model_name: str = "m", model_extra: str = "", kv_memory_gib: float = 2.0,
                 kv_extra: str = "", extra: str = "", model_path: str = "smollm2-135m-instruct",
                 env: dict[str, str] | None = None, devices_extra: str = "") -> tuple[subprocess.Popen, str]:
    """Writes a config for `mode` into `tmp`, starts the server and returns (process, base url).

    model_path: [model] path, a bundled model name or a file (bench/llama_server.py gguf_path gives the one
    llama-server loads).
    model_extra, kv_extra: more TOML lines for the [model] and [kv] tables, e.g. 'quantization = "int8"'.
    kv_memory_gib: each device's KV pool (float32 KV: 2 GiB a device holds ~46k tokens of SmolLM2).
    extra: more TOML after the [kv] table, e.g. an [slo] table.
    devices_extra: more TOML lines for the [devices] table, e.g. 'lend_between_steps = false'.
    env: the server's environment (default: this process's), e.g. NODESERVE_KERNELS_MARCH for a CPU class.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(tmp, f"{mode}-{abs(hash(model_extra + kv_extra + extra + devices_extra))}.toml")
    with open(path, "w") as f:
        f.write(config_text(mode, dtype, port, model_name, model_extra, kv_memory_gib, kv_extra, extra, model_path,
                            devices_extra))
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "nodeserve", "run", "--config", path],
                            stdout=out, stderr=subprocess.STDOUT, env=env)
    if log_path:
        out.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a cold start on a busy 2-core machine can take minutes
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{mode} server did not start" + (f"; see {log_path}" if log_path else ""))


def cpu_model() -> str:
    """The CPU's model name, for the machine description next to every result."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
