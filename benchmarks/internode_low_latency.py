"""Low-latency mode on virtual nodes (issue 26): the time per call of the low-latency kernels with the ranks of
this machine seen as nodes of `--ranks_per_node` (NOTE [internode low-latency] in include/tokenyard/sync.cuh: the
ranks of other nodes reached by NVSHMEM puts), beside the same kernels with every rank in one node (stores over
CUDA IPC) and the reference backend, on the same ranks and inputs. **Not a network figure**: a put to a rank of
"another node" goes through NVSHMEM's P2P transport on this host (on one GPU, between processes sharing it under
MPS), so the times say what the internode path costs beside the intranode one, nothing about a NIC
(`python -m tokenyard.tools.bench --model --mode low_latency` predicts a cluster's).

The kernels' dispatch and combine are each captured in a CUDA graph and timed per replay with CUDA events, back
to back (median over `--iters`); the reference backend's calls eagerly. The logs of tests/gpu/test_low_latency_cuda.py
run under TOKENYARD_RANKS_PER_NODE (`--test_logs`) add the runs (nodes, ranks per node, GPUs, passed, failed).

    python benchmarks/internode_low_latency.py --num_ranks 4 --ranks_per_node 2 --json out.json --test_logs a.log

`--cast` picks the dispatch's payload (FP8 by default; NVFP4 with the global scale 448 * 6 / max|x|).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard


def _rank(args) -> dict:
    import torch.distributed as dist
    from internode import median_us  # benchmarks/internode.py, beside this file

    from tokenyard import Buffer
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, topk_idx, weights = make_rank_inputs(7, num_ranks, args.num_tokens, args.hidden, args.num_experts,
                                            args.num_topk, "uniform", "bf16", device)[rank]
    size = Buffer.get_low_latency_rdma_size_hint(args.num_tokens, args.hidden, num_ranks, args.num_experts)
    global_scale = (448.0 * 6.0 / x.float().abs().max()).reshape(1) if args.cast == "nvfp4" else None
    results = {}
    setups = (("cuda_internode", "cuda", args.ranks_per_node), ("cuda_one_node", "cuda", num_ranks),
              ("reference", "reference", args.ranks_per_node))
    for name, backend, per_node in setups:
        buffer = Buffer(dist.group.WORLD, 0, size, backend=backend, ranks_per_node=per_node, check_inputs=False)
        if backend == "cuda":
            buffer.runtime.use_low_latency_kernels = True
            results[f"{name}_remote_ranks"] = bin(buffer.runtime._low_latency_kernels.remote).count("1")

        def dispatch():
            return buffer.low_latency_dispatch(x, topk_idx, args.num_tokens, args.num_experts,
                                               use_fp8=args.cast == "fp8", use_nvfp4=args.cast == "nvfp4",
                                               x_global_scale=global_scale)

        recv, _, handle, _, _ = dispatch()
        y = torch.randn(args.num_experts // num_ranks, num_ranks * args.num_tokens, args.hidden,
                        device=device).to(torch.bfloat16)  # expert outputs: the combine's input

        def combine():
            return buffer.low_latency_combine(y, topk_idx, weights, handle)

        combine()
        torch.cuda.synchronize()
        calls = {"dispatch": dispatch, "combine": combine}
        if backend == "cuda":  # each call captured once, timed per replay
            graphs = {}
            for call, fn in calls.items():
                graphs[call] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[call]):
                    fn()
            calls = {call: graph.replay for call, graph in graphs.items()}
        dist.barrier()
        results[name] = {call: median_us(fn, args.warmup, args.iters) for call, fn in calls.items()}
        dist.barrier()
        buffer.destroy()
    return results


def _runs(logs, num_gpus: int) -> list:
    """{"log", "nodes", "ranks_per_node", "num_gpus", "passed", "failed", "tests"} per log of
    tests/gpu/test_low_latency_cuda.py ran under TOKENYARD_RANKS_PER_NODE, from run_device.sh's logs (the layout
    is the one the tests print, "(N nodes x P)")."""
    runs = []
    for path in logs:
        with open(path) as f:
            text = f.read()
        layout = re.search(r"\((\d+) nodes x (\d+)\)", text)
        found = re.findall(r"test_low_latency_cuda\.py::(\w+)\[(\d+)\] .*?(PASSED|FAILED)", text, re.DOTALL)
        if layout is None or not found:
            continue
        nodes, per_node = int(layout.group(1)), int(layout.group(2))
        runs.append({"log": os.path.basename(path), "nodes": nodes, "ranks_per_node": per_node,
                     "num_gpus": min(num_gpus, nodes * per_node),
                     "passed": sum(v == "PASSED" for _, _, v in found),
                     "failed": sum(v == "FAILED" for _, _, v in found),
                     "tests": [f"{test}: {verdict}" for test, _, verdict in found]})
    return runs


def main(argv=None) -> int:
    from internode import add_arguments, report  # benchmarks/internode.py, beside this file
    from tokenyard.tools.launch import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, num_tokens=128, warmup=5, iters=30)
    parser.add_argument("--cast", choices=("fp8", "nvfp4", "bf16"), default="fp8", help="the dispatch's payload")
    args = parser.parse_args(argv)

    per_rank = run_on_ranks(args.num_ranks, _rank, args, use_cuda=True, timeout_s=500.0)
    report(args, per_rank, _runs(args.test_logs, torch.cuda.device_count()),
           f"virtual nodes on one host: not a network figure; {args.cast} dispatch, bf16 combine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
