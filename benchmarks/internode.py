"""Internode normal mode on virtual nodes (issue 25): the time per call of the CUDA backend's internode kernels
(NOTE [internode kernels]) and of the reference backend's hierarchical path, on the ranks of this machine seen
as nodes of `--ranks_per_node`. **Not a network figure**: every byte that "crosses a node" here goes through
NVSHMEM's P2P transport on one host (on one GPU, between processes time-sliced under MPS), so the times say what
the kernels cost beside the reference path on the same ranks, nothing about a NIC.

Each call is timed back to back with CUDA events around it, as DeepEP's harness times calls (median over
`--iters`): a fresh dispatch (it waits for the counts on the CPU), a cached dispatch, a combine. The test logs
of tests/gpu/test_internode_cuda.py, given with `--test_logs`, add the runs (nodes, ranks per node, GPUs,
passed, failed) to the JSON.

    python benchmarks/internode.py --num_ranks 4 --ranks_per_node 2 --json out.json --test_logs shared_gpu_*.log
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard


def _rank(args) -> dict:
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, topk_idx, weights = make_rank_inputs(7, num_ranks, args.num_tokens, args.hidden, args.num_experts,
                                            args.num_topk, "uniform", "fp8", device)[rank]
    nvl_bytes = Config(num_max_tokens_per_rank=args.num_tokens).get_nvl_buffer_size_hint(args.hidden * 2, num_ranks)
    results = {}
    for name, rdma_bytes in (("cuda", args.rdma_mib << 20), ("reference", 0)):
        buffer = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend=name, ranks_per_node=args.ranks_per_node,
                        check_inputs=False)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.num_experts)

        def fresh():
            return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                                   num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert)

        recv_x, _, recv_w, _, handle, _ = fresh()
        y = torch.randn(recv_x[0].size(0), args.hidden, device=device).to(torch.bfloat16)
        calls = {"dispatch": fresh, "cached_dispatch": lambda: buffer.dispatch(x, handle=handle),
                 "combine": lambda: buffer.combine(y, handle, topk_weights=recv_w)}
        results[name] = {call: median_us(fn, args.warmup, args.iters) for call, fn in calls.items()}
        results["rows_received"] = int(recv_x[0].size(0))
        buffer.destroy()
    return results


def _runs(logs, num_gpus: int) -> list:
    """{"nodes", "ranks_per_node", "num_gpus", "passed", "failed"} per layout that tests/gpu/test_internode_cuda.py
    ran, from run_device.sh's logs (shared_gpu_<ranks>.log) of this machine (its `num_gpus`)."""
    runs = {}
    for path in logs:
        with open(path) as f:
            text = f.read()
        found = re.findall(r"test_internode_cuda\.py::(\w+)\[(\d+)-(\d+)\] .*?(PASSED|FAILED)", text, re.DOTALL)
        # The virtual-host test names only its ranks: hosts (so nodes) of 2 ranks (TOKENYARD_VIRTUAL_HOSTS=2).
        found += [(test, ranks, "2", verdict) for test, ranks, verdict in re.findall(
            r"test_internode_cuda\.py::(test_virtual_hosts\w+)\[(\d+)\] .*?(PASSED|FAILED)", text, re.DOTALL)]
        for test, ranks, per_node, verdict in found:
            run = runs.setdefault((int(ranks), int(per_node)), {
                "nodes": int(ranks) // int(per_node), "ranks_per_node": int(per_node),
                "num_gpus": min(num_gpus, int(ranks)), "passed": 0, "failed": 0, "tests": []})
            run["passed" if verdict == "PASSED" else "failed"] += 1
            run["tests"].append(f"{test}: {verdict}")
    return [runs[k] for k in sorted(runs)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, num_tokens=1024, warmup=3, iters=10)
    parser.add_argument("--rdma_mib", type=int, default=512, help="num_rdma_bytes of the CUDA Buffer, MiB")
    args = parser.parse_args(argv)

    from tokenyard.tools.launch import run_on_ranks

    per_rank = run_on_ranks(args.num_ranks, _rank, args, use_cuda=True, timeout_s=500.0)
    report(args, per_rank, _runs(args.test_logs, torch.cuda.device_count()),
           "virtual nodes on one host: not a network figure")
    return 0


def median_us(fn, warmup: int, iters: int) -> float:
    """The median time of `fn` (µs), CUDA events around each call, after `warmup` calls."""
    samples = []
    for _ in range(warmup + iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1000)
    return round(statistics.median(samples[warmup:]), 1)


def add_arguments(parser: argparse.ArgumentParser, num_tokens: int, warmup: int, iters: int) -> None:
    """A virtual-node benchmark's arguments: the ranks and their nodes, the problem, the timing, the test logs
    whose runs the JSON records, and the JSON's path."""
    parser.add_argument("--num_ranks", type=int, default=4)
    parser.add_argument("--ranks_per_node", type=int, default=2)
    parser.add_argument("--num_tokens", type=int, default=num_tokens)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num_experts", type=int, default=256)
    parser.add_argument("--num_topk", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--test_logs", nargs="*", default=[])
    parser.add_argument("--json")


def report(args, per_rank: list, runs: list, note: str) -> None:
    """Print a virtual-node benchmark's JSON, and write it to `args.json` if given: the commit, device, date,
    settings (`args` but for its file arguments), `note`, the test `runs` and each rank's timing."""
    from tokenyard.tools.bench.report import git_commit

    result = {"commit": git_commit(), "device": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "test_logs")},
              "note": note, "runs": runs, "timing_us_median_per_rank": per_rank}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
