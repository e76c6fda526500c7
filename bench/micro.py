"""Micro-benchmark: prefill throughput and decode step time of the model runner, next to roofline bounds.

Command (the one whose output is in bench/README.md):

    . .venv/bin/activate && python bench/micro.py --dtype bf16,fp32 --threads 1 --json /tmp/micro.json

What it runs, per dtype, on the CPU, with torch.set_num_threads(--threads) (default 1: one server worker):
  * the bundled model (smollm2-135m-instruct) loaded with nodeserve.model.loader.load_model, load time reported;
  * ModelRunner(model, TorchAttention(KVPool, ...)).run(chunks), i.e. the server's own step path (host-side
    prepare + forward + logits), so host overhead is included in every figure;
  * prefill: one 512-token prompt, and 4 prompts x 256 tokens (1024 tokens) in one step; logits only for
    each prompt's last token, as the server does. Reported as tokens/s and step time;
  * decode: one step of B = 1, 8, 32 sequences, one new token each, each with a 128-token context already
    in the KV pool (the pool is filled with random K/V; values do not change the cost), so seq_len = 129.
Timing: a short warm-up run through the same kernels (32-token prompts / one decode row), then runs timed with
time.perf_counter until --budget seconds (default 6) of samples, at most 5 (prefill) / 20 (decode); the median
is reported, n = samples. A first full run under 1 s is also discarded as warm-up; a longer one is kept, so
that very slow cases (bf16 on a CPU without hardware bf16 matmul: ~13 s per 512-token prefill) fit a ~2-minute
run. Whole run on the 2-core CI machine: about 2 minutes, of which ~20 s is loading the model twice.

Bounds, measured in the same process and with the same thread count:
  * bandwidth: sum() over a 1 GiB float32 tensor filled with ones (written, so its pages are real), best of 5;
  * peak: an n^3 matmul in the benchmark dtype, best of 3, the fastest of three operand layouts (a@b, a@b.T,
    which F.linear uses, and a.T@b); n = 2048 unless a 512^3 probe says one run would exceed 1.5 s, then 1024
    or 512. Without hardware bf16 (AVX2-only CPUs) bf16 matmul is a slow, layout-dependent software path
    (a@b at 2048^3 takes ~90 s, 0.2 GFLOP/s), so there the bf16 "peak" is that of the software path and
    is far below fp32's; the line above the table says which size and layout gave the peak;
  * memory time = bytes a step must read / bandwidth. Bytes = every parameter once in the dtype (embedding and
    lm_head are tied, counted once) + the K/V of all contexts read by attention (decode: B * 129 tokens;
    prefill: the prompt's K/V written, negligible);
  * compute time = FLOPs / peak. FLOPs = 2 * matmul params * tokens (layer projections for every token, lm_head
    only for rows that produce logits) + attention: 4 * heads * head_dim * (query, key) pairs per layer,
    counting only causal pairs (L(L+1)/2 for a prompt of L, seq_len per decode row);
  * bound = max(memory time, compute time), the roofline; "bound by" says which term it was. Prefill is
    compute-bound and small-batch decode memory-bound, as expected; where the other term is larger (e.g. fp32
    decode at B=32, or every bf16 case on a CPU whose bf16 peak is a software path) the max is used.

The ratio column is  bound / achieved  = the fraction of the roofline reached: 1.0 would be at the bound,
0.25 means the step takes 4x the bound. Example: "achieved 4.1 ms, bound 1.9 ms, 0.46 of bound".
Other columns: tok/s = tokens processed per second in that step (decode: B / step time); GFLOP/s and GB/s are
the counted FLOPs and bytes divided by the achieved time. JSON (--json) holds every figure plus the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.model.loader import load_model, parse_dtype
from nodeserve.model.quant import PackedLinear

MODEL = "smollm2-135m-instruct"
PAGE_SIZE = 16
DECODE_CONTEXT = 128
DECODE_BATCHES = (1, 8, 32)
PREFILLS = (("prefill 1x512", [512]), ("prefill 4x256", [256] * 4))


def best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def time_runs(fn, warm_fn, budget_s: float, max_iters: int) -> list[float]:
    """Warm up with warm_fn (a cheap run through the same kernels), then time fn until budget_s of samples or
    max_iters. A first full run shorter than 1 s is discarded as warm-up too; a longer one is kept (one-time costs
    are then negligible), so that slow cases (bf16 without hardware bf16 matmul) still fit in the run time."""
    warm_fn()
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times = [first] if first >= 1.0 else []
    while len(times) < max_iters and (not times or sum(times) < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure_bandwidth(reps: int = 5) -> float:
    """Bytes/s of sum() over 1 GiB of written float32."""
    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, every page written
    nbytes = x.numel() * x.element_size()
    x.sum()  # warm
    best = best_of(x.sum, reps)
    del x
    return nbytes / best


MATMUL_LAYOUTS = {"a@b": lambda a, b: torch.mm(a, b), "a@b.T": lambda a, b: torch.mm(a, b.t()),
                  "a.T@b": lambda a, b: torch.mm(a.t(), b)}


def measure_peak(dtype: torch.dtype, reps: int = 3, max_run_s: float = 1.5) -> tuple[float, str]:
    """FLOP/s of the fastest n^3 matmul in dtype, best of `reps`, over three operand layouts (a@b.T is what
    F.linear runs). n = 2048, unless a 512^3 probe shows one 2048^3 run would take over max_run_s (dtypes
    without a hardware path, e.g. bf16 on AVX2-only CPUs, can be 100x slower and layout-dependent); then
    1024, then 512."""
    best, desc = 0.0, ""
    for name, mm in MATMUL_LAYOUTS.items():
        a, b = torch.randn(512, 512).to(dtype), torch.randn(512, 512).to(dtype)
        mm(a, b)
        probe = best_of(lambda: mm(a, b), 1)
        n = next((n for n in (2048, 1024) if probe * (n / 512) ** 3 <= max_run_s), 512)
        if n == 512:
            t = probe
        else:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            mm(a, b)
            t = best_of(lambda: mm(a, b), reps)
        flops = 2 * n ** 3 / t
        if flops > best:
            best, desc = flops, f"{n}^3 {name}"
    return best, desc


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


WEIGHT_BYTES = {"fp16": 2}  # bytes per weight of a PackedLinear format


def measure_packed_peak(fmt: str, n: int = 1024, reps: int = 3) -> tuple[float, str]:
    """FLOP/s of an n x n x n product through PackedLinear(fmt): the compute roof of a quantized variant."""
    lin = PackedLinear(torch.nn.Linear(n, n, bias=False), fmt)
    x = torch.randn(n, n)
    lin(x)
    return 2 * n ** 3 / best_of(lambda: lin(x), reps), f"{n}^3 PackedLinear({fmt})"


def linear_stats(module: torch.nn.Module) -> tuple[int, int]:
    """(matmul params, bytes those weights occupy) over the Linear / PackedLinear layers below module."""
    params = nbytes = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            params += m.weight.numel()
            nbytes += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, PackedLinear):
            params += m.in_features * m.out_features
            nbytes += m.in_features * m.out_features * WEIGHT_BYTES[m.fmt]
    return params, nbytes


class Bench:
    """One variant: a dtype ("fp32", "bf16", "fp16"), optionally "+fp16w" for fp32 compute over fp16 weights
    (nodeserve/model/quant.py; model.quantization = "fp16" in the config)."""

    def __init__(self, variant: str, args):
        dtype_name, _, weights = variant.partition("+")
        self.quantization = weights.removesuffix("w") if weights else "none"
        self.dtype_name, self.dtype, self.args = variant, parse_dtype(dtype_name), args
        t = time.perf_counter()
        self.loaded = load_model(MODEL, self.dtype, quantization=self.quantization)
        self.load_s = time.perf_counter() - t
        self.cfg = cfg = self.loaded.config
        model = self.loaded.model
        self.elsize = torch.tensor([], dtype=self.dtype).element_size()
        self.layer_matmul_params, layer_bytes = linear_stats(model.layers)
        self.lm_head_params, head_bytes = linear_stats(model.lm_head)
        tied = isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.embed_tokens.weight
        # Bytes a step reads: every matmul weight once and the norms. A step gathers only a few embedding rows,
        # so the table counts only when it is also the (tied, dense) lm_head.
        other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if "norm" in n or (tied and n == "embed_tokens.weight"))
        head_bytes = 0 if tied else head_bytes
        self.param_bytes = layer_bytes + head_bytes + other
        self.kv_bytes_per_token = cfg.kv_bytes_per_token * self.elsize
        need = max(sum(pages_for(L, PAGE_SIZE) for L in lens) for _, lens in PREFILLS)
        need = max(need, max(DECODE_BATCHES) * pages_for(DECODE_CONTEXT + 1, PAGE_SIZE))
        self.pool = KVPool(cfg, need + 4, PAGE_SIZE, self.dtype, torch.device("cpu"))
        self.pool.data.copy_(torch.randn(self.pool.data.shape) * 0.5)  # stand-in for cached context K/V
        self.runner = ModelRunner(model, TorchAttention(self.pool, cfg, model.dtype))
        self.peak, self.peak_desc = measure_peak(self.dtype) if self.quantization == "none" \
            else measure_packed_peak(self.quantization)

    # FLOPs of attention: 2 matmuls (QK^T, PV) x 2 FLOPs x heads x head_dim per (query, key) pair, per layer.
    def attn_flops(self, pairs: int) -> float:
        return 4.0 * self.cfg.num_heads * self.cfg.head_dim * pairs * self.cfg.num_layers

    def row(self, name, tokens, times, flops, nbytes, bw):
        t = statistics.median(times)
        mem_s, comp_s = nbytes / bw, flops / self.peak
        bound = max(mem_s, comp_s)
        return {
            "dtype": self.dtype_name, "case": name, "tokens": tokens, "iters": len(times),
            "median_s": t, "min_s": min(times), "tokens_per_s": tokens / t,
            "flops": flops, "bytes": nbytes, "mem_bound_s": mem_s, "compute_bound_s": comp_s,
            "bound_s": bound, "bound_kind": "memory" if mem_s >= comp_s else "compute",
            "fraction_of_bound": bound / t, "achieved_gflops": flops / t / 1e9,
            "achieved_gbps": nbytes / t / 1e9,
        }

    def prefill(self, name, lens, bw, budget, max_iters):
        pages = self.pool.manager.allocate(sum(pages_for(L, PAGE_SIZE) for L in lens))
        chunks, off = [], 0
        for i, L in enumerate(lens):
            n = pages_for(L, PAGE_SIZE)
            ids = [(7 + 31 * (i * 1000 + j)) % self.cfg.vocab_size for j in range(L)]
            chunks.append(SeqChunk(ids, 0, pages[off:off + n]))
            off += n
        warm = [SeqChunk(c.token_ids[:32], 0, c.page_table) for c in chunks]
        times = time_runs(lambda: self.runner.run(chunks), lambda: self.runner.run(warm), budget, max_iters)
        self.pool.manager.free(pages)
        tokens = sum(lens)
        flops = (2.0 * self.layer_matmul_params * tokens + 2.0 * self.lm_head_params * len(lens)
                 + self.attn_flops(sum(L * (L + 1) // 2 for L in lens)))
        nbytes = self.param_bytes + tokens * self.kv_bytes_per_token  # weights once + K/V written
        return self.row(name, tokens, times, flops, nbytes, bw)

    def decode(self, batch, bw, budget, max_iters):
        n = pages_for(DECODE_CONTEXT + 1, PAGE_SIZE)
        pages = self.pool.manager.allocate(batch * n)
        chunks = [SeqChunk([100 + b], DECODE_CONTEXT, pages[b * n:(b + 1) * n]) for b in range(batch)]
        times = time_runs(lambda: self.runner.run(chunks), lambda: self.runner.run(chunks[:1]), budget, max_iters)
        self.pool.manager.free(pages)
        seq_len = DECODE_CONTEXT + 1
        flops = (2.0 * (self.layer_matmul_params + self.lm_head_params) * batch
                 + self.attn_flops(batch * seq_len))
        nbytes = self.param_bytes + batch * seq_len * self.kv_bytes_per_token
        return self.row(f"decode B={batch}", batch, times, flops, nbytes, bw)


def fmt_t(s: float) -> str:
    return f"{s * 1e3:8.1f} ms" if s >= 0.01 else f"{s * 1e3:8.2f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16,fp32", help="comma-separated variants: bf16, fp32, fp16, "
                    "fp32+fp16w (fp32 compute over fbgemm-packed fp16 weights)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--budget", type=float, default=6.0,
                    help="seconds of timed runs per case (at least 1 run; at most 5 prefill / 20 decode runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    bw = measure_bandwidth()
    date = datetime.date.today().isoformat()
    print(f"# nodeserve micro-benchmark  {date}")
    print(f"# cpu: {cpu_name()} ({os.cpu_count()} logical CPUs), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, ISA {torch.backends.cpu.get_cpu_capability()}")
    print(f"# model {MODEL}; decode context {DECODE_CONTEXT} tokens/seq; page size {PAGE_SIZE}")
    print(f"# bandwidth (sum over 1 GiB of ones): {bw / 1e9:.1f} GB/s")

    results = {"date": date, "cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
               "python": sys.version.split()[0], "isa": torch.backends.cpu.get_cpu_capability(),
               "threads": torch.get_num_threads(), "model": MODEL, "bandwidth_Bps": bw, "dtypes": {}, "rows": []}
    rows = []
    for name in args.dtype.split(","):
        name = name.strip()
        b = Bench(name, args)
        print(f"# {name}: load {b.load_s:.1f} s, weights {b.param_bytes / 1e6:.0f} MB, "
              f"matmul peak {b.peak / 1e9:.1f} GFLOP/s ({b.peak_desc})")
        results["dtypes"][name] = {"load_s": b.load_s, "param_bytes": b.param_bytes, "peak_flops": b.peak,
                                   "peak_matmul": b.peak_desc,
                                   "layer_matmul_params": b.layer_matmul_params,
                                   "lm_head_params": b.lm_head_params}
        for case, lens in PREFILLS:
            rows.append(b.prefill(case, lens, bw, args.budget, 5))
        for batch in DECODE_BATCHES:
            rows.append(b.decode(batch, bw, args.budget, 20))
        del b

    print()
    print("ratio = bound / achieved (fraction of roofline reached; 1.00 = at the bound)")
    hdr = f"{'variant':10} {'case':14} {'achieved':>11} {'tok/s':>8} {'bound':>11} {'bound by':>8} {'ratio':>6} " \
          f"{'GFLOP/s':>8} {'GB/s':>6} {'n':>3}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['dtype']:10} {r['case']:14} {fmt_t(r['median_s'])} {r['tokens_per_s']:8.0f} "
              f"{fmt_t(r['bound_s'])} {r['bound_kind']:>8} {r['fraction_of_bound']:6.2f} "
              f"{r['achieved_gflops']:8.1f} {r['achieved_gbps']:6.2f} {r['iters']:3d}")
    peaks = {n: d["peak_flops"] for n, d in results["dtypes"].items()}
    if "bf16" in peaks and "fp32" in peaks and peaks["bf16"] < peaks["fp32"]:
        print(f"note: bf16 matmul peak {peaks['bf16'] / 1e9:.1f} < fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s: no hardware "
              f"bf16 matmul here, so bf16 ratios are against a software path")
    total = time.perf_counter() - t_start
    print(f"\n# total run time {total:.0f} s")
    results["rows"] = rows
    results["total_s"] = total
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
