"""``python -m tokenyard.tools.bench --model --mode low_latency``: the command line of the low-latency model
(NOTE [low-latency model] in low_latency.py) and what it prints. Nothing is measured: every figure follows from the
arguments, the calibration and the assumptions they name."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ....backends.cuda.heuristics import NVLINK_GBS
from . import pricing
from .common import MODEL_MODES, OPS, calibration_nodes, calibration_type, model_parser, write_json
from .low_latency import (CHOICES, MESSAGE_FORMATS, OVERHEAD_US, PUBLISHED, ROUTES, calibrate, compare, fit_overhead,
                          nic_bytes_by_choice, pair_fits, predict)

NOTE = "NOTE [low-latency model] in tokenyard/tools/bench/model/low_latency.py"
DESCRIPTION = ("Predict the internode low-latency dispatch and combine times per call from a model (nothing is "
               "measured): the bytes each GPU puts on the NIC and NVLink and the work requests its NIC executes "
               "(operations.py's counts at a NIC's message rate), with one efficiency calibrated on a published time.")


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
    add("num_experts", type=int, default=256, help="experts (default 256; they must divide over the ranks)")
    add("dtype", choices=("fp8", "bf16"), default="fp8", help="dispatch messages (default fp8)")
    add("message_format", choices=MESSAGE_FORMATS, default="deepep",
        help="deepep: a message per (token, expert); tokenyard: per (token, rank) (default deepep)")
    add("route", choices=ROUTES, default="rdma",
        help="rdma: every other rank through the NIC (pure RDMA); nvlink: same-node peers over NVLink (default rdma)")
    pricing.add_wr_rate_argument(add)
    add("efficiency", type=float,
        help="the NIC's achieved share of its line rate (default: the --calibration_table's)")
    add("calibrate", type=calibration_type("US"), metavar="EP,US[,OP]",
        help="fit the efficiency to a call of US µs at EP ranks (EP / gpus_per_node nodes) in the setting the other "
             "arguments give, for OP dispatch (default) or combine")
    add("calibration_table", choices=sorted(PUBLISHED), default="deepep",
        help="without --efficiency or --calibrate: the published table whose calibration sets the efficiency and t0 "
             "(default deepep: its EP32 dispatch, t0 assumed; deepep_nvlink: its EP32 dispatch, t0 on its EP8)")
    add("published", choices=sorted(PUBLISHED),
        help="instead: the model beside that project's published low-latency table, calibrated on one point (and "
             "deepep_nvlink's t0 on its EP8)")
    add("calibrate_on", type=int, metavar="EP",
        help="with --published: the point whose dispatch time is fitted (default 32; UCCL-EP: 16)")
    add("overhead_us", type=float,
        help=f"t0, the fixed cost of a call, µs (default: the calibration's; {OVERHEAD_US:g} assumed where no "
             "published point fits it)")
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
            t0 = OVERHEAD_US if args.overhead_us is None else args.overhead_us
            if args.calibrate:
                ep, us, op = args.calibrate
                efficiency = calibrate(us, op, overhead_us=t0, message_format=args.message_format, route=args.route,
                                       wr_rate=args.wr_rate, **{**setting, "num_nodes": nodes})
                fitted = f"fitted on {us:g} µs {op} at EP{ep}"
            elif args.efficiency is not None:
                efficiency, fitted = args.efficiency, "given"
            else:
                table = PUBLISHED[args.calibration_table]
                fit = compare(table, overhead_us=args.overhead_us, wr_rate=args.wr_rate)
                efficiency, t0, on = fit["efficiency"], fit["overhead_us"], fit["calibrated_on"]
                fitted = f"fitted on {table.source}'s EP{on['ep']} {on['op']}, {on['us']:g} µs" + (
                    f"; t0 on its EP{fit['overhead_fitted_on']['ep']}" if fit["overhead_fitted_on"] else "")
            result = predict(efficiency=efficiency, overhead_us=t0, message_format=args.message_format,
                             route=args.route, wr_rate=args.wr_rate, **setting)
            result.update(efficiency=efficiency, overhead_us=t0, wr_rate=args.wr_rate, calibration=fitted)
            _print_cluster(args, result, fitted)
    except ValueError as exc:
        print(f"{prog} --model --mode low_latency: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, args, result)
    return 0


def _rate(rate) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def _print_cluster(args, result: dict, fitted: str) -> None:
    print(f"predicted, not measured ({NOTE}): {args.nodes} nodes x {args.gpus_per_node} GPUs, NIC {args.nic_gbps:g} "
          f"Gb/s at {result['efficiency']:.4f} of it ({fitted}), {args.wr_rate:g} WRs per µs, {args.num_tokens} "
          f"tokens, hidden {args.hidden_size}, top-{args.num_topk} of {args.num_experts}, {args.dtype} dispatch, "
          f"{args.message_format} messages, route {args.route}, t0 {result['overhead_us']:.1f} µs")
    print(f"{result['messages_per_token']:.2f} messages per token, {result['nic_share']:.4f} of them on the NIC; "
          "terms in µs (the largest sets the time after t0); WRs bind below: the WR rate, per µs, under which the "
          "WRs would set the time")
    print(f"{'op':<9} {'us':>8} {'bound':>6} {'msg bytes':>9} {'NIC MB':>8} {'NVLink MB':>9} {'NIC WRs':>8} "
          f"{'NIC us':>7} {'WR us':>7} {'NVL us':>7} {'bind <':>7} {'quiets':>7} {'NIC GB/s':>8}")
    for op in OPS:
        r = result[op]
        terms = r["terms_us"]
        print(f"{op:<9} {r['us']:8.1f} {r['bound']:>6} {r['message_bytes']:9d} {r['nic_bytes'] / 1e6:8.3f} "
              f"{r['nvlink_bytes'] / 1e6:9.3f} {r['work_requests']:8.0f} {terms['nic']:7.1f} {terms['wr']:7.1f} "
              f"{terms['nvlink']:7.1f} {_rate(r['wr_binds_below']):>7} {r['quiets']:7.0f} {r['nic_gbps']:8.1f}")


def _print_published(args) -> dict:
    published = PUBLISHED[args.published]
    result = compare(published, args.calibrate_on, overhead_us=args.overhead_us, wr_rate=args.wr_rate)
    fit, t0 = result["calibrated_on"], result["overhead_us"]
    how_t0 = (f"fitted on EP{published.t0_ep}'s dispatch, where no byte crosses the NIC"
              if result["overhead_fitted_on"] else "given" if args.overhead_us is not None else "assumed")
    print(f"predicted, not measured ({NOTE}) beside {published.source}: {published.hardware}, {published.num_tokens} "
          f"tokens, hidden {published.hidden}, top-{published.num_topk}, FP8 dispatch, BF16 combine, route "
          f"{published.route}, NVLink {published.nvlink_gbs:g} GB/s, {args.wr_rate:g} WRs per µs")
    print(f"efficiency {result['efficiency']:.4f} of {published.nic_gbps:g} Gb/s, fitted on EP{fit['ep']} dispatch "
          f"({fit['us']:g} µs); t0 {t0:.1f} µs ({how_t0})")
    print("NIC MB and WRs: what one GPU sends; GB/s: DeepEP's test's count (every selected pair) over the model's µs "
          "and over the published µs")
    print(f"{'EP':>4} {'nodes':>5} {'NIC share':>9} {'op':<9} {'NIC MB':>7} {'NIC WRs':>7} {'us':>7} {'bound':>6} "
          f"{'pub. us':>7} {'GB/s':>6} {'pub.':>6} {'error':>7}")
    for row in result["points"]:
        for op in OPS:
            r = row[op]
            print(f"{row['ep']:>4} {row['nodes']:>5} {row['nic_share']:9.4f} {op:<9} {r['nic_bytes'] / 1e6:7.3f} "
                  f"{r['work_requests']:7.0f} {r['us']:7.1f} {r['bound']:>6} {r['published_us']:7.0f} "
                  f"{r['counted_gbps']:6.1f} {r['published_counted_gbps']:6.1f} {r['error']:+7.1%}")
    lowest = max((row[op]["wr_rate_at_least"], row["ep"], op) for row in result["points"] for op in OPS)
    share = max(row[op]["terms_us"]["wr"] / max(row[op]["terms_us"]["nic"], row[op]["terms_us"]["nvlink"])
                for row in result["points"] for op in OPS)
    result["wr_rate_at_least"] = lowest[0]
    result["wr_term_share_at_most"] = share
    print(f"WRs: every published time allows any WR rate above {lowest[0]:.2f} per µs (the tightest, EP{lowest[1]} "
          f"{lowest[2]}); at {args.wr_rate:g} per µs the WR term is at most {share:.1%} of the larger bytes' term")
    print("the largest error over every point (from EP16 up in brackets), calibrated on each dispatch time in turn:")
    result["each_calibration"] = {}
    for ep in sorted(published.points):
        try:
            other = compare(published, ep, overhead_us=args.overhead_us, wr_rate=args.wr_rate)
        except ValueError as exc:
            print(f"  EP{ep}: {exc}")
            continue
        worst = {op: max(abs(p[op]["error"]) for p in other["points"] if p["ep"] >= 16) for op in OPS}
        every = {op: max(abs(p[op]["error"]) for p in other["points"]) for op in OPS}
        result["each_calibration"][ep] = {"efficiency": other["efficiency"], "max_abs_error_from_ep16": worst,
                                          "max_abs_error": every}
        print(f"  EP{ep}: efficiency {other['efficiency']:.4f}, dispatch {every['dispatch']:.1%} "
              f"({worst['dispatch']:.1%}), combine {every['combine']:.1%} ({worst['combine']:.1%})")
    _print_each_t0(args, published, result)
    result["pair_fits"] = pair_fits(published)
    print("each EP's dispatch and combine fitted together (where the NIC binds both): the efficiency and t0 (or t0 "
          "as a cost per NIC WR); and the rate the dispatch would need if sending and receiving added up:")
    for ep, f in result["pair_fits"].items():
        print(f"  EP{ep}: {f['efficiency']:.4f} and {f['t0_us']:+.1f} µs ({f['wr_cost_ns']:+.1f} ns a WR); "
              f"{f['both_directions_gbps']:.1f} GB/s")
    _print_choices(args, published, result)
    return result


def _print_each_t0(args, published, result: dict) -> None:
    """The errors with another t0: a few values where it is assumed; where it is fitted, the same point's combine
    and the other table's assumption."""
    if result["overhead_fitted_on"]:
        others = [(f"fitted on EP{published.t0_ep}'s combine", fit_overhead(published, "combine",
                                                                           wr_rate=args.wr_rate)),
                  ("assumed, as for the table without such a point", OVERHEAD_US)]
    else:
        others = [("assumed", t0) for t0 in (0.0, 5.0, 10.0, 20.0)]
    print(f"calibrated on EP{result['calibrated_on']['ep']} with another t0, the largest error over every point "
          "(from EP16 up in brackets):")
    result["each_t0"] = {}
    for how, t0 in others:
        try:
            other = compare(published, args.calibrate_on, overhead_us=t0, wr_rate=args.wr_rate)
        except ValueError as exc:
            print(f"  t0 {t0:.1f} µs ({how}): {exc}")
            continue
        every = max(abs(p[op]["error"]) for p in other["points"] for op in OPS)
        worst = max(abs(p[op]["error"]) for p in other["points"] if p["ep"] >= 16 for op in OPS)
        result["each_t0"][f"{t0:g}"] = {"how": how, "efficiency": other["efficiency"], "max_abs_error": every,
                                        "max_abs_error_from_ep16": worst}
        print(f"  t0 {t0:.1f} µs ({how}): efficiency {other['efficiency']:.4f}, {every:.1%} ({worst:.1%})")


def _print_choices(args, published, result: dict) -> None:
    result["nic_bytes"] = {}
    print(f"per GPU per call at efficiency {result['efficiency']:.4f}, t0 {result['overhead_us']:.1f} µs: NIC MB, "
          f"predicted µs and NIC WRs, with DeepEP's messages per (token, expert) or ours per (token, rank), every "
          f"peer through the NIC (rdma) or same-node peers over NVLink at {published.nvlink_gbs:g} GB/s (nvlink); "
          "msgs: messages per token; bind <: the WR rate, per µs, under which the WRs would set the time")
    print(f"{'EP':>4} {'experts':>7} {'op':<9}" + "".join(f" {f'{fmt} {route}':>30}" for fmt, route in CHOICES))
    for ep in sorted(published.points):
        choice = result["nic_bytes"][ep] = nic_bytes_by_choice(published, ep, result["efficiency"],
                                                               overhead_us=result["overhead_us"],
                                                               wr_rate=args.wr_rate)
        experts = published.setting(ep)["num_experts"]
        print(f"{ep:>4} {experts:>7} {'msgs':<9}" + "".join(
            f" {choice[f'{fmt}_{route}']['messages_per_token']:>30.2f}" for fmt, route in CHOICES))
        for op in OPS:
            print(f"{ep:>4} {experts:>7} {op:<9}" + "".join(
                f" {c[op]['nic_bytes'] / 1e6:6.3f} MB {c[op]['us']:5.1f} µs {c[op]['work_requests']:5.0f} WRs"
                f" {_rate(c[op]['wr_binds_below']):>5}" for c in (choice[f"{fmt}_{route}"] for fmt, route in CHOICES)))
