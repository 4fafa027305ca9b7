"""The Buffer's fast paths (NOTE [fast paths] in tokenyard/backends/cuda/fast_paths.py), device machine only.

Each call kind is made once through the full path (which records its shape) and then again with fresh
inputs of the same shape, which must take the fast path; every result, poisoned before the kernels write
it, must equal the reference backend's over the same group (dispatch bit for bit, combine within bf16
rounding). Synchronous and `async_finish` calls both, synchronous calls from two streams in turn, and a fast
fresh dispatch that another rank's larger call sends in rounds.
"""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 80, 2048, 32, 4



def _calls(buffer, inputs, async_finish):
    x, topk_idx, weights = inputs

    def done(event):
        event.current_stream_wait()

    per_rank, _, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS,
                                                                         async_finish=async_finish)
    done(event)
    recv_x, _, recv_w, _, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, async_finish=async_finish)
    done(event)
    out = {"layout": (per_rank, per_expert, in_rank), "dispatch": recv_x}
    expert_out = (recv_x[0].float() * 0.5 + 1.0).to(torch.bfloat16)
    for i in range(2):  # the second of each takes the fast path on the CUDA Buffer
        cached, *_, event = buffer.dispatch(x, handle=handle, async_finish=async_finish)
        done(event)
        out[f"cached{i}"] = cached
        combined, combined_w, event = buffer.combine(expert_out, handle, topk_weights=recv_w,
                                                     async_finish=async_finish)
        done(event)
        out[f"combine{i}"] = (combined, combined_w)
    for i in range(2):  # num_worst_tokens: rows past the received ones are padding (only their metadata is set)
        worst = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                num_worst_tokens=NUM_TOKENS * buffer.group_size, async_finish=async_finish)
        done(worst[-1])
        rows = worst[4].recv_src_idx >= 0
        out[f"worst{i}"] = (worst[0][0][rows], worst[0][1][rows], worst[1], worst[2], worst[4].recv_src_idx,
                            worst[4].rank_prefix_matrix, worst[4].send_head)
    ll_x = x[0].float().to(torch.bfloat16)
    packed, count, ll_handle, _, _ = buffer.low_latency_dispatch(ll_x, topk_idx, NUM_TOKENS, NUM_EXPERTS)
    out["ll_count"] = count
    y = packed[0].float().to(torch.bfloat16)
    out["ll_combine"] = buffer.low_latency_combine(y, topk_idx, weights, ll_handle)[0]
    return out


def _across_streams(buffer, inputs):
    """Synchronous cached dispatches and combines from two side streams in turn: a call on the stream the
    last one joined runs there directly, and the next call on the other stream must still come after it
    (NOTE [joined stream] in tokenyard/buffer.py). -> (results, calls that ran straight on a caller's stream)."""
    x, topk_idx, weights = inputs
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert)
    expert_out = (recv_x[0].float() * 0.25 - 1.0).to(torch.bfloat16)
    main, streams = torch.cuda.current_stream(), (torch.cuda.Stream(), torch.cuda.Stream())
    results, straight = [], 0
    for i in range(6):
        stream = streams[i % 2]
        stream.wait_stream(main)  # the inputs were made on main; the other side stream is not waited for
        with torch.cuda.stream(stream):
            for call in (lambda: buffer.dispatch(x, handle=handle)[0],
                         lambda: buffer.combine(expert_out, handle, topk_weights=recv_w)[:2]):
                results.append(call())
                straight += buffer._fast is not None and buffer._fast.calls.ran_on >= 0  # a CUDA-backend Buffer
    for stream in streams:
        main.wait_stream(stream)
    return results, straight


def _fast_paths_match(seed):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)
    buffer = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="cuda", check_inputs=False, timeout_s=30)
    buffer.runtime.poison_outputs = True
    other = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="reference", check_inputs=False)
    hits = []
    for case in range(3):  # case 0 records the shapes; 1 and 2 (fresh inputs) take the fast paths
        async_finish = case == 2
        inputs = make_rank_inputs(seed + case, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "fp8",
                                  device)[rank]
        before = buffer._fast.hits
        got, want = _calls(buffer, inputs, async_finish), _calls(other, inputs, async_finish)
        hits.append(buffer._fast.hits - before)
        torch.cuda.synchronize()
        for name in ("layout", "dispatch", "cached0", "cached1", "worst0", "worst1", "ll_count"):
            for i, (a, b) in enumerate(zip(got[name] if isinstance(got[name], tuple) else (got[name],),
                                           want[name] if isinstance(want[name], tuple) else (want[name],))):
                assert a.shape == b.shape and torch.equal(spawn.bits(a), spawn.bits(b)), \
                    f"case {case}: {name}[{i}] differs"
        for name in ("combine0", "combine1"):
            assert_within_bf16_rounding(got[name][0], want[name][0], f"case {case}: {name}")
            assert torch.allclose(got[name][1], want[name][1], rtol=1e-5, atol=1e-5), f"case {case}: {name} weights"
        assert_within_bf16_rounding(got["ll_combine"], want["ll_combine"], f"case {case}: low-latency combine")
    # Case 0: the second cached dispatch, combine and num_worst_tokens dispatch. Case 1: also the layout, the
    # fresh dispatch (NOTE [fresh calls]), the first num_worst_tokens dispatch and the low-latency pair (and the
    # first cached dispatch and combine where the fresh dispatch received as many rows as in case 0). Case 2,
    # asynchronous: the second cached dispatch, combine and num_worst_tokens dispatch and the low-latency pair at
    # least.
    assert hits[0] == 3 and hits[1] in (8, 10) and hits[2] >= 5, f"fast-path calls per case: {hits}"
    inputs = make_rank_inputs(seed + 3, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "fp8",
                              device)[rank]
    (got, straight), (want, _) = _across_streams(buffer, inputs), _across_streams(other, inputs)
    torch.cuda.synchronize()
    assert straight >= 6, f"only {straight} calls ran straight on their stream"
    for i, (a, b) in enumerate(zip(got, want)):
        if i % 2 == 0:
            for j in range(2):
                assert torch.equal(spawn.bits(a[j]), spawn.bits(b[j])), f"across streams: cached dispatch {i // 2}"
        else:
            assert_within_bf16_rounding(a[0], b[0], f"across streams: combine {i // 2}")
            assert torch.allclose(a[1], b[1], rtol=1e-5, atol=1e-5), f"across streams: combine {i // 2} weights"
    for b in (buffer, other):
        b.destroy()
    return f"fast-path calls per case: {hits}"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_fast_paths_match_the_reference_with_fresh_inputs(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, "the fast paths serve one node's calls")
    print(spawn.run(num_ranks, _fast_paths_match, seed)[0])


def _unaligned_rows_refused(seed):
    import torch.distributed as dist

    from tokenyard import Buffer, Config, InvalidInputError
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs, unaligned_copy

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl_bytes, 0, backend="cuda", timeout_s=30)
    other = Buffer(dist.group.WORLD, nvl_bytes, 0, backend="reference")
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform",
                                            "bf16", device)[rank]
    results = []
    for b in (buffer, other):
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        recv_x, _, recv_w, _, handle, _ = b.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                     num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert)
        y = (recv_x.float() * 0.5 + 1.0).to(torch.bfloat16)
        for _ in range(2):  # the second of each takes the fast path on the CUDA Buffer
            b.dispatch(x, handle=handle)
            b.combine(y, handle, topk_weights=recv_w)
        # The same calls with rows 2 bytes past a 16-byte boundary: refused before any kernel, on every rank.
        for call in (lambda: b.dispatch(unaligned_copy(x), handle=handle),
                     lambda: b.combine(unaligned_copy(y), handle, topk_weights=recv_w)):
            with pytest.raises(InvalidInputError, match="16-byte boundary"):
                call()
        results.append((b.dispatch(x, handle=handle)[0], b.combine(y, handle, topk_weights=recv_w)[0]))
    torch.cuda.synchronize()
    assert buffer._fast.hits >= 2, f"the fast paths were not taken ({buffer._fast.hits} calls)"
    (got_x, got_y), (want_x, want_y) = results
    assert torch.equal(got_x, want_x), "the cached dispatch after the refusals differs"
    assert_within_bf16_rounding(got_y, want_y, "the combine after the refusals")
    for b in (buffer, other):
        b.destroy()
    return "refused on every rank; the Buffer goes on"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_rows_off_a_16_byte_boundary_are_refused_on_the_fast_paths_too(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, "the fast paths serve one node's calls")
    print(spawn.run(num_ranks, _unaligned_rows_refused, seed)[0])


def _fresh_call_in_rounds(seed):
    """A fresh dispatch whose shape every rank recorded in one round, made again with fresh inputs while rank 0
    sends more tokens than a round holds: the other ranks take the fast path (NOTE [fresh calls]) and go on
    with the rounds rank 0's call needs, as the full path would. Every output and handle field equals the
    reference backend's one-shot call, and so does a combine through the handle."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    round_tokens, small, large = 48, 40, 3 * 48 - 20
    nvl_bytes = Config(num_max_tokens_per_rank=large).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl_bytes, backend="cuda", check_inputs=False, timeout_s=30,
                    per_round_tokens=round_tokens)
    buffer.runtime.poison_outputs = True
    other = Buffer(dist.group.WORLD, nvl_bytes, backend="reference", check_inputs=False)

    def rank_inputs(case, tokens):
        (data, scales), topk_idx, weights = make_rank_inputs(seed + case, num_ranks, large, HIDDEN, NUM_EXPERTS,
                                                             NUM_TOPK, "uniform", "fp8", device)[rank]
        return (data[:tokens], scales[:tokens]), topk_idx[:tokens], weights[:tokens]

    def call(b, inputs):
        x, topk_idx, weights = inputs
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        recv_x, recv_idx, recv_w, per_expert_list, handle, _ = b.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        expert_out = (recv_x[0].float() * 0.5 - 0.25).to(torch.bfloat16)
        combined, combined_w, _ = b.combine(expert_out, handle, topk_weights=recv_w)
        return (recv_x[0], recv_x[1], recv_idx, recv_w) + tuple(handle[:6]), per_expert_list, handle, \
            (combined, combined_w)

    call(buffer, rank_inputs(0, small))  # every rank records the call of `small` tokens, one round
    inputs = rank_inputs(1, large if rank == 0 else small)
    before = buffer._fast.hits
    got = call(buffer, inputs)
    hits = buffer._fast.hits - before
    want = call(other, inputs)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        assert a.shape == b.shape and torch.equal(spawn.bits(a), spawn.bits(b)), f"rank {rank}: dispatch field {i}"
    assert got[1] == want[1], f"rank {rank}: received per expert {got[1]} != {want[1]}"
    assert got[2].rounds.num_rounds == 3, f"rank {rank}: {got[2].rounds.num_rounds} rounds"
    assert_within_bf16_rounding(got[3][0], want[3][0], f"rank {rank}: combine after the rounds")
    assert torch.allclose(got[3][1], want[3][1], rtol=1e-5, atol=1e-5), f"rank {rank}: combined weights"
    # Rank 0's shapes are new: the full path. The others: the layout and round 0 of the dispatch.
    assert hits == (0 if rank == 0 else 2), f"rank {rank}: {hits} fast-path calls"
    for b in (buffer, other):
        b.destroy()
    return f"rank {rank}: {hits} fast-path calls"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_a_fast_fresh_dispatch_goes_on_with_the_rounds_another_ranks_call_needs(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, "the fast paths serve one node's calls")
    print(spawn.run(num_ranks, _fresh_call_in_rounds, seed)[0])
