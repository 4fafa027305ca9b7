"""The validated arguments of each call, as the front-end hands them to a backend.

The `Buffer` front-end checks and normalizes the caller's arguments once (checks.py) and passes one of
these frozen records to the backend, so the ~20 arguments of a dispatch are spelled out here only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..config import Config
from ..handle import DispatchHandle, LowLatencyHandle


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one round of a call in rounds writes: straight into the whole call's tensors (NOTE [placed
    rounds] in rounds.py). Every backend takes one on dispatch and combine (Backend.dispatch)."""

    recv_first: torch.Tensor                 # [R] int32 on the device: row of the whole call's receive order
                                             # that the round's first row from source s takes; with `cursor`,
                                             # written by the round's count exchange
    outputs: Optional[Tuple[Optional[torch.Tensor], ...]]  # dispatch: the whole call's (recv_x, recv_x_scales,
                                             # recv_topk_idx, recv_topk_weights, recv_src_idx), None where
                                             # round 0 makes them (`DispatchRequest.call` gives their rows);
                                             # combine: the round's tokens of (combined_x, combined_topk_weights)
    token_base: int = 0                      # dispatch: the round's first token, added to recv_src_idx
    cursor: Optional[torch.Tensor] = None    # dispatch, [R] int32: the whole call's next free row per source.
                                             # The count exchange sets recv_first to it (to where each source's
                                             # rows start, given `call`), then adds the round's rows to it


@dataclasses.dataclass(frozen=True)
class WholeCall:
    """Round 0 of a dispatch in rounds (NOTE [placed rounds] in rounds.py): the whole call, which round 0's
    count exchange shares."""

    num_tokens: int                          # this rank's tokens
    tokens_per_rank: torch.Tensor            # [R] int32: what this rank sends each rank
    prefix_matrix: torch.Tensor              # [R, R] int32, written: the whole call's rank_prefix_matrix


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    """A fresh dispatch's whole-call inputs whose values its count exchange judges (NOTE [input verdict] in
    checks.py): given to its one-shot request, or to round 0 of a call in rounds."""

    topk_idx: Optional[torch.Tensor]         # [T, K] or None (then only the per-rank counts are judged)
    num_tokens_per_rank: torch.Tensor        # [R] int32
    is_token_in_rank: torch.Tensor           # [T, R] bool
    num_tokens_per_expert: torch.Tensor      # [E] int32


@dataclasses.dataclass(frozen=True)
class Expansion:
    """ElasticBuffer's expanded dispatch in the dispatch kernel (NOTE [expanded rows] in kernels/dispatch.cuh): the
    rows go to their pairs' rows of the expanded layout, and the result's recv_x, recv_x_scales and
    recv_topk_weights are the expanded ones (`num_rows` rows; weights one an expanded row). Cached: the handle's
    layout (`row_of`, `source_row`). Fresh (`source_ranks` given): the layout made as the rows land, returned in
    DispatchResult.expanded. One round of one node on the CUDA backend only (`Buffer._expands_in_kernel`)."""

    topk_idx: torch.Tensor                   # [T, K]: which slots' weights go to which rank (the handle's if cached)
    num_experts: int
    zero_fill: bool                          # padding rows zero, else unspecified
    row_of: Optional[torch.Tensor] = None    # cached, [N, K] int32: each received row's pairs' rows, -1 where none
    source_row: Optional[torch.Tensor] = None  # cached, [M] int32: each expanded row's received row, -1 on padding
    source_ranks: Optional[torch.Tensor] = None  # fresh, [T, K] int32: semantics.expand.source_ranks
    expanded_rows: int = 0                   # fresh: M where no CPU wait sizes it (the worst case); 0: the counts'
    num_max_tokens_per_rank: int = 0         # fresh: for the handle's recv_src_metadata

    @property
    def fresh(self) -> bool:
        return self.source_ranks is not None

    @property
    def num_rows(self) -> int:
        return self.expanded_rows if self.fresh else self.source_row.size(0)


@dataclasses.dataclass(frozen=True)
class DispatchRequest:
    x: torch.Tensor                          # [T, H] any dtype, rows a multiple of 16 bytes
    x_scales: Optional[torch.Tensor]         # [T, S] float32/int32 (any strides) or None
    topk_idx: Optional[torch.Tensor]         # [T, K] int64 global expert ids, None with a handle
    topk_weights: Optional[torch.Tensor]     # [T, K] float32 or None
    num_tokens_per_rank: Optional[torch.Tensor]   # [R] int32, None with a handle
    is_token_in_rank: torch.Tensor           # [T, R] bool
    num_tokens_per_expert: Optional[torch.Tensor]  # [E] int32, None with a handle
    handle: Optional[DispatchHandle]         # set: cached dispatch
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    placement: Optional[Placement] = None    # a placed round: its rows go straight into the whole call's tensors
    call: Optional[WholeCall] = None         # round 0 of a call in rounds: the result reports most_call_tokens
    check: Optional[LayoutCheck] = None      # a fresh dispatch's one-shot request or round 0
    all_topk_weights: bool = False           # every slot's weight arrives, not only the local ones' (DeepEP V2)
    expansion: Optional[Expansion] = None    # a dispatch straight into the expanded layout, cached or fresh

    @property
    def num_experts(self) -> int:
        return self.num_tokens_per_expert.size(0)

    @property
    def kernel_topk_idx(self) -> Optional[torch.Tensor]:
        """The top-k ids the dispatch kernel reads: an expanded dispatch's (the handle's when cached: its tails carry
        the slots' local experts and weights, as a fresh one's do), none for another cached dispatch."""
        if self.expansion is not None:
            return self.expansion.topk_idx
        return None if self.handle is not None else self.topk_idx

    def whole_round(self, placement: Placement, call: WholeCall) -> DispatchRequest:
        """This request as round 0 of a call that one round holds (rounds.first_round): `dataclasses.replace`
        without `__init__`, which sets each frozen field through object.__setattr__, for a fresh dispatch's fast
        path makes one per call (benchmarks/results/host_cost.md)."""
        round_0 = object.__new__(DispatchRequest)
        round_0.__dict__.update(self.__dict__, num_worst_tokens=0, placement=placement, call=call)
        return round_0


@dataclasses.dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list]
    handle: DispatchHandle
    # The largest whole-call (`request.call`, else this call's) token count of any rank, where the count
    # exchange learned it on the host (a fresh dispatch that waited for the CPU); None elsewhere.
    most_call_tokens: Optional[int] = None
    # A fresh expanded dispatch's layout (Expansion): "counts" [L], "ends" [L], "row_of" [N, K], "source_row" [M],
    # "metadata" [N, K + 2] (int32, the EPHandle's fields); None elsewhere.
    expanded: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class CombineRequest:
    x: torch.Tensor                          # [N, H] bf16
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]     # [N, K] float32
    bias_0: Optional[torch.Tensor]           # [T, H] bf16
    bias_1: Optional[torch.Tensor]
    config: Config
    placement: Optional[Placement] = None    # a placed round: x and topk_weights are the whole call's


@dataclasses.dataclass(frozen=True)
class LowLatencyDispatchRequest:
    x: torch.Tensor                          # [T, H] bf16
    topk_idx: torch.Tensor                   # [T, K] int64
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]  # [L] int32, accumulated in place
    return_recv_hook: bool
    rank_mask: Optional[torch.Tensor]        # [R] int32, 1 = masked (enable_shrink), or None
    wait_recv_cost_stats: Optional[torch.Tensor] = None  # [R] int64, NOTE [wait costs]: accumulated in place
    use_nvfp4: bool = False                  # NOTE [nvfp4] in semantics/quant.py; then use_fp8 is False
    x_global_scale: Optional[torch.Tensor] = None  # one float32, NVFP4's global scale (None: 1)

    @property
    def cast(self) -> int:
        """The payload's format as the call signature names it: 0 bf16, 1 FP8, 2 NVFP4."""
        return 2 if self.use_nvfp4 else int(self.use_fp8)


@dataclasses.dataclass
class LowLatencyDispatchResult:
    packed_recv_x: torch.Tensor              # [L, R*M, H]
    packed_recv_x_scales: Optional[torch.Tensor]
    packed_recv_count: torch.Tensor          # [L] int32
    handle: LowLatencyHandle
    hook: Optional[object]                   # callable receiving the data, when return_recv_hook


@dataclasses.dataclass(frozen=True)
class CombineOverlap:
    """NOTE [combine overlap] (kernels/low_latency_combine.cuh): the combine sends while the expert GEMM still
    writes `x`, a row once its block's signal is done."""
    comp_signal: torch.Tensor                # [L * signal_blocks] int32, per block of block_m rows of each expert
    signal_blocks: int                       # ceil(R * M / block_m)
    block_m: int
    threshold: int                           # a block is done once its signal reaches this
    num_sms: int                             # the sending launch's blocks
    packed_recv_count: torch.Tensor          # [L] int32: the dispatch's rows per expert (its blocks to wait for)


@dataclasses.dataclass(frozen=True)
class LowLatencyCombineRequest:
    x: torch.Tensor                          # [L, R*M, H] bf16
    topk_idx: torch.Tensor                   # [T, K] int64
    topk_weights: torch.Tensor               # [T, K] float32
    handle: LowLatencyHandle
    zero_copy: bool
    return_recv_hook: bool
    out: Optional[torch.Tensor]              # [T, H] bf16 or None
    rank_mask: Optional[torch.Tensor]        # as in LowLatencyDispatchRequest
    wait_recv_cost_stats: Optional[torch.Tensor] = None  # as in LowLatencyDispatchRequest
    overlap: Optional[CombineOverlap] = None
