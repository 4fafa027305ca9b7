"""Operation counts of the internode calls, per rank and per call (issue 53, items 1 and 2): what DeepEP V1 at
commit 29d31c0 and tokenyard post to NVSHMEM for one dispatch or combine, as formulas. Nothing here prices an
operation: pricing.py does (NOTE [operations priced]), from `work_requests`, for normal.py and low_latency.py.

NOTE [operation counts]
A call's counts are a dict of numbers (expectations where routing decides them). Per destination kind
(self: this rank; node: another rank of this node; remote: a rank of another node):
  puts_K, put_bytes_K   messages (rows) written to K and their bytes, whatever writes them (a NIC put, an NVSHMEM
                        P2P put or plain stores over NVLink);
  put_signals_K         puts that carry their signal (tokenyard's low-latency combine weights to another node);
  signals_K             single words a peer waits for (a 64-bit signal, or a release store within a node);
  atomics_K             remote atomic adds (a count, a tail, a head, a flag);
and per call: quiets (nvshmem_quiet, or DeepEP's nvshmemi_ibgda_quiet of one QP), fences, barriers (NVSHMEM
collective syncs: nvshmem_sync / nvshmem_sync_all), staged_rows (rows copied into a send buffer before their put),
nic_puts and nic_atomics (the puts and atomics posted by IBGDA or NVSHMEM to another node, and in DeepEP's "rdma"
route to every other rank; `work_requests` adds the signals: every work request a NIC sees). T tokens per rank,
top-k of E experts, R = N nodes x G GPUs, hidden H. Routing is uniform over k distinct experts: a given rank holds
one of a token's experts with p_rank = hit_probability(E, E / R, k), a given node with
p_node = hit_probability(E, E / N, k) (common.py); a (token, expert) pair lands on a given rank with probability
k / R.

DeepEP low latency (csrc/kernels/internode_ll.cu at 29d31c0; "ll" below), FP8 or BF16 messages of
b = 16 + (H + 4 H / 128 if FP8 else 2 H) bytes (ll:181):
  dispatch: T rows staged into rdma_x (cast/copy, ll:203-249); one message per (token, top-k expert), not per
    rank: T k / R to self, T k (G - 1) / R to the node, T k (N - 1) / N remote (ll:255-273): an IBGDA put
    (nvshmemi_ibgda_put_nbi_warp, ll:267) where nvshmemi_get_p2p_ptr is 0, else a warp copy (ll:271-273); one
    count per expert, E per call (E / R self, E (G - 1) / R node, E (N - 1) / N remote, ll:325-341): an IBGDA
    atomic add (ll:337) or a release store (ll:339). No fence and no quiet in the call: ordering rides the
    expert's QP (qp id = the local expert, ll:267, ll:337); the QP quiets are in clean_low_latency_buffer's
    barrier (ll:23-33, ll:87, ll:101), not per call.
  combine: every received pair goes back as its own row of 2 H bytes (ll:848, ll:912): T k in expectation, split
    as in the dispatch; rows for the NIC are first copied (TMA) into rdma_send_x (ll:850-909) unless zero_copy;
    one flag per (local expert, rank), E per call (ll:919-932, an IBGDA atomic at ll:926, a store at ll:928).
    The weights never travel: the receiver applies its own topk_weights.
  route: allow_nvlink_for_low_latency_mode=True (the default at 29d31c0, deep_ep/buffer.py:38) sets
    NVSHMEM_DISABLE_P2P=0 (buffer.py:108): the node's ranks get warp copies and stores. With it False ("rdma"
    here) nvshmemi_get_p2p_ptr returns 0 for every other rank (ibgda_device.cuh:458-470), so every message and
    count to another rank is an IBGDA put or atomic: nic_puts = T k (R - 1) / R, nic_atomics = E (R - 1) / R.
    NVSHMEM may split a put into one work request per memory chunk it crosses (ibgda_device.cuh:345-373); we
    count one.

DeepEP normal mode (csrc/kernels/internode.cu at 29d31c0; "in" below), C channels (num_sms / 2, in:488),
S = num_max_rdma_chunked_send_tokens, Q QPs per peer (num_rc_per_pe x devices, in:134). Only the RDMA leg uses
NVSHMEM, and only to the rank of the same GPU index on each other node (translate_dst_rdma_rank, in:83); the
NVLink leg writes peers' buffers with stores. A row of the RDMA leg is
rb = align16(H e + 8 + 4 scales + 4 k + 4 k) bytes in the dispatch (e the element size; in:42-46, in:520),
align16(2 H + 8 + 4 k) in the combine (in:1753); n = T p_node / C rows per (channel, node) in expectation, and
ceil(n / S) is taken of that mean.
  notify_dispatch (in:93-291): Q (N - 1) quiets of every QP (in:134-139), N - 1 puts of (8 + E / N + 1) x 4 bytes
    (in:171-181), N - 1 quiets of QP 0 (in:193-194), 3 barriers (nvshmem_sync, in:143, in:199, in:290).
  dispatch (in:447-): per channel and other node one put of 72 bytes of channel prefixes (in:612); each token
    copied into the send buffer of every node it reaches (T p_node N rows staged, the own node's straight into
    its receive buffer, in:655-700); per (channel, other node) ceil(n / S) puts of up to S rows (in:818) each
    followed by a tail atomic (in:835; the own node's tail is a local atomicAdd, counted as atomics_self); the
    forwarders return head atomics, at most floor(n / S) per (channel, node) and fewer when they lag (in:1045):
    counted at that bound. NVLink leg: each forwarded row to each rank of the node holding it, N T p_rank rows
    per rank.
  combine: cached_notify (in:1311-1372): Q (N - 1) quiets (in:1345) and 2 barriers (in:1351, in:1371); each rank
    returns its received rows to their forwarders over NVLink (T R p_rank rows, split 1 : G - 1 between self and
    node); each forwarder reduces into its RDMA send buffer (N T p_node rows staged) and puts per (channel, other
    node) ceil(n / S) chunks (in:2118), each with a tail atomic (in:2132), and head atomics at most
    floor(n / S) per (channel, node) (in:2250).

tokenyard low latency (NOTE [internode low-latency] in include/tokenyard/sync.cuh, NOTE [low-latency dispatch]
and NOTE [low-latency combine]), B blocks (every SM), a quiet per block (NOTE [block quiet]): the node's ranks
by stores, another node's through the transport (NOTE [transport seam]).
  dispatch: one message per (token, rank), of 80 + b - 16 bytes (the header, LOW_LATENCY_MESSAGE_HEADER_BYTES,
    then data and scales): T p_rank to self, T (G - 1) p_rank to the node, T (N - 1) G p_rank remote, each remote
    one staged (staged_message) and put whole by the warp completing it (arrive_and_put); E expert counts
    (E / R, E (G - 1) / R, E (N - 1) / N) and one token count per rank (publish_when_last), each a signal; B
    quiets (publish_when_last's Remote::quiet, one thread of each block).
  combine: within the node k weight words per (token, rank it went to), each stored with its tag (send_weights);
    to each rank of another node every token's k weights, staged and put at once with one signal (R - G puts
    with signal of 8 k T bytes); one row of 2 H bytes per received message (T p_rank per rank), the remote ones staged
    (staged_row) and put whole; one flag per rank; B quiets.

tokenyard normal mode (NOTE [internode kernels] in include/tokenyard/kernels/internode.cuh), B blocks
(Config.num_sms), a quiet per block (NOTE [block quiet]); every row through the transport, the node's by NVSHMEM P2P:
  dispatch: the start barrier, a signal from block 0 to every rank (R); stage 1, per node m (the own node's
    rank being this rank) ceil(T p_node / 4) puts of up to 4 rows of rb' = align16(row + 4 G) bytes (rows packed
    on the host: T N p_node staged); B quiets, then B N signals; stage 2, each row from each node to each rank
    of this node holding it (N T p_rank per rank, row bytes); B quiets, then B G signals.
  combine: the barrier (R signals); each received row copied into comb_in (T R p_rank staged); B quiets and
    B G signals; as forwarder, per source node, ceil(T p_node / 4) puts of up to 4 forwarded rows (of 2 H +
    align16(4 k) bytes) to its source, the own node's to this rank, each summed first into comb_stage (staged);
    B quiets and B N signals.
tokenyard's counts through its transport seam are measured by the CUDA backend's counters (NOTE [operation counters] in
include/tokenyard/operation_counts.cuh) and given exactly per call by NOTE [exact operation counts]
(backends/cuda/operation_counts.py), whose mean over every routing is these (the low-latency ones to other nodes only:
the node's rows are stores there, not seen by the seam).
"""

from __future__ import annotations

import math
from typing import Dict

from ....plan import workspace
from .common import hit_probability

KINDS = ("self", "node", "remote")
PER_KIND = ("puts", "put_bytes", "put_signals", "signals", "atomics")
PER_CALL = ("quiets", "fences", "barriers", "staged_rows", "nic_puts", "nic_atomics")
CALLS = ("dispatch", "combine")
ROUTES = ("nvlink", "rdma")
INTERNODE_CHUNK_ROWS = 4  # kInternodeChunkRows
DEEPEP_CHANNELS = 10      # Config(num_sms=20): num_sms / 2 channels
DEEPEP_CHUNK = 6          # num_max_rdma_chunked_send_tokens of DeepEP's dispatch configs at 16-64 ranks, 8 or 12 beyond
DEEPEP_QPS = 24           # num_qps_per_rank's default (deep_ep/buffer.py:37)


def zero() -> Dict[str, float]:
    """Every key of NOTE [operation counts], at zero."""
    counts = {f"{op}_{kind}": 0.0 for op in PER_KIND for kind in KINDS}
    counts.update({key: 0.0 for key in PER_CALL})
    return counts


def work_requests(counts: dict, route: str = "nvlink") -> float:
    """The work requests a NIC executes in a call of these counts (NOTE [operations priced] in pricing.py): every
    put, signal and atomic to a rank of another node, and in route "rdma" (NVSHMEM's P2P off, DeepEP's published
    setting) to the node's other ranks as well. A put with its signal counts twice, a write and the signal's atomic
    (tokenyard's low-latency combine weights); quiets, fences and barriers count none."""
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {ROUTES}")
    kinds = ("node", "remote") if route == "rdma" else ("remote",)
    return sum(counts[f"puts_{k}"] + 2 * counts[f"put_signals_{k}"] + counts[f"signals_{k}"] + counts[f"atomics_{k}"]
               for k in kinds)


def _align16(n: float) -> int:
    return int(-(-n // 16) * 16)


def _check(call: str, num_experts: int, nodes: int, gpus_per_node: int) -> None:
    if call not in CALLS:
        raise ValueError(f"call {call!r}: one of {CALLS}")
    if nodes < 1 or gpus_per_node < 1 or num_experts % (nodes * gpus_per_node):
        raise ValueError(f"{num_experts} experts do not divide over {nodes} x {gpus_per_node} ranks")


def _split(counts: dict, op: str, total_per_rank: float, ranks: int, gpus_per_node: int) -> None:
    """`total_per_rank` of op to each rank: 1 to self, G - 1 to the node, R - G remote."""
    counts[f"{op}_self"] += total_per_rank
    counts[f"{op}_node"] += total_per_rank * (gpus_per_node - 1)
    counts[f"{op}_remote"] += total_per_rank * (ranks - gpus_per_node)


def _bytes(counts: dict, per_row: float) -> None:
    for kind in KINDS:
        counts[f"put_bytes_{kind}"] = counts[f"puts_{kind}"] * per_row


def low_latency_message_bytes(hidden: int, fp8: bool = True) -> int:
    """DeepEP's dispatch message (ll:181): an int4 of source index, then the data and its FP8 scales."""
    return 16 + (hidden + hidden // 128 * 4 if fp8 else hidden * 2)


def deepep_low_latency(call: str, tokens: int, topk: int, num_experts: int, nodes: int, gpus_per_node: int,
                       hidden: int, route: str = "rdma", fp8: bool = True, zero_copy: bool = False) -> dict:
    """DeepEP V1's low-latency dispatch or combine (NOTE [operation counts]); route "rdma": NVSHMEM P2P off, every
    other rank over the NIC; "nvlink": allow_nvlink_for_low_latency_mode, the node's ranks by copies and stores."""
    _check(call, num_experts, nodes, gpus_per_node)
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {ROUTES}")
    ranks = nodes * gpus_per_node
    counts = zero()
    # Messages: one per (token, top-k expert), a pair landing on a given rank with probability k / R; the
    # combine sends back what the dispatch brought, the same numbers by symmetry.
    _split(counts, "puts", tokens * topk / ranks, ranks, gpus_per_node)
    _bytes(counts, low_latency_message_bytes(hidden, fp8) if call == "dispatch" else hidden * 2)
    # A count per expert (dispatch) or a flag per (local expert, rank) (combine): E per call either way.
    over_nic = ("node", "remote") if route == "rdma" else ("remote",)
    per_rank_words = num_experts / ranks
    for kind, share in (("self", 1), ("node", gpus_per_node - 1), ("remote", ranks - gpus_per_node)):
        counts[f"{'atomics' if kind in over_nic else 'signals'}_{kind}"] += per_rank_words * share
    counts["nic_puts"] = sum(counts[f"puts_{kind}"] for kind in over_nic)
    counts["nic_atomics"] = sum(counts[f"atomics_{kind}"] for kind in over_nic)
    if call == "dispatch":
        counts["staged_rows"] = float(tokens)  # rdma_x: the cast (or copy) of every token, once
    elif not zero_copy:
        counts["staged_rows"] = counts["nic_puts"]  # rdma_send_x: every row the NIC takes
    return counts


def tokenyard_low_latency(call: str, tokens: int, topk: int, num_experts: int, nodes: int, gpus_per_node: int,
                          hidden: int, fp8: bool = True, blocks: int = 132) -> dict:
    """tokenyard's low-latency dispatch or combine (NOTE [operation counts]): the node's ranks by stores, another
    node's through the transport; `blocks` the grid (every SM: 132 on an H100 SXM)."""
    _check(call, num_experts, nodes, gpus_per_node)
    ranks = nodes * gpus_per_node
    p_rank = hit_probability(num_experts, num_experts / ranks, topk)
    counts = zero()
    _split(counts, "puts", tokens * p_rank, ranks, gpus_per_node)  # one message (row) per (token, rank)
    if call == "dispatch":
        _bytes(counts, workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES + low_latency_message_bytes(hidden, fp8) - 16)
        _split(counts, "signals", num_experts / ranks + 1, ranks, gpus_per_node)  # expert counts, token count
    else:
        _bytes(counts, hidden * 2)
        # Within the node k weight words per message and a flag, stored; to another node every token's k weights
        # by one put with its signal, and the flag.
        _split(counts, "signals", tokens * p_rank * topk + 1, gpus_per_node, gpus_per_node)
        counts["put_signals_remote"] = float(ranks - gpus_per_node)
        counts["put_bytes_remote"] += counts["put_signals_remote"] * tokens * topk * 8
        counts["signals_remote"] = float(ranks - gpus_per_node)
    counts["staged_rows"] = counts["puts_remote"]
    counts["nic_puts"] = counts["puts_remote"]
    if nodes > 1:
        counts["quiets"] = float(blocks)  # publish_when_last: one thread of each block
    return counts


def _deepep_chunks(rows_per_channel: float, chunk: int) -> tuple:
    """(puts, most head updates) of one (channel, node) carrying `rows_per_channel` rows in chunks of `chunk`."""
    return math.ceil(rows_per_channel / chunk - 1e-9), math.floor(rows_per_channel / chunk + 1e-9)


def deepep_normal(call: str, tokens: int, topk: int, num_experts: int, nodes: int, gpus_per_node: int, hidden: int,
                  channels: int = DEEPEP_CHANNELS, chunk: int = DEEPEP_CHUNK, qps: int = DEEPEP_QPS,
                  fp8: bool = False) -> dict:
    """DeepEP V1's normal-mode internode dispatch (notify_dispatch with it) or combine (cached_notify with it),
    NOTE [operation counts]; `chunk` num_max_rdma_chunked_send_tokens, `qps` QPs per peer."""
    _check(call, num_experts, nodes, gpus_per_node)
    ranks = nodes * gpus_per_node
    p_node = hit_probability(num_experts, num_experts / nodes, topk)
    p_rank = hit_probability(num_experts, num_experts / ranks, topk)
    counts = zero()
    per_channel = tokens * p_node / channels
    puts, heads = _deepep_chunks(per_channel, chunk)
    other = nodes - 1
    if call == "dispatch":
        row = _align16(hidden * (1 if fp8 else 2) + 8 + (hidden // 128 * 4 if fp8 else 0) + 8 * topk)
        meta_bytes = (8 + num_experts // nodes + 1) * 4
        counts["quiets"] = float(qps * other + other)             # in:134-139, in:193-194
        counts["barriers"] = 3.0                                   # in:143, in:199, in:290
        counts["puts_remote"] = float(other + channels * other + channels * other * puts)
        counts["put_bytes_remote"] = float(other * meta_bytes + channels * other * 72) + other * tokens * p_node * row
        nvl_rows = nodes * tokens * p_rank                         # forwarded rows to each rank of the node
        counts["puts_self"], counts["puts_node"] = nvl_rows, nvl_rows * (gpus_per_node - 1)
    else:
        row = _align16(hidden * 2 + 8 + 4 * topk)
        counts["quiets"] = float(qps * other)                      # in:1345
        counts["barriers"] = 2.0                                   # in:1351, in:1371
        counts["puts_remote"] = float(channels * other * puts)
        counts["put_bytes_remote"] = other * tokens * p_node * row
        back = ranks * tokens * p_rank                             # received rows back to their forwarders
        counts["puts_self"], counts["puts_node"] = back / gpus_per_node, back * (gpus_per_node - 1) / gpus_per_node
    counts["put_bytes_self"] = counts["puts_self"] * row
    counts["put_bytes_node"] = counts["puts_node"] * row
    counts["atomics_remote"] = float(channels * other * (puts + heads))  # tails, then heads at most
    counts["atomics_self"] = float(channels * (puts + heads))            # the own node's: local atomicAdd
    counts["staged_rows"] = nodes * tokens * p_node
    counts["nic_puts"] = counts["puts_remote"]
    counts["nic_atomics"] = counts["atomics_remote"]
    return counts


def tokenyard_normal(call: str, tokens: int, topk: int, num_experts: int, nodes: int, gpus_per_node: int, hidden: int,
                     blocks: int = 20, row_bytes: int = 0) -> dict:
    """tokenyard's normal-mode internode dispatch or combine kernel (NOTE [operation counts]); `blocks`
    Config.num_sms; `row_bytes` the dispatch's packed row (0: 2 H + 8 k + 16 rounded up to 16, an estimate:
    the data, top-k ids and weights, the source index)."""
    _check(call, num_experts, nodes, gpus_per_node)
    ranks = nodes * gpus_per_node
    p_node = hit_probability(num_experts, num_experts / nodes, topk)
    p_rank = hit_probability(num_experts, num_experts / ranks, topk)
    counts = zero()
    _split(counts, "signals", 1.0, ranks, gpus_per_node)  # the start barrier: block 0 to every rank
    counts["quiets"] = float(2 * blocks)                            # internode_signal_after_puts, twice
    node_rows = tokens * p_node                                     # this rank's rows to each node
    counts["signals_self"] += 2 * blocks                            # both stages signal this rank too
    counts["signals_remote"] += blocks * (nodes - 1)                # stage signals to each node's forwarder
    counts["signals_node"] += blocks * (gpus_per_node - 1)          # stage signals to the node's ranks
    if call == "dispatch":
        row = _align16(row_bytes or hidden * 2 + 8 * topk + 16)
        stride = _align16(row + 4 * gpus_per_node)
        chunks = math.ceil(node_rows / INTERNODE_CHUNK_ROWS - 1e-9)
        forwarded = nodes * tokens * p_rank                         # stage 2: to each rank of the node
        counts["puts_self"] = chunks + forwarded
        counts["puts_node"] = forwarded * (gpus_per_node - 1)
        counts["puts_remote"] = float(chunks * (nodes - 1))
        counts["put_bytes_self"] = node_rows * stride + forwarded * row
        counts["put_bytes_node"] = counts["puts_node"] * row
        counts["put_bytes_remote"] = node_rows * stride * (nodes - 1)
        counts["staged_rows"] = nodes * node_rows                   # send_rows, packed on the host
    else:
        row = hidden * 2 + _align16(4 * topk)
        chunks = math.ceil(node_rows / INTERNODE_CHUNK_ROWS - 1e-9)
        counts["puts_self"], counts["puts_remote"] = float(chunks), float(chunks * (nodes - 1))
        counts["put_bytes_self"], counts["put_bytes_remote"] = node_rows * row, node_rows * (nodes - 1) * row
        counts["staged_rows"] = ranks * tokens * p_rank + nodes * node_rows  # comb_in, then comb_stage
    counts["nic_puts"] = counts["puts_remote"]
    return counts


def compare(tokens: int, topk: int, num_experts: int, nodes: int, gpus_per_node: int, hidden: int) -> dict:
    """Both libraries' counts side by side for every internode call: {mode: {call: {"tokenyard", "deepep"}}}."""
    args = (tokens, topk, num_experts, nodes, gpus_per_node, hidden)
    return {"low_latency": {call: {"tokenyard": tokenyard_low_latency(call, *args),
                                   "deepep": deepep_low_latency(call, *args)} for call in CALLS},
            "normal": {call: {"tokenyard": tokenyard_normal(call, *args),
                              "deepep": deepep_normal(call, *args)} for call in CALLS}}
