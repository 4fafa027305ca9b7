"""The Buffer's calls as PyTorch custom ops, so that `torch.compile` traces them without graph breaks.

NOTE [custom ops]
`Buffer.get_dispatch_layout`, `dispatch`, `combine`, `low_latency_dispatch` and `low_latency_combine` called
while `torch.compile` traces (`torch.compiler.is_compiling()`) go through the ops below, registered with
`torch.library`:

    tokenyard::get_dispatch_layout   tokenyard::dispatch   tokenyard::cached_dispatch   tokenyard::combine
    tokenyard::low_latency_dispatch   tokenyard::low_latency_combine

An op takes tensors and ints only, so the Buffer travels as its id (`Buffer._id`, looked up in `_buffers`)
and a dispatch handle as its six tensors. Each op's real implementation is the Buffer's own call (same
checks, same backends, same fast paths); its fake implementation gives the output shapes, so the compiled
graph holds one node per call. A fresh dispatch's row count is data-dependent: without `num_worst_tokens`
it is an unbacked size in the trace (dynamo needs `capture_dynamic_output_shape_ops` to trace it); with it,
the outputs have exactly `num_worst_tokens` rows. An op's outputs may not alias its inputs or each other, so
outputs that are parts of one allocation (NOTE [plan allocations] in csrc/call_plan.cpp) are copied: a few
small copies per call, in compiled code only.

Inside a compiled region the calls run on the current stream: `previous_event`, `async_finish` and
`allocate_on_comm_stream` are ignored, and the returned event is an empty `EventOverlap` (the work is already
ordered before whatever the stream runs next); `return_recv_hook` too (the call receives at once: the hook it asks
for does nothing; without it the hook is None, as in eager calls and DeepEP), a low-latency combine's `out` is
filled by a copy, and with `zero_copy` the buffer it reads is named as the op's input. The statistics tensors a
low-latency call adds to are declared mutated. `num_recv_tokens_per_expert_list` is a Python list read from a
tensor (one graph break where it is used; empty with `num_worst_tokens`, as in DeepEP). Handles are DeepEP's plain
tuples; the Buffer finds the rest of what it knew about its own handle (its rounds, its fast path) by the identity
of the tensor the op returned as its key (`recv_src_idx`, or a low-latency handle's `src_info`), so calls with a
traced handle cost what they cost in eager mode.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .event import EventOverlap
from .handle import DispatchHandle, LowLatencyHandle

_buffers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handle_attributes: Dict[int, dict] = {}  # id of a handle's key tensor -> the handle's attributes (NOTE above)

Tensor = torch.Tensor


def register(buffer) -> None:
    """Make `buffer` reachable from the ops by its id."""
    _buffers[buffer._id] = buffer


def _buffer(buffer_id: int):
    buffer = _buffers.get(buffer_id)
    if buffer is None:
        raise RuntimeError(f"tokenyard: no live Buffer with id {buffer_id} (destroyed, or made in another process)")
    return buffer


def _remember(handle, key: Tensor) -> None:
    """Keep a handle's attributes beside the tensor the op returns as its key (a dispatch handle's
    `recv_src_idx`, a low-latency handle's `src_info`) for as long as that tensor lives. A handle of rounds
    (no `fast_for`) carries tensors in its attributes and is rebuilt from its fields instead."""
    if getattr(handle, "fast_for", None) is None:
        return
    _handle_attributes[id(key)] = dict(handle.__dict__)
    weakref.finalize(key, _handle_attributes.pop, id(key), None)


def _handle(fields) -> DispatchHandle:
    return DispatchHandle(*fields, **_handle_attributes.get(id(fields[3]), {}))


def _unaliased(outputs, inputs):
    """A custom op's outputs may not alias its inputs or each other: copy any output that shares the storage
    of an input or of an earlier output (outputs that are parts of one allocation, NOTE [plan allocations])."""
    storages = {t.untyped_storage()._cdata for t in inputs if t is not None}
    unaliased = []
    for t in outputs:
        if t.untyped_storage()._cdata in storages:
            t = t.clone()
        storages.add(t.untyped_storage()._cdata)
        unaliased.append(t)
    return tuple(unaliased)


def _no_rows(rows, like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((rows, 0), dtype=dtype)


def _rows_and_scales(recv_x, x: Tensor) -> Tuple[Tensor, Tensor]:
    """A dispatch's received x as (rows, scales), the scales [N, 0] where x had none."""
    return recv_x if isinstance(recv_x, tuple) else (recv_x, _no_rows(recv_x.size(0), x, torch.float32))


def _fake_rows_and_scales(rows, x: Tensor, x_scales: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The fake (rows, scales) of a dispatch that receives `rows` rows of `x` (and `x_scales`)."""
    scales = _no_rows(rows, x, torch.float32) if x_scales is None else \
        x_scales.new_empty((rows,) + tuple(x_scales.shape[1:]))
    return x.new_empty((rows,) + tuple(x.shape[1:])), scales


# -- get_dispatch_layout --------------------------------------------------------------------------------

@torch.library.custom_op("tokenyard::get_dispatch_layout", mutates_args=())
def _layout(buffer_id: int, topk_idx: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor]:
    per_rank, _, per_expert, in_rank, _ = _buffer(buffer_id).get_dispatch_layout(topk_idx, num_experts)
    return _unaliased((per_rank, per_expert, in_rank), (topk_idx,))


@_layout.register_fake
def _(buffer_id, topk_idx, num_experts):
    num_ranks = _buffer(buffer_id).group_size
    return (topk_idx.new_empty(num_ranks, dtype=torch.int32), topk_idx.new_empty(num_experts, dtype=torch.int32),
            topk_idx.new_empty((topk_idx.size(0), num_ranks), dtype=torch.bool))


# -- dispatch ----------------------------------------------------------------------------------------------

@torch.library.custom_op("tokenyard::dispatch", mutates_args=())
def _dispatch(buffer_id: int, x: Tensor, x_scales: Optional[Tensor], num_tokens_per_rank: Tensor,
              is_token_in_rank: Tensor, num_tokens_per_expert: Tensor, topk_idx: Optional[Tensor],
              topk_weights: Optional[Tensor], expert_alignment: int, num_worst_tokens: int) -> List[Tensor]:
    """Returns recv_x, recv_x_scales ([N, 0] without scales), recv_topk_idx and recv_topk_weights ([N, 0]
    without top-k), the per-expert counts (int64 on the CPU) and the handle's fields but `is_token_in_rank`,
    which is the input."""
    buffer = _buffer(buffer_id)
    sent = x if x_scales is None else (x, x_scales)
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = buffer.dispatch(
        sent, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    recv_x, recv_scales = _rows_and_scales(recv_x, x)
    rows = recv_x.size(0)
    if recv_topk_idx is None:
        recv_topk_idx, recv_topk_weights = _no_rows(rows, x, torch.int64), _no_rows(rows, x, torch.float32)
    outputs = _unaliased((recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
                          torch.tensor(per_expert, dtype=torch.int64, device="cpu"), handle[0], handle[1],
                          handle[2], handle[3], handle[5]),
                         (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                          num_tokens_per_expert))
    _remember(handle, outputs[8])
    return list(outputs)


@_dispatch.register_fake
def _(buffer_id, x, x_scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
      expert_alignment, num_worst_tokens):
    num_ranks = _buffer(buffer_id).group_size
    rows = num_worst_tokens or torch.library.get_ctx().new_dynamic_size()
    num_local_experts = num_tokens_per_expert.size(0) // num_ranks
    num_topk = 0 if topk_idx is None else topk_idx.size(1)
    int32 = dict(dtype=torch.int32)
    return [*_fake_rows_and_scales(rows, x, x_scales),
            x.new_empty((rows, num_topk), dtype=torch.int64),
            x.new_empty((rows, num_topk), dtype=torch.float32),
            torch.empty(0 if num_worst_tokens else num_local_experts, dtype=torch.int64, device="cpu"),
            x.new_empty((num_ranks, num_ranks), **int32), x.new_empty((num_ranks, 1), **int32),
            x.new_empty((num_ranks, 1), **int32), x.new_empty(rows, **int32),
            x.new_empty((x.size(0), num_ranks), **int32)]


@torch.library.custom_op("tokenyard::cached_dispatch", mutates_args=())
def _cached_dispatch(buffer_id: int, x: Tensor, x_scales: Optional[Tensor], rank_prefix_matrix: Tensor,
                     channel_prefix_matrix: Tensor, recv_channel_prefix_matrix: Tensor, recv_src_idx: Tensor,
                     is_token_in_rank: Tensor, send_head: Tensor) -> Tuple[Tensor, Tensor]:
    fields = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
              send_head)
    sent = x if x_scales is None else (x, x_scales)
    recv_x = _buffer(buffer_id).dispatch(sent, handle=_handle(fields))[0]
    return _unaliased(_rows_and_scales(recv_x, x), (x, x_scales) + fields)


@_cached_dispatch.register_fake
def _(buffer_id, x, x_scales, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head):
    return _fake_rows_and_scales(recv_src_idx.size(0), x, x_scales)


# -- combine -----------------------------------------------------------------------------------------------

@torch.library.custom_op("tokenyard::combine", mutates_args=())
def _combine(buffer_id: int, x: Tensor, rank_prefix_matrix: Tensor, channel_prefix_matrix: Tensor,
             recv_channel_prefix_matrix: Tensor, recv_src_idx: Tensor, is_token_in_rank: Tensor, send_head: Tensor,
             topk_weights: Optional[Tensor], bias_0: Optional[Tensor], bias_1: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Returns combined_x and combined_topk_weights ([T, 0] without weights)."""
    fields = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
              send_head)
    bias = bias_0 if bias_1 is None else (bias_0, bias_1)
    combined_x, combined_weights, _ = _buffer(buffer_id).combine(x, _handle(fields), topk_weights=topk_weights,
                                                                 bias=bias)
    if combined_weights is None:
        combined_weights = _no_rows(combined_x.size(0), x, torch.float32)
    return _unaliased((combined_x, combined_weights), (x, topk_weights, bias_0, bias_1) + fields)


@_combine.register_fake
def _(buffer_id, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head, topk_weights, bias_0, bias_1):
    num_tokens = is_token_in_rank.size(0)
    num_topk = 0 if topk_weights is None else topk_weights.size(1)
    return x.new_empty((num_tokens, x.size(1))), x.new_empty((num_tokens, num_topk), dtype=torch.float32)


# -- low-latency dispatch and combine ----------------------------------------------------------------------

@torch.library.custom_op("tokenyard::low_latency_dispatch",
                         mutates_args=("cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats"))
def _low_latency_dispatch(buffer_id: int, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                          num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor],
                          dispatch_wait_recv_cost_stats: Optional[Tensor], use_fp8: bool, round_scale: bool,
                          use_ue8m0: bool, use_nvfp4: bool,
                          x_global_scale: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns packed_recv_x, its scales ([0] without FP8 or NVFP4), packed_recv_count and the handle's two
    tensors."""
    recv_x, count, handle, _, _ = _buffer(buffer_id).low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        use_nvfp4=use_nvfp4, x_global_scale=x_global_scale)
    recv_x, scales = recv_x if use_fp8 or use_nvfp4 else (recv_x, x.new_empty(0, dtype=torch.float32))
    outputs = _unaliased((recv_x, scales, count, handle[0], handle[1]),
                         (x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
    _remember(handle, outputs[3])
    return outputs


def _low_latency_shapes(buffer_id, x, num_max, num_experts):
    num_ranks = _buffer(buffer_id).group_size
    return num_experts // num_ranks, num_ranks * num_max, num_ranks, x.size(1)


@_low_latency_dispatch.register_fake
def _(buffer_id, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
      dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, use_nvfp4, x_global_scale):
    num_local_experts, num_slots, num_ranks, hidden = _low_latency_shapes(buffer_id, x, num_max_dispatch_tokens_per_rank,
                                                                          num_experts)
    handle_parts = (x.new_empty(num_local_experts, dtype=torch.int32),
                    x.new_empty((num_local_experts, num_slots), dtype=torch.int32),
                    x.new_empty((num_local_experts, num_ranks), dtype=torch.int64))
    if use_nvfp4:  # DeepEP's permuted views of expert-major tensors (NOTE [nvfp4] in semantics/quant.py)
        data = x.new_empty((num_local_experts, num_slots, hidden // 2), dtype=torch.uint8)
        scales = x.new_empty((num_local_experts, -(-num_slots // 128), hidden // 64, 32, 4, 4),
                             dtype=torch.float8_e4m3fn)
        return (data.permute(1, 2, 0), scales.permute(3, 4, 1, 5, 2, 0)) + handle_parts
    if use_fp8:  # column-major in the last two axes, as the backends lay them out
        groups, dtype = (hidden // 512, torch.int32) if use_ue8m0 else (hidden // 128, torch.float32)
        scales = x.new_empty((num_local_experts, groups, num_slots), dtype=dtype).transpose(1, 2)
    else:
        scales = x.new_empty(0, dtype=torch.float32)
    data = x.new_empty((num_local_experts, num_slots, hidden), dtype=torch.float8_e4m3fn if use_fp8 else x.dtype)
    return (data, scales) + handle_parts


@torch.library.custom_op("tokenyard::low_latency_combine", mutates_args=("combine_wait_recv_cost_stats",))
def _low_latency_combine(buffer_id: int, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, src_info: Tensor,
                         layout_range: Tensor, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                         zero_copy: bool, combine_wait_recv_cost_stats: Optional[Tensor]) -> Tensor:
    fields = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    handle = LowLatencyHandle(*fields, **_handle_attributes.get(id(src_info), {}))
    combined = _buffer(buffer_id).low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy=zero_copy,
                                                      combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)[0]
    return _unaliased((combined,), (x, topk_idx, topk_weights, src_info, layout_range,
                                    combine_wait_recv_cost_stats))[0]


@_low_latency_combine.register_fake
def _(buffer_id, x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
      num_experts, zero_copy, combine_wait_recv_cost_stats):
    return x.new_empty((topk_idx.size(0), hidden), dtype=torch.bfloat16)


# -- what Buffer calls while tracing ------------------------------------------------------------------------

def get_dispatch_layout(buffer, topk_idx: Tensor, num_experts: int):
    per_rank, per_expert, in_rank = torch.ops.tokenyard.get_dispatch_layout(buffer._id, topk_idx, num_experts)
    return per_rank, None, per_expert, in_rank, EventOverlap(None)


def dispatch(buffer, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
             topk_weights, expert_alignment: int, num_worst_tokens: int):
    data, scales = (x, None) if isinstance(x, torch.Tensor) else (x[0], x[1])
    if handle is not None:
        recv_x, recv_scales = torch.ops.tokenyard.cached_dispatch(buffer._id, data, scales, *handle)
        return (recv_x if scales is None else (recv_x, recv_scales)), None, None, None, None, EventOverlap(None)
    (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, rank_prefix, channel_prefix,
     recv_channel_prefix, recv_src_idx, send_head) = torch.ops.tokenyard.dispatch(
        buffer._id, data, scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
        topk_weights, expert_alignment, num_worst_tokens)
    new_handle = (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank, send_head)
    if topk_idx is None:
        recv_topk_idx = recv_topk_weights = None
    per_expert_list = [] if num_worst_tokens else per_expert.tolist()
    return ((recv_x if scales is None else (recv_x, recv_scales)), recv_topk_idx, recv_topk_weights, per_expert_list,
            new_handle, EventOverlap(None))


def low_latency_dispatch(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8: bool,
                         round_scale: bool, use_ue8m0: bool, use_nvfp4: bool, x_global_scale,
                         return_recv_hook: bool = False):
    recv_x, scales, count, src_info, layout_range = torch.ops.tokenyard.low_latency_dispatch(
        buffer._id, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, use_nvfp4, x_global_scale)
    handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
    return ((recv_x, scales) if use_fp8 or use_nvfp4 else recv_x, count, handle, EventOverlap(None),
            _no_hook if return_recv_hook else None)


def low_latency_combine(buffer, x, topk_idx, topk_weights, handle, zero_copy: bool, out,
                        combine_wait_recv_cost_stats, return_recv_hook: bool = False):
    if zero_copy:  # what the combine reads, named as its input so that the trace orders the caller's writes first
        x = buffer.get_next_low_latency_combine_buffer(handle)
    combined = torch.ops.tokenyard.low_latency_combine(buffer._id, x, topk_idx, topk_weights, handle[0], handle[1],
                                                       handle[2], handle[3], handle[4], zero_copy,
                                                       combine_wait_recv_cost_stats)
    if out is not None:
        out.copy_(combined)
        combined = out
    return combined, EventOverlap(None), _no_hook if return_recv_hook else None


def _no_hook() -> None:
    """The hook a traced call returns for `return_recv_hook`: the op received already."""


def combine(buffer, x: Tensor, handle, topk_weights: Optional[Tensor], bias):
    bias_0, bias_1 = buffer._unpack_bias(bias)
    combined_x, combined_weights = torch.ops.tokenyard.combine(buffer._id, x, *handle, topk_weights, bias_0, bias_1)
    return combined_x, (None if topk_weights is None else combined_weights), EventOverlap(None)
