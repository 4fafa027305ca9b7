"""Low-latency kernels timed DeepEP's way, per rank: the plain kernels and, with recv hooks, each send and receive.

    python benchmarks/ll_kineto.py [--num_ranks 4] [--tokens 128] [--iters 20] [--json OUT.json]

DeepEP's tests/test_low_latency.py times its kernels with the profiler (bench_kineto with barrier_comm_profiling):
a large matmul and an all-reduce before the calls, and with return_recv_hook a large matmul between each send and
its hook (large_gemm_with_hook), so that the ranks reach each kernel skewed by their matmuls, as two micro-batches
overlap in SGLang and vLLM. Here every call follows its own matmul and all-reduce. Per rank: the mean and the
longest GPU time of each kernel over `--iters` calls, from the profiler's trace (a hook call's launches alternate
send, receive). The setting: DeepSeek-V3 decode (hidden 7168, top-8 of 256 experts), FP8 dispatch, bf16 combine.
Issue 51 asks that no send wait for a peer (NOTE [deferred rows] in kernels/low_latency_combine.cuh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8
MATMUL = 8192  # DeepEP's large_gemm_with_hook: float32 [8192, 8192] @ [8192, 8192]


def _kernel_times(prof, words) -> dict:
    """{word: the GPU times (us) of the trace's kernels whose names contain "::word", in launch order}."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return {word: [float(e["dur"]) for e in kernels if f"::{word}" in e.get("name", "")] for word in words}


def _summary(times: list) -> dict:
    return {"mean": round(sum(times) / len(times), 2), "max": round(max(times), 2)}


def _measure(num_tokens: int, iters: int) -> dict:
    import torch.distributed as dist

    from tokenyard import Buffer

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device).manual_seed(rank)
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, HIDDEN, num_ranks, NUM_EXPERTS)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda")
    buffer.runtime.use_low_latency_kernels = True
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen, device=device, dtype=torch.float32)
    topk_idx = torch.topk(scores, NUM_TOPK, dim=1).indices.to(torch.int64)
    weights = torch.rand(num_tokens, NUM_TOPK, generator=gen, device=device, dtype=torch.float32) + 0.1
    # The experts' outputs: random rows where the dispatch put tokens (DeepEP's simulated GEMM output).
    y = torch.randn(NUM_EXPERTS // num_ranks, num_ranks * num_tokens, HIDDEN, generator=gen, device=device,
                    dtype=torch.float32).to(torch.bfloat16)
    lhs, rhs = (torch.randn(MATMUL, MATMUL, generator=gen, device=device, dtype=torch.float32) for _ in range(2))
    one = torch.ones(1, device=device, dtype=torch.float32)

    def call(hook: bool) -> None:
        _, _, handle, _, receive = buffer.low_latency_dispatch(x, topk_idx, num_tokens, NUM_EXPERTS, use_fp8=True,
                                                               return_recv_hook=hook)
        if hook:
            lhs @ rhs
            receive()
        _, _, receive = buffer.low_latency_combine(y, topk_idx, weights, handle, return_recv_hook=hook)
        if hook:
            lhs @ rhs
            receive()

    result = {"rank": rank}
    for hook in (False, True):
        call(hook)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                lhs @ rhs
                dist.all_reduce(one)
                call(hook)
            torch.cuda.synchronize()
        for word, times in _kernel_times(prof, ("dispatch", "combine")).items():
            assert len(times) == iters * (2 if hook else 1), f"{len(times)} '::{word}' kernels in the trace"
            if hook:
                result[f"{word}_send"], result[f"{word}_recv"] = _summary(times[0::2]), _summary(times[1::2])
            else:
                result[word] = _summary(times)
    buffer.runtime.check_failures()
    buffer.destroy()
    return result


def measure(num_ranks: int, num_tokens: int, iters: int) -> dict:
    """The record (benchmarks/results/low_latency.json's keys under tokenyard): per rank, the plain kernels and the
    hook mode's sends and receives, each {"mean", "max"} in us."""
    from tokenyard.tools.launch import run_on_ranks

    ranks = run_on_ranks(num_ranks, _measure, num_tokens, iters, use_cuda=True, timeout_s=600)
    return {"method": "DeepEP's (bench_kineto, barrier_comm_profiling, large_gemm_with_hook): profiler GPU time per "
                      f"kernel, each call after a {MATMUL}^2 float32 matmul and an all-reduce, a matmul between each "
                      f"send and its hook; mean and max over {iters} calls per rank",
            "kineto_us_per_rank": [{"rank": r["rank"], "dispatch": r["dispatch"], "combine": r["combine"]}
                                   for r in ranks],
            "hook_send_us_per_rank": [{"rank": r["rank"], "dispatch": r["dispatch_send"],
                                       "combine": r["combine_send"]} for r in ranks],
            "hook_recv_us_per_rank": [{"rank": r["rank"], "dispatch": r["dispatch_recv"],
                                       "combine": r["combine_recv"]} for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from tokenyard.tools.launch import disable_nvlink_multicast

    disable_nvlink_multicast()
    record = measure(args.num_ranks or torch.cuda.device_count(), args.tokens, args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    print(f"{'rank':>4} {'dispatch':>9} {'combine':>9} {'d send':>9} {'d recv':>9} {'c send':>9} {'c recv':>9}  "
          "(us, mean / max)")
    rows = zip(record["kineto_us_per_rank"], record["hook_send_us_per_rank"], record["hook_recv_us_per_rank"])
    for plain, send, recv in rows:
        cells = [plain["dispatch"], plain["combine"], send["dispatch"], recv["dispatch"], send["combine"],
                 recv["combine"]]
        print(f"{plain['rank']:>4} " + " ".join(f"{c['mean']:>4.1f}/{c['max']:<4.0f}" for c in cells))


if __name__ == "__main__":
    main()
