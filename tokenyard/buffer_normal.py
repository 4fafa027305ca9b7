"""The normal-mode half of `Buffer`'s API (DeepEP's layout, dispatch and combine), as a mixin `Buffer` inherits.

Kept apart from buffer.py only for size; it uses the `Buffer`'s checks, streams and backend, as
buffer_low_latency.py does.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import checks, ops, rounds
from .backends import internode
from .backends.requests import CombineRequest, DispatchRequest, Expansion, LayoutCheck
from .config import Config
from .errors import HandleError, InvalidInputError
from .event import EventOverlap
from .handle import DispatchHandle, InternodeHandle
from .plan import devices, workspace
from .semantics import routing

XLike = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class NormalCalls:
    """`get_dispatch_layout`, `dispatch` and `combine`, with the round planning they share."""

    def normal_round_plan(self, num_tokens: int, hidden: int, num_topk: int = 0, dtype: torch.dtype = torch.bfloat16,
                          num_scales: Optional[int] = None) -> rounds.NormalRoundPlan:
        """The bytes this Buffer holds, the bytes dispatch and combine of a problem need in one round, and the
        rounds they run in (NOTE [rounds]); computes only.

        Arguments:
            num_tokens: tokens of the largest rank. hidden, num_topk: the problem's hidden size and top-k.
            dtype: of the dispatched data (bf16, or FP8 e4m3 / int8 with float32 scales).
            num_scales: scales per token (default hidden / 128 for 1-byte dtypes, else none).
        """
        element_size = dtype.itemsize
        if num_scales is None:
            num_scales = hidden // 128 if element_size == 1 else 0
        dispatch_row = workspace.normal_dispatch_row_bytes(hidden * element_size, num_scales * 4, num_topk)
        return rounds.round_plan(self.nvl_bytes_held, self.group_size, num_tokens, dispatch_row,
                                 workspace.normal_combine_row_bytes(hidden, num_topk), self.per_round_tokens)

    def _round_tokens(self, num_tokens: int, row_bytes: int, what: str, paired_row_bytes: Optional[int] = None):
        return checks.normal_round_tokens(num_ranks=self.group_size, num_tokens=num_tokens, row_bytes=row_bytes,
                                          num_nvl_bytes=self.nvl_bytes_held, per_round_tokens=self.per_round_tokens,
                                          what=what, paired_row_bytes=paired_row_bytes)

    @staticmethod
    def _unpack_bias(bias):
        if bias is None:
            return None, None
        if isinstance(bias, torch.Tensor):
            return bias, None
        if isinstance(bias, (tuple, list)) and len(bias) == 2:
            return bias[0], bias[1]
        raise InvalidInputError("bias must be a tensor or a tuple of two tensors")

    def _agrees_on_normal_calls(self, backend) -> bool:
        """NOTE [call agreement]: whether normal-mode calls agree first: where the backend's collectives need it, and
        on several nodes, whose internode kernels size rows from each rank's own call."""
        return backend.wants_call_agreement(False) or self._internode

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Which ranks and experts each token goes to.

        Naive equivalent: ``is_token_in_rank[t, r] = any(topk_idx[t] // (E // R) == r)``.

        Arguments:
            topk_idx: ``[T, K]`` int64 (or int32) global expert ids, -1 for none.
            num_experts: total experts E, divisible by the group size R.
        Returns:
            ``num_tokens_per_rank`` int32 [R], ``num_tokens_per_rdma_rank`` (int32 [N]: tokens with an expert on
            each of N > 1 nodes; None on one node),
            ``num_tokens_per_expert`` int32 [E], ``is_token_in_rank`` bool [T, R], event.
        Raises:
            InvalidInputError: bad dtype/shape/device, E not divisible by R; ids outside [-1, E) only with
                `check_inputs` (a host sync). By default this call reads no id on the host, so it raises nothing
                for them: it counts such an id nowhere (as -1), and the next fresh dispatch on this Buffer is
                refused on every rank, naming this rank, with no row moved (NOTE [input verdict] in checks.py;
                a dispatch given `topk_idx` judges the ids it is given instead).
        """
        if torch.compiler.is_compiling():  # NOTE [custom ops] in ops.py
            self._refuse_internode_compile("get_dispatch_layout")
            return ops.get_dispatch_layout(self, topk_idx, num_experts)
        fast = self._fast if not self._internode else None  # NOTE [internode normal mode]
        if fast is not None and not allocate_on_comm_stream and not self.check_inputs:  # NOTE [fast paths]
            result = self._fast.layout(topk_idx, num_experts, previous_event, async_finish)
            if result is not None:
                return result
        result = self._get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                           allocate_on_comm_stream)
        if fast is not None and not allocate_on_comm_stream and not self.check_inputs and \
                topk_idx.device == self.device:
            self._fast.learn_layout(topk_idx, num_experts, async_finish)
        return result

    @devices.runs_where_tensors_are("topk_idx")
    def _get_dispatch_layout(self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
        backend = self._normal_backend()
        num_experts = checks.num_experts(num_experts, self.group_size)
        checks.topk_idx(topk_idx, num_tokens=None, device=self.device)
        if self._check_values(previous_event):
            checks.topk_values(topk_idx, num_experts)
        with self._stream_scope(use_comm_stream=True, previous_event=previous_event, async_finish=async_finish,
                                allocate_on_comm_stream=allocate_on_comm_stream) as scope:
            per_rank, per_expert, in_rank = backend.get_dispatch_layout(topk_idx, num_experts)
            per_rdma_rank = None  # one node: one NVLink domain
            if self._internode:
                per_node = routing.tokens_per_node(in_rank, self.topology.ranks_per_node)
                per_rdma_rank = per_node.sum(0, dtype=torch.int32)
        self._hand_over(scope.owner, (per_rank, per_rdma_rank, per_expert, in_rank))
        return per_rank, per_rdma_rank, per_expert, in_rank, scope.event

    def dispatch(self, x: XLike, handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts.

        Naive equivalent: rank r receives ``cat([x_s[is_token_in_rank_s[:, r]] for s in ranks])``.

        Arguments:
            x: ``[T, H]`` tensor (bf16, or any dtype whose rows are a multiple of 16 bytes), or a tuple
                ``(data [T, H], scales [T, S] or [T] float32/int32)`` such as FP8 e4m3 or INT8 with per-128
                scales (scales may have any strides; [T] scales are received as [N]).
            handle: a previous dispatch's handle: reuse its layout (no count exchange, no CPU wait); then
                the layout arguments and top-k must be None.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from `get_dispatch_layout`.
            num_tokens_per_rdma_rank: accepted and ignored (derived from is_token_in_rank on several nodes).
            topk_idx, topk_weights: ``[T, K]`` global expert ids (int64) and float32 weights, or None.
            expert_alignment: round each local expert's count up to this multiple.
            num_worst_tokens: if > 0, outputs have exactly this many rows (padding rows have
                ``recv_topk_idx == -1``), the per-expert list is empty and the CPU does not wait; in rounds,
                their number is fixed by num_worst_tokens / group size tokens per rank (NOTE [rounds]).
                Ignored with a handle, whose rows the cached dispatch fills (as in DeepEP).
            config: performance settings (default `get_dispatch_config`).
        Returns:
            ``recv_x`` (tuple like `x`), ``recv_topk_idx`` (local ids, -1 elsewhere), ``recv_topk_weights``
            (0 where -1), ``num_recv_tokens_per_expert_list``, ``handle`` (a `DispatchHandle`; an
            `InternodeHandle` on several nodes), event.
            With a cached handle the middle four are None. More tokens than one round of `num_nvl_bytes`
            holds run in rounds with the same results (NOTE [rounds] in rounds.py).
        Raises:
            InvalidInputError, HandleError, CapacityError (not one row fits, or `per_round_tokens` is above
            what fits): before any communication. BackendUnavailableError: ``backend="cuda"`` on several nodes
            (NOTE [internode normal mode]).
        """
        if torch.compiler.is_compiling():  # NOTE [custom ops] in ops.py
            self._refuse_internode_compile("dispatch")
            return ops.dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                topk_weights, expert_alignment, num_worst_tokens)
        return self._dispatch_call(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                   topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                                   async_finish, allocate_on_comm_stream)

    def _dispatch_call(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                       topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                       allocate_on_comm_stream, all_topk_weights: bool = False):
        """`dispatch` through its fast paths where they apply (NOTE [fast paths]), else the full checks;
        `all_topk_weights`: every slot's weight arrives (ElasticBuffer's), not only the local slots'."""
        fast = self._fast if not (allocate_on_comm_stream or self._internode) else None  # NOTE [fast paths]
        cached = handle is not None and topk_idx is None and topk_weights is None
        if fast is not None and cached:
            result = fast.cached_dispatch(x, handle, config, previous_event, async_finish)
            if result is not None:
                return result
        unchecked_fresh = fast is not None and handle is None and not self.check_inputs
        worst, fresh = unchecked_fresh and num_worst_tokens, unchecked_fresh and not num_worst_tokens
        layout = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
        if worst:
            result = fast.worst_dispatch(x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                         config, previous_event, async_finish, all_topk_weights)
            if result is not None:
                return result
        if fresh:
            result = self._fast_fresh_dispatch(fast, x, layout, topk_idx, topk_weights, expert_alignment, config,
                                               previous_event, async_finish, all_topk_weights)
            if result is not None:
                return result
        result = self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                                allocate_on_comm_stream, all_topk_weights)
        if worst and self._last_rounds == 1 and self._learnable_x(x):
            fast.learn_worst_dispatch(x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                      async_finish, self._learnable_shape, result[4].rounds, all_topk_weights)
        if fast is not None and cached and self._last_rounds == 1 and getattr(handle, "fast_for", None) == self._id and \
                self._learnable_x(x):
            fast.learn_cached_dispatch(x, handle, config, async_finish, self._learnable_shape, self._last_round_tokens)
        if fresh and self._last_rounds == 1 and topk_idx is not None and self._learnable_x(x):
            fast.learn_fresh_dispatch(x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish,
                                      all_topk_weights, self._learnable_shape, self._last_round_tokens)
        return result

    def _fast_fresh_dispatch(self, fast, x, layout, topk_idx, topk_weights, expert_alignment, config, previous_event,
                             async_finish: bool, all_topk_weights: bool):
        """NOTE [fresh calls] (csrc/call_plan.cpp): a fresh dispatch without num_worst_tokens whose shape the full
        path recorded runs round 0 as that path does (rounds.first_round: the same plans and inputs, so ranks on
        either path communicate alike), its count exchange and transfer by `FastPaths.fresh_dispatch`, with no
        argument checks; where another rank's call takes more rounds, they follow as the full path sends them.
        -> `dispatch`'s outputs, or None (the full path runs)."""
        entry = fast.fresh_entry(x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish,
                                 all_topk_weights)
        if entry is None or torch.cuda.is_current_stream_capturing():  # NOTE [graph capture]: the full path refuses
            return None
        round_tokens = entry[2]
        data, scales = x if isinstance(x, tuple) else (x, None)
        per_rank, in_rank, per_expert = layout
        request = DispatchRequest(x=data, x_scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,
                                  num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert, handle=None, expert_alignment=expert_alignment,
                                  num_worst_tokens=0,
                                  config=config if config is not None else self.get_dispatch_config(self.group_size),
                                  all_topk_weights=all_topk_weights,
                                  check=LayoutCheck(topk_idx, per_rank, in_rank, per_expert))
        round_0, call, placement = rounds.first_round(request, round_tokens)
        first = fast.fresh_dispatch(entry, round_0, previous_event, async_finish)
        if first is None:
            return None
        if first.most_call_tokens <= round_tokens:  # one round holds every rank's call
            result, plan = rounds.after_first_round(self._normal_backend(), request, first, call, placement,
                                                    round_tokens, self._exchange, False)
            event = fast.event(async_finish)
        else:
            with self._stream_scope(use_comm_stream=True, previous_event=previous_event,
                                    async_finish=async_finish) as scope:
                result, plan = rounds.after_first_round(self._normal_backend(), request, first, call, placement,
                                                        round_tokens, self._exchange, False)
            event = scope.event
            self._hand_over(scope.owner, (result.recv_x, result.recv_x_scales, result.recv_topk_idx,
                                          result.recv_topk_weights) + tuple(result.handle))
        new_handle = self._fresh_handle(result, plan, 0)
        recv_x = result.recv_x if scales is None else (result.recv_x, result.recv_x_scales)
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                new_handle, event)

    def _fresh_handle(self, result, plan, num_worst_tokens: int) -> DispatchHandle:
        """A fresh one-node dispatch's handle: the backend's fields, this Buffer's, the rounds."""
        rows = result.recv_x if result.expanded is None else result.recv_topk_idx  # expanded: recv_x is [M, H]
        return DispatchHandle.of(result.handle, dict(
            buffer_id=self._id, rounds=plan, num_recv_tokens=None if num_worst_tokens else rows.size(0),
            fast_for=self._id if plan.num_rounds == 1 else None))

    def _learnable_x(self, x) -> bool:
        """A dispatch `x` whose call a fast path may record (NOTE [fast paths]): a tensor or a pair with 2-D
        scales, on this Buffer's device."""
        if isinstance(x, tuple):
            return len(x) == 2 and x[1].dim() == 2 and x[0].device == self.device
        return isinstance(x, torch.Tensor) and x.device == self.device

    @staticmethod
    def _dispatch_row_bytes(data: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int,
                            source_ranks: bool = False) -> int:
        """A dispatch row's bytes in the buffer, for `data` and `scales` as checks.dispatch_x gives them
        (`source_ranks`: a fresh expanded dispatch's tail, which carries each slot's source rank)."""
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()
        return workspace.normal_dispatch_row_bytes(data.size(1) * data.element_size(), scale_bytes, num_topk,
                                                   source_ranks)

    def _kernel_expands(self, x: XLike, num_sms: int, fresh: bool):
        """Where the dispatch kernel may take an expanded dispatch (`fresh`, else cached) of `x` on `num_sms` SMs (one
        node, `x` on this Buffer's device: NOTE [device rule], a CPU twin makes the layout after its pass; the
        backend's threshold): `x`'s data and scales as checks.dispatch_x gives them; else None."""
        first = x[0] if isinstance(x, tuple) and x else x
        if self._internode or not isinstance(first, torch.Tensor) or first.device != self.device or \
                not self._normal_backend().expands_in_dispatch(num_sms, fresh):
            return None
        data, scales, _ = checks.dispatch_x(x, device=self.device)
        return data, scales

    def _expands_in_kernel(self, handle, x: XLike, num_topk: int, num_sms: int) -> bool:
        """Whether ElasticBuffer's cached expanded dispatch of `x` (top-k `num_topk`) with the V1 `handle` on
        `num_sms` SMs runs in the dispatch kernel (NOTE [expanded rows] in kernels/dispatch.cuh): on one node, in the
        one round the handle's dispatch ran in, where the backend's kernel takes it; else the rows are gathered after a
        dispatch."""
        checked = self._kernel_expands(x, num_sms, fresh=False)
        if checked is None:
            return False
        data, scales = checked
        row_bytes = self._dispatch_row_bytes(data, scales, num_topk)
        stored = getattr(handle, "rounds", None)
        return stored is not None and stored.num_rounds == 1 and \
            stored.fits(self._round_tokens(data.size(0), row_bytes, "dispatch"))

    def _expands_fresh_in_kernel(self, x: XLike, num_topk: int, num_max_tokens: int, num_sms: int) -> bool:
        """Whether ElasticBuffer's fresh expanded dispatch of `x` (top-k `num_topk`, at most `num_max_tokens` tokens on
        any rank) on `num_sms` SMs makes the expanded layout in the dispatch kernel (NOTE [expanded rows] in
        kernels/dispatch.cuh): on one node, where the backend's kernel takes it and every rank's call is one round
        (which `num_max_tokens` decides alike on every rank, before any exchange)."""
        checked = self._kernel_expands(x, num_sms, fresh=True)
        if checked is None:
            return False
        data, scales = checked
        row_bytes = self._dispatch_row_bytes(data, scales, num_topk, source_ranks=True)
        paired = workspace.normal_combine_row_bytes(data.size(1), num_topk)
        return self._round_tokens(num_max_tokens, row_bytes, "dispatch", paired) >= num_max_tokens

    @devices.runs_where_tensors_are("x")
    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                  allocate_on_comm_stream, all_topk_weights: bool = False, expansion: Optional[Expansion] = None):
        """`expansion`: a dispatch straight into the expanded layout, cached (the handle's: `_expands_in_kernel`,
        with `topk_weights` the slots' weights) or fresh (`_expands_fresh_in_kernel`, one round: the result then
        ends with the layout made, DispatchResult.expanded); its recv_x and weights are the expanded ones."""
        backend = self._normal_backend()
        x, x_scales, scales_1d = checks.dispatch_x(x, device=self.device)
        num_tokens = x.size(0)
        config = config if config is not None else self.get_dispatch_config(self.group_size)
        expert_alignment = checks.size_int("expert_alignment", expert_alignment, positive=True)
        num_worst_tokens = checks.size_int("num_worst_tokens", num_worst_tokens)
        if handle is not None:
            handle = checks.dispatch_handle(handle, num_ranks=self.group_size, device=self.device)
            handle = self._handle_for_nodes(handle)
            if topk_idx is not None or (topk_weights is not None and expansion is None):
                raise InvalidInputError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
            num_worst_tokens = 0  # as in DeepEP: the handle's rows (its num_worst_tokens, if it had one)
            if handle.num_tokens != num_tokens:
                raise InvalidInputError(f"the handle was made for {handle.num_tokens} tokens, x has {num_tokens}")
            is_token_in_rank = handle.is_token_in_rank
            num_topk = 0 if expansion is None else expansion.topk_idx.size(1)
            if topk_weights is not None:
                checks.topk_weights(topk_weights, like=expansion.topk_idx, device=self.device)
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise InvalidInputError("dispatch needs num_tokens_per_rank, is_token_in_rank and "
                                        "num_tokens_per_expert (from get_dispatch_layout), or a handle")
            checks.tensor("num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32,),
                          shape=(self.group_size,), device=self.device)
            checks.tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,),
                          shape=(num_tokens, self.group_size), device=self.device)
            checks.tensor("num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32,), dim=1,
                          device=self.device)
            num_experts = checks.num_experts(num_tokens_per_expert.size(0), self.group_size)
            if topk_weights is not None and topk_idx is None:
                raise InvalidInputError("topk_weights needs topk_idx")
            if num_worst_tokens and (topk_idx is None or topk_weights is None):
                raise InvalidInputError("num_worst_tokens needs topk_idx and topk_weights")
            num_topk = 0
            if topk_idx is not None:
                checks.topk_idx(topk_idx, num_tokens=num_tokens, device=self.device)
                num_topk = topk_idx.size(1)
                if topk_weights is not None:
                    checks.topk_weights(topk_weights, like=topk_idx, device=self.device)
            if self._check_values(previous_event):  # the debug mode's host checks (NOTE [input verdict])
                if topk_idx is not None:
                    checks.topk_values(topk_idx, num_experts)
                checks.layout_agrees(topk_idx, num_experts, num_tokens_per_rank, is_token_in_rank,
                                     num_tokens_per_expert)
        fresh_expansion = expansion is not None and expansion.fresh
        row_bytes = self._dispatch_row_bytes(x, x_scales, num_topk, fresh_expansion)
        paired_row_bytes = None if handle is not None else workspace.normal_combine_row_bytes(x.size(1), num_topk)
        round_tokens = self._round_tokens(num_tokens, row_bytes, "dispatch", paired_row_bytes)
        self._refuse_capture(backend, "dispatch", cpu_wait=handle is None and not num_worst_tokens)
        check_values = self._check_values()

        if self._agrees_on_normal_calls(backend):  # NOTE [call agreement]
            if handle is None:
                self._exchange.agree("dispatch", hidden_bytes=x.size(1) * x.element_size(),
                                     num_scales=0 if x_scales is None else x_scales.size(1), num_topk=num_topk,
                                     num_experts=num_tokens_per_expert.size(0), num_worst_tokens=num_worst_tokens,
                                     expert_alignment=expert_alignment, with_weights=int(topk_weights is not None),
                                     expanded=int(fresh_expansion))
            else:
                self._exchange.agree("cached_dispatch", hidden_bytes=x.size(1) * x.element_size(),
                                     num_scales=0 if x_scales is None else x_scales.size(1),
                                     expanded=int(expansion is not None))
        request = DispatchRequest(x=x, x_scales=x_scales, topk_idx=topk_idx, topk_weights=topk_weights,
                                  num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                                  num_tokens_per_expert=num_tokens_per_expert, handle=handle,
                                  expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                  config=config, all_topk_weights=all_topk_weights, expansion=expansion,
                                  check=None if handle is not None else LayoutCheck(
                                      topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert))
        # What the fast paths record (NOTE [fast paths]); a fresh dispatch's only without check_inputs, the one
        # setting whose fast paths take it.
        if self._fast is not None and not self._internode and expansion is None and \
                (handle is not None or not self.check_inputs):
            recorded = request if handle is not None or num_worst_tokens else \
                rounds.first_round(request, round_tokens)[0]  # a fresh dispatch's fast path runs its round 0
            self._learnable_shape = self.runtime.dispatch_shape(recorded)
        with self._stream_scope(use_comm_stream=True, previous_event=previous_event, async_finish=async_finish,
                                allocate_on_comm_stream=allocate_on_comm_stream) as scope:
            if self._internode:  # whole calls (NOTE [internode stages] in backends/internode.py)
                result = backend.internode_dispatch(request)
                plan = None
            elif fresh_expansion:  # one round on every rank (`_expands_fresh_in_kernel`), so no round 0 first
                result = backend.dispatch(request)
                most = result.most_call_tokens
                plan = rounds.Rounds(round_tokens, 1, round_tokens if most is None else min(round_tokens, most), most)
            elif handle is None:
                result, plan = rounds.dispatch(backend, request, round_tokens=round_tokens, exchange=self._exchange,
                                               check_values=check_values)
            else:
                plan = rounds.plan_for(handle, round_tokens, self._exchange)
                result = rounds.cached_dispatch(backend, request, plan)
            self._last_rounds, self._last_round_tokens = 1 if plan is None else plan.num_rounds, round_tokens
        new_handle = result.handle
        if handle is None and self._internode:
            new_handle = self._internode_handle(result, num_worst_tokens)
        elif handle is None:
            new_handle = self._fresh_handle(result, plan, num_worst_tokens)
        outputs = (result.recv_x, result.recv_x_scales, result.recv_topk_idx, result.recv_topk_weights)
        self._hand_over(scope.owner, outputs + tuple(new_handle) + tuple(getattr(new_handle, "flat", None) or ()))
        if async_finish:
            self._hand_over(self._comm_stream, (x, x_scales, topk_idx, topk_weights, is_token_in_rank))
        recv_scales = result.recv_x_scales
        if scales_1d:  # [N] scales come back as [N], as in DeepEP
            recv_scales = recv_scales.view(-1)
        recv_x = result.recv_x if x_scales is None else (result.recv_x, recv_scales)
        if handle is not None:  # expanded: the expanded rows' weights
            return recv_x, None, result.recv_topk_weights, None, None, scope.event
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                new_handle, scope.event) + ((result.expanded,) if fresh_expansion else ())

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each received row back to its source rank and sum the rows of each token there.

        Naive equivalent: ``out_s[t] = bias[t] + sum(x_r[send_head_s[t, r]] for r with the token)``.

        Arguments:
            x: ``[N, H]`` bf16, one row per row the dispatch delivered (N = the handle's row count).
            handle: the dispatch's handle.
            topk_weights: ``[N, K]`` float32 (any strides), summed the same way into ``combined_topk_weights``.
            bias: ``[T, H]`` bf16, or a tuple of two, added once per token.
        Returns:
            ``combined_x`` [T, H] bf16, ``combined_topk_weights`` [T, K] float32 or None, event.
        Raises:
            InvalidInputError, HandleError, CapacityError: before any communication. BackendUnavailableError:
            ``backend="cuda"`` on several nodes (NOTE [internode normal mode]).
        """
        if torch.compiler.is_compiling():  # NOTE [custom ops] in ops.py
            self._refuse_internode_compile("combine")
            return ops.combine(self, x, handle, topk_weights, bias)
        fast = self._fast if not (allocate_on_comm_stream or self._internode) else None  # NOTE [fast paths]
        if fast is not None:
            result = fast.combine(x, handle, topk_weights, bias, config, previous_event, async_finish)
            if result is not None:
                return result
        result = self._combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                               allocate_on_comm_stream)
        if fast is not None and self._last_rounds == 1 and getattr(handle, "fast_for", None) == self._id and \
                x.device == self.device and \
                (topk_weights is None or topk_weights.is_contiguous()) and not isinstance(bias, list):
            fast.learn_combine(x, handle, topk_weights, bias, config, async_finish, self._last_round_tokens)
        return result

    @devices.runs_where_tensors_are("x")
    def _combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream):
        backend = self._normal_backend()
        handle = self._handle_for_nodes(checks.dispatch_handle(handle, num_ranks=self.group_size, device=self.device))
        checks.tensor("x", x, dtypes=(torch.bfloat16,), shape=(handle.num_rows, None), device=self.device,
                      aligned=True)
        if topk_weights is not None:
            checks.tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(handle.num_rows, None),
                          device=self.device, contiguous=False)
        bias_0, bias_1 = self._unpack_bias(bias)
        for name, b in (("bias", bias_0), ("bias[1]", bias_1)):
            if b is not None:
                checks.tensor(name, b, dtypes=(torch.bfloat16,), shape=(handle.num_tokens, x.size(1)),
                              device=self.device, aligned=True)
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        round_tokens = self._round_tokens(handle.num_tokens, workspace.normal_combine_row_bytes(x.size(1), num_topk),
                                          "combine")
        config = config if config is not None else self.get_combine_config(self.group_size)
        self._refuse_capture(backend, "combine")
        if self._agrees_on_normal_calls(backend):  # NOTE [call agreement]
            self._exchange.agree("combine", hidden=x.size(1), num_topk=num_topk,
                                 num_biases=(bias_0 is not None) + (bias_1 is not None))
        with self._stream_scope(use_comm_stream=True, previous_event=previous_event, async_finish=async_finish,
                                allocate_on_comm_stream=allocate_on_comm_stream) as scope:
            # any strides (an autograd gradient may be expanded): copied inside the scope, after the event
            weights = None if topk_weights is None else topk_weights.contiguous()
            request = CombineRequest(x=x, handle=handle, topk_weights=weights, bias_0=bias_0, bias_1=bias_1,
                                     config=config)
            if self._internode:  # whole calls (NOTE [internode stages] in backends/internode.py)
                combined_x, combined_topk_weights = backend.internode_combine(request)
                num_rounds = 1
            else:
                plan = rounds.plan_for(handle, round_tokens, self._exchange)
                combined_x, combined_topk_weights = rounds.combine(backend, request, plan)
                num_rounds = plan.num_rounds
        self._last_rounds, self._last_round_tokens = num_rounds, round_tokens
        self._hand_over(scope.owner, (combined_x, combined_topk_weights))
        if async_finish:
            self._hand_over(self._comm_stream, (x, topk_weights, bias_0, bias_1) + tuple(handle))
        return combined_x, combined_topk_weights, scope.event

    # -- internode normal mode (NOTE [internode normal mode] in backends/__init__.py) ---------------------

    def _refuse_internode_compile(self, what: str) -> None:
        if self._internode:
            raise InvalidInputError(f"{what} on a group of {self.topology.num_nodes} nodes cannot be traced by "
                                    "torch.compile yet (its custom ops carry the one-node handle): call it eagerly")

    def _handle_for_nodes(self, handle):
        """A checked normal-mode handle as this Buffer's nodes need it: an `InternodeHandle` of as many nodes on
        several, the equivalent one-node `DispatchHandle` on one (NOTE [internode handle])."""
        if isinstance(handle, InternodeHandle):
            if not self._internode:
                return internode.flat_handle_of(handle, self._exchange)
            if handle.rdma_channel_prefix_matrix.size(0) != self.topology.num_nodes:
                raise HandleError(f"the handle was made on {handle.rdma_channel_prefix_matrix.size(0)} nodes; this "
                                  f"Buffer's group has {self.topology.num_nodes} (ranks_per_node differs)")
            return handle
        if self._internode:
            raise HandleError(f"a one-node handle (6 fields) on a Buffer of {self.topology.num_nodes} nodes: pass the "
                              "handle of a dispatch on such a Buffer (10 fields, NOTE [internode handle])")
        return handle

    def _internode_handle(self, result, num_worst_tokens: int) -> InternodeHandle:
        """A fresh internode dispatch's handle with this Buffer's attributes; its `flat` one-node handle carries
        the one round the call ran in, which a one-node Buffer replays where it fits (NOTE [rounds])."""
        num_recv = None if num_worst_tokens else result.recv_x.size(0)
        most = result.most_call_tokens
        flat = DispatchHandle(*result.handle.flat, buffer_id=self._id, num_recv_tokens=num_recv,
                              rounds=rounds.Rounds(max(most, 1), 1, most, most))
        return InternodeHandle(*result.handle, flat=flat, buffer_id=self._id, num_recv_tokens=num_recv,
                               group_counts=result.handle.group_counts)
