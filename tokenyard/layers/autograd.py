"""Differentiable normal-mode dispatch and combine, for training an expert-parallel MoE layer.

Dispatch and combine move the same rows in opposite directions (docs/semantics.md), so each is the
other's backward:

- the backward of ``dispatch`` is a ``combine`` with the same handle: the gradient of ``recv_x`` goes
  back to the token and is summed over the ranks the token went to, and the gradient of
  ``recv_topk_weights`` comes back as the combined weights;
- the backward of ``combine`` is a cached ``dispatch`` (``buffer.dispatch(grad, handle=handle)``): every
  row that was summed into a token receives that token's gradient.

Both work on any `Buffer`, whatever its backend, through its public calls only. The same holds for
`ElasticBuffer`'s expanded layout (`expanded_dispatch`, `expanded_combine`): the backward of an expanded
dispatch is an expanded combine of the rows' gradients, and the backward of an expanded combine is a
cached expanded dispatch of the output's gradient.

NOTE [combine wire dtype]
`Buffer.combine` takes bf16 rows (DeepEP's combine format). A float32 tensor given to `combine` here, and
the float32 gradient of a float32 `dispatch` input, is therefore rounded to bf16 before it travels, summed
in float32 on arrival, rounded to bf16 again (the combine's output) and returned as float32. Float32
models thus see bf16 rounding (relative error up to about 2**-8) in the combined output and in the
gradient of the dispatched input, and nowhere else: dispatch carries float32 rows unchanged, and top-k
weights and their gradients travel as float32 both ways.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from ..backends.rows import byte_rows
from ..buffer import Buffer
from ..elastic import ElasticBuffer
from ..errors import InvalidInputError

_WIRE_DTYPE = torch.bfloat16
_ROW_ALIGN_BYTES = 16  # dispatch rows must be a multiple of 16 bytes


def _combine_rows(buffer: Buffer, rows: Optional[torch.Tensor], handle, weight_rows: Optional[torch.Tensor],
                  num_rows: int, out_dtype: torch.dtype):
    """``Buffer.combine`` of `rows` (any float dtype, NOTE [combine wire dtype]) and float32 `weight_rows`.

    Either may be None: without `rows`, a zero bf16 column block of 16 bytes rides along (combine always
    carries some x), and the returned x is None.
    """
    if rows is None:
        wire = torch.zeros(num_rows, _ROW_ALIGN_BYTES // 2, dtype=_WIRE_DTYPE, device=buffer.device)
    else:
        wire = rows.to(_WIRE_DTYPE).contiguous()
    combined_x, combined_w, _ = buffer.combine(wire, handle, topk_weights=weight_rows)
    return (None if rows is None else combined_x.to(out_dtype)), combined_w


def _dispatch_cached(buffer: Buffer, handle, tensors: Sequence[torch.Tensor], num_rows: int) -> List[torch.Tensor]:
    """Cached dispatch of several ``[T, *]`` tensors in one call; returns each with `num_rows` rows.

    The tensors are packed side by side as bytes (padded to 16 bytes per row), sent once, and unpacked;
    one tensor whose rows are already a multiple of 16 bytes is sent as it is. Rows past the received
    count (``num_worst_tokens`` padding) are zero.
    """
    tensors = [t.contiguous() for t in tensors]
    widths = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
    if len(tensors) == 1 and tensors[0].dim() == 2 and widths[0] % _ROW_ALIGN_BYTES == 0:
        received = [buffer.dispatch(tensors[0], handle=handle)[0]]
    else:
        num_tokens = tensors[0].size(0)
        columns = [byte_rows(t) for t in tensors]
        pad = -sum(widths) % _ROW_ALIGN_BYTES
        if pad:
            columns.append(torch.zeros(num_tokens, pad, dtype=torch.uint8, device=tensors[0].device))
        packed = buffer.dispatch(torch.cat(columns, dim=1), handle=handle)[0]
        received, begin = [], 0
        for t, width in zip(tensors, widths):
            column = packed[:, begin:begin + width].contiguous()
            received.append(column.view(t.dtype).view((packed.size(0),) + tuple(t.shape[1:])))
            begin += width
    out = []
    for r in received:
        if r.size(0) < num_rows:
            r = torch.cat([r, r.new_zeros((num_rows - r.size(0),) + tuple(r.shape[1:]))])
        out.append(r)
    return out


class DispatchFunction(torch.autograd.Function):
    """`Buffer.dispatch` as an autograd node; its backward is a combine with the same handle.

    ``apply(x, topk_weights, buffer, topk_idx, layout, state)`` returns ``(recv_x, recv_topk_weights)``
    and writes ``recv_topk_idx``, ``num_recv_tokens_per_expert_list`` and ``handle`` into the dict
    `state`. Use `dispatch` below rather than this class.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, layout, state):
        recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
        state.update(recv_topk_idx=recv_topk_idx, num_recv_tokens_per_expert_list=per_expert, handle=handle)
        ctx.buffer, ctx.handle, ctx.x_dtype = buffer, handle, x.dtype
        ctx.save_for_backward(recv_topk_idx)
        if recv_topk_weights is None:
            return recv_x, None
        return recv_x, recv_topk_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_topk_weights):
        # Output gradients are materialized (zeros where unused), so every rank makes the same calls.
        need_x, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        (recv_topk_idx,) = ctx.saved_tensors
        if not (need_x or need_weights):
            return None, None, None, None, None, None
        weight_rows = None
        if need_weights:
            # A received weight of another rank's expert was set to 0 by the dispatch: it has no gradient.
            weight_rows = grad_recv_topk_weights.float().masked_fill(recv_topk_idx < 0, 0.0).contiguous()
        grad_x, grad_weights = _combine_rows(ctx.buffer, grad_recv_x if need_x else None, ctx.handle, weight_rows,
                                             recv_topk_idx.size(0), ctx.x_dtype)
        return grad_x, grad_weights, None, None, None, None


class CombineFunction(torch.autograd.Function):
    """`Buffer.combine` as an autograd node; its backward is a cached dispatch with the same handle.

    ``apply(x, topk_weights, buffer, handle)`` returns ``(combined_x, combined_topk_weights)``. Use
    `combine` below rather than this class.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, handle):
        ctx.buffer, ctx.handle, ctx.num_rows = buffer, handle, x.size(0)
        return _combine_rows(buffer, x, handle, topk_weights, x.size(0), x.dtype)

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_topk_weights):
        need_x, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wanted = []
        if need_x:
            wanted.append(grad_combined_x.contiguous())
        if need_weights:
            wanted.append(grad_combined_topk_weights.float().contiguous())
        if not wanted:
            return None, None, None, None
        received = iter(_dispatch_cached(ctx.buffer, ctx.handle, wanted, ctx.num_rows))
        grad_x = next(received) if need_x else None
        grad_weights = next(received) if need_weights else None
        return grad_x, grad_weights, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
             num_experts: int, *, expert_alignment: int = 1, num_worst_tokens: int = 0):
    """Differentiable `Buffer.get_dispatch_layout` + `Buffer.dispatch`.

    Naive equivalent: rank r receives ``cat([x_s[is_token_in_rank_s[:, r]] for s in ranks])`` with their
    top-k ids made local (-1 for other ranks' experts) and those entries' weights set to 0.

    Gradients: ``x.grad[t] = sum over ranks q the token reached of recv_x.grad_q[row of t]`` (a combine,
    NOTE [combine wire dtype] for float32), and ``topk_weights.grad[t, k]`` is the gradient of that weight
    on the rank owning expert ``topk_idx[t, k]`` (0 where it is -1). Every rank must run the backward of
    every dispatch (they are collectives), as every rank ran its forward.

    Arguments:
        buffer: a `Buffer` of any backend, sized for rows of ``H * max(x.element_size(), 2)`` bytes.
        x: ``[T, H]`` bf16 or float32 (any dtype whose rows are a multiple of 16 bytes travels; only
            floating dtypes carry gradients).
        topk_idx: ``[T, K]`` int64 global expert ids, -1 for none.
        topk_weights: ``[T, K]`` float32, or None.
        num_experts: E, divisible by the group size.
        expert_alignment, num_worst_tokens: as in `Buffer.dispatch`.
    Returns:
        ``recv_x [N, H]`` (x's dtype), ``recv_topk_idx [N, K]`` (local ids), ``recv_topk_weights [N, K]``
        float32 (or None), ``num_recv_tokens_per_expert_list``, ``handle``.
    Raises:
        InvalidInputError, CapacityError: as `Buffer.dispatch`, before any communication.
    """
    if not isinstance(buffer, Buffer):
        raise InvalidInputError(f"buffer must be a tokenyard.Buffer, got {type(buffer).__name__}")
    x = x.contiguous()
    topk_weights = None if topk_weights is None else topk_weights.contiguous()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    state = {}
    recv_x, recv_topk_weights = DispatchFunction.apply(x, topk_weights, buffer, topk_idx, layout, state)
    return (recv_x, state["recv_topk_idx"], recv_topk_weights, state["num_recv_tokens_per_expert_list"],
            state["handle"])


def combine(buffer: Buffer, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None):
    """Differentiable `Buffer.combine`.

    Naive equivalent: ``out_s[t] = sum(x_r[send_head_s[t, r]] for r with the token)``, summed in float32
    in increasing r; ``combined_topk_weights`` sums `topk_weights` the same way.

    Gradients: ``x.grad`` is the cached dispatch of ``out.grad`` (each row receives its token's
    gradient; padding rows of a ``num_worst_tokens`` dispatch receive 0), and likewise for
    `topk_weights`. Every rank must run the backward, as every rank ran the forward.

    Arguments:
        buffer: the `Buffer` that made `handle`.
        x: ``[N, H]`` bf16 or float32, one row per received row; float32 travels as bf16
            (NOTE [combine wire dtype]) and comes back as float32.
        handle: the dispatch's handle.
        topk_weights: ``[N, K]`` float32, or None.
    Returns:
        ``combined_x [T, H]`` (x's dtype), ``combined_topk_weights [T, K]`` float32 or None.
    Raises:
        InvalidInputError, HandleError, CapacityError: as `Buffer.combine`, before any communication.
    """
    if not isinstance(buffer, Buffer):
        raise InvalidInputError(f"buffer must be a tokenyard.Buffer, got {type(buffer).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise InvalidInputError(f"x must be bf16 or float32, got {x.dtype}")
    topk_weights = None if topk_weights is None else topk_weights.contiguous()
    return CombineFunction.apply(x.contiguous(), topk_weights, buffer, handle)


# -- DeepEP V2's expanded layout ------------------------------------------------------------------------------

def _check_expanded(buffer, x: torch.Tensor, what: str) -> None:
    """An expanded `what` runs on an ElasticBuffer and carries bf16 rows (V2's format for rows with gradients)."""
    if not isinstance(buffer, ElasticBuffer):
        raise InvalidInputError(f"buffer must be a tokenyard.ElasticBuffer, got {type(buffer).__name__}")
    if x.dtype != _WIRE_DTYPE:
        raise InvalidInputError(f"an expanded {what} carries bf16 rows, got {x.dtype}")


class ExpandedDispatchFunction(torch.autograd.Function):
    """`ElasticBuffer.dispatch(..., do_expand=True)` as an autograd node; its backward is an expanded combine.

    ``apply(x, topk_weights, buffer, topk_idx, options, state)`` returns ``(recv_x, recv_topk_weights)`` and
    writes the ``handle`` into the dict `state`. Use `expanded_dispatch` below rather than this class.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, options, state):
        recv_x, _, recv_topk_weights, handle, event = buffer.dispatch(x, topk_idx, topk_weights, do_expand=True,
                                                                      do_handle_copy=False, **options)
        state.update(handle=handle, event=event)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, options["num_sms"]
        return recv_x, recv_topk_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_topk_weights):
        need_x, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_weights):
            return None, None, None, None, None, None
        weights = grad_recv_topk_weights.float().contiguous() if need_weights else None
        grad_x, grad_weights, _ = ctx.buffer.combine(grad_recv_x.to(_WIRE_DTYPE).contiguous(), ctx.handle,
                                                     topk_weights=weights, num_sms=ctx.num_sms)
        return (grad_x if need_x else None), grad_weights, None, None, None, None


class ExpandedCombineFunction(torch.autograd.Function):
    """`ElasticBuffer.combine` of expanded rows as an autograd node; its backward is a cached expanded dispatch.

    ``apply(x, topk_weights, buffer, handle, options, state)`` returns ``(combined_x, combined_topk_weights)``
    and writes the call's ``event`` into the dict `state`. Use `expanded_combine` below rather than this class.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, handle, options, state):
        zero_padding = options.pop("do_zero_padding")
        ctx.buffer, ctx.handle, ctx.num_sms, ctx.zero_padding = buffer, handle, options["num_sms"], zero_padding
        combined_x, combined_topk_weights, state["event"] = buffer.combine(x, handle, topk_weights=topk_weights,
                                                                           **options)
        return combined_x, combined_topk_weights

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_topk_weights):
        need_x, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_weights):
            return None, None, None, None, None, None
        # The dispatch always carries rows: the output's gradient (zeros where it has none) goes either way.
        weights = grad_combined_topk_weights.float().contiguous() if need_weights else None
        grad_x, _, grad_weights, _, _ = ctx.buffer.dispatch(
            grad_combined_x.to(_WIRE_DTYPE).contiguous(), topk_weights=weights, handle=ctx.handle, do_expand=True,
            do_zero_padding=ctx.zero_padding, num_sms=ctx.num_sms)
        return (grad_x if need_x else None), grad_weights, None, None, None, None


def expanded_dispatch(buffer: ElasticBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: Optional[torch.Tensor], num_experts: int, *, expert_alignment: int = 1,
                      do_cpu_sync: bool = True, do_zero_padding: bool = False, num_sms: int = 0,
                      previous_event=None, async_with_compute_stream: bool = False):
    """Differentiable `ElasticBuffer.dispatch` into the expanded layout (``do_expand=True``).

    Naive equivalent: rank r's row m holds ``x_s[t]`` for the m-th (received token, local expert) pair, the
    pairs of local expert 0 first, then expert 1's, ..., within an expert by source rank, then token
    (tokenyard/semantics/expand.py); ``recv_topk_weights[m]`` is that pair's weight.

    Gradients: ``x.grad[t]`` sums ``recv_x.grad`` over every row that holds token t, on every rank (an
    expanded combine with the same handle), and ``topk_weights.grad[t, k]`` is ``recv_topk_weights.grad`` at
    the row of pair (t, k) (0 where its expert is -1). Gradients of padding rows (between aligned groups,
    and past the pairs when the counts are not synced to the host) go nowhere. Every rank must run the
    backward, as every rank ran the forward.

    Arguments:
        buffer: an `ElasticBuffer` of any backend.
        x: ``[T, H]`` bf16 (V2's dispatch format for rows that carry gradients).
        topk_idx: ``[T, K]`` int64 global expert ids, -1 for none.
        topk_weights: ``[T, K]`` float32, or None.
        num_experts, expert_alignment, do_cpu_sync, do_zero_padding, num_sms, previous_event,
            async_with_compute_stream: as in `ElasticBuffer.dispatch`; the backward runs on the handle's SMs
            (or `num_sms`) and keeps the padding as the forward did.
    Returns:
        ``recv_x [M, H]`` bf16, ``recv_topk_weights [M]`` float32 (or None), the `EPHandle` (its
        ``psum_num_recv_tokens_per_expert``, on the device, ends each expert's rows), and the dispatch's
        `EventOverlap` (wait for it before using the outputs when `async_with_compute_stream`).
    Raises:
        InvalidInputError, CapacityError: as `ElasticBuffer.dispatch`, before any communication.
    """
    _check_expanded(buffer, x, "dispatch")
    topk_weights = None if topk_weights is None else topk_weights.contiguous()
    options = dict(num_experts=num_experts, expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync,
                   do_zero_padding=do_zero_padding, num_sms=num_sms, previous_event=previous_event,
                   async_with_compute_stream=async_with_compute_stream)
    state = {}
    recv_x, recv_topk_weights = ExpandedDispatchFunction.apply(x.contiguous(), topk_weights, buffer, topk_idx,
                                                               options, state)
    return recv_x, recv_topk_weights, state["handle"], state["event"]


def expanded_combine(buffer: ElasticBuffer, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                     *, do_zero_padding: bool = False, num_sms: int = 0, previous_event=None,
                     async_with_compute_stream: bool = False):
    """Differentiable `ElasticBuffer.combine` of expanded rows.

    Naive equivalent: ``out_s[t]`` sums, in float32, the rows of token t on each rank (in slot order, rounded
    to bf16), then over the ranks in increasing order; ``combined_topk_weights[t, k]`` is the weight row of
    pair (t, k) on the rank owning its expert.

    Gradients: ``x.grad`` is the cached expanded dispatch of ``out.grad`` (each row receives its token's
    gradient), and likewise for `topk_weights`. Every rank must run the backward.

    Arguments:
        buffer: the `ElasticBuffer` that made `handle`.
        x: ``[M, H]`` bf16, one row per expanded row.
        handle: the expanded dispatch's `EPHandle`.
        topk_weights: ``[M]`` float32, or None.
        do_zero_padding: the backward's dispatch zeroes the padding rows (give the forward dispatch's).
        num_sms, previous_event, async_with_compute_stream: as in `ElasticBuffer.combine`.
    Returns:
        ``combined_x [T, H]`` bf16, ``combined_topk_weights [T, K]`` float32 or None, the `EventOverlap`.
    Raises:
        InvalidInputError, HandleError, CapacityError: as `ElasticBuffer.combine`, before any communication.
    """
    _check_expanded(buffer, x, "combine")
    if not getattr(handle, "do_expand", False):
        raise InvalidInputError("expanded_combine needs the handle of an expanded dispatch")
    topk_weights = None if topk_weights is None else topk_weights.contiguous()
    options = dict(do_zero_padding=do_zero_padding, num_sms=num_sms, previous_event=previous_event,
                   async_with_compute_stream=async_with_compute_stream)
    state = {}
    combined_x, combined_topk_weights = ExpandedCombineFunction.apply(x.contiguous(), topk_weights, buffer, handle,
                                                                      options, state)
    return combined_x, combined_topk_weights, state["event"]
