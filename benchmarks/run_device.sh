#!/usr/bin/env bash
# What the device machine should prove, a part per call (each fits the 10-minute limit with a warm kernel
# cache): the GPU tests; the low-latency sweep and its phase trace; the normal-mode benchmarks (4 ranks at
# 24 SMs, 2 ranks, a token sweep) and the per-kernel profile; the diagnostics (Python-side cost per call,
# ways of writing to the peers). Logs and JSON go to $OUT.
#
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh [tests|low_latency|bench|diagnostics|tuning|all]
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh [ep8_tests|ep8_bench]
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh one_gpu
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh host_cost
#   TOKENYARD_COMMIT=<hash> TOKENYARD_TEST_NUM_RANKS=2,4 bash benchmarks/run_device.sh shared [pytest args]
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh residency
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh shared_bench
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh faults
#   TOKENYARD_COMMIT=<hash> TOKENYARD_BEFORE=<hash> bash benchmarks/run_device.sh structure_ab
#   TOKENYARD_COMMIT=<hash> TOKENYARD_BEFORE=<hash> bash benchmarks/run_device.sh host_cost_ab
#   TOKENYARD_COMMIT=<hash> [TOKENYARD_BEFORE=<hash>] bash benchmarks/run_device.sh stream_stress
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh [compat [pytest args]|sanitizer [test files]|main_bench|faults_gpus|ll_hooks]
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh [sm_sweep|moe_step]
#   TOKENYARD_COMMIT=<hash> [TOKENYARD_BEFORE=<hash>] [TOKENYARD_TUNING_VARIANTS=...] bash benchmarks/run_device.sh proxy
#   TOKENYARD_COMMIT=<hash> [TOKENYARD_TUNING_VARIANTS=...] bash benchmarks/run_device.sh proxy_phases
#
# `ep8_tests` and `ep8_bench` (issue 8, on nvidia-h200-x8, a call each) run the GPU tests, and the normal-mode
# benchmark, the low-latency sweep and phases and the bounded buffers, at 8 ranks (JSON: *_ep8.json).
#
# `host_cost` runs benchmarks/host_cost.py (the host's time per call, at 128-8192 tokens) at one rank per GPU.
#
# `one_gpu` (on nvidia-h100-x1 or nvidia-h200, where the multi-GPU tests skip) runs tests/gpu/test_one_gpu.py
# and the README's benchmark command at one rank: every kernel compiled and loaded on that GPU, the own-rank
# paths against the reference backend.
#
# `shared` (on any machine, one GPU included) runs tests/gpu at each rank count of TOKENYARD_TEST_NUM_RANKS
# (default 2,4,8), the ranks spread evenly over the GPUs there are, several per GPU under MPS: it starts the
# MPS daemon with pipe and log folders of its own under /tmp and stops it at the end (NOTE [shared GPUs] in
# tokenyard/plan/devices.py). Extra arguments go to pytest (say, -k to run part of the suite in one call). Logs:
# shared_gpu_<ranks>.log; benchmarks/shared_gpu.py turns them into shared_gpu.json. `residency` (under MPS
# too) measures which grids of ranks sharing a GPU are resident together (benchmarks/mps_residency.py);
# `shared_bench` runs the benchmark at 2 and 4 ranks on the GPUs there are (times only where they share).
#
# `faults` (under MPS, issue 23) runs tests/gpu/test_faults.py at 4 ranks on the GPUs there are, then records
# the same scenarios on the CUDA backend (benchmarks/faults.py: faults_cuda.json).
#
# `tuning` (not part of `all`) times the normal-mode kernels at the defaults and their neighbours
# (TOKENYARD_TUNING), to choose heuristics.py's defaults.
#
# `sm_sweep` (issue 50's record, on 4 GPUs) runs the normal-mode kernels at 4-32 SMs beside the copy limit and NCCL
# (normal_sm.json, normal_sm.png; `python -m tokenyard.tools.bench --mode compare_sm`); `moe_step` (issue 52's) the
# MoE layer step on the GPUs there are (moe_step.json, moe_step.png; benchmarks/moe_step.py).
#
# `proxy` (one GPU, between 4-GPU sessions) runs the normal-mode kernels at TOKENYARD_SM_COUNTS (default 8,24) with
# TOKENYARD_PROXY_RANKS ranks (default 4) sharing the GPU under MPS: the peers' buffers are then the same GPU's
# memory, so it shows what the SMs issue, not the links (at 4 ranks and 8 SMs its cached dispatch and combine came
# within 10% of 4 x H200's: benchmarks/results/normal_tuning.md). TOKENYARD_BEFORE's tree first (in_tree), then the
# defaults and each TOKENYARD_TUNING_VARIANTS entry (default: the candidates, below), per rank count;
# benchmarks/tuning_table.py prints them (proxy*.json). `proxy_phases` runs benchmarks/normal_phases.py the same way
# (TOKENYARD_SM_COUNTS default 8), at the defaults and each variant (phases_*.json; benchmarks/phases_table.py prints
# them).
#
# The candidates, which `tuning`, `proxy` and `proxy_phases` try when TOKENYARD_TUNING_VARIANTS is not given: the
# neighbours of the 4-rank block shapes (NOTE [block shapes by ranks] in heuristics.py), more sending warps in a
# dispatch block and wider combine blocks (NOTE [combine block width]); on 4 GPUs none was faster than the defaults
# (benchmarks/results/normal_tuning.md, "Block shapes on 4 GPUs"), so they stay the neighbours a kernel change
# is checked against.
#
# The device copy of the tree has no git metadata: pass the commit so the JSON records it. Carry the
# kernel cache (.jit_cache) with the call and bring back $out/jit_cache.tgz: a header change recompiles
# every kernel that includes it, minutes of device time.
set -uo pipefail
what="${1:-all}"
out="${OUT:-/tmp/tokenyard-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENYARD_CACHE_DIR="${TOKENYARD_CACHE_DIR:-$PWD/.jit_cache}"
num_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

start_mps() {
    # Private folders: only this script's processes (and their children) become MPS clients.
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/tokenyard-mps-pipe.XXXXXX)
    CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/tokenyard-mps-log.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    PATH="$PATH:/usr/local/nvidia/bin" nvidia-cuda-mps-control -d && echo "MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY)"
    trap stop_mps EXIT
}
stop_mps() {
    echo quit | PATH="$PATH:/usr/local/nvidia/bin" nvidia-cuda-mps-control
    cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$out/mps_control.log" 2>/dev/null || true
}

CANDIDATES="dispatch_threads=512 dispatch_threads=1024 combine_send_warps=3 combine_send_warps=5
            dispatch_send_warps=16 dispatch_send_warps=20 combine_threads=1024,combine_reduce_loads=8
            combine_threads=1024,combine_reduce_loads=8,combine_send_warps=6"

in_tree() {
    # in_tree before|after CMD...: CMD in that side's tree of an A/B, recording its commit. The earlier tree
    # (TOKENYARD_BEFORE's) travels ignored, as _before/ (carry it): git archive "$TOKENYARD_BEFORE" | tar x -C _before.
    local side=$1
    shift
    ( if [ "$side" = before ]; then cd _before || exit 1; export TOKENYARD_COMMIT="$TOKENYARD_BEFORE"; fi; "$@" )
}
structure_bench() {  # structure_bench SIDE RUN, in_tree's CMD: trees older than item 8's layout name it tokenyard.bench
    local module=tokenyard.bench
    [ -d tokenyard/tools/bench ] && module=tokenyard.tools.bench
    timeout 240 python3 -m $module --quiet --backends cuda --json "$out/ab_$1_$2.json" 2>&1 | tail -3
}
compare_variants() {  # compare_variants PREFIX [bench args]: compare_sm before (TOKENYARD_BEFORE), defaults, variants
    local prefix=$1
    shift
    local compare="python3 -m tokenyard.tools.bench --quiet --mode compare_sm --backends cuda $*"
    if [ -n "${TOKENYARD_BEFORE:-}" ]; then
        in_tree before timeout 150 $compare --json "$out/${prefix}_before.json" > "$out/${prefix}_before.log" 2>&1
    fi
    timeout 150 $compare --json "$out/${prefix}_defaults.json" > "$out/${prefix}_defaults.log" 2>&1
    for tuning in ${TOKENYARD_TUNING_VARIANTS:-$CANDIDATES}; do
        TOKENYARD_TUNING="$tuning" timeout 150 $compare --json "$out/${prefix}_${tuning//[=,]/_}.json" \
            > "$out/${prefix}_${tuning//[=,]/_}.log" 2>&1
    done
}
host_cost_run() {  # host_cost_run SIDE RUN, in_tree's CMD
    timeout 150 python3 benchmarks/host_cost.py --json "$out/host_cost_$1_$2.json" > "$out/host_cost_$1_$2.log" 2>&1
    grep -v Warn "$out/host_cost_$1_$2.log" | head -8
}

if [ "$what" = shared_bench ]; then
    # The benchmark with ranks sharing the GPUs: times only, labelled shared, no bandwidth.
    start_mps
    for ranks in 2 4; do
        timeout 200 python3 -m tokenyard.tools.bench --quiet --num_ranks $ranks \
            --json "$out/bench_shared_${ranks}.json" 2>&1 | grep -v Warn | tail -16
    done
fi
if [ "$what" = faults ]; then
    start_mps
    TOKENYARD_TEST_NUM_RANKS=4 timeout 300 python3 -m pytest -v tests/gpu/test_faults.py -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_tests_faults.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -20
    timeout 240 python3 benchmarks/faults.py --backend cuda --json "$out/faults_cuda.json" 2>&1 | grep -v Warn | tail -12
fi
if [ "$what" = residency ]; then
    start_mps
    timeout 400 python3 benchmarks/mps_residency.py --json "$out/mps_residency.json" 2>&1 | grep -v Warn | tail -12
fi
if [ "$what" = shared ]; then
    shift
    start_mps
    IFS=, read -ra counts <<< "${TOKENYARD_TEST_NUM_RANKS:-2,4,8}"
    for ranks in "${counts[@]}"; do
        log="$out/shared_gpu_${ranks}.log"
        echo "== $ranks ranks on $num_gpus GPU(s)"
        { echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"; echo "num_gpus: $num_gpus"
          echo "num_ranks: $ranks"; echo "commit: ${TOKENYARD_COMMIT:-}"; echo "date: $(date -u +%FT%TZ)"
          echo "pytest args: $*"; } > "$log"
        TOKENYARD_TEST_NUM_RANKS=$ranks timeout "${TOKENYARD_SHARED_TIMEOUT_S:-560}" python3 -m pytest -v tests/gpu \
            -p no:cacheprovider "$@" 2>&1 | tee -a "$log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -30
    done
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout 540 python3 -m pytest -q tests/gpu -p no:cacheprovider --durations=0 2>&1 | tee "$out/gpu_tests.log" | tail -5
fi
if [ "$what" = low_latency ] || [ "$what" = all ]; then
    # The low-latency kernels beside the reference backend over NCCL, as CUDA-graph replays, 1-256 tokens
    # (and 2 ranks at 128), then where the 128-token kernels spend their time.
    two_ranks=""
    [ "$num_gpus" -gt 2 ] && two_ranks="--two_ranks"
    timeout 330 python3 benchmarks/low_latency.py $two_ranks --json "$out/low_latency.json" 2>&1 | tail -8
    timeout 100 python3 benchmarks/ll_phases.py --tokens 1,128 --iters 20 --json "$out/low_latency_phases.json" \
        2>&1 | tail -42
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    bench="timeout 200 python3 -m tokenyard.tools.bench --quiet --num_sms 24"
    $bench --mode all --json "$out/normal.json" --plot "$out/normal.png" 2>&1 | tail -16
    if [ "$num_gpus" -ge 2 ]; then
        $bench --mode normal --num_ranks 2 --backends cuda --json "$out/normal_2ranks.json" 2>&1 | tail -6
    fi
    for tokens in 512 1024 2048 8192; do
        $bench --mode normal --num_tokens "$tokens" --backends cuda --json "$out/normal_${tokens}.json" 2>&1 | tail -6
    done
    timeout 120 python3 benchmarks/profile_normal.py --sms 24 2>&1 | grep -v "^frame\|^#" | tee "$out/profile.log" \
        | tail -40
fi
if [ "$what" = diagnostics ] || [ "$what" = all ]; then
    timeout 90 python3 benchmarks/host_cost.py --num_ranks 2 --json "$out/host_cost_2ranks.json" \
        > "$out/host_cost_2ranks.log" 2>&1
    head -8 "$out/host_cost_2ranks.log"
    timeout 150 python3 benchmarks/copy_patterns.py --json "$out/copy_patterns.json" 2>&1 | tail -12
fi
if [ "$what" = ep8_tests ]; then
    # About 480 s on 8 H200s with the kernels compiled in the same call.
    TOKENYARD_TEST_NUM_RANKS=8 timeout 560 python3 -m pytest -v tests/gpu -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_tests_ep8.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -20
fi
if [ "$what" = ep8_bench ]; then
    timeout 220 python3 -m tokenyard.tools.bench --quiet --num_sms 24 --num_ranks 8 --mode all \
        --json "$out/normal_ep8.json" --plot "$out/normal_ep8.png" 2>&1 | tail -16
    timeout 200 python3 benchmarks/low_latency.py --num_ranks 8 --json "$out/low_latency_ep8.json" 2>&1 | tail -8
    timeout 60 python3 benchmarks/ll_phases.py --num_ranks 8 --tokens 128 --iters 20 \
        --json "$out/low_latency_phases_ep8.json" 2>&1 | tail -24
    timeout 100 python3 benchmarks/bounded.py --num_ranks 8 --json "$out/bounded_ep8.json" 2>&1 | tail -10
fi
if [ "$what" = tuning ]; then
    # The normal-mode kernels at 8 and 24 SMs, at the defaults and at each TOKENYARD_TUNING variant (default: the
    # candidates); with TOKENYARD_BEFORE, the kernels of that commit first (in_tree). benchmarks/tuning_table.py
    # prints one table of them.
    compare_variants tuning --sm_counts 8,24
    python3 benchmarks/tuning_table.py "$out"/tuning_*.json
fi
if [ "$what" = host_cost ]; then
    # Issue 24's figures: one rank per GPU there is (one on nvidia-h100-x1).
    timeout 240 python3 benchmarks/host_cost.py --json "$out/host_cost.json" > "$out/host_cost.log" 2>&1
    grep -v Warn "$out/host_cost.log" | head -14
    # The same in the debug mode that also checks values on the host (TOKENYARD_CHECK_INPUTS=1).
    TOKENYARD_CHECK_INPUTS=1 timeout 200 python3 benchmarks/host_cost.py --json "$out/host_cost_checked.json" \
        > "$out/host_cost_checked.log" 2>&1
    grep -v Warn "$out/host_cost_checked.log" | head -14
fi
if [ "$what" = host_cost_ab ]; then
    # Issue 24: benchmarks/host_cost.py in the tree of TOKENYARD_BEFORE and in this one (in_tree), alternately,
    # TOKENYARD_AB_RUNS times (default 2), on this machine; benchmarks/host_cost_ab.py merges them. Both sides run
    # this tree's harness.
    cp benchmarks/host_cost.py _before/benchmarks/host_cost.py
    for i in $(seq "${TOKENYARD_AB_RUNS:-2}"); do
        for side in before after; do
            in_tree $side host_cost_run $side $i
        done
    done
    python3 benchmarks/host_cost_ab.py --json "$out/host_cost_ab.json" --before "$out"/host_cost_before_*.json \
        --after "$out"/host_cost_after_*.json
fi
if [ "$what" = stream_stress ]; then
    # Issue 56: benchmarks/stream_stress.py in the tree of TOKENYARD_BEFORE (with this tree's run copied in) and in
    # this one, TOKENYARD_STRESS_SEEDS seeds (default 2) at each of TOKENYARD_STRESS_RANKS (default 2 4).
    stress_run() {  # stress_run SIDE, in_tree's CMD
        timeout "${TOKENYARD_STRESS_TIMEOUT_S:-200}" python3 benchmarks/stream_stress.py \
            --ranks ${TOKENYARD_STRESS_RANKS:-2 4} --seeds "${TOKENYARD_STRESS_SEEDS:-2}" \
            --json "$out/stream_stress_$1.json" 2>&1 | grep -v Warn | tee "$out/stream_stress_$1.log" | tail -8
    }
    if [ -n "${TOKENYARD_BEFORE:-}" ]; then
        cp tests/gpu/stream_stress.py _before/tests/gpu/ && cp benchmarks/stream_stress.py _before/benchmarks/
        in_tree before stress_run before
    fi
    in_tree after stress_run after
fi
if [ "$what" = compat ]; then
    # Issue 47: DeepEP programs' habits (torch's default device and dtype, hooks, contiguity, profiler names) at 4
    # ranks on the GPUs there are (compat_4ranks.log); the defaults and profiler tests hold their own Buffers of 2
    # virtual nodes x 2 (ranks_per_node), so the internode cases run in the same call. Extra arguments go to pytest.
    shift
    TOKENYARD_TEST_NUM_RANKS=4 timeout "${TOKENYARD_COMPAT_TIMEOUT_S:-240}" python3 -m pytest -v -p no:cacheprovider \
        tests/gpu/test_torch_defaults_cuda.py tests/gpu/test_profiler_names.py tests/gpu/test_elastic_cuda.py \
        tests/gpu/test_low_latency_cuda.py tests/gpu/test_fast_paths.py tests/gpu/test_compile.py "$@" 2>&1 \
        | tee "$out/compat_4ranks.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -30
fi
if [ "$what" = sanitizer ]; then
    # Issue 56: PyTorch's CUDA sanitizer (CSAN) over GPU test files at 2 ranks, or at TOKENYARD_TEST_NUM_RANKS
    # (sanitizer.log; on one GPU under MPS, which changes nothing CSAN sees: the streams and events of each
    # process): the arguments, else the stream-heavy ones. It sees torch's own kernels and stream waits only: the kernels and waits tokenyard makes
    # through the driver are invisible to it (benchmarks/results/stream_stress.md). First a canary, a read on a side
    # stream that waits for nothing, which CSAN must report: without that report the run proves nothing.
    shift
    files=("$@")
    [ ${#files[@]} -eq 0 ] && files=(tests/gpu/test_elastic_cuda.py tests/gpu/test_normal_cuda.py)
    [ "$num_gpus" -lt 2 ] && start_mps  # one GPU: the 2 ranks share it
    TORCH_CUDA_SANITIZER=1 python3 -c "
import torch
a = torch.rand(1 << 20, device='cuda')
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    b = a * 2
torch.cuda.synchronize()" > "$out/sanitizer_canary.log" 2>&1 \
        && echo "CSAN canary: NO report (the sanitizer is not active)" \
        || echo "CSAN canary: reported ($(grep -m1 -o 'CSAN detected a possible data race[^.]*' "$out/sanitizer_canary.log"))"
    TORCH_CUDA_SANITIZER=1 TOKENYARD_TEST_NUM_RANKS="${TOKENYARD_TEST_NUM_RANKS:-2}" \
        timeout "${TOKENYARD_SANITIZER_TIMEOUT_S:-90}" python3 -m pytest \
        -v -p no:cacheprovider "${files[@]}" 2>&1 \
        | tee "$out/sanitizer.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|CSAN|race" | tail -20
fi
if [ "$what" = main_bench ]; then
    # Issue 55: the README's main command as a user runs it on the GPUs there are (bench_main.txt, .json, .png).
    timeout "${TOKENYARD_BENCH_TIMEOUT_S:-300}" python3 -m tokenyard.tools.bench --quiet --json "$out/bench_main.json" --plot "$out/bench_main.png" \
        2>&1 | grep -v Warn | tee "$out/bench_main.txt"
fi
if [ "$what" = faults_gpus ]; then
    # Issue 48: every fault scenario on the CUDA backend, one rank per GPU over NCCL, on one node and on 2 virtual
    # nodes x 2, into faults_gpus.json (benchmarks/faults.py --gpus_json; a copy of the record is updated in place).
    cp benchmarks/results/faults_gpus.json "$out/faults_gpus.json" 2>/dev/null || true
    for per_node in ${TOKENYARD_FAULT_NODES:-0 2}; do
        TOKENYARD_RANKS_PER_NODE=$per_node timeout 270 python3 benchmarks/faults.py --cuda_ranks 4 \
            --gpus_json "$out/faults_gpus.json" 2>&1 | grep -v Warn | tee -a "$out/faults_gpus.log" | cut -c1-160
    done
fi
if [ "$what" = structure_ab ]; then
    # Issue 22: the README's benchmark (CUDA backend only) at one rank, twice in the tree of TOKENYARD_BEFORE and
    # twice in this one (in_tree), on this machine; benchmarks/structure_ab.py merges them into structure_ab.json.
    for side in before after; do
        for i in 1 2; do
            in_tree $side structure_bench $side $i
        done
    done
    python3 benchmarks/structure_ab.py --before-commit "$TOKENYARD_BEFORE" --after-commit "$TOKENYARD_COMMIT" \
        --json "$out/structure_ab.json" --before "$out"/ab_before_*.json --after "$out"/ab_after_*.json
fi
if [ "$what" = one_gpu ]; then
    timeout 420 python3 -m pytest -v tests/gpu/test_one_gpu.py -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_tests_one_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -20
    # Two ranks on one GPU without MPS (this part starts no daemon): the CUDA backend must refuse, naming MPS.
    [ "$num_gpus" -eq 1 ] && TOKENYARD_TEST_NUM_RANKS=2 timeout 120 python3 -m pytest -v tests/gpu/test_process_groups.py \
        -k mps -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_without_mps.log" | grep -E "PASSED|FAILED|passed|failed|Error"
    timeout 150 python3 -m tokenyard.tools.bench --quiet --json "$out/bench_one_gpu.json" 2>&1 | tail -16
fi
if [ "$what" = ll_hooks ]; then
    # Issue 51: the low-latency GPU tests at TOKENYARD_TEST_NUM_RANKS (default 4), then the kernels timed DeepEP's
    # way per rank (benchmarks/ll_kineto.py: ll_kineto.json, and ll_kineto_before.json in TOKENYARD_BEFORE's tree
    # where given), then the CUDA-graph replays beside the reference backend over NCCL at 128 tokens (low_latency.json).
    TOKENYARD_TEST_NUM_RANKS=${TOKENYARD_TEST_NUM_RANKS:-4} timeout "${TOKENYARD_LL_TESTS_TIMEOUT_S:-300}" \
        python3 -m pytest -v tests/gpu/test_low_latency_cuda.py -p no:cacheprovider 2>&1 | tee "$out/ll_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|^E " | cut -c1-300 | tail -30
    timeout 150 python3 benchmarks/ll_kineto.py --json "$out/ll_kineto.json" 2>&1 | grep -v Warn | tail -6
    if [ -n "${TOKENYARD_BEFORE:-}" ]; then
        cp benchmarks/ll_kineto.py _before/benchmarks/
        in_tree before timeout 150 python3 benchmarks/ll_kineto.py --json "$out/ll_kineto_before.json" 2>&1 \
            | grep -v Warn | tail -6
        in_tree before timeout 200 python3 benchmarks/low_latency.py --tokens 128 --json "$out/low_latency_before.json" \
            2>&1 | tail -2
    fi
    timeout 200 python3 benchmarks/low_latency.py --tokens 128 --json "$out/low_latency.json" 2>&1 | tail -2
fi
if [ "$what" = proxy ]; then
    start_mps
    for ranks in ${TOKENYARD_PROXY_RANKS:-4}; do
        compare_variants "proxy$ranks" --num_ranks "$ranks" --sm_counts "${TOKENYARD_SM_COUNTS:-8,24}"
    done
    python3 benchmarks/tuning_table.py "$out"/proxy*.json
fi
if [ "$what" = proxy_phases ]; then
    # Where the warps' time goes (benchmarks/normal_phases.py) at the defaults and each variant, ranks sharing the GPU
    # as in `proxy`: a change to the senders shows in their phases even where the receivers or reducers set the
    # kernel's time, as they do in the proxy at 8 SMs (benchmarks/results/normal_tuning.md).
    start_mps
    for tuning in defaults ${TOKENYARD_TUNING_VARIANTS:-$CANDIDATES}; do
        [ "$tuning" = defaults ] && variant="" || variant="$tuning"
        TOKENYARD_TUNING="$variant" timeout 100 python3 benchmarks/normal_phases.py \
            --num_ranks "${TOKENYARD_PROXY_RANKS:-4}" --sm_counts "${TOKENYARD_SM_COUNTS:-8}" \
            --json "$out/phases_${tuning//[=,]/_}.json" > "$out/phases_${tuning//[=,]/_}.log" 2>&1
    done
    python3 benchmarks/phases_table.py "$out"/phases_*.json
fi
if [ "$what" = sm_sweep ]; then
    timeout "${TOKENYARD_SWEEP_TIMEOUT_S:-500}" python3 -m tokenyard.tools.bench --quiet --mode compare_sm --backends cuda \
        --sm_counts "${TOKENYARD_SM_COUNTS:-4,6,8,12,16,24,32}" --json "$out/normal_sm.json" --plot "$out/normal_sm.png" \
        2>&1 | grep -v Warn | tee "$out/normal_sm.txt" | tail -40
fi
if [ "$what" = moe_step ]; then
    timeout "${TOKENYARD_MOE_TIMEOUT_S:-400}" python3 benchmarks/moe_step.py --num_ranks "$num_gpus" \
        --json "$out/moe_step.json" --plot "$out/moe_step.png" 2>&1 | grep -v Warn | tee "$out/moe_step.txt" | tail -30
fi
tar czf "$out/jit_cache.tgz" "${TOKENYARD_CACHE_DIR#$PWD/}" 2>/dev/null || true
