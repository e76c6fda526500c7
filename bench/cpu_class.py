"""The CPU classes a benchmark can measure on any x86 machine (--cpu-class): nodeserve's environment for a class,
and whether this CPU runs it as a proxy (it has more than the class) or for real. bench/compare.py and
bench/quality.py share it; llama-server's side is bench/build_llama.py's CPU_CLASSES."""

from __future__ import annotations

import os

# --cpu-class: nodeserve's environment for a class of CPU: its kernels built for the class (native.py) and forced to
# the class's paths (native.avx2_only), torch's own kernels capped at it (ATen's dispatch, oneDNN). llama-server is
# built for the same class (build_llama.CPU_CLASSES).
CPU_CLASS_ENV = {"avx2": {"NODESERVE_KERNELS_MARCH": "x86-64-v3", "NODESERVE_KERNELS": "avx2",
                          "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
# /proc/cpuinfo flags beyond a class: a CPU with any of them runs the class as a proxy
BEYOND_CLASS = {"avx2": ("avx512f", "avx_vnni", "avx512_vnni", "amx_int8")}


def nodeserve_env(cpu_class: str | None) -> dict[str, str] | None:
    """The environment nodeserve servers start with: this process's, with CPU_CLASS_ENV's for a class."""
    return None if cpu_class is None else {**os.environ, **CPU_CLASS_ENV[cpu_class]}


def class_is_proxy(cpu_class: str, flags_line: str) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags has more than the class (so the class run is a proxy)."""
    return bool(set(flags_line.split()) & set(BEYOND_CLASS[cpu_class]))


def class_text(cpu_class: dict | None) -> str:
    """table.md's sentence on a --cpu-class run ("" for none): the class, proxy or real, and how each side ran it."""
    if not cpu_class:
        return ""
    how = "proxy: this CPU has more than the class" if cpu_class["proxy"] else "real: this CPU is of the class"
    env = " ".join(f"{k}={v}" for k, v in cpu_class["nodeserve_env"].items())
    return f"CPU class {cpu_class['class']} ({how}): nodeserve with {env}, llama-server built for the class. "
