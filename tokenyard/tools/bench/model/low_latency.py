"""``python -m tokenyard.tools.bench --model --mode low_latency``: predicted internode low-latency dispatch and combine
times per call (issues 26 and 53), from the model below, its bytes and operations, and one efficiency calibrated on
a published time (with t0 where a table shows it alone). Nothing is measured here: every figure follows from the
arguments, that calibration and the assumptions they name. low_latency_cli.py is its command line.

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
- time = t0 + max(NIC bytes / (efficiency x line rate), NIC work requests / WR rate, NVLink bytes / NVLink rate),
  with the NIC bytes one GPU sends and its work requests (WRs) as operations.py counts them (NOTE [operations
  priced] in pricing.py). Decisions, with their reasons (the figures behind them:
  benchmarks/results/internode_model.md):
  * One direction, not sending plus receiving: by symmetry a GPU receives what it sends, and the NIC is full duplex.
    Added together, the published times would need more than the line rate (`--published` prints the sum's
    rate), so the two directions overlap.
  * A cost per operation is a WR at the NIC's message rate, not a fitted cost per message: DeepEP's messages per
    GPU, T k (R - 1)/R, change with R exactly as its bytes do, so at its one message size a fitted cost would be the
    efficiency (or t0) under another name. The rate is an assumption (NOTE [operations priced]); it binds none of
    DeepEP's published calls, so the tables still fit the efficiency alone, and it prices what they cannot show:
    calls with many more WRs per byte (our combine's weight signals).
  * One efficiency for both operations at every EP of a table: the NIC's achieved share of its line rate, fitted
    on one published dispatch time (by default EP32's, in the middle of each table, as in NOTE [internode model]).
    A share above 1 would be faster than the wire, so `calibrate` refuses it.
  * t0, what a call costs besides its bytes and WRs (the last message's and the counts' flight, the receive's copy
    behind them; a launch is not in a kernel's time), belongs to the code measured, so to each table. DeepEP's
    README table (pure RDMA, early 2025) leaves no point where t0 shows alone: it stays an assumption, 5 µs, and
    its pair fits (`pair_fits`) scatter too widely to take one value from; the results page shows that the 10%
    goal holds for any t0 from 0 to 20 µs. DeepEP's docs/legacy.md table (the same README after PR #173 sent
    same-node peers over NVLink) has one, EP8, where no byte crosses the NIC: t0 is fitted there (`t0_ep`) as the
    dispatch time less NVLink's, at the rate DeepEP's intranode kernels reach (DEEPEP_NVLINK_GBS); it comes out
    several times 5 µs, and with 5 µs that table's EP8 misses by far and its EP16 by more than 10% (the results
    page), so the two tables are two calibrations, each on its own points.
  The published times grow a little faster with R than the bytes do; the model leaves that to its error.
- Our messages (format "tokenyard", NOTE [low-latency dispatch] and NOTE [low-latency combine] in
  include/tokenyard/kernels/): one per (token, destination rank), its header (LOW_LATENCY_MESSAGE_HEADER_BYTES in
  tokenyard/plan/workspace.py) naming the token's choices there, then DeepEP's data and scales; the combine sends
  each source one pre-reduced bf16 row per (token, rank), after k 8-byte weight words, each its own signal: k + 1
  WRs per (token, rank) where DeepEP's combine has one. A token reaches R p_rank ranks (`common.reach`) instead of
  k experts, fewer when experts of one rank are chosen together.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from ....backends.cuda.heuristics import NVLINK_GBS
from ....plan import workspace
from . import operations, pricing
from .common import DEEPEP_NVLINK_GBS, OPS, reach

OVERHEAD_US = 5.0
MESSAGE_FORMATS = ("deepep", "tokenyard")
ROUTES = ("rdma", "nvlink")
DEEPEP_HEADER_BYTES = 16  # internode_ll.cu's dispatch message: an int4 holding the source token index
WEIGHT_WORD_BYTES = 8  # our combine's (tag << 32) | float32 weight words, k per (token, rank)
TEST_EXPERTS = 288  # DeepEP's and UCCL-EP's low-latency tests' default; 256 where 288 does not divide over EP


@dataclasses.dataclass(frozen=True)
class PublishedLowLatency:
    """One project's published low-latency table and the setting it states."""
    name: str
    source: str
    hardware: str
    nic_gbps: float
    points: Dict[int, Tuple[float, float]]  # EP ranks -> (dispatch, combine) µs per call
    calibrate_ep: int  # the point whose dispatch time fits the efficiency by default
    route: str = "rdma"  # how its same-node peers are reached (NOTE [low-latency model])
    t0_ep: Optional[int] = None  # the point, with no byte on the NIC, whose dispatch time fits t0 (None: assumed)
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
    # DeepEP main's docs/legacy.md, V1's table as its README had it after "News (2025.06.05): low-latency kernels
    # now leverage NVLink as much as possible" (PR #173): same-node peers over NVLink, though still headed "pure
    # RDMA" (its EP8 moves more than the NIC carries: benchmarks/results/internode_model.md). Its EP128 and EP256
    # rows repeat the README's above, so they are left to that table.
    "deepep_nvlink": PublishedLowLatency(
        "deepep_nvlink", "DeepEP docs/legacy.md", "H800, CX7 InfiniBand 400 Gb/s per GPU, NVLink within a node",
        400.0, {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0)}, calibrate_ep=32,
        route="nvlink", t0_ep=8, nvlink_gbs=DEEPEP_NVLINK_GBS),
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
            overhead_us: float = OVERHEAD_US, message_format: str = "deepep", route: str = "rdma",
            wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> dict:
    """One GPU's low-latency dispatch and combine (NOTE [low-latency model]); bandwidths in GB/s, times in µs,
    `wr_rate` in WRs per µs (millions per second). Raises ValueError for an unknown format or route, or experts that
    do not divide over the ranks."""
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
        counts = pricing.low_latency_counts(op, message_format, route, num_nodes=num_nodes,
                                            gpus_per_node=gpus_per_node, num_tokens=num_tokens, hidden=hidden,
                                            num_topk=num_topk, num_experts=num_experts, dtype=dtype)
        wrs = operations.work_requests(counts, route)
        terms = {"nic": nic / (wire_bytes_per_us * efficiency), "wr": pricing.work_request_us(wrs, wr_rate),
                 "nvlink": nvl / (nvlink_gbs * 1e3)}
        bound = max(terms, key=terms.get)
        us = overhead_us + terms[bound]
        counted = num_tokens * num_topk * message_bytes(hidden, num_topk, op, "deepep", dtype)
        out[op] = {"us": us, "bound": bound, "terms_us": terms, "message_bytes": size, "messages": messages,
                   "nic_bytes": nic, "nvlink_bytes": nvl, "work_requests": wrs,
                   "wr_binds_below": pricing.binds_below(wrs, max(terms["nic"], terms["nvlink"])),
                   "quiets": counts["quiets"], "nic_gbps": nic / us / 1e3, "counted_gbps": counted / us / 1e3}
    return out


def calibrate(us: float, op: str = "dispatch", *, overhead_us: float = OVERHEAD_US, message_format: str = "deepep",
              route: str = "rdma", wr_rate: float = pricing.WORK_REQUESTS_PER_US, **setting) -> float:
    """The `efficiency` at which `predict(**setting)` takes `us` for `op`: the model solved for it. Raises
    ValueError where none can: the time leaves nothing after t0, no byte crosses the NIC, NVLink or the WRs alone
    take longer, or the NIC would have to beat its line rate."""
    if op not in OPS:
        raise ValueError(f"calibrate on {op!r}: one of {OPS}")
    line = predict(efficiency=1.0, overhead_us=0.0, message_format=message_format, route=route, wr_rate=wr_rate,
                   **setting)[op]
    left_us = us - overhead_us
    if left_us <= 0:
        raise ValueError(f"{us:g} µs leaves no time after t0 = {overhead_us:g} µs")
    if line["nic_bytes"] == 0:
        raise ValueError("no message crosses the NIC there: the time says nothing about it")
    for name, alone in (("nvlink", "NVLink alone takes"), ("wr", "The WRs alone take")):
        if line["terms_us"][name] > left_us:
            raise ValueError(f"{alone} {line['terms_us'][name]:.1f} µs > {left_us:.1f} µs there")
    efficiency = line["terms_us"]["nic"] / left_us  # time at line rate / time left
    if efficiency > 1:
        raise ValueError(f"{us:g} µs would need the NIC at {efficiency:.2f} of its line rate")
    return efficiency


def fit_overhead(published: PublishedLowLatency, op: str = "dispatch", *,
                 wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> float:
    """t0 from `published`'s time of `op` at its `t0_ep`, where no byte crosses the NIC: that time less the
    slowest other term (NVLink's). Raises ValueError where the table names no such point or bytes cross there."""
    ep = published.t0_ep
    if ep is None or ep not in published.points:
        raise ValueError(f"{published.name} names no point to fit t0 on")
    line = predict(efficiency=1.0, overhead_us=0.0, route=published.route, wr_rate=wr_rate,
                   **published.setting(ep))[op]
    if line["nic_bytes"]:
        raise ValueError(f"bytes cross the NIC at {published.name}'s EP{ep}: its time does not show t0 alone")
    return published.points[ep][OPS.index(op)] - line["us"]


def table_overhead(published: PublishedLowLatency, overhead_us: Optional[float] = None, *,
                   wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> float:
    """`overhead_us` where given, else the table's t0: fitted on its `t0_ep`, or the assumed OVERHEAD_US."""
    if overhead_us is not None:
        return overhead_us
    return OVERHEAD_US if published.t0_ep is None else fit_overhead(published, wr_rate=wr_rate)


def compare(published: PublishedLowLatency, calibrate_ep: Optional[int] = None, *,
            overhead_us: Optional[float] = None, wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> dict:
    """The model calibrated on `published`'s dispatch time at `calibrate_ep` ranks (its default point when None),
    with t0 `overhead_us` (None: the table's, `table_overhead`), beside every time of that table; errors are
    (predicted - published) / published. `wr_rate_at_least`: the lowest WR rate the published time allows (below
    it the WRs alone would take longer)."""
    calibrate_ep = published.calibrate_ep if calibrate_ep is None else calibrate_ep
    if calibrate_ep not in published.points:
        raise ValueError(f"{published.name} publishes no EP{calibrate_ep}: {sorted(published.points)}")
    t0 = table_overhead(published, overhead_us, wr_rate=wr_rate)
    efficiency = calibrate(published.points[calibrate_ep][0], "dispatch", overhead_us=t0, route=published.route,
                           wr_rate=wr_rate, **published.setting(calibrate_ep))
    rows = []
    for ep, times in sorted(published.points.items()):
        result = predict(efficiency=efficiency, overhead_us=t0, route=published.route, wr_rate=wr_rate,
                         **published.setting(ep))
        row = {"ep": ep, "nodes": ep // published.gpus_per_node, "nic_share": result["nic_share"]}
        for op, published_us in zip(OPS, times):
            r = result[op]
            row[op] = {"published_us": published_us, "error": r["us"] / published_us - 1,
                       "wr_rate_at_least": r["work_requests"] / (published_us - t0),
                       "published_counted_gbps": r["counted_gbps"] * r["us"] / published_us,
                       **{k: r[k] for k in ("us", "bound", "terms_us", "nic_bytes", "nvlink_bytes", "work_requests",
                                            "wr_binds_below", "nic_gbps", "counted_gbps")}}
        rows.append(row)
    return {"published": published.name, "source": published.source, "hardware": published.hardware,
            "route": published.route, "calibrated_on": {"ep": calibrate_ep, "op": "dispatch",
                                                        "us": published.points[calibrate_ep][0]},
            "efficiency": efficiency, "overhead_us": t0,
            "overhead_fitted_on": ({"ep": published.t0_ep, "op": "dispatch"}
                                   if overhead_us is None and published.t0_ep is not None else None),
            "wr_rate": wr_rate, "points": rows}


def default_efficiency() -> float:
    """The efficiency fitted on DeepEP's EP32 dispatch time (NOTE [low-latency model])."""
    return compare(PUBLISHED["deepep"])["efficiency"]


def pair_fits(published: PublishedLowLatency) -> Dict[int, dict]:
    """What each EP's dispatch and combine, fitted together, say of the terms the model leaves out or assumes (NOTE
    [low-latency model]): the efficiency and t0 that reproduce both, t0 as a cost per NIC WR instead (ns), and the
    rate the dispatch would need if its sending and receiving added up (GB/s). Points where no byte crosses the NIC,
    or NVLink's time is not below the NIC's, say nothing of the NIC and are left out."""
    out = {}
    for ep, (dispatch_us, combine_us) in sorted(published.points.items()):
        line = predict(efficiency=1.0, overhead_us=0.0, route=published.route, **published.setting(ep))
        if any(line[op]["bound"] != "nic" for op in OPS):
            continue
        wire_us = {op: line[op]["terms_us"]["nic"] for op in OPS}
        efficiency = (wire_us["combine"] - wire_us["dispatch"]) / (combine_us - dispatch_us)
        t0_us = dispatch_us - wire_us["dispatch"] / efficiency
        out[ep] = {"efficiency": efficiency, "t0_us": t0_us,
                   "wr_cost_ns": t0_us * 1e3 / line["dispatch"]["work_requests"],
                   "both_directions_gbps": 2 * line["dispatch"]["nic_bytes"] / dispatch_us / 1e3}
    return out


CHOICES = (("deepep", "rdma"), ("deepep", "nvlink"), ("tokenyard", "rdma"), ("tokenyard", "nvlink"))


def nic_bytes_by_choice(published: PublishedLowLatency, ep: int, efficiency: float, *,
                        overhead_us: float = OVERHEAD_US, wr_rate: float = pricing.WORK_REQUESTS_PER_US) -> dict:
    """Bytes and WRs per GPU on the NIC and the predicted µs of one dispatch and one combine at `published`'s setting
    and `ep` ranks, for each (message format, route) in CHOICES: DeepEP's messages pure RDMA, DeepEP's with NVLink
    for same-node peers, ours (one per rank) pure RDMA, ours with NVLink for same-node peers."""
    out = {}
    for message_format, route in CHOICES:
        result = predict(efficiency=efficiency, overhead_us=overhead_us, message_format=message_format, route=route,
                         wr_rate=wr_rate, **published.setting(ep))
        out[f"{message_format}_{route}"] = {
            "messages_per_token": result["messages_per_token"],
            **{op: {k: result[op][k] for k in ("nic_bytes", "nvlink_bytes", "work_requests", "wr_binds_below", "us",
                                               "bound", "message_bytes")}
               for op in OPS}}
    return out
