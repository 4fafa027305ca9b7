"""The low-latency half of `Buffer`'s API (DeepEP's ``low_latency_*`` calls), as a mixin `Buffer` inherits.

Kept apart from buffer.py only for size; it uses the `Buffer`'s checks, streams and backend.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import checks, ops
from .backends.requests import CombineOverlap, LowLatencyCombineRequest, LowLatencyDispatchRequest
from .errors import InvalidInputError
from .handle import LowLatencyHandle
from .plan import devices, workspace


def _no_async_with_hook(async_finish: bool, return_recv_hook: bool) -> None:
    """A recv hook receives on the stream the call was made on; an event for a call whose receive has not
    been launched would mean nothing, so DeepEP refuses the pair, and so do we."""
    if async_finish and return_recv_hook:
        raise InvalidInputError("async_finish=True and return_recv_hook=True cannot be combined (as in DeepEP)")


def _combine_overlap(overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms, src_signals,
                     src_signal_expect_value, return_recv_hook, num_local_experts: int, num_slots: int,
                     layout_range: torch.Tensor, device) -> Optional[CombineOverlap]:
    """The single-batch overlap of SGLang's DeepEP (NOTE [combine overlap] in kernels/low_latency_combine.cuh),
    checked: None without `overlap`, whose other arguments then mean nothing, as in DeepEP. The Blackwell form
    (`src_signals`, one signal per local expert: all its rows done once it reaches `src_signal_expect_value`) is
    the same wait with one block of every row: a power-of-two block_m of at least R*M rows."""
    if not overlap:
        return None
    if not return_recv_hook:
        raise InvalidInputError("overlap=True sends while the expert GEMM still writes x and receives in the hook: "
                                "pass return_recv_hook=True, as DeepEP's overlap requires")
    if src_signals is not None:
        if comp_signal is not None:
            raise InvalidInputError("overlap takes comp_signal (a signal per block of block_m rows) or src_signals "
                                    "(one per local expert), not both")
        checks.tensor("src_signals", src_signals, dtypes=(torch.int32, torch.uint32), shape=(num_local_experts,),
                      device=device)
        comp_signal, threshold = src_signals.view(torch.int32), src_signal_expect_value
        block_m = 1 << max(0, num_slots - 1).bit_length()
        # The dispatch's rows per local expert, from its handle (on the GPU: nothing waits for it here).
        packed_recv_count = (layout_range & 0xFFFFFFFF).sum(1).to(torch.int32)
    for name, value, low in (("block_m", block_m, 1), ("threshold", threshold, 0), ("num_sms", num_sms, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**31:
            shown = "src_signal_expect_value" if name == "threshold" and src_signals is not None else name
            raise InvalidInputError(f"{shown} must be an int in [{low}, 2^31), got {value!r}")
    if block_m & (block_m - 1):
        raise InvalidInputError(f"block_m must be a power of two (the GEMM's rows per block), got {block_m}")
    signal_blocks = -(-num_slots // block_m)
    checks.tensor("comp_signal", comp_signal, dtypes=(torch.int32,), dim=1, device=device)
    if comp_signal.numel() < num_local_experts * signal_blocks:
        raise InvalidInputError(f"comp_signal holds {comp_signal.numel()} signals; {num_local_experts} local experts "
                                f"of {num_slots} rows in blocks of {block_m} need {num_local_experts * signal_blocks}")
    checks.tensor("packed_recv_count", packed_recv_count, dtypes=(torch.int32,), shape=(num_local_experts,),
                  device=device)
    return CombineOverlap(comp_signal, signal_blocks, block_m, threshold, num_sms, packed_recv_count)


def _nvfp4_global_scale(x_global_scale, device, check_value: bool) -> None:
    """NOTE [nvfp4] (semantics/quant.py): float32 on the Buffer's device, or None for 1. Its first value is the
    call's: vLLM passes one per expert, all the same (a token is quantized once, whatever its experts), and
    DeepEP's kernel reads the first. The values are read (a wait for the GPU) only in debug mode."""
    if x_global_scale is None:
        return
    checks.tensor("x_global_scale", x_global_scale, dtypes=(torch.float32,), device=device, contiguous=False)
    if x_global_scale.numel() == 0:
        raise InvalidInputError("x_global_scale holds no value; give the call's global scale (or None for 1)")
    if check_value:
        values = x_global_scale.reshape(-1)
        first = float(values[0])
        if not 0.0 < first < float("inf"):
            raise InvalidInputError(f"x_global_scale must be positive and finite, got {first}")
        if not bool((values == values[0]).all()):
            raise InvalidInputError("x_global_scale holds different values; NVFP4 dispatch quantizes a token once "
                                    "for all its experts, so it takes one global scale (the first value)")


class LowLatencyCalls:
    """Low-latency dispatch/combine, hooks, zero-copy buffers and rank masking; see `Buffer`."""

    # -- low-latency mode ---------------------------------------------------------------------------------

    def _low_latency_checks(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """-> (num_max_dispatch_tokens_per_rank, num_experts) as ints, checked against the buffer's size."""
        num_experts = checks.num_experts(num_experts, self.group_size)
        num_max_dispatch_tokens_per_rank = checks.size_int("num_max_dispatch_tokens_per_rank",
                                                           num_max_dispatch_tokens_per_rank, positive=True)
        checks.low_latency_capacity(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                    hidden=hidden, num_ranks=self.group_size, num_experts=num_experts,
                                    num_rdma_bytes=self.num_rdma_bytes)
        return num_max_dispatch_tokens_per_rank, num_experts

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signalling state (after normal-mode use of the same memory, say)."""
        num_max, num_experts = self._low_latency_checks(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._backend().clean_low_latency_buffer(num_max, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None):
        """Send each (token, expert) pair to the expert's rank, packed per local expert.

        Naive equivalent: local expert l receives, from each rank in order, the tokens that chose it.

        Arguments:
            x: ``[T, H]`` bf16, T <= `num_max_dispatch_tokens_per_rank` (same on every rank).
            topk_idx: ``[T, K]`` int64 global expert ids, -1 for none, K <= 16; an expert named twice in a
                row takes one slot (NOTE [repeated experts] in routing.py).
            cumulative_local_expert_recv_stats: ``[L]`` int32, incremented by the received counts.
            dispatch_wait_recv_cost_stats: ``[R]`` int64: adds, per source rank, the GPU clock cycles the
                receive waited for that rank's tokens (CUDA kernels; NOTE [wait costs] in checks.py).
            use_fp8: quantize to e4m3 with per-128-channel float32 scales (H % 128 == 0).
            round_scale, use_ue8m0: power-of-two scales; UE8M0 packs them as int32 (H % 512 == 0).
            return_recv_hook: send only; the returned hook receives.
            use_nvfp4, x_global_scale: NVFP4 instead (DeepEP's NVFP4 branch, as SGLang and vLLM call it; NOTE
                [nvfp4] in semantics/quant.py; H % 128 == 0): e2m1 values with an e4m3 scale per 16 channels
                and the global scale `x_global_scale`, float32, its first value read on the GPU (None: 1; vLLM
                passes one per expert, all the same; positive, finite and all the same: checked in debug mode). `use_fp8`, `round_scale` and `use_ue8m0` are then ignored, and
                `x_global_scale` is without NVFP4.
        Returns:
            ``packed_recv_x`` (``(e4m3 [L, R*M, H], scales [L, R*M, H/128])`` or bf16 ``[L, R*M, H]``; with
            NVFP4 ``(uint8 [R*M, H/2, L], float8_e4m3fn [32, 4, ceil(R*M/128), 4, ceil(H/64), L])``, DeepEP's
            views), ``packed_recv_count`` int32 [L], ``handle``, event, hook (None without `return_recv_hook`).
        Raises:
            InvalidInputError, CapacityError: before any communication.
        """
        if use_nvfp4:  # the FP8 options mean nothing then, and the global scale nothing without NVFP4
            use_fp8 = round_scale = use_ue8m0 = False
        else:
            x_global_scale = None
        args = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, bool(use_nvfp4), x_global_scale)
        if torch.compiler.is_compiling():  # NOTE [custom ops] in ops.py
            return ops.low_latency_dispatch(self, *args, return_recv_hook)
        fast = self._fast if not (async_finish or return_recv_hook or self.check_inputs) else None  # NOTE [fast paths]
        if fast is not None:
            result = fast.low_latency_dispatch(args)
            if result is not None:
                return result
        result = self._low_latency_dispatch(*args, async_finish, return_recv_hook)
        if fast is not None and x.device == self.device and topk_idx.is_contiguous():
            fast.learn_low_latency_dispatch(args)
        return result

    @devices.runs_where_tensors_are("x")
    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                              use_ue8m0, use_nvfp4, x_global_scale, async_finish, return_recv_hook):
        backend = self._backend()
        checks.wait_recv_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                                    num_ranks=self.group_size, device=self.device)
        checks.tensor("x", x, dtypes=(torch.bfloat16,), dim=2, device=self.device, aligned=True)
        num_tokens, hidden = x.shape
        checks.topk_idx(topk_idx, num_tokens=num_tokens, device=self.device, max_topk=workspace.LOW_LATENCY_MAX_TOPK)
        num_max_dispatch_tokens_per_rank, num_experts = self._low_latency_checks(num_max_dispatch_tokens_per_rank,
                                                                                 hidden, num_experts)
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise InvalidInputError(f"{num_tokens} tokens exceed num_max_dispatch_tokens_per_rank="
                                    f"{num_max_dispatch_tokens_per_rank}")
        if hidden % 8 != 0:
            raise InvalidInputError(f"low-latency rows must be a multiple of 16 bytes: hidden % 8 == 0, got {hidden}")
        if (use_fp8 or use_nvfp4) and hidden % 128 != 0:
            raise InvalidInputError(f"{'NVFP4' if use_nvfp4 else 'FP8'} dispatch needs hidden % 128 == 0, "
                                    f"got hidden={hidden}")
        if use_nvfp4:
            _nvfp4_global_scale(x_global_scale, self.device, self._check_values())
        _no_async_with_hook(async_finish, return_recv_hook)
        if use_fp8 and use_ue8m0 and hidden % 512 != 0:
            raise InvalidInputError(f"UE8M0 scales need hidden % 512 == 0, got hidden={hidden}")
        num_local_experts = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            checks.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                          dtypes=(torch.int32,), shape=(num_local_experts,), device=self.device)
        if self._check_values():
            checks.topk_values(topk_idx, num_experts)
        if backend.wants_call_agreement(True):  # NOTE [call agreement] in collectives.py
            # NOTE [input verdict] in checks.py: the ids are judged with the header, so every rank refuses alike.
            verdicts = self._exchange.agree(
                "low_latency_dispatch", lambda: checks.bad_expert_ids(topk_idx, num_experts).any().int(),
                hidden=hidden, num_topk=topk_idx.size(1), num_experts=num_experts,
                num_max=num_max_dispatch_tokens_per_rank, cast=2 if use_nvfp4 else int(use_fp8),
                round_scale=int(round_scale or use_ue8m0), use_ue8m0=int(use_ue8m0 and use_fp8))
            if any(verdicts):
                raise checks.verdict_error([r for r, v in enumerate(verdicts) if v], checks.BAD_EXPERT_ID,
                                           num_experts, op="low_latency_dispatch")
        request = LowLatencyDispatchRequest(
            x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, use_fp8=use_fp8, round_scale=round_scale or use_ue8m0,
            use_ue8m0=use_ue8m0 and use_fp8, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            return_recv_hook=return_recv_hook, rank_mask=self._rank_mask,
            wait_recv_cost_stats=dispatch_wait_recv_cost_stats, use_nvfp4=use_nvfp4, x_global_scale=x_global_scale)
        with self._stream_scope(use_comm_stream=async_finish, async_finish=async_finish) as scope:
            result = backend.low_latency_dispatch(request)
        handle = LowLatencyHandle(*result.handle, buffer_id=self._id, num_topk=topk_idx.size(1),
                                  num_tokens=num_tokens, half=result.handle.half, fast_for=self._id)
        recv_x = (result.packed_recv_x, result.packed_recv_x_scales) if use_fp8 or use_nvfp4 else result.packed_recv_x
        return recv_x, result.packed_recv_count, handle, scope.event, self._wrap_hook(result.hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, overlap: bool = False,
                            packed_recv_count: Optional[torch.Tensor] = None,
                            comp_signal: Optional[torch.Tensor] = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 3, src_signals: Optional[torch.Tensor] = None,
                            src_signal_expect_value: int = 0):
        """Return each expert output to its token's rank and sum them with the top-k weights.

        Naive equivalent: ``out[t] = sum_k topk_weights[t, k] * expert_output(topk_idx[t, k], t)``.

        Arguments:
            x: ``[L, R*M, H]`` bf16 expert outputs in the dispatch's slots (ignored with `zero_copy`,
                which reads `get_next_low_latency_combine_buffer(handle)` instead).
            topk_idx, topk_weights: the ``[T, K]`` ids given to the dispatch and float32 weights.
            handle: the low-latency dispatch's handle.
            use_logfmt: accepted; the rows travel as bf16 whatever it says, so the result is the plain
                combine's (DeepEP's LogFMT-10 rounds each value below 1 by up to 2.2% on the way:
                benchmarks/results/logfmt_bound.md).
            zero_copy: read `get_next_low_latency_combine_buffer(handle)` instead of `x` (with `use_logfmt`
                too, which DeepEP refuses).
            out: ``[T, H]`` bf16 to write into.
            combine_wait_recv_cost_stats: ``[R]`` int64: adds, per expert rank, the GPU clock cycles the
                receive waited for that rank's rows (CUDA kernels; NOTE [wait costs] in checks.py).
            overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms: SGLang's single-batch overlap
                (docs/semantics.md, "Combine overlap"): with `overlap`, `x` may still be being written by the expert
                GEMM on another stream; row r of local expert l is read once ``comp_signal[l * ceil(R*M / block_m)
                + r // block_m] >= threshold``; packed_recv_count is the dispatch's; the sending half runs on
                `num_sms` SMs; needs `return_recv_hook`. The result is the plain combine's.
            src_signals, src_signal_expect_value: the Blackwell form of the overlap (instead of comp_signal,
                packed_recv_count, block_m and threshold): ``[L]`` int32 or uint32, the rows of local expert l are
                read once ``src_signals[l] >= src_signal_expect_value``.
        Returns:
            ``combined_x`` [T, H] bf16, event, hook (None without `return_recv_hook`).
        Raises:
            InvalidInputError, HandleError: before any communication.
        """
        del use_logfmt  # see the docstring
        overlap_args = (overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms, src_signals,
                        src_signal_expect_value)
        if torch.compiler.is_compiling() and not overlap:  # NOTE [custom ops] in ops.py
            return ops.low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, out,
                                           combine_wait_recv_cost_stats, return_recv_hook)
        fast = self._fast if not (async_finish or return_recv_hook or zero_copy or overlap) else None  # [fast paths]
        args = (x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats)
        if fast is not None:
            result = fast.low_latency_combine(*args)
            if result is not None:
                return result
        result = self._low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats, overlap_args)
        if fast is not None and getattr(handle, "fast_for", None) == self._id and x.device == self.device:
            fast.learn_low_latency_combine(*args)
        return result

    @devices.runs_where_tensors_are("x")
    def _low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out,
                             combine_wait_recv_cost_stats, overlap_args=(False,) + (None,) * 7):
        backend = self._backend()
        checks.wait_recv_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                                    num_ranks=self.group_size, device=self.device)
        handle = checks.low_latency_handle(handle, buffer_id=self._id, num_ranks=self.group_size,
                                           device=self.device)
        num_max, hidden, num_experts = handle[2], handle[3], handle[4]
        self._low_latency_checks(num_max, hidden, num_experts)
        num_local_experts = num_experts // self.group_size
        if zero_copy:
            x = backend.next_low_latency_combine_buffer(num_max, hidden, num_experts)
        checks.tensor("x", x, dtypes=(torch.bfloat16,), shape=(num_local_experts, self.group_size * num_max, hidden),
                      device=self.device, contiguous=not zero_copy, aligned=True)  # zero-copy: DeepEP's strides
        checks.topk_idx(topk_idx, num_tokens=None, device=self.device, max_topk=workspace.LOW_LATENCY_MAX_TOPK)
        if topk_idx.size(0) > num_max:
            raise InvalidInputError(f"topk_idx has {topk_idx.size(0)} rows, more than the dispatch's "
                                    f"num_max_dispatch_tokens_per_rank={num_max}")
        _no_async_with_hook(async_finish, return_recv_hook)
        if handle.num_topk is not None and topk_idx.size(1) != handle.num_topk:
            raise InvalidInputError(f"topk_idx has {topk_idx.size(1)} columns; the dispatch had {handle.num_topk}")
        if handle.num_tokens is not None and topk_idx.size(0) != handle.num_tokens:
            raise InvalidInputError(f"topk_idx has {topk_idx.size(0)} rows; the dispatch had {handle.num_tokens} "
                                    "tokens: pass the dispatch's topk_idx")
        checks.topk_weights(topk_weights, like=topk_idx, device=self.device)
        if out is not None:
            checks.tensor("out", out, dtypes=(torch.bfloat16,), shape=(topk_idx.size(0), hidden), device=self.device,
                          aligned=True)
        overlap = _combine_overlap(*overlap_args, return_recv_hook, num_local_experts, self.group_size * num_max,
                                   handle[1], self.device)
        if backend.wants_call_agreement(True):  # NOTE [call agreement] in collectives.py
            self._exchange.agree("low_latency_combine", hidden=hidden, num_topk=topk_idx.size(1),
                                 num_experts=num_experts, num_max=num_max)
        request = LowLatencyCombineRequest(x=x, topk_idx=topk_idx, topk_weights=topk_weights, handle=handle,
                                           zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out,
                                           rank_mask=self._rank_mask,
                                           wait_recv_cost_stats=combine_wait_recv_cost_stats, overlap=overlap)
        with self._stream_scope(use_comm_stream=async_finish, async_finish=async_finish) as scope:
            combined_x, hook = backend.low_latency_combine(request)
        return combined_x, scope.event, self._wrap_hook(hook)

    @staticmethod
    def _wrap_hook(hook: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """The receive hook, called at most once; None without `return_recv_hook`, as DeepEP returns (clients
        assert it)."""
        if hook is None:
            return None
        done = []

        def receive() -> None:
            if not done:
                hook()
                done.append(True)

        return receive

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The bf16 ``[L, R*M, H]`` tensor to fill before ``low_latency_combine(..., zero_copy=True)``, with
        DeepEP's strides: rows ``H + 2 * (H // 128)`` elements apart (its combine message, LogFMT bounds included),
        a view of memory the combine reads in place."""
        handle = checks.low_latency_handle(handle, buffer_id=self._id, num_ranks=self.group_size,
                                           device=self.device)
        return self._backend().next_low_latency_combine_buffer(handle[2], handle[3], handle[4])

    # -- rank masking (enable_shrink) ---------------------------------------------------------------------

    def _mask(self) -> torch.Tensor:
        if self._rank_mask is None:
            raise InvalidInputError("rank masking needs Buffer(..., enable_shrink=True)")
        return self._rank_mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank: low-latency calls neither send to nor wait for it."""
        if not 0 <= rank_to_mask < self.group_size:
            raise InvalidInputError(f"rank_to_mask={rank_to_mask} is outside [0, {self.group_size})")
        self._mask()[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask (1 = masked) into `mask_status`, an int32 [R] tensor."""
        checks.tensor("mask_status", mask_status, dtypes=(torch.int32,), shape=(self.group_size,), contiguous=False)
        mask_status.copy_(self._mask())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._mask().zero_()

