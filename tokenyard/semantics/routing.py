"""The meaning of layout, dispatch and combine, written once as plain single-process PyTorch.

Every function here takes the inputs of *all* ranks (lists indexed by rank) and returns what each rank
must receive. They are deliberately simple loops: this file is the oracle that both backends are tested
against, and docs/semantics.md is its prose. The backends never call the all-rank functions; they share
only the small per-rank helpers marked "per rank" below.

NOTE [recv order]
Normal dispatch: rank r receives the tokens of source rank 0 first, then rank 1, ..., and within one
source in increasing token index. Low-latency dispatch: local expert l's slots hold source rank 0's
(token, k) pairs first, in increasing (token, k) order, then rank 1's, and so on from slot 0.

NOTE [repeated experts]
A low-latency row may name one expert twice (DeepEP takes such rows). The token then takes one slot of
that expert, the slot of its first such choice, and every choice of it reads that slot's output in the
combine, each with its own weight: the combined result is DeepEP's (which gives the token a slot per choice,
whose outputs are the same), packed_recv_count counts the token once.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import quant


# --------------------------------------------------------------------------------------------------
# per-rank helpers (shared with the backends)
# --------------------------------------------------------------------------------------------------

def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Per rank. ``topk_idx [T, K]`` -> ``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
    is_token_in_rank bool [T, R])``.

    A token counts once per rank however many of its experts live there; ``num_tokens_per_expert``
    counts (token, k) pairs, and entries of -1 count nowhere.
    """
    num_local_experts = num_experts // num_ranks
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // num_local_experts, torch.full_like(topk_idx, num_ranks))
    hits = torch.zeros(topk_idx.size(0), num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, owner.long(), True)
    is_token_in_rank = hits[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def tokens_per_node(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """Per rank. ``bool [T, N]``: whether token t has an expert on node m (some rank of m holds one),
    nodes of `ranks_per_node` consecutive ranks (NOTE [virtual nodes] in plan/devices.py). Its column sums
    are `get_dispatch_layout`'s ``num_tokens_per_rdma_rank``."""
    num_tokens, num_ranks = is_token_in_rank.shape
    return is_token_in_rank.view(num_tokens, num_ranks // ranks_per_node, ranks_per_node).any(2)


def landing_rows(selected: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Per rank. ``int32 [T, D]``: where each selected row lands when the selected rows of column d are
    sent in increasing order to a receiver that places them from ``first`` on; -1 where not selected.

    selected: bool ``[T, D]``; first: ``[D]``, or ``[T, D]`` where the first row depends on the row too.
    Example: selected column [1, 0, 1, 1], first 5 -> [5, -1, 6, 7]. `send_head` is this with
    ``first[q]`` = the rows rank q receives from lower source ranks.
    """
    position = selected.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return torch.where(selected, position + first.to(torch.int32), -1).to(torch.int32)


def to_local_topk(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], rank: int,
                  num_local_experts: int, all_weights: bool = False):
    """Per rank. Global expert ids -> this rank's local ids, -1 for experts elsewhere; their weights 0 (kept
    with `all_weights`, as DeepEP V2 delivers them)."""
    begin = rank * num_local_experts
    local = (topk_idx >= begin) & (topk_idx < begin + num_local_experts)
    local_idx = torch.where(local, topk_idx - begin, torch.full_like(topk_idx, -1))
    local_weights = None
    if topk_weights is not None:
        local_weights = topk_weights if all_weights else torch.where(local, topk_weights,
                                                                     torch.zeros_like(topk_weights))
    return local_idx, local_weights


def placed_rows(rank_prefix_matrix: torch.Tensor, rank: int, recv_first: torch.Tensor,
                num_rows: int) -> torch.Tensor:
    """Per rank. Where a round's rows go in the whole call's receive order (NOTE [placed rounds] in
    rounds.py): row i of the round's own order (NOTE [recv order]) comes from the source s whose rows hold
    it and lands at ``recv_first[s] + i - (the round's rows from sources before s)``.

    rank_prefix_matrix: the round's ``[R, R]``; recv_first: ``[R]``; num_rows: the round's rows, padding
    included. Returns int64 ``[num_rows]``, -1 on padding rows.
    Example: 2 sources sending 2 and 1 rows, recv_first [5, 9] -> rows [5, 6, 9].
    """
    inclusive = rank_prefix_matrix[:, rank].long()
    row = torch.arange(num_rows, dtype=torch.int64, device=inclusive.device)
    source = torch.searchsorted(inclusive, row, right=True)  # R on padding rows
    valid = source < inclusive.numel()
    source = source.clamp_max(inclusive.numel() - 1)
    before = inclusive - torch.diff(inclusive, prepend=inclusive.new_zeros(1))  # exclusive
    placed = recv_first.long()[source] + row - before[source]
    return torch.where(valid, placed, -1)


def align_counts(counts: Sequence[int], expert_alignment: int) -> List[int]:
    """Per rank. Round each count up to a multiple of `expert_alignment`."""
    return [(int(c) + expert_alignment - 1) // expert_alignment * expert_alignment for c in counts]


# --------------------------------------------------------------------------------------------------
# normal mode, all ranks at once
# --------------------------------------------------------------------------------------------------

def dispatch(xs: Sequence[torch.Tensor], x_scales: Sequence[Optional[torch.Tensor]],
             topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[Optional[torch.Tensor]],
             num_experts: int, expert_alignment: int = 1) -> List[dict]:
    """What every rank receives from a normal dispatch.

    Returns, per rank r, a dict with ``recv_x``, ``recv_x_scales`` (or None), ``recv_topk_idx`` (local ids,
    -1 elsewhere), ``recv_topk_weights`` (0 where -1), ``num_recv_tokens_per_expert_list``,
    ``rank_prefix_matrix``, ``recv_src_idx``, ``is_token_in_rank`` and ``send_head`` (NOTE [handle contents]).
    """
    num_ranks = len(xs)
    num_local_experts = num_experts // num_ranks
    layouts = [dispatch_layout(t, num_experts, num_ranks) for t in topk_idxs]
    counts = torch.stack([layout[0] for layout in layouts])  # [src, dst]
    rank_prefix_matrix = counts.cumsum(0).to(torch.int32)
    outputs = []
    for r in range(num_ranks):
        pieces = {"x": [], "scales": [], "idx": [], "weights": [], "src": []}
        for s in range(num_ranks):
            rows = layouts[s][2][:, r].nonzero().flatten()
            pieces["x"].append(xs[s][rows])
            if x_scales[s] is not None:
                pieces["scales"].append(x_scales[s][rows])
            if topk_idxs[s] is not None:
                pieces["idx"].append(topk_idxs[s][rows])
            if topk_weights[s] is not None:
                pieces["weights"].append(topk_weights[s][rows])
            pieces["src"].append(rows.to(torch.int32))
        recv_topk_idx = torch.cat(pieces["idx"])
        recv_weights = torch.cat(pieces["weights"]) if pieces["weights"] else None
        recv_topk_idx, recv_weights = to_local_topk(recv_topk_idx, recv_weights, r, num_local_experts)
        per_expert = [int(sum(layouts[s][1][r * num_local_experts + e] for s in range(num_ranks)))
                      for e in range(num_local_experts)]
        outputs.append({
            "recv_x": torch.cat(pieces["x"]),
            "recv_x_scales": torch.cat(pieces["scales"]) if pieces["scales"] else None,
            "recv_topk_idx": recv_topk_idx,
            "recv_topk_weights": recv_weights,
            "num_recv_tokens_per_expert_list": align_counts(per_expert, expert_alignment),
            "rank_prefix_matrix": rank_prefix_matrix,
            "recv_src_idx": torch.cat(pieces["src"]),
        })
    for s in range(num_ranks):
        is_token_in_rank = layouts[s][2]
        send_head = torch.full(is_token_in_rank.shape, -1, dtype=torch.int32, device=is_token_in_rank.device)
        for r in range(num_ranks):
            rows = is_token_in_rank[:, r].nonzero().flatten()
            first = int(rank_prefix_matrix[s - 1, r]) if s > 0 else 0
            send_head[rows, r] = first + torch.arange(rows.numel(), dtype=torch.int32, device=rows.device)
        outputs[s]["is_token_in_rank"] = is_token_in_rank
        outputs[s]["send_head"] = send_head
    return outputs


def combine(recv_xs: Sequence[torch.Tensor], send_heads: Sequence[torch.Tensor],
            recv_topk_weights: Optional[Sequence[torch.Tensor]] = None,
            biases: Optional[Sequence[Sequence[torch.Tensor]]] = None):
    """What every rank gets back from a normal combine.

    For source rank s and its token t: ``float32(bias_0[t]) + float32(bias_1[t])`` (those given), then
    ``+ float32(recv_xs[r][send_head_s[t, r]])`` for each rank r the token went to, in increasing r; the
    sum is cast to the dtype of ``recv_xs``. Tokens sent nowhere come back as zeros (plus bias).
    ``combined_topk_weights`` sums the received weights the same way (float32), or is None. This is
    `internode_combine` with nodes of one rank, whose partial sum of one row is that row.
    """
    return internode_combine(recv_xs, send_heads, 1, recv_topk_weights, biases)


# --------------------------------------------------------------------------------------------------
# internode normal mode, all ranks at once (docs/semantics.md "Internode normal mode")
# --------------------------------------------------------------------------------------------------

def internode_handles(is_token_in_ranks: Sequence[torch.Tensor], ranks_per_node: int,
                      num_worst_tokens: int = 0) -> List[dict]:
    """The internode handle fields (NOTE [internode handle] in handle.py) of every rank, from the two stages
    as loops: rank (n, l) sends token t once to the forwarder (m, l) of every node m holding one of its
    experts, which receives in order of source node, then token, and sends it on to the ranks of m that
    hold its experts; those place rows in order of source rank, then token (NOTE [recv order]).

    Returns, per rank, a dict of the ten fields by name; the rows received are padded to
    `num_worst_tokens` where it is given (recv_src_meta -1 there).
    """
    num_ranks, per_node = len(is_token_in_ranks), ranks_per_node
    num_nodes = num_ranks // per_node
    in_rank = [t.tolist() for t in is_token_in_ranks]
    device = is_token_in_ranks[0].device
    # forwarded[f]: the (source rank, token) pairs forwarder f receives, in stage-1 order.
    forwarded = [[] for _ in range(num_ranks)]
    send_rdma_head = [torch.full((len(in_rank[s]), num_nodes), -1, dtype=torch.int32, device=device)
                      for s in range(num_ranks)]
    for f in range(num_ranks):
        node, local = divmod(f, per_node)
        for source_node in range(num_nodes):
            s = source_node * per_node + local
            for t, row in enumerate(in_rank[s]):
                if any(row[node * per_node:(node + 1) * per_node]):
                    send_rdma_head[s][t, node] = len(forwarded[f])
                    forwarded[f].append((s, t))
    # received[q]: the (source rank, token) pairs rank q receives, in its row order.
    received = [[(s, t) for s in range(num_ranks) for t, row in enumerate(in_rank[s]) if row[q]]
                for q in range(num_ranks)]
    row_on = [{pair: i for i, pair in enumerate(pairs)} for pairs in received]
    outputs = []
    for r in range(num_ranks):
        node = r // per_node
        to_rank = [sum(row[q] for row in in_rank[r]) for q in range(num_ranks)]
        to_node = [sum(any(row[m * per_node:(m + 1) * per_node]) for row in in_rank[r]) for m in range(num_nodes)]
        from_node = [sum(s // per_node == m for s, _ in forwarded[r]) for m in range(num_nodes)]
        from_rank = [sum(s == source for s, _ in received[r]) for source in range(num_ranks)]
        first_row = [sum(from_rank[:source]) for source in range(num_ranks)]
        meta = [[s, t] for s, t in received[r]] + [[-1, -1]] * max(0, num_worst_tokens - len(received[r]))
        send_nvl_head = torch.full((len(forwarded[r]), per_node), -1, dtype=torch.int32, device=device)
        for i, (s, t) in enumerate(forwarded[r]):
            for j in range(per_node):
                q = node * per_node + j
                if in_rank[s][t][q]:
                    send_nvl_head[i, j] = row_on[q][(s, t)]

        def column(values):
            return torch.tensor(values, dtype=torch.int32, device=device).view(-1, 1)

        outputs.append({
            "is_token_in_rank": is_token_in_ranks[r],
            "rdma_channel_prefix_matrix": column(to_node),
            "gbl_channel_prefix_matrix": column(to_rank),
            "recv_rdma_channel_prefix_matrix": column(from_node),
            "recv_rdma_rank_prefix_sum": torch.tensor(from_node, dtype=torch.int32, device=device).cumsum(
                0, dtype=torch.int32),
            "recv_gbl_channel_prefix_matrix": column(first_row),
            "recv_gbl_rank_prefix_sum": torch.tensor(from_rank, dtype=torch.int32, device=device).cumsum(
                0, dtype=torch.int32),
            "recv_src_meta": torch.tensor(meta, dtype=torch.int32, device=device).view(-1, 2),
            "send_rdma_head": send_rdma_head[r],
            "send_nvl_head": send_nvl_head,
        })
    return outputs


def internode_combine(recv_xs: Sequence[torch.Tensor], send_heads: Sequence[torch.Tensor], ranks_per_node: int,
                      recv_topk_weights: Optional[Sequence[torch.Tensor]] = None,
                      biases: Optional[Sequence[Sequence[torch.Tensor]]] = None):
    """What every rank gets back from an internode combine: `combine` reduced inside each node first.

    For source rank s and its token t: ``acc = float32(bias_0[t]) + float32(bias_1[t])`` (those given); then
    for each node m, in increasing order, that token t reached: ``partial_m = bf16(sum over the ranks q of m
    it reached, increasing, of float32(recv_xs[q][send_head_s[t, q]]))`` (a float32 sum from 0) and
    ``acc = acc + float32(partial_m)``; the result is bf16. ``combined_topk_weights``: the same in float32
    throughout, per node partial sums then their sum over m. With one rank per node this is `combine`.
    """
    num_ranks = len(recv_xs)
    hidden, device = recv_xs[0].size(1), recv_xs[0].device
    out_x, out_w = [], []
    for s in range(num_ranks):
        send_head = send_heads[s]
        num_tokens = send_head.size(0)
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        for bias in (biases[s] if biases is not None else ()):
            acc = acc + bias.float()
        acc_w = None
        if recv_topk_weights is not None:
            acc_w = torch.zeros(num_tokens, recv_topk_weights[0].size(1), dtype=torch.float32, device=device)
        for begin in range(0, num_ranks, ranks_per_node):
            partial = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
            partial_w = None if acc_w is None else torch.zeros_like(acc_w)
            for q in range(begin, begin + ranks_per_node):
                rows = (send_head[:, q] >= 0).nonzero().flatten()
                where = send_head[rows, q].long()
                partial[rows] = partial[rows] + recv_xs[q][where].float()
                if partial_w is not None:
                    partial_w[rows] = partial_w[rows] + recv_topk_weights[q][where].float()
            reached = (send_head[:, begin:begin + ranks_per_node] >= 0).any(1).nonzero().flatten()
            acc[reached] = acc[reached] + partial[reached].to(recv_xs[0].dtype).float()
            if acc_w is not None:
                acc_w[reached] = acc_w[reached] + partial_w[reached]
        out_x.append(acc.to(recv_xs[0].dtype))
        out_w.append(acc_w)
    return out_x, out_w


# --------------------------------------------------------------------------------------------------
# low-latency mode, all ranks at once
# --------------------------------------------------------------------------------------------------

def low_latency_dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                         num_max_dispatch_tokens_per_rank: int, num_experts: int, use_fp8: bool = True,
                         round_scale: bool = False, use_ue8m0: bool = False, use_nvfp4: bool = False,
                         x_global_scale: Optional[torch.Tensor] = None) -> List[dict]:
    """What every rank receives from a low-latency dispatch (slot order: NOTE [recv order]).

    Returns, per rank, ``packed_recv_x [L, R*M, H]`` (e4m3 or bf16; NVFP4 ``uint8 [L, R*M, H/2]``),
    ``packed_recv_x_scales`` (``[L, R*M, H/128]`` float32, ``[L, R*M, H/512]`` int32 with UE8M0, NVFP4
    ``float8_e4m3fn [L, R*M, H/16]``, or None: expert-major, before the views of NOTE [nvfp4]),
    ``packed_recv_count [L]``,
    ``src_info [L, R*M]`` and ``layout_range [L, R]``. Unused slots hold zeros (data, scales) and -1
    (src_info) here; backends leave them unspecified.
    """
    num_ranks = len(xs)
    num_local_experts = num_experts // num_ranks
    num_slots = num_ranks * num_max_dispatch_tokens_per_rank
    payloads = []
    for x in xs:
        if use_nvfp4:
            payloads.append(quant.quantize_nvfp4(x, x_global_scale))
        elif use_fp8:
            payloads.append(quant.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0))
        else:
            payloads.append((x, None))
    # pairs[e][s]: the tokens of rank s that chose expert e, in (token, k) order, each once (NOTE
    # [repeated experts]).
    pairs = [[[] for _ in range(num_ranks)] for _ in range(num_experts)]
    for s in range(num_ranks):
        for t, row in enumerate(topk_idxs[s].tolist()):
            for e in dict.fromkeys(row):
                if e >= 0:
                    pairs[e][s].append(t)
    outputs = []
    for r in range(num_ranks):
        data_like = payloads[0][0]
        device = data_like.device
        recv_x = torch.zeros(num_local_experts, num_slots, data_like.size(1), dtype=data_like.dtype,
                             device=device)
        recv_scales = None
        if use_fp8 or use_nvfp4:
            scale_like = payloads[0][1]
            recv_scales = torch.zeros(num_local_experts, num_slots, scale_like.size(1), dtype=scale_like.dtype,
                                      device=device)
        src_info = torch.full((num_local_experts, num_slots), -1, dtype=torch.int32, device=device)
        layout_range = torch.zeros(num_local_experts, num_ranks, dtype=torch.int64, device=device)
        count = torch.zeros(num_local_experts, dtype=torch.int32, device=device)
        for l in range(num_local_experts):
            slot = 0
            for s in range(num_ranks):
                tokens = pairs[r * num_local_experts + l][s]
                rows = torch.tensor(tokens, dtype=torch.long, device=device)
                recv_x[l, slot:slot + len(tokens)] = payloads[s][0][rows]
                if recv_scales is not None:
                    recv_scales[l, slot:slot + len(tokens)] = payloads[s][1][rows]
                src_info[l, slot:slot + len(tokens)] = rows.to(torch.int32)
                layout_range[l, s] = (slot << 32) | len(tokens)
                slot += len(tokens)
            count[l] = slot
        outputs.append({"packed_recv_x": recv_x, "packed_recv_x_scales": recv_scales,
                        "packed_recv_count": count, "src_info": src_info, "layout_range": layout_range})
    return outputs


def low_latency_combine(expert_outputs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                        topk_weights: Sequence[torch.Tensor], layout_ranges: Sequence[torch.Tensor],
                        num_experts: int, pre_reduce: bool = False) -> List[torch.Tensor]:
    """What every rank gets back from a low-latency combine.

    For rank s and its token t: ``acc = 0``; for k in increasing order with ``e = topk_idx[t, k] >= 0``,
    ``acc = acc + w[t, k] * float32(y)`` (one float32 product, then one float32 sum, no fused multiply-add)
    where y is the expert output in the slot the pair (t, k) was dispatched to (a repeated expert's slot for
    each of its choices, NOTE [repeated experts]); the result is bf16.

    With `pre_reduce`, the arithmetic of the CUDA kernels (NOTE [low-latency combine]): the token's pairs
    on each rank r are summed as above into a bf16 partial, and ``acc = acc + float32(partial_r)`` over
    the ranks in increasing order gives the result; it is within bf16 rounding of the plain sum.
    """
    num_ranks = len(expert_outputs)
    num_local_experts = num_experts // num_ranks
    results = []
    for s in range(num_ranks):
        topk_idx, weights = topk_idxs[s], topk_weights[s]
        num_tokens, num_topk = topk_idx.shape
        hidden, device = expert_outputs[0].size(2), expert_outputs[0].device
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        seen = {}  # expert -> pairs of rank s seen so far, in (t, k) order
        slot_of = {}
        for t in range(num_tokens):
            first_choice = {}  # expert -> the token's first k that chose it
            for k in range(num_topk):
                e = int(topk_idx[t, k])
                if e < 0:
                    continue
                if e in first_choice:
                    slot_of[(t, k)] = slot_of[(t, first_choice[e])]
                    continue
                first_choice[e] = k
                r, l = divmod(e, num_local_experts)
                begin = int(layout_ranges[r][l, s]) >> 32
                slot_of[(t, k)] = (r, l, begin + seen.get(e, 0))
                seen[e] = seen.get(e, 0) + 1
        for t in range(num_tokens):
            partials = {}  # owner rank -> the float32 sum of the token's pairs there, in k order
            for k in range(num_topk):
                if (t, k) in slot_of:
                    r, l, slot = slot_of[(t, k)]
                    owner = r if pre_reduce else 0
                    term = weights[t, k].float() * expert_outputs[r][l, slot].float()
                    zero = torch.zeros(hidden, dtype=torch.float32, device=device)
                    partials[owner] = partials.get(owner, zero) + term
            acc = torch.zeros(hidden, dtype=torch.float32, device=device)
            for owner in sorted(partials):
                acc = acc + (partials[owner].to(torch.bfloat16).float() if pre_reduce else partials[owner])
            out[t] = acc
        results.append(out.to(torch.bfloat16))
    return results
