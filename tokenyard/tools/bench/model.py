"""``python -m tokenyard.tools.bench --model``: predicted internode normal-mode times for a cluster (issue 25), from
the model below, before any internode kernel runs. Nothing is measured here: every figure follows from the
arguments and the assumptions they name.

NOTE [internode model]
DeepEP's internode normal mode: a token crosses the network at most once per remote node that holds one of its
experts (to the GPU with the sender's local index there), which forwards it over NVLink to the ranks of its node
that hold the token's experts; a combine runs the other way. For N nodes of G GPUs (R = N G ranks), E experts,
top-k routing with the k experts of a token distinct and uniform:
- a node holds one of a token's experts with p_node = 1 - C(E - E/N, k) / C(E, k), a rank with
  p_rank = 1 - C(E - E/R, k) / C(E, k); so a token reaches N p_node nodes and R p_rank ranks in expectation.
  Group-limited routing (`topk_groups` = M node groups, DeepSeek-V3's node-limited routing) draws the k experts
  from the M chosen nodes' experts: min(M, N) nodes each with p_node computed over those M E / N experts, and the
  ranks likewise.
- per GPU and T tokens, by symmetry: RDMA bytes out = T (N - 1)/N x nodes reached x row bytes; NVLink bytes out =
  row bytes x T x [(remote nodes reached) x (ranks reached per node reached) x (G - 1)/G (the forwarding; the
  forwarder itself may be one of the node's ranks) + (ranks reached in the own node) x (G - 1)/G].
- rows: FP8 `hidden (1 + 4/128)` bytes (the scales), BF16 `2 hidden`, plus the top-k ids and weights (8 k bytes) and
  the source index (4) a dispatch row carries; a combine row is `2 hidden` plus its k weights.
- time = overhead + max(RDMA bytes / (efficiency x NIC bandwidth), NVLink bytes / NVLink bandwidth): the two
  links pipeline, the slower one sets the time. `nvlink_gbs` is an achieved figure (the default: the copy limit
  measured on H200s, heuristics.NVLINK_GBS); the NIC's efficiency and the overhead are assumptions.
- DeepEP's tests report an RDMA "bottleneck bandwidth" that counts the tokens for the sender's own node too
  (T x nodes reached x row bytes / time); the table gives it beside the wire figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Optional, Sequence

from ...backends.cuda.heuristics import NVLINK_GBS


def hit_probability(num_experts: int, experts_there: float, num_topk: int) -> float:
    """The chance that a place holding `experts_there` of `num_experts` experts holds one of a token's `num_topk`
    distinct, uniformly drawn experts: 1 - C(E - e, k) / C(E, k) (e need not be whole: a mean)."""
    if num_topk > num_experts:
        raise ValueError(f"top-{num_topk} of {num_experts} experts")
    missed = 1.0
    for i in range(num_topk):  # C(E - e, k) / C(E, k) as a product, for a fractional e too
        missed *= max(0.0, (num_experts - experts_there - i) / (num_experts - i))
    return 1.0 - missed


def reach(num_nodes: int, gpus_per_node: int, num_experts: int, num_topk: int,
          topk_groups: Optional[int] = None) -> dict:
    """NOTE [internode model]: the nodes and ranks a token reaches in expectation."""
    if num_experts % (num_nodes * gpus_per_node):
        raise ValueError(f"{num_experts} experts do not divide over {num_nodes} x {gpus_per_node} ranks")
    groups = num_nodes if topk_groups is None else min(topk_groups, num_nodes)
    experts = num_experts * groups // num_nodes  # the experts a token draws from
    per_node, per_rank = num_experts // num_nodes, num_experts // (num_nodes * gpus_per_node)
    nodes = groups * hit_probability(experts, per_node, num_topk)
    ranks = groups * gpus_per_node * hit_probability(experts, per_rank, num_topk)
    return {"nodes": nodes, "remote_nodes": nodes * (num_nodes - 1) / num_nodes, "ranks": ranks,
            "ranks_per_node": ranks / nodes, "own_node_ranks": ranks / num_nodes}


def row_bytes(hidden: int, num_topk: int, dtype: str, combine: bool) -> float:
    if combine:
        return 2 * hidden + 4 * num_topk
    data = hidden * (1 + 4 / 128) if dtype == "fp8" else 2 * hidden
    return data + 8 * num_topk + 4


def predict(*, num_nodes: int, gpus_per_node: int, nic_gbps: float, nvlink_gbs: float, num_tokens: int,
            hidden: int, num_topk: int, num_experts: int, topk_groups: Optional[int] = None, dtype: str = "fp8",
            rdma_efficiency: float = 0.8, overhead_us: float = 20.0) -> dict:
    """Predicted dispatch and combine of one GPU (NOTE [internode model]); bandwidths in GB/s, times in µs."""
    where = reach(num_nodes, gpus_per_node, num_experts, num_topk, topk_groups)
    local_share = (gpus_per_node - 1) / gpus_per_node
    nic_bytes_per_us = nic_gbps / 8 * 1e3 * rdma_efficiency  # Gb/s -> bytes per µs
    nvl_bytes_per_us = nvlink_gbs * 1e3
    out = {"reach": where}
    for op in ("dispatch", "combine"):
        row = row_bytes(hidden, num_topk, dtype, op == "combine")
        rdma = num_tokens * where["remote_nodes"] * row
        nvl = row * num_tokens * (where["remote_nodes"] * where["ranks_per_node"] * local_share +
                                  where["own_node_ranks"] * local_share)
        rdma_us, nvl_us = rdma / nic_bytes_per_us, nvl / nvl_bytes_per_us
        us = overhead_us + max(rdma_us, nvl_us)
        out[op] = {"us": us, "rdma_bytes": rdma, "nvlink_bytes": nvl, "bound": "rdma" if rdma_us >= nvl_us else "nvlink",
                   "rdma_gbps": rdma / us / 1e3, "nvlink_gbps": nvl / us / 1e3,
                   "bottleneck_rdma_gbps": num_tokens * where["nodes"] * row / us / 1e3}
    return out


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{prog} --model", description=__doc__.splitlines()[0])

    def add(name: str, **kwargs) -> None:
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*spellings, dest=name, **kwargs)

    add("nodes", type=int, default=4, help="nodes (default 4)")
    add("gpus_per_node", type=int, default=8, help="GPUs per node (default 8)")
    add("nic_gbps", type=float, default=400.0, help="each GPU's NIC, Gb/s (default 400)")
    add("nvlink_gbs", type=float, default=NVLINK_GBS, help=f"NVLink GB/s a GPU's copies reach (default {NVLINK_GBS:g})")
    add("num_tokens", type=int, default=4096, help="tokens per GPU (default 4096)")
    add("hidden_size", type=int, default=7168, help="hidden size (default 7168)")
    add("num_topk", type=int, default=8, help="experts per token (default 8)")
    add("num_experts", type=int, default=256, help="experts (default 256)")
    add("topk_groups", type=int, help="node groups a token's experts come from (DeepSeek-V3: 4; default: any)")
    add("dtype", choices=("fp8", "bf16"), default="fp8", help="dispatch rows (default fp8)")
    add("rdma_efficiency", type=float, default=0.8, help="share of the NIC's line rate reached (assumed 0.8)")
    add("overhead_us", type=float, default=20.0, help="fixed cost of a call, µs (assumed 20)")
    add("json", metavar="PATH", help="write the prediction as JSON")
    return parser


def main(argv: Sequence[str], prog: str = "python -m tokenyard.tools.bench") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        result = predict(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, nic_gbps=args.nic_gbps,
                         nvlink_gbs=args.nvlink_gbs, num_tokens=args.num_tokens, hidden=args.hidden_size,
                         num_topk=args.num_topk, num_experts=args.num_experts, topk_groups=args.topk_groups,
                         dtype=args.dtype, rdma_efficiency=args.rdma_efficiency, overhead_us=args.overhead_us)
    except ValueError as exc:
        print(f"{prog} --model: {exc}", file=sys.stderr)
        return 2
    where = result["reach"]
    print(f"predicted, not measured (NOTE [internode model] in tokenyard/tools/bench/model.py): {args.nodes} nodes x "
          f"{args.gpus_per_node} GPUs, NIC {args.nic_gbps:g} Gb/s at {args.rdma_efficiency:g}, NVLink "
          f"{args.nvlink_gbs:g} GB/s, {args.num_tokens} tokens, hidden {args.hidden_size}, top-{args.num_topk} of "
          f"{args.num_experts}{'' if args.topk_groups is None else f' in {args.topk_groups} node groups'}, "
          f"{args.dtype} dispatch, {args.overhead_us:g} µs per call")
    print(f"a token reaches {where['nodes']:.2f} nodes ({where['remote_nodes']:.2f} remote) and "
          f"{where['ranks']:.2f} ranks")
    print(f"{'op':<9} {'us':>8} {'bound':>7} {'rdma GB/s':>10} {'bottleneck':>11} {'nvlink GB/s':>12}")
    for op in ("dispatch", "combine"):
        r = result[op]
        print(f"{op:<9} {r['us']:8.1f} {r['bound']:>7} {r['rdma_gbps']:10.1f} {r['bottleneck_rdma_gbps']:11.1f} "
              f"{r['nvlink_gbps']:12.1f}")
    if args.json:
        from .report import git_commit

        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.json, "w") as f:
            json.dump({"predicted": True, "commit": git_commit(), "date": date, "settings": vars(args), **result}, f,
                      indent=1)
    return 0
