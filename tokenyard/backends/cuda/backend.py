"""The CUDA backend: JIT kernels over NVLink-mapped buffers of every rank of the group.

Normal mode runs our kernels (include/tokenyard/kernels); low-latency mode those of low_latency.py, or the
reference implementation over the same group where TOKENYARD_LOW_LATENCY_KERNELS=off. The group carries only
host-side exchanges (the peers' IPC handles), so any group serves, its ranks on GPUs of their own or sharing
GPUs under MPS (NOTE [MPS]).
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import env, workspace
from ...errors import BackendUnavailableError, CommTimeoutError, InvalidInputError, TokenyardError
from ...handle import DispatchHandle
from ...jit import load
from ...requests import CombineRequest, DispatchRequest, DispatchResult
from ...waiting import wait_until
from ..base import Backend, GroupContext
from . import heuristics, kernels, runtime

HOST_COUNTS_INTS = 4 + 4096  # NOTE [notify]: call id, three counts, then the per-local-expert counts
# The Stage enum of include/tokenyard/sync.cuh, by value.
_STAGES = {1: "barrier", 2: "dispatch/notify", 3: "dispatch/receive", 4: "combine/receive",
           5: "low_latency_dispatch/receive", 6: "low_latency_combine/receive", 7: "low_latency_combine/weights",
           8: "low_latency_dispatch/expert_counts"}
_MASK32 = 0xFFFFFFFF


class _CudaArray:
    """Lets torch view raw device memory without owning it."""

    def __init__(self, ptr: int, num_bytes: int):
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class SymmetricBuffer:
    """`num_bytes` of device memory on every rank, each rank's mapped into every process by CUDA IPC."""

    def __init__(self, ctx: GroupContext, num_bytes: int):
        self.num_bytes = num_bytes
        self.local = runtime.malloc(max(num_bytes, 16))
        runtime.memset(self.local, 0, max(num_bytes, 16))
        handles = ctx.all_gather_object(runtime.ipc_handle(self.local))
        self.bases = [self.local if r == ctx.rank else runtime.ipc_open(h) for r, h in enumerate(handles)]
        self.rank = ctx.rank
        self.bases_tensor = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
        self.tensor = torch.as_tensor(_CudaArray(self.local, num_bytes), device=ctx.device)

    def close(self) -> None:
        for r, base in enumerate(self.bases):
            if r != self.rank:
                runtime.ipc_close(base)
        runtime.free(self.local)
        self.bases = []


class CudaBackend(Backend):
    name = "cuda"
    # `backend="auto"` picks this backend only once its GPU tests have passed on the device machine
    # (tests/gpu/test_normal_cuda.py: bit for bit against the reference backend on 2 and 4 H200s).
    VALIDATED = True
    # The low-latency kernels serve low-latency calls once their GPU tests have passed
    # (tests/gpu/test_low_latency_cuda.py: dispatch bit for bit against the reference, combine bit for bit
    # against its pre-reduced arithmetic, graph replays, a masked rank; 2 and 4 H200s, last at ce69a85).
    # TOKENYARD_LOW_LATENCY_KERNELS=off hands the calls to the reference implementation over the same group.
    LOW_LATENCY_KERNELS_VALIDATED = True

    @staticmethod
    def available() -> bool:
        if not torch.cuda.is_available():
            return False
        try:
            from ...jit.cache import get_compiler
            from ...jit.driver import libcuda

            libcuda()
            runtime.libcudart()
            get_compiler()
        except Exception as exc:  # noqa: BLE001 - any missing piece means "not here"
            env.log(f"CUDA backend unavailable: {exc}")
            return False
        return True

    def __init__(self, ctx: GroupContext):
        super().__init__(ctx)
        if ctx.num_ranks > 32:
            raise BackendUnavailableError("the CUDA backend handles up to 32 ranks (one NVLink domain)")
        # NOTE [MPS]: ranks that share a GPU wait in their kernels for each other's kernels, which run at the
        # same time only where MPS serves the GPU; without it they would take turns (time slices of
        # milliseconds), so every wait would crawl or time out. Refused before any buffer is made.
        unserved = ctx.topology.without_mps()
        if unserved:
            raise BackendUnavailableError(
                f"ranks share {'; '.join(unserved)} without MPS: the CUDA backend's kernels wait for each other's "
                "kernels, which run at the same time on a shared GPU only under MPS. Start the MPS daemon "
                "(`nvidia-cuda-mps-control -d`, as root) before the ranks start (no MPS percentage is needed: "
                "tokenyard sizes each rank's grids to fit beside the others'), or give each rank a GPU of its own")
        torch.cuda.init()
        self.device_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        # SMs this rank's grids may fill: every co-located rank's grid must be resident at once (NOTE [shared
        # GPUs] in devices.py); the whole GPU where a rank has one of its own.
        self.device_sms = ctx.topology.sm_budget
        if self.device_sms < heuristics.fewest_sms(ctx.num_ranks):
            visible = ctx.topology.places[ctx.rank].visible_sms
            raise BackendUnavailableError(
                f"rank {ctx.rank} may fill {self.device_sms} SMs (the {visible} it sees over the "
                f"{ctx.topology.ranks_per_gpu} ranks of its GPU), fewer than the {heuristics.fewest_sms(ctx.num_ranks)} "
                "the kernels need: run fewer ranks per GPU, or without an MPS share "
                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), which caps the SMs a rank sees (NOTE [shared GPUs] in devices.py)")
        self.low_latency_buffer = None
        try:
            self.normal = SymmetricBuffer(ctx, ctx.num_nvl_bytes)
            if ctx.num_rdma_bytes > 0:
                self.low_latency_buffer = SymmetricBuffer(ctx, ctx.num_rdma_bytes)
        except runtime.RuntimeError_ as exc:
            raise BackendUnavailableError(f"could not map the peers' buffers: {exc}") from exc
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        self.host_record_ptr = runtime.host_alloc_mapped(8 * 4)
        self.host_record = runtime.int32_view(self.host_record_ptr, 8)
        self.host_counts_ptr = runtime.host_alloc_mapped(HOST_COUNTS_INTS * 4)
        self.host_counts = runtime.int32_view(self.host_counts_ptr, HOST_COUNTS_INTS)
        self.timeout_ns = int(ctx.timeout_s * 1e9)
        self._seq = 0
        self._notify_calls = 0
        self._barrier_calls = 0
        self._failure: Optional[TokenyardError] = None
        self._kernels = {}  # id(spec) -> (spec, Kernel), see _kernel
        from ..reference import ReferenceBackend
        from .low_latency import LowLatencyKernels

        self._low_latency = ReferenceBackend(ctx)
        self._low_latency_kernels = None
        if self.low_latency_buffer is not None:
            self._low_latency_kernels = LowLatencyKernels(self, self.low_latency_buffer)
        choice = env.settings().low_latency_kernels
        self.use_low_latency_kernels = self.LOW_LATENCY_KERNELS_VALIDATED if choice == "auto" else choice == "on"

    # -- helpers --------------------------------------------------------------------------------------

    def _kernel(self, spec):
        """The loaded kernel of `spec`; specs come from lru_caches, so one object per kernel: looked up by
        identity (hashing a spec hashes its ~40 parameters, microseconds per call)."""
        entry = self._kernels.get(id(spec))
        if entry is None:
            entry = self._kernels[id(spec)] = (spec, load(spec, self.device_index))  # holds spec: ids stay unique
        return entry[1]

    def _stream(self) -> int:
        """The current stream of this backend's device, as a raw handle (NOTE [host cost per call])."""
        return torch._C._cuda_getCurrentRawStream(self.device_index)

    def _wait_args(self):
        return (self.error_flag.data_ptr(), self.host_record_ptr, self.timeout_ns)

    def _buffer_args(self, layout: workspace.NormalLayout, seq: int):
        return (self.normal.bases_tensor.data_ptr(), self.ctx.rank, layout.control_bytes, layout.region_bytes,
                layout.slots_offset, layout.max_chunks, layout.row_bytes, seq)

    def check_failures(self) -> None:
        """Raise the error a kernel recorded (a timeout, an overflow); once failed, always failed."""
        if self._failure is None and self.host_record[0] != 0:
            kind, rank, peer, stage, seen, expected = (self.host_record[i] for i in range(6))
            stage_name = _STAGES.get(stage, f"stage {stage}")
            if kind == 2:
                self._failure = InvalidInputError(
                    f"rank {rank} received at least {seen} rows at {stage_name}, more than "
                    f"num_worst_tokens={expected}; "
                    "rows past it were dropped")
            elif kind == 3:
                self._failure = InvalidInputError(
                    f"rank {peer} dispatched with {seen} sending warps and rank {rank} with {expected}: every rank "
                    "must use the same number of SMs (Buffer.set_num_sms, Config.num_sms); destroy this Buffer "
                    "and make a new one")
            else:
                self._failure = CommTimeoutError(rank, peer, stage_name,
                                                 f"flag was {seen & _MASK32}, expected {expected & _MASK32}; "
                                                 "destroy this Buffer and make a new one")
        if self._failure is not None:
            raise self._failure

    def _next(self, counter: str) -> int:
        """Advance one of the call counters (the same on every rank, since every rank makes the same calls)."""
        value = (getattr(self, counter) + 1) & _MASK32
        setattr(self, counter, value)
        return value

    def _wait_host_counts(self, call_id: int) -> None:
        """The CPU wait of a dispatch: until the notify kernel published the counts, bounded."""
        if not wait_until(lambda: (self.host_counts[0] & _MASK32) == call_id, self.ctx.timeout_s,
                          self.check_failures):
            self._failure = CommTimeoutError(self.ctx.rank, -1, "dispatch/notify (CPU wait)", "the counts never arrived")
            raise self._failure

    # -- normal mode ----------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.check_failures()
        num_ranks = self.ctx.num_ranks
        num_tokens, num_topk = topk_idx.shape
        device = topk_idx.device
        per_rank = torch.zeros(num_ranks, dtype=torch.int32, device=device)
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=device)
        in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
        if num_tokens > 0:
            kernel = self._kernel(kernels.dispatch_layout(num_ranks, topk_idx.dtype))
            grid = heuristics.layout_grid(num_tokens, kernels.LAYOUT_THREADS, self.device_sms)
            kernel(grid, self._stream(), topk_idx.data_ptr(), num_tokens, num_topk, num_experts, per_rank.data_ptr(),
                   per_expert.data_ptr(), in_rank.data_ptr(), shared_bytes=(num_experts + num_ranks) * 4)
        return per_rank, per_expert, in_rank

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self.check_failures()
        num_ranks, rank = self.ctx.num_ranks, self.ctx.rank
        x, scales = request.x, request.x_scales
        device = x.device
        num_tokens = x.size(0)
        cached = request.handle is not None
        placement = request.placement  # NOTE [placed rounds] in rounds.py: the outputs exist
        topk_idx = None if cached else request.topk_idx
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        if num_topk > kernels.MAX_TOPK:
            raise InvalidInputError(f"the CUDA backend handles top-k up to {kernels.MAX_TOPK}, got {num_topk}")
        topk_dtype = torch.int64 if topk_idx is None else topk_idx.dtype
        num_experts = num_ranks if cached else request.num_experts
        num_local_experts = num_experts // num_ranks
        most_local_experts = min(HOST_COUNTS_INTS - 4, workspace.normal_max_local_experts(num_ranks))
        if num_local_experts > most_local_experts:
            raise InvalidInputError(f"the CUDA backend handles up to {most_local_experts} experts per rank on "
                                    f"{num_ranks} ranks, got {num_local_experts}")
        data_bytes = x.size(1) * x.element_size()
        num_scales = 0 if scales is None else scales.size(1)
        layout = workspace.normal_layout(self.ctx.num_nvl_bytes, num_ranks,
                                         workspace.normal_dispatch_row_bytes(data_bytes, num_scales * 4, num_topk))
        # The data kernel's shape, decided (and refused) before any kernel runs. The senders need no output
        # tensor, so where the CPU must wait for the counts before it can size the outputs, they may start
        # before the wait (heuristics.SPLIT_DISPATCH_AROUND_CPU_WAIT), the receivers following in a launch of
        # their own; the receivers need the sending launch's warp count (NOTE [sender ranges]).
        grid = heuristics.data_grid(request.config.num_sms, self.device_sms, heuristics.dispatch_send_share(num_ranks))
        # Round 0 of a call in rounds makes the whole call's outputs (NOTE [placed rounds] in rounds.py).
        makes_outputs = placement is None or placement.outputs is None
        cpu_wait = not cached and not request.num_worst_tokens and makes_outputs
        split = cpu_wait and heuristics.SPLIT_DISPATCH_AROUND_CPU_WAIT
        num_send_warps = (grid.num_blocks if split else grid.num_send_blocks) * (kernels.DATA_THREADS // 32)
        chunk_tokens, tail_tokens = heuristics.DISPATCH_CHUNK_TOKENS, heuristics.dispatch_tail_tokens()
        peer_major = heuristics.dispatch_peer_major(num_ranks, num_send_warps)
        num_groups = num_ranks if peer_major else 1
        slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens, num_groups)
        if slots > layout.max_chunks:  # whole chunks to the end (NOTE [tail pieces]); alike on every rank
            tail_tokens = chunk_tokens
            slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens,
                                                    num_groups)
        if slots > layout.max_chunks:
            raise InvalidInputError(f"{num_send_warps} sending warps need {slots} chunk slots per source, more than "
                                    f"the {layout.max_chunks} the buffer has: use fewer SMs (Buffer.set_num_sms)")
        stream = self._stream()
        is_token_in_rank = request.is_token_in_rank.contiguous()

        # 1. Count exchange (also the barrier before rows land in the peers' buffers).
        prefix_excl = torch.empty((num_tokens + 1) * num_ranks, dtype=torch.int32, device=device)
        rank_prefix_matrix = torch.empty(num_ranks, num_ranks, dtype=torch.int32, device=device)
        source_num_tokens = torch.empty(num_ranks, dtype=torch.int32, device=device)
        call_id = self._next("_notify_calls")
        per_expert = 0 if cached else request.num_tokens_per_expert.data_ptr()
        call = request.call
        placed_by_notify = placement is not None and placement.cursor is not None
        self._kernel(kernels.dispatch_notify(num_ranks))(
            num_ranks + 1, stream, is_token_in_rank.data_ptr(), num_tokens, per_expert, num_experts,
            request.expert_alignment, prefix_excl.data_ptr(), rank_prefix_matrix.data_ptr(),
            source_num_tokens.data_ptr(), num_tokens if call is None else call.num_tokens,
            0 if call is None else call.tokens_per_rank.data_ptr(),
            0 if call is None else call.prefix_matrix.data_ptr(),
            placement.recv_first.data_ptr() if placed_by_notify else 0,
            placement.cursor.data_ptr() if placed_by_notify else 0, self.host_counts_ptr, call_id,
            self.normal.bases_tensor.data_ptr(), rank, (call_id * num_ranks) & _MASK32, *self._wait_args())

        # 2. The rows.
        kernel = self._kernel(kernels.dispatch(num_ranks, data_bytes // 16, num_scales, num_topk, topk_dtype,
                                                chunk_tokens, tail_tokens))
        buffer_args = self._buffer_args(layout, self._next("_seq"))
        scale_strides = (0, 0) if scales is None else (scales.stride(0), scales.stride(1))
        send_head = None if cached else self.empty(num_tokens, num_ranks, dtype=torch.int32, device=device)
        outputs = None if makes_outputs else placement.outputs
        own_rows_direct, prefetch = heuristics.dispatch_own_rows_direct(), heuristics.prefetch_next_row()
        num_worst, recv_first, src_idx_base = request.num_worst_tokens, 0, 0
        if outputs is not None:
            num_worst, recv_first, src_idx_base = outputs[0].size(0), placement.recv_first.data_ptr(), placement.token_base

        def launch(num_send_blocks: int) -> None:
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs or (None,) * 5
            kernel(grid.num_blocks, stream, x.data_ptr(), 0 if scales is None else scales.data_ptr(), *scale_strides,
                   0 if topk_idx is None else topk_idx.data_ptr(),
                   0 if request.topk_weights is None or cached else request.topk_weights.data_ptr(),
                   is_token_in_rank.data_ptr(), prefix_excl.data_ptr(), rank_prefix_matrix.data_ptr(),
                   source_num_tokens.data_ptr(), num_tokens, num_local_experts, num_send_blocks,
                   *(0 if t is None else t.data_ptr() for t in (recv_x, recv_scales, recv_topk_idx,
                                                                 recv_topk_weights, recv_src_idx, send_head)),
                   num_worst, recv_first, src_idx_base, int(own_rows_direct and not split), num_send_warps,
                   int(prefetch), int(peer_major),
                   *buffer_args, *self._wait_args())

        if split:
            launch(grid.num_blocks)  # senders only
        per_expert_list = most_call_tokens = None
        if not makes_outputs:
            num_rows = None
        elif cached:
            num_rows = request.handle.num_rows
        elif request.num_worst_tokens:
            num_rows = request.num_worst_tokens
            per_expert_list = []
        else:
            self._wait_host_counts(call_id)
            num_rows, most_call_tokens = int(self.host_counts[1]), int(self.host_counts[2])
            if placement is not None:  # the whole call's rows, this round's placed
                num_rows = int(self.host_counts[3])
                num_worst, recv_first = num_rows, placement.recv_first.data_ptr()
            per_expert_list = [int(self.host_counts[4 + l]) for l in range(num_local_experts)]

        if outputs is None:
            recv_x = self.empty(num_rows, x.size(1), dtype=x.dtype, device=device)
            recv_scales = None if scales is None else self.empty(num_rows, num_scales, dtype=scales.dtype,
                                                                  device=device)
            recv_topk_idx = recv_topk_weights = None
            if topk_idx is not None:
                recv_topk_idx = self.empty(num_rows, num_topk, dtype=topk_dtype, device=device)
                if request.topk_weights is not None:
                    recv_topk_weights = self.empty(num_rows, num_topk, dtype=torch.float32, device=device)
            recv_src_idx = self.empty(num_rows, dtype=torch.int32, device=device)
            outputs = (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs
        if split:
            launch(0)  # receivers only
        else:
            launch(grid.num_send_blocks)

        if cached:
            handle = request.handle
        else:
            counts = prefix_excl[num_tokens * num_ranks:].view(num_ranks, 1).clone()
            source_first = torch.cat([rank_prefix_matrix.new_zeros(1), rank_prefix_matrix[:-1, rank]]).view(-1, 1)
            handle = DispatchHandle(rank_prefix_matrix, counts, source_first, recv_src_idx, is_token_in_rank,
                                    send_head)
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle,
                              most_call_tokens)

    def combine(self, request: CombineRequest):
        self.check_failures()
        x, handle = request.x, request.handle
        num_tokens, hidden = handle.num_tokens, x.size(1)
        weights = request.topk_weights
        num_topk = 0 if weights is None else weights.size(1)
        layout = workspace.normal_layout(self.ctx.num_nvl_bytes, self.ctx.num_ranks,
                                         workspace.normal_combine_row_bytes(hidden, num_topk))
        placement = request.placement  # NOTE [placed rounds] in rounds.py
        if placement is not None:
            combined_x, combined_w = placement.outputs
        else:
            combined_x = self.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
            combined_w = None if weights is None else self.empty(num_tokens, num_topk, dtype=torch.float32,
                                                                  device=x.device)
        grid = heuristics.data_grid(request.config.num_sms, self.device_sms,
                                    heuristics.combine_send_share(self.ctx.num_ranks))
        barrier_expected = self._next("_barrier_calls")
        self._kernel(kernels.combine(self.ctx.num_ranks, hidden * 2 // 16, num_topk))(
            grid.num_blocks, self._stream(), x.data_ptr(), 0 if weights is None else weights.data_ptr(),
            0 if request.bias_0 is None else request.bias_0.data_ptr(),
            0 if request.bias_1 is None else request.bias_1.data_ptr(),
            handle.rank_prefix_matrix.data_ptr(), 0 if placement is None else placement.recv_first.data_ptr(),
            handle.send_head.data_ptr(), num_tokens, grid.num_send_blocks,
            combined_x.data_ptr(), 0 if combined_w is None else combined_w.data_ptr(),
            int(heuristics.combine_own_rows_direct()), int(heuristics.prefetch_next_row()),
            *self._buffer_args(layout, self._next("_seq")), barrier_expected, *self._wait_args())
        return combined_x, combined_w

    # -- low-latency mode -----------------------------------------------------------------------------

    def _low_latency_impl(self):
        if self.use_low_latency_kernels and self._low_latency_kernels is not None:
            return self._low_latency_kernels
        return None

    def wants_call_agreement(self, low_latency: bool) -> bool:
        # Only where the reference implementation serves the call: the kernels' calls must cost the host no
        # exchange (their own checks of the call belong in their count exchange).
        return low_latency and self._low_latency_impl() is None

    def low_latency_dispatch(self, request):
        self.check_failures()
        impl = self._low_latency_impl()
        return impl.dispatch(request) if impl else self._low_latency.low_latency_dispatch(request)

    def low_latency_combine(self, request):
        self.check_failures()
        impl = self._low_latency_impl()
        return impl.combine(request) if impl else self._low_latency.low_latency_combine(request)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        impl = self._low_latency_impl()
        if impl is not None:
            impl.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def next_low_latency_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self._low_latency.next_low_latency_combine_buffer(num_max_dispatch_tokens_per_rank, hidden,
                                                                 num_experts)

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer:
            if self.low_latency_buffer is not None:
                return self.low_latency_buffer.tensor
            return self._low_latency.local_buffer(True)
        return self.normal.tensor

    def destroy(self) -> None:
        torch.cuda.synchronize(self.device_index)
        for name in ("normal", "low_latency_buffer"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)
        for ptr in (self.host_record_ptr, self.host_counts_ptr):
            runtime.host_free(ptr)
        self.host_record_ptr = self.host_counts_ptr = 0
        self._low_latency.destroy()
