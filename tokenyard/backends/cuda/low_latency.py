"""Low-latency dispatch and combine with the CUDA kernels (include/tokenyard/kernels/low_latency_dispatch.cuh and
low_latency_combine.cuh).

Everything a call does on the host is a fixed sequence of allocations and launches, so a call can be
captured in a CUDA graph and replayed with new inputs. Consecutive calls alternate between the two halves
of the buffer (NOTE [low-latency buffer]); signals carry an epoch the GPU keeps (NOTE [low-latency epochs]),
so nothing needs cleaning between calls and replays signal afresh.
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import Optional

import torch

from ...errors import InvalidInputError
from ...handle import LowLatencyHandle
from ...plan import workspace
from .. import collectives
from ..requests import CombineOverlap, LowLatencyCombineRequest, LowLatencyDispatchRequest, LowLatencyDispatchResult
from . import heuristics, kernels, plans

_CLEAN = "clean_low_latency_buffer"  # the operation a timeout of `clean`'s meetings names
_HANDLE_OUTPUTS = ("src_info", "layout_range")  # a dispatch's outputs that its handle keeps

# The inputs and per-call scalars of the low-latency plans (NOTE [call plans] in plans.py), in run order.
LOW_LATENCY_DISPATCH_INPUTS = ("x", "topk_idx", "stats", "rank_mask", "wait_costs", "x_global_scale")
LOW_LATENCY_COMBINE_INPUTS = ("x", "topk_idx", "topk_weights", "out", "rank_mask", "wait_costs", "comp_signal")
LOW_LATENCY_SCALARS = ("bases", "trace")


def tag_factor(op: str, **fields: int) -> int:
    """NOTE [call tags] in include/tokenyard/sync.cuh: the odd factor of the tags of a call with `op`'s signature
    (collectives.signature), the same in every process."""
    values = collectives.signature(op, **fields)
    return zlib.crc32(struct.pack(f"<{len(values)}q", *values)) | 1


def _rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """Expert outputs ``[L, R*M, H]`` as the combine kernel reads them: dense rows a 16-byte multiple apart, one
    expert's after another's (so the zero-copy tensor, whose rows are wider than H, is read where it lies); any
    other layout is copied."""
    rows_apart = x.stride(1)
    if x.stride(2) == 1 and rows_apart * 2 % 16 == 0 and x.stride(0) == x.size(1) * rows_apart:
        return x
    return x.contiguous()


class LowLatencyKernels:
    """The low-latency half of the CUDA backend; `backend` owns the buffers, the kernels and the errors."""

    def __init__(self, backend, buffer):
        self.backend = backend
        # A SymmetricBuffer of num_rdma_bytes, or with ranks on other nodes a transport.HeapBuffer, whose kernels
        # are the NVSHMEM units (NOTE [internode low-latency] in include/tokenyard/sync.cuh).
        self.buffer = buffer
        self.remote = getattr(buffer, "remote", 0)
        self._src_info_of_half = [None, None]  # data_ptr of each half's latest dispatch's src_info
        self._bases = {}  # half_bytes -> (device array of half 0's base on every rank, the same for half 1)
        self._half_base_addresses = {}  # (num_max, hidden, num_experts) -> their two addresses
        self.trace = None  # see start_trace
        self._shared_limit = getattr(torch.cuda.get_device_properties(backend.device_index),
                                     "shared_memory_per_block_optin", 227 << 10)  # bytes per block, opted in

    def start_trace(self) -> torch.Tensor:
        """NOTE [low-latency trace]: from now on every launch stamps, per block, the GPU timer (ns) at each
        trace point into the returned int64 tensor ``[2 (dispatch, combine), grid, 8]``; a diagnostic
        (benchmarks/ll_phases.py), never on in production."""
        self.trace = torch.zeros(2, self._grid(), 8, dtype=torch.int64, device=self.backend.ctx.device)
        self.backend.calls.forget()  # recorded calls hold the trace's address (NOTE [fast calls])
        return self.trace

    def clean(self, num_max: int, hidden: int, num_experts: int) -> None:
        """DeepEP's clean_low_latency_buffer, a call every rank makes: zero both halves' state and every word
        tagged with an epoch (signals, message headers, expert counts, weights) for this shape between two
        group barriers, so that no word left by another shape (or by other use of the memory) can match an
        epoch, and every rank restarts from the same epochs and the same half (a rank that missed calls, say
        while masked, may have used the halves an odd number of times fewer). The barriers are meetings, bounded
        as a destroy's (the hosts may be seconds apart, whatever the kernels' deadline).

        Raises:
            CommTimeoutError: a rank did not come, naming this rank and the stage (clean_low_latency_buffer/...).
        """
        ctx = self.backend.ctx
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        region_bytes = workspace.low_latency_region_bytes(num_max, hidden, ctx.num_ranks, num_experts)
        words = [(getattr(layout, name), region_bytes[name])
                 for name in ("state", "dispatch_recv", "dispatch_counts", "dispatch_expert_counts", "combine_weights",
                              "combine_flags", "arrivals", "combine_deferred", "weights_flags")]
        torch.cuda.synchronize(ctx.device)
        ctx.collectives.meeting(_CLEAN, "senders_done")  # no rank still sends into this buffer
        local = self.buffer.tensor
        for half in (0, 1):
            for offset, num_bytes in words:
                begin = half * layout.half_bytes + offset
                local[begin:begin + num_bytes].zero_()
        self.backend.calls.reset_low_latency_halves()
        self._src_info_of_half = [None, None]
        torch.cuda.synchronize(ctx.device)
        ctx.collectives.meeting(_CLEAN, "cleaned")  # no rank sends before every rank is clean

    def _kernel(self, spec):
        """An NVSHMEM unit is loaded by the transport, which registers its module (NOTE [NVSHMEM units])."""
        return self.buffer.transport.load(spec, self.backend.device_index) if spec.nvshmem else \
            self.backend._kernel(spec)

    def _trace_ptr(self, kind: int) -> int:
        return 0 if self.trace is None else self.trace[kind].data_ptr()

    def _half_bases(self, layout: workspace.LowLatencyLayout, half: int) -> torch.Tensor:
        """Both halves are made on first use, so a call captured in a graph later copies nothing."""
        if layout.half_bytes not in self._bases:
            self._bases[layout.half_bytes] = tuple(
                plans.device_constant([base + h * layout.half_bytes for base in self.buffer.bases], torch.int64,
                                      self.backend.ctx.device) for h in (0, 1))
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

    def _buffer_args(self, b, layout, do_send: int, do_recv: int, num_max: int, factor: int) -> dict:
        """Both kernels' view of the buffer (kernels._LOW_LATENCY_BUFFERS), and which half does what."""
        ctx = self.backend.ctx
        return dict(peer_bases=b.scalar("bases"), rank=ctx.rank, num_ranks=ctx.num_ranks, num_max=num_max,
                    dispatch_recv=layout.dispatch_recv, message_bytes=layout.dispatch_message_bytes,
                    header_bytes=workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES,
                    dispatch_positions=layout.dispatch_positions, dispatch_counts=layout.dispatch_counts,
                    dispatch_expert_counts=layout.dispatch_expert_counts, combine_weights=layout.combine_weights,
                    combine_recv=layout.combine_recv, combine_flags=layout.combine_flags, state=layout.state,
                    tag_factor=factor, do_send=do_send, do_recv=do_recv, remote_ranks=self.remote,
                    staged_messages=layout.staged_messages, staged_rows=layout.staged_rows, arrivals=layout.arrivals,
                    combine_deferred=layout.combine_deferred, weights_flags=layout.weights_flags,
                    staged_weights=layout.staged_weights)

    def _pair_bits_bytes(self, num_max: int, num_rows: int) -> int:
        """The pair bits of NOTE [pair slots]: a row of words per rank, or per expert and per rank."""
        return num_rows * ((num_max + 31) // 32) * 4

    def _shared_bytes(self, num_max: int, num_experts: int) -> int:
        """The dispatch's: the pair bits (expert rows) while sending, then while receiving two int32 per
        (local expert, source): its count and its first row."""
        return max(self._pair_bits_bytes(num_max, num_experts), 2 * num_experts * 4)

    def _plans(self, key: tuple, kernel, inputs, outputs, launch_args, shared_bytes: int, hook: bool,
               send_grid: Optional[int] = None):
        """The plans of a call (NOTE [call plans]): one that makes `outputs` (name -> (shape, dtype)) and
        launches with sending and receiving, or with `hook` a sending one and a receiving one (whose inputs
        add the first's outputs)."""
        def build():
            backend = self.backend
            first = backend._builder(inputs, LOW_LATENCY_SCALARS)
            made, wholes = {}, {}
            for name, (shape, dtype, *order) in outputs.items():  # NOTE [plan allocations]: the handle's fields apart
                kept = name in _HANDLE_OUTPUTS
                if kept not in wholes:
                    wholes[kept] = first.whole()
                made[name] = first.part(wholes[kept], name, shape, dtype, *order)
            first.launch(kernel, send_grid or self._grid(), launch_args(first, made, 1, int(not hook)), shared_bytes)
            if not hook:
                return first.build(), None
            first_plan = first.build()
            second = backend._builder(tuple(inputs) + first_plan.output_names, LOW_LATENCY_SCALARS)
            made = {name: second.inp(name) for name in outputs}
            second.launch(kernel, self._grid(), launch_args(second, made, 0, 1), shared_bytes)
            return first_plan, second.build()

        return self.backend.plan(key, build)

    def dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        x, topk_idx = request.x, request.topk_idx.contiguous()
        first, second = self.dispatch_plans(x.size(0), x.size(1), topk_idx.size(1), topk_idx.dtype,
                                            request.num_experts, request.num_max_dispatch_tokens_per_rank,
                                            request.cast, request.use_ue8m0, request.round_scale,
                                            request.return_recv_hook)
        outputs, handle = self.run_dispatch(first.native, x, topk_idx, request.num_max_dispatch_tokens_per_rank,
                                            request.num_experts, request.cumulative_local_expert_recv_stats,
                                            request.rank_mask, request.wait_recv_cost_stats, request.x_global_scale)
        made = first.named(outputs)
        hook = None
        if second is not None:
            inputs = (x, topk_idx, request.cumulative_local_expert_recv_stats, request.rank_mask,
                      request.wait_recv_cost_stats, request.x_global_scale) + outputs
            hook = self._receive_hook(second, inputs, self.dispatch_scalars(
                request.num_max_dispatch_tokens_per_rank, x.size(1), request.num_experts, handle.half))
        return LowLatencyDispatchResult(made["packed_recv_x"], made.get("packed_recv_x_scales"),
                                        made["packed_recv_count"], handle, hook)

    def run_dispatch(self, native, x, topk_idx, num_max: int, num_experts: int, stats, rank_mask, wait_costs,
                     x_global_scale=None, buffer_id: Optional[int] = None):
        """Run a dispatch's first plan on the current stream, in the next half of the buffer; -> (outputs,
        handle)."""
        half = self.backend.calls.next_low_latency_half()
        outputs = native.run((x, topk_idx, stats, rank_mask, wait_costs, x_global_scale),
                             self.dispatch_scalars(num_max, x.size(1), num_experts, half), self.backend._stream(), 0,
                             0, 0, 0, False, False, 0)
        return outputs, self.dispatched(outputs, half, x, topk_idx, num_max, num_experts, buffer_id)

    def dispatch_scalars(self, num_max: int, hidden: int, num_experts: int, half: int) -> list:
        """A dispatch's LOW_LATENCY_SCALARS in `half` of the buffer."""
        return [self._half_bases_of(num_max, hidden, num_experts, half), self._trace_ptr(0)]

    def dispatched(self, outputs: tuple, half: int, x, topk_idx, num_max: int, num_experts: int,
                   buffer_id: Optional[int]) -> LowLatencyHandle:
        """The handle of a dispatch that ran in `half` (the fast path's too, NOTE [fast calls])."""
        src_info = outputs[-2]
        self._src_info_of_half[half] = src_info.data_ptr()
        num_tokens, hidden = x.shape
        return LowLatencyHandle.of((src_info, outputs[-1], num_max, hidden, num_experts),
                                   {"buffer_id": buffer_id, "num_topk": topk_idx.shape[1], "num_tokens": num_tokens,
                                    "half": half, "fast_for": buffer_id})

    def _half_bases_of(self, num_max: int, hidden: int, num_experts: int, half: int) -> int:
        """The address of `_half_bases` for a call of this shape (asked on every call: kept as two ints)."""
        key = (num_max, hidden, num_experts)
        addresses = self._half_base_addresses.get(key)
        if addresses is None:
            layout = workspace.low_latency_layout(num_max, hidden, self.backend.ctx.num_ranks, num_experts)
            addresses = self._half_base_addresses[key] = tuple(self._half_bases(layout, h).data_ptr() for h in (0, 1))
        return addresses[half]

    def _receive_hook(self, plan, inputs: tuple, scalars):
        """A recv hook: launches the receiving plan where the send was launched, as DeepEP's does."""
        stream = self.backend._stream()

        def hook():
            self.backend.check_failures()
            plan.run_here(stream, inputs, scalars)

        return hook

    def dispatch_plans(self, num_tokens: int, hidden: int, num_topk: int, topk_dtype: torch.dtype, num_experts: int,
                       num_max: int, cast: int, use_ue8m0: bool, round_scale: bool, hook: bool):
        """Inputs LOW_LATENCY_DISPATCH_INPUTS, scalars LOW_LATENCY_SCALARS; `cast` as LowLatencyDispatchRequest's."""
        ctx = self.backend.ctx
        num_local_experts, num_slots = num_experts // ctx.num_ranks, ctx.num_ranks * num_max
        shared_bytes = self._shared_bytes(num_max, num_experts)
        limit = self._shared_limit - 1024  # the kernel's static shared arrays
        if shared_bytes > limit:
            raise InvalidInputError(
                f"low-latency dispatch of num_max_dispatch_tokens_per_rank={num_max} with {num_experts} experts on "
                f"{ctx.num_ranks} ranks needs {shared_bytes} bytes of shared memory per block, more than this GPU's "
                f"{limit}; use at most {limit // 4 // num_experts * 32} tokens per rank")
        kernel = self._kernel(kernels.low_latency_dispatch(num_topk, topk_dtype, cast, use_ue8m0, self.remote != 0))
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        use_fp8 = cast == 1
        # name -> (shape, dtype[, order]): with an order, stored expert-major and handed back permuted so
        # (PlanBuilder.part), as DeepEP's views.
        outputs = {"packed_recv_x": ((num_local_experts, num_slots, hidden),
                                     torch.float8_e4m3fn if use_fp8 else torch.bfloat16)}
        if cast == 2:  # NOTE [nvfp4]
            outputs = {"packed_recv_x": ((num_local_experts, num_slots, hidden // 2), torch.uint8, (1, 2, 0)),
                       "packed_recv_x_scales": ((num_local_experts, -(-num_slots // 128), hidden // 64, 32, 4, 4),
                                                torch.float8_e4m3fn, (3, 4, 1, 5, 2, 0))}
        if use_fp8:
            # Column-major in the last two axes, as DeepEP lays them out for TMA.
            groups = hidden // 128 // (4 if use_ue8m0 else 1)
            outputs["packed_recv_x_scales"] = ((num_local_experts, groups, num_slots),
                                               torch.int32 if use_ue8m0 else torch.float32, (0, 2, 1))
        outputs.update(packed_recv_count=((num_local_experts,), torch.int32),
                       src_info=((num_local_experts, num_slots), torch.int32),
                       layout_range=((num_local_experts, ctx.num_ranks), torch.int64))
        factor = tag_factor("low_latency_dispatch", hidden=hidden, num_topk=num_topk, num_experts=num_experts,
                            num_max=num_max, cast=cast, round_scale=int(round_scale),
                            use_ue8m0=int(use_ue8m0))

        def launch_args(b, made, do_send, do_recv):
            return dict(x=b.inp("x"), topk_idx=b.inp("topk_idx"), num_tokens=num_tokens, hidden=hidden,
                        num_experts=num_experts, round_scale=int(round_scale), x_global_scale=b.inp("x_global_scale"),
                        packed_recv_x=made["packed_recv_x"],
                        packed_recv_scales=made.get("packed_recv_x_scales", 0),
                        packed_recv_count=made["packed_recv_count"], src_info=made["src_info"],
                        layout_range=made["layout_range"], cumulative_stats=b.inp("stats"),
                        rank_mask=b.inp("rank_mask"), wait_costs=b.inp("wait_costs"),
                        **self._buffer_args(b, layout, do_send, do_recv, num_max, factor),
                        **self.backend._wait_args(), trace=b.scalar("trace"))

        key = ("low_latency_dispatch", kernel, num_tokens, hidden, num_experts, num_max, round_scale, hook)
        return self._plans(key, kernel, LOW_LATENCY_DISPATCH_INPUTS, outputs, launch_args, shared_bytes, hook)

    def combine_plans(self, num_tokens: int, hidden: int, num_topk: int, topk_dtype: torch.dtype, num_experts: int,
                      num_max: int, with_out: bool, hook: bool, x_row_int4: Optional[int] = None,
                      overlap: Optional[CombineOverlap] = None):
        """Inputs LOW_LATENCY_COMBINE_INPUTS, scalars LOW_LATENCY_SCALARS; `x_row_int4`: x's row stride in 16-byte
        vectors (its rows dense unless given: the zero-copy tensor's are wider, see `_rows_in_place`); `overlap`:
        NOTE [combine overlap], the sending launch on `overlap.num_sms` blocks."""
        ctx = self.backend.ctx
        x_row_int4 = x_row_int4 or hidden * 2 // 16
        kernel = self._kernel(kernels.low_latency_combine(num_topk, topk_dtype, self.remote != 0))
        layout = workspace.low_latency_layout(num_max, hidden, ctx.num_ranks, num_experts)
        outputs = {} if with_out else {"combined_x": ((num_tokens, hidden), torch.bfloat16)}
        factor = tag_factor("low_latency_combine", hidden=hidden, num_topk=num_topk, num_experts=num_experts,
                            num_max=num_max)

        def launch_args(b, made, do_send, do_recv):
            return dict(x=b.inp("x"), topk_idx=b.inp("topk_idx"), topk_weights=b.inp("topk_weights"),
                        num_tokens=num_tokens, hidden=hidden, num_experts=num_experts,
                        combined_x=made["combined_x"] if "combined_x" in made else b.inp("out"),
                        rank_mask=b.inp("rank_mask"), wait_costs=b.inp("wait_costs"), local_blocks=self._local_blocks,
                        x_row_int4=x_row_int4, comp_signal=b.inp("comp_signal"), signal_blocks=signals[0],
                        block_m=signals[1], signal_threshold=signals[2],
                        **self._buffer_args(b, layout, do_send, do_recv, num_max, factor),
                        **self.backend._wait_args(), trace=b.scalar("trace"))

        signals = (0, 1, 0) if overlap is None else (overlap.signal_blocks, overlap.block_m, overlap.threshold)
        send_grid = None if overlap is None else max(1, min(overlap.num_sms, self._grid()))
        key = ("low_latency_combine", kernel, num_tokens, hidden, num_experts, num_max, with_out, hook, x_row_int4,
               signals, send_grid)
        return self._plans(key, kernel, LOW_LATENCY_COMBINE_INPUTS, outputs, launch_args,
                           self._pair_bits_bytes(num_max, ctx.num_ranks), hook, send_grid)

    def combine(self, request: LowLatencyCombineRequest):
        handle = request.handle
        x = _rows_in_place(request.x)
        topk_idx, topk_weights = request.topk_idx.contiguous(), request.topk_weights.contiguous()
        first, second = self.combine_plans(topk_idx.size(0), handle.hidden, topk_idx.size(1), topk_idx.dtype,
                                           handle.num_experts, handle.num_max_dispatch_tokens_per_rank,
                                           request.out is not None, request.return_recv_hook, x.stride(1) * 2 // 16,
                                           request.overlap)
        comp_signal = None if request.overlap is None else request.overlap.comp_signal
        combined = self.run_combine(first.native, x, topk_idx, topk_weights, handle, request.out, request.rank_mask,
                                    request.wait_recv_cost_stats, comp_signal)
        hook = None
        if second is not None:
            half = handle.half if handle.half is not None else self._half_of(handle.src_info)
            inputs = (x, topk_idx, topk_weights, request.out, request.rank_mask, request.wait_recv_cost_stats,
                      comp_signal)
            scalars = (self._half_bases_of(handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                                           handle.num_experts, half), self._trace_ptr(1))
            hook = self._receive_hook(second, inputs + ((combined,) if request.out is None else ()), scalars)
        return combined, hook

    def run_combine(self, native, x, topk_idx, topk_weights, handle, out, rank_mask, wait_costs, comp_signal=None):
        """Run a combine's first plan on the current stream; -> the combined tensor."""
        half = handle.half if handle.half is not None else self._half_of(handle.src_info)
        scalars = (self._half_bases_of(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
                                       half), self._trace_ptr(1))
        made = native.run((x, topk_idx, topk_weights, out, rank_mask, wait_costs, comp_signal), scalars,
                          self.backend._stream(), 0, 0, 0, 0, False, False, 0)
        return out if out is not None else made[0]

    def _half_of(self, src_info: torch.Tensor) -> int:
        """NOTE [plain low-latency handles]
        A handle rebuilt from DeepEP's plain 5-tuple does not say which half of the buffer its dispatch used,
        and a combine that read the other half would wait for signals that never come or read another call's
        rows. The half is the one whose latest dispatch made this `src_info` (the latest dispatch's half is
        looked at first: its src_info is alive, so no freed tensor of the other half can share its address);
        a src_info that is neither (a copy) is taken as the latest dispatch's, the half DeepEP's combine
        would use."""
        latest = self.backend.calls.latest_low_latency_half()
        for half in (latest, 1 - latest):
            if self._src_info_of_half[half] == src_info.data_ptr():
                return half
        return latest
