"""Where a Buffer works (tokenyard/plan/devices.py) and how its tensors cross the group
(tokenyard/backends/collectives.py): the device rule, ranks sharing GPUs, virtual nodes, on CPU with made-up
placements and real gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenyard import InvalidInputError
from tokenyard.backends.collectives import choose_mode
from tokenyard.plan import devices
from tokenyard.plan.devices import RankPlace, make_topology

H100 = 132


def _gpu(host: str, gpu: str, sms: int = H100, mps: bool = True) -> RankPlace:
    return RankPlace(host, gpu, sms, mps)


def test_device_rule_takes_the_current_cuda_device_wherever_there_is_a_gpu_never_the_groups_backend():
    assert devices.buffer_device(True, 3) == torch.device("cuda", 3)
    assert devices.buffer_device(False, 0) == torch.device("cpu")
    # This machine: the rule gives what PyTorch sees, whatever group a Buffer gets.
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert devices.default_device() == want


class _FakeGpuBuffer:
    """Just what the device rule's routing reads: a GPU device and a CPU twin that records its calls."""

    device = torch.device("cuda", 0)

    def __init__(self):
        self.calls = []
        outer = self

        class Twin:
            device = torch.device("cpu")

            def dispatch(self, x, handle=None):
                outer.calls.append(("twin", x))
                return "cpu path"

        self.twin = Twin()

    def _cpu_twin(self):
        return self.twin

    @devices.runs_where_tensors_are("x")
    def dispatch(self, x, handle=None):
        self.calls.append(("own", x))
        return "own path"


def test_calls_with_cpu_tensors_on_a_gpu_buffer_run_on_its_cpu_twin_whatever_position_the_tensor_takes():
    buffer = _FakeGpuBuffer()
    cpu_x = torch.zeros(2, 4)
    assert buffer.dispatch(cpu_x) == "cpu path"
    assert buffer.dispatch(x=cpu_x) == "cpu path"
    assert buffer.dispatch((cpu_x, cpu_x[:, :1])) == "cpu path"  # an FP8-like (data, scales) tuple
    assert buffer.dispatch(None, handle=object()) == "own path"  # no tensor to say where: the Buffer's own
    assert [who for who, _ in buffer.calls] == ["twin", "twin", "twin", "own"]


def test_every_call_that_takes_tensors_keeps_the_device_rule():
    """NOTE [device rule]: the Buffer's inner calls that take tensors are the ones wrapped (5f185e9 once left the
    wrapper of `_dispatch` on a helper defined above it)."""
    from tokenyard.buffer_low_latency import LowLatencyCalls
    from tokenyard.buffer_normal import NormalCalls

    for owner, name in ((NormalCalls, "_get_dispatch_layout"), (NormalCalls, "_dispatch"), (NormalCalls, "_combine"),
                        (LowLatencyCalls, "_low_latency_dispatch"), (LowLatencyCalls, "_low_latency_combine")):
        assert hasattr(getattr(owner, name), "__wrapped__"), f"{owner.__name__}.{name} runs wherever it is called"
    for name in ("_expands_in_kernel",):
        assert not hasattr(getattr(NormalCalls, name), "__wrapped__"), f"NormalCalls.{name} is no call of tensors"


def test_ranks_that_share_a_gpu_divide_the_sms_each_sees_so_their_grids_fit_whatever_mps_shares_they_have():
    topology = make_topology(1, [_gpu("h", "GPU-a"), _gpu("h", "GPU-a")])  # no MPS share: each sees 132
    assert (topology.ranks_per_gpu, topology.shares_gpu, topology.sm_budget) == (2, True, 49)
    # A 50% share each: shares reserve nothing and may cover the same SMs, so each fills half of 3/4 of its 66.
    assert make_topology(0, [_gpu("h", "GPU-a", 66), _gpu("h", "GPU-a", 66)]).sm_budget == 24
    assert make_topology(0, [_gpu("h", "GPU-a"), _gpu("h", "GPU-b")]).sm_budget == H100  # a GPU each
    assert [devices.sm_budget(H100, n) for n in (1, 2, 4, 8)] == [132, 49, 24, 12]


def test_gpus_that_serve_different_numbers_of_ranks_and_groups_of_gpu_and_cpu_ranks_are_refused():
    with pytest.raises(InvalidInputError, match="same number of ranks"):
        make_topology(0, [_gpu("h", "GPU-a"), _gpu("h", "GPU-a"), _gpu("h", "GPU-b")])
    with pytest.raises(InvalidInputError, match="all work on GPUs"):
        make_topology(0, [_gpu("h", "GPU-a"), RankPlace("h")])
    # The same UUID on two hosts cannot be one GPU: a GPU each.
    assert make_topology(0, [_gpu("h1", "GPU-a"), _gpu("h2", "GPU-a")]).ranks_per_gpu == 1
    assert make_topology(0, [RankPlace("h")] * 3).ranks_per_gpu == 1


def test_ranks_that_share_a_gpu_without_mps_are_named():
    places = [_gpu("h", "GPU-a", mps=False), _gpu("h", "GPU-a", mps=False), _gpu("h", "GPU-b", mps=False),
              _gpu("h", "GPU-b", mps=False)]
    unserved = make_topology(0, places).without_mps()
    assert len(unserved) == 2 and "ranks [0, 1]" in unserved[0] and "ranks [2, 3]" in unserved[1], unserved
    assert make_topology(0, [_gpu("h", "GPU-a", mps=False), _gpu("h", "GPU-b", mps=False)]).without_mps() == []
    assert make_topology(0, [_gpu("h", "GPU-a"), _gpu("h", "GPU-a")]).without_mps() == []


def test_virtual_nodes_split_one_host_and_the_default_node_is_a_host():
    one_host = [_gpu("h", "GPU-a")] * 8
    assert make_topology(5, one_host).num_nodes == 1
    for ranks_per_node, nodes in ((2, 4), (4, 2)):
        topology = make_topology(5, one_host, ranks_per_node)
        assert (topology.num_nodes, topology.node, topology.local_rank) == (nodes, 5 // ranks_per_node,
                                                                            5 % ranks_per_node)
    two_hosts = [_gpu("h1", f"GPU-{i}") for i in range(4)] + [_gpu("h2", f"GPU-{i}") for i in range(4)]
    default = make_topology(6, two_hosts)
    assert (default.ranks_per_node, default.num_nodes, default.node, default.local_rank) == (4, 2, 1, 2)
    assert make_topology(6, two_hosts, 2).num_nodes == 4
    with pytest.raises(InvalidInputError, match="never spans two hosts"):
        make_topology(0, two_hosts, 8)
    for bad in (3, 0, -2, 2.0, True):
        with pytest.raises(InvalidInputError, match="ranks_per_node"):
            make_topology(0, one_host, bad)


def test_launchers_spread_ranks_evenly_over_the_gpus_there_are():
    assert devices.launch_layout(8, 1) == (1, 8)
    assert devices.launch_layout(8, 4) == (4, 2)
    assert devices.launch_layout(6, 4) == (3, 2)
    assert devices.launch_layout(2, 8) == (2, 1)
    assert [devices.launch_gpu(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(InvalidInputError):
        devices.launch_layout(2, 0)


def test_collective_modes_move_cuda_tensors_over_any_group():
    assert choose_mode("nccl", "cuda", False) == "direct"
    assert choose_mode("gloo", "cuda", False) == "nccl"
    assert choose_mode("gloo", "cuda", True) == "host"
    assert choose_mode("cpu:gloo,cuda:nccl", "cuda", False) == "direct"
    assert choose_mode("cpu:gloo,cuda:nccl", "cpu", False) == "direct"
    assert choose_mode("gloo", "cpu", False) == "direct"
    with pytest.raises(InvalidInputError, match="gloo"):
        choose_mode("nccl", "cpu", False)


def _runtime_queries(ranks_per_node):
    import torch.distributed as dist

    from tokenyard import Buffer

    buffer = Buffer(dist.group.WORLD, 1 << 20, 0, ranks_per_node=ranks_per_node)
    runtime = buffer.runtime
    found = (runtime.get_num_rdma_ranks(), runtime.get_rdma_rank(), runtime.get_root_rdma_rank(True),
             runtime.get_root_rdma_rank(False), buffer.device.type, buffer._exchange.mode)
    buffer.destroy()
    return found


def test_runtime_queries_see_virtual_nodes_on_gloo_ranks(ranks):
    pool = ranks(4)
    assert pool.run(_runtime_queries, None) == [(1, 0, r, 0, "cpu", "direct") for r in range(4)]
    assert pool.run(_runtime_queries, 2) == [(2, r // 2, r % 2, 0, "cpu", "direct") for r in range(4)]
    with pytest.raises(AssertionError, match="ranks_per_node"):
        pool.run(_runtime_queries, 3)


def test_virtual_hosts_are_hosts_of_their_own_but_a_shared_gpu_is_still_one_gpu():
    """NOTE [virtual hosts]: 4 ranks of one machine on one GPU, as 2 hosts of 2: nodes default to them, each rank's
    host is its block, and the GPU counts all 4 ranks (its UUID names it wherever it is)."""
    places = [dataclasses.replace(_gpu(f"m/virtual-host-{r // 2}", "GPU-a"), machine="m") for r in range(4)]
    topology = make_topology(3, places)
    assert (topology.num_hosts, topology.ranks_per_node, topology.num_nodes) == (2, 2, 2)
    assert topology.same_host() == [2, 3]
    assert topology.ranks_per_gpu == 4
    one_host = make_topology(1, [_gpu("m", "GPU-a", mps=True)] * 4)
    assert (one_host.num_hosts, one_host.same_host(), one_host.num_nodes) == (1, [0, 1, 2, 3], 1)
