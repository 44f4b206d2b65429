#!/usr/bin/env bash
# Everything the two-GPU issue measures, as one command on a machine with two NVIDIA GPUs (NCCL):
#
#     python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda
#     bash benchmarks/two_gpu_run.sh "$OUT"
#
# Steps (each under its own time limit; a failed step is logged and the next one runs):
#   1. the multi_gpu tests that are new this round (compiled `full` with NCCL collectives inside and the
#      fallback graph set under TP; data-parallel key agreement) plus the TP equivalence test
#   2. bench_tp.py: eager / hand-written graph / `full` / compiled `full` at batch 1, 8, 32, 64
#   3. bench_dp_agree.py --device cuda: the cost of one agreement per step next to a bare all-reduce
#   4. benchmarks/serve_tp_check.py: `devgraph serve --tp 2` against the single-GPU server (greedy tokens,
#      latency under load), then a worker killed
# Writes at most 8 files under OUT (the device tool brings back no more): two-gpu.log, tp-tests.json,
# dp-tests.json, tp.json, tp.png, dp-agree.json, serve-tp.json.
set -u
OUT=${1:?usage: bash benchmarks/two_gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
LOG="$OUT/two-gpu.log"
export PYTHONUNBUFFERED=1
# NVLink multicast off (the device notes: NVLS can hang collectives on these machines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} >>"$LOG" 2>&1

DEVGRAPH_TP_RESULTS="$OUT/tp-tests.json" DEVGRAPH_DP_RESULTS="$OUT/dp-tests.json" \
    step multi_gpu_tests 200 $PY -m pytest -q -p no:cacheprovider -m multi_gpu -rfs \
    tests/test_tp.py tests/test_dp.py -k "compiled or fallback or dp or different_batches or replays_equal"
step bench_tp 150 torchrun --nproc-per-node 2 benchmarks/bench_tp.py --presets qwen3-0.6b \
    --time-budget 130 --out "$OUT/tp.json"
step bench_dp_agree 40 $PY benchmarks/bench_dp_agree.py --device cuda --out "$OUT/dp-agree.json"
step serve_tp_check 180 $PY benchmarks/serve_tp_check.py --out "$OUT/serve-tp.json" --time-budget 165
echo "done $(date -u +%T)" | tee -a "$LOG"
