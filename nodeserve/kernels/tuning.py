"""Which cache the C kernels' software prefetches fill on this machine, L1 or L2: timed once per build and CPU.

Decode attention reads scattered KV pages, and the GEMVs stream weight rows (R16, GGUF-layout and K-quant alike),
each asking for its data ahead of use. Into L1 (prefetcht0) or into L2 (prefetcht1) is the CPU's business, and the two CPUs measured disagree: one
Zen 5 core read pages fastest into L1 (decode attention 21-22 GB/s, slower into L2; docs/performance.md), where one
Zen 4 VM core's L1 miss buffers held attention to ~9 GB/s of its 27 and L2 gave 20, and its batch-1 GEMV ~10 %
more. So the first load of a build on a machine times both on synthetic data larger than a big L3, alternated, keeps
the faster for each family, and caches the choice beside the build with the CPU it was measured on.
NODESERVE_KERNELS_PREFETCH=l1 or l2 forces both (for A/B runs). The start-up log names the choice.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import torch

from nodeserve.kernels import cpuinfo

FOOTPRINT_BYTES = 96 * 2 ** 20  # each family's synthetic data: past a large L3, so it streams from DRAM
ROUNDS = 3


class TunedKernels(Protocol):
    """What of a build (native.NativeKernels) the choice reads and sets."""

    lib: Any  # the loaded library: ns_set_prefetch_levels
    features: frozenset[str]  # the ISA extensions it was built for (/proc/cpuinfo's names)
    isa: str

    def paged_decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, page_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor: ...


Workload = Callable[[], None]  # one pass over FOOTPRINT_BYTES of a family's data


@dataclass(frozen=True)
class PrefetchLevels:
    pages_l2: bool    # decode attention's pages into L2 (else L1)
    weights_l2: bool  # the GEMMs' weight rows into L2 (else L1)
    source: str       # "measured", "cached" or "forced"
    cpu: str = ""     # the CPU it was measured on (cpu_identity)

    def describe(self) -> str:
        def level(l2: bool) -> str:
            return "L2" if l2 else "L1"
        return f"prefetch: pages into {level(self.pages_l2)}, weights into {level(self.weights_l2)} ({self.source})"


def cpu_identity() -> str:
    """This CPU's vendor, family, model and model name: what a cached choice must match (a VM may name Zen 3 and
    Zen 4 alike "AMD EPYC"; family and model tell them apart)."""
    return cpuinfo.identity(cpuinfo.first_processor())


def choose(kernels: TunedKernels, cache_path: str | None,
           gemv: Callable[[], Workload] | None = None) -> PrefetchLevels:
    """The levels for this machine (forced, cached for this CPU, or measured now and cached), applied. gemv: makes
    the weights' workload (native.py's batch-1 GEMVs; None: the build has none, weights keep L2)."""
    forced = os.environ.get("NODESERVE_KERNELS_PREFETCH", "").lower()
    if forced:
        if forced not in ("l1", "l2"):
            raise ValueError(f"NODESERVE_KERNELS_PREFETCH must be l1 or l2, got {forced!r}")
        levels = PrefetchLevels(forced == "l2", forced == "l2", "forced")
    elif not runs_here(kernels.features):  # a build for another class (inspected, not run): nothing to time
        return PrefetchLevels(True, True, "default, built for another CPU")
    else:
        levels = _cached(cache_path) or _measure_and_cache(kernels, cache_path, gemv)
    apply(kernels, levels)
    return levels


def runs_here(features: frozenset[str]) -> bool:
    """Whether this CPU has every ISA extension a build targets (/proc/cpuinfo's names); True where it cannot tell."""
    flags = cpuinfo.isa_flags(cpuinfo.first_processor())
    return flags is None or features <= flags


def apply(kernels: TunedKernels, levels: PrefetchLevels) -> None:
    kernels.lib.ns_set_prefetch_levels(int(levels.pages_l2), int(levels.weights_l2))


def _cached(cache_path: str | None) -> PrefetchLevels | None:
    if cache_path is None:
        return None
    try:
        with open(cache_path) as f:
            data = json.load(f)
        levels = PrefetchLevels(bool(data["pages_l2"]), bool(data["weights_l2"]), "cached", str(data["cpu"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return levels if levels.cpu == cpu_identity() else None


def _measure_and_cache(kernels: TunedKernels, cache_path: str | None,
                       gemv: Callable[[], Workload] | None) -> PrefetchLevels:
    levels = measure(kernels, gemv)
    if cache_path is not None:
        tmp = f"{cache_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(asdict(levels), f)
            os.replace(tmp, cache_path)  # atomic: processes measuring at once never read half a file
        except OSError:
            pass
    return levels


def measure(kernels: TunedKernels, gemv: Callable[[], Workload] | None = None) -> PrefetchLevels:
    """Times each family with its prefetches into L1 and into L2, alternated ROUNDS times: the faster (by the best
    round of each) wins. A family this build does not prefetch for keeps L2."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels run on the calling thread; torch's fills need not spread
    try:
        pages_l2 = _faster(kernels, _attention_pass(kernels), pages=True) if kernels.isa != "scalar" else True
        weights_l2 = _faster(kernels, gemv(), pages=False) if gemv is not None else True
    finally:
        torch.set_num_threads(torch_threads)
    return PrefetchLevels(pages_l2, weights_l2, "measured", cpu_identity())


def _faster(kernels: TunedKernels, run: Workload, pages: bool) -> bool:
    """Whether `run` is faster with the family's prefetches into L2 than into L1 (the other family left at L2)."""
    best = {True: float("inf"), False: float("inf")}
    run()  # warm: first touches, code paths
    for _ in range(ROUNDS):
        for l2 in (False, True):
            kernels.lib.ns_set_prefetch_levels(int(l2 or not pages), int(l2 or pages))
            start = time.perf_counter()
            run()
            best[l2] = min(best[l2], time.perf_counter() - start)
    return best[True] <= best[False]


def _attention_pass(kernels: TunedKernels) -> Workload:
    """Decode attention of 16 sequences x 256 tokens (SmolLM2's heads: 9 over 3 KV heads of 64) on each of as many
    pool layers of scattered pages as FOOTPRINT_BYTES holds, one call per layer, as a step makes them."""
    batch, pages_a_seq, page_size, kv_heads, head_dim = 16, 16, 16, 3, 64
    page_bytes = 2 * page_size * kv_heads * head_dim * 4
    num_layers = max(2, FOOTPRINT_BYTES // (batch * pages_a_seq * page_bytes))
    num_pages = batch * pages_a_seq
    layers = torch.full((num_layers, num_pages, 2, page_size, kv_heads, head_dim), 0.01)  # written: real pages
    tables = torch.stack([torch.randperm(num_pages) for _ in range(num_layers)]).view(num_layers, batch, pages_a_seq)
    q = torch.randn(batch, 3 * kv_heads, head_dim)
    seq_lens = torch.full((batch,), pages_a_seq * page_size, dtype=torch.int64)

    def run() -> None:
        for i in range(num_layers):
            kernels.paged_decode_attention(q, layers[i], tables[i], seq_lens, 0.125)
    return run
