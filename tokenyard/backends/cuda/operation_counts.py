"""The transport seam's operation counts (NOTE [operation counters] in include/tokenyard/operation_counts.cuh): the
counters' table as a rank's counts, those grouped by destination kind, and the exact counts an internode call makes
from its routing (docs/cuda_backend.md, "Operation counters"), which tests/gpu/test_operation_counts_cuda.py compares
the counters with.

A rank's counts ("per peer") are a dict: `puts`, `put_bytes`, `put_signals` and `signals`, each a list with an
entry per destination rank; `quiets` and `fences`, numbers. `by_kind` sums the lists over the destination kinds of
NOTE [operation counts] (tools/bench/model/operations.py): self (this rank), node (another rank of its node), remote
(a rank of another node), into its keys puts_self, ..., signals_remote, beside quiets and fences.

NOTE [exact operation counts]
What one call of each internode kernel asks of the seam, from the routing of every rank (the kernels' code, not the
uniform-routing expectations of NOTE [operation counts]); one launch, no rank mask, no recv hook, the grid of B blocks
(a quiet per block, NOTE [block quiet] in include/tokenyard/transport.cuh). Rank r is local rank l of node n, nodes
of P ranks; hits(s) is the bool [T_s, R] "token t of rank s has an expert (0 <= e < E) on rank q", L = E / R local
experts.
  low-latency dispatch (kernels with ranks on other nodes): to each rank q of another node, hits(r)[:, q].sum()
    puts (a message per (token, rank), put whole by the warp that completes it) of header + data + scales bytes
    (80 + 2H bf16, 80 + H + H / 32 FP8, 80 + H / 2 + H / 16 NVFP4) and L + 1 signals (its expert counts, then
    its token count); B quiets (publish_when_last). Nothing to this node's ranks, which take stores.
  low-latency combine: to each rank q of another node, hits(q)[:, r].sum() puts (a row per message q sent r) of 2H
    bytes, one put with its signal of r's weights, T_r k words of 8 bytes (none where T_r is 0), and 1 signal (its
    flag); B quiets.
  normal dispatch (NOTE [internode kernels]; every row through the seam, the node's by NVSHMEM P2P): signals to rank
    q, 1 (the start barrier, block 0's) + B [q's local rank is l] (stage 1) + B [q on node n] (stage 2); to forwarder (m, l)
    ceil(rows_m / 4) puts of rows_m x S bytes in all, rows_m the tokens of r that reach node m, S = align16(b + 4P),
    b = align16 of the packed row; to rank (n, j), sum over nodes k of rank (k, l)'s tokens on (n, j), b bytes each;
    2 B quiets.
  normal combine: the same signals; to rank (k, l) ceil(rows / 4) puts, rows the tokens of (k, l) that reach node
    n, of 2H + 16 ceil(4 k / 16) bytes each (k the combine's top-k weights, 0 without); 2 B quiets.
No kernel calls fence: fences are 0.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Sequence

import torch

from ...plan import headers, workspace

_ENUM = headers.enum("operation_counts.cuh", "CountedOperation")
# The counters' columns, as the header orders them: kCountedPutBytes -> put_bytes.
OPERATIONS = tuple(re.sub(r"(?<!^)([A-Z])", r"_\1", name[len("kCounted"):]).lower()
                   for name, _ in sorted(((n, v) for n, v in _ENUM.items() if n.startswith("kCounted")),
                                         key=lambda item: item[1]))
PER_PEER = ("puts", "put_bytes", "put_signals", "signals")
PER_CALL = ("quiets", "fences")
KINDS = ("self", "node", "remote")
CHUNK_ROWS = headers.constant("kernels/internode.cuh", "kInternodeChunkRows")
CASTS = (0, 1, 2)  # LowLatencyDispatchRequest.cast: bf16, FP8, NVFP4


def zero(num_ranks: int) -> dict:
    """A rank's counts, all zero."""
    counts = {op: [0] * num_ranks for op in PER_PEER}
    counts.update({op: 0 for op in PER_CALL})
    return counts


def from_table(table: torch.Tensor) -> dict:
    """A rank's counts from the counters' table ([1 + R, len(OPERATIONS)] int64: row 0 what names no rank, row
    1 + q what went to rank q)."""
    columns = {op: table[:, i] for i, op in enumerate(OPERATIONS)}
    counts = {op: [int(v) for v in columns[op][1:]] for op in PER_PEER}
    counts.update({op: int(columns[op][0]) for op in PER_CALL})
    return counts


def by_kind(counts: dict, rank: int, ranks_per_node: int) -> Dict[str, int]:
    """`counts` summed per destination kind (NOTE [operation counts]' keys: puts_self, ..., signals_remote),
    with quiets and fences."""
    def kind(q: int) -> str:
        return "self" if q == rank else "node" if q // ranks_per_node == rank // ranks_per_node else "remote"

    summed = {f"{op}_{k}": 0 for op in PER_PEER for k in KINDS}
    for op in PER_PEER:
        for q, value in enumerate(counts[op]):
            summed[f"{op}_{kind(q)}"] += value
    summed.update({op: counts[op] for op in PER_CALL})
    return summed


def hits(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """bool [T, R]: the token has an expert in range on rank q (expert ids -1 or out of range go nowhere)."""
    idx = topk_idx.long().cpu()
    valid = (idx >= 0) & (idx < num_experts)
    dest = torch.where(valid, idx // (num_experts // num_ranks), torch.full_like(idx, num_ranks))
    hits = torch.zeros(idx.size(0), num_ranks + 1, dtype=torch.bool, device="cpu")
    hits.scatter_(1, dest, True)
    return hits[:, :num_ranks]


def low_latency_message_bytes(hidden: int, cast: int) -> int:
    """What a low-latency dispatch puts per (token, rank): the header, the data, the scales (NOTE [low-latency
    dispatch])."""
    if cast not in CASTS:
        raise ValueError(f"cast {cast}: one of {CASTS} (bf16, FP8, NVFP4)")
    data = (hidden * 2, hidden, hidden // 2)[cast]
    scales = (0, hidden // 128 * 4, hidden // 16)[cast]
    return workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES + data + scales


def low_latency(call: str, topk_idx: Sequence[torch.Tensor], rank: int, num_experts: int, ranks_per_node: int,
                hidden: int, num_blocks: int, cast: int = 0) -> dict:
    """The counts of one low-latency `call` ("dispatch" or "combine") on `rank` (NOTE [exact operation counts]):
    `topk_idx` every rank's [T_s, k] ids (the combine's are its dispatch's), `cast` the dispatch's (0 bf16, 1 FP8,
    2 NVFP4), `num_blocks` the grid."""
    num_ranks = len(topk_idx)
    num_local = num_experts // num_ranks
    counts = zero(num_ranks)
    mine = hits(topk_idx[rank], num_experts, num_ranks)
    for q in range(num_ranks):
        if q // ranks_per_node == rank // ranks_per_node:
            continue  # stores, not the seam
        if call == "dispatch":
            counts["puts"][q] = int(mine[:, q].sum())
            counts["put_bytes"][q] = counts["puts"][q] * low_latency_message_bytes(hidden, cast)
            counts["signals"][q] = num_local + 1
        elif call == "combine":
            weight_words = topk_idx[rank].numel()  # every token's k weights, one put with its signal
            counts["puts"][q] = int(hits(topk_idx[q], num_experts, num_ranks)[:, rank].sum())
            counts["put_signals"][q] = int(weight_words > 0)
            counts["put_bytes"][q] = counts["puts"][q] * hidden * 2 + weight_words * 8
            counts["signals"][q] = 1
        else:
            raise ValueError(f"call {call!r}: dispatch or combine")
    counts["quiets"] = num_blocks  # NOTE [block quiet]
    return counts


def _align16(num_bytes: int) -> int:
    return -(-num_bytes // 16) * 16


def normal(call: str, is_token_in_rank: Sequence[torch.Tensor], rank: int, ranks_per_node: int, num_blocks: int,
           row_bytes: int = 0, hidden: int = 0, num_topk: int = 0) -> dict:
    """The counts of one launch of the internode normal `call` ("dispatch" or "combine") on `rank` (NOTE [exact
    operation counts]): `is_token_in_rank` every rank's bool [T_s, R]; the dispatch's `row_bytes`, its packed row
    (ReferenceBackend.payload's, before padding); the combine's bf16 `hidden` and `num_topk` (its weights'
    columns, 0 without); `num_blocks` the grid."""
    num_ranks, per_node = len(is_token_in_rank), ranks_per_node
    num_nodes, node, local = num_ranks // per_node, rank // per_node, rank % per_node
    in_rank = [t.bool().cpu() for t in is_token_in_rank]

    def to_node(s: int, m: int) -> int:  # tokens of rank s that reach node m
        return int(in_rank[s][:, m * per_node:(m + 1) * per_node].any(1).sum())

    counts = zero(num_ranks)
    for q in range(num_ranks):
        counts["signals"][q] = 1 + num_blocks * ((q % per_node == local) + (q // per_node == node))
    if call == "dispatch":
        row = _align16(row_bytes)
        stride = _align16(row + 4 * per_node)
        for m in range(num_nodes):  # stage 1: chunks of rows to forwarder (m, l)
            rows = to_node(rank, m)
            counts["puts"][m * per_node + local] += math.ceil(rows / CHUNK_ROWS)
            counts["put_bytes"][m * per_node + local] += rows * stride
        for j in range(per_node):  # stage 2: the forwarded rows to the node's ranks
            dest = node * per_node + j
            rows = sum(int(in_rank[k * per_node + local][:, dest].sum()) for k in range(num_nodes))
            counts["puts"][dest] += rows
            counts["put_bytes"][dest] += rows * row
    elif call == "combine":
        row = hidden * 2 + 16 * math.ceil(4 * num_topk / 16)
        for k in range(num_nodes):  # the partials of the rows forwarded, back to their source (k, l), by chunks
            rows = to_node(k * per_node + local, node)
            counts["puts"][k * per_node + local] = math.ceil(rows / CHUNK_ROWS)
            counts["put_bytes"][k * per_node + local] = rows * row
    else:
        raise ValueError(f"call {call!r}: dispatch or combine")
    counts["quiets"] = 2 * num_blocks  # NOTE [block quiet]
    return counts


def differences(got: dict, want: dict) -> List[str]:
    """Where two ranks' counts differ, one line each (empty where they agree)."""
    return [f"{op}: counted {got[op]}, expected {want[op]}" for op in PER_PEER + PER_CALL if got[op] != want[op]]
