"""The CUDA backend on any process group (NOTE [device rule] in tokenyard/plan/devices.py), device machine only.

vLLM builds DeepEP's Buffer on a gloo group while every tensor lives on the GPU. Here a Buffer on a gloo
group must take the CUDA backend, work on the GPU, and give what the same calls give through an
NCCL-capable path: the CUDA backend over NCCL where every rank has a GPU (bit for bit, the same kernels),
the reference backend over the same gloo group where ranks share a GPU and NCCL cannot run (dispatch bit
for bit, combine within bf16 rounding for low latency). Outputs are poisoned before the kernels write them;
CPU tensors given to the GPU Buffer take the CPU path and agree with the GPU's results.
"""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 96, 2048, 32, 4



def _same(what, a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b):
        assert x.shape == y.shape, f"{what}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        assert torch.equal(spawn.bits(x), spawn.bits(y).to(x.device)), f"{what} differs"


def _calls(buffer, inputs, use_fp8):
    """The calls vLLM makes: layout, dispatch, cached dispatch, combine; low-latency dispatch and combine."""
    x, topk_idx, weights = inputs
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert)
    cached = buffer.dispatch(x, handle=handle)[0]
    expert_out = (recv_x.float() * 0.5 + 1.0).to(torch.bfloat16)
    combined = buffer.combine(expert_out, handle, topk_weights=recv_w)[0]
    packed, packed_count, ll_handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, NUM_TOKENS, NUM_EXPERTS,
                                                                           use_fp8=use_fp8, return_recv_hook=True)
    hook()
    y = (packed[0] if use_fp8 else packed).float().to(torch.bfloat16)
    ll_combined = buffer.low_latency_combine(y, topk_idx, weights, ll_handle)[0]
    return {"layout": (per_rank, per_expert, in_rank), "dispatch": (recv_x, recv_idx, recv_w, handle.recv_src_idx,
            handle.send_head), "counts": counts, "cached": cached, "combine": combined, "ll_count": packed_count,
            "ll_handle": ll_handle, "ll_data": packed, "ll_combine": ll_combined}


def _vllm_pattern(seed):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    gloo = dist.new_group(backend="gloo")  # vLLM's cpu_group
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)
    buffer = Buffer(gloo, nvl_bytes, rdma_bytes, timeout_s=30)
    assert buffer.backend == "cuda", f"a gloo group with GPUs took the {buffer.backend} backend"
    assert buffer.device == device, f"the Buffer works on {buffer.device}, the rank on {device}"
    assert buffer.get_local_buffer_tensor(torch.uint8).device == device
    assert buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).device == device
    buffer.runtime.poison_outputs = True
    shared = buffer.topology.shares_gpu
    world_is_nccl = "nccl" in str(dist.get_backend()).lower()
    if world_is_nccl:  # the same kernels over NCCL: everything bit for bit
        other = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="cuda", timeout_s=30)
    else:  # ranks share GPUs (NCCL refuses them): the reference backend, staged through the host
        other = Buffer(gloo, nvl_bytes, rdma_bytes, backend="reference")
    reports = []
    for case, (kind, dtype, use_fp8) in enumerate((("uniform", "bf16", True), ("masked", "bf16", False))):
        inputs = make_rank_inputs(seed + case, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, kind, dtype,
                                  device)[rank]
        got, want = _calls(buffer, inputs, use_fp8), _calls(other, inputs, use_fp8)
        torch.cuda.synchronize()
        what = f"case {case} {kind}/fp8={use_fp8}"
        for name in ("layout", "dispatch", "cached", "combine", "ll_count"):
            for i, (a, b) in enumerate(zip(got[name] if isinstance(got[name], tuple) else (got[name],),
                                           want[name] if isinstance(want[name], tuple) else (want[name],))):
                _same(f"{what}: {name}[{i}]", a, b)
        assert got["counts"] == want["counts"], f"{what}: per-expert counts"
        _same(f"{what}: layout_range", got["ll_handle"].layout_range, want["ll_handle"].layout_range)
        slots = torch.arange(num_ranks * NUM_TOKENS, device=device).view(1, -1)
        valid = slots < (got["ll_handle"].layout_range & 0xFFFFFFFF).sum(1, keepdim=True)
        for i, (a, b) in enumerate(zip(got["ll_data"] if use_fp8 else (got["ll_data"],),
                                       want["ll_data"] if use_fp8 else (want["ll_data"],))):
            _same(f"{what}: low-latency data[{i}]", a[valid], b[valid])
        if world_is_nccl:
            _same(f"{what}: low-latency combine", got["ll_combine"], want["ll_combine"])
        else:
            assert_within_bf16_rounding(got["ll_combine"], want["ll_combine"], f"{what}: low-latency combine")

        # The same calls given CPU tensors take the CPU path (the reference backend over gloo).
        cpu = [t.cpu() for t in inputs]
        layout_cpu = buffer.get_dispatch_layout(cpu[1], NUM_EXPERTS)
        assert layout_cpu[0].device.type == "cpu"
        recv_cpu = buffer.dispatch(cpu[0], topk_idx=cpu[1], topk_weights=cpu[2], num_tokens_per_rank=layout_cpu[0],
                                   is_token_in_rank=layout_cpu[3], num_tokens_per_expert=layout_cpu[2])[0]
        _same(f"{what}: dispatch of CPU tensors", recv_cpu, got["dispatch"][0].cpu())
        reports.append(f"{what}: ok ({got['dispatch'][0].size(0)} rows)")

    # CUDA-graph replay on the gloo group, as vLLM captures decode.
    inputs = make_rank_inputs(seed + 7, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "bf16",
                              device)[rank]
    static = [t.clone() for t in inputs]

    def step():
        packed, _, handle, _, _ = buffer.low_latency_dispatch(static[0], static[1], NUM_TOKENS, NUM_EXPERTS)
        return buffer.low_latency_combine(packed[0].float().to(torch.bfloat16), static[1], static[2], handle)[0]

    eager = step().clone()
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for replay in range(2):
        graph.replay()
        torch.cuda.synchronize()
        _same(f"graph replay {replay}", captured, eager)
    buffer.runtime.check_failures()
    mode, sms = buffer._exchange.mode, buffer.runtime.device_sms
    for b in (buffer, other):
        b.destroy()
    dist.destroy_process_group(gloo)
    return reports + [f"gloo group: backend cuda, {'shared GPUs' if shared else 'a GPU per rank'} ({sms} SMs a "
                      f"rank), reference collectives {mode}; graph replays match"]


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_a_buffer_on_a_gloo_group_with_gpu_tensors_runs_the_cuda_backend_and_matches(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, "it compares the fields of one node's handles (recv_src_idx)")
    for line in spawn.run(num_ranks, _vllm_pattern, seed, fresh=True)[0]:
        print(line)


def _cuda_backend_where_mps_serves(seed):
    """Ranks that share a GPU: the CUDA backend under MPS; without it a refusal that names MPS and how to
    start it, and `backend="auto"` falls back to the reference backend, which still dispatches correctly."""
    import warnings

    import torch.distributed as dist

    from tokenyard import BackendUnavailableError, Buffer, Config
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    size = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    probe = Buffer(dist.group.WORLD, size, 0, backend="reference")
    served, shared = not probe.topology.without_mps(), probe.topology.shares_gpu
    probe.destroy()
    if served or not shared:
        buffer = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
        buffer.destroy()
        return "MPS serves the GPU (or a GPU each): the CUDA backend runs"
    try:
        Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
        raise AssertionError("the CUDA backend started on a GPU shared without MPS")
    except BackendUnavailableError as exc:
        message = str(exc)
    assert "MPS" in message and "nvidia-cuda-mps-control -d" in message, message
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        fallback = Buffer(dist.group.WORLD, size, 0, timeout_s=30)
    assert fallback.backend == "reference", fallback.backend
    inputs = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "bf16", device)
    x, topk_idx, weights = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = fallback.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x = fallback.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)[0]
    want = routing.dispatch([i[0].cpu() for i in inputs], [None] * num_ranks, [i[1].cpu() for i in inputs],
                            [i[2].cpu() for i in inputs], NUM_EXPERTS)[rank]
    assert torch.equal(recv_x.cpu(), want["recv_x"]), "the reference backend's dispatch differs from the oracle"
    fallback.destroy()
    return f"without MPS: {message.split(':')[0]}; auto took the reference backend, which dispatched correctly"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_ranks_that_share_a_gpu_get_the_cuda_backend_under_mps_and_a_clear_refusal_without(num_ranks, seed):
    print(spawn.run(num_ranks, _cuda_backend_where_mps_serves, seed, fresh=True)[0])
