"""Where a low-latency call spends its time: per-phase GPU timestamps of the CUDA kernels.

    python benchmarks/ll_phases.py [--tokens 1,128] [--num_ranks 4] [--iters 30] [--hook] [--json OUT.json]

Every block of a traced launch stamps the GPU's global timer at the points of NOTE [low-latency trace]
(include/tokenyard/sync.cuh). Per call this prints, for each point, when the first and the
last block passed it, in microseconds after the first block started (medians over `iters` calls, ranks
started together as in NOTE [aligned start]); the "end" row's last column is the kernel's span on the GPU.
With --hook each call returns a recv hook (return_recv_hook=True): the send launch and the receive launch are
traced apart (`dispatch_send`, `dispatch_recv`, ...), the hook called once the send has ended.
A diagnostic for finding fixed costs, not a figure for the results table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

POINTS = ("start", "prologue", "sent", "counted", "published", "recv_ready", "recv_mid", "end")


def phases(stamps) -> dict:
    """One launch's stamps [blocks, points] (0 = not passed) -> {point: (first_us, last_us)} after the start."""
    t0 = min(int(s[0]) for s in stamps if s[0])
    out = {}
    for i, name in enumerate(POINTS):
        seen = [int(s[i]) - t0 for s in stamps if s[i]]
        if seen:
            out[name] = (min(seen) / 1e3, max(seen) / 1e3)
    return out


def rank_main(num_tokens: int, hidden: int, num_experts: int, num_topk: int, iters: int, hook: bool = False):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.bench.timing import ALIGN_SLEEP_CYCLES
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True, backend="cuda", check_inputs=False)
    kernels = buffer._backend()._low_latency_impl()
    if kernels is None:
        raise RuntimeError("the CUDA low-latency kernels are off (TOKENYARD_LOW_LATENCY_KERNELS)")
    trace = kernels.start_trace()
    num_local_experts = num_experts // num_ranks
    expert_out = torch.randn(num_local_experts, num_ranks * num_tokens, hidden, device=device).to(torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    together = torch.ones(1, device=device)
    ops = ("dispatch", "combine")
    records = {f"{op}_{part}": [] for op in ops for part in ("send", "recv")} if hook else {op: [] for op in ops}
    # Every call's inputs first: the host making them between calls would leave the GPU idle (and its clocks
    # low) right before each call.
    calls = [make_rank_inputs(it * 7919 + 1, num_ranks, num_tokens, hidden, num_experts, num_topk)[rank]
             for it in range(iters + 3)]
    calls = [tuple(t.to(device) for t in inputs) for inputs in calls]
    for it, (x, topk_idx, weights) in enumerate(calls):
        handle = None
        for kind, op in enumerate(ops):
            trace.zero_()
            flush.bitwise_not_()
            dist.barrier(device_ids=[device.index])
            torch.cuda._sleep(ALIGN_SLEEP_CYCLES)
            dist.all_reduce(together)
            if op == "dispatch":
                out = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=True,
                                                  return_recv_hook=hook)
                handle = out[2]
            else:
                out = buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=hook)
            torch.cuda.synchronize(device)
            if hook:
                if it >= 3:
                    records[f"{op}_send"].append(phases(trace[kind].cpu().tolist()))
                trace.zero_()
                out[-1]()
                torch.cuda.synchronize(device)
            if it >= 3:
                records[f"{op}_recv" if hook else op].append(phases(trace[kind].cpu().tolist()))
    buffer.destroy()
    summary = {}
    for op, calls in records.items():
        summary[op] = {name: [statistics.median(c[name][j] for c in calls if name in c) for j in (0, 1)]
                       for name in POINTS if any(name in c for c in calls)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--num_ranks", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num_experts", type=int, default=256)
    parser.add_argument("--num_topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--hook", action="store_true", help="trace each call's send and receive launches apart")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    from tokenyard.tools.launch import run_on_ranks

    num_ranks = args.num_ranks or torch.cuda.device_count()
    result = {}
    for num_tokens in map(int, args.tokens.split(",")):
        per_rank = run_on_ranks(num_ranks, rank_main, num_tokens, args.hidden, args.num_experts, args.num_topk,
                                args.iters, args.hook, use_cuda=True)
        result[num_tokens] = per_rank
        for op in per_rank[0]:
            print(f"\n{num_ranks} ranks, {num_tokens} tokens, {op}: first/last block past each point, us")
            print(f"{'point':>11} " + " ".join(f"{'rank ' + str(r):>13}" for r in range(num_ranks)))
            for name in POINTS:
                cells = [per_rank[r][op].get(name) for r in range(num_ranks)]
                print(f"{name:>11} " + " ".join(f"{c[0]:6.1f}/{c[1]:6.1f}" if c else f"{'-':>13}" for c in cells))
    if args.json:
        import datetime

        from tokenyard.tools.bench.report import git_commit

        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": f"{torch.cuda.get_device_name()} x {num_ranks}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "num_ranks": num_ranks, "hidden": args.hidden, "num_experts": args.num_experts,
                       "num_topk": args.num_topk, "iters": args.iters, "points": POINTS, "by_tokens": result}, f,
                      indent=1)


if __name__ == "__main__":
    main()
