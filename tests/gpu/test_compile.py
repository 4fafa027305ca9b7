"""`torch.compile` traces layout, dispatch, expert work, combine and cached dispatch as one graph with
tokenyard's custom ops in it (NOTE [custom ops] in tokenyard/ops.py), and a low-latency step likewise; the
compiled steps return what the same calls return in eager mode, on fresh inputs every run. The same function runs on the reference backend
over CPU ranks (tests/cpu/test_compile.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from . import spawn

NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 64, 256, 16, 4


def _traced_ops(graphs):
    return sorted({str(node.target) for gm in graphs for node in gm.graph.nodes if "tokenyard" in str(node.target)})


def compiled_calls(seed: int, backend: str = "cuda"):
    import torch.distributed as dist

    from tokenyard import Buffer, Config, ops
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl_bytes, backend=backend, timeout_s=60)
    num_worst = NUM_TOKENS * num_ranks
    torch._dynamo.reset()

    def step(x, topk_idx, topk_weights, num_worst_tokens):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        recv_x, recv_idx, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens)
        data = recv_x if isinstance(recv_x, torch.Tensor) else recv_x[0].to(torch.bfloat16) * recv_x[1].repeat_interleave(
            128, dim=1)[:, :recv_x[0].size(1)]
        expert_out = (data.float() * (1 + recv_idx.clamp(min=0).sum(1, keepdim=True))).to(torch.bfloat16)
        combined_x, combined_weights, _ = buffer.combine(expert_out, handle, topk_weights=recv_weights)
        again = buffer.dispatch(x, handle=handle)[0]
        return recv_x, recv_idx, recv_weights, per_expert_list, combined_x, combined_weights, again, handle[3]

    for case, (dtype, num_worst_tokens) in enumerate([("bf16", num_worst), ("fp8", num_worst), ("bf16", 0)]):
        x, topk_idx, topk_weights = make_rank_inputs(seed + case, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS,
                                                     NUM_TOPK, "uniform", dtype, device)[rank]
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(step, backend=keep, fullgraph=True, dynamic=False)
        # Without num_worst_tokens the rows are data-dependent: dynamo traces them when told to.
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=not num_worst_tokens,
                                        capture_scalar_outputs=not num_worst_tokens):
            got = compiled(x, topk_idx, topk_weights, num_worst_tokens)
        want = step(x, topk_idx, topk_weights, num_worst_tokens)
        traced = _traced_ops(graphs)
        for op in ("get_dispatch_layout", "dispatch", "combine", "cached_dispatch"):
            assert f"tokenyard.{op}" in traced, f"{dtype}, worst {num_worst_tokens}: {op} not in {traced}"
        assert torch.equal(got[-1], want[-1]), f"{dtype}, worst {num_worst_tokens}: recv_src_idx differs"
        assert id(got[-1]) in ops._handle_attributes, "the traced handle lost its Buffer's record of it"
        filled = want[-1] >= 0  # rows past the received ones (num_worst_tokens) hold nothing defined
        for what, g, w in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert", "combined_x",
                               "combined_topk_weights", "cached recv_x"), got, want):
            if what in ("combined_x", "combined_topk_weights"):
                assert_within_bf16_rounding(g, w, what)
                continue
            for gt, wt in zip(g if isinstance(g, tuple) else (g,), w if isinstance(w, tuple) else (w,)):
                if isinstance(wt, torch.Tensor) and what in ("recv_x", "cached recv_x"):
                    assert gt.shape == wt.shape, f"{dtype}, worst {num_worst_tokens}: {what} shape"
                    gt, wt = gt[filled[:wt.size(0)]], wt[filled[:wt.size(0)]]
                if isinstance(wt, torch.Tensor):
                    assert gt.shape == wt.shape and torch.equal(gt.view(torch.uint8), wt.view(torch.uint8)), \
                        f"{dtype}, worst {num_worst_tokens}: {what} differs"
                else:
                    assert gt == wt, f"{dtype}, worst {num_worst_tokens}: {what} {gt} != {wt}"
        assert int(torch.count_nonzero(got[4].float())) > 0, "combined_x is all zeros"
    buffer.destroy()
    return f"rank {rank}: three compiled steps matched eager mode"


def compiled_low_latency(seed: int, backend: str = "cuda"):
    """A compiled low-latency step (dispatch, expert work, combine; FP8 and bf16) against eager mode, and a compiled
    NVFP4 dispatch."""
    import torch.distributed as dist

    from tokenyard import Buffer, ops
    from tokenyard.semantics import quant
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)
    buffer = Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True, backend=backend, timeout_s=60)
    torch._dynamo.reset()

    def step(x, topk_idx, topk_weights, use_fp8):
        recv_x, count, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, NUM_TOKENS, NUM_EXPERTS,
                                                                     use_fp8=use_fp8)
        assert hook is None  # no return_recv_hook: no hook, as DeepEP
        data = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2)) if use_fp8 else recv_x.float()
        expert_out = (data * 0.5 - 1.0).to(torch.bfloat16)
        combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)[0]
        return recv_x, count, combined, handle[0]

    for case, use_fp8 in enumerate((True, False)):
        x, topk_idx, topk_weights = make_rank_inputs(seed + 10 + case, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS,
                                                     NUM_TOPK, "uniform", "bf16", device)[rank]
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        got = torch.compile(step, backend=keep, fullgraph=True, dynamic=False)(x, topk_idx, topk_weights, use_fp8)
        want = step(x, topk_idx, topk_weights, use_fp8)
        traced = _traced_ops(graphs)
        for op in ("low_latency_dispatch", "low_latency_combine"):
            assert f"tokenyard.{op}" in traced, f"fp8 {use_fp8}: {op} not in {traced}"
        assert torch.equal(got[1], want[1]), f"fp8 {use_fp8}: packed_recv_count differs"
        assert id(got[3]) in ops._handle_attributes, "the traced handle lost its Buffer's record of it"
        for l, n in enumerate(want[1].tolist()):  # slots past an expert's count hold nothing defined
            assert torch.equal(got[3][l, :n], want[3][l, :n]), f"fp8 {use_fp8}: src_info of expert {l}"
            for g, w in zip(got[0] if use_fp8 else (got[0],), want[0] if use_fp8 else (want[0],)):
                assert g.shape == w.shape and g.stride() == w.stride(), f"fp8 {use_fp8}: layout of packed_recv_x"
                assert torch.equal(spawn.bits(g[l, :n]), spawn.bits(w[l, :n])), f"fp8 {use_fp8}: rows of expert {l}"
        assert_within_bf16_rounding(got[2], want[2], f"fp8 {use_fp8}: combined_x")
        assert int(torch.count_nonzero(got[2].float())) > 0, "combined_x is all zeros"

    def nvfp4_step(x, topk_idx, global_scale):  # NOTE [nvfp4]: DeepEP's views, their strides kept by the op
        (data, scales), count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, NUM_TOKENS, NUM_EXPERTS, use_nvfp4=True, x_global_scale=global_scale)
        assert hook is None
        return data, scales, count, handle[0]

    x, topk_idx, _ = make_rank_inputs(seed + 20, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform",
                                      "bf16", device)[rank]
    global_scale = (448.0 * 6.0 / x.float().abs().max()).reshape(1)
    graphs = []
    got = torch.compile(nvfp4_step, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True,
                        dynamic=False)(x, topk_idx, global_scale)
    want = nvfp4_step(x, topk_idx, global_scale)
    assert "tokenyard.low_latency_dispatch" in _traced_ops(graphs), "nvfp4: the dispatch was not traced"
    assert torch.equal(got[2], want[2]), "nvfp4: packed_recv_count differs"
    for g, w in zip(got[:2], want[:2]):
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype, "nvfp4: layout of an output"
    scales = [quant.unswizzle_nvfp4_scales(t[1], num_ranks * NUM_TOKENS, HIDDEN // 16) for t in (got, want)]
    for l, n in enumerate(want[2].tolist()):
        assert torch.equal(got[3][l, :n], want[3][l, :n]), f"nvfp4: src_info of expert {l}"
        assert torch.equal(got[0][:n, :, l], want[0][:n, :, l]), f"nvfp4: data of expert {l}"
        assert torch.equal(spawn.bits(scales[0][l, :n]), spawn.bits(scales[1][l, :n])), f"nvfp4: scales of {l}"
    buffer.destroy()
    return f"rank {rank}: three compiled low-latency steps (FP8, bf16, NVFP4) matched eager mode"


# PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1) works through a dispatch mode, and under it torch.compile handed
# these tests' backend no graph at all (benchmarks/results/stream_stress.md): they check what is traced, so they are
# skipped there; the calls they make eagerly are the other GPU tests'.
pytestmark = [spawn.needs_ranks(),
              pytest.mark.skipif(bool(os.environ.get("TORCH_CUDA_SANITIZER")),
                                 reason="torch.compile traced nothing under the CUDA sanitizer")]


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_compiled_step_matches_eager(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, "torch.compile of internode calls raises InvalidInputError "
                                           "(docs/semantics.md)")
    print(spawn.run(num_ranks, compiled_calls, seed)[0])


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_compiled_low_latency_step_matches_eager(num_ranks, seed):
    print(spawn.run(num_ranks, compiled_low_latency, seed)[0])
