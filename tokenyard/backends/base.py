"""The interface every backend implements, and the group context they share.

A backend receives requests the front-end has already checked (requests.py) and runs them on the
current stream; the front-end owns stream switching, events and handle bookkeeping.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError
from ..plan.devices import Topology
from ..semantics import expand
from .collectives import Collectives
from .requests import (CombineRequest, DispatchRequest, DispatchResult, LowLatencyCombineRequest,
                       LowLatencyDispatchRequest, LowLatencyDispatchResult)


@dataclasses.dataclass
class GroupContext:
    """Who we are in the EP group, where every rank works, and how to exchange with the group: small host
    objects (`all_gather_object`) and tensors of `device` (`collectives`, NOTE [device collectives])."""

    group: Optional[dist.ProcessGroup]
    rank: int
    num_ranks: int
    device: torch.device
    all_gather_object: Callable[[Any], List[Any]]
    num_nvl_bytes: int
    num_rdma_bytes: int
    timeout_s: float
    topology: Topology
    collectives: Collectives


class Backend(abc.ABC):
    """One implementation of the tokenyard operations."""

    name: str = "?"
    # Normal-mode calls that wait for no count on the host may be captured in a CUDA graph (NOTE [graph
    # capture] in buffer.py): what they signal is counted on the GPU.
    CAPTURES_NORMAL_MODE = False

    def __init__(self, ctx: GroupContext):
        self.ctx = ctx
        self.poison_outputs = False  # tests set it: outputs start as 0xAB bytes, so unwritten rows show

    # -- DeepEP's runtime queries (`buffer.runtime.*` in DeepEP code): nodes of `topology.ranks_per_node` ranks
    # (NOTE [virtual nodes] in devices.py), an RDMA rank per node ------------------------------------------

    def is_available(self) -> bool:
        return True

    def get_num_rdma_ranks(self) -> int:
        return self.ctx.topology.num_nodes

    def get_rdma_rank(self) -> int:
        return self.ctx.topology.node

    def get_root_rdma_rank(self, global_: bool) -> int:
        """The rank of this rank's peer on the first node: in the group with `global_`, else in its node."""
        return self.ctx.topology.local_rank if global_ else 0

    def get_local_device_id(self) -> int:
        return self.ctx.device.index if self.ctx.device.type == "cuda" and self.ctx.device.index is not None else 0

    def wants_call_agreement(self, low_latency: bool) -> bool:
        """Whether the front-end agrees on each call (normal or low-latency mode) before this backend runs it
        (NOTE [call agreement] in collectives.py): a host exchange per call, which plain collectives need."""
        return False

    def empty(self, *shape, dtype: torch.dtype, device) -> torch.Tensor:
        """An output tensor, poisoned where the tests ask for it."""
        t = torch.empty(*shape, dtype=dtype, device=device)
        if self.poison_outputs and t.numel():
            t.view(torch.uint8).fill_(0xAB)
        return t

    # DeepEP V2's expanded layout (tokenyard/semantics/expand.py): what a backend may do faster.
    def expanded_layout(self, recv_topk_idx: torch.Tensor, recv_src_idx: torch.Tensor, psum_per_rank: torch.Tensor,
                        num_local: int, alignment: int, num_max: int, num_expanded: Optional[int]):
        """A dispatch's layout for its `EPHandle`: -> (counts [L], psum_per_expert [L], row_of [N, K],
        source_row [M], recv_src_metadata [N, K + 2]), all int32; psum_per_expert is where each expert's rows end
        (expanded: its group's end; else the running sum of the aligned counts); row_of and source_row None unless
        expanded (`num_expanded` rows)."""
        if num_expanded is None:
            counts, row_of, source_row = expand.expert_counts(recv_topk_idx, num_local), None, None
            psum = torch.cumsum(expand.align(counts, alignment), 0, dtype=torch.int32)
        else:
            row_of, counts, psum = expand.expand_rows(recv_topk_idx, num_local, alignment)
            source_row = expand.source_rows(row_of, num_expanded)
        return counts, psum, row_of, source_row, expand.source_metadata(recv_topk_idx, recv_src_idx, psum_per_rank,
                                                                        num_max, row_of)

    def source_ranks(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        return expand.source_ranks(topk_idx, num_experts)

    def expands_in_dispatch(self, num_sms: int, fresh: bool) -> bool:
        """Whether a dispatch (`fresh`, else cached) on `num_sms` SMs takes DispatchRequest.expansion (NOTE
        [expanded rows] in kernels/dispatch.cuh), rather than `gather_rows` (or the expanded layout's kernels) after
        it."""
        del num_sms, fresh
        return False

    def gather_rows(self, rows: torch.Tensor, source_row: torch.Tensor, zero_fill: bool) -> torch.Tensor:
        return expand.gather_rows(rows, source_row, zero_fill)

    def reduce_expanded(self, x: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        return expand.reduce_expanded(x, row_of)

    def expand_weights(self, topk_weights: torch.Tensor, row_of: torch.Tensor, num_expanded: int,
                       zero_fill: bool) -> torch.Tensor:
        return expand.expand_weights(topk_weights, row_of, num_expanded, zero_fill)

    def gather_weights(self, topk_weights: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        return expand.gather_weights(topk_weights, row_of)

    def local_weights(self, topk_weights: torch.Tensor, recv_topk_idx: torch.Tensor) -> torch.Tensor:
        return expand.local_weights(topk_weights, recv_topk_idx)

    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """-> (num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])."""

    @abc.abstractmethod
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """With `request.placement`, the round's rows go into the placement's tensors, which the result
        holds; a placement without tensors (round 0 of a call in rounds, with `request.call`) has the result
        hold the whole call's tensors, this round's rows placed, and report most_call_tokens. A placement
        with a cursor has its recv_first written and the cursor advanced first (NOTE [placed rounds]); a
        `request.call` has its prefix_matrix written."""

    @abc.abstractmethod
    def combine(self, request: CombineRequest):
        """-> (combined_x [T, H], combined_topk_weights [T, K] or None); with `request.placement`, the
        placement's tensors, written."""

    @abc.abstractmethod
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult: ...

    @abc.abstractmethod
    def low_latency_combine(self, request: LowLatencyCombineRequest):
        """-> (combined_x [T, H] bf16, hook or None)."""

    @abc.abstractmethod
    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """This rank's raw communication buffer as a uint8 tensor."""

    @abc.abstractmethod
    def next_low_latency_combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                        num_experts: int) -> torch.Tensor:
        """The bf16 [L, R*M, H] tensor a zero-copy low-latency combine reads."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset low-latency signalling state; nothing to do where there is none."""

    def start_internode(self) -> None:
        """Make what internode normal-mode calls need, with the Buffer (NOTE [internode start] in
        backends/cuda/backend.py); nothing where there is nothing to make."""

    def operation_counts(self, per_peer: bool = False) -> dict:
        """What this rank's kernels asked of the transport between nodes since the last read (NOTE [operation
        counters] in include/tokenyard/operation_counts.cuh); only the CUDA backend's internode kernels count.

        Raises:
            BackendUnavailableError: always here; on the CUDA backend where nothing counts.
        """
        raise BackendUnavailableError(f"the {self.name} backend counts no transport operations (NOTE [operation "
                                      "counters]: the CUDA backend's internode kernels, TOKENYARD_COUNT_OPERATIONS=1)")

    def destroy(self, together: bool = True) -> None:
        """Release resources; the backend is unusable afterwards. `together`: every rank of the group makes
        this call at this point (Buffer.destroy), so shared memory can be released in step."""
