"""`Config`: the performance settings of one normal-mode call, with DeepEP's constructor."""

from __future__ import annotations

import dataclasses

from .plan import workspace


# The ranks of a node as DeepEP's size hints assume (its NUM_MAX_NVL_PEERS): a group of more spans several nodes.
DEEPEP_RANKS_PER_NODE = 8


@dataclasses.dataclass
class Config:
    """Performance settings for normal-mode dispatch/combine.

    The positional arguments are DeepEP's, so ``Config(24, 6, 256, 6, 128)`` works unchanged.

    Arguments:
        num_sms: SMs the CUDA kernels may occupy (even; the reference backend ignores it).
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: DeepEP's NVLink queue chunking.
            tokenyard sends into fixed-size per-source regions (docs/semantics.md), so these are accepted
            and ignored.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: DeepEP's RDMA chunking;
            accepted and ignored (internode normal mode runs over the group's collectives, no RDMA kernels yet).
        num_max_tokens_per_rank: tokenyard's own, keyword only: how many tokens per rank the size hints
            make room for.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256
    num_max_tokens_per_rank: int = dataclasses.field(default=workspace.DEFAULT_HINT_TOKENS_PER_RANK,
                                                     kw_only=True)

    def __post_init__(self):
        if self.num_sms <= 0:
            raise ValueError(f"Config.num_sms must be positive, got {self.num_sms}")
        if self.num_max_tokens_per_rank <= 0:
            raise ValueError(f"Config.num_max_tokens_per_rank must be positive, got {self.num_max_tokens_per_rank}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """`num_nvl_bytes` for tokens of `hidden_bytes` (``hidden * max(element_size, 2)``) on `num_ranks`: room
        for `num_max_tokens_per_rank` tokens in one round (a call with more tokens runs in rounds)."""
        return workspace.normal_size_hint(hidden_bytes, num_ranks, self.num_max_tokens_per_rank)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """`num_rdma_bytes` for normal mode: 0 on one node (up to 8 ranks, as DeepEP assumes), where every rank is
        reached over NVLink; on nodes of 8, what the CUDA backend's internode kernels keep for any routing of
        `num_max_tokens_per_rank` tokens of `hidden_bytes` per rank (NOTE [internode region] in
        backends/cuda/internode.py: each half holds, at most, a row from every token of every rank plus a row per
        node for each of this rank's tokens; a combine row, the larger). The reference backend's hierarchical path
        needs none."""
        return self.internode_region_bytes(hidden_bytes, num_ranks, DEEPEP_RANKS_PER_NODE)

    def internode_region_bytes(self, hidden_bytes: int, num_ranks: int, ranks_per_node: int) -> int:
        """tokenyard's own: `get_rdma_buffer_size_hint` for nodes of `ranks_per_node` ranks (virtual nodes
        included, NOTE [virtual nodes] in plan/devices.py); 0 where the group is one node."""
        num_nodes = num_ranks // ranks_per_node if 0 < ranks_per_node < num_ranks else 1
        if num_nodes == 1:
            return 0
        row = hidden_bytes + 32 * 4 + 64  # a combine row: the data, up to 32 weights, padding
        return 2 * (num_ranks + num_nodes) * self.num_max_tokens_per_rank * row
