"""What the two models of ``python -m tokenyard.tools.bench --model`` share: the modes and operations, where a
token's experts lie (NOTE [internode model] in normal.py), the NVLink rate of DeepEP's published H800s, and the
command line's pieces. normal.py and low_latency.py import from here, never from each other."""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Optional, Tuple

MODEL_MODES = ("normal", "low_latency")  # --mode, as the benchmark spells its modes
OPS = ("dispatch", "combine")
DEEPEP_NVLINK_GBS = 153.0  # what DeepEP's intranode dispatch reaches on the H800s of its published tables


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
            "remote_ranks": ranks * (num_nodes - 1) / num_nodes, "ranks_per_node": ranks / nodes}


def calibration_type(unit: str):
    """The argparse type of `--calibrate EP,<unit>[,dispatch|combine]` (both models): -> (ep, value, op)."""
    def parse(text: str) -> Tuple[int, float, str]:
        parts = text.split(",")
        try:
            ep, value, op = int(parts[0]), float(parts[1]), (parts[2] if len(parts) > 2 else "dispatch")
        except (IndexError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r}: EP,{unit} or EP,{unit},dispatch|combine") from None
        if len(parts) > 3 or op not in OPS:
            raise argparse.ArgumentTypeError(f"{text!r}: EP,{unit} or EP,{unit},dispatch|combine")
        return ep, value, op

    return parse


def model_parser(prog: str, description: str):
    """A model's argument parser and its `add(name, ...)`, which also accepts the name spelt with dashes."""
    parser = argparse.ArgumentParser(prog=prog, description=description)

    def add(name: str, **kwargs) -> None:
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*spellings, dest=name, **kwargs)

    return parser, add


def calibration_nodes(args: argparse.Namespace, efficiency_given: bool) -> Optional[int]:
    """The checks both models make of their calibration arguments; -> the nodes of `--calibrate`'s EP, if given.

    Raises:
        ValueError: --calibrate_on without --published, --published with an efficiency of its own, an EP that
            is not whole nodes.
    """
    if args.calibrate_on is not None and not args.published:
        raise ValueError("--calibrate_on names a point of a --published table")
    if args.published and (args.calibrate or efficiency_given):
        raise ValueError("--published fits its own efficiency: name its point with --calibrate_on EP")
    if not args.calibrate:
        return None
    ep = args.calibrate[0]
    if ep % args.gpus_per_node:
        raise ValueError(f"EP{ep} is not whole nodes of {args.gpus_per_node} GPUs")
    return ep // args.gpus_per_node


def write_json(path: str, args: argparse.Namespace, result: dict) -> None:
    """A prediction as JSON, with the commit and date it was made at and every setting; `model_prices_operations`:
    the times price the NIC's work requests beside the bytes (NOTE [operations priced] in pricing.py)."""
    from ..report import git_commit

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(path, "w") as f:
        json.dump({"predicted": True, "model_prices_operations": True, "commit": git_commit(), "date": date,
                   "settings": vars(args), **result}, f, indent=1)
