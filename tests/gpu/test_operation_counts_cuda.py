"""The transport seam's operation counters (NOTE [operation counters] in include/tokenyard/operation_counts.cuh) on
virtual nodes, device machine only (4 ranks as 2 nodes x 2, where only 2 GPUs 2 x 1): under
TOKENYARD_COUNT_OPERATIONS=1, what each rank's kernels asked of the transport in one low-latency dispatch (FP8) and
combine and one internode normal dispatch and combine, read and zeroed after each call, must be the exact counts of
NOTE [exact operation counts] (backends/cuda/operation_counts.py) from that call's routing (every rank's top-k ids
and is_token_in_rank, gathered): per destination rank, and by destination kind through the default form of
`Buffer.runtime.operation_counts()`."""

from __future__ import annotations

import pytest
import torch

from tokenyard.jit import nvshmem

from . import spawn

pytestmark = [spawn.needs_ranks(),
              pytest.mark.skipif(nvshmem.find() is None, reason="needs NVSHMEM (pip install tokenyard[internode])")]


def _layouts():
    """(num_ranks, ranks_per_node): 2 x 2 where 4 ranks run, else 2 x 1."""
    counts = spawn.rank_counts()
    return [(4, 2)] if 4 in counts else [(2, 1)] if 2 in counts else []


def _counted_calls(seed, ranks_per_node):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.backends.cuda import operation_counts as counted
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 64, 2048, 8 * num_ranks, 4
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform",
                                            "bf16", device)[rank]
    nvl_bytes = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    rdma_bytes = max(64 << 20, Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts))
    buffer = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="cuda", ranks_per_node=ranks_per_node,
                    timeout_s=30)
    backend = buffer.runtime
    backend.use_low_latency_kernels = True
    assert backend._low_latency_kernels.remote != 0, "the low-latency kernels put to no rank"
    backend.operation_counts()  # from zero

    def gathered(t):
        out = [None] * num_ranks
        dist.all_gather_object(out, t.cpu())
        return out

    def check(what, got, want):
        wrong = counted.differences(got, want)
        assert not wrong, f"rank {rank}, {what}: " + "; ".join(wrong)

    # Low latency: the grid is every SM this rank may fill.
    every_topk_idx = gathered(topk_idx)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=True)
    torch.cuda.synchronize()
    want = counted.low_latency("dispatch", every_topk_idx, rank, num_experts, ranks_per_node, hidden,
                               backend.device_sms, cast=1)
    got = backend.operation_counts()  # by kind
    assert got == counted.by_kind(want, rank, ranks_per_node), \
        f"rank {rank}, low-latency dispatch: counted {got}, expected {counted.by_kind(want, rank, ranks_per_node)}"
    assert got["puts_remote"] > 0 and got["puts_node"] == got["puts_self"] == 0, got
    y = torch.zeros(recv[0].shape, dtype=torch.bfloat16, device=device)  # the values do not count
    buffer.low_latency_combine(y, topk_idx, weights, handle)
    torch.cuda.synchronize()
    check("low-latency combine", backend.operation_counts(per_peer=True),
          counted.low_latency("combine", every_topk_idx, rank, num_experts, ranks_per_node, hidden,
                              backend.device_sms))

    # Normal mode: one round each (the region holds the call), on min(Config.num_sms, the SMs it may fill) blocks.
    config = Config()
    num_blocks = max(1, min(config.num_sms, backend.device_sms))
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, normal_handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, config=config)
    torch.cuda.synchronize()
    rounds = backend._internode_kernels().rounds
    assert rounds["dispatch"] == 1, rounds
    every_in_rank = gathered(in_rank)
    # ReferenceBackend.payload's row: the token's data, its source index (int32), top-k ids and weights.
    row_bytes = x.element_size() * hidden + 4 + (topk_idx.element_size() + weights.element_size()) * num_topk
    check("normal dispatch", backend.operation_counts(per_peer=True),
          counted.normal("dispatch", every_in_rank, rank, ranks_per_node, num_blocks, row_bytes=row_bytes))
    buffer.combine(recv_x, normal_handle, topk_weights=recv_w, config=config)
    torch.cuda.synchronize()
    assert rounds["combine"] == 1, rounds
    got = backend.operation_counts(per_peer=True)
    check("normal combine", got, counted.normal("combine", every_in_rank, rank, ranks_per_node, num_blocks,
                                                hidden=hidden, num_topk=recv_w.size(1)))
    buffer.destroy()
    return {"rank": rank, "normal combine puts": got["puts"], "quiets": got["quiets"]}


@pytest.mark.parametrize("num_ranks,ranks_per_node", _layouts())
def test_the_counters_hold_the_exact_counts_of_each_internode_call(num_ranks, ranks_per_node, seed, monkeypatch):
    monkeypatch.setenv("TOKENYARD_COUNT_OPERATIONS", "1")  # the ranks' processes read it at their start
    reports = spawn.run(num_ranks, _counted_calls, seed, ranks_per_node, timeout_s=420.0, fresh=True)
    print(f"operation counters, {num_ranks // ranks_per_node} nodes x {ranks_per_node} on "
          f"{spawn.describe(num_ranks)}, seed {seed}: {reports}")
