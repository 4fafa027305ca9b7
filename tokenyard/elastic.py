"""DeepEP V2's API: `ElasticBuffer` (dispatch with no separate layout call, the expanded layout, combine) and
`EPHandle`, on the same backends as `Buffer` (docs/semantics.md, "ElasticBuffer").

An ElasticBuffer holds a `Buffer` and runs each call as the V1 calls of the same meaning: the layout, the
dispatch (with ``num_worst_tokens`` where the CPU must not wait, and every slot's weight delivered, where V1
delivers the local slots'), a cached dispatch of the top-k weights where a cached call is given them, and
the expanded layout, which the backend computes without a host sync (`Backend.expanded_layout`,
`gather_rows`, `reduce_expanded`: kernels on the CUDA backend, tokenyard/semantics/expand.py elsewhere).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import checks
from .backends.requests import Expansion
from .buffer import Buffer
from .config import Config
from .errors import HandleError, InvalidInputError
from .event import EventHandle, EventOverlap
from .semantics import expand as expanded

XLike = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _overlap(event) -> Optional[EventOverlap]:
    """V2 passes `EventHandle`s where V1 takes `EventOverlap`s."""
    return EventOverlap(event) if isinstance(event, EventHandle) else event


class EPHandle:
    """The layout of one `ElasticBuffer.dispatch`, for its combine and cached dispatches (DeepEP V2's fields).

    Attributes:
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: ``[T, K]`` the routing this rank sent.
        num_recv_tokens: rows received (the worst case ``R * num_max_tokens_per_rank`` without a CPU sync).
        num_expanded_tokens: rows of the expanded layout (its worst case without a CPU sync).
        num_recv_tokens_per_expert_list: each local expert's pairs rounded up to `expert_alignment` ([]
            without a CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: int32 ``[R]``, inclusive prefix sums of the rows from each
            source rank (every rank is one NVLink domain: the scale-up ranks are the group).
        psum_num_recv_tokens_per_expert: int32 ``[L]``: expanded, where each expert's pairs end
            (``align(end[i-1]) + count[i]``); otherwise the inclusive prefix sums of the aligned counts.
        num_unaligned_recv_tokens_per_expert: int32 ``[L]``, each local expert's pairs.
        recv_src_metadata: int32 ``[N, K + 2]`` (`tokenyard.semantics.expand.source_metadata`).
        dst_buffer_slot_idx, token_metadata_at_forward, channel_linked_list: DeepEP's kernel bookkeeping;
            None here.
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx=None, token_metadata_at_forward=None,
                 channel_linked_list=None):
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        # tokenyard's own: the V1 dispatch's handle, its local top-k ids, and each pair's expanded row.
        self.dispatch_handle = None
        self.recv_topk_idx: Optional[torch.Tensor] = None
        self.row_of: Optional[torch.Tensor] = None
        self.source_row: Optional[torch.Tensor] = None  # expanded: the received row each expanded row holds
        self.buffer_id: Optional[int] = None


def _not_offered(name: str) -> InvalidInputError:
    return InvalidInputError(f"ElasticBuffer.{name} is DeepEP V2's Engram, pipeline-parallel or all-gather/reduce-"
                             "scatter API, which tokenyard does not offer (docs/semantics.md, \"ElasticBuffer\")")


class _OneNodeBuffer(Buffer):
    """NOTE [elastic nodes]
    ElasticBuffer's `Buffer` runs normal mode as one node whatever nodes its group has (real hosts, or virtual
    ones from TOKENYARD_RANKS_PER_NODE): ElasticBuffer offers V2's calls without its scale-out (hybrid)
    mode, reports `num_scaleout_ranks = 1`, and its handles and expanded layouts are built on the one-node
    `DispatchHandle`. So its results never depend on nodes, it keeps the CUDA backend on virtual nodes of one
    host, and a group of several hosts runs as before (the reference backend's one-node all-to-all)."""

    _normal_mode_sees_nodes = False


class ElasticBuffer:
    """DeepEP V2's `ElasticBuffer`: expert-parallel dispatch and combine in one class.

    Arguments (DeepEP V2's, in its order):
        group: the EP process group (any `torch.distributed` group, as for `Buffer`).
        num_bytes: buffer bytes per rank; None: `get_buffer_size_hint` of the next four arguments.
        num_cpu_bytes: host memory for Engram, which tokenyard does not offer: must be 0.
        num_max_tokens_per_rank: the most tokens a rank dispatches in one call (the default of `dispatch`).
        hidden, num_topk, use_fp8_dispatch: the problem the size hint makes room for.
        deterministic: accepted, and kept as the attribute: tokenyard's calls are deterministic either way
            (docs/semantics.md "ElasticBuffer"): rows in order of source rank, then token (V2's deterministic
            order), every sum in a fixed order, so the same inputs give the same bits.
        allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps:
            RDMA and SM-policy settings of DeepEP; accepted, kept as attributes, and not read (every rank is
            reached over NVLink; combine reduces once per token, in a fixed order).
        num_cpu_timeout_secs: accepted; host waits use `num_gpu_timeout_secs` as every wait's deadline.
        num_gpu_timeout_secs: the deadline of every wait for a peer (`Buffer`'s timeout_s).
        explicitly_destroy: accepted; `destroy()` works either way.
    tokenyard's own, keyword only: backend, check_inputs, per_round_tokens, device (as for `Buffer`).

    Attributes: DeepEP V2's (group, rank_idx, num_ranks, num_bytes, num_max_tokens_per_rank, the settings above,
    the domain sizes and indices, `runtime`), and `buffer`, the `Buffer` that runs the calls.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, backend: Optional[str] = None, check_inputs: Optional[bool] = None,
                 per_round_tokens: Optional[int] = None, device: Optional[Union[str, torch.device]] = None) -> None:
        del sl_idx, num_cpu_timeout_secs  # see docstring
        if num_cpu_bytes:
            raise InvalidInputError("num_cpu_bytes is Engram's host memory, which tokenyard does not offer: pass 0")
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise InvalidInputError("without num_bytes, num_max_tokens_per_rank and hidden must be positive "
                                        "(they size the buffer)")
            num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, allow_hybrid_mode)
        self.buffer = _OneNodeBuffer(group, num_nvl_bytes=num_bytes, explicitly_destroy=explicitly_destroy,
                             backend=backend, timeout_s=float(num_gpu_timeout_secs), check_inputs=check_inputs,
                             per_round_tokens=per_round_tokens, device=device)
        self.group, self.num_bytes, self.deterministic = group, num_bytes, deterministic
        self.rank_idx, self.num_ranks = self.buffer.rank, self.buffer.group_size
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.allow_hybrid_mode, self.explicitly_destroy = allow_hybrid_mode, explicitly_destroy
        self.allow_multiple_reduction, self.prefer_overlap_with_compute = allow_multiple_reduction, \
            prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks

    @property
    def backend(self) -> str:
        return self.buffer.backend

    @property
    def runtime(self):
        """DeepEP V2's runtime attribute: the backend that runs the calls (`Buffer.runtime`, which answers DeepEP's
        runtime queries), None after `destroy()`, as DeepEP's."""
        return self.buffer.runtime

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes per rank for calls of `num_max_tokens_per_rank` tokens in one round (more run in rounds). bf16
        rows bound FP8 ones, so `use_fp8_dispatch` changes nothing; the other settings are DeepEP's."""
        del num_topk, use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction
        config = Config(num_max_tokens_per_rank=num_max_tokens_per_rank)
        return config.get_nvl_buffer_size_hint(hidden * 2, group.size())

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16):
        """DeepEP V2's Engram storage size: refused, as Engram is not offered (docs/semantics.md "ElasticBuffer").

        Raises:
            InvalidInputError: naming the call.
        """
        raise _not_offered("get_engram_storage_size_hint")

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """DeepEP V2's pipeline-parallel buffer size: refused, as its `pp_*` calls are not offered.

        Raises:
            InvalidInputError: naming the call.
        """
        raise _not_offered("get_pp_buffer_size_hint")

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes, dtype: torch.dtype) -> int:
        """DeepEP V2's all-gather/reduce-scatter session size: refused, as its `agrs_*` calls are not offered.

        Raises:
            InvalidInputError: naming the call.
        """
        raise _not_offered("get_agrs_num_max_session_bytes")

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """DeepEP V2's all-gather/reduce-scatter buffer size: refused, as its `agrs_*` calls are not offered.

        Raises:
            InvalidInputError: naming the call.
        """
        raise _not_offered("get_agrs_buffer_size_hint")

    def destroy(self) -> None:
        self.buffer.destroy()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Return once every rank has called it (the streams and the device as they are)."""
        del use_comm_stream, sequential
        if with_cpu_sync and self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        self.buffer._exchange.barrier("ElasticBuffer.barrier")

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream."""
        return EventHandle()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        return self.buffer.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(RDMA ranks, NVLink ranks): one NVLink domain of the whole group."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out ranks, scale-up ranks), as `get_physical_domain_size`."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0, rdma_gbs: float = 0,
                                nvlink_gbs: float = 0, sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """The fewest SMs at which the normal-mode kernels of this group's size fill NVLink (NOTE [SM model] in
        tokenyard/backends/cuda/heuristics.py), at the rates given.

        Arguments:
            nvlink_gbs: what NVLink carries out of a GPU (0: our figure, heuristics.NVLINK_GBS, as DeepEP's 0 asks
                for the machine's). sm_read_gbs: what one receiving SM copies out of the buffer; sm_write_gbs: what
                one sending SM writes, to the peers and (its rank's share) to its own memory, which costs it more
                (NOTE [SM model]); DeepEP V2's defaults, 200 and 50 (0: our kernels' figures).
            num_experts, num_topk: accepted (the rates above do not depend on them). num_scaleout_topk,
                rdma_gbs: ignored (one NVLink domain).
        A call given ``num_sms=0`` takes the model at our kernels' own rates (`_default_num_sms`: 16 SMs at 2
        ranks, 12 at 4 and 8), which DeepEP's defaults (a sending SM's 50 GB/s, ours measure 31) would undercount.
        """
        del num_experts, num_topk, num_scaleout_topk, rdma_gbs
        from .backends.cuda import heuristics

        return heuristics.theoretical_num_sms(self.num_ranks, nvlink_gbs or heuristics.NVLINK_GBS,
                                              sm_write_gbs or heuristics.SM_WRITE_GBS,
                                              sm_read_gbs or heuristics.SM_READ_GBS)

    def _default_num_sms(self) -> int:
        """The SMs of a call given ``num_sms=0``: NOTE [SM model] at our kernels' measured rates."""
        return self.get_theoretical_num_sms(0, 0, sm_read_gbs=0, sm_write_gbs=0)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs: none (no RDMA path); accepted for DeepEP's callers."""
        del num_sms
        return 0

    def __getattr__(self, name: str):
        if name.startswith(("engram_", "pp_", "agrs_")) or name in ("all_gather", "create_agrs_session",
                                                                       "destroy_agrs_session"):
            raise _not_offered(name)
        raise AttributeError(f"'ElasticBuffer' object has no attribute {name!r}")

    # -- dispatch ----------------------------------------------------------------------------------------------

    def _config(self, num_sms: int) -> Optional[Config]:
        return Config(num_sms) if num_sms else None

    def dispatch(self, x: XLike, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send each token to every rank that holds one of its experts (docs/semantics.md, "ElasticBuffer").

        Arguments:
            x: ``[T, H]`` bf16, or ``(data [T, H], scales [T, S])`` (FP8 e4m3 with float32 or packed scales).
            topk_idx, topk_weights: ``[T, K]`` global expert ids (-1: none) and float32 weights; topk_idx is
                None with a handle (topk_weights may be given then: they travel by the handle's layout).
            cumulative_local_expert_recv_stats: int32 ``[L]``; a fresh dispatch adds each local expert's pairs.
            num_experts: required without a handle.
            num_max_tokens_per_rank: the most tokens a rank sends (default: the constructor's).
            expert_alignment: each local expert's count rounds up to this multiple (default 1).
            num_sms: SMs for the CUDA kernels (0: NOTE [SM model] at our kernels' rates, `_default_num_sms`).
            num_qps: ignored.
            previous_event: the call waits for it. previous_event_before_epilogue: waited for too, before the call.
            async_with_compute_stream: the call runs on the communication stream without holding up the
                current stream; the returned event says when its outputs are ready (wait for it before using
                them: `event.current_stream_wait()`), as V1's `async_finish` (NOTE [elastic streams]).
            allocate_on_comm_stream: as in `Buffer.dispatch`.
            handle: a previous dispatch's `EPHandle`: reuse its layout (no count exchange, no CPU wait).
            do_handle_copy: keep a copy of `topk_idx` in the handle (else the handle holds the caller's).
            do_cpu_sync: wait on the host for the counts (default True; False with a handle): outputs then have
                exactly the received rows; without it, the worst case's rows (the valid ones end at
                ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``, the rest unspecified).
            do_expand: one row per (received token, local expert), grouped by expert, each group starting at a
                multiple of `expert_alignment`. do_zero_padding: zero the rows between the groups.
            use_tma_aligned_col_major_sf: the received scales column-major, their column stride a multiple
                of 4 rows.
        Returns:
            ``recv_x`` (a tuple like `x`), ``recv_topk_idx`` (local ids, -1 elsewhere; None when expanded),
            ``recv_topk_weights`` (every slot's weight ``[N, K]``, or ``[M]`` per expanded row; None without
            weights), the `EPHandle`, an `EventOverlap`.
        """
        del num_qps
        if do_zero_padding and not do_expand:
            raise InvalidInputError("do_zero_padding zeroes the expanded layout's padding: it needs do_expand")
        if handle is None and do_cpu_sync is not False:  # before the layout runs (NOTE [graph capture])
            self.buffer._refuse_capture(self.buffer._normal_backend(), "dispatch", cpu_wait=True)
        with self._scope(previous_event, previous_event_before_epilogue, async_with_compute_stream,
                         allocate_on_comm_stream) as scope:
            if handle is not None:
                result = self._cached_dispatch(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                                               expert_alignment, num_sms, handle, do_cpu_sync, do_expand,
                                               do_zero_padding, use_tma_aligned_col_major_sf)
            else:
                result = self._fresh_dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                              num_experts, num_max_tokens_per_rank, expert_alignment, num_sms,
                                              do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                                              use_tma_aligned_col_major_sf)
        return result + (self._finish(scope, result, (x, topk_idx, topk_weights, cumulative_local_expert_recv_stats),
                                      async_with_compute_stream),)

    @contextlib.contextmanager
    def _scope(self, previous_event, previous_event_before_epilogue, async_with_compute_stream: bool,
               allocate_on_comm_stream: bool):
        """NOTE [elastic streams]
        A V2 call is one stream scope of its Buffer (NOTE [stream contract] in buffer.py): the whole call, its
        V1 calls and the torch work around them (the expanded layout, the weights' rows, the handle's copy of
        topk_idx) included, runs on the communication stream after `previous_event` (else after the current
        stream's work so far), so no part of it reads an input before the event says it is ready. The V1 calls
        inside take no event of their own: they follow what came before them in the scope. Without
        async_with_compute_stream the caller's stream then waits for the scope, as after a V1 call (a call on
        the joined stream runs there straight, NOTE [joined stream]); with it the caller's stream goes on at
        once and the call's event says when the outputs are ready. `previous_event_before_epilogue` is waited
        for at the scope's start, on the stream the call runs on. Outputs and the handle's tensors are
        handed to the caller's stream, and, with async_with_compute_stream, the inputs to the communication
        stream, as V1's `async_finish` does, so that neither stream's allocator reuses memory the other still
        reads.

        NOTE [expanded sums first]
        One exception: an expanded combine given neither event sums each received token's expanded rows (and
        gathers their weights) on the caller's stream, before the scope; the communication stream then holds the
        combine kernel alone. A persistent GEMM queued after the call holds every SM until it ends, so a
        communication kernel not yet running when the GEMM starts (one waiting for an earlier kernel of its call)
        runs after it: with the sums on the communication stream the combine kernel ran after the next GEMM, with
        them here it starts beside it (benchmarks/results/moe_step.md, "One GPU"). The sums read only what the
        caller's stream wrote, in its order, as a GEMM would. Given an event, the inputs may come from another
        stream, and the sums stay in the scope."""
        with self.buffer._stream_scope(use_comm_stream=True, previous_event=_overlap(previous_event),
                                       async_finish=async_with_compute_stream,
                                       allocate_on_comm_stream=allocate_on_comm_stream) as scope:
            if previous_event_before_epilogue is not None:
                previous_event_before_epilogue.current_stream_wait()
            yield scope

    def _finish(self, scope, outputs: tuple, inputs: tuple, async_with_compute_stream: bool) -> EventOverlap:
        """The call's event (NOTE [elastic streams]), after handing its tensors to the streams that use them."""
        if scope.owner is not None:  # else the tensors are the caller's stream's already (NOTE [joined stream])
            # A handle's fields: its tensors, and the V1 handle (a tuple) with its own; not its list of counts.
            made = [v for t in outputs for v in (vars(t).values() if isinstance(t, EPHandle) else (t,))
                    if not isinstance(v, list)]
            self.buffer._hand_over(scope.owner, made)
        if not async_with_compute_stream:
            return EventOverlap(None)
        if scope.event.event is None:  # no communication stream (a CPU Buffer): nothing to wait for
            return EventOverlap(EventHandle())
        self.buffer._hand_over(self.buffer._comm_stream, inputs)
        return scope.event

    def _fresh_dispatch(self, x, topk_idx, topk_weights, stats, num_experts, num_max, expert_alignment, num_sms,
                        do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, col_major_sf):
        if topk_idx is None or num_experts is None:
            raise InvalidInputError("a dispatch without a handle needs topk_idx and num_experts")
        num_max = self.num_max_tokens_per_rank if num_max is None else num_max
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        data = x[0] if isinstance(x, tuple) else x
        if num_max <= 0 or data.size(0) > num_max:
            raise InvalidInputError(f"{data.size(0)} tokens on rank {self.rank_idx}, more than num_max_tokens_per_rank "
                                    f"= {num_max} (give it to the constructor or to dispatch)")
        if expert_alignment < 1:
            raise InvalidInputError(f"expert_alignment must be at least 1, got {expert_alignment}")
        num_local = num_experts // self.num_ranks
        if stats is not None and (stats.dtype != torch.int32 or stats.shape != (num_local,)):
            raise InvalidInputError(f"cumulative_local_expert_recv_stats must be int32 [{num_local}], got "
                                    f"{stats.dtype} {list(stats.shape)}")
        num_sms = num_sms or self._default_num_sms()
        config = self._config(num_sms)
        buffer = self.buffer
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        num_worst = 0 if do_cpu_sync else self.num_ranks * num_max
        weights = topk_weights  # num_worst_tokens wants some: zeros where the caller has none
        if weights is None and not do_cpu_sync:
            weights = torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        if do_expand and buffer._expands_fresh_in_kernel(x, topk_idx.size(1), num_max, config.num_sms):
            return self._fresh_in_kernel(x, topk_idx, weights, topk_weights is not None, stats, num_experts, num_max,
                                         expert_alignment, num_sms, config, (per_rank, in_rank, per_expert),
                                         num_worst, do_handle_copy, do_zero_padding, col_major_sf)
        recv_x, recv_topk_idx, recv_weights, per_expert_list, v1, _ = buffer._dispatch_call(
            x, None, per_rank, in_rank, per_expert, topk_idx, weights, expert_alignment, num_worst, config, None,
            False, False, all_topk_weights=True)
        if topk_weights is None:
            recv_weights = None
        num_rows = recv_topk_idx.size(0)
        if do_cpu_sync:
            num_expanded = sum(per_expert_list)
        else:
            num_expanded = expanded.worst_expanded_rows(num_rows, topk_idx.size(1), num_local, expert_alignment)
        # The handle's field, contiguous as DeepEP's: vLLM's kernels read it as plain memory.
        psum_per_rank = v1.rank_prefix_matrix[:, self.rank_idx].contiguous()
        counts, psum_per_expert, row_of, source_row, metadata = buffer._backend().expanded_layout(
            recv_topk_idx, v1.recv_src_idx, psum_per_rank, num_local, expert_alignment, num_max,
            num_expanded if do_expand else None)
        if stats is not None:
            stats += counts.to(stats.device)
        handle = self._handle(
            v1, recv_topk_idx, row_of, source_row, topk_idx, do_handle_copy, do_expand=do_expand,
            num_experts=num_experts, expert_alignment=expert_alignment, num_max_tokens_per_rank=num_max,
            num_sms=num_sms, num_recv_tokens=v1.num_recv_tokens if do_cpu_sync else num_rows,
            num_expanded_tokens=num_expanded, num_recv_tokens_per_expert_list=per_expert_list if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=psum_per_rank, psum_num_recv_tokens_per_expert=psum_per_expert,
            num_unaligned_recv_tokens_per_expert=counts, recv_src_metadata=metadata)
        if do_expand:
            return self._expanded(recv_x, recv_weights, handle, do_zero_padding, col_major_sf) + (handle,)
        return (self._laid_out(recv_x, col_major_sf), recv_topk_idx, recv_weights, handle)

    def _handle(self, v1, recv_topk_idx, row_of, source_row, topk_idx, do_handle_copy: bool, **fields) -> EPHandle:
        """A fresh dispatch's EPHandle: DeepEP V2's `fields` by name, the routing (a copy with `do_handle_copy`),
        and tokenyard's own: the V1 handle `v1`, the local top-k ids, each pair's expanded row and each row's source."""
        handle = EPHandle(topk_idx=topk_idx.clone() if do_handle_copy else topk_idx, **fields)
        handle.dispatch_handle, handle.recv_topk_idx, handle.row_of = v1, recv_topk_idx, row_of
        handle.source_row = source_row
        handle.buffer_id = id(self)
        return handle

    def _fresh_in_kernel(self, x, topk_idx, weights, with_weights: bool, stats, num_experts, num_max,
                         expert_alignment, num_sms, config, layout, num_worst, do_handle_copy, do_zero_padding,
                         col_major_sf):
        """A fresh expanded dispatch whose kernel makes the expanded layout as the rows land (NOTE [expanded rows] in
        kernels/dispatch.cuh): each slot's source rank goes with its row, and the receivers place it past where its
        source's pairs of the expert begin (semantics.expand.source_ranks, expanded_bases)."""
        num_topk, num_local = topk_idx.size(1), num_experts // self.num_ranks
        num_worst_expanded = 0 if not num_worst else expanded.worst_expanded_rows(num_worst, num_topk, num_local,
                                                                                  expert_alignment)
        expansion = Expansion(topk_idx, num_experts, do_zero_padding,
                              source_ranks=self.buffer._backend().source_ranks(topk_idx, num_experts),
                              expanded_rows=num_worst_expanded, num_max_tokens_per_rank=num_max)
        per_rank, in_rank, per_expert = layout
        recv_x, recv_topk_idx, recv_weights, per_expert_list, v1, _, made = self.buffer._dispatch(
            x, None, per_rank, in_rank, per_expert, topk_idx, weights, expert_alignment, num_worst, config, None,
            False, False, all_topk_weights=True, expansion=expansion)
        if stats is not None:
            stats += made["counts"].to(stats.device)
        num_rows = recv_topk_idx.size(0)
        psum_per_rank = v1.rank_prefix_matrix[:, self.rank_idx].contiguous()  # contiguous: as in _fresh_dispatch
        handle = self._handle(
            v1, recv_topk_idx, made["row_of"], made["source_row"], topk_idx, do_handle_copy, do_expand=True,
            num_experts=num_experts, expert_alignment=expert_alignment, num_max_tokens_per_rank=num_max,
            num_sms=num_sms, num_recv_tokens=num_rows if num_worst else v1.num_recv_tokens,
            num_expanded_tokens=num_worst_expanded or sum(per_expert_list),
            num_recv_tokens_per_expert_list=[] if num_worst else per_expert_list,
            psum_num_recv_tokens_per_scaleup_rank=psum_per_rank, psum_num_recv_tokens_per_expert=made["ends"],
            num_unaligned_recv_tokens_per_expert=made["counts"], recv_src_metadata=made["metadata"])
        return self._laid_out(recv_x, col_major_sf), None, recv_weights if with_weights else None, handle

    def _cached_dispatch(self, x, topk_idx, topk_weights, num_experts, num_max, expert_alignment, num_sms, handle,
                         do_cpu_sync, do_expand, do_zero_padding, col_major_sf):
        if not isinstance(handle, EPHandle) or handle.dispatch_handle is None:
            raise HandleError("handle must be the EPHandle of an ElasticBuffer.dispatch")
        if handle.buffer_id != id(self):
            raise HandleError("the handle was made by another ElasticBuffer")
        if topk_idx is not None:
            raise InvalidInputError("a dispatch with a handle takes its topk_idx from the handle: pass None")
        if do_cpu_sync:
            raise InvalidInputError("a dispatch with a handle never waits on the CPU: do_cpu_sync must not be True")
        for name, value, held in (("num_experts", num_experts, handle.num_experts),
                                  ("num_max_tokens_per_rank", num_max, handle.num_max_tokens_per_rank),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment)):
            if value is not None and value != held:
                raise InvalidInputError(f"{name} = {value} differs from the handle's {held}")
        if do_expand != handle.do_expand:
            raise InvalidInputError(f"do_expand = {do_expand}, but the handle's dispatch had {handle.do_expand}")
        config = self._config(num_sms or handle.num_sms)
        if do_expand and self.buffer._expands_in_kernel(handle.dispatch_handle, x, handle.topk_idx.size(1),
                                                        config.num_sms):
            # NOTE [expanded rows] in kernels/dispatch.cuh: the rows and their weights straight to the expanded layout
            expansion = Expansion(handle.topk_idx, handle.num_experts, do_zero_padding, row_of=handle.row_of,
                                  source_row=handle.source_row)
            recv_x, _, weights = self.buffer._dispatch(
                x, handle.dispatch_handle, None, None, None, None, topk_weights, 1, 0, config, None, False, False,
                expansion=expansion)[:3]
            return self._laid_out(recv_x, col_major_sf), None, weights, handle
        recv_x = self.buffer.dispatch(x, handle.dispatch_handle, config=config)[0]
        recv_weights = self._send_weights(topk_weights, handle.dispatch_handle, config)
        if do_expand:
            return self._expanded(recv_x, recv_weights, handle, do_zero_padding, col_major_sf) + (handle,)
        return (self._laid_out(recv_x, col_major_sf), handle.recv_topk_idx.clone(), recv_weights, handle)

    def _send_weights(self, topk_weights, v1_handle, config) -> Optional[torch.Tensor]:
        """Every slot's weight at each received row: a cached dispatch of the weights as rows of float32,
        padded to 16 bytes."""
        if topk_weights is None:
            return None
        num_topk = topk_weights.size(1)
        width = expanded.align(num_topk, 4)
        rows = torch.zeros(topk_weights.size(0), width, dtype=torch.float32, device=topk_weights.device)
        rows[:, :num_topk] = topk_weights
        return self.buffer.dispatch(rows, v1_handle, config=config)[0][:, :num_topk].contiguous()

    def _expanded(self, recv_x, recv_weights, handle: EPHandle, zero_fill: bool, col_major_sf: bool):
        data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        rows = handle.num_expanded_tokens
        backend = self.buffer._backend()
        out = backend.gather_rows(data, handle.source_row, zero_fill)
        if scales is not None:
            out = self._laid_out((out, backend.gather_rows(scales, handle.source_row, zero_fill)), col_major_sf)
        weights = None if recv_weights is None else backend.expand_weights(recv_weights, handle.row_of, rows,
                                                                          zero_fill)
        return out, None, weights

    @staticmethod
    def _laid_out(recv_x, col_major_sf: bool):
        """Scales column-major with a column stride that is a multiple of 4 rows, where asked."""
        if not col_major_sf or not isinstance(recv_x, tuple):
            return recv_x
        data, scales = recv_x
        rows = expanded.align(scales.size(0), 4)
        storage = torch.empty(scales.size(1), rows, dtype=scales.dtype, device=scales.device)
        out = storage[:, :scales.size(0)].t()
        out.copy_(scales)
        return data, out

    # -- combine -----------------------------------------------------------------------------------------------

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its token's rank and sum there (docs/semantics.md, "ElasticBuffer").

        Arguments:
            x: bf16, ``[N, H]`` one row per received row, or ``[M, H]`` one per expanded row (the rows of one
                received token are summed first, in slot order, in float32, then rounded to bf16).
            handle: the dispatch's `EPHandle`.
            topk_weights: ``[N, K]`` (or ``[M]`` expanded) float32: ``combined_topk_weights[t, k]`` is slot k's
                value on the rank that owns its expert (0 where the slot has none). Not applied to `x`.
            bias: ``[T, H]`` bf16, or a tuple of two, added once per token.
            num_sms: SMs for the CUDA kernels (0: the handle's). num_qps: ignored.
            previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream:
                as in `dispatch`.
        Returns:
            ``combined_x`` [T, H] bf16, ``combined_topk_weights`` [T, K] float32 or None, an `EventOverlap`.
        """
        del num_qps
        if not isinstance(handle, EPHandle) or handle.dispatch_handle is None:
            raise HandleError("handle must be the EPHandle of an ElasticBuffer.dispatch")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.dispatch_handle.num_rows
        if x.dim() != 2 or x.size(0) != rows:
            made = "expanded" if handle.do_expand else "received"
            raise InvalidInputError(f"x must have the {rows} rows the dispatch {made}, got {list(x.shape)}")
        if handle.do_expand and topk_weights is not None and topk_weights.shape != (rows,):
            raise InvalidInputError(f"expanded topk_weights must be [{rows}], got {list(topk_weights.shape)}")
        # Before the sums (device work) that may precede the V1 call's own checks.
        checks.tensor("x", x, dtypes=(torch.bfloat16,), device=self.buffer.device)
        backend = self.buffer._backend()
        sums, weights = None, None
        # NOTE [expanded sums first]: with nothing to wait for, the expanded rows are summed on the caller's stream.
        if handle.do_expand and previous_event is None and previous_event_before_epilogue is None:
            sums = backend.reduce_expanded(x, handle.row_of)
            weights = None if topk_weights is None else backend.gather_weights(topk_weights, handle.row_of)
        inputs = (x, topk_weights, sums, weights) + (bias if isinstance(bias, tuple) else (bias,))
        with self._scope(previous_event, previous_event_before_epilogue, async_with_compute_stream,
                         allocate_on_comm_stream) as scope:
            if handle.do_expand and sums is None:
                weights = None if topk_weights is None else backend.gather_weights(topk_weights, handle.row_of)
                sums = backend.reduce_expanded(x, handle.row_of)
            elif not handle.do_expand:
                weights = None if topk_weights is None else backend.local_weights(topk_weights,
                                                                                  handle.recv_topk_idx)
            combined_x, combined_weights, _ = self.buffer.combine(
                x if sums is None else sums, handle.dispatch_handle, weights, bias,
                self._config(num_sms or handle.num_sms))
        return combined_x, combined_weights, self._finish(scope, (combined_x, combined_weights), inputs,
                                                          async_with_compute_stream)
