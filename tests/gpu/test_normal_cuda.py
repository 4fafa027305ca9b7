"""CUDA backend, normal mode, against the reference backend on the same inputs (device machine only).

Dispatch must match bit for bit (data, scales, indices, weights, counts, order, handle), and combine too (the
same float32 sums in the same order, then one rounding to bf16). Outputs are poisoned before the kernels
write them.
"""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

CASES = [
    # (num_tokens, hidden, num_experts, num_topk, kind, dtype)
    (512, 7168, 256, 8, "uniform", "fp8"),
    (512, 7168, 256, 8, "uniform", "bf16"),
    (300, 4096, 64, 4, "skewed", "bf16"),
    (257, 2048, 32, 1, "masked", "int8"),
    (128, 2048, 64, 16, "empty_rank", "fp8"),
    (96, 2048, 16, 4, "no_tokens", "bf16"),
    (160, 2048, 32, 4, "repeated", "fp8"),  # an expert twice in a row: counted per (token, k), as DeepEP
]


def _compare_ranks(seed, cases):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs, unaligned_copy

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    reports = []
    for case_id, (num_tokens, hidden, num_experts, num_topk, kind, dtype) in enumerate(cases):
        x, topk_idx, topk_weights = make_rank_inputs(seed + case_id, num_ranks, num_tokens, hidden, num_experts,
                                                     num_topk, kind, dtype, device)[rank]
        data = x[0] if isinstance(x, tuple) else x
        size = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(hidden * max(data.element_size(), 2),
                                                                                   num_ranks)
        ref = Buffer(dist.group.WORLD, size, 0, backend="reference")
        cuda = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
        cuda.runtime.poison_outputs = True
        what = f"case {case_id} {kind}/{dtype}/h{hidden}/k{num_topk}"
        print(f"rank {rank}: {what}", flush=True)

        # Twice on the CUDA Buffer: the second call takes the kernel's ticket where the first left it
        # (NOTE [layout without a fill]).
        layouts = [b.get_dispatch_layout(topk_idx, num_experts) for b in (ref, cuda, cuda)]
        for name, i in (("num_tokens_per_rank", 0), ("num_tokens_per_expert", 2), ("is_token_in_rank", 3)):
            for call in (1, 2):
                assert torch.equal(layouts[0][i], layouts[call][i]), f"{what}: layout {name} differs (call {call})"
        per_rank, _, per_expert, in_rank, _ = layouts[1]
        outs = [b.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=4)
                for b in (ref, cuda)]
        torch.cuda.synchronize()
        (rx, ri, rw, rl, rh, _), (cx, ci, cw, cl, ch, _) = outs
        rx, cx = (rx if isinstance(rx, tuple) else (rx,)), (cx if isinstance(cx, tuple) else (cx,))
        for name, a, b in [("recv_x", rx[0], cx[0]), ("recv_topk_idx", ri, ci), ("recv_topk_weights", rw, cw),
                           ("rank_prefix_matrix", rh[0], ch[0]), ("recv_src_idx", rh[3], ch[3]),
                           ("send_head", rh[5], ch[5])] + ([("recv_x_scales", rx[1], cx[1])] if len(rx) > 1 else []):
            assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} vs {tuple(b.shape)}"
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), f"{what}: {name} differs"
        assert rl == cl, f"{what}: per-expert counts {rl} vs {cl}"

        # Cached dispatch.
        again = cuda.dispatch(x, handle=ch)[0]
        again = again if isinstance(again, tuple) else (again,)
        assert torch.equal(again[0].view(torch.uint8), cx[0].view(torch.uint8)), f"{what}: cached dispatch differs"

        # Combine of random rows with weights and bias: the same float32 sums in the same order.
        y = torch.randn(cx[0].size(0), hidden, device=device).to(torch.bfloat16)
        bias = torch.randn(data.size(0), hidden, device=device).to(torch.bfloat16)
        rc = ref.combine(y, rh, topk_weights=rw, bias=bias)
        cc = cuda.combine(y, ch, topk_weights=cw, bias=bias)
        torch.cuda.synchronize()
        error = (rc[0].float() - cc[0].float()).abs().max().item() if rc[0].numel() else 0.0
        assert torch.equal(rc[0], cc[0]), f"{what}: combine differs (max abs error {error})"
        assert torch.equal(rc[1], cc[1]), f"{what}: combined weights differ"
        # The same weights 4 bytes off a 16-byte boundary: the lanes store them, not TMA (NOTE [combine weights]).
        cs = cuda.combine(y, ch, topk_weights=unaligned_copy(cw), bias=bias)
        torch.cuda.synchronize()
        assert torch.equal(rc[0], cs[0]) and torch.equal(rc[1], cs[1]), f"{what}: combine of unaligned weights differs"

        # num_worst_tokens: same rows, padded.
        worst = num_tokens * num_ranks
        wx, wi, ww, wl, wh, _ = cuda.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                              num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, num_worst_tokens=worst)
        torch.cuda.synchronize()
        n = ri.size(0)
        wx = wx if isinstance(wx, tuple) else (wx,)
        assert wl == [] and wx[0].size(0) == worst
        assert torch.equal(wx[0][:n].view(torch.uint8), cx[0].view(torch.uint8)), f"{what}: worst-case rows differ"
        assert bool((wi[n:] == -1).all()) and bool((ww[n:] == 0).all()), f"{what}: padding rows not cleared"
        cuda.runtime.check_failures()
        ref.destroy()
        cuda.destroy()
        reports.append(f"{what}: ok ({ri.size(0)} rows)")
    return reports


def _small_dispatch(seed, num_tokens, timeout_s):
    """A CUDA Buffer and the arguments of one small bf16 dispatch (hidden 1024, top-4 of 16 experts)."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, 1024, 16, 4, "uniform", "bf16", device)[rank]
    size = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(2048, num_ranks)
    buffer = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=timeout_s)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 16)
    args = dict(topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)
    return x, args, size, buffer


def _timeout_then_recover(seed):
    import torch.distributed as dist

    import tokenyard
    from tokenyard import Buffer

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, args, size, buffer = _small_dispatch(seed, 64, timeout_s=3)
    message = "skipped"
    if rank != num_ranks - 1:  # the last rank skips this call
        try:
            buffer.dispatch(x, **args)
            raise AssertionError("a dispatch with a missing rank returned")
        except tokenyard.CommTimeoutError as exc:
            message = str(exc)
            assert exc.rank == rank and "dispatch" in exc.stage, message
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    fresh = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
    recv = fresh.dispatch(x, **args)[0]
    torch.cuda.synchronize()
    fresh.destroy()
    return f"{message}; a new Buffer then dispatched {recv.size(0)} rows"


def _different_sms_then_recover(seed):
    # NOTE [sender ranges]: the receivers assume every rank sends with as many warps as they do. Ranks that
    # use different SM counts must get an error, never rows misplaced or missing.
    import torch.distributed as dist

    import tokenyard
    from tokenyard import Buffer

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, args, size, buffer = _small_dispatch(seed, 512, timeout_s=5)
    default_sms = Buffer.num_sms
    if rank == 0:  # fewer than the others use, within the SMs a rank may fill (fewer where ranks share a GPU)
        Buffer.set_num_sms(max(2, (min(default_sms, buffer.runtime.device_sms) - 2) // 2 * 2))
    message = None
    try:
        buffer.dispatch(x, **args)
        torch.cuda.synchronize()
        buffer.runtime.check_failures()
    except tokenyard.TokenyardError as exc:
        message = str(exc)
    torch.cuda.synchronize()
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, message)
    errors = [m for m in gathered if m is not None]
    assert errors, "ranks with different SM counts dispatched without an error"
    assert all("same number of SMs" in m or "timed out" in m.lower() for m in errors), errors
    assert any("same number of SMs" in m for m in errors), errors
    buffer.destroy()
    Buffer.set_num_sms(default_sms)
    fresh = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
    recv = fresh.dispatch(x, **args)[0]
    torch.cuda.synchronize()
    fresh.destroy()
    return f"{errors[0]}; a new Buffer then dispatched {recv.size(0)} rows"


# Launch choices taken the other way (tokenyard/backends/cuda/heuristics.py): what each sets there, from its values.
# Each path a token's row for its own rank can take, in both kernels; the blocks shaped for the other side of
# heuristics.MANY_RANKS (NOTE [block shapes by ranks]).
FLIPPED = {"own_rows": ("DISPATCH_OWN_ROWS_DIRECT", "COMBINE_OWN_ROWS_DIRECT")}
OTHER_WAYS = (*FLIPPED, "block_shapes")


def _other_way(way: str, heuristics, num_ranks: int) -> dict:
    if way in FLIPPED:
        return {name: not getattr(heuristics, name) for name in FLIPPED[way]}
    if num_ranks >= heuristics.MANY_RANKS:
        return {"DISPATCH_THREADS_MANY_RANKS": heuristics.DISPATCH_THREADS,
                "COMBINE_SEND_WARPS_MANY_RANKS": heuristics.COMBINE_SEND_WARPS,
                "COMBINE_THREADS_MANY_RANKS": heuristics.COMBINE_THREADS}
    return {"DISPATCH_THREADS": heuristics.DISPATCH_THREADS_MANY_RANKS,
            "COMBINE_SEND_WARPS": heuristics.COMBINE_SEND_WARPS_MANY_RANKS,
            "COMBINE_THREADS": heuristics.COMBINE_THREADS_MANY_RANKS}


def _compare_ranks_the_other_way(seed, cases, way):
    import torch.distributed as dist

    from tokenyard.backends.cuda import heuristics

    changes = _other_way(way, heuristics, dist.get_world_size())
    before = {name: getattr(heuristics, name) for name in changes}
    try:  # the pool's ranks run the tests after this one (NOTE [rank pool]): put the choices back
        for name, value in changes.items():
            setattr(heuristics, name, value)
        return _compare_ranks(seed, cases)
    finally:
        for name, value in before.items():
            setattr(heuristics, name, value)


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_cuda_normal_mode_matches_reference(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, _compare_ranks, seed, CASES)[0]:
        print(line)


@pytest.mark.parametrize("way", OTHER_WAYS)
@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_launch_choices_taken_the_other_way_match_reference(num_ranks, way, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, _compare_ranks_the_other_way, seed, CASES, way)[0]:
        print(line)


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_ranks_with_different_sm_counts_get_an_error_then_a_new_buffer_works(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, _different_sms_then_recover, seed):
        print(line)


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_missing_rank_raises_timeout_naming_rank_and_stage_then_new_buffer_works(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, _timeout_then_recover, seed):
        print(line)
