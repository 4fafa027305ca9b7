"""``python -m tokenyard.tools.bench --model --mode low_latency``: predicted internode low-latency dispatch and combine
times per call (issue 26), from the model below and one efficiency calibrated on a published time. Nothing is
measured here: every figure follows from the arguments, that efficiency and the assumptions they name.

NOTE [low-latency model]
DeepEP's low-latency kernels (csrc/kernels/internode_ll.cu, `dispatch` and `combine`) move one message per
(token, top-k choice): the dispatch puts a token into a slot of each expert it chose, the combine puts each
expert's bf16 output for it back into a slot of its own at the token's source. For N nodes of G GPUs (R = N G
ranks), T tokens per rank and top-k routing with the k experts of a token distinct and uniform:
- Message bytes (`message_bytes`, format "deepep"): a dispatch message is a 16-byte header (an int4 whose first int
  is the token's index at its source, the rest unused) and the data: FP8 plus one float32 scale per 128 channels,
  hidden x (1 + 4/128) bytes, or bf16, 2 hidden; a combine message is the bf16 row alone. DeepEP's test
  (tests/test_low_latency.py) counts the same bytes per selected (token, expert) for its "RDMA bandwidth", so its
  published GB/s are T k messages (less the few pairs the test masks) over the published time, which is a whole
  kernel's: its profiler's mean per call of the `dispatch` or `combine` kernel, sending and receiving in one launch.
- Messages on the NIC (`route`): "rdma" is DeepEP's published setting ("pure RDMA"): deep_ep/buffer.py turns
  NVSHMEM's P2P mappings off unless `allow_nvlink_for_low_latency_mode`, so `nvshmemi_get_p2p_ptr`
  (csrc/kernels/ibgda_device.cuh) gives a plain address for the rank itself alone, and every other rank, on the same
  node or not, gets an IBGDA put: the share (R - 1)/R of the messages leaves the GPU. "nvlink" stores to same-node
  peers over NVLink (DeepEP with that flag; our intranode kernels do only that): the share (R - G)/R crosses the
  NIC, (G - 1)/R NVLink.
- time = t0 + max(NIC bytes / (efficiency x line rate), NVLink bytes / NVLink rate), with the NIC bytes one GPU sends.
  Decisions, with their reasons (the figures behind them: benchmarks/results/internode_model.md):
  * One direction, not sending plus receiving: by symmetry a GPU receives what it sends, and the NIC is full duplex.
    Added together, the published times would need more than the line rate (`_print_published` prints the sum's
    rate), so the two directions overlap.
  * No per-message cost: the messages per GPU, T k (R - 1)/R, change with R exactly as the bytes do, so at one
    message size such a cost is the efficiency under another name, and at one EP (the dispatch's and the combine's
    messages are as many) it is t0 under another name. Nothing published tells them apart; the model keeps t0.
  * One efficiency for both operations at every EP: the NIC's achieved share of its line rate, fitted on one
    published time (by default DeepEP's EP32 dispatch, in the middle of its table, as in NOTE [internode model]). A
    share above 1 would be faster than the wire, so `calibrate` refuses it.
  * t0 = 5 µs, an assumption: what a call costs besides its bytes (the last message's and the counts' flight, the
    receive's copy behind them; a launch is not in a kernel's time). The dispatch and combine of one EP could fit t0
    beside the efficiency (`pair_fits`), but the six published pairs scatter it too widely to take one value from;
    the results page shows that the 10% goal holds for any t0 from 0 to 20 µs.
  The published times grow a little faster with R than the bytes do; the model leaves that to its error.
- Our messages (format "tokenyard", NOTE [low-latency dispatch] and NOTE [low-latency combine] in
  include/tokenyard/kernels/): one per (token, destination rank), its header (LOW_LATENCY_MESSAGE_HEADER_BYTES in
  tokenyard/plan/workspace.py) naming the token's choices there, then DeepEP's data and scales; the combine sends
  each source one pre-reduced bf16 row per (token, rank), after k 8-byte weight words. A token reaches R p_rank
  ranks (`common.reach`) instead of k experts, fewer when experts of one rank are chosen together.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Dict, Optional, Sequence, Tuple

from ....backends.cuda.heuristics import NVLINK_GBS
from ....plan import workspace
from .common import (DEEPEP_NVLINK_GBS, MODEL_MODES, OPS, calibration_nodes, calibration_type, model_parser, reach,
                     write_json)

OVERHEAD_US = 5.0
MESSAGE_FORMATS = ("deepep", "tokenyard")
ROUTES = ("rdma", "nvlink")
DEEPEP_HEADER_BYTES = 16  # internode_ll.cu's dispatch message: an int4 holding the source token index
WEIGHT_WORD_BYTES = 8  # our combine's (tag << 32) | float32 weight words, k per (token, rank)
TEST_EXPERTS = 288  # DeepEP's and UCCL-EP's low-latency tests' default; 256 where 288 does not divide over EP


@dataclasses.dataclass(frozen=True)
class PublishedLowLatency:
    """One project's published low-latency table (pure RDMA) and the setting it states."""
    name: str
    source: str
    hardware: str
    nic_gbps: float
    points: Dict[int, Tuple[float, float]]  # EP ranks -> (dispatch, combine) µs per call
    calibrate_ep: int  # the point whose dispatch time fits the efficiency by default
    gpus_per_node: int = 8
    num_tokens: int = 128
    hidden: int = 7168
    num_topk: int = 8
    nvlink_gbs: float = NVLINK_GBS  # for the same-node peers of route "nvlink" only

    def setting(self, ep: int) -> dict:
        """`predict`'s arguments at `ep` ranks. The experts do not change the time of DeepEP's messages (one per
        choice, whatever the count); they set how many ranks a token reaches, our messages."""
        return dict(num_nodes=ep // self.gpus_per_node, gpus_per_node=self.gpus_per_node, nic_gbps=self.nic_gbps,
                    nvlink_gbs=self.nvlink_gbs, num_tokens=self.num_tokens, hidden=self.hidden, num_topk=self.num_topk,
                    num_experts=TEST_EXPERTS if TEST_EXPERTS % ep == 0 else 256, dtype="fp8")


PUBLISHED = {
    # DeepEP README, "Low-latency kernels with pure RDMA" (shared/seeds/003_834bd8067d025687.txt); NVLink, for the
    # NVLink routes of `nic_bytes_by_choice`, as NOTE [internode model] takes it on those H800s.
    "deepep": PublishedLowLatency(
        "deepep", "DeepEP README", "H800, CX7 InfiniBand 400 Gb/s per GPU", 400.0,
        {8: (163.0, 318.0), 16: (173.0, 329.0), 32: (182.0, 350.0), 64: (186.0, 353.0), 128: (192.0, 369.0),
         256: (194.0, 360.0)}, calibrate_ep=32, nvlink_gbs=DEEPEP_NVLINK_GBS),
    # UCCL-EP README, "Low-latency kernels with pure RDMA" (shared/seeds/004_74529b3c5f312808.txt).
    "uccl": PublishedLowLatency(
        "uccl", "UCCL-EP README", "H200, EFA 400 Gb/s per GPU", 400.0,
        {16: (226.0, 293.0), 24: (386.0, 580.0), 32: (465.0, 694.0)}, calibrate_ep=16),
}


def message_bytes(hidden: int, num_topk: int, op: str, message_format: str = "deepep", dtype: str = "fp8") -> int:
    """Bytes of one message on the wire (NOTE [low-latency model])."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: one of {OPS}")
    data = hidden + 4 * (hidden // 128) if dtype == "fp8" else 2 * hidden
    if message_format == "deepep":
        return DEEPEP_HEADER_BYTES + data if op == "dispatch" else 2 * hidden
    if message_format == "tokenyard":
        if op == "dispatch":
            return workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES + data
        return workspace.low_latency_combine_message_bytes(hidden) + WEIGHT_WORD_BYTES * num_topk
    raise ValueError(f"message format {message_format!r}: one of {MESSAGE_FORMATS}")


def messages_per_token(num_nodes: int, gpus_per_node: int, num_experts: int, num_topk: int,
                       message_format: str) -> float:
    """Messages a token makes in one call, in expectation: one per choice (DeepEP) or per rank reached (ours)."""
    if message_format == "deepep":
        return float(num_topk)
    if message_format == "tokenyard":
        return reach(num_nodes, gpus_per_node, num_experts, num_topk)["ranks"]
    raise ValueError(f"message format {message_format!r}: one of {MESSAGE_FORMATS}")


def predict(*, num_nodes: int, gpus_per_node: int, nic_gbps: float, nvlink_gbs: float, num_tokens: int, hidden: int,
            num_topk: int, num_experts: int, dtype: str = "fp8", efficiency: float,
            overhead_us: float = OVERHEAD_US, message_format: str = "deepep", route: str = "rdma") -> dict:
    """One GPU's low-latency dispatch and combine (NOTE [low-latency model]); bandwidths in GB/s, times in µs."""
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {ROUTES}")
    num_ranks = num_nodes * gpus_per_node
    per_token = messages_per_token(num_nodes, gpus_per_node, num_experts, num_topk, message_format)
    messages = num_tokens * per_token
    nic_share = (num_ranks - (1 if route == "rdma" else gpus_per_node)) / num_ranks
    nvlink_share = 0.0 if route == "rdma" else (gpus_per_node - 1) / num_ranks
    wire_bytes_per_us = nic_gbps / 8 * 1e3  # Gb/s -> bytes per µs
    out = {"messages_per_token": per_token, "nic_share": nic_share}
    for op in OPS:
        size = message_bytes(hidden, num_topk, op, message_format, dtype)
        nic, nvl = messages * nic_share * size, messages * nvlink_share * size
        times = {"nic": nic / (wire_bytes_per_us * efficiency), "nvlink": nvl / (nvlink_gbs * 1e3)}
        bound = max(times, key=times.get)
        us = overhead_us + times[bound]
        counted = num_tokens * num_topk * message_bytes(hidden, num_topk, op, "deepep", dtype)
        out[op] = {"us": us, "bound": bound, "message_bytes": size, "messages": messages, "nic_bytes": nic,
                   "nvlink_bytes": nvl, "nic_gbps": nic / us / 1e3, "counted_gbps": counted / us / 1e3}
    return out


def calibrate(us: float, op: str = "dispatch", *, overhead_us: float = OVERHEAD_US, message_format: str = "deepep",
              route: str = "rdma", **setting) -> float:
    """The `efficiency` at which `predict(**setting)` takes `us` for `op`: the model solved for it. Raises
    ValueError where none can: the time leaves nothing after t0, no byte crosses the NIC, NVLink alone takes longer,
    or the NIC would have to beat its line rate."""
    if op not in OPS:
        raise ValueError(f"calibrate on {op!r}: one of {OPS}")
    line = predict(efficiency=1.0, overhead_us=0.0, message_format=message_format, route=route, **setting)[op]
    left_us = us - overhead_us
    if left_us <= 0:
        raise ValueError(f"{us:g} µs leaves no time after t0 = {overhead_us:g} µs")
    if line["nic_bytes"] == 0:
        raise ValueError("no message crosses the NIC there: the time says nothing about it")
    nvlink_us = line["nvlink_bytes"] / (setting["nvlink_gbs"] * 1e3)
    if nvlink_us > left_us:
        raise ValueError(f"NVLink alone takes {nvlink_us:.1f} µs > {left_us:.1f} µs there")
    efficiency = line["nic_bytes"] / (setting["nic_gbps"] / 8 * 1e3) / left_us  # time at line rate / time left
    if efficiency > 1:
        raise ValueError(f"{us:g} µs would need the NIC at {efficiency:.2f} of its line rate")
    return efficiency


def compare(published: PublishedLowLatency, calibrate_ep: Optional[int] = None, *,
            overhead_us: float = OVERHEAD_US) -> dict:
    """The model calibrated on `published`'s dispatch time at `calibrate_ep` ranks (its default point when None)
    beside every time of that table; errors are (predicted - published) / published."""
    calibrate_ep = published.calibrate_ep if calibrate_ep is None else calibrate_ep
    if calibrate_ep not in published.points:
        raise ValueError(f"{published.name} publishes no EP{calibrate_ep}: {sorted(published.points)}")
    efficiency = calibrate(published.points[calibrate_ep][0], "dispatch", overhead_us=overhead_us,
                           **published.setting(calibrate_ep))
    rows = []
    for ep, times in sorted(published.points.items()):
        result = predict(efficiency=efficiency, overhead_us=overhead_us, **published.setting(ep))
        row = {"ep": ep, "nodes": ep // published.gpus_per_node, "nic_share": result["nic_share"]}
        for op, published_us in zip(OPS, times):
            r = result[op]
            row[op] = {"published_us": published_us, "us": r["us"], "error": r["us"] / published_us - 1,
                       "nic_bytes": r["nic_bytes"], "nic_gbps": r["nic_gbps"], "counted_gbps": r["counted_gbps"],
                       "published_counted_gbps": r["counted_gbps"] * r["us"] / published_us}
        rows.append(row)
    return {"published": published.name, "source": published.source, "hardware": published.hardware,
            "calibrated_on": {"ep": calibrate_ep, "op": "dispatch", "us": published.points[calibrate_ep][0]},
            "efficiency": efficiency, "overhead_us": overhead_us, "points": rows}


def default_efficiency() -> float:
    """The efficiency fitted on DeepEP's EP32 dispatch time (NOTE [low-latency model])."""
    return compare(PUBLISHED["deepep"])["efficiency"]


def pair_fits(published: PublishedLowLatency) -> Dict[int, dict]:
    """What each EP's dispatch and combine, fitted together, say of the terms the model leaves out (NOTE
    [low-latency model]): the efficiency and t0 that reproduce both, t0 as a cost per message on the NIC instead (ns),
    and the rate the dispatch would need if its sending and receiving added up (GB/s)."""
    out = {}
    for ep, (dispatch_us, combine_us) in sorted(published.points.items()):
        line = predict(efficiency=1.0, overhead_us=0.0, **published.setting(ep))
        wire_us = {op: line[op]["nic_bytes"] / (published.nic_gbps / 8 * 1e3) for op in OPS}
        efficiency = (wire_us["combine"] - wire_us["dispatch"]) / (combine_us - dispatch_us)
        t0_us = dispatch_us - wire_us["dispatch"] / efficiency
        out[ep] = {"efficiency": efficiency, "t0_us": t0_us,
                   "message_cost_ns": t0_us * 1e3 / (line["dispatch"]["messages"] * line["nic_share"]),
                   "both_directions_gbps": 2 * line["dispatch"]["nic_bytes"] / dispatch_us / 1e3}
    return out


CHOICES = (("deepep", "rdma"), ("deepep", "nvlink"), ("tokenyard", "rdma"), ("tokenyard", "nvlink"))


def nic_bytes_by_choice(published: PublishedLowLatency, ep: int, efficiency: float, *,
                        overhead_us: float = OVERHEAD_US) -> dict:
    """Bytes per GPU on the NIC and the predicted µs of one dispatch and one combine at `published`'s setting and
    `ep` ranks, for each (message format, route) in CHOICES: DeepEP's messages pure RDMA (as published), DeepEP's with
    NVLink for same-node peers, ours (one per rank) pure RDMA, ours with NVLink for same-node peers."""
    out = {}
    for message_format, route in CHOICES:
        result = predict(efficiency=efficiency, overhead_us=overhead_us, message_format=message_format, route=route,
                         **published.setting(ep))
        out[f"{message_format}_{route}"] = {
            "messages_per_token": result["messages_per_token"],
            **{op: {k: result[op][k] for k in ("nic_bytes", "nvlink_bytes", "us", "bound", "message_bytes")}
               for op in OPS}}
    return out


DESCRIPTION = ("Predict the internode low-latency dispatch and combine times per call from a model (nothing is "
               "measured): the messages each GPU puts on the NIC and NVLink, with one efficiency calibrated on a "
               "published time.")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser, add = model_parser(f"{prog} --model --mode low_latency", DESCRIPTION)
    add("mode", choices=MODEL_MODES, default="low_latency", help="low_latency here (normal: the other model)")
    add("nodes", type=int, default=4, help="nodes (default 4)")
    add("gpus_per_node", type=int, default=8, help="GPUs per node (default 8)")
    add("nic_gbps", type=float, default=400.0, help="each GPU's NIC, Gb/s (default 400)")
    add("nvlink_gbs", type=float, default=NVLINK_GBS,
        help=f"NVLink GB/s, with --route nvlink (default {NVLINK_GBS:g})")
    add("num_tokens", type=int, default=128, help="tokens per GPU (default 128)")
    add("hidden_size", type=int, default=7168, help="hidden size (default 7168)")
    add("num_topk", type=int, default=8, help="experts per token (default 8)")
    add("num_experts", type=int, default=256, help="experts (default 256; only our per-rank messages depend on it)")
    add("dtype", choices=("fp8", "bf16"), default="fp8", help="dispatch messages (default fp8)")
    add("message_format", choices=MESSAGE_FORMATS, default="deepep",
        help="deepep: a message per (token, expert); tokenyard: per (token, rank) (default deepep)")
    add("route", choices=ROUTES, default="rdma",
        help="rdma: every other rank through the NIC (pure RDMA); nvlink: same-node peers over NVLink (default rdma)")
    add("efficiency", type=float,
        help="the NIC's achieved share of its line rate (default: calibrated on DeepEP's EP32 dispatch)")
    add("calibrate", type=calibration_type("US"), metavar="EP,US[,OP]",
        help="fit the efficiency to a call of US µs at EP ranks (EP / gpus_per_node nodes) in the setting the other "
             "arguments give, for OP dispatch (default) or combine")
    add("published", choices=sorted(PUBLISHED),
        help="instead: the model beside that project's published low-latency table, calibrated on one point")
    add("calibrate_on", type=int, metavar="EP",
        help="with --published: the point whose dispatch time is fitted (DeepEP: 32, UCCL-EP: 16)")
    add("overhead_us", type=float, default=OVERHEAD_US,
        help=f"t0, the fixed cost of a call, µs (assumed {OVERHEAD_US:g})")
    add("json", metavar="PATH", help="write the prediction as JSON")
    return parser


def main(argv: Sequence[str], prog: str = "python -m tokenyard.tools.bench") -> int:
    args = build_parser(prog).parse_args(argv)
    setting = dict(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, nic_gbps=args.nic_gbps,
                   nvlink_gbs=args.nvlink_gbs, num_tokens=args.num_tokens, hidden=args.hidden_size,
                   num_topk=args.num_topk, num_experts=args.num_experts, dtype=args.dtype)
    try:
        nodes = calibration_nodes(args, args.efficiency is not None)
        if args.published:
            result = _print_published(args)
        else:
            efficiency, fitted = args.efficiency, "given"
            if args.calibrate:
                ep, us, op = args.calibrate
                efficiency = calibrate(us, op, overhead_us=args.overhead_us, message_format=args.message_format,
                                       route=args.route, **{**setting, "num_nodes": nodes})
                fitted = f"fitted on {us:g} µs {op} at EP{ep}"
            elif efficiency is None:
                efficiency, fitted = default_efficiency(), "fitted on DeepEP's EP32 dispatch, 182 µs"
            result = predict(efficiency=efficiency, overhead_us=args.overhead_us, message_format=args.message_format,
                             route=args.route, **setting)
            result["efficiency"] = efficiency
            _print_cluster(args, result, fitted)
    except ValueError as exc:
        print(f"{prog} --model --mode low_latency: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, args, result)
    return 0


def _print_cluster(args, result: dict, fitted: str) -> None:
    print(f"predicted, not measured (NOTE [low-latency model] in tokenyard/tools/bench/model/low_latency.py): "
          f"{args.nodes} nodes x {args.gpus_per_node} GPUs, NIC {args.nic_gbps:g} Gb/s at {result['efficiency']:.4f} "
          f"of it ({fitted}), {args.num_tokens} tokens, hidden {args.hidden_size}, top-{args.num_topk} of "
          f"{args.num_experts}, {args.dtype} dispatch, {args.message_format} messages, route {args.route}, "
          f"t0 {args.overhead_us:g} µs")
    print(f"{result['messages_per_token']:.2f} messages per token, {result['nic_share']:.4f} of them on the NIC")
    print(f"{'op':<9} {'us':>8} {'bound':>7} {'msg bytes':>9} {'NIC MB':>8} {'NVLink MB':>9} {'NIC GB/s':>9}")
    for op in OPS:
        r = result[op]
        print(f"{op:<9} {r['us']:8.1f} {r['bound']:>7} {r['message_bytes']:9d} {r['nic_bytes'] / 1e6:8.3f} "
              f"{r['nvlink_bytes'] / 1e6:9.3f} {r['nic_gbps']:9.1f}")


def _print_published(args) -> dict:
    published = PUBLISHED[args.published]
    result = compare(published, args.calibrate_on, overhead_us=args.overhead_us)
    fit = result["calibrated_on"]
    print(f"predicted, not measured (NOTE [low-latency model] in tokenyard/tools/bench/model/low_latency.py) beside "
          f"{published.source}: {published.hardware}, {published.num_tokens} tokens, hidden {published.hidden}, "
          f"top-{published.num_topk}, FP8 dispatch, BF16 combine, pure RDMA, t0 {args.overhead_us:g} µs")
    print(f"efficiency {result['efficiency']:.4f} of {published.nic_gbps:g} Gb/s, fitted on EP{fit['ep']} dispatch "
          f"({fit['us']:g} µs)")
    print("NIC MB: bytes one GPU sends; GB/s: DeepEP's test's count (every selected pair) over the model's µs and over "
          "the published µs")
    print(f"{'EP':>4} {'nodes':>5} {'NIC share':>9} {'op':<9} {'NIC MB':>7} {'us':>7} {'pub. us':>7} "
          f"{'GB/s':>6} {'pub.':>6} {'error':>7}")
    for row in result["points"]:
        for op in OPS:
            r = row[op]
            print(f"{row['ep']:>4} {row['nodes']:>5} {row['nic_share']:9.4f} {op:<9} {r['nic_bytes'] / 1e6:7.3f} "
                  f"{r['us']:7.1f} {r['published_us']:7.0f} {r['counted_gbps']:6.1f} "
                  f"{r['published_counted_gbps']:6.1f} {r['error']:+7.1%}")
    print("the largest error from EP16 up (all points in brackets), calibrated on each dispatch time in turn:")
    result["each_calibration"] = {}
    for ep in sorted(published.points):
        other = compare(published, ep, overhead_us=args.overhead_us)
        worst = {op: max(abs(p[op]["error"]) for p in other["points"] if p["ep"] >= 16) for op in OPS}
        every = {op: max(abs(p[op]["error"]) for p in other["points"]) for op in OPS}
        result["each_calibration"][ep] = {"efficiency": other["efficiency"], "max_abs_error_from_ep16": worst,
                                          "max_abs_error": every}
        print(f"  EP{ep}: efficiency {other['efficiency']:.4f}, dispatch {worst['dispatch']:.1%} "
              f"({every['dispatch']:.1%}), combine {worst['combine']:.1%} ({every['combine']:.1%})")
    print(f"t0 is assumed; calibrated on EP{fit['ep']} with another t0, the largest error from EP16 up:")
    result["each_t0"] = {}
    for t0 in (0.0, 5.0, 10.0, 20.0):
        try:
            other = compare(published, args.calibrate_on, overhead_us=t0)
        except ValueError as exc:
            print(f"  t0 {t0:g} µs: {exc}")
            continue
        worst = max(abs(p[op]["error"]) for p in other["points"] if p["ep"] >= 16 for op in OPS)
        result["each_t0"][t0] = {"efficiency": other["efficiency"], "max_abs_error_from_ep16": worst}
        print(f"  t0 {t0:g} µs: efficiency {other['efficiency']:.4f}, {worst:.1%}")
    result["pair_fits"] = pair_fits(published)
    print("each EP's dispatch and combine fitted together: the efficiency and t0 (or t0 as a cost per NIC "
          "message); and the rate the dispatch would need if sending and receiving added up:")
    for ep, f in result["pair_fits"].items():
        print(f"  EP{ep}: {f['efficiency']:.4f} and {f['t0_us']:+.1f} µs ({f['message_cost_ns']:+.1f} ns a "
              f"message); {f['both_directions_gbps']:.1f} GB/s")
    result["nic_bytes"] = {}
    print(f"per GPU per call at efficiency {result['efficiency']:.4f}: NIC MB and predicted µs, with DeepEP's messages "
          f"per (token, expert) or ours per (token, rank), every peer through the NIC (rdma) or same-node peers over "
          f"NVLink at {published.nvlink_gbs:g} GB/s (nvlink); msgs: messages per token")
    print(f"{'EP':>4} {'experts':>7} {'op':<9}" + "".join(f" {f'{fmt} {route}':>20}" for fmt, route in CHOICES))
    for ep in sorted(published.points):
        choice = result["nic_bytes"][ep] = nic_bytes_by_choice(published, ep, result["efficiency"],
                                                               overhead_us=args.overhead_us)
        experts = published.setting(ep)["num_experts"]
        print(f"{ep:>4} {experts:>7} {'msgs':<9}" + "".join(
            f" {choice[f'{fmt}_{route}']['messages_per_token']:>20.2f}" for fmt, route in CHOICES))
        for op in OPS:
            print(f"{ep:>4} {experts:>7} {op:<9}" + "".join(
                f" {c[op]['nic_bytes'] / 1e6:9.3f} MB {c[op]['us']:5.1f} µs"
                for c in (choice[f"{fmt}_{route}"] for fmt, route in CHOICES)))
    return result
