"""The CUDA kernels' names under the PyTorch profiler (NOTE [kernel names] in tokenyard/jit/spec.py), device
machine only: DeepEP's benchmark helper times a call's kernels by name, and asserts that exactly one line of
the profile table contains "dispatch" (and one "combine"), then, where a call runs its kernel in several
launches (a receive hook), counts the trace's events whose name contains "::dispatch". The same two filters
are applied here to a low-latency round trip with and without a hook, a normal-mode cached dispatch and
combine, and an ElasticBuffer round trip; and, as DeepEP's internode test applies them (at most one line with
"notify" too), to internode normal mode's cached dispatch and combine on virtual nodes (issue 47)."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

from tokenyard.jit import nvshmem

from . import spawn

pytestmark = spawn.needs_ranks()

NUM_TOKENS, HIDDEN, NUM_TOPK = 64, 2048, 8


def _filters(fn, launches_per_call: int, words=("dispatch", "combine"), at_most_one=()) -> str:
    """Profile two periods of `fn` as DeepEP's helper does; -> a report, or AssertionError naming the filter and the
    lines it found. `words`: one line each, and as many trace events named "::word" as calls (times their launches);
    `at_most_one`: no more than one line each (DeepEP's own assertion, which a call without such a kernel passes)."""
    fn()
    torch.cuda.synchronize()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
        for _ in range(2):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            prof.step()
    lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    report = []
    for word in words:
        rows = [line for line in lines if word in line]
        assert len(rows) == 1, f"{len(rows)} profile rows contain {word!r}: {rows}"
        kernels = [e for e in events if f"::{word}" in e.get("name", "")]
        assert len(kernels) in (3 * launches_per_call, 6 * launches_per_call), \
            f"{len(kernels)} trace events contain '::{word}'"
        report.append(rows[0].split()[0])
    for word in at_most_one:
        rows = [line for line in lines if word in line]
        assert len(rows) <= 1, f"{len(rows)} profile rows contain {word!r}: {rows}"
        report.append(f"{word}: {rows[0].split()[0] if rows else 'none'}")
    return ", ".join(report)


def _names(seed):
    import torch.distributed as dist

    from tokenyard import Buffer, ElasticBuffer
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, num_experts, NUM_TOPK, "uniform",
                                            "bf16", device)[rank]
    reports = []
    size = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=30)
    for hook in (False, True):
        def low_latency():
            recv, _, handle, _, receive = buffer.low_latency_dispatch(x, topk_idx, NUM_TOKENS, num_experts,
                                                                      use_fp8=False, return_recv_hook=hook)
            if hook:
                receive()
            combined, _, receive = buffer.low_latency_combine(recv, topk_idx, weights, handle, return_recv_hook=hook)
            if hook:
                receive()
            return combined

        reports.append(f"low latency, hook={hook}: {_filters(low_latency, 2 if hook else 1)}")
    buffer.destroy()

    buffer = Buffer(dist.group.WORLD, 256 << 20, 0, backend="cuda", timeout_s=30)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert)
    reports.append("normal, cached: " + _filters(
        lambda: buffer.combine(buffer.dispatch(x, handle=handle)[0], handle, topk_weights=recv_w), 1))
    buffer.destroy()

    elastic = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                            backend="cuda", num_gpu_timeout_secs=30)
    for do_expand in (False, True):
        def round_trip():
            recv, _, recv_w, handle, _ = elastic.dispatch(x, topk_idx, weights, None, num_experts,
                                                          do_cpu_sync=False, do_expand=do_expand)
            return elastic.combine(recv, handle, recv_w)

        reports.append(f"ElasticBuffer, expand={do_expand}: {_filters(round_trip, 1)}")
    elastic.destroy()
    return reports


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_deepep_benchmark_filters_find_one_dispatch_and_one_combine_kernel(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, _names, seed)[0]:
        print(line)


def _internode_names(seed, ranks_per_node):
    """DeepEP's internode test times a cached dispatch with ("dispatch", "notify") and a combine with ("combine",
    "notify"), each call in one launch here (a region large enough for one round, NOTE [internode rounds])."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, num_experts, NUM_TOPK, "uniform",
                                            "bf16", device)[rank]
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl_bytes, 64 << 20, backend="cuda", ranks_per_node=ranks_per_node,
                    timeout_s=30)
    assert buffer.runtime.get_num_rdma_ranks() == num_ranks // ranks_per_node
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                      num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    reports = [f"internode {num_ranks // ranks_per_node} x {ranks_per_node}, cached dispatch: " + _filters(
                   lambda: buffer.dispatch(x, handle=handle), 1, ("dispatch",), ("notify",)),
               f"internode {num_ranks // ranks_per_node} x {ranks_per_node}, combine: " + _filters(
                   lambda: buffer.combine(recv_x, handle, topk_weights=recv_w), 1, ("combine",), ("notify",))]
    buffer.destroy()
    return reports


@pytest.mark.skipif(nvshmem.find() is None, reason="needs NVSHMEM (pip install tokenyard[internode])")
@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts())
def test_deepep_internode_filters_find_one_dispatch_and_one_combine_kernel(num_ranks, ranks_per_node, seed):
    for line in spawn.run(num_ranks, _internode_names, seed, ranks_per_node, fresh=True)[0]:
        print(line)
