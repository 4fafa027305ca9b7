"""DeepEP V2's `ElasticBuffer` on every rank of a RankPool, against an oracle written here with loops (not with
tokenyard/semantics/expand.py, which the ElasticBuffer itself runs), from docs/semantics.md "ElasticBuffer"."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tokenyard
from tokenyard.tools.testing import make_rank_inputs

from .scenarios import _bits, _split, _world


def _align(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def received(inputs, rank, num_ranks, num_experts):
    """Rank `rank`'s received rows in order (source rank, then token): (source, token, local ids [K])."""
    num_local = num_experts // num_ranks
    rows = []
    for s in range(num_ranks):
        for t, ids in enumerate(inputs[s][1].tolist()):
            local = [e - rank * num_local if rank * num_local <= e < (rank + 1) * num_local else -1 for e in ids]
            if any(e >= 0 for e in local):
                rows.append((s, t, local))
    return rows


def expanded_rows(rows, num_local, alignment):
    """Per (row j, slot k) its expanded row, and the expanded row count: experts in order, pairs by j within,
    each expert's block starting aligned."""
    row_of, start = {}, 0
    for e in range(num_local):
        pairs = [(j, k) for j, (_, _, local) in enumerate(rows) for k, le in enumerate(local) if le == e]
        for i, pair in enumerate(pairs):
            row_of[pair] = start + i
        start = _align(start + len(pairs), alignment)
    return row_of, start


def round_trip(seed, num_tokens, hidden, num_experts, num_topk, kind, dtype, do_expand, alignment, do_cpu_sync):
    rank, num_ranks = _world()
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, dtype)
    x, topk_idx, topk_weights = inputs[rank]
    num_local = num_experts // num_ranks
    num_max = num_tokens + 3
    buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_max, hidden=hidden,
                                     num_topk=num_topk, backend="reference")
    stats = torch.full((num_local,), 5, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, topk_idx, topk_weights, stats, num_experts, expert_alignment=alignment, handle=None,
        do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_expand)
    assert event.event is None

    rows = received(inputs, rank, num_ranks, num_experts)
    num_rows = len(rows)
    data, scales = _split(recv_x)
    want_counts = [sum(local.count(e) for _, _, local in rows) for e in range(num_local)]
    assert stats.tolist() == [5 + c for c in want_counts], "stats must add each local expert's pairs"
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == want_counts
    psum = handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
    assert psum == [sum(1 for s, _, _ in rows if s <= q) for q in range(num_ranks)]
    if do_cpu_sync:
        assert handle.num_recv_tokens == num_rows
        assert handle.num_recv_tokens_per_expert_list == [_align(c, alignment) for c in want_counts]
    else:
        assert handle.num_recv_tokens == num_ranks * num_max and handle.num_recv_tokens_per_expert_list == []
    meta = handle.recv_src_metadata
    for j, (s, t, local) in enumerate(rows):
        first = min(k for k, e in enumerate(local) if e >= 0)
        assert meta[j, :2].tolist() == [s * num_max + t, s * num_topk + first], f"metadata of row {j}"

    src_data = [_split(i[0])[0] for i in inputs]
    src_scales = [_split(i[0])[1] for i in inputs]
    if not do_expand:
        assert data.size(0) == (num_rows if do_cpu_sync else num_ranks * num_max)
        for j, (s, t, local) in enumerate(rows):
            assert torch.equal(_bits(data[j]), _bits(src_data[s][t])), f"recv_x row {j}"
            if scales is not None:
                assert torch.equal(scales[j], src_scales[s][t]), f"scales row {j}"
            assert recv_idx[j].tolist() == local, f"recv_topk_idx row {j}"
            assert torch.equal(recv_w[j], inputs[s][2][t]), f"recv_topk_weights row {j}: every slot's weight"
        assert bool((recv_idx[num_rows:] == -1).all())
        psum_e = torch.cumsum(torch.tensor([_align(c, alignment) for c in want_counts]), 0)
        assert handle.psum_num_recv_tokens_per_expert.tolist() == psum_e.tolist()
        outputs = torch.randn(data.size(0), hidden, generator=torch.Generator().manual_seed(seed + rank)).to(
            torch.bfloat16)
        sent = outputs[:num_rows]
        weights_back = recv_w * (rank + 2)
    else:
        row_of, num_expanded = expanded_rows(rows, num_local, alignment)
        assert recv_idx is None
        if do_cpu_sync:
            assert data.size(0) == num_expanded == handle.num_expanded_tokens
        filled = set(row_of.values())
        for (j, k), m in row_of.items():
            s, t, _ = rows[j]
            assert torch.equal(_bits(data[m]), _bits(src_data[s][t])), f"expanded row {m}"
            if scales is not None:
                assert torch.equal(scales[m], src_scales[s][t])
            assert recv_w[m] == inputs[s][2][t, k], f"expanded weight {m}"
        for m in range(num_expanded):
            if m not in filled:  # padding, zeroed as asked
                assert not _bits(data[m]).any() and recv_w[m] == 0, f"padding row {m} must be zero"
        ends, start = [], 0
        for c in want_counts:
            ends.append(start + c)
            start = _align(start + c, alignment)
        assert handle.psum_num_recv_tokens_per_expert.tolist() == ends
        for j in range(num_rows):
            assert meta[j, 2:].tolist() == [row_of.get((j, k), -1) for k in range(num_topk)]
        outputs = torch.randn(data.size(0), hidden, generator=torch.Generator().manual_seed(seed + rank)).to(
            torch.bfloat16)
        # Each received row goes back as its pairs' expert outputs summed in slot order.
        sent = torch.stack([
            torch.stack([outputs[row_of[(j, k)]].float() for k in range(num_topk) if (j, k) in row_of]).sum(0)
            for j in range(num_rows)]).to(torch.bfloat16) if num_rows else outputs[:0]
        weights_back = recv_w * (rank + 2)

    # Cached dispatch: the same rows again, through the handle.
    again_x, again_idx, again_w, again_handle, _ = buffer.dispatch(x, handle=handle, topk_weights=topk_weights,
                                                                   do_expand=do_expand, do_zero_padding=do_expand)
    assert again_handle is handle
    valid = num_rows if not do_expand else data.size(0)
    assert torch.equal(_bits(_split(again_x)[0][:valid]), _bits(data[:valid])), "cached dispatch rows"
    if do_expand:
        assert again_idx is None and torch.equal(again_w, recv_w)
    else:
        assert torch.equal(again_idx, recv_idx) and torch.equal(again_w[:num_rows], recv_w[:num_rows])

    # Combine, with bias, against the loop oracle: each rank's rows and the weights it hands back.
    sents = [None] * num_ranks
    dist.all_gather_object(sents, (rank, sent))
    sents = dict(sents)
    bias = torch.randn(topk_idx.size(0), hidden, generator=torch.Generator().manual_seed(seed - rank)).to(
        torch.bfloat16)
    combined, combined_w, _ = buffer.combine(outputs, handle, weights_back, bias)
    for t, ids in enumerate(topk_idx.tolist()):
        acc = bias[t].float()
        owners = sorted({e // num_local for e in ids if e >= 0})
        for q in owners:
            j = [i for i, (s, tt, _) in enumerate(received(inputs, q, num_ranks, num_experts))
                 if (s, tt) == (rank, t)][0]
            acc = acc + sents[q][j].float()
        assert torch.equal(combined[t], acc.to(torch.bfloat16)), f"combined token {t}"
        owner_factor = torch.tensor([e // num_local + 2 if e >= 0 else 0 for e in ids], dtype=torch.float32)
        assert torch.equal(combined_w[t], topk_weights[t] * owner_factor), f"combined weights {t}"
    buffer.destroy()
    return num_rows


def refusals(seed):
    rank, num_ranks = _world()
    x, topk_idx, topk_weights = make_rank_inputs(seed, num_ranks, 8, 128, 4 * num_ranks, 2)[rank]
    buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8, hidden=128, backend="reference")
    errors = []
    for call in (lambda: buffer.dispatch(x, topk_idx, num_experts=4 * num_ranks, num_max_tokens_per_rank=4),
                 lambda: buffer.dispatch(x, topk_idx),
                 lambda: buffer.dispatch(x, topk_idx, num_experts=4 * num_ranks, do_zero_padding=True),
                 lambda: buffer.engram_fetch(topk_idx)):
        try:
            call()
        except tokenyard.InvalidInputError as exc:
            errors.append(str(exc))
    assert len(errors) == 4, errors
    _, _, _, handle, _ = buffer.dispatch(x, topk_idx, topk_weights, num_experts=4 * num_ranks)
    try:
        buffer.combine(torch.zeros(handle.num_recv_tokens + 1, 128, dtype=torch.bfloat16), handle)
    except tokenyard.InvalidInputError as exc:
        errors.append(str(exc))
    assert len(errors) == 5 and "rows" in errors[-1]
    buffer.destroy()
    return errors


def queries(seed):
    """The runtime queries: one NVLink domain of the whole group, and NOTE [SM model]'s count for it, at DeepEP V2's
    default rates where asked, at our kernels' where a call is given num_sms=0; DeepEP V2's attributes."""
    from tokenyard.backends.cuda import heuristics

    del seed
    rank, num_ranks = _world()
    buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8, hidden=128, backend="reference",
                                     allow_multiple_reduction=False, prefer_overlap_with_compute=False)
    assert buffer.get_physical_domain_size() == buffer.get_logical_domain_size() == (1, num_ranks)
    model = heuristics.theoretical_num_sms(num_ranks)
    assert buffer.get_theoretical_num_sms(4 * num_ranks, 2) == heuristics.theoretical_num_sms(
        num_ranks, sm_read_gbs=200, sm_write_gbs=50)
    assert buffer.get_theoretical_num_sms(4 * num_ranks, 2, sm_read_gbs=0, sm_write_gbs=0) == model
    assert buffer.get_theoretical_num_sms(4 * num_ranks, 2, sm_write_gbs=10) > model
    assert buffer._default_num_sms() == model
    x, topk_idx, weights = make_rank_inputs(1, num_ranks, 8, 128, 4 * num_ranks, 2)[rank]
    assert buffer.dispatch(x, topk_idx, weights, num_experts=4 * num_ranks)[3].num_sms == model
    assert buffer.get_theoretical_num_qps(model) == 0
    assert (buffer.allow_multiple_reduction, buffer.prefer_overlap_with_compute) == (False, False)
    assert buffer.runtime is buffer.buffer.runtime and buffer.runtime.is_available()
    buffer.destroy()
    assert buffer.runtime is None, "DeepEP's runtime is None after destroy()"
    return model


def deterministic(seed):
    """Whatever `deterministic` says (docs/semantics.md "ElasticBuffer"): the same inputs give the same bits, call
    after call and with either setting: rows in order of source rank, then token, and sums in a fixed order."""
    rank, num_ranks = _world()
    num_experts = 4 * num_ranks
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, 12, 256, num_experts, 4, "skewed")[rank]
    results = {}  # (deterministic, do_expand, call) -> the outputs
    for flag in (True, False):
        buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=12, hidden=256, num_topk=4,
                                         deterministic=flag, backend="reference")
        assert buffer.deterministic is flag
        for do_expand in (False, True):
            for call in range(2):
                recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx, weights, num_experts=num_experts,
                                                                      expert_alignment=4, do_expand=do_expand)
                y = torch.randn(recv_x.shape, generator=torch.Generator().manual_seed(seed + rank)).to(
                    torch.bfloat16)
                combined, combined_w, _ = buffer.combine(y, handle, recv_w)
                results[flag, do_expand, call] = (recv_x, recv_idx, recv_w, handle.recv_src_metadata, combined,
                                                  combined_w)
        buffer.destroy()
    for key, outputs in results.items():
        for i, (got, want) in enumerate(zip(outputs, results[True, key[1], 0])):
            assert (got is None and want is None) or torch.equal(_bits(got), _bits(want)), \
                f"deterministic={key[0]}, do_expand={key[1]}, call {key[2]}: output {i} differs from the first call's"
    return len(results)


def round_trip_on_virtual_nodes(seed, ranks_per_node):
    """NOTE [elastic nodes]: with TOKENYARD_RANKS_PER_NODE making virtual nodes, ElasticBuffer still runs as one
    node, with the same results."""
    import os

    from tokenyard import env

    os.environ["TOKENYARD_RANKS_PER_NODE"] = str(ranks_per_node)
    env.settings.cache_clear()
    try:
        _, num_ranks = _world()
        buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8, hidden=128, backend="reference")
        assert buffer.buffer.topology.num_nodes == num_ranks // ranks_per_node and not buffer.buffer._internode
        buffer.destroy()
        round_trip(seed, 10, 128, 16, 4, "skewed", "bf16", True, 4, True)
    finally:
        del os.environ["TOKENYARD_RANKS_PER_NODE"]
        env.settings.cache_clear()
