"""A Buffer lets go of its group as soon as it is dropped (NOTE [gloo threads at exit] in tokenyard/tools/launch.py)."""

import gc
import weakref

import pytest
import torch.distributed as dist

from tokenyard import Buffer
from tokenyard.tools.testing import make_rank_inputs

from . import scenarios

NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 8, 256, 8, 2


def _buffer_after_calls(low_latency: bool) -> Buffer:
    """A Buffer that has made one round trip, in normal or low-latency mode."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, topk_idx, topk_weights = make_rank_inputs(0, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK)[rank]
    if low_latency:
        buffer = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks,
                                                                                   NUM_EXPERTS), backend="reference")
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
        buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
        return buffer
    buffer = scenarios.normal_buffer(NUM_TOKENS, HIDDEN * 2)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 topk_weights=topk_weights)
    buffer.combine(recv_x, handle)
    return buffer


def dropped_buffer_is_freed_without_the_collector(low_latency: bool) -> bool:
    gc.collect()
    gc.disable()
    try:
        freed = weakref.ref(_buffer_after_calls(low_latency))
        return freed() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_a_dropped_buffer_is_freed_at_once_not_by_the_garbage_collector(ranks, low_latency):
    # A reference cycle would keep the Buffer, its group and gloo's worker threads alive until the
    # interpreter's last collection, where a worker can abort the process.
    assert ranks(2).run(dropped_buffer_is_freed_without_the_collector, low_latency) == [True, True]
