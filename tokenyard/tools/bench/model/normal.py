"""``python -m tokenyard.tools.bench --model``: predicted internode normal-mode times for a cluster (issue 25), from
the model below, before any internode kernel runs. Nothing is measured here: every figure follows from the
arguments, one efficiency calibrated on a published figure, and the assumptions they name. ``--mode low_latency``
predicts the low-latency calls instead (NOTE [low-latency model] in low_latency.py); normal is the default.

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
- Decision: the RDMA stage's time follows the rows for every node a token reaches, the sender's own node
  included, not only the rows that cross the NIC. Reason: in DeepEP's csrc/kernels/internode.cu the own node's
  rows take the same path as the remote ones. In `dispatch`, the kRDMASender warps copy each token into the
  chunked RDMA buffer of every node it reaches (for the own node the "send" slot is that node's receive slot), wait
  on the same head counter when the ring is full, and the kRDMASenderCoordinator advances the own node's tail
  with a fence where it posts a put for the others; the kRDMAAndNVLForwarder warps then drain all nodes' rings,
  the own one included, round-robin. `combine`'s kNVLAndRDMAForwarder has one warp group per destination node, the
  own node too, writing into the same kind of ring. So the channel's rate, not the wire, binds what it carries,
  and the published figures agree: DeepEP's bottleneck figure is flat (43, 44, 46 GB/s at EP 16, 32, 64) where a
  wire-only limit would make it fall as N / (N - 1) (2, 1.33, 1.14 times the wire rate); at EP16 a token reaches
  1.99 nodes of which 1.00 is remote, so half the rows never touch the NIC, yet the figure matches EP64's.
- per GPU and T tokens, by symmetry: RDMA-stage bytes = T x nodes reached x row bytes, of which the share
  (N - 1)/N crosses the NIC; NVLink bytes = T x nodes reached x (ranks reached per node reached) x (G - 1)/G x row
  bytes (the forwarder may be one of the ranks it feeds, and the own node's rows are forwarded as well).
- rows (`row_format`): "deepep", DeepEP's internode rows (internode.cu, `get_num_bytes_per_token`): a dispatch row is
  the data, float32 scales (FP8: hidden / 128 of them), an 8-byte source record and k int32 ids plus k float32
  weights, padded to 16 bytes; a combine row is the bf16 data, the source record and k weights, padded to 16.
  "tokenyard", our normal-mode rows (NOTE [normal-mode buffer] in tokenyard/plan/workspace.py), padded to 128.
- time = overhead + max(RDMA-stage bytes / (efficiency x NIC bandwidth), NIC bytes / NIC bandwidth, NIC work
  requests / WR rate, NVLink bytes / NVLink bandwidth): the stages pipeline, the slowest sets the time. The work
  requests are operations.py's counts of the kernels whose rows `row_format` names (DeepEP's, or our internode
  kernels'), under uniform routing over all experts (its counts know no group limit), priced as in NOTE
  [operations priced] in pricing.py. Most carry a row or a chunk of rows, so they bind nowhere the results page
  predicts. `efficiency` is what calibration fits (below): the stage's rate over all the rows it carries, as a
  share of the NIC's line rate, so not a wire efficiency, and it may pass 1 where the own node's rows make up for
  the wire (UCCL-EP's figures fit 1.03); the wire at line rate stays a floor. `nvlink_gbs` is an achieved figure.
  The overhead is an assumption (20 µs: a launch and the pipeline's fill), under 1.5% of the calls compared here,
  so no published point can fit it apart from the efficiency.
- DeepEP's tests (tests/test_internode.py) report an RDMA "bottleneck bandwidth" of T x (distinct nodes a token
  reaches, own node included) x hidden x (1 + 4/128) bytes for FP8, or 2 hidden for BF16 and for the combine,
  over the average time of a call with a cached handle: no metadata, no notify. `bottleneck_rdma_gbps` is that
  figure, so it is what is set beside theirs.
- Calibration: `calibrate` solves the equations above for the efficiency that reproduces one published (or
  measured) bottleneck figure; the others are predictions. By default the efficiency is fitted on DeepEP's EP32
  dispatch figure (44 GB/s): the middle of the three scales, and one where every node is a possible group, so the
  group limit plays no part in the fit. The figures beside DeepEP's: benchmarks/results/internode_model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Dict, Optional, Sequence, Tuple

from ....backends.cuda.heuristics import NVLINK_GBS
from ....plan import workspace
from . import operations, pricing
from .common import (DEEPEP_NVLINK_GBS, MODEL_MODES, OPS, calibration_nodes, calibration_type, model_parser, reach,
                     write_json)

OVERHEAD_US = 20.0
ROW_FORMATS = ("deepep", "tokenyard")


@dataclasses.dataclass(frozen=True)
class Published:
    """One project's published internode normal-mode table and the setting it states."""
    name: str
    source: str
    hardware: str
    nic_gbps: float
    nvlink_gbs: float
    points: Dict[int, Tuple[float, float]]  # EP ranks -> (dispatch, combine) bottleneck GB/s
    calibrate_ep: int  # the point whose dispatch figure fits the efficiency by default
    num_experts: Dict[int, int] = dataclasses.field(default_factory=dict)  # EP -> experts where not 256
    gpus_per_node: int = 8
    num_tokens: int = 4096
    hidden: int = 7168
    num_topk: int = 8
    topk_groups: int = 4

    def setting(self, ep: int) -> dict:
        return dict(num_nodes=ep // self.gpus_per_node, gpus_per_node=self.gpus_per_node, nic_gbps=self.nic_gbps,
                    nvlink_gbs=self.nvlink_gbs, num_tokens=self.num_tokens, hidden=self.hidden,
                    num_topk=self.num_topk, num_experts=self.num_experts.get(ep, 256), topk_groups=self.topk_groups,
                    dtype="fp8")


PUBLISHED = {
    # DeepEP README, "Normal kernels with NVLink and RDMA forwarding" (shared/seeds/003_834bd8067d025687.txt);
    # NVLink at what its intranode dispatch reaches on the same H800s (common.DEEPEP_NVLINK_GBS).
    "deepep": Published("deepep", "DeepEP README", "H800, CX7 InfiniBand 400 Gb/s per GPU", 400.0,
                        DEEPEP_NVLINK_GBS, {16: (43.0, 43.0), 32: (44.0, 47.0), 64: (46.0, 45.0)}, calibrate_ep=32),
    # UCCL-EP README, "Normal kernels with NVLink and RDMA forwarding" (shared/seeds/004_74529b3c5f312808.txt);
    # NVLink at our H200 copy limit (heuristics.NVLINK_GBS). 256 experts do not divide over 24 ranks and the README
    # names no other count, so EP24 assumes 288 (12 per rank).
    "uccl": Published("uccl", "UCCL-EP README", "H200, EFA 400 Gb/s per GPU", 400.0, NVLINK_GBS,
                      {16: (50.0, 18.0), 24: (53.0, 26.0), 32: (54.0, 43.0)}, calibrate_ep=16,
                      num_experts={24: 288}),
}


def _align(num_bytes: float, alignment: int) -> int:
    return int(-(-num_bytes // alignment) * alignment)


def row_bytes(hidden: int, num_topk: int, dtype: str, combine: bool, row_format: str = "deepep") -> int:
    """Bytes of one row on the RDMA stage (NOTE [internode model], `row_format`)."""
    scale_bytes = 4 * (hidden // 128) if dtype == "fp8" and not combine else 0
    data_bytes = 2 * hidden if combine or dtype == "bf16" else hidden
    if row_format == "deepep":
        source_meta = 8  # DeepEP's SourceMeta: the source node and a bit per local rank
        topk_bytes = 4 * num_topk if combine else 8 * num_topk
        return _align(data_bytes + scale_bytes + source_meta + topk_bytes, 16)
    if row_format == "tokenyard":
        if combine:
            return workspace.normal_combine_row_bytes(hidden, num_topk)
        return workspace.normal_dispatch_row_bytes(data_bytes, scale_bytes, num_topk)
    raise ValueError(f"row format {row_format!r}: one of {ROW_FORMATS}")


def counted_row_bytes(hidden: int, dtype: str, combine: bool) -> float:
    """The bytes of a row that DeepEP's bottleneck figure counts: the data and the FP8 scales, nothing else."""
    return hidden * (1 + 4 / 128) if dtype == "fp8" and not combine else 2 * hidden


def predict(*, num_nodes: int, gpus_per_node: int, nic_gbps: float, nvlink_gbs: float, num_tokens: int,
            hidden: int, num_topk: int, num_experts: int, topk_groups: Optional[int] = None, dtype: str = "fp8",
            rdma_efficiency: float, overhead_us: float = OVERHEAD_US, row_format: str = "deepep",
            wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> dict:
    """Predicted dispatch and combine of one GPU (NOTE [internode model]); bandwidths in GB/s, times in µs,
    `wr_rate` in WRs per µs (millions per second)."""
    where = reach(num_nodes, gpus_per_node, num_experts, num_topk, topk_groups)
    local_share = (gpus_per_node - 1) / gpus_per_node
    wire_bytes_per_us = nic_gbps / 8 * 1e3  # Gb/s -> bytes per µs
    stage_bytes_per_us = wire_bytes_per_us * rdma_efficiency
    nvl_bytes_per_us = nvlink_gbs * 1e3
    out = {"reach": where}
    for op in OPS:
        combine = op == "combine"
        row = row_bytes(hidden, num_topk, dtype, combine, row_format)
        stage = num_tokens * where["nodes"] * row
        nvl = stage * where["ranks_per_node"] * local_share
        nic = stage * (num_nodes - 1) / num_nodes
        counts = pricing.normal_counts(op, row_format, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                                       num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                                       num_experts=num_experts, dtype=dtype)
        wrs = operations.work_requests(counts)
        times = {"rdma": stage / stage_bytes_per_us, "nic": nic / wire_bytes_per_us,
                 "wr": pricing.work_request_us(wrs, wr_rate), "nvlink": nvl / nvl_bytes_per_us}
        bound = max(times, key=times.get)
        us = overhead_us + times[bound]
        counted = num_tokens * where["nodes"] * counted_row_bytes(hidden, dtype, combine)
        out[op] = {"us": us, "bound": bound, "terms_us": times, "row_bytes": row, "rdma_stage_bytes": stage,
                   "nic_bytes": nic, "nvlink_bytes": nvl, "work_requests": wrs,
                   "wr_binds_below": pricing.binds_below(wrs, max(t for k, t in times.items() if k != "wr")),
                   "quiets": counts["quiets"], "nic_gbps": nic / us / 1e3, "nvlink_gbps": nvl / us / 1e3,
                   "bottleneck_rdma_gbps": counted / us / 1e3, "bottleneck_bytes": counted}
    return out


def calibrate(bottleneck_gbs: float, op: str = "dispatch", *, overhead_us: float = OVERHEAD_US,
              row_format: str = "deepep", wr_rate: float = pricing.WORK_REQUESTS_PER_US, **setting) -> float:
    """The `rdma_efficiency` at which `predict(**setting)` gives `bottleneck_gbs` as `op`'s bottleneck figure:
    the model's equations solved for it. Raises ValueError where no efficiency can: the figure leaves no time
    after the overhead, or NVLink, the wire or the WRs, not the RDMA stage, would bound that call."""
    if op not in OPS:
        raise ValueError(f"calibrate on {op!r}: one of {OPS}")
    line = predict(rdma_efficiency=1.0, overhead_us=0.0, row_format=row_format, wr_rate=wr_rate, **setting)[op]
    stage_us = line["bottleneck_bytes"] / (bottleneck_gbs * 1e3) - overhead_us  # the time the figure leaves it
    if stage_us <= 0:
        raise ValueError(f"{bottleneck_gbs:g} GB/s leaves no time after the {overhead_us:g} µs overhead")
    wire_bytes_per_us = setting["nic_gbps"] / 8 * 1e3
    floors = {"NVLink": line["nvlink_bytes"] / (setting["nvlink_gbs"] * 1e3),
              "the NIC's line rate": line["nic_bytes"] / wire_bytes_per_us, "The WRs": line["terms_us"]["wr"]}
    for name, floor_us in floors.items():
        if floor_us > stage_us:
            raise ValueError(f"{name} bounds a {op} of {bottleneck_gbs:g} GB/s there ({floor_us:.0f} µs > "
                             f"{stage_us:.0f} µs): the figure says nothing about the RDMA stage")
    return line["rdma_stage_bytes"] / wire_bytes_per_us / stage_us  # time at line rate / time the figure leaves


def compare(published: Published, calibrate_ep: Optional[int] = None, *, overhead_us: float = OVERHEAD_US,
            wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> dict:
    """The model calibrated on `published`'s dispatch figure at `calibrate_ep` ranks (its default point when None)
    beside every figure of that table; errors are (predicted - published) / published."""
    calibrate_ep = published.calibrate_ep if calibrate_ep is None else calibrate_ep
    if calibrate_ep not in published.points:
        raise ValueError(f"{published.name} publishes no EP{calibrate_ep}: {sorted(published.points)}")
    efficiency = calibrate(published.points[calibrate_ep][0], "dispatch", overhead_us=overhead_us, wr_rate=wr_rate,
                           **published.setting(calibrate_ep))
    rows = []
    for ep, figures in sorted(published.points.items()):
        setting = published.setting(ep)
        result = predict(rdma_efficiency=efficiency, overhead_us=overhead_us, wr_rate=wr_rate, **setting)
        row = {"ep": ep, "nodes": setting["num_nodes"], "num_experts": setting["num_experts"],
               "nodes_reached": result["reach"]["nodes"]}
        for op, figure in zip(OPS, figures):
            r = result[op]
            row[op] = {"published_gbps": figure, "predicted_gbps": r["bottleneck_rdma_gbps"],
                       "error": r["bottleneck_rdma_gbps"] / figure - 1, "us": r["us"], "bound": r["bound"],
                       "published_us": r["bottleneck_bytes"] / figure / 1e3, "nic_gbps": r["nic_gbps"],
                       "work_requests": r["work_requests"], "wr_us": r["terms_us"]["wr"],
                       "wr_binds_below": r["wr_binds_below"]}
        rows.append(row)
    return {"published": published.name, "source": published.source, "hardware": published.hardware,
            "calibrated_on": {"ep": calibrate_ep, "op": "dispatch", "gbps": published.points[calibrate_ep][0]},
            "rdma_efficiency": efficiency, "overhead_us": overhead_us, "wr_rate": wr_rate, "points": rows}


def default_efficiency() -> float:
    """The efficiency fitted on DeepEP's EP32 dispatch figure (NOTE [internode model], calibration)."""
    return compare(PUBLISHED["deepep"])["rdma_efficiency"]


def nic_bytes_by_choice(published: Published, ep: int) -> dict:
    """Bytes per GPU on the NIC for one dispatch and one combine at `published`'s setting and `ep` ranks: DeepEP's
    rows, ours one per node, ours one per rank reached (as the intranode path sends them)."""
    setting = published.setting(ep)
    where = reach(setting["num_nodes"], setting["gpus_per_node"], setting["num_experts"], setting["num_topk"],
                  setting["topk_groups"])
    out = {}
    for op in OPS:
        rows = {f: row_bytes(published.hidden, published.num_topk, "fp8", op == "combine", f) for f in ROW_FORMATS}
        per_node, per_rank = published.num_tokens * where["remote_nodes"], published.num_tokens * where["remote_ranks"]
        out[op] = {"deepep_row_bytes": rows["deepep"], "tokenyard_row_bytes": rows["tokenyard"],
                   "deepep": per_node * rows["deepep"], "tokenyard_per_node": per_node * rows["tokenyard"],
                   "tokenyard_per_rank": per_rank * rows["tokenyard"]}
    return out


DESCRIPTION = ("Predict the internode normal-mode dispatch and combine times of a cluster from a model (nothing is "
               "measured): the NIC, NVLink and the rows each stage carries, and the work requests the NIC executes "
               "(operations.py's counts at a NIC's message rate), with one efficiency calibrated on a published "
               "figure. --mode low_latency predicts the low-latency calls instead.")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser, add = model_parser(f"{prog} --model", DESCRIPTION)
    add("mode", choices=MODEL_MODES, default="normal",
        help="normal (default) or low_latency (`--model --mode low_latency --help` lists its arguments)")
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
    add("row_format", choices=ROW_FORMATS, default="deepep",
        help="rows on the RDMA stage, and whose kernels' work requests (default deepep)")
    pricing.add_wr_rate_argument(add)
    add("rdma_efficiency", type=float,
        help="the RDMA stage's rate as a share of the NIC's line rate (default: calibrated on DeepEP's EP32 dispatch)")
    add("calibrate", type=calibration_type("GBS"), metavar="EP,GBS[,OP]",
        help="fit the efficiency to a bottleneck figure of GBS at EP ranks (EP / gpus_per_node nodes) in the setting "
             "the other arguments give, for OP dispatch (default) or combine")
    add("published", choices=sorted(PUBLISHED),
        help="instead: the model beside that project's published table, in its setting, calibrated on one point")
    add("calibrate_on", type=int, metavar="EP",
        help="with --published: the point whose dispatch figure is fitted (DeepEP: 32, UCCL-EP: 16)")
    add("overhead_us", type=float, default=OVERHEAD_US, help=f"fixed cost of a call, µs (assumed {OVERHEAD_US:g})")
    add("json", metavar="PATH", help="write the prediction as JSON")
    return parser


def _print_published(args, prog: str) -> dict:
    published = PUBLISHED[args.published]
    result = compare(published, args.calibrate_on, overhead_us=args.overhead_us, wr_rate=args.wr_rate)
    fit = result["calibrated_on"]
    print(f"predicted, not measured (NOTE [internode model] in tokenyard/tools/bench/model/normal.py) beside "
          f"{published.source}: {published.hardware}, {published.num_tokens} tokens, hidden {published.hidden}, "
          f"top-{published.num_topk} in top-{published.topk_groups} node groups, FP8 dispatch, BF16 combine, "
          f"NVLink {published.nvlink_gbs:g} GB/s, {args.overhead_us:g} µs per call, {args.wr_rate:g} WRs per µs")
    print(f"efficiency {result['rdma_efficiency']:.4f} of {published.nic_gbps:g} Gb/s, fitted on EP{fit['ep']} "
          f"dispatch ({fit['gbps']:g} GB/s)")
    print("GB/s: the bottleneck figure as DeepEP's test counts it; us: the model's call, and the call the published "
          "figure implies; NIC WRs: DeepEP's kernels' work requests per GPU, and their µs")
    print(f"{'EP':>4} {'nodes':>5} {'experts':>7} {'reached':>7} {'op':<9} {'us':>8} {'pub. us':>8} {'bound':>6} "
          f"{'NIC GB/s':>9} {'NIC WRs':>8} {'WR us':>6} {'predicted':>9} {'published':>9} {'error':>7}")
    for row in result["points"]:
        for op in OPS:
            r = row[op]
            print(f"{row['ep']:>4} {row['nodes']:>5} {row['num_experts']:>7} {row['nodes_reached']:>7.2f} {op:<9} "
                  f"{r['us']:8.1f} {r['published_us']:8.1f} {r['bound']:>6} {r['nic_gbps']:9.1f} "
                  f"{r['work_requests']:8.0f} {r['wr_us']:6.1f} {r['predicted_gbps']:9.1f} {r['published_gbps']:9.0f} "
                  f"{r['error']:+7.1%}")
    result["each_calibration"] = {}
    print("the largest error, calibrated on each dispatch figure in turn:")
    for ep in sorted(published.points):
        other = compare(published, ep, overhead_us=args.overhead_us, wr_rate=args.wr_rate)
        worst = {op: max(abs(p[op]["error"]) for p in other["points"]) for op in OPS}
        result["each_calibration"][ep] = {"rdma_efficiency": other["rdma_efficiency"], "max_abs_error": worst}
        print(f"  EP{ep}: efficiency {other['rdma_efficiency']:.4f}, dispatch {worst['dispatch']:.1%}, "
              f"combine {worst['combine']:.1%}")
    result["nic_bytes"] = {}
    print("MB per GPU on the NIC per call: DeepEP rows / ours one per node / ours one per rank reached")
    for ep in sorted(published.points):
        choice = result["nic_bytes"][ep] = nic_bytes_by_choice(published, ep)
        print(f"  EP{ep}: " + "; ".join(
            f"{op} {c['deepep'] / 1e6:.2f} / {c['tokenyard_per_node'] / 1e6:.2f} / {c['tokenyard_per_rank'] / 1e6:.2f}"
            f" (rows {c['deepep_row_bytes']} / {c['tokenyard_row_bytes']} bytes)" for op, c in choice.items()))
    return result


def main(argv: Sequence[str], prog: str = "python -m tokenyard.tools.bench") -> int:
    args = build_parser(prog).parse_args(argv)
    setting = dict(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, nic_gbps=args.nic_gbps,
                   nvlink_gbs=args.nvlink_gbs, num_tokens=args.num_tokens, hidden=args.hidden_size,
                   num_topk=args.num_topk, num_experts=args.num_experts, topk_groups=args.topk_groups,
                   dtype=args.dtype)
    try:
        nodes = calibration_nodes(args, args.rdma_efficiency is not None)
        if args.published:
            result = _print_published(args, prog)
        else:
            efficiency, fitted = args.rdma_efficiency, "given"
            if args.calibrate:
                ep, gbs, op = args.calibrate
                efficiency = calibrate(gbs, op, overhead_us=args.overhead_us, row_format=args.row_format,
                                       wr_rate=args.wr_rate, **{**setting, "num_nodes": nodes})
                fitted = f"fitted on {gbs:g} GB/s {op} at EP{ep}"
            elif efficiency is None:
                efficiency, fitted = default_efficiency(), "fitted on DeepEP's EP32 dispatch, 44 GB/s"
            result = predict(rdma_efficiency=efficiency, overhead_us=args.overhead_us, row_format=args.row_format,
                             wr_rate=args.wr_rate, **setting)
            result.update(rdma_efficiency=efficiency, wr_rate=args.wr_rate)
            _print_cluster(args, result, fitted)
    except ValueError as exc:
        print(f"{prog} --model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, args, result)
    return 0


def _print_cluster(args, result: dict, fitted: str) -> None:
    where = result["reach"]
    print(f"predicted, not measured (NOTE [internode model] in tokenyard/tools/bench/model/normal.py): "
          f"{args.nodes} nodes x {args.gpus_per_node} GPUs, NIC {args.nic_gbps:g} Gb/s, RDMA stage at "
          f"{result['rdma_efficiency']:.4f} of it ({fitted}), NVLink {args.nvlink_gbs:g} GB/s, {args.num_tokens} "
          f"tokens, hidden {args.hidden_size}, top-{args.num_topk} of {args.num_experts}"
          f"{'' if args.topk_groups is None else f' in {args.topk_groups} node groups'}, {args.dtype} dispatch, "
          f"{args.row_format} rows, {args.overhead_us:g} µs per call, {args.wr_rate:g} WRs per µs")
    print(f"a token reaches {where['nodes']:.2f} nodes ({where['remote_nodes']:.2f} remote) and "
          f"{where['ranks']:.2f} ranks; NIC WRs: the {args.row_format} kernels' work requests per GPU (operations.py), "
          "their µs, and the WR rate per µs under which they would set the time")
    print(f"{'op':<9} {'us':>8} {'bound':>7} {'NIC GB/s':>9} {'bottleneck':>11} {'nvlink GB/s':>12} {'NIC MB':>8} "
          f"{'NIC WRs':>8} {'WR us':>6} {'bind <':>7} {'quiets':>7}")
    for op in OPS:
        r = result[op]
        rate = "-" if r["wr_binds_below"] is None else f"{r['wr_binds_below']:.2f}"
        print(f"{op:<9} {r['us']:8.1f} {r['bound']:>7} {r['nic_gbps']:9.1f} {r['bottleneck_rdma_gbps']:11.1f} "
              f"{r['nvlink_gbps']:12.1f} {r['nic_bytes'] / 1e6:8.2f} {r['work_requests']:8.0f} "
              f"{r['terms_us']['wr']:6.1f} {rate:>7} {r['quiets']:7.0f}")
