#!/usr/bin/env bash
# One GPU machine's share of a round's measurements, in one command that fits a ten-minute call.
#
#     bash benchmarks/gpu_round.sh OUT LANE [LANE...]
#
# Each LANE is a GPU list and a comma-separated list of steps, `GPUS:step,step,...` (`0:suite`,
# `1:sanitizer,inplace`, `0,1:multi_tests,tp_channel`). Lanes run at the same time, each on its own GPUs
# (CUDA_VISIBLE_DEVICES); the steps of a lane run one after another, each under its own time limit (a step
# past it is killed and logged, the next one runs). Everything a step writes goes under OUT/r/; at the end
# OUT/round.tar.gz holds it all, with OUT/round.log the summary (two files: a device call brings back few).
#
# Before the steps: the project is installed editable (no network there) and the wheels under .whl/ (those
# the GPU image lacks, e.g. llguidance) into /tmp/site. NVLink multicast stays off (the device notes).
set -u
OUT=${1:?usage: bash benchmarks/gpu_round.sh OUT GPUS:step,step [GPUS:step,...]}
shift
mkdir -p "$OUT/r"
R="$OUT/r"
LOG="$OUT/round.log"
START=$(mktemp)  # what the benchmarks write under benchmarks/results after this is copied under R
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}

{
    date -u
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} >>"$LOG" 2>&1
$PY -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda >>"$LOG" 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

pytest_json() {  # pytest_json NAME LIMIT_PER_TEST ARGS...: a JUnit XML and the durations under R
    local name=$1 per=$2
    shift 2
    # -v: each test's name as it ends, so a step killed at its limit still says where it was
    $PY -m pytest -v -p no:cacheprovider -rfEs --durations=0 --timeout "$per" \
        --junitxml "$R/$name.xml" "$@"
}

run_step() {  # run_step NAME: one step, its limit, its command
    local name=$1 limit cmd
    case $name in
    suite) limit=560 cmd="pytest_json cuda-suite 120 -m 'cuda and not multi_gpu' tests" ;;
    suite_fast) limit=300 cmd="pytest_json cuda-suite-fast 150 -m 'cuda and not multi_gpu and not slow' tests" ;;
    multi_tests) limit=420 cmd="pytest_json multi-gpu 120 -m multi_gpu tests" ;;
    multi_rest) limit=200 cmd="pytest_json multi-rest 120 -m multi_gpu tests/test_tp.py tests/test_tp_channel.py -k 'destroy or fused or symm or worker_on_another'" ;;
    sanitizer) limit=100 cmd="$PY benchmarks/bench_sanitizer.py --out $R/sanitizer.json" ;;
    inplace) limit=180 cmd="$PY benchmarks/bench_inplace_cache.py --out $R/inplace-cache.json --time-budget 160" ;;
    prompt_logprobs) limit=80 cmd="cd benchmarks && PYTHONPATH=..:.:\${PYTHONPATH:-} $PY bench_prompt_logprobs.py --out $R/prompt-logprobs.json" ;;
    structured) limit=180 cmd="PYTHONPATH=.:backends/cuda:\${PYTHONPATH:-} $PY benchmarks/bench_structured.py --gpu" ;;
    submit) limit=90 cmd="$PY benchmarks/bench_submit.py --out $R/submit.json" ;;
    accelerator) limit=90 cmd="$PY benchmarks/bench_accelerator.py --out $R/accelerator.json" ;;
    startup) limit=200 cmd="$PY benchmarks/bench_startup_compile.py --out $R/startup.json --time-budget 170" ;;
    zoo_plain) limit=200 cmd="$PY benchmarks/bench_zoo.py --models plain --layers 8 --time-budget 170 --out $R/zoo-plain.json" ;;
    zoo_gptfast) limit=200 cmd="$PY benchmarks/bench_zoo.py --models gptfast --layers 8 --time-budget 170 --out $R/zoo-gptfast.json" ;;
    zoo_a) limit=300 cmd="$PY benchmarks/bench_zoo.py --models plain,gptfast,paged,hf_llama,hf_qwen3 --layers 4 --batches 1,32 --time-budget 280 --out $R/zoo-a.json" ;;
    zoo_b) limit=300 cmd="$PY benchmarks/bench_zoo.py --models hf_mistral,hf_gemma,hf_phi3,hf_gpt2,hf_mixtral --layers 4 --batches 1,32 --time-budget 280 --out $R/zoo-b.json" ;;
    zoo_c) limit=240 cmd="$PY benchmarks/bench_zoo.py --models paged,hf_llama,hf_qwen3 --layers 4 --batches 1,32 --time-budget 225 --out $R/zoo-c.json" ;;
    zoo_d) limit=240 cmd="$PY benchmarks/bench_zoo.py --models hf_phi3,hf_gpt2,hf_mixtral --layers 4 --batches 1,32 --time-budget 225 --out $R/zoo-d.json" ;;
    startup_regions) limit=150 cmd="$PY benchmarks/bench_startup_compile.py --out $R/startup-regions.json --children cold_regions,warm_regions,reduce_overhead --time-budget 140" ;;
    inplace_chosen) limit=110 cmd="$PY benchmarks/bench_inplace_cache.py --out $R/inplace-chosen.json --variants full,compiled_chosen --time-budget 100" ;;
    two_cuda_fixes) limit=70 cmd="pytest_json two-cuda-fixes 60 tests/test_guard_swap.py::test_cuda_weights_loaded_under_swap_mode_never_replay_stale 'tests/test_sanitizer.py::test_a_workspace_re_made_in_a_module_global_is_named'" ;;
    background) limit=110 cmd="$PY benchmarks/bench_background_capture.py --out $R/background-capture.json --time-budget 95 --repeats 2" ;;
    serve_fixes) limit=200 cmd="pytest_json serve-fixes 120 tests/test_cuda_background.py tests/test_serve_background.py tests/test_serve_sleep.py tests/test_guard_swap.py 'tests/test_sanitizer.py::test_a_workspace_re_made_in_a_module_global_is_named'" ;;
    zoo_all) limit=270 cmd="$PY benchmarks/bench_zoo.py --layers 4 --batches 1,32 --time-budget 250 --out $R/zoo-all.json" ;;
    tp_channel) limit=90 cmd="$PY benchmarks/bench_tp_channel.py --device cuda --out $R/tp-channel.json" ;;
    dp_agree) limit=40 cmd="$PY benchmarks/bench_dp_agree.py --device cuda --iters 2000 --out $R/dp-agree.json" ;;
    serve_tp_full) limit=445 cmd="$PY benchmarks/serve_tp_check.py --out $R/serve-tp.json --time-budget 420" ;;
    serve_tp_nofp32) limit=330 cmd="$PY benchmarks/serve_tp_check.py --out $R/serve-tp.json --time-budget 310 --no-fp32" ;;
    serve_tp_symm) limit=330 cmd="$PY benchmarks/serve_tp_check.py --out $R/serve-tp-symm.json --time-budget 310 --no-fp32 --tp-comm symm" ;;
    step_ops) limit=60 cmd="$PY benchmarks/bench_step_ops.py --device cuda --out $R/step-ops.json" ;;
    serve_host) limit=150 cmd="$PY benchmarks/bench_serve_host.py --device cuda --preset qwen3-0.6b --out $R/serve-host.json" ;;
    tp_comm) limit=70 cmd="$PY benchmarks/bench_tp_comm.py --out $R/tp-comm.json --deadline 60" ;;
    kill_test) limit=100 cmd="pytest_json kill-test 90 -m multi_gpu tests/test_serve_tp.py::test_a_worker_killed_on_two_gpus_fails_the_stream_and_the_server_exits" ;;
    serve_tp) limit=260 cmd="$PY benchmarks/serve_tp_check.py --out $R/serve-tp.json --time-budget 240" ;;
    serve_overlap) limit=120 cmd="$PY benchmarks/bench_serve_overlap.py --gpu --out $R" ;;
    startup_profile) limit=130 cmd="$PY benchmarks/bench_startup_compile.py --out $R/startup-profile.json --children cold_regions,warm_regions --profile --time-budget 120" ;;
    memory_tests) limit=150 cmd="pytest_json memory-tests 120 -m cuda tests/test_message_memory.py tests/test_overlap.py tests/test_tp_channel.py tests/test_engine_step_ops.py" ;;
    serve_tp_8b) limit=570 cmd="$PY benchmarks/serve_tp_check.py --out $R/serve-tp-8b.json --time-budget 550 --no-fp32 --tp-comm symm" ;;
    tp_kernels) limit=100 cmd="$PY benchmarks/bench_tp_comm.py --out $R/tp-kernels.json --no-micro --profile-kernels --deadline 90" ;;
    startup_pyc) limit=330 cmd="PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= $PY -m compileall -q -j 16 \$($PY -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))') >/dev/null 2>&1; PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= $PY benchmarks/bench_startup_compile.py --out $R/startup-pyc.json --children cold_regions,warm_regions,reduce_overhead --time-budget 200" ;;
    startup_pyc_quick) limit=200 cmd="PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= $PY -m compileall -q -j 16 \$($PY -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))') >/dev/null 2>&1; PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= $PY benchmarks/bench_startup_compile.py --out $R/startup-pyc-quick.json --children cold_regions,warm_regions --time-budget 150" ;;
    cuda_new) limit=150 cmd="pytest_json cuda-new 120 -m cuda tests/test_fused.py tests/test_inplace.py::test_on_cuda_the_plain_decoder_compiles_without_cache_copies" ;;
    multi_fused) limit=200 cmd="pytest_json multi-fused 180 -m multi_gpu tests/test_tp.py -k 'fused or symm'" ;;
    tp_kernels_fused) limit=170 cmd="$PY benchmarks/bench_tp_comm.py --out $R/tp-kernels.json --no-micro --profile-kernels --deadline 160" ;;
    serve_small_fused) limit=200 cmd="PYTHONFAULTHANDLER=1 $PY benchmarks/serve_tp_check.py --out $R/serve-tp-small-fused.json --models small --time-budget 180 --no-fp32 --tp-comm symm" ;;
    serve_small_unfused) limit=200 cmd="PYTHONFAULTHANDLER=1 DEVGRAPH_TP_FUSE=0 $PY benchmarks/serve_tp_check.py --out $R/serve-tp-small-unfused.json --models small --time-budget 180 --no-fp32 --tp-comm symm" ;;
    serve_8b_only) limit=300 cmd="PYTHONFAULTHANDLER=1 $PY benchmarks/serve_tp_check.py --out $R/serve-tp-8b.json --models 8b --time-budget 280 --no-fp32 --tp-comm symm" ;;
    serve_8b_switch100) limit=300 cmd="PYTHONFAULTHANDLER=1 $PY benchmarks/serve_tp_check.py --out $R/serve-tp-8b-switch100.json --models 8b --time-budget 280 --no-fp32 --tp-comm symm --serve-flags '--switch-interval-us 100'" ;;
    serve_tp_tests) limit=180 cmd="pytest_json serve-tp-tests 150 -m multi_gpu tests/test_serve_tp.py" ;;
    linear) limit=200 cmd="$PY benchmarks/bench_linear.py --out $R/linear.json --time-budget 170" ;;
    linear_models) limit=150 cmd="$PY benchmarks/bench_linear.py --out $R/linear-models.json --rows 1 --time-budget 130" ;;
    linear_check) limit=150 cmd="pytest_json linear-check 120 -m cuda --tb=long tests/test_sanitizer.py tests/test_triton_linear.py tests/test_fused.py" ;;
    linear_tests) limit=200 cmd="pytest_json linear-tests 120 -m cuda tests/test_triton_linear.py tests/test_fused.py tests/test_reference.py tests/test_kernels.py" ;;
    step_gap) limit=150 cmd="$PY benchmarks/bench_step_ops.py --device cuda --preset qwen3-0.6b --dtype bf16 --batches 1 32 --steps 5 --time-steps 40 --timeline 30 --out $R/step-gap.json" ;;
    step_tests) limit=200 cmd="pytest_json step-tests 120 -m cuda tests/test_triton_argmax.py tests/test_overlap.py tests/test_message_memory.py tests/test_serve_sleep.py tests/test_cuda_background.py tests/test_handle.py tests/test_sanitizer.py" ;;
    argmax) limit=120 cmd="cd benchmarks && PYTHONPATH=..:.:\${PYTHONPATH:-} $PY bench_argmax.py --out $R/argmax.json" ;;
    replay_order) limit=150 cmd="cd benchmarks && PYTHONPATH=..:.:\${PYTHONPATH:-} OUT=$R $PY replay_after_eager.py" ;;
    kernel_builds) limit=120 cmd="pytest_json kernel-builds 100 -m cuda tests/test_kernel_builds.py tests/test_fused.py" ;;
    serve_overlap_ab) limit=220 cmd="$PY benchmarks/bench_serve_overlap.py --gpu --both-deliveries --out $R" ;;
    serve_host_sample) limit=170 cmd="$PY benchmarks/bench_serve_host.py --device cuda --preset qwen3-0.6b --repeats 2 --sample --out $R/serve-host.json" ;;
    _ok) limit=20 cmd="echo fine" ;;        # the script's own check: a step that ends,
    _hang) limit=3 cmd="sleep 60; echo never" ;;  # and one killed at its limit
    *)
        echo "unknown step $name" >>"$LOG"
        return
        ;;
    esac
    echo "=== $name (limit ${limit}s, GPUs $CUDA_VISIBLE_DEVICES) $(date -u +%T)" >>"$LOG"
    local t0=$SECONDS
    # timeout signals its whole process group (the step's children too), then kills what is left.
    timeout --kill-after=10 "$limit" bash -c "$cmd" >"$R/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' (killed at its limit)')" >>"$LOG"
    tail -n 3 "$R/$name.log" >>"$LOG"
}

lane() {  # lane GPUS STEPS
    export CUDA_VISIBLE_DEVICES=$1
    local step
    for step in ${2//,/ }; do
        run_step "$step"
    done
}

export -f pytest_json
export R PY
for spec in "$@"; do
    lane "${spec%%:*}" "${spec#*:}" &
done
wait
find benchmarks/results -newer "$START" -type f -exec cp {} "$R/" \; 2>/dev/null
echo "done $(date -u +%T)" >>"$LOG"
tar -C "$OUT" -czf "$OUT/round.tar.gz" r
cat "$LOG"
