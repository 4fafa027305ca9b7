"""DeepEP V2's `ElasticBuffer` on the CUDA backend against the same calls on the reference backend over the same
group (docs/semantics.md, "ElasticBuffer"), device machine only: dispatch bit for bit (the CUDA Buffer's
outputs poisoned before its kernels write them), combine within bf16 rounding, expanded and not, bf16 and FP8,
with and without the CPU sync and weights, cached dispatches, bias, -1 entries and a rank that receives nothing, on the
current stream and (async_with_compute_stream) on the communication stream."""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

NUM_TOKENS, HIDDEN, NUM_TOPK = 96, 2048, 8

# (dtype, do_expand, expert_alignment, do_cpu_sync, routing kind, the fresh dispatch and the combine with weights)
CASES = (("bf16", False, 1, True, "uniform", True), ("fp8", True, 128, True, "masked", True),
         ("fp8", False, 64, False, "skewed", True), ("bf16", True, 16, False, "masked", False),
         ("fp8", True, 64, True, "empty_rank", True))  # the last rank receives no row


def _same(what, a, b):
    assert a is None and b is None or (a.shape == b.shape and torch.equal(spawn.bits(a), spawn.bits(b))), \
        f"{what} differs"


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def _elastic_matches(seed):
    from tokenyard.backends.cuda import heuristics

    # NOTE [expanded rows]: both paths under test at any rank count (the backend writes a cached dispatch's expanded
    # rows in the dispatch kernel from EXPAND_CACHED_IN_DISPATCH_MIN_RANKS ranks); put back for the pool's next tests
    # (NOTE [rank pool])
    before = heuristics.EXPAND_CACHED_IN_DISPATCH_MIN_RANKS
    heuristics.EXPAND_CACHED_IN_DISPATCH_MIN_RANKS = 2
    try:
        return _elastic_matches_both_paths(seed)
    finally:
        heuristics.EXPAND_CACHED_IN_DISPATCH_MIN_RANKS = before


def _elastic_matches_both_paths(seed):
    import torch.distributed as dist

    from tokenyard import ElasticBuffer
    from tokenyard.backends.cuda import heuristics
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    cuda = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                         num_gpu_timeout_secs=30, backend="cuda", check_inputs=False)
    cuda.buffer.runtime.poison_outputs = True
    ref = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                        backend="reference", check_inputs=False)
    reports = []
    in_kernel = heuristics.expand_in_dispatch_min_sms()  # NOTE [expanded rows]: from this many SMs
    after = max(2, in_kernel - 2)
    for case, (dtype, do_expand, alignment, do_cpu_sync, kind, with_weights) in enumerate(CASES):
        x, topk_idx, weights = make_rank_inputs(seed + case, num_ranks, NUM_TOKENS, HIDDEN, num_experts, NUM_TOPK,
                                                kind, dtype, device)[rank]
        got, want = {}, {}
        for buffer, out in ((cuda, got), (ref, want)):
            # NOTE [elastic streams]: odd cases run the CUDA calls on the comm stream, waited for by event
            side = dict(async_with_compute_stream=buffer is cuda and case % 2 == 1)
            stats = torch.zeros(num_experts // num_ranks, dtype=torch.int32, device=device)
            # Expanded: the layout made in the dispatch kernel (NOTE [expanded rows]), with and without the CPU sync;
            # in the last case after it.
            recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
                x, topk_idx, weights if with_weights else None, stats, num_experts, expert_alignment=alignment,
                do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_expand,
                num_sms=after if case == len(CASES) - 1 else in_kernel, **side)
            event.current_stream_wait()
            # A cached dispatch with other weights, expanded in the dispatch kernel (NOTE [expanded rows]); expanded
            # also on fewer SMs (the rows gathered after it) without zeroed padding.
            again = buffer.dispatch(x, topk_weights=weights * 0.5 + 0.25, handle=handle, do_expand=do_expand,
                                    do_zero_padding=do_expand, num_sms=in_kernel, **side)
            again[-1].current_stream_wait()
            loose = buffer.dispatch(x, topk_weights=weights, handle=handle, do_expand=True, num_sms=after, **side) \
                if do_expand else None
            if loose is not None:
                loose[-1].current_stream_wait()
            expert_out = (_split(recv_x)[0].float() * 0.5 - 0.25).to(torch.bfloat16)
            bias = (x[0] if isinstance(x, tuple) else x).float().mul(0.125).to(torch.bfloat16)
            # Without weights where the dispatch had none.
            combined, combined_w, event = buffer.combine(expert_out, handle, recv_w, bias, **side)
            event.current_stream_wait()
            out.update(x=recv_x, idx=recv_idx, w=recv_w, handle=handle, stats=stats, again=again, loose=loose,
                       combined=combined, combined_w=combined_w)
        torch.cuda.synchronize()
        h, hr = got["handle"], want["handle"]
        assert cuda.buffer._expands_fresh_in_kernel(x, NUM_TOPK, NUM_TOKENS, in_kernel) and \
            (after == in_kernel or not cuda.buffer._expands_fresh_in_kernel(x, NUM_TOPK, NUM_TOKENS, after)), \
            "the fresh paths under test"
        assert cuda.buffer._expands_in_kernel(h.dispatch_handle, x, NUM_TOPK, in_kernel) and \
            (after == in_kernel or not cuda.buffer._expands_in_kernel(h.dispatch_handle, x, NUM_TOPK, after)), \
            "the paths under test"

        valid = hr.psum_num_recv_tokens_per_scaleup_rank[-1].item()
        for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                     "num_unaligned_recv_tokens_per_expert"):
            _same(f"case {case}: handle.{name}", getattr(h, name), getattr(hr, name))
        _same(f"case {case}: recv_src_metadata", h.recv_src_metadata[:valid], hr.recv_src_metadata[:valid])
        # The handle keeps a copy of topk_idx (do_handle_copy's default), as DeepEP's
        _same(f"case {case}: handle.topk_idx", h.topk_idx, topk_idx)
        assert h.topk_idx.data_ptr() != topk_idx.data_ptr(), f"case {case}: handle.topk_idx is not a copy"
        assert (h.num_recv_tokens, h.num_expanded_tokens, h.num_recv_tokens_per_expert_list) == \
            (hr.num_recv_tokens, hr.num_expanded_tokens, hr.num_recv_tokens_per_expert_list), f"case {case}: counts"
        _same(f"case {case}: stats", got["stats"], want["stats"])
        rows = slice(None) if do_expand else slice(0, valid)  # expanded: padding zeroed on both
        for i, (a, b) in enumerate(zip(_split(got["x"]), _split(want["x"]))):
            _same(f"case {case}: recv_x[{i}]", None if a is None else a[rows], None if b is None else b[rows])
            _same(f"case {case}: cached recv_x[{i}]", None if a is None else _split(got["again"][0])[i][rows],
                  None if b is None else _split(want["again"][0])[i][rows])
        _same(f"case {case}: recv_topk_weights", got["w"] if got["w"] is None else got["w"][rows],
              want["w"] if want["w"] is None else want["w"][rows])
        _same(f"case {case}: cached recv_topk_weights", got["again"][2][rows], want["again"][2][rows])
        if do_expand:  # without zeroed padding: the rows that hold a pair
            held = hr.source_row >= 0
            for i, (a, b) in enumerate(zip(_split(got["loose"][0]), _split(want["loose"][0]))):
                _same(f"case {case}: cached recv_x[{i}], padding not zeroed", None if a is None else a[held],
                      None if b is None else b[held])
            _same(f"case {case}: cached weights, padding not zeroed", got["loose"][2][held], want["loose"][2][held])
        if not do_expand:
            _same(f"case {case}: recv_topk_idx", got["idx"], want["idx"])
        assert_within_bf16_rounding(got["combined"], want["combined"], f"case {case}: combine")
        _same(f"case {case}: combined weights", got["combined_w"], want["combined_w"])
        reports.append(f"case {case} {CASES[case]}: {valid} rows received, "
                       f"{h.num_expanded_tokens} expanded rows: matches")
    cuda.buffer.runtime.check_failures()
    for buffer in (cuda, ref):
        buffer.destroy()
    return reports


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_elastic_buffer_on_cuda_matches_the_reference(num_ranks, seed):
    for line in spawn.run(num_ranks, _elastic_matches, seed)[0]:
        print(line)


def _source_ranks_match(seed):
    import torch.distributed as dist

    from tokenyard import ElasticBuffer
    from tokenyard.semantics import expand
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    cuda = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                         backend="cuda", check_inputs=False)
    backend = cuda.buffer.runtime
    backend.poison_outputs = True
    reports = []
    for case, (num_tokens, num_experts, kind, dtype) in enumerate(
            ((1, 8 * num_ranks, "uniform", torch.int64), (37, 8 * num_ranks, "masked", torch.int64),
             (1000, 4 * num_ranks, "skewed", torch.int32), (4096, 256, "uniform", torch.int64))):
        topk_idx = make_rank_inputs(seed + case, num_ranks, num_tokens, 128, num_experts, NUM_TOPK, kind, "bf16",
                                    device)[rank][1].to(dtype)
        got = backend.source_ranks(topk_idx, num_experts)
        want = expand.source_ranks(topk_idx.cpu(), num_experts)
        assert torch.equal(got.cpu(), want), f"case {case}: source ranks differ"
        reports.append(f"case {case}: {num_tokens} tokens, {num_experts} experts, {kind}: matches")
    cuda.destroy()
    return reports


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_source_ranks_on_cuda_match_the_semantics(num_ranks, seed):
    """semantics.expand.source_ranks (each slot's rank among the tokens naming its expert) by its kernel."""
    for line in spawn.run(num_ranks, _source_ranks_match, seed)[0]:
        print(line)
