"""Low-latency dispatch and combine with the CUDA kernels (include/tokenyard/kernels/low_latency.cuh).

Everything a call does on the host is a fixed sequence of allocations and launches, so a call can be
captured in a CUDA graph and replayed with new inputs. Consecutive calls alternate between the two halves
of the buffer (NOTE [low-latency buffer]); signals carry an epoch the GPU keeps (NOTE [low-latency epochs]),
so nothing needs cleaning between calls and replays signal afresh.
"""

from __future__ import annotations

import functools

import torch

from ... import workspace
from ...errors import InvalidInputError
from ...handle import LowLatencyHandle
from ...requests import LowLatencyCombineRequest, LowLatencyDispatchRequest, LowLatencyDispatchResult
from . import heuristics, kernels

_MASK32 = 0xFFFFFFFF


class LowLatencyKernels:
    """The low-latency half of the CUDA backend; `backend` owns the buffers, the kernels and the errors."""

    def __init__(self, backend, buffer):
        self.backend = backend
        self.buffer = buffer  # a SymmetricBuffer of num_rdma_bytes
        self._dispatch_calls = 0
        self._src_info_of_half = [None, None]  # data_ptr of each half's latest dispatch's src_info
        self._bases = {}  # half_bytes -> (device array of half 0's base on every rank, the same for half 1)
        self.trace = None  # see start_trace
        self._shared_limit = getattr(torch.cuda.get_device_properties(backend.device_index),
                                     "shared_memory_per_block_optin", 227 << 10)  # bytes per block, opted in

    def start_trace(self) -> torch.Tensor:
        """NOTE [low-latency trace]: from now on every launch stamps, per block, the GPU timer (ns) at each
        trace point into the returned int64 tensor ``[2 (dispatch, combine), grid, 8]``; a diagnostic
        (benchmarks/ll_phases.py), never on in production."""
        self.trace = torch.zeros(2, self._grid(), 8, dtype=torch.int64, device=self.backend.ctx.device)
        return self.trace

    def clean(self, num_max: int, hidden: int, num_experts: int) -> None:
        """DeepEP's clean_low_latency_buffer, a call every rank makes: zero both halves' state and every word
        tagged with an epoch (signals, message headers, expert counts, weights) for this shape between two
        group barriers, so that no word left by another shape (or by other use of the memory) can match an
        epoch, and every rank restarts from the same epochs."""
        ctx = self.backend.ctx
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        region_bytes = workspace.low_latency_region_bytes(num_max, hidden, ctx.num_ranks, num_experts)
        words = [(getattr(layout, name), region_bytes[name])
                 for name in ("state", "dispatch_recv", "dispatch_counts", "dispatch_expert_counts", "combine_weights",
                              "combine_flags")]
        torch.cuda.synchronize(ctx.device)
        ctx.all_gather_object(None)  # no rank still sends into this buffer
        local = self.buffer.tensor
        for half in (0, 1):
            for offset, num_bytes in words:
                begin = half * layout.half_bytes + offset
                local[begin:begin + num_bytes].zero_()
        torch.cuda.synchronize(ctx.device)
        ctx.all_gather_object(None)  # no rank sends before every rank is clean

    def _trace_ptr(self, kind: int) -> int:
        return 0 if self.trace is None else self.trace[kind].data_ptr()

    def _half_bases(self, layout: workspace.LowLatencyLayout, half: int) -> torch.Tensor:
        """Both halves are made on first use, so a call captured in a graph later copies nothing."""
        if layout.half_bytes not in self._bases:
            self._bases[layout.half_bytes] = tuple(
                torch.tensor([base + h * layout.half_bytes for base in self.buffer.bases], dtype=torch.int64,
                             device=self.backend.ctx.device) for h in (0, 1))
        return self._bases[layout.half_bytes][half]

    def _grid(self) -> int:
        """Every SM: the send items are dealt across blocks first (NOTE [low-latency dispatch]), and the
        receive waits need every block resident, which one block per SM guarantees."""
        return self.backend.device_sms

    @functools.cached_property
    def _local_blocks(self) -> int:
        """The combine's blocks that send to their own rank (NOTE [peer-major blocks]): fixed for the
        backend's life, so worked out at the first call rather than at every launch."""
        return heuristics.low_latency_local_blocks(self._grid(), self.backend.ctx.num_ranks)

    def _buffer_args(self, layout, half: int, do_send: int, do_recv: int, num_max: int):
        ctx = self.backend.ctx
        return (self._half_bases(layout, half).data_ptr(), ctx.rank, ctx.num_ranks, num_max, layout.dispatch_recv,
                layout.dispatch_message_bytes, workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES,
                layout.dispatch_positions, layout.dispatch_counts, layout.dispatch_expert_counts,
                layout.combine_weights, layout.combine_recv, layout.combine_flags, layout.state, do_send, do_recv,
                self._local_blocks)

    def _pair_bits_bytes(self, num_max: int, num_rows: int) -> int:
        """The pair bits of NOTE [pair slots]: a row of words per rank, or per expert and per rank."""
        return num_rows * ((num_max + 31) // 32) * 4

    def _shared_bytes(self, num_max: int, num_experts: int) -> int:
        """The dispatch's: the pair bits (expert rows) while sending, then while receiving two int32 per
        (local expert, source): its count and its first row."""
        return max(self._pair_bits_bytes(num_max, num_experts), 2 * num_experts * 4)

    def dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        backend, ctx = self.backend, self.backend.ctx
        x, topk_idx = request.x, request.topk_idx.contiguous()
        num_tokens, hidden = x.shape
        num_topk = topk_idx.size(1)
        num_experts, num_max = request.num_experts, request.num_max_dispatch_tokens_per_rank
        num_local_experts, num_slots = num_experts // ctx.num_ranks, ctx.num_ranks * num_max
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        self._dispatch_calls = (self._dispatch_calls + 1) & _MASK32
        half = self._dispatch_calls % 2
        device = x.device

        data_dtype = torch.float8_e4m3fn if request.use_fp8 else torch.bfloat16
        packed_recv_x = backend.empty(num_local_experts, num_slots, hidden, dtype=data_dtype, device=device)
        packed_recv_x_scales = None
        if request.use_fp8:
            # Column-major in the last two axes, as DeepEP lays them out for TMA.
            groups = hidden // 128 // (4 if request.use_ue8m0 else 1)
            scale_dtype = torch.int32 if request.use_ue8m0 else torch.float32
            packed_recv_x_scales = backend.empty(num_local_experts, groups, num_slots, dtype=scale_dtype,
                                                  device=device).transpose(1, 2)
        packed_recv_count = backend.empty(num_local_experts, dtype=torch.int32, device=device)
        src_info = backend.empty(num_local_experts, num_slots, dtype=torch.int32, device=device)
        layout_range = backend.empty(num_local_experts, ctx.num_ranks, dtype=torch.int64, device=device)

        shared_bytes = self._shared_bytes(num_max, num_experts)
        limit = self._shared_limit - 1024  # the kernel's static shared arrays
        if shared_bytes > limit:
            raise InvalidInputError(
                f"low-latency dispatch of num_max_dispatch_tokens_per_rank={num_max} with {num_experts} experts on "
                f"{ctx.num_ranks} ranks needs {shared_bytes} bytes of shared memory per block, more than this GPU's "
                f"{limit}; use at most {limit // 4 // num_experts * 32} tokens per rank")
        kernel = backend._kernel(kernels.low_latency_dispatch(num_topk, topk_idx.dtype, request.use_fp8,
                                                              request.use_ue8m0))
        grid = self._grid()
        stats = request.cumulative_local_expert_recv_stats
        mask, wait_costs = request.rank_mask, request.wait_recv_cost_stats

        stream = backend._stream()  # a recv hook launches where the send did, as DeepEP's does

        def launch(do_send: int, do_recv: int) -> None:
            kernel(grid, stream, x.data_ptr(), topk_idx.data_ptr(), num_tokens, hidden, num_experts,
                   int(request.round_scale), packed_recv_x.data_ptr(),
                   0 if packed_recv_x_scales is None else packed_recv_x_scales.data_ptr(),
                   packed_recv_count.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(),
                   0 if stats is None else stats.data_ptr(), 0 if mask is None else mask.data_ptr(),
                   0 if wait_costs is None else wait_costs.data_ptr(),
                   *self._buffer_args(layout, half, do_send, do_recv, num_max), *backend._wait_args(),
                   self._trace_ptr(0), shared_bytes=shared_bytes)

        hook = self._send_then_receive(launch, request.return_recv_hook)
        self._src_info_of_half[half] = src_info.data_ptr()
        handle = LowLatencyHandle(src_info, layout_range, num_max, hidden, num_experts, num_topk=num_topk, half=half)
        return LowLatencyDispatchResult(packed_recv_x, packed_recv_x_scales, packed_recv_count, handle, hook)

    def combine(self, request: LowLatencyCombineRequest):
        backend, ctx = self.backend, self.backend.ctx
        handle = request.handle
        x = request.x.contiguous()
        topk_idx, topk_weights = request.topk_idx.contiguous(), request.topk_weights.contiguous()
        num_tokens, num_topk = topk_idx.shape
        num_max, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        half = handle.half if handle.half is not None else self._half_of(handle.src_info)
        out = request.out if request.out is not None else backend.empty(num_tokens, hidden, dtype=torch.bfloat16,
                                                                           device=x.device)
        kernel = backend._kernel(kernels.low_latency_combine(num_topk, topk_idx.dtype))
        grid = self._grid()
        mask, wait_costs = request.rank_mask, request.wait_recv_cost_stats

        stream = backend._stream()  # a recv hook launches where the send did, as DeepEP's does

        def launch(do_send: int, do_recv: int) -> None:
            kernel(grid, stream, x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), num_tokens,
                   hidden, num_experts, out.data_ptr(),
                   0 if mask is None else mask.data_ptr(), 0 if wait_costs is None else wait_costs.data_ptr(),
                   *self._buffer_args(layout, half, do_send, do_recv, num_max), *backend._wait_args(),
                   self._trace_ptr(1), shared_bytes=self._pair_bits_bytes(num_max, ctx.num_ranks))

        return out, self._send_then_receive(launch, request.return_recv_hook)

    def _half_of(self, src_info: torch.Tensor) -> int:
        """NOTE [plain low-latency handles]
        A handle rebuilt from DeepEP's plain 5-tuple does not say which half of the buffer its dispatch used,
        and a combine that read the other half would wait for signals that never come or read another call's
        rows. The half is the one whose latest dispatch made this `src_info` (the latest dispatch's half is
        looked at first: its src_info is alive, so no freed tensor of the other half can share its address);
        a src_info that is neither (a copy) is taken as the latest dispatch's, the half DeepEP's combine
        would use."""
        latest = self._dispatch_calls % 2
        for half in (latest, 1 - latest):
            if self._src_info_of_half[half] == src_info.data_ptr():
                return half
        return latest

    def _send_then_receive(self, launch, return_recv_hook: bool):
        """One launch that sends and receives, or (with a recv hook) a send launch now and a hook that
        launches the receive; -> the hook or None."""
        if not return_recv_hook:
            launch(1, 1)
            return None
        launch(1, 0)

        def hook():
            self.backend.check_failures()
            launch(0, 1)

        return hook
