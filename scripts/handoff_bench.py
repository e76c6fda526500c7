"""Handoff micro-benchmark (GPU): KV copy time per layer, and how much of it layer-by-layer streaming hides
behind prefill compute.

A synthetic prefill: per layer, a bf16 matmul sized like one layer of the chosen model on the prompt, then
that layer's KV copy enqueued on a real KVTransfer (copy stream, events) from the prefill GPU to the decode GPU.
  copy alone   all layers' copies with no compute: per-layer copy time and bandwidth
  exposed      time from the end of the last layer's compute to the decode side holding every byte
  hidden share 1 - exposed / copy alone
Usage: python scripts/handoff_bench.py [--tokens 2048] [--src cuda:0] [--dst cuda:1]
"""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import torch

from nodeserve.device import make_device
from nodeserve.runtime.transfer import KVTransfer
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.core.sampling_params import SamplingParams

# Llama-3.1-8B's shape: the KV per token and the per-layer weights a prefill multiplies by.
MODEL = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, hidden=4096, layer_params=218_000_000)
PAGE_SIZE = 16


def _prefill_and_copy(args, src, dst, transfer, src_pages, dst_pages, compute: bool) -> tuple[float, float]:
    """Returns (seconds from the last layer's compute to every copy landed, total seconds)."""
    x = torch.randn(args.tokens, MODEL.hidden, dtype=torch.bfloat16, device=src.torch_device)
    # One [hidden, layer_params / hidden] matmul per layer: the FLOPs of a layer's linear layers.
    w = torch.randn(MODEL.hidden, MODEL.layer_params // MODEL.hidden, dtype=torch.bfloat16, device=src.torch_device)
    pages = transfer.page_indices(src_pages, dst_pages)
    landed = threading.Event()
    done = []
    torch.cuda.synchronize(src.torch_device)
    start = time.perf_counter()
    for layer in range(MODEL.num_layers):
        if compute:
            x @ w
        transfer.copy_layer(layer, pages)
    errors = []

    def on_done(event, error):
        if error is None:
            done.append(event)
        else:
            errors.append(error)
        landed.set()
    transfer.finish("bench", [], on_done)  # no source pages given back: the next repeat copies the same ones
    torch.cuda.synchronize(src.torch_device)  # the compute is done here
    compute_end = time.perf_counter()
    landed.wait()
    if errors:
        raise SystemExit(errors[0])
    done[0].synchronize()
    end = time.perf_counter()
    return end - compute_end, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--src", default="cuda:0")
    parser.add_argument("--dst", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    src, dst = make_device(args.src), make_device(args.dst)
    num_pages = pages_for(args.tokens, PAGE_SIZE)
    src_pool = KVPool(MODEL, num_pages + 1, PAGE_SIZE, torch.bfloat16, src.torch_device)
    dst_pool = KVPool(MODEL, num_pages + 1, PAGE_SIZE, torch.bfloat16, dst.torch_device)
    src_pages = src_pool.manager.allocate(num_pages)
    dst_pages = dst_pool.manager.allocate(num_pages)
    transfer = KVTransfer(src, src_pool, dst, dst_pool, lambda pages, event: None)  # the pages are reused as is
    transfer.start()
    src.init_worker_thread()  # this thread plays the prefill worker: its compute stream
    try:
        _prefill_and_copy(args, src, dst, transfer, src_pages, dst_pages, compute=True)  # warm-up
        copy_alone = min(_prefill_and_copy(args, src, dst, transfer, src_pages, dst_pages, False)[1]
                         for _ in range(args.repeats))
        runs = [_prefill_and_copy(args, src, dst, transfer, src_pages, dst_pages, True) for _ in range(args.repeats)]
    finally:
        transfer.stop()
    exposed, total = min(runs)
    layer_bytes = num_pages * src_pool.bytes_per_page_per_layer
    per_layer = copy_alone / MODEL.num_layers
    print(f"{args.src} -> {args.dst}, {args.tokens} tokens, {MODEL.num_layers} layers, "
          f"{layer_bytes / 2**20:.1f} MiB of KV per layer")
    print(f"copy alone: {per_layer * 1e6:.0f} us per layer ({layer_bytes / per_layer / 1e9:.1f} GB/s), "
          f"{copy_alone * 1e3:.2f} ms in all")
    print(f"prefill + streamed copies: {total * 1e3:.2f} ms; exposed after compute: {exposed * 1e3:.2f} ms; "
          f"hidden share: {max(0.0, 1 - exposed / copy_alone):.0%}")


if __name__ == "__main__":
    main()
