"""The CPU fast path, piece by piece, against the machine's own limits: one core's DRAM read bandwidth and
fp32 matmul peak, the block-quantized GEMM per batch size, paged decode attention, whole decode steps and
prefill. Every row names the bound it is compared with.

    python bench/kernels.py                      # ~3 minutes on the 2-core machine; run it on a quiet machine
    python bench/kernels.py --json bench/results/kernels.json
    python bench/kernels.py --block-types        # only the per-GGUF-type GEMV rows (seconds)
    python bench/kernels.py --r16-gemm           # only the R16 kernels per CPU class on SmolLM2's shapes (~1 min)
    python bench/kernels.py --huge-pages         # only decode steps, weights and pools on huge pages or not
    python bench/kernels.py --prefetch           # only decode attention and steps, prefetches into L1 or L2

What each row means:
  * bandwidth: sum() over 1 GiB of written float32 on one thread (GB/s): the read bound everything below uses.
  * block type T M=m: one [640, 2048] matrix (Gemma 3 270M's ffn_down) in GGUF type T through the native kernel
    (Q8_0+R16: repacked for the VNNI kernel, where built), us per call: "cache" the same matrix every call (in
    L2), "dram" a ring of copies larger than L3, and "x bound" = dram time / (its bytes / bandwidth).
  * r16 gemm S M=m (--r16-gemm): one SmolLM2-135M projection of shape S (in->out; Q4_1, the lm_head Q8_0) at m rows,
    us per call (the fastest of 5 interleaved rounds), "cache" the same matrix every call, "dram" a ring of copies
    larger than L3: the GGUF-layout kernel
    (gguf: what AVX2 CPUs ran before csrc/r16_avx2.c) against each R16 kernel the build has (avx512-vnni,
    avx-vnni, avx2; NODESERVE_KERNELS_MARCH=x86-64-v3 builds what an AVX2-only CPU has), int16 activations, and
    int8 ones (_i8, `model.prompt_activations = "int8"`) for the Q4_1 shapes.
  * crossover M=m: the layers' projections through the fused kernel vs dequantize + F.linear.
  * gemm M=m: every projection of one decode step (30 layers + lm_head) at m activation rows, from DRAM: the
    file's Q4_1/Q8_0 blocks through the native kernels (auto: the best R16 kernel on repacked weights the
    CPU has; avx2: the AVX2 R16 kernels, NODESERVE_KERNELS=avx2) vs the dense float32 weights through
    F.linear; "x bound" = time / (weight bytes / bandwidth); ns per row block = time / (m x weight rows x blocks
    of 32 a row).
  * attention B x L: one layer's paged decode attention for B sequences of L tokens (pages scattered; 30 layers'
    pools taken in turn, so K and V come from DRAM as in a step),
    "x bound" = time / (K and V bytes / bandwidth).
  * prefill attention P+L: one layer's attention for an L-token chunk after P cached tokens, the native
    AVX-512 kernel (pages read in place; "bf16": its products in bf16, `model.prompt_attention`) vs the torch
    path (gather, then torch's flash attention), GFLOP/s of the causal work and its fraction of the fp32 matmul
    peak.
  * step B x L: ModelRunner.run of B decode rows with L tokens each (what a decode worker runs per step),
    quantization auto vs none; "x bound" = time / ((weight + KV bytes) / bandwidth); "float16 KV": the pool in
    float16 (kv.dtype = "float16"), as the attention rows marked float16.
  * prompt gemm M=m: the layers' projections (no lm_head) on m prompt rows through the VNNI kernel, int16
    activations vs int8 (`model.prompt_activations = "int8"`) vs bf16 products (`"bf16"`, the default where the
    CPU has AVX512-BF16), GOP/s of the multiply-adds.
  * prefill: a 512-token chunk, tok/s, and its FLOP rate as a fraction of the measured fp32 matmul peak
    (int8 / bf16: the default model with `prompt_activations = "int8"` / `"bf16"`); prompt attention as the config
    resolves it (bf16 products with quantized weights where the CPU has AVX512-BF16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from nodeserve.runtime.memory import weight_bytes
from nodeserve.runtime.node import build_runner
from nodeserve.runtime.model_runner import SeqChunk
from nodeserve.device import host_memory
from nodeserve.kernels import native
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.model.block_quant import QuantLinear
from nodeserve.model.loader import load_model

MODEL = "smollm2-135m-instruct"
LAYERS = 30  # the model's


def timed(fn, repeat: int, warmup: int = 1) -> float:
    """Median seconds of `repeat` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth() -> float:
    a = torch.ones(256 * 1024 * 1024 // 4)  # written, so its pages are real (not the shared zero page)
    return a.numel() * 4 / timed(a.sum, 5) / 1e9


def matmul_peak() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024 ** 3 / timed(lambda: a @ b, 10) / 1e9


def gemm_rows(models: dict, gbs: float, ms: list[int]) -> list[dict]:
    rows = []
    for m in ms:
        row = {"what": f"gemm M={m}"}
        for name, model in models.items():
            mods = [mod for mod in model.modules() if isinstance(mod, (QuantLinear, torch.nn.Linear))]
            num_bytes = sum(mod.weight.numel() * mod.weight.element_size() for mod in mods)
            row_blocks = sum(mod.out_features * mod.in_features // 32 for mod in mods)
            xs = {k: torch.randn(m, k) for k in {mod.in_features for mod in mods}}
            t = timed(lambda: [mod(xs[mod.in_features]) for mod in mods], 5 if name != "none" else 3)
            row.update({f"{name}_ms": t * 1e3, f"{name}_x_bound": t / (num_bytes / gbs / 1e9),
                        f"{name}_ns_per_row_block": t * 1e9 / (m * row_blocks), f"{name}_MB": num_bytes / 1e6})
        rows.append(row)
    return rows


def random_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """n rows of k weights in `qtype`'s GGUF blocks: random quants, fp16 scales in (0, 0.05)."""
    block, size = native.BLOCK_LAYOUTS[qtype]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8)
    scale_at = {native.Q4_0: (0,), native.Q8_0: (0,), native.Q6_K: (208,)}.get(qtype, (0, 2))
    for off in scale_at:
        raw[..., off:off + 2] = (torch.rand(n, k // block, 1) * 0.05).half().view(torch.uint8)
    return raw.reshape(n, -1)


def block_type_rows(kernels, gbs: float, ms: list[int], n: int = 640, k: int = 2048) -> list[dict]:
    types = {"Q8_0": native.Q8_0, "Q4_K": native.Q4_K, "Q5_K": native.Q5_K, "Q6_K": native.Q6_K,
             "Q5_1": native.Q5_1, "Q4_1": native.Q4_1}
    rows = []
    for name, qtype in types.items():
        w = random_blocks(qtype, n, k)
        variants = [(name, qtype, w)]
        if kernels.r16 and qtype in native.BLOCK_BYTES:
            variants.append((f"{name}+R16", qtype | native.R16, kernels.repack(qtype, w, n, k)))
        for label, t, data in variants:
            ring = [data.clone() for _ in range(max(2, 64 * 2 ** 20 // data.numel()))]  # > L3: read from DRAM
            for m in ms:
                x = torch.randn(m, k)
                cache = timed(lambda: [kernels.linear(t, data, x, n) for _ in range(50)], 7) / 50
                dram = timed(lambda: [kernels.linear(t, r, x, n) for r in ring], 5) / len(ring)
                rows.append({"what": f"block type {label} M={m}", "cache_us": cache * 1e6, "dram_us": dram * 1e6,
                             "x_bound": dram / (data.numel() / gbs / 1e9), "KB": data.numel() / 1e3})
    return rows


# SmolLM2-135M's projections (in, out, type): fused qkv, o, fused gate/up, down (Q4_1), the tied lm_head (Q8_0)
SMOLLM2_SHAPES = [(576, 960, native.Q4_1), (576, 576, native.Q4_1), (576, 3072, native.Q4_1),
                  (1536, 576, native.Q4_1), (576, 49152, native.Q8_0)]


def r16_gemm_rows(kernels, ms: list[int]) -> list[dict]:
    """The GGUF-layout kernel vs each R16 kernel of this build, on SmolLM2-135M's shapes."""
    rows = []
    for k, n, qtype in SMOLLM2_SHAPES:
        w = random_blocks(qtype, n, k)
        r16 = kernels.repack(qtype, w, n, k) if kernels.r16 else None
        variants = [("gguf", qtype, w)] + [(name, qtype | native.R16 | native.R16_FLAGS[name], r16)
                                           for name in kernels.r16_kernels]
        if qtype != native.Q8_0:
            variants += [(f"{name}_i8", qtype | native.R16 | native.R16_FLAGS[name] | native.ACT8, r16)
                         for name in kernels.r16_kernels]
        for m in ms:
            x = torch.randn(m, k)
            row = {"what": f"r16 gemm {k}->{n} M={m}"}
            rings = {label: [data.clone() for _ in range(max(2, 64 * 2 ** 20 // data.numel()))]  # > L3: DRAM
                     for label, _, data in variants}
            calls = max(1, 2 ** 22 // w.numel())
            best: dict[str, float] = {}
            for _ in range(5):  # variants interleaved, the fastest round of each: other work on the cores hits all
                for label, t, data in variants:
                    cache = timed(lambda: [kernels.linear(t, data, x, n) for _ in range(calls)], 1) / calls
                    dram = timed(lambda: [kernels.linear(t, r, x, n) for r in rings[label]], 1) / len(rings[label])
                    for key, v in ((f"{label}_cache_us", cache), (f"{label}_dram_us", dram)):
                        best[key] = min(best.get(key, v * 1e6), v * 1e6)
            row.update(best)
            rows.append(row)
    return rows


def prompt_gemm_rows(quant, ms: list[int]) -> list[dict]:
    """int16 vs int8 activations (vs bf16 products, where built) over one layer stack's projections, as prompt rows
    take them."""
    flags = (("int16", 0), ("int8", native.ACT8)) + ((("bf16", native.BF16),) if native.load().bf16_gemm else ())
    mods = [m for m in quant.modules() if isinstance(m, QuantLinear) and m is not quant.lm_head]
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k) for k in {mod.in_features for mod in mods}}
        ops = 2 * m * sum(mod.in_features * mod.out_features for mod in mods)
        row = {"what": f"prompt gemm M={m}"}
        for name, flag in flags:
            t = timed(lambda: [mod.kernels.linear(mod.qtype | flag, mod.weight, xs[mod.in_features],
                                                  mod.out_features) for mod in mods], 3)
            row.update({f"{name}_ms": t * 1e3, f"{name}_GOPs": ops / t / 1e9})
        rows.append(row)
    return rows


def crossover_rows(quant, ms: list[int]) -> list[dict]:
    """Fused kernel vs dequantize + torch GEMM over one step's projections, per row count: where
    block_quant.MAX_GEMV_ROWS should sit."""
    mods = [m for m in quant.modules() if isinstance(m, QuantLinear)][:-1]  # the layers' projections
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k) for k in {mod.in_features for mod in mods}}
        fused = timed(lambda: [mod.kernels.linear(mod.qtype, mod.weight, xs[mod.in_features], mod.out_features)
                               for mod in mods], 3)
        gemm = timed(lambda: [torch.nn.functional.linear(xs[mod.in_features], mod.quantized.dequantize())
                              for mod in mods], 3)
        rows.append({"what": f"crossover M={m}", "fused_ms": fused * 1e3, "dequant_gemm_ms": gemm * 1e3})
    return rows


def attention_rows(kernels, gbs: float, shapes: list[tuple[int, int]], dtype=torch.float32) -> list[dict]:
    rows, suffix = [], "" if dtype == torch.float32 else " float16"
    for b, length in shapes:
        pps = pages_for(length, 16)
        # one pool layer per model layer, a call on each in turn, as a step reads them: one layer's K/V alone
        # (25 MB at 16 x 1,024) stays in L3 from call to call and measured a third faster than DRAM allows
        layers = [torch.randn(b * pps + 7, 2, 16, 3, 64).to(dtype) for _ in range(LAYERS)]
        tables = torch.randperm(b * pps + 7)[:b * pps].view(b, pps)  # scattered pages, as in a busy pool
        q, seq_lens = torch.randn(b, 9, 64), torch.full((b,), length, dtype=torch.int64)
        call = [0]

        def attend():
            kernels.paged_decode_attention(q, layers[call[0] % LAYERS], tables, seq_lens, 0.125)
            call[0] += 1

        t = timed(attend, 3 * LAYERS, warmup=LAYERS)
        del layers
        kv_bytes = b * length * 2 * 3 * 64 * layers_itemsize(dtype)
        rows.append({"what": f"attention {b}x{length}{suffix}", "ms": t * 1e3,
                     "x_bound": t / (kv_bytes / gbs / 1e9)})
    return rows


def prefill_attention_rows(kernels, peak: float, shapes: list[tuple[int, int]]) -> list[dict]:
    """One layer's attention for a chunk of L tokens after P cached ones (SmolLM2's 9 heads, 3 KV heads, D 64):
    the native kernel reading the pages vs what the torch path does (gather the pages, then torch's flash
    attention: causal, or two calls merged after a prefix); GFLOP/s counts only the scores under the diagonal."""
    from nodeserve.attention.torch_ref import attend, attend_after_prefix, gather_kv

    rows = []
    for num_prefix, length in shapes:
        seq_len = num_prefix + length
        pps = pages_for(seq_len, 16)
        kv = torch.randn(pps + 7, 2, 16, 3, 64)
        table = torch.randperm(pps + 7)[:pps].contiguous()
        q, out = torch.randn(length, 9, 64), torch.empty(length, 9, 64)

        def by_torch():
            k, v = gather_kv(kv, table[None], seq_len)
            if num_prefix:
                return attend_after_prefix(q[None], k, v, 0.125)
            return attend(q[None], k, v, None, True, 0.125)
        flops = 4 * 9 * 64 * sum(num_prefix + i + 1 for i in range(length))
        row = {"what": f"prefill attention {num_prefix}+{length}"}
        if kernels.prefill:
            t = timed(lambda: kernels.prefill_attention(q, kv, table, num_prefix, 0.125, out), 5)
            row.update(native_ms=t * 1e3, native_GFLOPs=flops / t / 1e9, native_of_peak=flops / t / 1e9 / peak)
        if kernels.prefill_bf16:  # model.prompt_attention = "bfloat16" (the default with quantized weights)
            t = timed(lambda: kernels.prefill_attention(q, kv, table, num_prefix, 0.125, out, bf16=True), 5)
            row.update(bf16_ms=t * 1e3, bf16_GFLOPs=flops / t / 1e9)
        t = timed(by_torch, 5)
        row.update(torch_ms=t * 1e3, torch_GFLOPs=flops / t / 1e9, torch_of_peak=flops / t / 1e9 / peak)
        rows.append(row)
    return rows


def runner_for(name: str, model, pool: KVPool, max_num_seqs: int):
    """The runner a worker builds; for "avx2", with the AVX2 prefill attention too, as an AVX2 machine runs it
    (NODESERVE_KERNELS=avx2 is read when the attention backend is built, as it was for the GEMMs at load). Prompt
    attention as the config resolves it: bf16 products with quantized weights, float32 for "none"."""
    if name == "avx2":
        os.environ["NODESERVE_KERNELS"] = "avx2"
    try:
        return build_runner(model, pool, "auto", cuda_graphs=False, max_num_seqs=max_num_seqs,
                            prompt_attention="float32" if name == "none" else "auto")
    finally:
        os.environ.pop("NODESERVE_KERNELS", None)


def step_rows(models: dict, gbs: float, shapes: list[tuple[int, int]], kv_dtype=torch.float32,
              huge_pages: bool = True) -> list[dict]:
    """huge_pages: the pools on transparent huge pages, as a server's (devices.huge_pages)."""
    rows = []
    for b, length in shapes:
        row = {"what": f"step {b}x{length}" + ("" if kv_dtype == torch.float32 else " float16 KV")}
        for name, model in models.items():
            pps = pages_for(length + 20, 16)
            pool = KVPool(model.cfg, b * pps + 1, 16, kv_dtype, torch.device("cpu"), huge_pages=huge_pages)
            runner = runner_for(name, model, pool, b)
            tables = [pool.manager.allocate(pps) for _ in range(b)]
            step = [0]

            def run():
                runner.run([SeqChunk([1], length + step[0] % 10, t) for t in tables])
                step[0] += 1

            t = timed(run, 50, warmup=10)  # a stream: many steps in a row (10 after one warm-up swung more)
            kv_bytes = b * length * pool.bytes_per_page_per_layer // 16 * model.cfg.num_layers
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_x_bound"] = t / ((weight_bytes(model) + kv_bytes) / gbs / 1e9)
        rows.append(row)
    return rows


def layers_itemsize(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def prefill_rows(models: dict, peak: float, tokens: int = 512) -> list[dict]:
    row = {"what": f"prefill {tokens}"}
    for name, model in models.items():
        pool = KVPool(model.cfg, pages_for(tokens, 16) + 1, 16, torch.float32, torch.device("cpu"))
        runner = runner_for(name, model, pool, 1)
        table = pool.manager.allocate(pages_for(tokens, 16))
        ids = torch.randint(100, 40000, (tokens,)).tolist()
        t = timed(lambda: runner.run([SeqChunk(ids, 0, table)]), 3)
        flops = 2 * tokens * sum(m.in_features * m.out_features for m in model.modules()
                                 if isinstance(m, (QuantLinear, torch.nn.Linear)) and m is not model.lm_head)
        row[f"{name}_tok_s"] = tokens / t
        row[f"{name}_of_peak"] = flops / t / 1e9 / peak
    return [row]


def huge_page_steps(kernels, json_path: str | None, rounds: int = 3) -> dict:
    """Decode steps of the default model with its weights and pool on huge pages and on 4 KiB pages
    (devices.huge_pages), alternated `rounds` times: each row's values per round."""
    gbs = bandwidth()
    models = {huge: load_model(MODEL, torch.float32, quantization="auto", huge_pages=huge).model
              for huge in (True, False)}
    shapes = [(1, 128), (1, 1024), (8, 128), (32, 128), (16, 1024)]
    per_round = [[row for huge in (False, True) for row in step_rows({("huge" if huge else "4k"): models[huge]}, gbs,
                                                                      shapes, huge_pages=huge)]
                 for _ in range(rounds)]
    rows = []
    for i, (b, length) in enumerate(shapes):
        row: dict = {"what": f"step {b}x{length}"}
        for kind in ("4k", "huge"):
            row[f"{kind}_ms"] = [r[i if kind == "4k" else len(shapes) + i][f"{kind}_ms"] for r in per_round]
        rows.append(row)
        print(row["what"], "4 KiB pages", [round(v, 2) for v in row["4k_ms"]], "ms; huge pages",
              [round(v, 2) for v in row["huge_ms"]], "ms")
    return _kept(kernels, gbs, rows, json_path, thp=host_memory.thp_setting())


def _kept(kernels, gbs: float, rows: list[dict], json_path: str | None, **extra) -> dict:
    """An A/B's result: the machine, the build and the rows, written to json_path when given."""
    result = {"machine": platform.processor() or platform.machine(), "isa": kernels.isa, "bandwidth_GBs": gbs,
              "march": native.march(), **extra, "rows": rows}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def prefetch_steps(kernels, json_path: str | None, rounds: int = 3) -> dict:
    """Decode attention and decode steps of the default model with the kernels' prefetches into L1 and into L2
    (kernels/tuning.py), alternated `rounds` times in one process: each row's values per round. Run under
    NODESERVE_KERNELS_MARCH=x86-64-v3 NODESERVE_KERNELS=avx2 for the AVX2 class."""
    from nodeserve.kernels import tuning
    gbs = bandwidth()
    model = load_model(MODEL, torch.float32, quantization="auto", huge_pages=True).model
    attention_shapes, step_shapes = [(1, 1024), (32, 150), (16, 1024)], [(1, 50), (1, 1024), (32, 150), (16, 1024)]
    chosen = kernels.prefetch
    per_round = []
    try:
        for _ in range(rounds):
            for level in ("l1", "l2"):
                tuning.apply(kernels, tuning.PrefetchLevels(level == "l2", level == "l2", "forced"))
                per_round.append((level, attention_rows(kernels, gbs, attention_shapes)
                                  + step_rows({"auto": model}, gbs, step_shapes)))
    finally:
        tuning.apply(kernels, chosen)
    rows = []
    for i, what in enumerate(r["what"] for r in per_round[0][1]):
        key = "ms" if what.startswith("attention") else "auto_ms"
        row = {"what": what, **{f"{level}_ms": [r[i][key] for lv, r in per_round if lv == level]
                                for level in ("l1", "l2")}}
        rows.append(row)
        print(what, "into L1", [round(v, 2) for v in row["l1_ms"]], "ms; into L2", [round(v, 2) for v in row["l2_ms"]],
              "ms")
    return _kept(kernels, gbs, rows, json_path, chosen=chosen.describe())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--block-types", action="store_true", help="only the per-GGUF-type GEMV rows")
    ap.add_argument("--r16-gemm", action="store_true", help="only the R16 kernels per CPU class, SmolLM2's shapes")
    ap.add_argument("--huge-pages", action="store_true",
                    help="only decode steps of the default model, weights and pools on huge pages or not, alternated")
    ap.add_argument("--prefetch", action="store_true",
                    help="only decode attention and decode steps with the prefetches into L1 and L2, alternated")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one core, as a CPU worker runs
    kernels = native.load()
    if kernels is None:
        raise SystemExit("the native kernels could not be built (is a C compiler installed?)")
    if args.block_types or args.r16_gemm:
        gbs = bandwidth()
        result = {"machine": platform.processor() or platform.machine(), "isa": kernels.isa, "bandwidth_GBs": gbs,
                  "march": native.march(), "rows": block_type_rows(kernels, gbs, [1, 8]) if args.block_types
                  else r16_gemm_rows(kernels, [1, 32])}
        print(f"one-core DRAM read {gbs:.1f} GB/s, kernels: {kernels.isa}")
        for row in result["rows"]:
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    if args.huge_pages:
        return huge_page_steps(kernels, args.json)
    if args.prefetch:
        return prefetch_steps(kernels, args.json)
    gbs, peak = bandwidth(), matmul_peak()
    quant = load_model(MODEL, torch.float32, quantization="auto", huge_pages=True).model  # as a server loads it
    os.environ["NODESERVE_KERNELS"] = "avx2"  # the AVX2 R16 kernels, for comparison (read at load)
    gguf_layout = load_model(MODEL, torch.float32, quantization="auto").model
    del os.environ["NODESERVE_KERNELS"]
    dense = load_model(MODEL, torch.float32, quantization="none").model
    models = {"auto": quant, "avx2": gguf_layout, "none": dense} if kernels.r16 else {"auto": quant, "none": dense}
    int8 = load_model(MODEL, torch.float32, quantization="auto", prompt_activations="int8").model
    prompt_models = {"int8": int8}
    if kernels.bf16_gemm:  # the default where the CPU has AVX512-BF16 (model.prompt_activations = "auto")
        prompt_models["bf16"] = load_model(MODEL, torch.float32, quantization="auto", prompt_activations="bf16").model
    result = {"machine": platform.processor() or platform.machine(), "isa": kernels.isa,
              "bandwidth_GBs": gbs, "fp32_peak_GFLOPs": peak, "rows": []}
    print(f"one-core DRAM read {gbs:.1f} GB/s, fp32 matmul peak {peak:.1f} GFLOP/s, kernels: {kernels.isa}")
    result["rows"] += gemm_rows(models, gbs, [1, 2, 4, 8, 16, 32])
    result["rows"] += block_type_rows(kernels, gbs, [1, 8])
    result["rows"] += crossover_rows(quant, [16, 32, 64, 256])
    result["rows"] += attention_rows(kernels, gbs, [(1, 512), (1, 2048), (16, 1024), (32, 256)])
    if torch.float16 in kernels.kv_dtypes:  # kv.dtype = "float16"
        result["rows"] += attention_rows(kernels, gbs, [(1, 2048), (16, 1024)], torch.float16)
    result["rows"] += prefill_attention_rows(kernels, peak, [(0, 1024), (1024, 1024), (3072, 1024)])
    result["rows"] += step_rows(models, gbs, [(1, 128), (1, 1024), (16, 1024), (32, 128)])
    if torch.float16 in kernels.kv_dtypes:
        result["rows"] += step_rows({"auto": quant}, gbs, [(1, 1024), (16, 1024)], torch.float16)
    if kernels.r16:
        result["rows"] += prompt_gemm_rows(quant, [64, 512])
    result["rows"] += prefill_rows({**models, **prompt_models} if kernels.r16 else models, peak)
    for row in result["rows"]:
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
