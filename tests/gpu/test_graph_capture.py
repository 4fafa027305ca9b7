"""Normal-mode calls captured in a CUDA graph (NOTE [graph capture] in buffer.py), device machine only: DeepEP
V2's decode step (ElasticBuffer dispatch with do_cpu_sync=False, then combine) captured once on the CUDA
backend and replayed on fresh inputs copied into the captured tensors, each replay against the same calls
made eagerly on the reference backend (dispatch bit for bit, its outputs poisoned at every replay; combine
within bf16 rounding); then eager calls on the CUDA backend, which must still agree with their peers on the
call numbers the replays advanced (NOTE [normal-mode call numbers] in include/tokenyard/sync.cuh). Calls
that cannot be captured are refused inside the capture."""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

NUM_TOKENS, HIDDEN, NUM_TOPK, REPLAYS = 64, 2048, 8, 3

# (dtype, do_expand, expert_alignment, routing kind)
CASES = (("bf16", False, 1, "uniform"), ("fp8", True, 128, "masked"), ("bf16", True, 16, "skewed"))


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def _copy_into(static, fresh):
    for s, f in zip(_split(static), _split(fresh)):
        if s is not None:
            s.copy_(f)


def _same(what, a, b):
    assert a.shape == b.shape and torch.equal(spawn.bits(a), spawn.bits(b)), f"{what} differs"


def _step(buffer, x, topk_idx, weights, stats, num_experts, do_expand, alignment):
    """A decode step's communication: dispatch without the CPU sync, an expert stand-in, combine."""
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
        x, topk_idx, weights, stats, num_experts, expert_alignment=alignment, do_cpu_sync=False,
        do_expand=do_expand, do_zero_padding=do_expand)
    expert_out = (_split(recv_x)[0].float() * 0.5 - 0.25).to(torch.bfloat16)
    combined, combined_w, _ = buffer.combine(expert_out, handle, recv_w)
    return dict(x=recv_x, idx=recv_idx, w=recv_w, handle=handle, combined=combined, combined_w=combined_w)


def _compare(what, got, want, do_expand):
    h, hr = got["handle"], want["handle"]
    valid = hr.psum_num_recv_tokens_per_scaleup_rank[-1].item()
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert"):
        _same(f"{what}: handle.{name}", getattr(h, name), getattr(hr, name))
    rows = slice(None) if do_expand else slice(0, valid)  # expanded: padding zeroed on both
    for i, (a, b) in enumerate(zip(_split(got["x"]), _split(want["x"]))):
        if b is not None:
            _same(f"{what}: recv_x[{i}]", a[rows], b[rows])
    _same(f"{what}: recv_topk_weights", got["w"][rows], want["w"][rows])
    if not do_expand:
        _same(f"{what}: recv_topk_idx", got["idx"], want["idx"])
    from tokenyard.tools.testing import assert_within_bf16_rounding

    assert_within_bf16_rounding(got["combined"], want["combined"], f"{what}: combine")
    assert torch.equal(got["combined_w"], want["combined_w"]), f"{what}: combined weights"
    return valid


def _replays_match(seed):
    import torch.distributed as dist

    from tokenyard import ElasticBuffer, InvalidInputError
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    num_local = num_experts // num_ranks
    cuda = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                         num_gpu_timeout_secs=30, backend="cuda", check_inputs=False)
    cuda.buffer.runtime.poison_outputs = True
    ref = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                        backend="reference", check_inputs=False)

    def inputs(index, dtype, kind):
        return make_rank_inputs(seed + index, num_ranks, NUM_TOKENS, HIDDEN, num_experts, NUM_TOPK, kind, dtype,
                                device)[rank]

    reports = []
    for case, (dtype, do_expand, alignment, kind) in enumerate(CASES):
        x, topk_idx, weights = inputs(1000 * case, dtype, kind)  # the captured tensors
        stats = torch.zeros(num_local, dtype=torch.int32, device=device)
        args = (num_experts, do_expand, alignment)
        side = torch.cuda.Stream()  # warm up off the capture's stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _step(cuda, x, topk_idx, weights, stats, *args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _step(cuda, x, topk_idx, weights, stats, *args)
        # Nothing captured ran, but PyTorch's sanitizer (CSAN, run_device.sh sanitizer) records a captured kernel's
        # reads as if it had: without this sync it reports the writes below as racing with them.
        torch.cuda.synchronize()
        for replay in range(REPLAYS):
            fresh = inputs(1000 * case + replay + 1, dtype, kind)
            for static, value in zip((x, topk_idx, weights), fresh):
                _copy_into(static, value)
            stats.zero_()
            graph.replay()
            ref_stats = torch.zeros_like(stats)
            want = _step(ref, *fresh[:3], ref_stats, *args)
            torch.cuda.synchronize()
            valid = _compare(f"case {case} replay {replay}", captured, want, do_expand)
            _same(f"case {case} replay {replay}: stats", stats, ref_stats)
            reports.append(f"case {case} {CASES[case]} replay {replay}: {valid} rows received: matches")
        # Eager calls after the replays: the CPU-synced dispatch waits for its own call's counts.
        fresh = inputs(1000 * case + 999, dtype, kind)
        got = {}, {}
        for buffer, out in zip((cuda, ref), got):
            recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(*fresh[:3], None, num_experts,
                                                                  expert_alignment=alignment, do_expand=do_expand,
                                                                  do_zero_padding=do_expand)
            expert_out = (_split(recv_x)[0].float() * 0.5 - 0.25).to(torch.bfloat16)
            combined, combined_w, _ = buffer.combine(expert_out, handle, recv_w)
            out.update(x=recv_x, idx=recv_idx, w=recv_w, handle=handle, combined=combined, combined_w=combined_w)
        torch.cuda.synchronize()
        _compare(f"case {case} eager after the replays", got[0], got[1], do_expand)
        del graph, captured

    # What cannot be captured is refused inside the capture, and the Buffers go on serving eager calls.
    x, topk_idx, weights = inputs(5000, "bf16", "uniform")
    done = _step(ref, x, topk_idx, weights, None, num_experts, False, 1)
    refused = ((lambda: cuda.dispatch(x, topk_idx, weights, None, num_experts, do_cpu_sync=True), "do_cpu_sync=False"),
               (lambda: ref.combine(done["combined"].new_ones(done["x"].shape), done["handle"], done["w"]),
                "reference backend"))
    for call, said in refused:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(InvalidInputError, match=said):
            with torch.cuda.graph(graph):
                call()
        del graph
    got = {}, {}
    for buffer, out in zip((cuda, ref), got):
        out.update(_step(buffer, x, topk_idx, weights, None, num_experts, False, 1))
    torch.cuda.synchronize()
    _compare("eager after the refusals", got[0], got[1], False)
    reports.append("refused inside a capture: a CPU-synced dispatch, the reference backend; eager calls after: match")
    cuda.buffer.runtime.check_failures()
    for buffer in (cuda, ref):
        buffer.destroy()
    return reports


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_normal_mode_calls_replay_from_a_cuda_graph(num_ranks, seed):
    for line in spawn.run(num_ranks, _replays_match, seed)[0]:
        print(line)
