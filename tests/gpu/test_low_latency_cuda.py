"""CUDA low-latency kernels against the reference backend on the same inputs (device machine only).

Counts, layout ranges and source info exactly; FP8 and NVFP4 data and scales bit for bit on the valid slots; combine
within bf16 rounding of the reference backend's, and bit for bit equal to routing.low_latency_combine with
pre_reduce=True (the kernels' arithmetic: NOTE [low-latency combine]), also with zero_copy and `out=`; the same
through CUDA-graph replay with fresh inputs each replay. Outputs are poisoned before the kernels write them. Under
TOKENYARD_RANKS_PER_NODE (virtual nodes) the same tests run the kernels across nodes (NOTE [internode low-latency]).
"""

from __future__ import annotations

import time

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

MAX_SM_CLOCK_HZ = 2.5e9  # above the boost clock of every GPU this runs on (H100 and H200: 1.98 GHz)
CASES = [
    # (num_tokens, num_max, hidden, num_experts, num_topk, kind, cast, round_scale, use_ue8m0, hook); NVFP4 with
    # round_scale means with x_global_scale (NOTE [nvfp4]), without it the scale 1
    (128, 128, 7168, 256, 8, "uniform", "fp8", False, False, False),
    (100, 128, 7168, 256, 8, "masked", "fp8", True, True, True),
    (64, 64, 4096, 64, 6, "empty_rank", "bf16", False, False, False),
    (1, 32, 2048, 32, 1, "uniform", "fp8", False, False, True),
    (32, 48, 1024, 16, 4, "no_tokens", "fp8", True, False, False),
    (64, 64, 2048, 32, 4, "repeated", "fp8", False, False, False),  # NOTE [repeated experts]
    (48, 64, 4096, 64, 16, "uniform", "bf16", False, False, True),
    (128, 128, 7168, 256, 8, "uniform", "nvfp4", True, False, False),
    (40, 48, 2048, 32, 5, "masked", "nvfp4", False, False, True),
]


def _valid_slots(layout_range: torch.Tensor, num_slots: int) -> torch.Tensor:
    counts = (layout_range & 0xFFFFFFFF).sum(1)
    return torch.arange(num_slots, device=layout_range.device).view(1, -1) < counts.view(-1, 1)


def _differences(want: torch.Tensor, got: torch.Tensor) -> str:
    """Where two row sets differ: how many rows, the first one, and whether it still holds the poison."""
    want, got = want.reshape(want.size(0), -1).view(torch.uint8), got.reshape(got.size(0), -1).view(torch.uint8)
    rows = (want != got).any(1).nonzero().flatten().tolist()
    if not rows:
        return "no difference"
    first = rows[0]
    columns = (want[first] != got[first]).nonzero().flatten().tolist()
    poisoned = bool((got[first] == 0xAB).all())
    return (f"{len(rows)} of {want.size(0)} rows differ; row {first}: {len(columns)} bytes from byte {columns[0]}"
            f"{' (still poison)' if poisoned else ''}: want {want[first, columns[:4]].tolist()} "
            f"got {got[first, columns[:4]].tolist()}")


class _FilledSlots:
    """One rank's expert outputs ``[L, R*M, H]`` as the oracle reads them (``[l, slot]``, ``size(2)``, ``device``), holding
    only the slots its dispatch filled: a few MB where the whole tensor is hundreds, so every rank can gather
    every rank's over any group."""

    def __init__(self, y: torch.Tensor, layout_range: torch.Tensor):
        valid = _valid_slots(layout_range, y.size(1))
        self.rows = y[valid].cpu()
        self.row_of = (valid.flatten().cumsum(0) - 1).view(valid.shape).cpu()
        self.hidden = y.size(2)
        self.device = self.rows.device  # where the oracle makes its sums

    def size(self, dim: int) -> int:
        assert dim == 2, "the oracle asks for the hidden size only"
        return self.hidden

    def __getitem__(self, where):
        local_expert, slot = where
        return self.rows[self.row_of[local_expert, slot]]


def _pre_reduced(y, layout_range, all_inputs, num_experts):
    """This rank's routing.low_latency_combine(..., pre_reduce=True), from every rank's expert outputs `y`
    and `layout_range` (gathered here) and every rank's inputs."""
    import torch.distributed as dist

    from tokenyard.semantics import routing

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (_FilledSlots(y, layout_range), layout_range.cpu()))
    want = routing.low_latency_combine([g[0] for g in gathered], [i[1].cpu() for i in all_inputs],
                                       [i[2].cpu() for i in all_inputs], [g[1] for g in gathered], num_experts,
                                       pre_reduce=True)
    return want[dist.get_rank()].to(y.device)


def _check_path(buffer):
    """Under TOKENYARD_RANKS_PER_NODE (virtual nodes), the kernels reach every rank of another node through the
    transport and only those (NOTE [internode low-latency] in include/tokenyard/sync.cuh)."""
    import torch.distributed as dist

    from tokenyard import env

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    per_node = env.settings().ranks_per_node or num_ranks
    remote = sum(1 << r for r in range(num_ranks) if r // per_node != rank // per_node)
    assert buffer.runtime._low_latency_kernels.remote == remote, \
        f"rank {rank}: ranks reached by puts {buffer.runtime._low_latency_kernels.remote:#x}, want {remote:#x}"
    return "" if remote == 0 else f" ({num_ranks // per_node} nodes x {per_node})"


def _compare(seed, cases):
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.semantics import quant
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    reports = []
    for case_id, (num_tokens, num_max, hidden, num_experts, num_topk, kind, cast, round_scale, use_ue8m0,
                  hook) in enumerate(cases):
        what = f"case {case_id} {kind}/h{hidden}/k{num_topk}/{cast}/ue8m0={use_ue8m0}/hook={hook}"
        use_fp8, use_nvfp4 = cast == "fp8", cast == "nvfp4"
        global_scale = None
        size = Buffer.get_low_latency_rdma_size_hint(num_max, hidden, num_ranks, num_experts)
        ref = Buffer(dist.group.WORLD, 0, size, backend="reference")
        cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=30)
        cuda.runtime.use_low_latency_kernels = True
        cuda.runtime.poison_outputs = True
        what += _check_path(cuda)
        num_local_experts = num_experts // num_ranks
        stats = [torch.zeros(num_local_experts, dtype=torch.int32, device=device) for _ in range(2)]

        def run(buffer, x, topk_idx, weights, stat, replay):
            recv, count, handle, _, receive = buffer.low_latency_dispatch(
                x, topk_idx, num_max, num_experts, cumulative_local_expert_recv_stats=stat, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook, use_nvfp4=use_nvfp4,
                x_global_scale=global_scale)
            assert (receive is None) != hook, "a hook exactly where return_recv_hook asks for one, as DeepEP"
            if hook:
                receive()
            data = recv[0] if use_fp8 else recv
            # Expert outputs: a deterministic function of the received rows, the same on both backends.
            if use_nvfp4:  # the packed bytes, each twice, as [L, R*M, H]
                y = (recv[0].permute(2, 0, 1).float() * 0.01).repeat_interleave(2, dim=2).to(torch.bfloat16)
            else:
                y = (data.float() * 0.5 + 1.0).to(torch.bfloat16) if not use_fp8 else data.float().to(torch.bfloat16)
            # The second call: the outputs written in place (zero_copy) and the result into a poisoned `out`.
            zero_copy = replay == 1
            out = torch.full((x.size(0), hidden), float("nan"), dtype=torch.bfloat16, device=device) \
                if zero_copy else None
            if zero_copy:
                in_place = buffer.get_next_low_latency_combine_buffer(handle)
                row = hidden + 2 * (hidden // 128)  # DeepEP's strides: the combine kernels read these rows in place
                assert in_place.stride() == (num_ranks * num_max * row, row, 1), in_place.stride()
                in_place.copy_(y)
            combined, _, receive = buffer.low_latency_combine(torch.empty_like(y) if zero_copy else y, topk_idx,
                                                              weights, handle, zero_copy=zero_copy, out=out,
                                                              return_recv_hook=hook)
            assert (receive is None) != hook, "a hook exactly where return_recv_hook asks for one, as DeepEP"
            if hook:
                receive()
            assert out is None or combined.data_ptr() == out.data_ptr(), "the combine did not write into out"
            return recv, count, handle, combined, y

        for replay in range(2):
            all_inputs = make_rank_inputs(seed + 17 * case_id + replay, num_ranks, num_tokens, hidden, num_experts,
                                          num_topk, kind, "bf16", device)
            x, topk_idx, weights = all_inputs[rank]
            if use_nvfp4 and round_scale:  # as DeepEP's test picks it: the ranks' smallest 448 * 6 / max|x|
                global_scale = (448.0 * 6.0 / x.float().abs().max().clamp_min(1e-4)).reshape(1)
                dist.all_reduce(global_scale, op=dist.ReduceOp.MIN)
                if replay == 1:  # the second call: one per expert, all the same, as vLLM passes it
                    global_scale = global_scale.expand(num_experts)
            outs = [run(b, x, topk_idx, weights, s, replay) for b, s in ((ref, stats[0]), (cuda, stats[1]))]
            torch.cuda.synchronize()
            (r_recv, r_count, r_handle, r_comb, r_y), (c_recv, c_count, c_handle, c_comb, _) = outs
            assert torch.equal(r_count, c_count), f"{what}: packed_recv_count differs"
            assert torch.equal(r_handle.layout_range, c_handle.layout_range), f"{what}: layout_range differs"
            valid = _valid_slots(r_handle.layout_range, num_ranks * num_max)
            assert torch.equal(r_handle.src_info[valid], c_handle.src_info[valid]), f"{what}: src_info differs"
            r_data, c_data = (r_recv[0], c_recv[0]) if use_fp8 or use_nvfp4 else (r_recv, c_recv)
            if use_nvfp4:  # DeepEP's views (NOTE [nvfp4]), compared expert-major
                assert c_data.permute(2, 0, 1).is_contiguous() and c_data.shape == r_data.shape, f"{what}: data view"
                assert c_recv[1].permute(5, 2, 4, 0, 1, 3).is_contiguous() and c_recv[1].shape == r_recv[1].shape, \
                    f"{what}: scales view"
                r_data, c_data = r_data.permute(2, 0, 1), c_data.permute(2, 0, 1)
                r_scales, c_scales = (quant.unswizzle_nvfp4_scales(t[1], num_ranks * num_max, hidden // 16)
                                      for t in (r_recv, c_recv))
                assert torch.equal(r_scales[valid].view(torch.uint8), c_scales[valid].view(torch.uint8)), \
                    f"{what}: scales: {_differences(r_scales[valid], c_scales[valid])}"
            assert torch.equal(r_data[valid].view(torch.uint8), c_data[valid].view(torch.uint8)), \
                f"{what}: data: {_differences(r_data[valid], c_data[valid])}"
            if use_fp8:
                assert c_recv[1].stride(1) == 1, f"{what}: scales are not column-major"
                assert torch.equal(r_recv[1][valid], c_recv[1][valid]), f"{what}: scales differ"
            assert_within_bf16_rounding(c_comb, r_comb, f"{what}: combine against the reference backend")
            exact = _pre_reduced(r_y, r_handle.layout_range, all_inputs, num_experts)
            assert torch.equal(exact, c_comb), \
                f"{what}: combine differs from the pre-reduced oracle by {(exact.float() - c_comb.float()).abs().max()}"
        assert torch.equal(stats[0], stats[1]), f"{what}: cumulative stats differ"
        cuda.runtime.check_failures()
        reports.append(f"{what}: ok ({int(r_count.sum())} pairs received)")
        ref.destroy()
        cuda.destroy()
    return reports


def _graph_replay(seed):
    """Capture dispatch -> expert -> combine once, then an NVFP4 dispatch; replay with fresh inputs (a fresh global
    scale too, which the kernels read on the GPU); compare with the reference."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.semantics import quant
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 128, 7168, 256, 8
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    ref = Buffer(dist.group.WORLD, 0, size, backend="reference")
    cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=30)
    cuda.runtime.use_low_latency_kernels = True
    nodes = _check_path(cuda)

    def step(buffer, x, topk_idx, weights, global_scale, details=False):
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts)
        y = recv[0].float().to(torch.bfloat16)
        combined = buffer.low_latency_combine(y, topk_idx, weights, handle)[0]
        nvfp4, _, nvfp4_handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                    use_nvfp4=True, x_global_scale=global_scale)
        # expert-major data and linear scales (NOTE [nvfp4]), with the layout_range that says which rows hold tokens
        nvfp4 = (nvfp4[0].permute(2, 0, 1), quant.unswizzle_nvfp4_scales(nvfp4[1], num_ranks * num_tokens,
                                                                        hidden // 16), nvfp4_handle.layout_range)
        return (combined, y, handle.layout_range, nvfp4) if details else (combined, nvfp4)

    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                            "uniform", "bf16", device)[rank]
    static = [x.clone(), topk_idx.clone(), weights.clone(), torch.ones(1, device=device)]
    step(cuda, *static)  # warm up: compile and load outside the capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_nvfp4 = step(cuda, *static)
    for replay in range(3):
        all_inputs = make_rank_inputs(seed + 1 + replay, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                      "masked" if replay % 2 else "uniform", "bf16", device)
        fresh = all_inputs[rank] + (torch.full((1,), 448.0 * 6.0 / (replay + 2), device=device),)
        for target, value in zip(static, fresh):
            target.copy_(value)
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        want, y, layout_range, want_nvfp4 = step(ref, *fresh, details=True)
        torch.cuda.synchronize()
        assert torch.equal(captured_nvfp4[2], want_nvfp4[2]), f"replay {replay}: NVFP4 layout_range"
        valid = _valid_slots(want_nvfp4[2], num_ranks * num_tokens)
        for name, got, wanted in zip(("data", "scales"), captured_nvfp4[:2], want_nvfp4[:2]):
            assert torch.equal(got[valid].view(torch.uint8), wanted[valid].view(torch.uint8)), \
                f"replay {replay}: NVFP4 {name}: {_differences(wanted[valid], got[valid])}"
        assert_within_bf16_rounding(captured_out, want, f"replay {replay}: graph output against the reference")
        assert torch.equal(captured_out, _pre_reduced(y, layout_range, all_inputs, num_experts)), \
            f"replay {replay}: graph output differs from the pre-reduced oracle"
    cuda.runtime.check_failures()
    ref.destroy()
    cuda.destroy()
    return "graph replays match the reference" + nodes


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_low_latency_kernels_match_reference(num_ranks, seed):
    for line in spawn.run(num_ranks, _compare, seed, CASES)[0]:
        print(line)


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_low_latency_kernels_replay_in_a_cuda_graph_with_fresh_inputs(num_ranks, seed):
    print(spawn.run(num_ranks, _graph_replay, seed)[0])


def _shapes_on_one_buffer(seed):
    """One Buffer, calls of two shapes with clean_low_latency_buffer between them, as DeepEP users switch."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = [(128, 7168, 256, 8), (64, 4096, 64, 6), (128, 7168, 256, 8)]  # (num_max, hidden, experts, top-k)
    size = max(Buffer.get_low_latency_rdma_size_hint(m, h, num_ranks, e) for m, h, e, _ in shapes)
    ref = Buffer(dist.group.WORLD, 0, size, backend="reference")
    cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=30)
    cuda.runtime.use_low_latency_kernels = True
    cuda.runtime.poison_outputs = True
    for i, (num_max, hidden, num_experts, num_topk) in enumerate(shapes):
        cuda.clean_low_latency_buffer(num_max, hidden, num_experts)
        all_inputs = make_rank_inputs(seed + i, num_ranks, num_max, hidden, num_experts, num_topk, "uniform", "bf16",
                                      device)
        x, topk_idx, weights = all_inputs[rank]
        for call in range(3):  # both halves, then the first again
            outs = []
            for buffer in (ref, cuda):
                recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_max, num_experts)
                y = recv[0].float().to(torch.bfloat16)
                outs.append((recv, count, handle, y, buffer.low_latency_combine(y, topk_idx, weights, handle)[0]))
            torch.cuda.synchronize()
            (r_recv, r_count, r_handle, r_y, _), (c_recv, c_count, c_handle, _, c_comb) = outs
            what = f"shape {i} call {call}"
            assert torch.equal(r_count, c_count), f"{what}: counts differ"
            valid = _valid_slots(r_handle.layout_range, num_ranks * num_max)
            assert torch.equal(r_recv[0][valid].view(torch.uint8), c_recv[0][valid].view(torch.uint8)), \
                f"{what}: data differ"
            assert torch.equal(c_comb, _pre_reduced(r_y, r_handle.layout_range, all_inputs, num_experts)), \
                f"{what}: combine differs from the pre-reduced oracle"
    cuda.runtime.check_failures()
    ref.destroy()
    cuda.destroy()
    return "three shapes on one Buffer match the reference"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_calls_of_several_shapes_on_one_buffer_after_clean(num_ranks, seed):
    print(spawn.run(num_ranks, _shapes_on_one_buffer, seed)[0])


def _clean_without_rank_0(seed):
    """Every rank but rank 0 cleans the low-latency buffer; rank 0 makes no call. The others must raise
    CommTimeoutError at the clean's first barrier, naming themselves and the stage, within a destroy meeting's wait
    (the clean's barriers are meetings: `Collectives.meeting` in tokenyard/backends/collectives.py), not at the
    group's timeout. Rank 0 stays until they have raised (its process's end would end their group's collectives
    first), then makes its part of the meeting they left, so that the group is in step and every process leaves at
    once (with the meeting unfinished, ending the processes took 30 s: benchmarks/results/gpu_suite.md)."""
    import torch.distributed as dist

    from tokenyard import Buffer, CommTimeoutError
    from tokenyard.backends.collectives import meeting_wait_s

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_max, hidden, num_experts, timeout_s = 32, 1024, 2 * num_ranks, 1.0
    size = Buffer.get_low_latency_rdma_size_hint(num_max, hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=timeout_s)
    buffer.runtime.use_low_latency_kernels = True
    limit_s = meeting_wait_s(timeout_s) + 2.0
    if rank == 0:
        time.sleep(limit_s + 3.0)
        buffer._exchange.meeting("clean_low_latency_buffer", "senders_done")
        return "rank 0 made no call"
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as raised:
        buffer.clean_low_latency_buffer(num_max, hidden, num_experts)
    took = time.monotonic() - start
    assert took < limit_s, f"rank {rank} raised after {took:.1f} s"
    message = str(raised.value)
    assert f"rank {rank} " in message and "clean_low_latency_buffer/senders_done" in message, message
    return f"rank {rank} after {took:.1f} s: {message}"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_a_rank_that_does_not_clean_makes_the_others_raise_at_the_clean(num_ranks, seed):
    for line in spawn.run(num_ranks, _clean_without_rank_0, seed, fresh=True):
        print(line)


def _plain_handles_and_wait_costs(seed):
    """Two micro-batches (dispatch 1, dispatch 2, combine 2, combine 1), every combine given DeepEP's plain
    5-tuple, which does not say which half of the buffer its dispatch used (NOTE [plain low-latency handles]):
    both combines match the reference's. Wait-cost stats (NOTE [wait costs]) grow on every rank's entry."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 64, 2048, 16 * num_ranks, 4
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    ref = Buffer(dist.group.WORLD, 0, size, backend="reference")
    cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=30)
    cuda.runtime.use_low_latency_kernels = True
    cuda.runtime.poison_outputs = True
    batches = [make_rank_inputs(seed + b, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform", "bf16",
                                device) for b in range(2)]
    waits = [torch.zeros(num_ranks, dtype=torch.int64, device=device) for _ in range(3)]
    results, spans = {}, {}
    for buffer in (ref, cuda):
        handles, ys = [], []
        started = time.perf_counter()
        for b, all_inputs in enumerate(batches):
            x, topk_idx, _ = all_inputs[rank]
            recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False,
                                                                dispatch_wait_recv_cost_stats=waits[0])
            handles.append(tuple(handle))  # DeepEP's plain fields only
            ys.append((recv.float() * (b + 2)).to(torch.bfloat16))
        torch.cuda.synchronize()
        waits[1].copy_(waits[0])
        spans["dispatch"], started = time.perf_counter() - started, time.perf_counter()
        out = [None, None]
        for b in (1, 0):
            _, topk_idx, weights = batches[b][rank]
            out[b] = buffer.low_latency_combine(ys[b], topk_idx, weights, handles[b],
                                                combine_wait_recv_cost_stats=waits[0])[0]
        torch.cuda.synchronize()
        waits[2].copy_(waits[0])
        spans["combine"] = time.perf_counter() - started
        results[buffer.backend] = out
        if buffer is ref:
            assert int(waits[0].abs().sum()) == 0, "the reference backend counts no waits"
    for b in range(2):
        assert_within_bf16_rounding(results["cuda"][b], results["reference"][b],
                                    f"micro-batch {b}: combine through a plain handle against the reference")
    # Cycles of waiting, each no longer than its two calls took (no GPU clocks above MAX_SM_CLOCK_HZ): a raw
    # clock reading in place of a difference fails this.
    dispatch_costs, combine_costs = waits[1], waits[2] - waits[1]
    for what, costs in (("dispatch", dispatch_costs), ("combine", combine_costs)):
        most = spans[what] * MAX_SM_CLOCK_HZ
        assert bool((costs > 0).all()) and bool((costs <= most).all()), \
            f"{what} wait costs {costs.tolist()} cycles: each must be above 0 and at most {most:.0f}"
    cuda.runtime.check_failures()
    ref.destroy()
    cuda.destroy()
    return f"plain handles of two micro-batches match; wait costs {waits[2].tolist()} cycles"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_plain_tuple_handles_of_two_micro_batches_and_wait_costs(num_ranks, seed):
    for line in spawn.run(num_ranks, _plain_handles_and_wait_costs, seed):
        print(line)


def _combine_overlap(seed):
    """SGLang's single-batch overlap (NOTE [combine overlap]): the sending launch on 2 blocks reads each row once
    its block is signalled. Signals set before the call: the pre-reduced oracle bit for bit. Signals set late by a
    kernel on another stream (after a sleep): the send waits, then the same result, also with the Blackwell form's
    src_signals. A block never signalled: the call raises CommTimeoutError at low_latency_combine/overlap."""
    import torch.distributed as dist

    from tokenyard import Buffer, CommTimeoutError
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk, block_m, threshold = 64, 2048, 8 * num_ranks, 4, 16, 5
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=3)
    cuda.runtime.use_low_latency_kernels = True
    nodes = _check_path(cuda)
    all_inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform", "bf16",
                                  device)
    x, topk_idx, weights = all_inputs[rank]
    signal_blocks = -(-num_ranks * num_tokens // block_m)

    def signals(count, value):
        blocks = (count.long() + block_m - 1) // block_m
        done = torch.arange(signal_blocks, device=device).view(1, -1) < blocks.view(-1, 1)
        return torch.where(done, value, 0).to(torch.int32).flatten()

    side = torch.cuda.Stream(device)

    def round_trip(comp_signal, late=False, blackwell=False):
        """One dispatch and overlapped combine; `late`: the "GEMM" on another stream writes the expert outputs
        (poisoned until then) and then their signals ~50 ms after the combine began waiting; `blackwell`: the
        signals are src_signals, uint32, one per local expert."""
        recv, count, handle, _, _ = cuda.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
        y_final = (recv.float() * 0.5 + 1.0).to(torch.bfloat16)
        y, signal = y_final, comp_signal(count, handle.layout_range)
        if late:
            y, signal = torch.full_like(y_final, float("nan")), torch.zeros_like(signal)
            side.wait_stream(torch.cuda.current_stream(device))  # before the combine is launched
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(50e-3 * 2e9))
                y.copy_(y_final)
                signal.copy_(comp_signal(count, handle.layout_range))
        if blackwell:
            kwargs = dict(src_signals=signal.view(torch.uint32), src_signal_expect_value=threshold)
        else:
            kwargs = dict(packed_recv_count=count, comp_signal=signal, block_m=block_m, threshold=threshold, num_sms=2)
        combined, _, hook = cuda.low_latency_combine(y, topk_idx, weights, handle, return_recv_hook=True,
                                                     overlap=True, **kwargs)
        hook()
        torch.cuda.synchronize()
        return combined, y_final, handle.layout_range

    combined, y, layout_range = round_trip(lambda count, _: signals(count, threshold))
    want = _pre_reduced(y, layout_range, all_inputs, num_experts)  # every round trip's: the same inputs and y
    assert torch.equal(combined, want), f"rank {rank}: the overlapped combine differs from the oracle"
    start = time.monotonic()
    combined, y, layout_range = round_trip(lambda count, _: signals(count, threshold), late=True)
    waited = time.monotonic() - start
    assert torch.equal(combined, _pre_reduced(y, layout_range, all_inputs, num_experts)), \
        f"rank {rank}: the combine whose expert outputs came late differs from the oracle"
    combined, y, layout_range = round_trip(lambda count, _: torch.full_like(count, threshold), late=True,
                                           blackwell=True)
    assert torch.equal(combined, _pre_reduced(y, layout_range, all_inputs, num_experts)), \
        f"rank {rank}: the combine waiting on src_signals differs from the oracle"
    dist.barrier()

    # The last rank leaves one block below the threshold: the first of rank 0's rows of the local expert that has
    # most of them. It raises at the overlap's wait; rank 0, whose sum needs that row, names it; another rank names
    # it or, where the stalling rank's rows for it came before the deadline, gets the oracle's output. (Were every
    # rank to stall, a rank could first miss a stalled peer's weights, deferred to its receive (NOTE [deferred
    # rows]), and name that peer instead; and a block of a rank's own rows stalls no other rank.)
    stalling = num_ranks - 1

    def stalled(count, layout_range):
        signal = signals(count, threshold)
        if rank == stalling:
            from_rank_0 = layout_range[:, 0] & 0xFFFFFFFF
            expert = int(from_rank_0.argmax())
            assert int(from_rank_0[expert]) > 0, "no row of rank 0 on the stalling rank"
            signal[expert * signal_blocks + int(layout_range[expert, 0] >> 32) // block_m] = threshold - 1
        return signal

    seen = None
    try:
        combined, _, _ = round_trip(stalled)
        cuda.runtime.check_failures()
    except CommTimeoutError as exc:
        seen = exc
    if rank == stalling:
        assert seen is not None and seen.stage == "low_latency_combine/overlap", \
            f"rank {rank}: a block never signalled, yet the combine gave {seen!r}"
    elif seen is None:
        assert rank != 0, f"rank 0: rank {stalling}'s block of its rows never signalled, yet its combine returned"
        assert torch.equal(combined, want), f"rank {rank}: a combine that returned beside a stalled rank differs " \
                                            "from the oracle"
    else:
        assert seen.peer == stalling, f"rank {rank}: rank {stalling}'s block never signalled, yet {seen!r}"
    cuda.destroy()
    return (f"overlap: oracle bit for bit (comp_signal and src_signals), waited {waited * 1e3:.0f} ms for late "
            f"signals, then {'the oracle' if seen is None else f'{seen.stage} (peer {seen.peer})'}{nodes}")


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_combine_overlap_reads_rows_once_signalled(num_ranks, seed):
    for line in spawn.run(num_ranks, _combine_overlap, seed):
        print(line)


# A late rank's delay, and what the others' send launches must stay under (a send that waited would take the delay).
LATE_S = 0.05
SEND_BOUND_S = 0.01


def _late_rank(seed):
    """Issue 51 (NOTE [deferred rows]): with return_recv_hook, a rank that comes LATE_S late to its combine's send
    (then, another round, to its dispatch's) lengthens no other rank's send, of its node or another: each stays
    under SEND_BOUND_S, measured with events around the send. The late rank's data still arrives: every rank's dispatch equals routing's and its
    combine the pre-reduced oracle bit for bit, outputs poisoned."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 128, 7168, 32 * num_ranks, 8
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    cuda = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=10)
    cuda.runtime.use_low_latency_kernels = True
    cuda.runtime.poison_outputs = True
    nodes = _check_path(cuda)

    def timed_send(late: bool, call):
        """call() launched at once, or after LATE_S of GPU sleep on the late rank; -> (its outputs, events around
        it)."""
        if late:
            torch.cuda._sleep(int(LATE_S * MAX_SM_CLOCK_HZ))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        outputs = call()
        end.record()
        return outputs, start, end

    lines = []
    # Round 0 has no late rank: it loads the kernels, whose first launch (a module load, on virtual nodes NVSHMEM's
    # registration too) the events would count.
    rounds = [(None, None), (num_ranks - 1, "combine"), (0, "dispatch"), (None, None)]
    for round_id, (late_rank, late_stage) in enumerate(rounds):
        all_inputs = make_rank_inputs(seed + round_id, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform",
                                      "bf16", device)
        x, topk_idx, weights = all_inputs[rank]
        torch.cuda.synchronize()
        dist.barrier()
        (recv, count, handle, _, receive), d_start, d_end = timed_send(
            rank == late_rank and late_stage == "dispatch",
            lambda: cuda.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False,
                                              return_recv_hook=True))
        receive()
        y = (recv.float() * 0.5 + 1.0).to(torch.bfloat16)
        (combined, _, receive), c_start, c_end = timed_send(
            rank == late_rank and late_stage == "combine",
            lambda: cuda.low_latency_combine(y, topk_idx, weights, handle, return_recv_hook=True))
        receive()
        torch.cuda.synchronize()
        cuda.runtime.check_failures()
        sends = {"dispatch": d_start.elapsed_time(d_end) / 1e3, "combine": c_start.elapsed_time(c_end) / 1e3}
        what = f"rank {rank}, round {round_id} (rank {late_rank} late to its {late_stage})"
        if late_rank is not None and rank != late_rank:
            assert sends[late_stage] < SEND_BOUND_S, \
                f"{what}: the {late_stage} send took {sends[late_stage] * 1e3:.2f} ms: it waited for the late rank"
        oracle = routing.low_latency_dispatch([i[0].cpu() for i in all_inputs], [i[1].cpu() for i in all_inputs],
                                              num_tokens, num_experts, use_fp8=False)[rank]
        assert torch.equal(count.cpu(), oracle["packed_recv_count"]), f"{what}: packed_recv_count differs"
        valid = _valid_slots(handle.layout_range, num_ranks * num_tokens).cpu()
        assert torch.equal(recv.cpu()[valid], oracle["packed_recv_x"][valid]), f"{what}: dispatched rows differ"
        want = _pre_reduced(y, handle.layout_range, all_inputs, num_experts)
        assert torch.equal(combined, want), \
            f"{what}: combine differs from the pre-reduced oracle: {_differences(want, combined)}"
        lines.append(f"round {round_id}: sends {sends['dispatch'] * 1e6:.0f} / {sends['combine'] * 1e6:.0f} us")
    cuda.destroy()
    return f"rank {rank}: " + "; ".join(lines) + nodes


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_a_late_rank_lengthens_no_other_ranks_send(num_ranks, seed):
    for line in spawn.run(num_ranks, _late_rank, seed):
        print(line)


def _masked_rank(seed):
    """With enable_shrink, a rank that stops answering is masked and the others keep serving; once every rank has
    cleaned the buffer and unmasked it (low_latency_update_mask_buffer), it serves again."""
    import time

    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 32, 1024, 8 * num_ranks, 4
    num_local_experts = num_experts // num_ranks
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, backend="cuda", enable_shrink=True, timeout_s=3)
    buffer.runtime.use_low_latency_kernels = True
    nodes = _check_path(buffer)
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform", "bf16")
    x, topk_idx, weights = (t.to(device) for t in inputs[rank])

    def call():
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
        return count, buffer.low_latency_combine(recv, topk_idx, weights, handle)[0]

    call()  # every rank takes part once
    torch.cuda.synchronize()
    dist.barrier()
    stopped = num_ranks - 1
    message = "stopped"
    if rank != stopped:
        start = time.monotonic()
        count, combined = call()
        torch.cuda.synchronize()
        status = torch.zeros(num_ranks, dtype=torch.int32, device=device)
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == stopped) for r in range(num_ranks)], status.tolist()
        # Expected: the stopped rank sent nothing and its experts received nothing.
        survivors = [(inp[0], torch.where(inp[1] // num_local_experts == stopped, torch.full_like(inp[1], -1), inp[1]))
                     for inp in inputs]
        survivors[stopped] = (survivors[stopped][0][:0], survivors[stopped][1][:0])
        oracle = routing.low_latency_dispatch([s[0] for s in survivors], [s[1] for s in survivors], num_tokens,
                                              num_experts, use_fp8=False)
        want = routing.low_latency_combine([o["packed_recv_x"] for o in oracle], [s[1] for s in survivors],
                                           [inp[2] for inp in inputs], [o["layout_range"] for o in oracle],
                                           num_experts, pre_reduce=True)[rank]
        assert torch.equal(count.cpu(), oracle[rank]["packed_recv_count"]), "masked call counts differ"
        assert torch.equal(combined.cpu(), want), "masked call combine differs"
        first = time.monotonic() - start
        start = time.monotonic()
        call()  # the mask holds: no wait for the stopped rank
        torch.cuda.synchronize()
        again = time.monotonic() - start
        assert again < 1.0, f"a call after masking took {again:.2f} s"
        call()  # the stopped rank has now missed three calls: it used the buffer's halves an odd number fewer times
        message = f"masked rank {stopped} after {first:.1f} s; next call {again * 1e3:.1f} ms{nodes}"
    # The stopped rank comes back: every rank cleans the buffer (the stopped rank's epochs and half are behind) and
    # unmasks it, and a call of every rank is the whole oracle's.
    torch.cuda.synchronize()
    dist.barrier()
    buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
    buffer.low_latency_update_mask_buffer(stopped, False)
    count, combined = call()
    torch.cuda.synchronize()
    oracle = routing.low_latency_dispatch([inp[0] for inp in inputs], [inp[1] for inp in inputs], num_tokens,
                                          num_experts, use_fp8=False)
    want = routing.low_latency_combine([o["packed_recv_x"] for o in oracle], [inp[1] for inp in inputs],
                                       [inp[2] for inp in inputs], [o["layout_range"] for o in oracle], num_experts,
                                       pre_reduce=True)[rank]
    assert torch.equal(count.cpu(), oracle[rank]["packed_recv_count"]), "counts differ after unmasking"
    assert torch.equal(combined.cpu(), want), "combine differs after unmasking"
    buffer.runtime.check_failures()
    dist.barrier()
    buffer.destroy()
    return message + "; unmasked after a clean, the next call whole"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_a_stopped_rank_is_masked_and_the_others_keep_serving(num_ranks, seed):
    for line in spawn.run(num_ranks, _masked_rank, seed):
        print(line)


# Deadlines from shorter than a call to a few calls long, so that some land on the peers' signals; the shortest
# below the fastest call between separate GPUs (benchmarks/results/gpu_suite.md, "Before").
DEADLINE_TIMEOUTS_US = (2, 5, 10, 20, 40, 80, 160)
DEADLINE_ROUNDS = 6


def _deadline_race(seed):
    """With enable_shrink and deadlines about as long as the calls, peers' words land at the deadlines, and a
    call keeps some peers and masks others. Whichever it keeps, it keeps for every row (NOTE [one verdict]):
    the dispatch equals the oracle's without the sources its layout_range leaves out, and the combine equals,
    for every token alike, the pre-reduced sum over one set of ranks that leaves out masked ranks only."""
    import itertools

    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 64, 1024, 8 * num_ranks, 4
    num_local_experts, num_slots = num_experts // num_ranks, num_ranks * num_tokens
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform", "bf16")
    x, topk_idx, weights = (t.to(device) for t in inputs[rank])

    def expert(recv):  # a deterministic function of the received rows, as in _compare
        return (recv.float() * 0.5 + 1.0).to(torch.bfloat16)

    full = routing.low_latency_dispatch([i[0] for i in inputs], [i[1] for i in inputs], num_tokens, num_experts,
                                        use_fp8=False)
    sends = (full[rank]["layout_range"] & 0xFFFFFFFF).sum(0) > 0  # [R]: the sources with tokens for this rank
    oracles = {}

    def dispatch_oracle(absent):
        if absent not in oracles:
            kept = [(i[0][:0], i[1][:0]) if s in absent else (i[0], i[1]) for s, i in enumerate(inputs)]
            oracles[absent] = routing.low_latency_dispatch([k[0] for k in kept], [k[1] for k in kept], num_tokens,
                                                           num_experts, use_fp8=False)[rank]
        return oracles[absent]

    # This rank's pre-reduced partial from each rank d: the combine with its choices on d only.
    partials = []
    for d in range(num_ranks):
        on_d = [torch.where(i[1] // num_local_experts == d, i[1], torch.full_like(i[1], -1)) for i in inputs]
        partials.append(routing.low_latency_combine([expert(f["packed_recv_x"]) for f in full], on_d,
                                                    [i[2] for i in inputs], [f["layout_range"] for f in full],
                                                    num_experts, pre_reduce=True)[rank].float())

    def combined_over(ranks):
        acc = torch.zeros(num_tokens, hidden)
        for d in ranks:  # increasing rank order, float32, as the kernel
            acc = acc + partials[d]
        return acc.to(torch.bfloat16)

    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    status = torch.zeros(num_ranks, dtype=torch.int32, device=device)
    kept_some, masked_some = 0, 0
    for timeout_us in DEADLINE_TIMEOUTS_US:
        buffer = Buffer(dist.group.WORLD, 0, size, backend="cuda", enable_shrink=True, timeout_s=timeout_us * 1e-6)
        buffer.runtime.use_low_latency_kernels = True
        buffer.runtime.poison_outputs = True
        for round_ in range(DEADLINE_ROUNDS):
            what = f"deadline {timeout_us} us, round {round_}"
            buffer.low_latency_clean_mask_buffer()
            torch.cuda.synchronize()
            dist.barrier()
            recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                    use_fp8=False)
            combined = buffer.low_latency_combine(expert(recv), topk_idx, weights, handle)[0]
            torch.cuda.synchronize()
            buffer.low_latency_query_mask_buffer(status)
            masked = [r for r in range(num_ranks) if status[r]]
            layout_range = handle.layout_range.cpu()
            got = (layout_range & 0xFFFFFFFF).sum(0) > 0
            absent = frozenset(s for s in range(num_ranks) if sends[s] and not got[s])
            assert absent <= set(masked), f"{what}: sources {sorted(absent)} left out, masked {masked}"
            want = dispatch_oracle(absent)
            assert torch.equal(count.cpu(), want["packed_recv_count"]), f"{what}: counts without {sorted(absent)}"
            assert torch.equal(layout_range, want["layout_range"]), f"{what}: layout_range without {sorted(absent)}"
            valid = _valid_slots(layout_range, num_slots)
            assert torch.equal(recv.cpu()[valid], want["packed_recv_x"][valid]), \
                f"{what}: rows without sources {sorted(absent)}: " \
                f"{_differences(want['packed_recv_x'][valid], recv.cpu()[valid])}"
            assert torch.equal(handle.src_info.cpu()[valid], want["src_info"][valid]), f"{what}: src_info"
            sets = [[d for d in range(num_ranks) if d not in left_out]
                    for n in range(len(masked) + 1) for left_out in itertools.combinations(masked, n)]
            assert any(torch.equal(combined.cpu(), combined_over(s)) for s in sets), \
                f"{what}: the combine is no sum over one set of ranks (masked {masked})"
            kept_some += int(len(masked) < num_ranks)
            masked_some += int(bool(masked))
        dist.barrier()
        buffer.runtime.check_failures()
        buffer.destroy()
    counts = [None] * num_ranks
    dist.all_gather_object(counts, (kept_some, masked_some))
    calls = len(DEADLINE_TIMEOUTS_US) * DEADLINE_ROUNDS
    assert any(m > 0 for _, m in counts), f"no call of {calls} on any rank reached a deadline: {counts}"
    return f"{calls} calls per rank at deadlines {DEADLINE_TIMEOUTS_US} us; (kept a peer, masked a peer): {counts}"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_ranks_kept_or_masked_at_the_deadline_are_so_for_every_row(num_ranks, seed):
    print(spawn.run(num_ranks, _deadline_race, seed)[0])
