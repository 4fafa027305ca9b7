"""DeepEP V2's expanded layout (docs/semantics.md, "ElasticBuffer"), as tensor operations that run wherever the
tensors are, with no host sync (so a CUDA graph may capture them).

A dispatch received ``N`` rows on this rank with ``recv_topk_idx [N, K]`` (local expert ids, -1 elsewhere). The
expanded layout has one row per pair (row j, slot k) with ``recv_topk_idx[j, k] >= 0``: the pairs of local
expert 0 first, then those of expert 1, ...; within an expert in increasing j (the rows' order, that is by
source rank, then by token index there); expert i's block starts at ``align(end of block i-1)`` (``align``
rounds up to a multiple of `expert_alignment`), so that every block starts aligned; rows between a block's
end and the next block's start are padding.

Worked example: L = 2 local experts, alignment 4, ``recv_topk_idx = [[1, -1], [0, 1], [-1, 0]]``:
expert 0 holds pairs (1, 0), (2, 1) at rows 0, 1; rows 2, 3 are padding; expert 1 holds (0, 0), (1, 1) at
rows 4, 5; so ``row_of = [[4, -1], [0, 5], [-1, 1]]``, counts [2, 2], starts [0, 4], ends [2, 6], and the
tensors have ``align(6) = 8`` rows.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def align(value, alignment: int):
    """`value` (an int, or an integer tensor elementwise) rounded up to a multiple of `alignment`."""
    if alignment == 1:  # no tensor operations where nothing rounds (the host's time per call)
        return value
    return (value + alignment - 1) // alignment * alignment


def worst_expanded_rows(num_rows: int, num_topk: int, num_local_experts: int, expert_alignment: int) -> int:
    """Rows of the expanded tensors when the counts are not known on the host: every row's pairs (at most
    min(K, L) local ones) and each expert's padding."""
    return align(num_rows * min(num_topk, num_local_experts) + (expert_alignment - 1) * num_local_experts,
                 expert_alignment)


def expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int32 [L]: the pairs of each local expert (ids below 0 count nowhere)."""
    valid = recv_topk_idx >= 0
    counts = torch.zeros(num_local_experts, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, torch.where(valid, recv_topk_idx, 0).flatten().long(), valid.flatten().long())
    return counts.to(torch.int32)


def _aligned_starts(counts: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """int64 [L]: where each expert's block starts, ``align(end of block i-1)``, from ``counts [L]``; with aligned
    sizes a[i] = align(counts[i]) the starts are the exclusive prefix sums of a (every start is aligned, so
    align(start + count) = start + a)."""
    aligned = align(counts.long(), expert_alignment)
    return torch.cumsum(aligned, 0) - aligned


def _ranks_in_group(ids: torch.Tensor, valid: torch.Tensor, num_ids: int) -> torch.Tensor:
    """int64 [N, K]: each valid slot's rank among the valid slots naming the same id, in row order (a row names an
    id at most once); -1 where not valid."""
    num_rows, num_topk = ids.shape
    device = ids.device
    groups = torch.where(valid, ids, num_ids).long()
    rows = torch.arange(num_rows, dtype=torch.int64, device=device).unsqueeze(1).expand(num_rows, num_topk)
    order = torch.argsort((groups * max(num_rows, 1) + rows).flatten())
    sorted_groups = groups.flatten()[order]
    counts = torch.bincount(sorted_groups, minlength=num_ids + 1)
    first_of_group = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(order.numel(), dtype=torch.int64, device=device) - first_of_group[sorted_groups]
    ranks = torch.empty_like(rank_sorted)
    ranks[order] = torch.where(sorted_groups < num_ids, rank_sorted, -1)
    return ranks.view(num_rows, num_topk)


def expand_rows(recv_topk_idx: torch.Tensor, num_local_experts: int,
                expert_alignment: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (``row_of`` int32 [N, K]: each pair's expanded row, -1 where no local expert; ``counts`` int32 [L];
    ``ends`` int32 [L]: where each expert's pairs end, ``align(ends[i-1]) + counts[i]``)."""
    counts = expert_counts(recv_topk_idx, num_local_experts).long()
    starts = _aligned_starts(counts, expert_alignment)
    ends = starts + counts
    # The rank of pair (j, k) within its expert, past the expert's start.
    valid = recv_topk_idx >= 0
    ranks = _ranks_in_group(recv_topk_idx, valid, num_local_experts)
    row_of = torch.where(valid, starts[torch.where(valid, recv_topk_idx, 0).long()] + ranks, -1)
    return row_of.to(torch.int32), counts.to(torch.int32), ends.to(torch.int32)


def source_ranks(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [T, K], at a dispatch's source: slot k's rank among this rank's tokens whose top-k names expert
    ``topk_idx[t, k]``, in token order (-1 where the slot names none). With `expanded_bases` at the destination it
    gives each pair's expanded row before any row arrives: ``row_of[j, k] = bases[s, e] + source_ranks[t, k]`` for
    received row j from source s, token t, whose slot k names local expert e (a token names an expert once)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return _ranks_in_group(topk_idx, valid, num_experts).to(torch.int32)


def expanded_bases(counts: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """int32 [R, L], at a destination, from ``counts [R, L]`` (the pairs of its local expert l that source s sends):
    where source s's pairs of expert l begin in the expanded layout, ``starts[l] + sum over s' < s of counts[s',
    l]``, ``starts`` as in `expand_rows` (each expert's block aligned)."""
    counts = counts.long()
    starts = _aligned_starts(counts.sum(0), expert_alignment)
    return (starts.unsqueeze(0) + torch.cumsum(counts, 0) - counts).to(torch.int32)


def _pair_of(row_of: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """int64 [num_expanded]: the pair ``j * K + k`` each expanded row holds, ``N * K`` on padding rows."""
    num_pairs = row_of.numel()
    pair_of = torch.full((num_expanded + 1,), num_pairs, dtype=torch.long, device=row_of.device)
    where = torch.where(row_of >= 0, row_of, num_expanded).flatten().long()  # one spare row takes the rest
    pair_of.scatter_(0, where, torch.arange(num_pairs, dtype=torch.int64, device=row_of.device))
    return pair_of[:num_expanded]


def _gathered(source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, zero_fill: bool) -> torch.Tensor:
    """``source[index]`` (index clamped into range), rows where not `valid` zero if `zero_fill`."""
    if source.size(0) == 0:
        shape = (index.numel(),) + tuple(source.shape[1:])
        return torch.zeros(shape, dtype=source.dtype, device=source.device)
    out = source.index_select(0, index.clamp(max=source.size(0) - 1))
    if zero_fill:
        out.masked_fill_(~valid.view((-1,) + (1,) * (out.dim() - 1)), 0)
    return out


def source_rows(row_of: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """int32 [num_expanded]: the received row each expanded row holds, -1 on padding."""
    pair_of = _pair_of(row_of, num_expanded)
    return torch.where(pair_of < row_of.numel(), pair_of // row_of.size(1), -1).to(torch.int32)


def gather_rows(rows: torch.Tensor, source_row: torch.Tensor, zero_fill: bool) -> torch.Tensor:
    """``out[m] = rows[source_row[m]]``; rows with ``source_row[m] < 0`` are zero where `zero_fill`, else
    unspecified."""
    if rows.element_size() == 1 and rows.dtype != torch.uint8:  # FP8 has no masked_fill_: move the bytes
        return gather_rows(rows.view(torch.uint8), source_row, zero_fill).view(rows.dtype)
    return _gathered(rows, source_row.long().clamp(min=0), source_row >= 0, zero_fill)


def expand_weights(topk_weights: torch.Tensor, row_of: torch.Tensor, num_expanded: int,
                   zero_fill: bool) -> torch.Tensor:
    """float32 [num_expanded]: pair (j, k)'s weight ``topk_weights[j, k]`` at its expanded row."""
    pair_of = _pair_of(row_of, num_expanded)
    return _gathered(topk_weights.float().flatten(), pair_of, pair_of < row_of.numel(), zero_fill)


def reduce_expanded(x: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """The rows a combine sends back: row j is ``x.dtype(sum over k in increasing order of
    float32(x[row_of[j, k]]))`` over the pairs with a local expert (zeros for a row without)."""
    num_rows, num_topk = row_of.shape
    acc = torch.zeros(num_rows, x.size(1), dtype=torch.float32, device=x.device)
    for k in range(num_topk):
        acc += _gathered(x, row_of[:, k].long().clamp(min=0), row_of[:, k] >= 0, True).float()
    return acc.to(x.dtype)


def gather_weights(topk_weights: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from expanded weights [M]: pair (j, k)'s weight, 0 where no local expert."""
    padded = torch.cat([topk_weights.float(), torch.zeros(1, dtype=torch.float32, device=topk_weights.device)])
    return padded[torch.where(row_of >= 0, row_of, topk_weights.size(0)).long()]


def local_weights(topk_weights: torch.Tensor, recv_topk_idx: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: the weights of the slots whose expert is local, 0 elsewhere (what a combine sums, so each
    token's slot k comes back from the one rank that owns its expert)."""
    return topk_weights.float().masked_fill(recv_topk_idx < 0, 0.0)


def source_metadata(recv_topk_idx: torch.Tensor, recv_src_idx: torch.Tensor, psum_per_rank: torch.Tensor,
                    num_max_tokens_per_rank: int, row_of: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 [N, K + 2], DeepEP V2's ``recv_src_metadata``: column 0 the token's global index
    ``source rank * num_max_tokens_per_rank + token index`` (-1 on padding rows), column 1
    ``source rank * K + the first slot with a local expert``, columns 2.. the pairs' expanded rows (-1 where
    none, and everywhere outside the expanded layout)."""
    num_rows, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    positions = torch.arange(num_rows, device=device, dtype=torch.int32)
    source = torch.searchsorted(psum_per_rank.to(torch.int32).contiguous(), positions, right=True).to(torch.int32)
    real = recv_src_idx >= 0
    global_idx = torch.where(real, source * num_max_tokens_per_rank + recv_src_idx, -1)
    local = recv_topk_idx >= 0
    slots = torch.arange(num_topk, device=device, dtype=torch.int32).expand(num_rows, num_topk)
    first_slot = torch.where(local, slots, num_topk).min(dim=1).values
    first = torch.where(real & (first_slot < num_topk), source * num_topk + first_slot, -1)
    expanded = row_of if row_of is not None else torch.full((num_rows, num_topk), -1, dtype=torch.int32,
                                                             device=device)
    return torch.cat([global_idx.unsqueeze(1), first.unsqueeze(1), expanded.to(torch.int32)], dim=1).to(torch.int32)
