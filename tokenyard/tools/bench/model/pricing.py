"""What an internode call's operations cost in ``python -m tokenyard.tools.bench --model`` (issue 53, item 3): the
work requests its NIC executes, as operations.py counts them, at a NIC's message rate. normal.py and low_latency.py
set this term beside their bytes; nothing here is measured.

NOTE [operations priced]
Both models time a call as t0 + max(NIC bytes / (efficiency x line rate), NIC work requests / WR rate, NVLink bytes /
NVLink rate); normal mode adds its RDMA stage to the max (NOTE [internode model] in normal.py). Decisions:
- What a work request (WR) is: `operations.work_requests`, every put, signal and atomic a rank posts to a rank
  across the NIC (another node's; in the "rdma" route, the node's too). The size does not matter: an 8-byte weight
  signal costs the NIC one WR, as a 14 KB row does. So the term is where small operations cost what bytes hide:
  tokenyard's low-latency combine sends each of a token's k weights as its own signal, k + 1 WRs per (token, rank),
  where DeepEP sends one.
- Quiets, fences and barriers post no WR: a quiet polls its QPs' completions, so it costs the flight of the last
  put, which t0 holds. They are left unpriced, a known omission: tokenyard quiets once per sending thread (NOTE
  [operation counts]), a load on the GPU no published figure can price; the models print the count.
- One rate, `WORK_REQUESTS_PER_US`, an assumption: the lower end of the 330 to 370 million messages per second that
  NVIDIA's ConnectX-7 datasheet states (the datasheet is not among this project's sources). It is a NIC's best,
  small messages on many QPs; what the WRs a GPU posts through IBGDA reach is published nowhere we know.
- The published tables cannot fit it. DeepEP's calls carry kilobytes per WR (a 7 or 14 KB message each, and a
  count or flag per expert), so at any rate above the lowest each published time allows (its WRs over its time
  less t0, a few million per second; `--published` prints it) the bytes' term is the larger one, and the rate
  changes no prediction. The tables fit the efficiency (and t0
  where no byte crosses the NIC); the rate stays named, and the models print for each call the rate below which
  its WRs would set its time (`wr_binds_below`, per µs, which is millions per second).
- A max, not a sum: a NIC works on many QPs' descriptors while it moves other WRs' bytes (DeepEP posts on one QP
  per local expert), so its message rate and its bandwidth are two ceilings of one pipelined engine, and the
  nearer one sets the time. A sum would hold for one WR in flight at a time. At DeepEP's published points the two
  differ by the WR term itself, a few µs: nothing published tells them apart.
"""

from __future__ import annotations

from typing import Optional

from . import operations

WORK_REQUESTS_PER_US = 330.0  # million WRs per second (NOTE [operations priced]: ConnectX-7's datasheet, low end)


def add_wr_rate_argument(add) -> None:
    """Both models' --wr_rate (`add` is common.model_parser's)."""
    add("wr_rate", type=float, default=WORK_REQUESTS_PER_US,
        help=f"work requests a NIC executes per µs, millions per second (default {WORK_REQUESTS_PER_US:g}, "
             "ConnectX-7's datasheet, an assumption: NOTE [operations priced])")


def work_request_us(work_requests: float, wr_rate: float) -> float:
    """µs for `work_requests` at `wr_rate` WRs per µs (millions per second); raises ValueError for a rate <= 0."""
    if wr_rate <= 0:
        raise ValueError(f"a WR rate of {wr_rate:g} per µs")
    return work_requests / wr_rate


def binds_below(work_requests: float, other_us: float) -> Optional[float]:
    """The WR rate (per µs) below which `work_requests` take longer than `other_us`, the call's slowest other term:
    where WRs would start to set its time (None where nothing else takes time)."""
    return work_requests / other_us if other_us > 0 else None


def low_latency_counts(op: str, message_format: str, route: str, *, num_nodes: int, gpus_per_node: int,
                       num_tokens: int, hidden: int, num_topk: int, num_experts: int, dtype: str) -> dict:
    """operations.py's counts of a low-latency `op` for DeepEP's messages (format "deepep", in `route`) or ours
    ("tokenyard": the node's ranks by stores; `work_requests` with route "rdma" puts them on the NIC as well).
    Raises ValueError for an unknown format, or experts that do not divide over the ranks."""
    args = (op, num_tokens, num_topk, num_experts, num_nodes, gpus_per_node, hidden)
    if message_format == "deepep":
        return operations.deepep_low_latency(*args, route=route, fp8=dtype == "fp8")
    if message_format == "tokenyard":
        return operations.tokenyard_low_latency(*args, fp8=dtype == "fp8")
    raise ValueError(f"message format {message_format!r}: deepep or tokenyard")


def normal_counts(op: str, row_format: str, *, num_nodes: int, gpus_per_node: int, num_tokens: int, hidden: int,
                  num_topk: int, num_experts: int, dtype: str) -> dict:
    """operations.py's counts of a normal-mode `op`: DeepEP's kernels (format "deepep") or ours ("tokenyard").
    Routing is uniform over all experts there (no group limit). Raises ValueError as `low_latency_counts`."""
    args = (op, num_tokens, num_topk, num_experts, num_nodes, gpus_per_node, hidden)
    if row_format == "deepep":
        return operations.deepep_normal(*args, fp8=dtype == "fp8")
    if row_format == "tokenyard":
        return operations.tokenyard_normal(*args)
    raise ValueError(f"row format {row_format!r}: deepep or tokenyard")
