"""Internode normal mode on the CUDA backend (NOTE [internode kernels]) against the reference backend's hierarchical
path on the same virtual nodes (4 ranks as 2 x 2, 8 as 4 x 2 and 2 x 4; device machine only, on one GPU under
MPS): everything that crosses a node goes through NVSHMEM. Dispatch must match bit for bit (data, scales,
indices, weights, per-expert counts, every field of the handle; a rank that receives nothing, one that sends
nothing), a cached dispatch with the handle and with the plain 10-tuple too, and combine bit for bit (the same
float32 sums per node, rounded to bf16 once per node, then over the nodes in the same order). Fresh random
inputs per case; the combine's output is poisoned first."""

from __future__ import annotations

import pytest
import torch

from tokenyard.jit import nvshmem

from . import spawn

pytestmark = [spawn.needs_ranks(),
              pytest.mark.skipif(nvshmem.find() is None, reason="needs NVSHMEM (pip install tokenyard[internode])")]

CASES = [
    # (num_tokens, hidden, num_experts, num_topk, kind, dtype, num_worst_tokens)
    (256, 7168, 256, 8, "uniform", "fp8", 0),
    (200, 2048, 64, 4, "skewed", "bf16", 0),
    (96, 2048, 32, 4, "masked", "int8", 0),
    (64, 2048, 32, 8, "empty_rank", "bf16", 0),   # the last rank receives nothing
    (96, 2048, 16, 4, "no_tokens", "bf16", 0),    # rank 1 sends nothing
    (128, 4096, 64, 8, "uniform", "bf16", 2048),
]
RDMA_BYTES = 192 << 20
# A region that holds a few dozen of these tokens per round (NOTE [internode rounds]): 4 to 9 rounds a call.
ROUND_CASES = [
    (160, 2048, 32, 4, "uniform", "bf16", 0),
    (160, 2048, 32, 4, "skewed", "fp8", 0),
    (160, 2048, 32, 4, "no_tokens", "bf16", 0),
    (128, 2048, 32, 4, "masked", "bf16", 1024),
]
ROUND_RDMA_BYTES = 1600 << 10


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def _compare_ranks(seed, ranks_per_node, rdma_bytes=RDMA_BYTES, cases=CASES):
    import torch.distributed as dist

    from tokenyard import Buffer, Config, InternodeHandle
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = Config(num_max_tokens_per_rank=256).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
    ref = Buffer(dist.group.WORLD, nvl_bytes, 0, backend="reference", ranks_per_node=ranks_per_node)
    cuda = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="cuda", ranks_per_node=ranks_per_node,
                  timeout_s=30)
    cuda.runtime.poison_outputs = True
    report = []
    for case_id, (num_tokens, hidden, num_experts, num_topk, kind, dtype, worst) in enumerate(cases):
        x, topk_idx, topk_weights = make_rank_inputs(seed + case_id, num_ranks, num_tokens, hidden, num_experts,
                                                     num_topk, kind, dtype, device)[rank]
        what = f"rank {rank} case {case_id} {kind}/{dtype}/h{hidden}/k{num_topk}/worst{worst}"
        layouts = [b.get_dispatch_layout(topk_idx, num_experts) for b in (ref, cuda)]
        for i, name in enumerate(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                  "is_token_in_rank")):
            spawn.assert_same(f"{what}: layout {name}", layouts[0][i], layouts[1][i])
        per_rank, per_rdma, per_expert, in_rank, _ = layouts[1]
        outs = [b.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                           num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, expert_alignment=4, num_worst_tokens=worst)
                for b in (ref, cuda)]
        torch.cuda.synchronize()
        dispatch_rounds = cuda.runtime._internode_kernels().rounds["dispatch"]
        (rx, ri, rw, rl, rh, _), (cx, ci, cw, cl, ch, _) = outs
        assert isinstance(ch, InternodeHandle), f"{what}: handle {type(ch).__name__}"
        num_recv = int(rh.recv_gbl_rank_prefix_sum[-1])
        for name, a, b in (("recv_x", _split(rx)[0][:num_recv], _split(cx)[0][:num_recv]),
                           ("recv_x_scales", _split(rx)[1], _split(cx)[1]),
                           ("recv_topk_idx", ri, ci), ("recv_topk_weights", rw, cw)):
            spawn.assert_same(f"{what}: {name}", a if name != "recv_x_scales" or a is None else a[:num_recv],
                  b if name != "recv_x_scales" or b is None else b[:num_recv])
        assert rl == cl, f"{what}: per-expert counts {rl} vs {cl}"
        for name in InternodeHandle._fields:
            spawn.assert_same(f"{what}: handle.{name}", getattr(rh, name), getattr(ch, name))

        # Cached dispatch, with the handle and with DeepEP's plain 10-tuple.
        for how, h in (("handle", ch), ("10-tuple", tuple(ch))):
            again = _split(cuda.dispatch(x, handle=h)[0])
            spawn.assert_same(f"{what}: cached dispatch ({how})", again[0][:num_recv], _split(cx)[0][:num_recv])

        # Combine, with weights and a bias, then without either.
        y = torch.randn(_split(cx)[0].size(0), hidden, device=device).to(torch.bfloat16)
        bias = torch.randn(_split(x)[0].size(0), hidden, device=device).to(torch.bfloat16)  # "no_tokens": none
        for how, with_extras in (("weights and bias", True), ("plain", False)):
            rc = ref.combine(y, rh, topk_weights=rw if with_extras else None, bias=bias if with_extras else None)
            cc = cuda.combine(y, ch, topk_weights=cw if with_extras else None, bias=bias if with_extras else None)
            torch.cuda.synchronize()
            error = (rc[0].float() - cc[0].float()).abs().max().item() if rc[0].numel() else 0.0
            assert torch.equal(rc[0], cc[0]), f"{what}: combine ({how}) differs, max abs error {error}"
            spawn.assert_same(f"{what}: combined weights ({how})", rc[1], cc[1])
        report.append((case_id, num_recv, dispatch_rounds, cuda.runtime._internode_kernels().rounds["combine"]))

    # NOTE [device exchange]: every call's agreement and counts went through the transport, none over the group.
    assert cuda.runtime._internode_kernels().exchanges >= 2 * len(report), \
        f"rank {rank}: {cuda.runtime._internode_kernels().exchanges} exchanges through the transport"
    # Internode calls read their counts on the host: refused inside a CUDA-graph capture, then eager calls go on.
    from tokenyard import InvalidInputError

    for call in (lambda: cuda.combine(y, ch), lambda: cuda.dispatch(x, handle=ch)):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(InvalidInputError, match="CUDA-graph capture"):
            with torch.cuda.graph(graph):
                call()
        del graph
    spawn.assert_same(f"rank {rank}: combine after the refusals", ref.combine(y, rh)[0], cuda.combine(y, ch)[0])
    cuda.destroy()
    ref.destroy()
    return report


@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts())
def test_internode_kernels_match_the_reference_hierarchical_path(num_ranks, ranks_per_node):
    seed = int(torch.randint(0, 2**30, ()).item())
    reports = spawn.run(num_ranks, _compare_ranks, seed, ranks_per_node, timeout_s=420.0, fresh=True)
    print(f"internode kernels, {num_ranks // ranks_per_node} nodes x {ranks_per_node} on "
          f"{spawn.describe(num_ranks)}, seed {seed}: (case, rows received, dispatch and combine launches) {reports}")
    assert all(case[2:] == (1, 1) for report in reports for case in report), reports


@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts()[:2])
def test_calls_larger_than_the_region_run_in_rounds_with_the_results_of_one(num_ranks, ranks_per_node):
    seed = int(torch.randint(0, 2**30, ()).item())
    # A node of one rank receives fewer rows of a call than a node of two: a smaller region makes its calls
    # larger than it too (at 2 nodes x 1, 1600 KiB held the FP8 and masked cases whole).
    rdma_bytes = ROUND_RDMA_BYTES if ranks_per_node > 1 else ROUND_RDMA_BYTES // 4
    reports = spawn.run(num_ranks, _compare_ranks, seed, ranks_per_node, rdma_bytes, ROUND_CASES,
                        timeout_s=420.0, fresh=True)
    print(f"internode rounds, {num_ranks // ranks_per_node} nodes x {ranks_per_node}, seed {seed}: {reports}")
    # (case, rows received, dispatch launches, combine launches) per rank: every call needed several rounds.
    assert all(rounds > 1 for report in reports for case in report for rounds in case[2:]), reports


def _timeout_recorded(buffer, rank: int, stage_fits, where: str):
    """After rank 1 skipped its part of a call: rank 1 recorded nothing, every other rank a CommTimeoutError that
    names itself at a stage `stage_fits` accepts (`where` says which, for the message). -> what was recorded."""
    from tokenyard import CommTimeoutError

    seen = None
    try:
        buffer.runtime.check_failures()
    except CommTimeoutError as exc:
        seen = exc
    if rank == 1:
        assert seen is None, f"rank 1 skipped its part, yet recorded {seen}"
    else:
        assert seen is not None and seen.rank == rank and stage_fits(seen.stage), \
            f"rank {rank}: expected a timeout {where}, got {seen!r}"
    return seen


def _peer_that_stops(seed, ranks_per_node):
    """Rank 1 skips its combine kernel: the others' kernels wait at the combine's start barrier until their
    deadline and record it; each raises CommTimeoutError naming itself and the stage, a new Buffer then works."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = Config(num_max_tokens_per_rank=64).get_nvl_buffer_size_hint(2048 * 2, num_ranks)

    def round_trip(buffer, seed_):
        x, topk_idx, weights = make_rank_inputs(seed_, num_ranks, 64, 2048, 32, 4, "uniform", "bf16", device)[rank]
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 32)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                          num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert)
        return recv_x, handle, buffer.combine(recv_x, handle)[0]

    failing = Buffer(dist.group.WORLD, nvl_bytes, 32 << 20, backend="cuda", ranks_per_node=ranks_per_node,
                     timeout_s=3)
    round_trip(failing, seed)  # starts the internode kernels
    kernels = failing.runtime._internode_kernels()
    if rank == 1:
        launch = kernels._launch
        kernels._launch = lambda spec, *args, **kwargs: None if "combine" in spec.name else launch(spec, *args,
                                                                                                    **kwargs)
    recv_x, handle, _ = round_trip(failing, seed + 1)
    torch.cuda.synchronize()
    seen = _timeout_recorded(failing, rank, lambda stage: stage == "internode/barrier", "at internode/barrier")
    failing.destroy()

    fresh = Buffer(dist.group.WORLD, nvl_bytes, 32 << 20, backend="cuda", ranks_per_node=ranks_per_node,
                   timeout_s=30)
    ref = Buffer(dist.group.WORLD, nvl_bytes, 0, backend="reference", ranks_per_node=ranks_per_node)
    got, want = round_trip(fresh, seed + 2), round_trip(ref, seed + 2)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), f"rank {rank}: the new Buffer differs"
    fresh.destroy()
    ref.destroy()
    return str(seen)


@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts()[:1])
def test_a_peer_that_stops_times_out_naming_rank_and_stage_then_a_new_buffer_works(num_ranks, ranks_per_node):
    seed = int(torch.randint(0, 2**30, ()).item())
    reports = spawn.run(num_ranks, _peer_that_stops, seed, ranks_per_node, timeout_s=300.0, fresh=True)
    print(f"internode peer that stops, {num_ranks // ranks_per_node} nodes x {ranks_per_node}: {reports}")


def _low_latency_peer_that_stops(seed, ranks_per_node):
    """Low-latency calls across nodes (NOTE [internode low-latency] in include/tokenyard/sync.cuh), no rank mask:
    rank 1 skips its combine, so the others wait for its weights and rows until their deadline; each raises
    CommTimeoutError naming itself and a combine stage, and a new Buffer then matches the reference backend."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts = 32, 1024, 8 * num_ranks
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)

    def call(buffer, seed_, combine=True):
        x, topk_idx, weights = make_rank_inputs(seed_, num_ranks, num_tokens, hidden, num_experts, 4, "uniform",
                                                "bf16", device)[rank]
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
        return count, buffer.low_latency_combine(recv, topk_idx, weights, handle)[0] if combine else None

    failing = Buffer(dist.group.WORLD, 0, size, backend="cuda", ranks_per_node=ranks_per_node, timeout_s=3)
    failing.runtime.use_low_latency_kernels = True
    assert failing.runtime._low_latency_kernels.remote != 0, "the low-latency kernels put to no rank"
    call(failing, seed)
    torch.cuda.synchronize()
    dist.barrier()
    call(failing, seed + 1, combine=rank != 1)
    torch.cuda.synchronize()
    seen = _timeout_recorded(failing, rank, lambda stage: stage.startswith("low_latency_combine/"),
                             "in the low-latency combine")
    failing.destroy()

    fresh = Buffer(dist.group.WORLD, 0, size, backend="cuda", ranks_per_node=ranks_per_node, timeout_s=30)
    fresh.runtime.use_low_latency_kernels = True
    ref = Buffer(dist.group.WORLD, 0, size, backend="reference", ranks_per_node=ranks_per_node)
    (got_count, got), (want_count, want) = call(fresh, seed + 2), call(ref, seed + 2)
    torch.cuda.synchronize()
    assert torch.equal(got_count, want_count), f"rank {rank}: the new Buffer's counts differ"
    assert_within_bf16_rounding(got, want, f"rank {rank}: the new Buffer's combine")
    fresh.destroy()
    ref.destroy()
    return str(seen)


@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts()[:1])
def test_a_low_latency_peer_that_stops_times_out_then_a_new_buffer_works(num_ranks, ranks_per_node):
    seed = int(torch.randint(0, 2**30, ()).item())
    reports = spawn.run(num_ranks, _low_latency_peer_that_stops, seed, ranks_per_node, timeout_s=300.0, fresh=True)
    print(f"low-latency peer that stops, {num_ranks // ranks_per_node} nodes x {ranks_per_node}: {reports}")


def _second_group(seed):
    """NVSHMEM serves one group per process (NOTE [NVSHMEM start]): with it started for the world, a Buffer on a
    group of the first half of the ranks, nodes of 2, keeps its low-latency calls over CUDA IPC on every rank of
    that group (Transport.refusal, agreed before any collective) and matches the reference backend there (the
    other half waits: a second group calling at once would overfill the one GPU the ranks share)."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    size = Buffer.get_low_latency_rdma_size_hint(32, 1024, num_ranks, 4 * num_ranks)
    world = Buffer(dist.group.WORLD, 0, size, backend="cuda", ranks_per_node=2, timeout_s=30)
    assert world.runtime._low_latency_kernels.remote != 0, "the world's Buffer puts to no rank"
    half = num_ranks // 2
    group = dist.new_group(list(range(half)))
    if rank < half:
        num_experts = 4 * half
        size = Buffer.get_low_latency_rdma_size_hint(32, 1024, half, num_experts)
        cuda = Buffer(group, 0, size, backend="cuda", ranks_per_node=2, timeout_s=30)
        ref = Buffer(group, 0, size, backend="reference", ranks_per_node=2)
        assert cuda.runtime._low_latency_kernels.remote == 0 and cuda.runtime.heap_buffer is None
        x, topk_idx, weights = make_rank_inputs(seed, half, 32, 1024, num_experts, 4, "uniform", "bf16",
                                                device)[rank]
        outs = []
        for buffer in (ref, cuda):
            recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, num_experts, use_fp8=False)
            outs.append((count, buffer.low_latency_combine(recv, topk_idx, weights, handle)[0]))
        torch.cuda.synchronize()
        assert torch.equal(outs[0][0], outs[1][0]), f"rank {rank}: counts differ"
        assert_within_bf16_rounding(outs[1][1], outs[0][1], f"rank {rank}: combine")
        cuda.destroy()
        ref.destroy()
    dist.barrier()
    world.destroy()
    return "ok"


@pytest.mark.parametrize("num_ranks", [n for n in spawn.rank_counts() if n >= 8][:1])
def test_a_second_group_keeps_low_latency_over_ipc_while_nvshmem_serves_the_first(num_ranks):
    seed = int(torch.randint(0, 2**30, ()).item())
    spawn.run(num_ranks, _second_group, seed, timeout_s=300.0, fresh=True)


def _virtual_hosts(seed):
    """Ranks of one machine as hosts of 2 (NOTE [virtual hosts]): the CUDA backend starts with its internode
    kernels, maps no memory across hosts, and its normal and low-latency calls match the reference backend's
    (NOTE [several hosts]), the low-latency ones on the kernels that put to the other hosts' ranks (NOTE [internode
    low-latency] in include/tokenyard/sync.cuh): their combine, whose sums are pre-reduced, within bf16 rounding of
    the reference's and bit for bit the pre-reduced oracle."""
    from .test_low_latency_cuda import _pre_reduced
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    nvl_bytes = Config(num_max_tokens_per_rank=128).get_nvl_buffer_size_hint(2048 * 2, num_ranks)
    rdma_bytes = max(64 << 20, Buffer.get_low_latency_rdma_size_hint(128, 2048, num_ranks, 32))
    cuda = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="cuda", timeout_s=30)
    ref = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="reference")
    backend = cuda.runtime
    same_host = {r for r in range(num_ranks) if r // 2 == rank // 2}
    assert cuda.runtime.get_num_rdma_ranks() == num_ranks // 2 and backend.low_latency_buffer is None
    assert {r for r, base in enumerate(backend.normal.bases) if base} == same_host, backend.normal.bases
    assert backend._low_latency_kernels.remote == sum(1 << r for r in range(num_ranks) if r not in same_host)

    all_inputs = make_rank_inputs(seed, num_ranks, 128, 2048, 32, 4, "skewed", "fp8", device)
    x, topk_idx, weights = all_inputs[rank]
    outs, layout_ranges = [], []
    for buffer in (ref, cuda):
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 32)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y = (recv_x[0].float() * 0.5).to(torch.bfloat16)
        combined = buffer.combine(y, handle, topk_weights=recv_w)[0]
        bf16 = x[0].float().to(torch.bfloat16)
        packed, count, ll_handle, _, _ = buffer.low_latency_dispatch(bf16, topk_idx, 128, 32, use_fp8=False)
        ll_out = buffer.low_latency_combine(packed, topk_idx, weights, ll_handle)[0]
        outs.append((recv_x[0], recv_idx, counts, combined, packed, count, ll_out))
        layout_ranges.append(ll_handle.layout_range)
    torch.cuda.synchronize()
    names = ("recv_x", "recv_topk_idx", "per-expert counts", "combine", "low-latency recv", "low-latency counts",
             "low-latency combine")
    for name, a, b in zip(names, *outs):
        if name == "per-expert counts":
            assert a == b, f"rank {rank}: {name} {a} vs {b}"
        elif name == "low-latency recv":  # only each expert's received rows are defined
            for e in range(a.size(0)):
                n = int(outs[0][5][e])
                spawn.assert_same(f"rank {rank}: {name} of expert {e}", a[e, :n], b[e, :n])
        elif name == "low-latency combine":
            assert_within_bf16_rounding(b, a, f"rank {rank}: {name} against the reference backend")
            spawn.assert_same(f"rank {rank}: {name} against the pre-reduced oracle",
                              _pre_reduced(outs[0][4], layout_ranges[0], all_inputs, 32), b)
        else:
            spawn.assert_same(f"rank {rank}: {name}", a, b)
    cuda.destroy()
    ref.destroy()
    return "ok"


@pytest.mark.parametrize("num_ranks", [n for n in spawn.rank_counts() if n >= 4][:1])
def test_virtual_hosts_run_normal_mode_on_the_internode_kernels_and_map_nothing_across(num_ranks, monkeypatch):
    monkeypatch.setenv("TOKENYARD_VIRTUAL_HOSTS", "2")
    seed = int(torch.randint(0, 2**30, ()).item())
    spawn.run(num_ranks, _virtual_hosts, seed, timeout_s=300.0, fresh=True)
