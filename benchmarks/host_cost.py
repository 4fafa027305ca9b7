"""The Python-side cost of each call of the CUDA backend: argument checks, allocations and launches.

    python benchmarks/host_cost.py [--num_ranks 2] [--iters 200] [--profile] [--json OUT.json] [--cpu]

Per operation, the median host time of a call that returns without waiting for the GPU (a cached-handle
dispatch, a combine, a dispatch with num_worst_tokens, the low-latency calls), measured with
``time.perf_counter`` around the call after the GPU has drained, so the figure is the host's own work and
not a wait. ``--profile`` adds, per operation, the functions where a profiler saw the time go (cProfile,
by own time). DeepSeek-V3 shapes (hidden 7168, top-8 of 256 experts, 4096 / 128 tokens per rank).
``--cpu`` runs the reference backend on gloo ranks instead (a smoke test of the script, small shapes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard


def rank_main(iters: int, profile: bool, num_tokens: int, num_tokens_ll: int, gpu: bool):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    hidden, num_experts, num_topk = (7168, 256, 8) if gpu else (512, 16, 4)

    def drain():
        if gpu:
            torch.cuda.synchronize(device)
            dist.barrier(device_ids=[device.index])
            torch.cuda.synchronize(device)
        else:
            dist.barrier()

    num_nvl_bytes = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_tokens_ll, hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                    backend="cuda" if gpu else "reference",
                    check_inputs=False)
    x, topk_idx, weights = make_rank_inputs(1234, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                            dtype="fp8", device=device)[rank]
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                              num_tokens_per_rank=layout[0],
                                                              is_token_in_rank=layout[3],
                                                              num_tokens_per_expert=layout[2])
    rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).float().to(torch.bfloat16)
    worst = num_tokens * num_ranks
    ll_x, ll_idx, ll_w = make_rank_inputs(99, num_ranks, num_tokens_ll, hidden, num_experts, num_topk,
                                          device=device)[rank]
    ll_handle = buffer.low_latency_dispatch(ll_x, ll_idx, num_tokens_ll, num_experts)[2]
    ll_out = torch.randn(num_experts // num_ranks, num_ranks * num_tokens_ll, hidden,
                         device=device).to(torch.bfloat16)

    ops = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, num_experts),
        "dispatch (cached handle)": lambda: buffer.dispatch(x, handle=handle),
        "dispatch (num_worst_tokens)": lambda: buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], num_worst_tokens=worst),
        "combine": lambda: buffer.combine(rows, handle, topk_weights=recv_w),
        "low_latency_dispatch": lambda: buffer.low_latency_dispatch(ll_x, ll_idx, num_tokens_ll, num_experts),
        "low_latency_combine": lambda: buffer.low_latency_combine(ll_out, ll_idx, ll_w, ll_handle),
    }
    result = {}
    for name, op in ops.items():
        for _ in range(5):
            op()
        times = []
        profiler = cProfile.Profile() if profile else None
        for _ in range(iters):
            drain()
            if profiler:
                profiler.enable()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
            if profiler:
                profiler.disable()
        entry = {"host_us": statistics.median(times) * 1e6}
        if profiler:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats("tokenyard", 16)  # our functions, with what they call
            stats.sort_stats("tottime").print_stats(10)
            entry["profile"] = text.getvalue()
        result[name] = entry
    drain()
    buffer.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--num_tokens", type=int, default=4096)
    parser.add_argument("--num_tokens_low_latency", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    if args.cpu:
        args.num_tokens, args.num_tokens_low_latency = min(args.num_tokens, 64), min(args.num_tokens_low_latency, 16)

    from tokenyard.launch import run_on_ranks

    per_rank = run_on_ranks(args.num_ranks, rank_main, args.iters, args.profile, args.num_tokens,
                            args.num_tokens_low_latency, not args.cpu, use_cuda=not args.cpu)
    print(f"host time per call (median of {args.iters}, the slowest rank), {args.num_ranks} ranks:")
    for name in per_rank[0]:
        print(f"  {name:<30} {max(r[name]['host_us'] for r in per_rank):8.1f} us")
    if args.profile:
        for name, entry in per_rank[0].items():
            print(f"\n=== {name} (rank 0) ===\n{entry['profile']}")
    if args.json:
        from tokenyard.bench.report import git_commit

        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "num_ranks": args.num_ranks, "iters": args.iters,
                       "backend": "reference (gloo)" if args.cpu else "cuda",
                       "num_tokens": args.num_tokens, "num_tokens_low_latency": args.num_tokens_low_latency,
                       "host_us": {n: max(r[n]["host_us"] for r in per_rank) for n in per_rank[0]}}, f, indent=1)


if __name__ == "__main__":
    main()
