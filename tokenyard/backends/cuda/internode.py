"""The host side of the internode kernels (NOTE [internode kernels] in include/tokenyard/kernels/internode.cuh): their
buffers in NVSHMEM's symmetric heap, the rows they move packed and read back with torch ops, the launches.

NOTE [internode region]
Each rank holds one symmetric region of `num_rdma_bytes`, cut the same way on every rank without any exchange, so
that an address one rank computes for another is right there: dispatch puts stage-1 rows into its first half,
`fwd_recv` [N][C][row] with C = half / (N x row) rows per source node, and the received rows into its second half
(`recv`, rows of the receiver's own order); combine reads the rows ranks return from the first half (`comb_in`,
then the forwarder's own partials, `comb_stage`) and puts partials into the second half (`comb_out`
[N][C'][combine row]). Dispatch and combine count their calls and signal on words of their own (two sets of
N + P + 1 words).

NOTE [internode rounds]
A call whose rows do not fit the region runs in rounds, with the results of one: round r carries tokens
r*P .. (r+1)*P - 1 of every rank, P being the most tokens a round can hold whatever the routing (dispatch: a row per
node for each in the first half, a row from every rank for each in the second; combine: both, per half), the
same on every rank; the rounds are as many as the most tokens any rank sends need (the count exchange's, kept on
the handle as `group_counts`). One all-gather gives every rank's rows per rank and per node in each round. A
dispatch round moves its token slice as a call of its own (its source indices stay the whole call's, since the
rows are sliced, not rebuilt); the rounds' received rows, each round in order of source, are then put in order
of source, then round, which is the whole call's order; the forwarders' rows likewise. A combine round takes the
received rows whose token is in the round (recv_src_meta), the forwarded rows of the round (per node, from the
table), their landing rows moved from the whole call's receive order to the round's, and the round's slice of
the tokens and biases. A call whose one token per round does not fit raises CapacityError before anything moves
(dispatch from counts every rank holds, so every rank raises; combine from sizes every rank shares).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ... import checks
from ...errors import BackendUnavailableError, CapacityError, CommTimeoutError
from ...plan import headers
from ...semantics import routing
from ..requests import CombineRequest, DispatchRequest, DispatchResult
from ..waiting import wait_until
from . import failures, kernels, runtime

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
        # NOTE [device exchange]: the send slot, two sets of every rank's slot and signal, the exchanges so far
        self.exchange_send = transport.alloc(kernels.EXCHANGE_SLOT_BYTES)
        self.exchange_slots = transport.alloc(2 * self.num_ranks * kernels.EXCHANGE_SLOT_BYTES)
        self.exchange_signals = transport.alloc(2 * self.num_ranks * 8)
        self.exchanges = 0
        device = ctx.device
        # The exchange's own error record: the caller names the stage of its timeout (NOTE [device exchange]).
        self.exchange_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.exchange_record_ptr = runtime.host_alloc_mapped(failures.RECORD_INTS * 4)
        self.exchange_record = runtime.int32_view(self.exchange_record_ptr, failures.RECORD_INTS)
        self.call_counters = torch.zeros(2, dtype=torch.int64, device=device)  # dispatch's, combine's
        self.rounds = {"dispatch": 0, "combine": 0}  # the launches of the last call of each
        peers = transport.peer_pointers(self.region)
        node_peers = peers[self.node * ranks_per_node:(self.node + 1) * ranks_per_node]
        if not all(node_peers):
            raise BackendUnavailableError(f"rank {self.rank} cannot load from every rank of its node through NVSHMEM "
                                          f"(peer addresses {node_peers})")
        self.node_regions = torch.tensor(node_peers, dtype=torch.int64, device=device)

    def free(self) -> None:
        """Free the region, the signals and the exchange's memory and give back this use of the transport
        (collective)."""
        for ptr in (self.exchange_signals, self.exchange_slots, self.exchange_send, self.signals, self.region):
            self.transport.free(ptr)
        self.transport.close()
        runtime.host_free(self.exchange_record_ptr)

    def all_gather(self, t: torch.Tensor, stage: str) -> Optional[torch.Tensor]:
        """``[num_ranks, *t.shape]``: every rank's `t` (a CUDA tensor), through the transport with the Buffer's
        deadline (NOTE [device exchange]); waits for it on the host. None where `t` is larger than a slot (the
        caller gathers it over the group instead).

        Raises:
            CommTimeoutError: a rank did not reach this exchange within timeout_s, naming it and `stage`.
        """
        num_bytes = t.numel() * t.element_size()
        if num_bytes > kernels.EXCHANGE_SLOT_BYTES:
            return None
        backend, device = self.backend, self.backend.ctx.device
        backend.check_failures()
        self.exchanges += 1
        send = runtime.byte_view(self.exchange_send, num_bytes, device)
        send.copy_(t.contiguous().view(-1).view(torch.uint8))
        kernel = self.transport.load(kernels.exchange(), backend.device_index, counted=False)
        kernel(1, backend._stream(), send=self.exchange_send, slots=self.exchange_slots,
               signals=self.exchange_signals, bytes=num_bytes, tag=self.exchanges, num_ranks=self.num_ranks,
               rank=self.rank, error_flag=self.exchange_flag.data_ptr(), host_record=self.exchange_record_ptr,
               timeout_ns=backend.timeout_ns)
        first = (self.exchanges & 1) * self.num_ranks * kernels.EXCHANGE_SLOT_BYTES
        slots = runtime.byte_view(self.exchange_slots + first, self.num_ranks * kernels.EXCHANGE_SLOT_BYTES, device)
        out = slots.view(self.num_ranks, kernels.EXCHANGE_SLOT_BYTES)[:, :num_bytes].clone()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        # A second past the kernel's own deadline, whose record names the late rank; a kernel before it on the
        # stream that fails raises its own error.
        finished = wait_until(done.query, backend.ctx.timeout_s + 1.0, backend.check_failures)
        if self.exchange_record[0] != 0 or not finished:
            peer = self.exchange_record[2] if self.exchange_record[0] != 0 else -1
            backend.fail(CommTimeoutError(self.rank, peer, stage, "it did not reach this exchange of its call (late, "
                                          "gone, or making fewer calls; NOTE [device exchange]); destroy this Buffer "
                                          "and make a new one"))
        backend.check_failures()
        return out.view(t.dtype).view(self.num_ranks, *t.shape)

    def _bytes(self, offset: int, num_bytes: int) -> torch.Tensor:
        """Bytes of this rank's region as a uint8 tensor (no copy)."""
        if num_bytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.backend.ctx.device)
        return runtime.byte_view(self.region + offset, num_bytes, self.backend.ctx.device)

    def _launch(self, spec, num_sms: int, **args) -> None:
        """A grid of `num_sms` blocks (Config.num_sms, the same on every rank: every wait counts signals from
        every block of every rank, NOTE [internode kernels]), capped by the SMs this rank may fill."""
        kernel = self.transport.load(spec, self.backend.device_index)
        kernel(max(1, min(num_sms, self.backend.device_sms)), self.backend._stream(), rank=self.rank,
               num_nodes=self.num_nodes, ranks_per_node=self.per_node, **self.backend._wait_args(), **args)

    # -- dispatch -------------------------------------------------------------------------------------------

    def dispatch(self, rows: torch.Tensor, is_token_in_rank: torch.Tensor, counts: torch.Tensor,
                 tokens_to_node: torch.Tensor, most_tokens: int, num_sms: int, all_gather
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Move `rows` ([T, B] uint8) as the dispatch does (NOTE [internode kernels]), in rounds where the whole
        call does not fit the region (NOTE [internode rounds]).

        counts: ``[R, R]``, rows each rank sends each rank; tokens_to_node: ``[R, N]``, tokens each rank sends each
        node (one row per node however many of its ranks the token reaches); most_tokens: the most tokens any rank
        sends; all three every rank's, the same on every rank. all_gather: the group's all-gather of a tensor.
        Returns (the rows this rank receives, ``[num_recv, B']`` in receive order, B' being B rounded up to 16
        bytes, in one round a view of the region that the next call overwrites; bool ``[F, P]``: whether each
        row this rank forwarded went to each rank of its node).
        """
        device = rows.device
        counts, tokens_to_node = counts.to(device), tokens_to_node.to(device)
        if rows.size(1) % _ALIGN:
            rows = torch.nn.functional.pad(rows, (0, _ALIGN - rows.size(1) % _ALIGN))
        row_bytes = rows.size(1)
        stride = _aligned(row_bytes + 4 * self.per_node)
        # Every rank checks the same numbers, so all take the same path (NOTE [internode region]).
        most = int(tokens_to_node.max()) if tokens_to_node.numel() else 0
        received = int(counts.sum(0).max())
        if most * self.num_nodes * stride <= self.half and received * row_bytes <= self.half:
            self.rounds["dispatch"] = 1
            return self._dispatch_round(rows, is_token_in_rank, counts, tokens_to_node, num_sms, stride)
        per_round = min(self.half // (self.num_nodes * stride), self.half // (self.num_ranks * row_bytes))
        if per_round < 1:
            raise _capacity_error("dispatch", max(self.num_nodes * stride, self.num_ranks * row_bytes),
                                  self.region_bytes)
        table, bounds = self._round_table(is_token_in_rank, most_tokens, per_round, all_gather)
        self.rounds["dispatch"] = len(bounds)
        recvs, masks = [], []
        for r, (begin, end) in enumerate(bounds):
            round_counts, round_nodes = table[:, r, :self.num_ranks].to(device), table[:, r, self.num_ranks:].to(device)
            recv, mask = self._dispatch_round(rows[begin:end], is_token_in_rank[begin:end], round_counts, round_nodes,
                                              num_sms, stride)
            recvs.append(recv.clone())  # the next round overwrites the region
            masks.append(mask)
        sources = [k * self.per_node + self.local for k in range(self.num_nodes)]
        recv = torch.cat(recvs)[_source_major(table[:, :, self.rank]).to(device)]
        mask = torch.cat(masks)[_source_major(table[sources, :, self.num_ranks + self.node]).to(device)]
        return recv, mask

    def _round_table(self, is_token_in_rank: torch.Tensor, most_tokens: int, per_round: int, all_gather):
        """NOTE [internode rounds]: every rank's rows per rank and tokens per node in each round ([R, rounds, R + N],
        int64 on the CPU, one all-gather), and this rank's token range of each round."""
        num_rounds = max(1, -(-most_tokens // per_round))
        mine, bounds = round_counts(is_token_in_rank, self.per_node, per_round, num_rounds)
        table = all_gather(mine.flatten()).view(self.num_ranks, num_rounds, self.num_ranks + self.num_nodes)
        return table.cpu().long(), bounds

    def _dispatch_round(self, rows: torch.Tensor, is_token_in_rank: torch.Tensor, counts: torch.Tensor,
                        tokens_to_node: torch.Tensor, num_sms: int, stride: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """One launch of the dispatch kernel for rows that fit the region (`dispatch` says what comes back)."""
        per_node, num_nodes, node, local = self.per_node, self.num_nodes, self.node, self.local
        device = rows.device
        row_bytes = rows.size(1)
        # place[t, q]: token t's row among this rank's rows for rank q, or -1.
        place = routing.landing_rows(is_token_in_rank, torch.zeros(1, dtype=torch.int32, device=device))
        to_node = routing.tokens_per_node(is_token_in_rank, per_node)
        capacity = self.half // (num_nodes * stride)
        received = counts.sum(0)

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
                bias: Tuple[Optional[torch.Tensor], ...], num_sms: int, recv_src_meta: torch.Tensor,
                most_tokens: int, all_gather) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine (NOTE [internode kernels]), in rounds where `most_tokens` (the most tokens any rank sent)
        do not fit the region at once (NOTE [internode rounds]): x ``[N, H]`` bf16 in this rank's dispatch
        receive order; send_nvl_head ``[F, P]``, forwarded_per_node (rows it forwarded from each node) and
        recv_src_meta ``[N, 2]`` from the handle. Returns (combined_x ``[T, H]``, combined_topk_weights or None)."""
        self.backend.check_failures()  # a failure of an earlier call (combine waits for no CPU value)
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        row_bytes = x.size(1) * x.element_size() + _aligned(num_topk * 4)
        per_round = self.half // ((self.num_ranks + self.num_nodes) * row_bytes)
        if per_round < 1:
            raise _capacity_error("combine", (self.num_ranks + self.num_nodes) * row_bytes, self.region_bytes)
        if most_tokens <= per_round:
            self.rounds["combine"] = 1
            return self._combine_round(x, topk_weights, is_token_in_rank, send_nvl_head, forwarded_per_node, bias,
                                       num_sms)
        device = x.device
        table, bounds = self._round_table(is_token_in_rank, most_tokens, per_round, all_gather)
        self.rounds["combine"] = len(bounds)
        outs, weights_out = [], []
        for r, (begin, end) in enumerate(bounds):
            mine, picked, head, forwarded = combine_round_rows(table, r, per_round, self.rank, self.per_node,
                                                               recv_src_meta[:, 1].cpu(), send_nvl_head.cpu(),
                                                               forwarded_per_node)
            mine, head = mine.to(device), head.to(device)
            out, out_w = self._combine_round(
                x[mine], None if topk_weights is None else topk_weights[mine], is_token_in_rank[begin:end], head,
                forwarded, tuple(None if b is None else b[begin:end] for b in bias), num_sms)
            outs.append(out)
            weights_out.append(out_w)
        return torch.cat(outs), None if topk_weights is None else torch.cat(weights_out)

    def _combine_round(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], is_token_in_rank: torch.Tensor,
                       send_nvl_head: torch.Tensor, forwarded_per_node: Sequence[int],
                       bias: Tuple[Optional[torch.Tensor], ...], num_sms: int
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One launch of the combine kernel (`combine` says what the arguments are)."""
        per_node, num_nodes = self.per_node, self.num_nodes
        device = x.device
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
        fwd_row_begin = torch.tensor([0] + list(forwarded_per_node), dtype=torch.int64, device=device).cumsum(0)
        fwd_row_begin, send_nvl_head = fwd_row_begin.to(torch.int32), send_nvl_head.to(torch.int32).contiguous()
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
                     comb_in=self.region, peer_comb_in=self.node_regions.data_ptr(),
                     fwd_row_begin=fwd_row_begin.data_ptr(), send_nvl_head=send_nvl_head.data_ptr(),
                     comb_stage=self.region + _aligned(num_recv * row_bytes), comb_out=self.region + self.half,
                     fwd_capacity=capacity, num_tokens=num_tokens, send_rdma_pos=send_rdma_pos.data_ptr(),
                     bias_0=0 if biases[0] is None else biases[0].data_ptr(),
                     bias_1=0 if biases[1] is None else biases[1].data_ptr(), out=out.data_ptr(),
                     out_weights=0 if out_weights is None else out_weights.data_ptr(),
                     signals=self.signals + self.num_signals * 8, call_counter=self.call_counters[1:].data_ptr())
        return out, out_weights


def _source_major(rows: torch.Tensor) -> torch.Tensor:
    """NOTE [internode rounds]: rows[s, r] rows of source s came in round r, the rounds one after another, each in
    order of source; -> the index that puts them in order of source, then round (the whole call's order)."""
    rows = rows.tolist()
    num_sources, num_rounds = len(rows), len(rows[0]) if rows else 0
    first, at = [[0] * num_rounds for _ in range(num_sources)], 0
    for r in range(num_rounds):
        for s in range(num_sources):
            first[s][r], at = at, at + rows[s][r]
    parts = [torch.arange(first[s][r], first[s][r] + rows[s][r], dtype=torch.int64, device="cpu")
             for s in range(num_sources) for r in range(num_rounds)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device="cpu")


def round_counts(is_token_in_rank: torch.Tensor, per_node: int, per_round: int, num_rounds: int):
    """NOTE [internode rounds]: this rank's rows per rank and tokens per node in each round (int32
    ``[rounds, R + N]``), and its token range of each round."""
    num_tokens = is_token_in_rank.size(0)
    to_node = routing.tokens_per_node(is_token_in_rank, per_node)
    bounds = [(min(r * per_round, num_tokens), min((r + 1) * per_round, num_tokens)) for r in range(num_rounds)]
    counts = torch.stack([torch.cat([is_token_in_rank[b:e].sum(0, dtype=torch.int32),
                                     to_node[b:e].sum(0, dtype=torch.int32)]) for b, e in bounds])
    return counts, bounds


def combine_round_rows(table: torch.Tensor, r: int, per_round: int, rank: int, per_node: int, tokens: torch.Tensor,
                       send_nvl_head: torch.Tensor, forwarded_per_node: Sequence[int]):
    """NOTE [internode rounds]: what combine round `r` takes on `rank`, from the whole call's handle and every
    rank's per-round counts (`table`, int64 ``[R, rounds, R + N]``): the received rows whose token is in the round
    (`tokens`: recv_src_meta's token column), the forwarded rows of the round, their send_nvl_head rows with the
    landing rows moved from the whole call's receive order to the round's, and the rows forwarded from each node.
    All on the CPU."""
    num_ranks = table.size(0)
    num_nodes, node, local = num_ranks // per_node, rank // per_node, rank % per_node
    rows = table[:, :, :num_ranks]                                   # [s, r, q]: rows s sends q in round r
    whole = rows.sum(1)
    sources = [k * per_node + local for k in range(num_nodes)]
    forwarded = table[sources, :, num_ranks + node]                  # [k, r]: rows forwarded from node k
    first = torch.tensor([0] + list(forwarded_per_node), dtype=torch.int64, device="cpu").cumsum(0)
    tokens = tokens.long()
    mine = ((tokens >= r * per_round) & (tokens < (r + 1) * per_round)).nonzero().flatten()
    picked = torch.cat([torch.arange(int(first[k] + forwarded[k, :r].sum()), int(first[k] + forwarded[k, :r + 1].sum()),
                                     dtype=torch.int64, device="cpu") for k in range(num_nodes)])
    # On rank q, source s's rows start at (sources before s) in the whole call and at (sources before s, this
    # round) in the round's order; s's rows of earlier rounds come first among its own.
    shift = (rows[:, r, :].cumsum(0) - rows[:, r, :]) - (whole.cumsum(0) - whole) - (rows[:, :r, :].sum(1))
    shift = shift[sources][:, node * per_node:(node + 1) * per_node]
    source_of = torch.repeat_interleave(torch.arange(num_nodes, dtype=torch.int64, device="cpu"), forwarded[:, r])
    head = send_nvl_head[picked].long()
    head = torch.where(head >= 0, head + shift[source_of], -1).to(torch.int32)
    return mine, picked, head, forwarded[:, r].tolist()


# NVSHMEM's heap beyond the internode region: its signals and NVSHMEM's own
INTERNODE_HEAP_SLACK = 64 << 20


class InternodeCalls:
    """Internode normal mode (NOTE [internode kernels] in kernels/internode.cuh), the part of the CUDA backend that
    starts NVSHMEM and the kernels: a mixin `CudaBackend` inherits."""

    def internode_missing(self) -> Optional[str]:
        """None where this rank can run the internode kernels, else what it lacks (NOTE [NVSHMEM units])."""
        from ...jit import compiler as compilers
        from ...jit import nvshmem

        if nvshmem.find() is None:
            return nvshmem.missing_reason()
        if compilers.nvcc_path() is None:
            return "no nvcc, which links the kernels that call NVSHMEM"
        most = headers.constant("kernels/internode.cuh", "kMaxRanksPerNode")
        if self.ctx.topology.ranks_per_node > most:
            return f"nodes of {self.ctx.topology.ranks_per_node} ranks, more than the kernels' {most}"
        from .transport import Transport

        return Transport.refusal(self._group_ranks())  # NVSHMEM left to a lost peer, or serving another group

    def start_internode(self) -> None:
        """NOTE [internode start]
        NVSHMEM's start and its allocations are collective and wait without a deadline. A Buffer whose normal
        mode spans nodes therefore makes its internode kernels' region while it is made, a step every rank
        joins, rather than at its first call, where a rank late to the call would hold the others past their
        deadline (or, gone, forever). A Buffer without num_rdma_bytes makes none: its calls raise
        CapacityError."""
        if self.ctx.num_rdma_bytes > 0:
            self._internode_kernels()

    def _internode_kernels(self):
        """The internode kernels, NVSHMEM started for the group (collective; NOTE [internode start])."""
        if self._internode is None:
            from .internode import InternodeKernels

            ctx = self.ctx
            if ctx.num_rdma_bytes <= 0:
                raise CapacityError("internode normal mode on the CUDA backend keeps its rows in num_rdma_bytes "
                                    "of NVSHMEM memory (NOTE [internode region]); this Buffer has none",
                                    required_bytes=0, available_bytes=0, which="num_rdma_bytes")
            self._internode = InternodeKernels(self, self._transport(), ctx.num_rdma_bytes,
                                               ctx.topology.ranks_per_node)
            ctx.collectives.device_all_gather = self._internode.all_gather  # NOTE [device exchange]
        return self._internode

    def _group_ranks(self) -> tuple:
        ctx = self.ctx
        return tuple(dist.get_process_group_ranks(ctx.group)) if ctx.group is not None else tuple(range(ctx.num_ranks))

    def _transport(self):
        """NVSHMEM started for the group, or a use more of it (collective at the start), its heap room for the
        low-latency buffer and the internode kernels' region, num_rdma_bytes each."""
        from .transport import Transport

        ctx = self.ctx
        return Transport.start(ctx.rank, ctx.num_ranks, ctx.all_gather_object, self._group_ranks(),
                               heap_bytes=2 * ctx.num_rdma_bytes + INTERNODE_HEAP_SLACK,
                               shares_gpu=ctx.topology.shares_gpu)

    def operation_counts(self, per_peer: bool = False) -> dict:
        """What this rank's NVSHMEM kernels (every Buffer's of this process) asked of the transport since the last
        read, which zeroes the counters (NOTE [operation counters] in include/tokenyard/operation_counts.cuh): by
        default NOTE [operation counts]' keys, puts_K, put_bytes_K, put_signals_K and signals_K for K self, node and
        remote, with quiets and fences; with `per_peer` a list per destination rank of each of puts, put_bytes,
        put_signals and signals, with quiets and fences (backends/cuda/operation_counts.py). Waits for the device.

        Raises:
            BackendUnavailableError: TOKENYARD_COUNT_OPERATIONS is off, or this Buffer runs no NVSHMEM kernel (one
                node, or no num_rdma_bytes).
        """
        from . import operation_counts

        user = self.heap_buffer if self.heap_buffer is not None else self._internode
        if user is None:
            raise BackendUnavailableError("this Buffer runs no kernel through the transport (one node, or no "
                                          "num_rdma_bytes): it has no operation counts")
        counts = operation_counts.from_table(user.transport.operation_counts())
        return counts if per_peer else operation_counts.by_kind(counts, self.ctx.rank, self.ctx.topology.ranks_per_node)

    def internode_dispatch(self, request: DispatchRequest) -> DispatchResult:
        from .. import internode

        if request.handle is None and request.check is not None:
            # NOTE [input verdict] in checks.py: the ids the layout kernel saw out of range (verdict[0], which the
            # one-node notify kernel reads and clears) go to the count exchange of the reference backend that the
            # internode calls judge with.
            self._low_latency.note_layout_bad_ids((self.verdict[0] & checks.LAYOUT_BAD_IDS) != 0)
            self.verdict[0].zero_()
        return internode.dispatch(self._low_latency, request, self._internode_kernels())

    def internode_combine(self, request: CombineRequest):
        from .. import internode

        return internode.combine(self._low_latency, request, self._internode_kernels())
