"""Byte rows: a token's tensors packed side by side into one uint8 row, and the one-node handle that says where
a normal-mode dispatch's rows land.

The reference backend (reference.py) moves its rows this way in both modes, and its internode path
(internode.py) in its two stages. `byte_rows` views a [T, ...] tensor as [T, bytes]; `pack` lays such byte
columns side by side and returns each column's (begin, end); `from_bytes` reads a column back as its dtype.
`flat_handle` builds the one-node `DispatchHandle` from the counts every rank sends every other.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from ..handle import DispatchHandle
from ..semantics import routing


def byte_rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[T, ...] tensor -> [T, bytes] uint8 view (copying only if not contiguous).

    A contiguous tensor may still have a last stride other than 1 where that axis has one element (strides of
    size-1 axes do not count for contiguity): SGLang's UE8M0 scales at hidden 512, one int32 column
    column-major, are [T, 1] with strides (1, T rounded up to 4). Viewed as bytes, those rows are the same
    memory with the strides of a row-major tensor.
    """
    if t is None:
        return None
    t = t.contiguous()
    width = math.prod(t.shape[1:])
    rows = t.view(t.size(0), width)
    if rows.stride(1) != 1:  # one column (or an empty axis): its stride does not count, its rows are adjacent
        rows = rows.as_strided(rows.shape, (width, 1))
    return rows.view(torch.uint8)


def from_bytes(rows: torch.Tensor, begin: int, end: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Columns [begin, end) of byte rows, reinterpreted as `width` elements of `dtype` per row."""
    column = rows.new_empty(rows.size(0), end - begin).copy_(rows[:, begin:end])
    return column.view(dtype).view(rows.size(0), width)


def pack(columns: List[torch.Tensor]):
    """Concatenate byte columns; return the rows and each column's (begin, end)."""
    spans, begin = [], 0
    for c in columns:
        spans.append((begin, begin + c.size(1)))
        begin += c.size(1)
    return torch.cat(columns, dim=1), spans


def exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.cumsum(dim) - t


def flat_handle(counts: torch.Tensor, rank: int, recv_src_idx: torch.Tensor,
                is_token_in_rank: torch.Tensor) -> DispatchHandle:
    """The one-node `DispatchHandle` (NOTE [handle contents]) from ``counts [R, R]`` (tokens rank s sends to
    rank r, the same on every rank) and this rank's own fields."""
    rank_prefix_matrix = counts.cumsum(0).to(torch.int32)
    recv_first = exclusive_cumsum(counts[:, rank], 0)
    send_head = routing.landing_rows(is_token_in_rank, rank_prefix_matrix[rank] - counts[rank])
    return DispatchHandle(rank_prefix_matrix, counts[rank].view(-1, 1).to(torch.int32).clone(),
                          recv_first.view(-1, 1).to(torch.int32), recv_src_idx, is_token_in_rank, send_head)
