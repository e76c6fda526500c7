"""`nodeserve devices`: what this machine has and how fast it moves bytes, to choose a device split from.

CPU: cores, and DRAM read bandwidth on one core and on all of them. GPUs: name, total and free memory, the
peer-access matrix, and measured copy bandwidth for every ordered pair.
"""

from __future__ import annotations

import os
import time

import torch

from nodeserve.device.base import available_devices
from nodeserve.device.cpu import has_fast_bf16
from nodeserve.kernels import cpuinfo

NUM_REPEATS = 3  # best of


def _cpu_model() -> str:
    return cpuinfo.first_processor().get("model name", "unknown")


def cpu_read_bandwidth(num_bytes: int, num_threads: int) -> float:
    """GB/s of sum() over a float32 buffer filled with ones, best of NUM_REPEATS. The buffer is written first:
    never-touched pages all map the shared zero page and read back at cache speed."""
    buf = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        best = float("inf")
        for _ in range(NUM_REPEATS):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return buf.numel() * 4 / best / 1e9


def gpu_copy_bandwidth(src: int, dst: int, num_bytes: int) -> float:
    """GB/s of one num_bytes copy from cuda:src to cuda:dst, best of NUM_REPEATS."""
    a = torch.ones(num_bytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{dst}")
    b.copy_(a)  # first copy enables peer access and warms up
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    best = float("inf")
    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def inventory(num_bytes: int = 256 * 2**20) -> list[str]:
    """The report, one line per item; measures with buffers of num_bytes."""
    cores = [n for n in available_devices() if n.startswith("cpu:")]
    lines = [f"cpu: {len(cores)} usable cores ({', '.join(cores)}) of {os.cpu_count()}, {_cpu_model()}, "
             f"hardware bf16: {'yes' if has_fast_bf16() else 'no'}"]
    one = cpu_read_bandwidth(num_bytes, 1)
    every = cpu_read_bandwidth(num_bytes, len(cores))
    lines.append(f"cpu: DRAM read bandwidth {one:.1f} GB/s on 1 core, {every:.1f} GB/s on {len(cores)} "
                 f"(sum() over {num_bytes / 2**20:.0f} MiB, best of {NUM_REPEATS})")
    if not torch.cuda.is_available():
        lines.append("cuda: no GPU visible to torch")
        return lines
    count = torch.cuda.device_count()
    for i in range(count):
        free, total = torch.cuda.mem_get_info(i)
        lines.append(f"cuda:{i}: {torch.cuda.get_device_name(i)}, {total / 2**30:.1f} GiB total, "
                     f"{free / 2**30:.1f} GiB free")
    if count > 1:
        lines.append("peer access (row = source; P: peer to peer, H: staged through host):")
        lines.append("        " + " ".join(f"{j:>3}" for j in range(count)))
        for i in range(count):
            marks = ["  -" if i == j else ("  P" if torch.cuda.can_device_access_peer(i, j) else "  H")
                     for j in range(count)]
            lines.append(f"cuda:{i:<3}" + " ".join(marks))
        for i in range(count):
            for j in range(count):
                if i != j:
                    lines.append(f"copy cuda:{i} -> cuda:{j}: {gpu_copy_bandwidth(i, j, num_bytes):.1f} GB/s")
    return lines
