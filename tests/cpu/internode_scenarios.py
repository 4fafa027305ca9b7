"""Internode normal mode (virtual nodes) on every rank of a RankPool, against tokenyard.semantics.routing and
properties of the handle checked across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenyard import DispatchHandle, InternodeHandle
from tokenyard.semantics import routing
from tokenyard.tools.testing import make_rank_inputs

from .scenarios import _split, _world, assert_same, normal_buffer


def _independent_per_node(topk_idx, num_experts, num_ranks, ranks_per_node):
    """Tokens with an expert on each node, counted by loops, without routing.py."""
    experts_per_node = num_experts // num_ranks * ranks_per_node
    per_node = torch.zeros(num_ranks // ranks_per_node, dtype=torch.int32)
    for row in topk_idx.tolist():
        for node in {e // experts_per_node for e in row if e >= 0}:
            per_node[node] += 1
    return per_node


def _gathered(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _check_heads_across_ranks(handle, ranks_per_node):
    """NOTE [internode handle], checked from its definition across ranks (not from the oracle): a token's
    send_rdma_head row on forwarder (m, l) has the send_nvl_head row whose entry j is the row it landed at on
    rank (m, j), and that row's recv_src_meta names the token."""
    rank, num_ranks = _world()
    handles = _gathered(tuple(t.clone() for t in handle) + (handle.flat.send_head.clone(),))
    for s in range(num_ranks):
        in_rank, send_rdma_head, send_head = handles[s][0], handles[s][8], handles[s][10]
        for t in range(in_rank.size(0)):
            for m in range(num_ranks // ranks_per_node):
                nodes_ranks = range(m * ranks_per_node, (m + 1) * ranks_per_node)
                f = int(send_rdma_head[t, m])
                assert (f >= 0) == bool(in_rank[t, m * ranks_per_node:(m + 1) * ranks_per_node].any())
                if f < 0:
                    continue
                forwarder = m * ranks_per_node + s % ranks_per_node
                nvl_row = handles[forwarder][9][f]
                for j, q in enumerate(nodes_ranks):
                    assert int(nvl_row[j]) == int(send_head[t, q]), f"token {t} of rank {s}: nvl head on rank {q}"
                    if send_head[t, q] >= 0:
                        meta = handles[q][7][int(send_head[t, q])].tolist()
                        assert meta == [s, t], f"rank {q} row {int(send_head[t, q])}: meta {meta}, want {[s, t]}"


def internode_round_trip(seed, ranks_per_node, num_tokens, hidden, num_experts, num_topk, kind, dtype,
                         num_worst_tokens=0, num_biases=1):
    rank, num_ranks = _world()
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, dtype)
    x, topk_idx, topk_weights = inputs[rank]
    data, scales = _split(x)
    buffer = normal_buffer(num_tokens, hidden * max(data.element_size(), 2), ranks_per_node=ranks_per_node)
    assert buffer.runtime.get_num_rdma_ranks() == num_ranks // ranks_per_node

    # Layout: num_tokens_per_rdma_rank counts the tokens with an expert on each node.
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert_same("num_tokens_per_rdma_rank", per_rdma_rank,
                _independent_per_node(topk_idx, num_experts, num_ranks, ranks_per_node))

    # Dispatch: the one-node meaning, bit for bit; the handle's ten fields as the oracle's stages make them.
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        num_worst_tokens=num_worst_tokens)
    assert isinstance(handle, InternodeHandle) and len(handle) == 10
    oracle = routing.dispatch([_split(i[0])[0] for i in inputs], [_split(i[0])[1] for i in inputs],
                              [i[1] for i in inputs], [i[2] for i in inputs], num_experts)
    mine = oracle[rank]
    num_recv = mine["recv_x"].size(0)
    recv_data, recv_scales = _split(recv_x)
    if num_worst_tokens:
        assert recv_data.size(0) == num_worst_tokens and per_expert_list == [] and handle.num_recv_tokens is None
        assert bool((recv_idx[num_recv:] == -1).all()) and bool((recv_w[num_recv:] == 0).all())
    else:
        assert per_expert_list == mine["num_recv_tokens_per_expert_list"] and handle.num_recv_tokens == num_recv
    assert_same("recv_x", recv_data[:num_recv], mine["recv_x"])
    assert_same("recv_x_scales", None if recv_scales is None else recv_scales[:num_recv], mine["recv_x_scales"])
    assert_same("recv_topk_idx", recv_idx[:num_recv], mine["recv_topk_idx"])
    assert_same("recv_topk_weights", recv_w[:num_recv], mine["recv_topk_weights"])
    fields = routing.internode_handles([o["is_token_in_rank"] for o in oracle], ranks_per_node,
                                       num_worst_tokens)[rank]
    for name, want in fields.items():
        assert_same(f"handle.{name}", getattr(handle, name), want)
    assert handle[7] is handle.recv_src_meta and handle.num_rows == recv_data.size(0)
    for name in ("rank_prefix_matrix", "recv_src_idx", "send_head", "is_token_in_rank"):
        got = getattr(handle.flat, name)
        assert_same(f"handle.flat.{name}", got[:num_recv] if name == "recv_src_idx" else got, mine[name])
    _check_heads_across_ranks(handle, ranks_per_node)

    # Cached dispatch, with our handle and with DeepEP's plain 10-tuple: the same rows.
    for what, h in (("handle", handle), ("10-tuple", tuple(handle))):
        again = buffer.dispatch(x, handle=h)
        assert again[1:5] == (None, None, None, None)
        assert_same(f"cached ({what}) recv_x", _split(again[0])[0][:num_recv], mine["recv_x"])
        assert _split(again[0])[0].size(0) == recv_data.size(0)
        assert_same(f"cached ({what}) scales", _split(again[0])[1], recv_scales)

    # Combine: reduced inside each node first, against the internode oracle; also with the plain tuple.
    rows = [torch.randn(o["recv_x"].size(0), hidden, generator=torch.Generator().manual_seed(seed + 7 * r + 1))
            .to(torch.bfloat16) for r, o in enumerate(oracle)]
    biases = [tuple(torch.randn(o["send_head"].size(0), hidden, generator=torch.Generator().manual_seed(seed - r - b))
                    .to(torch.bfloat16) for b in range(num_biases)) for r, o in enumerate(oracle)]
    y, y_weights = rows[rank], recv_w[:num_recv]
    if num_worst_tokens:
        y = torch.cat([y, torch.full((num_worst_tokens - num_recv, hidden), float("nan"), dtype=torch.bfloat16)])
        y_weights = recv_w
    bias = biases[rank][0] if num_biases == 1 else biases[rank] if num_biases else None
    send_heads = [o["send_head"] for o in oracle]
    want_x, want_w = routing.internode_combine(rows, send_heads, ranks_per_node,
                                               [o["recv_topk_weights"] for o in oracle], biases)
    for what, h in (("handle", handle), ("10-tuple", tuple(handle))):
        combined, combined_w, _ = buffer.combine(y, h, topk_weights=y_weights, bias=bias)
        assert_same(f"combined_x ({what})", combined, want_x[rank])
        assert_same(f"combined_topk_weights ({what})", combined_w, want_w[rank])
    plain, none_w, _ = buffer.combine(y, handle)
    assert none_w is None
    assert_same("combined_x without bias or weights", plain, routing.internode_combine(rows, send_heads,
                                                                                       ranks_per_node)[0][rank])

    # A Buffer that sees the group as one node takes the handle as its one-node equivalent (also derived from
    # the plain 10-tuple), and combines flat.
    flat_buffer = normal_buffer(num_tokens, hidden * max(data.element_size(), 2), ranks_per_node=num_ranks)
    derived = flat_buffer._handle_for_nodes(InternodeHandle(*handle))
    assert isinstance(derived, DispatchHandle)
    for name in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head"):
        assert_same(f"derived flat {name}", getattr(derived, name), getattr(handle.flat, name))
    assert handle.rounds.num_rounds == 1
    for what, h in (("handle", handle), ("10-tuple", tuple(handle))):
        flat_combined, _, _ = flat_buffer.combine(y, h)
        assert_same(f"one-node combine of the internode {what}", flat_combined,
                    routing.combine(rows, send_heads)[0][rank])
    assert_same("one-node cached dispatch of the internode handle",
                _split(flat_buffer.dispatch(x, handle=handle)[0])[0][:num_recv], mine["recv_x"])
    flat_buffer.destroy()
    buffer.destroy()
    return num_recv


def one_node_handle_refused_on_nodes(seed, ranks_per_node):
    """A one-node handle on a Buffer of several nodes is refused before anything moves, on every rank."""
    from tokenyard.errors import HandleError

    rank, num_ranks = _world()
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, 8, 128, 4 * num_ranks, 2)[rank]
    flat_buffer = normal_buffer(8, 256, ranks_per_node=num_ranks)
    layout = flat_buffer.get_dispatch_layout(topk_idx, 4 * num_ranks)
    assert layout[1] is None
    handle = flat_buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                  num_tokens_per_expert=layout[2], topk_idx=topk_idx)[4]
    buffer = normal_buffer(8, 256, ranks_per_node=ranks_per_node)
    try:
        buffer.dispatch(x, handle=handle)
    except HandleError as exc:
        assert "one-node handle" in str(exc)
    else:
        raise AssertionError("a one-node handle was taken by a Buffer of several nodes")
    buffer.destroy()
    flat_buffer.destroy()


def normal_mode_refused_with_cuda_backend_on_nodes(ranks_per_node):
    """NOTE [internode normal mode] on a Buffer: a stand-in for the CUDA backend's decision, as the CPU has none."""
    from tokenyard.errors import BackendUnavailableError

    buffer = normal_buffer(8, 256, ranks_per_node=ranks_per_node)
    buffer._normal_runtime = None  # what backend="cuda" leaves on several nodes
    try:
        buffer.get_dispatch_layout(torch.zeros(2, 2, dtype=torch.int64), 4 * dist.get_world_size())
    except BackendUnavailableError as exc:
        assert "internode kernels" in str(exc)
    else:
        raise AssertionError("normal mode ran without a backend for it")
    buffer.destroy()



def autograd_on_nodes(seed, ranks_per_node, num_tokens, hidden, num_experts, num_topk):
    """tokenyard.layers.autograd on several nodes: dispatch's backward is the internode combine of the
    gradients, combine's backward the cached dispatch of its gradient (docs/semantics.md)."""
    from tokenyard.layers import autograd

    rank, num_ranks = _world()
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform", "bf16")
    x, topk_idx, topk_weights = inputs[rank]
    buffer = normal_buffer(num_tokens, hidden * 2, ranks_per_node=ranks_per_node)
    oracle = routing.dispatch([i[0] for i in inputs], [None] * num_ranks, [i[1] for i in inputs],
                              [i[2] for i in inputs], num_experts)
    grads = [torch.randn(o["recv_x"].size(0), hidden, generator=torch.Generator().manual_seed(seed + 3 * r))
             .to(torch.bfloat16) for r, o in enumerate(oracle)]
    x = x.clone().requires_grad_()
    recv_x, _, _, _, handle = autograd.dispatch(buffer, x, topk_idx, topk_weights, num_experts)
    assert isinstance(handle, InternodeHandle)
    recv_x.backward(grads[rank])
    want = routing.internode_combine(grads, [o["send_head"] for o in oracle], ranks_per_node)[0][rank]
    assert_same("dispatch backward", x.grad, want)

    y = recv_x.detach().clone().requires_grad_()
    combined = autograd.combine(buffer, y, handle)[0]
    grad_out = [torch.randn(i[0].size(0), hidden, generator=torch.Generator().manual_seed(seed - 5 * r))
                .to(torch.bfloat16) for r, i in enumerate(inputs)]
    combined.backward(grad_out[rank])
    want_rows = routing.dispatch(grad_out, [None] * num_ranks, [i[1] for i in inputs], [i[2] for i in inputs],
                                 num_experts)[rank]["recv_x"]
    assert_same("combine backward", y.grad, want_rows)
    buffer.destroy()
