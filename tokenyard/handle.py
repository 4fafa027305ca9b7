"""Handles returned by dispatch: named objects that still unpack as DeepEP's tuples.

NOTE [handle contents]
`DispatchHandle` unpacks into DeepEP's six intranode fields, with these meanings (all on the caller's
device; R ranks, T tokens sent by this rank, N rows received by this rank):

    rank_prefix_matrix          int32 [R, R]  entry [s, r]: tokens ranks 0..s sent to rank r, inclusive.
                                              Same on every rank.
    channel_prefix_matrix       int32 [R, 1]  tokens this rank sends to each rank (one channel).
    recv_channel_prefix_matrix  int32 [R, 1]  first received row of each source rank.
    recv_src_idx                int32 [N]     index of each received row in its source rank's input
                                              (-1 on padding rows when `num_worst_tokens` is used).
    is_token_in_rank            bool  [T, R]  whether this rank's token t went to rank r.
    send_head                   int32 [T, R]  row at which token t landed on rank r, or -1.

These six fields are all any backend needs to run a cached dispatch or a combine, so a plain 6-tuple
built by DeepEP-style code is accepted too. `LowLatencyHandle` unpacks into DeepEP's five low-latency
fields ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:

    src_info      int32 [L, R * M]  source token index of each slot (-1 where unused).
    layout_range  int64 [L, R]      ``(begin << 32) | count``: the slots of local expert l that came
                                    from rank r are ``begin .. begin + count - 1``.
"""

from __future__ import annotations

from typing import Optional

import torch

_DISPATCH_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                    "recv_src_idx", "is_token_in_rank", "send_head")
_LOW_LATENCY_FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                       "num_experts")


class _NamedTuple(tuple):
    """A tuple whose positions also have names, plus a few attributes that are not unpacked."""

    _fields: tuple = ()

    def __new__(cls, *values, **attributes):
        if len(values) != len(cls._fields):
            raise TypeError(f"{cls.__name__} takes {len(cls._fields)} fields {cls._fields}, got {len(values)}")
        obj = super().__new__(cls, values)
        for name, value in attributes.items():
            object.__setattr__(obj, name, value)
        return obj

    def __getattr__(self, name):
        if name in type(self)._fields:
            return self[type(self)._fields.index(name)]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __reduce__(self):
        """copy, deepcopy and pickle keep the fields and the attributes (tuple's own reduce would pass the
        fields to __new__ as one argument)."""
        return _rebuild, (type(self), tuple(self), dict(self.__dict__))

    def __repr__(self) -> str:
        parts = []
        for name, value in zip(type(self)._fields, self):
            shown = f"tensor{tuple(value.shape)}:{value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
            parts.append(f"{name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _rebuild(cls, values, attributes):
    return cls(*values, **attributes)


class DispatchHandle(_NamedTuple):
    """The layout of one normal-mode dispatch (see NOTE [handle contents]).

    Attributes beyond the six fields:
        buffer_id: identity of the `Buffer` that made it (None for a handle built from a plain tuple).
        num_recv_tokens: rows actually received, or None where unknown on the host (`num_worst_tokens`).
        rounds: the `tokenyard.plan.rounds.Rounds` the dispatch ran in (NOTE [rounds]), with each round's own
            handle, so combine and cached dispatch replay them; None for a handle built from a plain tuple.
    """

    _fields = _DISPATCH_FIELDS
    buffer_id: Optional[int] = None
    num_recv_tokens: Optional[int] = None
    rounds: Optional[object] = None

    @property
    def num_rows(self) -> int:
        """Rows of the received tensors (the worst-case count when `num_worst_tokens` was used)."""
        return self[3].size(0)

    @property
    def num_tokens(self) -> int:
        """Tokens this rank sent (rows of its combine output)."""
        return self[4].size(0)


class LowLatencyHandle(_NamedTuple):
    """The layout of one low-latency dispatch (see NOTE [handle contents]).

    Attributes beyond the five fields:
        buffer_id: identity of the `Buffer` that made it.
        num_topk: top-k of the dispatch.
        num_tokens: tokens the dispatch sent (its topk_idx's rows, which the combine's must equal).
        half: which half of the low-latency buffer the dispatch used (CUDA backend); None for a handle
            built from a plain tuple, whose half the backend finds from `src_info` (NOTE [plain low-latency
            handles] in backends/cuda/low_latency.py).
    """

    _fields = _LOW_LATENCY_FIELDS
    buffer_id: Optional[int] = None
    num_topk: Optional[int] = None
    num_tokens: Optional[int] = None
    half: Optional[int] = None


def _as_handle(cls, handle):
    if isinstance(handle, cls):
        return handle
    if isinstance(handle, (tuple, list)) and len(handle) == len(cls._fields):
        return cls(*handle)
    raise TypeError(f"expected a {cls.__name__} ({len(cls._fields)} fields {cls._fields}), got {type(handle).__name__}")


def as_dispatch_handle(handle) -> DispatchHandle:
    """Accept our handle or DeepEP's plain 6-tuple."""
    return _as_handle(DispatchHandle, handle)


def as_low_latency_handle(handle) -> LowLatencyHandle:
    """Accept our handle or DeepEP's plain 5-tuple."""
    return _as_handle(LowLatencyHandle, handle)
