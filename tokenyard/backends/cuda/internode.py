"""The host side of the internode kernels (NOTE [internode kernels] in include/tokenyard/kernels/internode.cuh): their
buffers in NVSHMEM's symmetric heap, the rows they move packed and read back with torch ops, the launches.

NOTE [internode region]
Each rank holds one symmetric region of `num_rdma_bytes`, cut the same way on every rank without any exchange, so
that an address one rank computes for another is right there: dispatch puts stage-1 rows into its first half,
`fwd_recv` [N][C][row] with C = half / (N x row) rows per source node, and the received rows into its second half
(`recv`, rows of the receiver's own order); combine reads the rows ranks return from the first half (`comb_in`,
then the forwarder's own partials, `comb_stage`) and puts partials into the second half (`comb_out`
[N][C'][combine row]). A call whose rows do not fit raises CapacityError before anything moves: dispatch from
the counts every rank holds (so every rank raises), combine from this rank's handle. Dispatch and combine count
their calls and signal on words of their own (two sets of N + P + 1 words).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ...errors import BackendUnavailableError, CapacityError
from ...semantics import routing
from . import kernels

_ALIGN = 16


def _aligned(value: int) -> int:
    return (value + _ALIGN - 1) // _ALIGN * _ALIGN


def _capacity_error(what: str, half_needed: int, region: int) -> CapacityError:
    required = 2 * _aligned(half_needed)
    return CapacityError(f"internode {what} needs num_rdma_bytes >= {required} (NOTE [internode region]); this Buffer "
                         f"holds {region}: make it with more (Config.get_rdma_buffer_size_hint)",
                         required_bytes=required, available_bytes=region, which="num_rdma_bytes")


class InternodeKernels:
    """The internode kernels of one rank, over `transport` (a started `Transport`), in a region of `region_bytes`."""

    def __init__(self, backend, transport, region_bytes: int, ranks_per_node: int):
        ctx = backend.ctx
        self.backend, self.transport = backend, transport
        self.rank, self.num_ranks, self.per_node = ctx.rank, ctx.num_ranks, ranks_per_node
        self.num_nodes = ctx.num_ranks // ranks_per_node
        self.node, self.local = self.rank // ranks_per_node, self.rank % ranks_per_node
        self.region_bytes = region_bytes // (2 * _ALIGN) * (2 * _ALIGN)
        self.half = self.region_bytes // 2
        self.region = transport.alloc(self.region_bytes)
        self.num_signals = self.num_nodes + ranks_per_node + 1
        self.signals = transport.alloc(2 * self.num_signals * 8)
        device = ctx.device
        self.call_counters = torch.zeros(2, dtype=torch.int64, device=device)  # dispatch's, combine's
        peers = transport.peer_pointers(self.region)
        node_peers = peers[self.node * ranks_per_node:(self.node + 1) * ranks_per_node]
        if not all(node_peers):
            raise BackendUnavailableError(f"rank {self.rank} cannot load from every rank of its node through NVSHMEM "
                                          f"(peer addresses {node_peers})")
        self.node_regions = torch.tensor(node_peers, dtype=torch.int64, device=device)

    def close(self) -> None:
        self.transport.free(self.signals)
        self.transport.free(self.region)

    def _bytes(self, offset: int, num_bytes: int) -> torch.Tensor:
        """Bytes of this rank's region as a uint8 tensor (no copy)."""
        from .backend import _CudaArray

        if num_bytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.backend.ctx.device)
        return torch.as_tensor(_CudaArray(self.region + offset, num_bytes), device=self.backend.ctx.device)

    def _launch(self, spec, num_sms: int, **args) -> None:
        """A grid of `num_sms` blocks (Config.num_sms, the same on every rank: every wait counts signals from
        every block of every rank, NOTE [internode kernels]), capped by the SMs this rank may fill."""
        kernel = self.transport.load(spec, self.backend.device_index)
        kernel(max(1, min(num_sms, self.backend.device_sms)), self.backend._stream(), rank=self.rank,
               num_nodes=self.num_nodes, ranks_per_node=self.per_node, **self.backend._wait_args(), **args)

    # -- dispatch -------------------------------------------------------------------------------------------

    def dispatch(self, rows: torch.Tensor, is_token_in_rank: torch.Tensor, counts: torch.Tensor,
                 tokens_to_node: torch.Tensor, num_sms: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Move `rows` ([T, B] uint8) as the dispatch does (NOTE [internode kernels]).

        counts: ``[R, R]``, rows each rank sends each rank; tokens_to_node: ``[R, N]``, tokens each rank sends each
        node (one row per node however many of its ranks the token reaches); both every rank's, the same on every
        rank.
        Returns (the rows this rank receives, ``[num_recv, B']`` in receive order, B' being B rounded up to 16
        bytes, a view of the region that the next call overwrites; bool ``[F, P]``: whether each row this rank
        forwarded went to each rank of its node).
        """
        per_node, num_nodes, node, local = self.per_node, self.num_nodes, self.node, self.local
        device = rows.device
        counts, tokens_to_node = counts.to(device), tokens_to_node.to(device)
        if rows.size(1) % _ALIGN:
            rows = torch.nn.functional.pad(rows, (0, _ALIGN - rows.size(1) % _ALIGN))
        row_bytes = rows.size(1)
        # place[t, q]: token t's row among this rank's rows for rank q, or -1.
        place = routing.landing_rows(is_token_in_rank, torch.zeros(1, dtype=torch.int32, device=device))
        to_node = routing.tokens_per_node(is_token_in_rank, per_node)
        stride = _aligned(row_bytes + 4 * per_node)
        capacity = self.half // (num_nodes * stride)
        # Every rank checks the same numbers, so all raise or none (NOTE [internode region]).
        most = int(tokens_to_node.max()) if tokens_to_node.numel() else 0
        received = counts.sum(0)
        if most > capacity or int(received.max()) * row_bytes > self.half:
            raise _capacity_error("dispatch", max(num_nodes * most * stride, int(received.max()) * row_bytes),
                                  self.region_bytes)

        # Rows grouped by destination node, each with its places on that node's ranks.
        parts, begins = [], [0]
        for m in range(num_nodes):
            tokens = to_node[:, m].nonzero().flatten()
            part = torch.zeros(tokens.numel(), stride, dtype=torch.uint8, device=device)
            part[:, :row_bytes] = rows[tokens]
            part[:, row_bytes:row_bytes + 4 * per_node] = place[tokens, m * per_node:(m + 1) * per_node].contiguous() \
                .view(torch.uint8)
            parts.append(part)
            begins.append(begins[-1] + tokens.numel())
        send_rows = torch.cat(parts)
        node_row_begin = torch.tensor(begins, dtype=torch.int32, device=device)
        sources = [k * per_node + local for k in range(num_nodes)]
        fwd_rows = tokens_to_node[sources, node].to(torch.int32)
        rows_before = counts.cumsum(0) - counts                  # [s, q]: rows on q before source s
        dest_first = rows_before[sources, node * per_node:(node + 1) * per_node].to(torch.int32).contiguous()
        self._launch(kernels.internode_dispatch(), num_sms, send_rows=send_rows.data_ptr(),
                     node_row_begin=node_row_begin.data_ptr(), fwd_recv=self.region, fwd_rows=fwd_rows.data_ptr(),
                     dest_first=dest_first.data_ptr(), recv=self.region + self.half, signals=self.signals,
                     call_counter=self.call_counters[0:].data_ptr(), row_bytes=stride, out_row_bytes=row_bytes,
                     fwd_capacity=capacity)
        torch.cuda.current_stream(device).synchronize()  # a fresh dispatch waits for its counts anyway
        self.backend.check_failures()

        num_recv = int(received[self.rank])
        recv = self._bytes(self.half, num_recv * row_bytes).view(num_recv, row_bytes)
        fwd = self._bytes(0, num_nodes * capacity * stride).view(num_nodes, capacity, stride)
        places = torch.cat([fwd[k, :int(fwd_rows[k]), row_bytes:row_bytes + 4 * per_node] for k in range(num_nodes)])
        return recv, places.contiguous().view(torch.int32).view(-1, per_node) >= 0

    # -- combine --------------------------------------------------------------------------------------------

    def combine(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], is_token_in_rank: torch.Tensor,
                send_nvl_head: torch.Tensor, forwarded_per_node: Sequence[int],
                bias: Tuple[Optional[torch.Tensor], ...], num_sms: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine (NOTE [internode kernels]): x ``[N, H]`` bf16 in this rank's dispatch receive order;
        send_nvl_head ``[F, P]`` and forwarded_per_node (rows it forwarded from each node) from the handle.
        Returns (combined_x ``[T, H]``, combined_topk_weights or None)."""
        per_node, num_nodes = self.per_node, self.num_nodes
        device = x.device
        self.backend.check_failures()  # a failure of an earlier call (combine waits for no CPU value)
        num_recv, hidden = x.shape
        num_tokens = is_token_in_rank.size(0)
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        hidden_int4 = hidden * x.element_size() // 16
        row_int4 = hidden_int4 + (num_topk * 4 + 15) // 16
        row_bytes = row_int4 * 16
        num_fwd = int(send_nvl_head.size(0))
        capacity = self.half // (num_nodes * row_bytes)
        to_node = routing.tokens_per_node(is_token_in_rank, per_node)
        rows_to_node = to_node.sum(0)
        most = max([int(rows_to_node.max()) if num_tokens else 0] + list(forwarded_per_node))
        if most > capacity or (num_recv + num_fwd) * row_bytes > self.half:
            raise _capacity_error("combine", max(num_nodes * most, num_recv + num_fwd) * row_bytes, self.region_bytes)
        # send_rdma_pos[t, m]: token t's row among this rank's tokens for node m (its partial's row there), or -1.
        send_rdma_pos = routing.landing_rows(to_node, torch.zeros(1, dtype=torch.int32, device=device)).contiguous()
        fwd_row_begin = torch.tensor([0] + list(forwarded_per_node), dtype=torch.int64).cumsum(0).to(torch.int32)
        fwd_row_begin, send_nvl_head = fwd_row_begin.to(device), send_nvl_head.to(torch.int32).contiguous()
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
        out_weights = None if topk_weights is None else torch.empty(num_tokens, num_topk, dtype=torch.float32,
                                                                    device=device)
        if self.backend.poison_outputs:  # tests: rows the kernel leaves unwritten show
            for t in (out, out_weights):
                if t is not None:
                    t.view(torch.uint8).fill_(0xAB)
        x, weights = x.contiguous(), None if topk_weights is None else topk_weights.contiguous()
        biases = [None if b is None else b.contiguous() for b in bias]
        self._launch(kernels.internode_combine(hidden_int4, num_topk), num_sms, x=x.data_ptr(),
                     topk_weights=0 if weights is None else weights.data_ptr(), num_recv=num_recv,
                     comb_in=self.region, peer_comb_in=self.node_regions.data_ptr(), num_fwd=num_fwd,
                     fwd_row_begin=fwd_row_begin.data_ptr(), send_nvl_head=send_nvl_head.data_ptr(),
                     comb_stage=self.region + _aligned(num_recv * row_bytes), comb_out=self.region + self.half,
                     fwd_capacity=capacity, num_tokens=num_tokens, send_rdma_pos=send_rdma_pos.data_ptr(),
                     bias_0=0 if biases[0] is None else biases[0].data_ptr(),
                     bias_1=0 if biases[1] is None else biases[1].data_ptr(), out=out.data_ptr(),
                     out_weights=0 if out_weights is None else out_weights.data_ptr(),
                     signals=self.signals + self.num_signals * 8, call_counter=self.call_counters[1:].data_ptr())
        return out, out_weights
