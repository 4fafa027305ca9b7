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
built by DeepEP-style code is accepted too. `InternodeHandle` (a group of several nodes, NOTE [internode
handle]) unpacks into DeepEP's ten internode fields. `LowLatencyHandle` unpacks into DeepEP's five low-latency
fields ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:

    src_info      int32 [L, R * M]  source token index of each slot (-1 where unused).
    layout_range  int64 [L, R]      ``(begin << 32) | count``: the slots of local expert l that came
                                    from rank r are ``begin .. begin + count - 1``.

NOTE [internode handle]
A dispatch on a group of N > 1 nodes of P ranks (rank r is local rank r % P of node r // P) moves rows in
two stages (docs/semantics.md "Internode normal mode"): to the forwarder (m, r % P) of each node m that
holds one of the token's experts, which receives in order of source node, then token ("RDMA"), and from it
to the ranks of m that hold them ("NVLink"). `InternodeHandle` unpacks into DeepEP's ten internode fields,
in DeepEP's order, with these meanings (one "channel", as the intranode handle has; T tokens sent, N_recv
rows received, N_fwd rows forwarded by this rank):

    is_token_in_rank                 bool  [T, R]      whether this rank's token t went to rank q.
    rdma_channel_prefix_matrix       int32 [N, 1]      tokens this rank sends to node m (stage 1).
    gbl_channel_prefix_matrix        int32 [R, 1]      tokens this rank sends to rank q.
    recv_rdma_channel_prefix_matrix  int32 [N, 1]      tokens this rank forwards that came from node m.
    recv_rdma_rank_prefix_sum        int32 [N]         its inclusive cumsum.
    recv_gbl_channel_prefix_matrix   int32 [R, 1]      first received row from each source rank.
    recv_gbl_rank_prefix_sum         int32 [R]         inclusive cumsum of the rows from each source rank.
    recv_src_meta                    int32 [N_recv, 2] (source rank, source token index) of each received
                                                       row; -1 on `num_worst_tokens` padding rows.
    send_rdma_head                   int32 [T, N]      row at which token t landed in forwarder (m, r % P)'s
                                                       stage-1 receive, or -1.
    send_nvl_head                    int32 [N_fwd, P]  for each row this rank forwarded (stage-1 receive
                                                       order), the row at which it landed on local rank j
                                                       of this node, or -1.

DeepEP's own cached path reads `recv_src_meta.size(0)` as the rows received and `send_nvl_head.size(0)` as
the rows forwarded; so do we. The ten fields are all the reference backend's internode path needs, so a
plain 10-tuple is accepted too. The handle also carries, as the attribute `flat` (not unpacked), the
`DispatchHandle` a one-node dispatch of the same tokens makes, so a Buffer that sees the group as one node
takes the handle as well; a plain 10-tuple has none, which such a Buffer derives (`backends.internode.
flat_handle_of`, one all-gather).
Example: 2 nodes x 2 ranks; rank 1 (node 0, local 1) sends token 0 (experts on ranks 1 and 3) to
forwarders 1 (itself) and 3, so send_rdma_head[0] = [row on 1, row on 3]; forwarder 3 sends it on to
rank 3 only, and its send_nvl_head row for it is [-1, row on 3].
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

_DISPATCH_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                    "recv_src_idx", "is_token_in_rank", "send_head")
_INTERNODE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                     "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                     "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
_LOW_LATENCY_FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                       "num_experts")


class _NamedTuple(tuple):
    """A tuple whose positions also have names, plus a few attributes that are not unpacked."""

    _fields: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for index, name in enumerate(cls._fields):  # a field read by name costs what one by position does
            setattr(cls, name, property(operator.itemgetter(index), doc=f"field {index} of the tuple"))

    def __new__(cls, *values, **attributes):
        if len(values) != len(cls._fields):
            raise TypeError(f"{cls.__name__} takes {len(cls._fields)} fields {cls._fields}, got {len(values)}")
        obj = tuple.__new__(cls, values)
        if attributes:  # a handle is made on every fresh dispatch: one update, not a setattr each
            obj.__dict__.update(attributes)
        return obj

    @classmethod
    def of(cls, values: tuple, attributes: dict):
        """`cls(*values, **attributes)` at less than half its cost, for the handles the calls make: `values` are
        as many as the fields (not checked) and `attributes`, a dict of the caller's own, becomes the handle's."""
        obj = tuple.__new__(cls, values)
        obj.__dict__ = attributes
        return obj

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
        rounds: the `tokenyard.rounds.Rounds` the dispatch ran in (NOTE [rounds]), with each round's own
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


class InternodeHandle(_NamedTuple):
    """The layout of one normal-mode dispatch over several nodes (see NOTE [internode handle]).

    Attributes beyond the ten fields:
        flat: the `DispatchHandle` a one-node dispatch of the same tokens makes (None for a handle built
            from a plain tuple).
        buffer_id: identity of the `Buffer` that made it (None for a handle built from a plain tuple).
        num_recv_tokens: rows actually received, or None where unknown on the host (`num_worst_tokens`).
        group_counts: ``(counts [R, R], tokens per node [R, N], most tokens of a rank)``, as the dispatch's count
            exchange gave them (None for a handle built from a plain tuple): the CUDA backend's kernels need them
            for a cached dispatch and for rounds, and exchange them again only where they are missing.
    """

    _fields = _INTERNODE_FIELDS
    flat: Optional[DispatchHandle] = None
    buffer_id: Optional[int] = None
    num_recv_tokens: Optional[int] = None
    group_counts: Optional[tuple] = None

    @property
    def num_rows(self) -> int:
        """Rows of the received tensors (the worst-case count when `num_worst_tokens` was used)."""
        return self[7].size(0)

    @property
    def num_tokens(self) -> int:
        """Tokens this rank sent (rows of its combine output)."""
        return self[0].size(0)

    @property
    def rounds(self):
        """The rounds of its one-node equivalent (one: internode calls run whole), None without `flat`."""
        return None if self.flat is None else self.flat.rounds

    @property
    def num_forwarded(self) -> int:
        """Rows this rank forwarded (received in stage 1)."""
        return self[9].size(0)


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


def as_normal_handle(handle):
    """Accept a `DispatchHandle`, an `InternodeHandle`, or DeepEP's plain 6- or 10-tuple."""
    is_sequence = isinstance(handle, (tuple, list))
    if isinstance(handle, InternodeHandle) or (is_sequence and not isinstance(handle, DispatchHandle)
                                               and len(handle) == len(_INTERNODE_FIELDS)):
        return _as_handle(InternodeHandle, handle)
    return as_dispatch_handle(handle)


def as_low_latency_handle(handle) -> LowLatencyHandle:
    """Accept our handle or DeepEP's plain 5-tuple."""
    return _as_handle(LowLatencyHandle, handle)
