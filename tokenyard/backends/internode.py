"""The reference backend's internode normal mode: DeepEP's hierarchical path in two all-to-alls.

NOTE [internode stages]
A group of N nodes of P ranks (rank r is local rank l = r % P of node n = r // P; NOTE [virtual nodes] in
plan/devices.py) dispatches in two stages, each one `all_to_all_single` of the whole group in which a rank
sends to and receives from its stage's peers only (zero splits elsewhere), so no new process group is made:

- stage 1 ("RDMA"): rank (n, l) sends each token once to the forwarder (m, l) of every node m that holds one
  of its experts (m == n too: to itself). The forwarder receives in order of source node, then token (the
  all-to-all's order: its sources (0, l), (1, l), ... are in increasing rank order). Each row carries the
  token's `is_token_in_rank` row, which says where the forwarder sends it on.
- stage 2 ("NVLink"): forwarder (m, l) sends each row it received to the ranks j of node m that hold the
  token's experts. Rank (m, j) receives from forwarders (m, 0), (m, 1), ... in turn, each in order of
  source node then token, and places the rows in order of global source rank then token (NOTE [recv order]
  in routing.py): a stable sort by source rank, since a forwarder's rows of one source are one run in token
  order.

So the outputs are the one-node dispatch's, bit for bit; only the handle differs (NOTE [internode handle]).
Combine runs the stages backwards: each receiver sends its rows of the sources (n', l) back to forwarder
(m, l), in the order that forwarder sent them (`send_nvl_head`'s rows for column j are increasing), which
sums them per token into a bf16 partial over the local ranks j in increasing order; each forwarder sends its
partials of node n's tokens back to (n, l) (`send_rdma_head` order), which adds them to the biases over the
nodes m in increasing order (docs/semantics.md "Internode normal mode"; routing.internode_combine).
Example: 2 nodes x 2 ranks, rank 1's token 0 has experts on ranks 1 and 3: stage 1 sends it to rank 1
(itself) and rank 3; stage 2 has rank 1 send it to itself and rank 3 send it to itself. In the combine,
rank 3's row goes back to forwarder 3 (itself), which sends its bf16 partial to rank 1.

Each call runs whole (one round): rounds of the internode path come with the CUDA kernels.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

from .. import checks
from ..handle import DispatchHandle, InternodeHandle
from ..semantics import routing
from .requests import CombineRequest, DispatchRequest, DispatchResult
from .rows import byte_rows, flat_handle, from_bytes, pack


@dataclasses.dataclass(frozen=True)
class _Nodes:
    """This rank's place among nodes of `per_node` consecutive ranks."""

    rank: int
    num_ranks: int
    per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.per_node

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    @property
    def local(self) -> int:
        return self.rank % self.per_node

    def forwarder(self, node: int) -> int:
        """This rank's stage-1 peer on `node`: the rank of the same local index (also whom it serves)."""
        return node * self.per_node + self.local

    def in_node(self, local: int) -> int:
        """Rank `local` of this rank's node: a stage-2 peer."""
        return self.node * self.per_node + local

    def splits(self, peers: Sequence[int], counts: Sequence[int]) -> List[int]:
        """A split per rank of the group: `counts` at `peers`, 0 elsewhere."""
        splits = [0] * self.num_ranks
        for peer, count in zip(peers, counts):
            splits[peer] = int(count)
        return splits


def _send(backend, nodes: _Nodes, rows: torch.Tensor, blocks: Sequence[Tuple[int, torch.Tensor]],
          recv_splits: List[int]) -> torch.Tensor:
    """One stage: rows ``index`` of each ``(peer, index)`` block go to `peer` (peers increasing), and
    ``recv_splits[s]`` rows come from each rank s; returns what came, in order of source rank."""
    send_splits = nodes.splits([peer for peer, _ in blocks], [index.numel() for _, index in blocks])
    order = torch.cat([index for _, index in blocks])
    recv = rows.new_empty(sum(recv_splits), rows.size(1))
    backend._all_to_all(recv, rows[order], recv_splits, send_splits)
    return recv


def _selected(mask: torch.Tensor, column: int) -> torch.Tensor:
    return mask[:, column].nonzero().flatten()


def _source_order(nodes: _Nodes, from_rank: torch.Tensor) -> torch.Tensor:
    """Stage 2's receive order -> the final one (NOTE [internode stages]): the permutation that sorts rows
    received from forwarders l = 0, 1, ... (each holding sources (0, l), (1, l), ...) by source rank.
    from_rank: ``[R]`` rows this rank receives from each source rank."""
    sources = torch.arange(nodes.num_ranks, dtype=torch.int64, device=from_rank.device)
    sources = sources.view(nodes.num_nodes, nodes.per_node).t()
    sources = sources.flatten()
    source_of_row = torch.repeat_interleave(sources, from_rank.long()[sources])
    return torch.sort(source_of_row, stable=True).indices


def _two_stages(backend, nodes: _Nodes, rows: torch.Tensor, to_node: torch.Tensor, from_node: torch.Tensor,
                forwarded_to, from_rank: torch.Tensor):
    """The dispatch's data path (NOTE [internode stages]).

    rows: ``[T, bytes]``; to_node: bool ``[T, N]``, the tokens sent to each node's forwarder; from_node:
    ``[N]``, the rows this rank forwards from each node; forwarded_to(recv1) -> bool ``[F, P]``: where each
    received row goes on; from_rank: ``[R]``, the rows this rank receives from each source rank.
    Returns (forwarded_to of the stage-1 rows, the final rows in receive order).
    """
    recv1 = _send(backend, nodes, rows, [(nodes.forwarder(m), _selected(to_node, m)) for m in range(nodes.num_nodes)],
                  nodes.splits([nodes.forwarder(m) for m in range(nodes.num_nodes)], from_node.tolist()))
    mask = forwarded_to(recv1)
    per_forwarder = from_rank.view(nodes.num_nodes, nodes.per_node).sum(0)  # [l]: rows from forwarder (n, l)
    recv2 = _send(backend, nodes, recv1, [(nodes.in_node(j), _selected(mask, j)) for j in range(nodes.per_node)],
                  nodes.splits([nodes.in_node(j) for j in range(nodes.per_node)], per_forwarder.tolist()))
    return mask, recv2[_source_order(nodes, from_rank)]


def _nodes(backend) -> _Nodes:
    ctx = backend.ctx
    return _Nodes(ctx.rank, ctx.num_ranks, ctx.topology.ranks_per_node)


def dispatch(backend, request: DispatchRequest, kernels=None) -> DispatchResult:
    """A fresh or cached normal dispatch through the two stages; the outputs are the one-node dispatch's
    (docs/semantics.md "Normal dispatch"), the handle an `InternodeHandle`. `backend` is a reference backend,
    whose count exchange, rows and outputs serve both paths; `kernels` (the CUDA backend's `InternodeKernels`)
    moves the rows in place of the two all-to-alls (NOTE [internode kernels])."""
    if request.handle is not None:
        return _cached_dispatch(backend, request, kernels)
    nodes = _nodes(backend)
    rank, per_node = nodes.rank, nodes.per_node
    in_rank = request.is_token_in_rank
    to_node = routing.tokens_per_node(in_rank, per_node)
    # counts[s, q]: rows s sends q; node_counts[s, m]: tokens s sends node m
    counts, most_call_tokens, per_expert, node_counts = backend.count_exchange(
        request, extra=to_node.sum(0, dtype=torch.int32))
    if request.num_worst_tokens:
        checks.received_rows(counts.sum(0), request.num_worst_tokens)
    from_node = node_counts[nodes.local::per_node, nodes.node]            # [n']: from source (n', l)

    if kernels is None:
        # Each row carries the token's is_token_in_rank row; the forwarder reads its node's columns of it.
        rows, spans = backend.payload(request, extra=in_rank.to(torch.uint8))
        in_node = slice(spans[-1][0] + nodes.node * per_node, spans[-1][0] + (nodes.node + 1) * per_node)
        mask, recv = _two_stages(backend, nodes, rows, to_node, from_node, lambda recv1: recv1[:, in_node].bool(),
                                 counts[:, rank])
    else:
        rows, spans = backend.payload(request)
        recv, mask = kernels.dispatch(rows, in_rank, counts, node_counts, most_call_tokens, request.config.num_sms,
                                      backend._all_gather)
    recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, recv_src_idx = backend.received(
        request, recv, spans, per_expert)

    # The handle (NOTE [internode handle]).
    from_rank = counts[:, rank]
    ranks = torch.arange(nodes.num_ranks, dtype=torch.int64, device=in_rank.device)
    source_rank = torch.repeat_interleave(ranks, from_rank.long())
    source_rank = torch.cat([source_rank, source_rank.new_full((recv_src_idx.numel() - source_rank.numel(),), -1)])
    recv_src_meta = torch.stack([source_rank.to(torch.int32), recv_src_idx], dim=1)
    # send_rdma_head: forwarder (m, l) holds the rows of sources (n', l), n' < n, before this rank's.
    rdma_first = node_counts[nodes.local::per_node][:nodes.node].sum(0)
    send_rdma_head = routing.landing_rows(to_node, rdma_first)
    # send_nvl_head: a forwarded row of source s lands on (n, j) at s's first row there plus its place among
    # s's rows for j, i.e. minus the rows for j of the sources forwarded before s.
    rows_before = counts.cumsum(0) - counts                                   # [s, q]: rows on q before source s
    block = counts[nodes.local::per_node, nodes.node * per_node:(nodes.node + 1) * per_node]  # [n', j]
    block_before = block.cumsum(0) - block
    node_ids = torch.arange(nodes.num_nodes, dtype=torch.int64, device=in_rank.device)
    source_node = torch.repeat_interleave(node_ids, from_node.long())
    forwarded_source = source_node * per_node + nodes.local
    nvl_first = rows_before[forwarded_source, nodes.node * per_node:(nodes.node + 1) * per_node] - \
        block_before[source_node]
    send_nvl_head = routing.landing_rows(mask, nvl_first)
    recv_total = from_rank.cumsum(0).to(torch.int32)
    handle = InternodeHandle(
        in_rank, to_node.sum(0, dtype=torch.int32).view(-1, 1), counts[rank].to(torch.int32).view(-1, 1).clone(),
        from_node.to(torch.int32).view(-1, 1).clone(), from_node.cumsum(0).to(torch.int32),
        (recv_total - from_rank).to(torch.int32).view(-1, 1), recv_total, recv_src_meta, send_rdma_head,
        send_nvl_head, flat=flat_handle(counts, rank, recv_src_idx, in_rank),
        group_counts=(counts, node_counts, most_call_tokens))
    return DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle,
                          most_call_tokens)


def _cached_dispatch(backend, request: DispatchRequest, kernels) -> DispatchResult:
    """The handle's layout again: stage 1 by `send_rdma_head`, stage 2 by `send_nvl_head`; the rows fill the
    handle's rows (its num_worst_tokens, if it had one), as a one-node cached dispatch does. The kernels need
    every rank's counts, which the handle's rows per rank and per node give (one all-gather)."""
    nodes, handle = _nodes(backend), request.handle
    rows, spans = backend.payload(request)
    from_rank = torch.diff(handle.recv_gbl_rank_prefix_sum, prepend=handle.recv_gbl_rank_prefix_sum.new_zeros(1))
    from_node = handle.recv_rdma_channel_prefix_matrix[:, 0]
    if kernels is None:
        _, recv = _two_stages(backend, nodes, rows, handle.send_rdma_head >= 0, from_node,
                              lambda recv1: handle.send_nvl_head >= 0, from_rank)
    else:
        counts, node_counts, most_tokens = group_counts(backend, handle)
        recv, _ = kernels.dispatch(rows, handle.is_token_in_rank, counts, node_counts, most_tokens,
                                   request.config.num_sms, backend._all_gather)
    padded = dataclasses.replace(request, num_worst_tokens=handle.num_rows)
    recv_x, recv_x_scales = backend.received(padded, recv, spans, None)[:2]
    return DispatchResult(recv_x, recv_x_scales, None, None, None, handle)


def combine(backend, request: CombineRequest, kernels=None):
    """The internode combine (NOTE [internode stages]): ``(combined_x, combined_topk_weights or None)``; with
    `kernels`, by the CUDA backend's (NOTE [internode kernels])."""
    nodes, handle = _nodes(backend), request.handle
    x, weights = request.x, request.topk_weights
    if kernels is not None:
        num_recv = int(handle.recv_gbl_rank_prefix_sum[-1])
        return kernels.combine(x[:num_recv], None if weights is None else weights[:num_recv],
                               handle.is_token_in_rank, handle.send_nvl_head,
                               handle.recv_rdma_channel_prefix_matrix[:, 0].tolist(), (request.bias_0, request.bias_1),
                               request.config.num_sms, handle.recv_src_meta[:num_recv],
                               group_counts(backend, handle)[2], backend._all_gather)
    device, hidden = x.device, x.size(1)
    columns = [byte_rows(x)] + ([] if weights is None else [byte_rows(weights)])
    rows, spans = pack(columns)

    # Stage 2 backwards: the rows of sources (n', l) go back to forwarder (n, l), in the order it sent them.
    recv_total = handle.recv_gbl_rank_prefix_sum.long()
    from_rank = torch.diff(recv_total, prepend=recv_total.new_zeros(1))
    first = recv_total - from_rank
    blocks = []
    for local in range(nodes.per_node):
        sources = range(local, nodes.num_ranks, nodes.per_node)
        index = [torch.arange(int(first[s]), int(recv_total[s]), dtype=torch.int64, device=device) for s in sources]
        blocks.append((nodes.in_node(local), torch.cat(index)))
    forwarded_to = handle.send_nvl_head >= 0
    back = _send(backend, nodes, rows, blocks, nodes.splits([nodes.in_node(j) for j in range(nodes.per_node)],
                                                            forwarded_to.sum(0).tolist()))
    partial = _summed(back, spans, forwarded_to, x.dtype, hidden, weights)

    # Stage 1 backwards: the partials of node n's tokens go back to (n, l), in send_rdma_head order.
    from_node = handle.recv_rdma_channel_prefix_matrix[:, 0].long()
    node_first = from_node.cumsum(0) - from_node
    peers = [nodes.forwarder(m) for m in range(nodes.num_nodes)]
    blocks = [(peer, torch.arange(int(node_first[m]), int(node_first[m] + from_node[m]), dtype=torch.int64,
                                      device=device))
              for m, peer in enumerate(peers)]
    sent_to_node = handle.send_rdma_head >= 0
    partials = _send(backend, nodes, partial, blocks, nodes.splits(peers, sent_to_node.sum(0).tolist()))

    num_tokens = handle.num_tokens
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for bias in (request.bias_0, request.bias_1):
        if bias is not None:
            acc = acc + bias.float()
    acc_w = None if weights is None else torch.zeros(num_tokens, weights.size(1), dtype=torch.float32, device=device)
    begin = 0
    for m in range(nodes.num_nodes):
        tokens = _selected(sent_to_node, m)
        end = begin + tokens.numel()
        acc[tokens] = acc[tokens] + from_bytes(partials[begin:end], *spans[0], x.dtype, hidden).float()
        if acc_w is not None:
            acc_w[tokens] = acc_w[tokens] + from_bytes(partials[begin:end], *spans[1], torch.float32, weights.size(1))
        begin = end
    return acc.to(x.dtype), acc_w


def _summed(back: torch.Tensor, spans, forwarded_to: torch.Tensor, dtype: torch.dtype, hidden: int, weights):
    """A forwarder's partials: for each row it forwarded, the float32 sum over local ranks j (increasing) of
    the rows j sent back, rounded to `dtype` once; weights summed in float32. Returns them as byte rows with
    the spans of `back`."""
    num_forwarded = forwarded_to.size(0)
    device = back.device
    acc = torch.zeros(num_forwarded, hidden, dtype=torch.float32, device=device)
    acc_w = None if weights is None else torch.zeros(num_forwarded, weights.size(1), dtype=torch.float32,
                                                     device=device)
    begin = 0
    for j in range(forwarded_to.size(1)):
        forwarded = _selected(forwarded_to, j)
        end = begin + forwarded.numel()
        acc[forwarded] = acc[forwarded] + from_bytes(back[begin:end], *spans[0], dtype, hidden).float()
        if acc_w is not None:
            acc_w[forwarded] = acc_w[forwarded] + from_bytes(back[begin:end], *spans[1], torch.float32,
                                                             weights.size(1))
        begin = end
    columns = [byte_rows(acc.to(dtype))] + ([] if acc_w is None else [byte_rows(acc_w)])
    return pack(columns)[0]


def group_counts(backend, handle: InternodeHandle):
    """``(counts [R, R], tokens per node [R, N], most tokens of a rank)`` of the dispatch that made `handle`: kept
    on our handles, gathered again (one all-gather) for a plain 10-tuple."""
    kept = getattr(handle, "group_counts", None)
    if kept is not None:
        return kept
    num_ranks = handle.gbl_channel_prefix_matrix.size(0)
    mine = torch.cat([handle.gbl_channel_prefix_matrix[:, 0], handle.rdma_channel_prefix_matrix[:, 0],
                      handle.gbl_channel_prefix_matrix.new_full((1,), handle.num_tokens)]).to(torch.int32)
    gathered = backend._all_gather(mine)
    return gathered[:, :num_ranks], gathered[:, num_ranks:-1], int(gathered[:, -1].max())


def flat_handle_of(handle: InternodeHandle, exchange) -> DispatchHandle:
    """The one-node `DispatchHandle` of an internode handle: its `flat`, or, for one built from a plain
    10-tuple, derived with one all-gather of every rank's tokens per rank (NOTE [internode handle])."""
    if handle.flat is not None:
        return handle.flat
    counts = exchange.all_gather(handle.gbl_channel_prefix_matrix[:, 0].contiguous())
    return flat_handle(counts, exchange.rank, handle.recv_src_meta[:, 1].contiguous(), handle.is_token_in_rank)
