"""The calls of a CUDA-backend Buffer whose shape was seen before: one crossing to C++ that looks the call up and
runs it (NOTE [fast calls] in csrc/call_plan.cpp).

NOTE [fast paths]
The first call of a shape goes through the Buffer's full path: every argument check, the backend's plan
(NOTE [call plans] in backends/cuda/plans.py), the streams. When it returns, the Buffer records what decided
it: the metadata of every argument (dtypes, shapes, strides, device: all the checks read), the flags,
the SM count, as one signature made in C++ (NOTE [call signatures] in csrc/call_plan.cpp). A later call
whose signature is the same would pass the same checks and build the same plan, so it skips both: it finds
the plan and runs it, ordering the streams in the same C++ call. What the key cannot cover goes the full
path every time: value checks (with `check_inputs`), calls in rounds, handles not made and checked by this
Buffer, `allocate_on_comm_stream`, another current device, CPU tensors, CUDA-graph capture of the value
checks. A call that raises leaves no record, so a refusal is always the full path's, with its message.

Keys hold per-rank shapes, so in one call some ranks may take a fast path and others the full path: the two
must then communicate alike. The full path's only host collectives are those of rounds (`rounds.derive`), so
a cached dispatch or a combine takes its fast path only where the handle's rounds fit the call's round size
(the same on every rank, recorded with the plan); there the full path replays them with no collective. A
fast path taken where they did not fit would also run more tokens than one round holds. A fresh dispatch
without num_worst_tokens learns its round count only from its count exchange: its fast path (NOTE [fresh calls]
in csrc/call_plan.cpp) runs round 0 as the full path does and, where another rank's call needs more rounds, the
Buffer sends them as the full path would.

Outputs are allocated on the caller's current stream (which waits for the communication stream at the end
of a call unless `async_finish`), so no tensor needs `record_stream` on the synchronous path; with
`async_finish` every tensor of the call is marked as used by the communication stream.
"""

from __future__ import annotations

import operator

import torch

from ...event import EventHandle, EventOverlap
from ...handle import DispatchHandle

_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def split_x(x):
    """Dispatch's `x` (or combine's `bias`) as a pair; a tuple of another length matches no recorded key."""
    if isinstance(x, tuple):
        return x if len(x) == 2 else (object(), None)
    return x, None


_NINE_NONES = (None,) * 9
# A signature's first item:
_LAYOUT, _CACHED, _WORST, _COMBINE, _LOW_LATENCY_DISPATCH, _LOW_LATENCY_COMBINE, _FRESH = range(7)


class FastPaths:
    """The fast paths of one CUDA-backend Buffer (NOTE [fast paths]); their C++ half is the backend's `calls`
    (NOTE [fast calls] in csrc/call_plan.cpp), which also keeps the order of the Buffer's streams."""

    def __init__(self, buffer):
        from . import plans
        from .backend import DISPATCH_INPUTS

        self.unused_dispatch_inputs = (None,) * (len(DISPATCH_INPUTS) - 5)  # a cached dispatch's, after the fifth
        # A worst-case dispatch's, after its check inputs (the expanded layout's, NOTE [expanded rows]).
        self.unused_after_checks = (None,) * (len(DISPATCH_INPUTS) - DISPATCH_INPUTS.index("check_per_expert") - 1)
        self.buffer = buffer
        self.backend = buffer.runtime
        self.device_index = buffer.device.index
        self.comm_stream = buffer.get_comm_stream()
        self.calls = self.backend.calls
        self.calls.set_streams(self.comm_stream.cuda_stream, self.comm_stream.stream_id, plans.new_event(),
                               plans.new_event())

    @property
    def hits(self) -> int:
        """Calls that took a fast path (read by tests)."""
        return self.calls.hits

    # Each call below is one `self.calls.run` (NOTE [fast calls]): -> (the extra it recorded, outputs, a low-latency
    # dispatch's half), or None; a fresh dispatch's is `take`, `run_first` and `finish_counted` (NOTE [fresh calls],
    # NOTE [counted finish]).

    def event(self, async_finish: bool) -> EventOverlap:
        """A normal-mode call's event, as the full path's stream scope makes it."""
        return EventOverlap(EventHandle(self.comm_stream)) if async_finish else EventOverlap(None)

    def _num_sms(self, config) -> int:
        """The SM count a call's `config` names, or the Buffer's."""
        return self.buffer.num_sms if config is None else config.num_sms

    # -- normal mode ----------------------------------------------------------------------------------------

    def layout(self, topk_idx, num_experts, previous_event, async_finish):
        ran = self.calls.run((_LAYOUT, topk_idx, num_experts, async_finish), (topk_idx,),
                             _raw_stream(self.device_index), previous_event, async_finish, 0)
        if ran is None:
            return None
        per_rank, per_expert, in_rank = ran[1]
        return per_rank, None, per_expert, in_rank, self.event(async_finish)

    def learn_layout(self, topk_idx, num_experts, async_finish) -> None:
        plan = self.backend.layout_plan(topk_idx.dtype, topk_idx.size(0), topk_idx.size(1), num_experts)
        self.calls.learn((_LAYOUT, topk_idx, num_experts, async_finish), plan.native, None, [], False, 0, [])

    def _cached_key(self, x, handle, config, async_finish):
        # The handle's recv_src_idx and is_token_in_rank: its received rows and sent tokens.
        return _CACHED, x, handle[3], handle[4], self._num_sms(config), async_finish

    def cached_dispatch(self, x, handle, config, previous_event, async_finish):
        if getattr(handle, "fast_for", None) != self.buffer._id:
            return None
        data, scales = split_x(x)
        ran = self.calls.run(self._cached_key(x, handle, config, async_finish),
                             (data, scales, None, None, handle[4]) + self.unused_dispatch_inputs,
                             _raw_stream(self.device_index), previous_event, async_finish,
                             handle.rounds.max_round_tokens)
        if ran is None:
            return None
        (recv_x_at, scales_at), outputs, _ = ran
        recv_x = outputs[recv_x_at] if scales is None else (outputs[recv_x_at], outputs[scales_at])
        return recv_x, None, None, None, None, self.event(async_finish)

    def learn_cached_dispatch(self, x, handle, config, async_finish, shape, round_tokens: int) -> None:
        first, second = self.backend.dispatch_plans(shape)
        if second is not None:
            return
        names = first.output_names
        self.calls.learn(self._cached_key(x, handle, config, async_finish), first.native,
                         (names.index("recv_x"), names.index("recv_x_scales") if "recv_x_scales" in names else None),
                         self.backend.dispatch_scalars(handle.num_tokens, ticket=0), True, round_tokens, [])

    def _worst_key(self, x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                   async_finish, all_weights):
        return (_WORST, x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                self._num_sms(config), async_finish, all_weights)

    def worst_dispatch(self, x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                       previous_event, async_finish, all_weights: bool = False):
        """A fresh dispatch with num_worst_tokens (one plan, no CPU wait); `layout` = (num_tokens_per_rank,
        is_token_in_rank, num_tokens_per_expert); `all_weights`: DispatchRequest.all_topk_weights."""
        data, scales = split_x(x)
        per_rank, in_rank, per_expert = layout
        ran = self.calls.run(self._worst_key(x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                             config, async_finish, all_weights),
                             (data, scales, topk_idx, topk_weights, in_rank, per_expert) + _NINE_NONES +
                             (topk_idx, in_rank, per_rank, per_expert) + self.unused_after_checks,
                             _raw_stream(self.device_index), previous_event,
                             async_finish, 0)
        if ran is None:
            return None
        (pick, rounds, num_experts), outputs, _ = ran
        self.backend.note_judged(num_experts)
        prefix, counts, first, src_idx, send_head, recv_x, recv_idx, recv_weights, *recv_scales = pick(outputs)
        buffer_id = self.buffer._id
        handle = DispatchHandle.of((prefix, counts, first, src_idx, in_rank, send_head),
                                   {"buffer_id": buffer_id, "rounds": rounds, "num_recv_tokens": None,
                                    "fast_for": buffer_id})
        return ((recv_x, *recv_scales) if scales is not None else recv_x, recv_idx, recv_weights, [], handle,
                self.event(async_finish))

    def learn_worst_dispatch(self, x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                             async_finish, shape, rounds, all_weights: bool = False) -> None:
        first, second = self.backend.dispatch_plans(shape)
        names = first.output_names
        if second is not None or "recv_topk_weights" not in names:
            return
        picked = ("rank_prefix_matrix", "counts", "source_first", "recv_src_idx", "send_head", "recv_x",
                  "recv_topk_idx", "recv_topk_weights") + (("recv_x_scales",) if "recv_x_scales" in names else ())
        pick = operator.itemgetter(*(names.index(name) for name in picked))
        num_tokens = split_x(x)[0].size(0)
        self.calls.learn(self._worst_key(x, layout, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                         async_finish, all_weights), first.native, (pick, rounds, layout[2].size(0)),
                         self.backend.dispatch_scalars(num_tokens, None, num_worst_tokens, 0, num_tokens, ticket=0),
                         True, 0, [])

    def _fresh_key(self, x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish, all_weights):
        return (_FRESH, x, layout, topk_idx, topk_weights, expert_alignment, self._num_sms(config), async_finish,
                all_weights)

    def fresh_entry(self, x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish,
                    all_weights: bool):
        """The record of a fresh dispatch without num_worst_tokens of this shape, (first plan, second plan, round
        tokens), where a fast call may run now; else None."""
        return self.calls.take(self._fresh_key(x, layout, topk_idx, topk_weights, expert_alignment, config,
                                               async_finish, all_weights))

    def fresh_dispatch(self, entry, round_0, previous_event, async_finish: bool):
        """Round 0 (`round_0`, rounds.first_round's request) of a fresh dispatch recorded as `entry`: its count
        exchange, the host's wait for the counts, its transfer (NOTE [fresh calls] in csrc/call_plan.cpp).
        -> the backend's DispatchResult, or None (an unreadable `previous_event`: the full path runs)."""
        first, second = entry[0], entry[1]
        self.backend.check_failures()  # one found on the host (a CPU wait past its deadline) too, as `dispatch` does
        inputs, scalars = self.backend.dispatch_values(round_0)
        made = self.calls.run_first(first.native, inputs, scalars, _raw_stream(self.device_index), previous_event,
                                    async_finish)
        if made is None:
            return None
        inputs += made
        try:  # NOTE [counted finish] in csrc/call_plan.cpp
            outputs = self.calls.finish_counted(second.native, inputs, scalars, async_finish, scalars[0],
                                                self.backend.host_wait_s, self.backend.count_reads(round_0))
            if outputs is None:  # the counts did not come clean: the host's wait raises what came instead
                self.backend.counts_arrived(round_0, scalars, timeout_s=0.0)
                outputs = self.calls.finish(second.native, inputs, scalars, async_finish)
        except BaseException:
            self.calls.abandon()
            raise
        named = first.named(made)
        named.update(second.named(outputs))
        return self.backend.dispatch_result(round_0, named, inputs[4], *self.backend.counts_read(round_0))

    def learn_fresh_dispatch(self, x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish,
                             all_weights: bool, shape, round_tokens: int) -> None:
        """Records a fresh dispatch that took one round; `shape`: its round 0's DispatchShape."""
        first, second = self.backend.dispatch_plans(shape)
        if second is None:
            return
        self.calls.learn(self._fresh_key(x, layout, topk_idx, topk_weights, expert_alignment, config, async_finish,
                                         all_weights), first.native, (first, second, round_tokens), [], False, 0, [])

    def _combine_key(self, x, handle, topk_weights, bias, config, async_finish):
        return (_COMBINE, x, topk_weights, bias, handle[3], handle[4],  # as _cached_key's
                self._num_sms(config), async_finish)

    def combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish):
        if getattr(handle, "fast_for", None) != self.buffer._id or isinstance(bias, list):
            return None
        bias_0, bias_1 = split_x(bias)
        ran = self.calls.run(self._combine_key(x, handle, topk_weights, bias, config, async_finish),
                             (x, topk_weights, bias_0, bias_1, handle[0], None, handle[5], None, None),  # handle fields
                             _raw_stream(self.device_index), previous_event, async_finish,
                             handle.rounds.max_round_tokens)
        if ran is None:
            return None
        outputs = ran[1]
        return outputs[0], (outputs[1] if topk_weights is not None else None), self.event(async_finish)

    def learn_combine(self, x, handle, topk_weights, bias, config, async_finish, round_tokens: int) -> None:
        num_sms = self._num_sms(config)
        bias_0, bias_1 = split_x(bias)
        plan = self.backend.combine_plan(handle.num_tokens, x.size(1), 0 if topk_weights is None else
                                         topk_weights.size(1), (bias_0 is not None) + (bias_1 is not None), num_sms,
                                         False)
        self.calls.learn(self._combine_key(x, handle, topk_weights, bias, config, async_finish), plan.native, None, [],
                         False, round_tokens, [])

    # -- low-latency mode -----------------------------------------------------------------------------------

    # A low-latency dispatch's key is its arguments as Buffer.low_latency_dispatch gathers them: x, topk_idx,
    # num_max_dispatch_tokens_per_rank, num_experts, the two stats tensors, the four cast flags, x_global_scale.

    def low_latency_dispatch(self, args: tuple):
        kernels = self.backend._low_latency_impl()
        if kernels is None:
            return None
        x, topk_idx, num_max, num_experts, stats, wait_stats, *_, x_global_scale = args
        ran = self.calls.run((_LOW_LATENCY_DISPATCH, args),
                             (x, topk_idx, stats, self.buffer._rank_mask, wait_stats, x_global_scale),
                             _raw_stream(self.device_index), None, False, 0)
        if ran is None:
            return None
        (recv_x_at, scales_at), outputs, half = ran
        handle = kernels.dispatched(outputs, half, x, topk_idx, num_max, num_experts, self.buffer._id)
        if scales_at is None:
            return outputs[recv_x_at], outputs[recv_x_at + 1], handle, EventOverlap(None), None
        return (outputs[recv_x_at], outputs[scales_at]), outputs[scales_at + 1], handle, EventOverlap(None), None

    def learn_low_latency_dispatch(self, args: tuple) -> None:
        kernels = self.backend._low_latency_impl()
        if kernels is None:
            return
        x, topk_idx, num_max, num_experts, _, _, use_fp8, round_scale, use_ue8m0, use_nvfp4, _ = args
        cast = 2 if use_nvfp4 else int(use_fp8)
        first, _ = kernels.dispatch_plans(x.size(0), x.size(1), topk_idx.size(1), topk_idx.dtype, num_experts, num_max,
                                          cast, use_ue8m0, round_scale, False)
        names = first.output_names
        self.calls.learn((_LOW_LATENCY_DISPATCH, args), first.native,
                         (names.index("packed_recv_x"),
                          names.index("packed_recv_x_scales") if "packed_recv_x_scales" in names else None), [], False,
                         0, [kernels.dispatch_scalars(num_max, x.size(1), num_experts, half) for half in (0, 1)])

    def _low_latency_combine_key(self, x, topk_idx, topk_weights, handle, out, wait_stats):
        # The handle's sent tokens and top-k: a learnt entry's equal topk_idx's (else the full path refused).
        return (_LOW_LATENCY_COMBINE, x, topk_idx, topk_weights, handle[2], handle[3], handle[4], out, wait_stats,
                handle.num_tokens, handle.num_topk)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, out, wait_stats):
        kernels = self.backend._low_latency_impl()
        if kernels is None or getattr(handle, "fast_for", None) != self.buffer._id:
            return None
        entry = self.calls.take(self._low_latency_combine_key(x, topk_idx, topk_weights, handle, out, wait_stats))
        if entry is None:
            return None
        combined = kernels.run_combine(entry, x, topk_idx, topk_weights, handle, out, self.buffer._rank_mask,
                                       wait_stats)
        return combined, EventOverlap(None), None  # no hook without return_recv_hook, as DeepEP

    def learn_low_latency_combine(self, x, topk_idx, topk_weights, handle, out, wait_stats) -> None:
        kernels = self.backend._low_latency_impl()
        if kernels is None or not (x.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous()):
            return
        first, _ = kernels.combine_plans(topk_idx.size(0), handle.hidden, topk_idx.size(1), topk_idx.dtype,
                                         handle.num_experts, handle.num_max_dispatch_tokens_per_rank, out is not None,
                                         False)
        self.calls.learn(self._low_latency_combine_key(x, topk_idx, topk_weights, handle, out, wait_stats),
                         first.native, first.native, [], False, 0, [])
