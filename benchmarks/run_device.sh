#!/usr/bin/env bash
# Everything the device machine should prove in one call: the GPU tests, then the normal-mode benchmarks
# (4 ranks at 24 SMs, 2 ranks, a token sweep) and the per-kernel profile. Logs and JSON go to $OUT.
#
#   TOKENYARD_COMMIT=<hash> bash benchmarks/run_device.sh [tests|bench|low_latency|all]
#
# The device copy of the tree has no git metadata: pass the commit so the JSON records it.
set -uo pipefail
what="${1:-all}"
out="${OUT:-/tmp/tokenyard-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENYARD_CACHE_DIR="${TOKENYARD_CACHE_DIR:-$PWD/.jit_cache}"
num_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout 300 python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -5
fi
if [ "$what" = low_latency ] || [ "$what" = all ]; then
    # The low-latency kernels (on) beside the reference backend over NCCL, as CUDA-graph replays; then the
    # normal mode once more with each rank bound to its GPU's cores and NUMA node (the JSON records it).
    ll="timeout 150 python3 -m tokenyard.bench --quiet --mode low_latency"
    TOKENYARD_LOW_LATENCY_KERNELS=on $ll --json "$out/low_latency.json" 2>&1 | tail -8
    if [ "$num_gpus" -ge 2 ]; then
        TOKENYARD_LOW_LATENCY_KERNELS=on $ll --num_ranks 2 --backends cuda --json "$out/low_latency_2ranks.json" \
            2>&1 | tail -4
    fi
    timeout 150 python3 -m tokenyard.bench --quiet --mode normal --backends cuda --bind --json "$out/bind.json" \
        2>&1 | tail -6
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    bench="timeout 200 python3 -m tokenyard.bench --quiet --num_sms 24"
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
