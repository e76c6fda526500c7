"""Fill FlashInfer's JIT cache (~/.cache/flashinfer) for one attention shape, or for the norm/activation/RoPE kernels,
so that a later run of tests/cuda or the benchmarks finds every kernel compiled. Several of these can run at once
(one process per shape): each compiles its own modules with nvcc in parallel with the others.

    python scripts/gpu_prewarm.py attn --heads 9 --kv-heads 3 --head-dim 64 --kv-dtype bf16   # SmolLM2-135M
    python scripts/gpu_prewarm.py attn --heads 8 --kv-heads 2 --head-dim 128 --kv-dtype fp8   # tests/cuda's shape
    python scripts/gpu_prewarm.py ops

Runs what the server runs on such a shape: one eager step with decodes and prefill chunks (the decode wrapper with
tensor cores, the prefill wrapper with causal=True) and one decode step on a CUDA-graph-mode backend; prints the
time each took (the first use of a kernel is its compile).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from nodeserve.attention.base import AttentionMetadata

DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _meta(seqs, page_size, device):
    """seqs: (cached, new) pairs, decodes first; pages assigned in order from page 1."""
    tables, slots, next_page = [], [], 1
    for cached, new in seqs:
        n = -(-(cached + new) // page_size)
        table = list(range(next_page, next_page + n))
        next_page += n
        tables.append(table)
        slots += [table[p // page_size] * page_size + p % page_size for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    page_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    seq_lens = [c + n for c, n in seqs]
    return AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), page_tables=page_tables,
                             seq_lens=torch.tensor(seq_lens, device=device), query_lens=[n for _, n in seqs],
                             seq_lens_host=seq_lens, num_decodes=sum(1 for _, n in seqs if n == 1),
                             page_size=page_size, page_tables_host=tables), next_page


def attn(args) -> None:
    from nodeserve.attention.flashinfer_backend import FlashInferAttention
    from nodeserve.kv.pool import KVPool

    device = torch.device("cuda", 0)
    h, kh, d = args.heads, args.kv_heads, args.head_dim
    cfg = SimpleNamespace(num_layers=1, num_heads=h, num_kv_heads=kh, head_dim=d, max_position_embeddings=8192,
                          softmax_scale=d ** -0.5, window=lambda layer: 0)
    seqs = [(15, 1), (99, 1), (0, 33), (40, 17)]
    meta, pages = _meta(seqs, 16, device)
    pool = KVPool(cfg, pages + 8, 16, DTYPES[args.kv_dtype], device)
    tokens = sum(n for _, n in seqs)
    q = torch.randn(tokens, h, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(tokens, kh, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(tokens, kh, d, device=device, dtype=torch.bfloat16)
    tag = f"attn H={h} KH={kh} D={d} kv={args.kv_dtype}"

    start = time.monotonic()
    eager = FlashInferAttention(pool, cfg, torch.bfloat16)
    eager.prepare(meta)
    out = eager.forward(0, q, k, v)
    torch.cuda.synchronize()
    print(f"{tag}: eager mixed step (decode+prefill kernels) {time.monotonic() - start:.1f} s, "
          f"finite={bool(out.float().isfinite().all())}", flush=True)

    start = time.monotonic()
    decode_meta, _ = _meta(seqs[:2], 16, device)
    graphed = FlashInferAttention(pool, cfg, torch.bfloat16, graph_batch_size=2, workspace=eager.workspace)
    graphed.prepare(decode_meta)
    out = graphed.forward(0, q[:2], k[:2], v[:2])
    torch.cuda.synchronize()
    print(f"{tag}: graph-mode decode step {time.monotonic() - start:.1f} s, "
          f"finite={bool(out.float().isfinite().all())}", flush=True)


def ops(args) -> None:
    from nodeserve.model.flashinfer_ops import FlashInferOps
    from nodeserve.model.rope import RotaryEmbedding

    device, bf16 = torch.device("cuda", 0), torch.bfloat16
    start = time.monotonic()
    fi = FlashInferOps(RotaryEmbedding(64, 100000.0, None), 8192, device)
    x, res, w = (torch.randn(5, 576, device=device, dtype=bf16) for _ in range(3))
    fi.rms_norm(x, w[0], 1e-5)
    fi.add_rms_norm(x, res, w[0], 1e-5)
    fi.silu_and_mul(torch.randn(5, 2 * 1536, device=device, dtype=bf16))
    qkv = torch.randn(5, (9 + 2 * 3) * 64, device=device, dtype=bf16)
    q, kk, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    fi.rotary(torch.arange(5, device=device), bf16).apply(q.view(5, 9, 64), kk.view(5, 3, 64))
    torch.cuda.synchronize()
    print(f"ops (rmsnorm, fused_add_rmsnorm, silu_and_mul, rope): {time.monotonic() - start:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["attn", "ops"])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args()
    (attn if args.what == "attn" else ops)(args)


if __name__ == "__main__":
    main()
