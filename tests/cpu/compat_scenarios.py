"""Inputs DeepEP's V1 Buffer accepts that tokenyard must accept too, run on every rank of a RankPool: each
compares the lenient call with the plain call it must equal."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tokenyard import Buffer, quantize_fp8
from tokenyard.tools.testing import make_rank_inputs

from .scenarios import _world, assert_same, normal_buffer


def _layout(buffer, topk_idx, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def normal_leniencies(seed, num_tokens=24, hidden=256, num_experts=16, num_topk=4):
    """A handle used on another Buffer, a cached dispatch given num_worst_tokens, [T] scales, numpy sizes."""
    rank, num_ranks = _world()
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk)[rank]
    first = normal_buffer(num_tokens, hidden * 2)
    second = Buffer(dist.group.WORLD, np.int64(first.num_nvl_bytes), np.int32(0), backend="reference")
    assert isinstance(second.num_nvl_bytes, int) and second.num_nvl_bytes == first.num_nvl_bytes
    layout = _layout(first, topk_idx, np.int64(num_experts))  # numpy sizes, as DeepEP's binding takes them
    recv_x, recv_idx, recv_w, _, handle, _ = first.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    y = torch.randn(recv_x.shape, generator=torch.Generator().manual_seed(seed + rank)).to(torch.bfloat16)
    want = first.combine(y, handle, topk_weights=recv_w)

    # Another Buffer of the group takes the handle, as DeepEP's does: one of the same size replays its
    # rounds, one too small for them derives its own (NOTE [rounds]).
    small = normal_buffer(num_tokens // 3, hidden * 2)
    for other, what in ((second, "another Buffer"), (small, "a smaller Buffer")):
        got = other.combine(y, handle, topk_weights=recv_w)
        assert_same(f"combine on {what}", got[0], want[0])
        assert_same(f"combined weights on {what}", got[1], want[1])
        assert_same(f"cached dispatch on {what}", other.dispatch(x, handle=handle)[0], recv_x)
    assert small.normal_round_plan(num_tokens, hidden, num_topk).num_rounds > 1

    # A cached dispatch ignores num_worst_tokens, as DeepEP's does: the handle's rows.
    assert_same("cached dispatch with num_worst_tokens", first.dispatch(x, handle=handle, num_worst_tokens=4096)[0],
                recv_x)

    # [T] scales (one per token) come back as [N].
    data, scales = quantize_fp8(x)
    one_scale = scales[:, 0].contiguous()
    flat = first.dispatch((data, one_scale), topk_idx=topk_idx, topk_weights=weights, **layout)[0]
    column = first.dispatch((data, one_scale.view(-1, 1)), topk_idx=topk_idx, topk_weights=weights, **layout)[0]
    assert flat[1].dim() == 1 and column[1].dim() == 2
    assert_same("[T] scales received as [N]", flat[1], column[1].view(-1))
    assert_same("data with [T] scales", flat[0], column[0])
    for buffer in (first, second, small):
        buffer.destroy()
    return int(recv_x.size(0))


def low_latency_leniencies(seed, num_tokens=6, num_max=8, hidden=256, num_experts=8, num_topk=3):
    """use_logfmt (also with zero_copy) gives the plain combine; [R] int64 wait-cost stats are taken and, on
    the reference backend, left as they were; DeepEP's runtime queries answer."""
    rank, num_ranks = _world()
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk)[rank]
    buffer = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(num_max, hidden, num_ranks,
                                                                            num_experts), backend="reference")
    stats = torch.randint(0, 1 << 40, (num_ranks,), dtype=torch.int64)
    stats_before = stats.clone()
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, np.int64(num_max), np.int64(num_experts),
                                                          use_fp8=False, dispatch_wait_recv_cost_stats=stats)
    assert handle.num_max_dispatch_tokens_per_rank == num_max and isinstance(handle.num_experts, int)
    y = torch.randn(recv_x.shape, generator=torch.Generator().manual_seed(seed + rank)).to(torch.bfloat16)
    want = buffer.low_latency_combine(y, topk_idx, weights, handle)[0]
    got = buffer.low_latency_combine(y, topk_idx, weights, handle, use_logfmt=True,
                                     combine_wait_recv_cost_stats=stats)[0]
    assert_same("combine with use_logfmt", got, want)
    buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    got = buffer.low_latency_combine(torch.full_like(y, float("nan")), topk_idx, weights, handle, use_logfmt=True,
                                     zero_copy=True)[0]
    assert_same("zero-copy combine with use_logfmt", got, want)
    assert_same("wait-cost stats on the reference backend", stats, stats_before)

    runtime = buffer.runtime
    assert runtime.is_available() and runtime.get_num_rdma_ranks() == 1 and runtime.get_rdma_rank() == 0
    assert runtime.get_root_rdma_rank(True) == rank and runtime.get_root_rdma_rank(False) == 0
    assert runtime.get_local_device_id() == 0
    buffer.destroy()


def one_column_scales(seed, num_tokens=10, hidden=512, num_experts=16, num_topk=4):
    """SGLang's FP8 scales at hidden 512: the four UE8M0 exponents of a token packed in one int32, column-major with
    the token axis padded to 4, so the one column has stride 12 (a [T, 1] tensor is contiguous whatever that stride).
    Dispatched on one node, on 2 virtual nodes and by ElasticBuffer, they arrive as the same scales written row by
    row would."""
    from tokenyard import ElasticBuffer

    rank, num_ranks = _world()
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk)[rank]
    data = quantize_fp8(x)[0]
    exponents = torch.randint(100, 140, (num_tokens, 4), dtype=torch.int32,
                              generator=torch.Generator(device="cpu").manual_seed(seed + rank))
    packed = (exponents << torch.tensor([0, 8, 16, 24], dtype=torch.int32)).sum(1, dtype=torch.int32)
    storage = torch.zeros(1, (num_tokens + 3) // 4 * 4, dtype=torch.int32)
    storage[0, :num_tokens] = packed
    column_major = storage[:, :num_tokens].t()
    assert column_major.shape == (num_tokens, 1) and column_major.stride() == (1, 12)
    row_major = packed.view(-1, 1).contiguous()
    for per_node in (None, num_ranks // 2):
        buffer = normal_buffer(num_tokens, hidden * 2, ranks_per_node=per_node)
        layout = _layout(buffer, topk_idx, num_experts)
        (got, got_scales), *_, handle, _ = buffer.dispatch((data, column_major), topk_idx=topk_idx,
                                                           topk_weights=weights, **layout)
        (want, want_scales), *_ = buffer.dispatch((data, row_major), topk_idx=topk_idx, topk_weights=weights,
                                                  **layout)
        assert_same(f"data, ranks_per_node {per_node}", got, want)
        assert_same(f"one-column scales, ranks_per_node {per_node}", got_scales, want_scales)
        assert_same(f"cached, ranks_per_node {per_node}", buffer.dispatch((data, column_major), handle=handle)[0][1],
                    want_scales)
        buffer.destroy()
    elastic = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden, backend="reference")
    for do_expand in (False, True):
        got = elastic.dispatch((data, column_major), topk_idx, weights, num_experts=num_experts, do_expand=do_expand)
        want = elastic.dispatch((data, row_major), topk_idx, weights, num_experts=num_experts, do_expand=do_expand)
        assert_same(f"ElasticBuffer scales, do_expand {do_expand}", got[0][1], want[0][1])
    elastic.destroy()
