"""Issue 53's record: what each internode call asks of the transport per rank, tokenyard's against DeepEP V1's.

    python benchmarks/internode_ops.py [--json benchmarks/results/internode_ops.json]

For 2 nodes x 2, 2 x 4 and 4 x 2 ranks, the DeepSeek-V3 setting (hidden 7168, top-8 of 256 experts, uniform
routing; 4096 tokens per rank in normal mode, BF16 rows; 128 in low-latency mode, FP8 dispatch), each call's
operations per rank by destination kind and the work requests a NIC executes (NOTE [operation counts] in
tokenyard/tools/bench/model/operations.py):
- tokenyard's: the exact counts of NOTE [exact operation counts] (tokenyard/backends/cuda/operation_counts.py) from
  one seeded routing of every rank, the mean over the ranks: the counts the transport seam's counters hold on the
  GPU (tests/gpu/test_operation_counts_cuda.py checks them equal, call by call);
- DeepEP's: the expectations of its kernels at 29d31c0 (operations.py, with its line references), in its default
  route (allow_nvlink_for_low_latency_mode: the node's ranks by stores, as tokenyard's), with the low-latency work
  requests of the route its published tables used (NVSHMEM P2P off, every other rank over the NIC) beside them
  (`work_requests_rdma`); the grids at their defaults (DeepEP: Config(num_sms=20), 10 channels; tokenyard: Config().num_sms blocks in
  normal mode, 132 SMs, an H100's, in low-latency mode).
Nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenyard import Config  # noqa: E402
from tokenyard.backends.cuda import operation_counts as counted  # noqa: E402
from tokenyard.tools.bench.model import operations  # noqa: E402

LAYOUTS = ((2, 2), (2, 4), (4, 2))  # (nodes, ranks per node)
HIDDEN, TOPK, EXPERTS = 7168, 8, 256
TOKENS = {"normal": 4096, "low_latency": 128}
LOW_LATENCY_BLOCKS = 132  # the low-latency grid: every SM of an H100 SXM
FP8 = 1  # operation_counts' cast of an FP8 dispatch


def routing(seed: int, num_ranks: int, tokens: int) -> list:
    """Every rank's [tokens, k] expert ids, k distinct experts uniformly drawn per token."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(tokens, EXPERTS, generator=generator).topk(TOPK, dim=1).indices for _ in range(num_ranks)]


def work_requests(kinds: dict) -> float:
    """operations.work_requests of tokenyard's counts by kind (route "nvlink": the node's ranks take stores)."""
    return kinds["puts_remote"] + 2 * kinds["put_signals_remote"] + kinds["signals_remote"]


def tokenyard_ops(mode: str, call: str, nodes: int, per_node: int, seed: int) -> dict:
    num_ranks = nodes * per_node
    topk_idx = routing(seed, num_ranks, TOKENS[mode])
    in_rank = [counted.hits(t, EXPERTS, num_ranks) for t in topk_idx]  # the normal calls' is_token_in_rank
    # ReferenceBackend.payload's row: BF16 data, the source index, int64 top-k ids and float32 weights.
    row_bytes = 2 * HIDDEN + 4 + (8 + 4) * TOPK
    per_rank = []
    for rank in range(num_ranks):
        if mode == "low_latency":
            counts = counted.low_latency(call, topk_idx, rank, EXPERTS, per_node, HIDDEN, LOW_LATENCY_BLOCKS,
                                         cast=FP8 if call == "dispatch" else 0)
        else:
            counts = counted.normal(call, in_rank, rank, per_node, Config().num_sms, row_bytes=row_bytes,
                                    hidden=HIDDEN, num_topk=TOPK)
        kinds = counted.by_kind(counts, rank, per_node)
        kinds["work_requests"] = work_requests(kinds)
        per_rank.append(kinds)
    return {key: sum(r[key] for r in per_rank) / num_ranks for key in per_rank[0]}


def deepep_ops(mode: str, call: str, nodes: int, per_node: int) -> dict:
    if mode == "low_latency":
        counts = operations.deepep_low_latency(call, TOKENS[mode], TOPK, EXPERTS, nodes, per_node, HIDDEN,
                                               route="nvlink", fp8=True)
        rdma = operations.deepep_low_latency(call, TOKENS[mode], TOPK, EXPERTS, nodes, per_node, HIDDEN,
                                             route="rdma", fp8=True)
        counts["work_requests_rdma"] = operations.work_requests(rdma, "rdma")
    else:  # its NVLink leg writes with stores; only the rank of the same GPU index per node is reached by RDMA
        counts = operations.deepep_normal(call, TOKENS[mode], TOPK, EXPERTS, nodes, per_node, HIDDEN, fp8=False)
    return dict(counts, work_requests=operations.work_requests(counts, "nvlink"))


def nic_bytes(ops: dict) -> float:
    """Bytes a rank's NIC puts: to the ranks of other nodes."""
    return ops["put_bytes_remote"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=53)
    parser.add_argument("--json")
    args = parser.parse_args()
    calls = []
    for nodes, per_node in LAYOUTS:
        for mode in ("low_latency", "normal"):
            for call in operations.CALLS:
                ours = tokenyard_ops(mode, call, nodes, per_node, args.seed)
                theirs = deepep_ops(mode, call, nodes, per_node)
                calls.append({"call": f"{mode} {call}", "nodes": nodes, "ranks_per_node": per_node,
                              "tokens": TOKENS[mode], "tokenyard_ops": ours, "deepep_ops": theirs,
                              "tokenyard_bytes": nic_bytes(ours), "deepep_bytes": nic_bytes(theirs)})
    print(f"{'call':<22} {'nodes x ranks':>13} {'tokenyard WRs':>14} {'DeepEP WRs':>11} {'tokenyard NIC MB':>17} "
          f"{'DeepEP NIC MB':>14} {'tokenyard quiets':>17}")
    for c in calls:
        print(f"{c['call']:<22} {c['nodes']:>6} x {c['ranks_per_node']:<4} {c['tokenyard_ops']['work_requests']:>14.1f} "
              f"{c['deepep_ops']['work_requests']:>11.1f} {c['tokenyard_bytes'] / 1e6:>17.3f} "
              f"{c['deepep_bytes'] / 1e6:>14.3f} {c['tokenyard_ops']['quiets']:>17.0f}")
    if args.json:
        commit = os.environ.get("TOKENYARD_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        doc = {"commit": commit, "device": "none (counts from formulas; the GPU counters equal tokenyard's, "
                                           "tests/gpu/test_operation_counts_cuda.py)",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "python benchmarks/internode_ops.py --json benchmarks/results/internode_ops.json",
               "seed": args.seed, "hidden": HIDDEN, "num_topk": TOPK, "num_experts": EXPERTS, "calls": calls,
               "model_prices_operations": True}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
