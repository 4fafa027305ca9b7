"""The transport seam's operation counters without a GPU (NOTE [operation counters] in
include/tokenyard/operation_counts.cuh): the setting, off by default; every kernel's unit written as before unless
counting, which only adds the define; the Transport loads the counting variant only under the setting and refuses to
read counts without it; the counters' table read as a rank's counts and by destination kind; and the exact counts of
NOTE [exact operation counts] (backends/cuda/operation_counts.py) on a hand-computed routing, and averaged over every
routing against the expectations of NOTE [operation counts] (tools/bench/model/operations.py). The GPU test is
tests/gpu/test_operation_counts_cuda.py; the counting units compile in test_nvshmem_build.py and ci_compile."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from tokenyard import env
from tokenyard.backends.cuda import kernels
from tokenyard.backends.cuda import operation_counts as counted
from tokenyard.backends.cuda import transport
from tokenyard.errors import BackendUnavailableError
from tokenyard.tools.bench import copy_limit
from tokenyard.tools.bench.model import operations


def test_count_operations_is_off_by_default_and_read_as_a_boolean(tokenyard_env):
    tokenyard_env("TOKENYARD_COUNT_OPERATIONS", None)
    assert env.settings().count_operations is False
    for text, value in (("1", True), ("on", True), ("0", False), ("off", False)):
        tokenyard_env("TOKENYARD_COUNT_OPERATIONS", text)
        assert env.settings().count_operations is value
    tokenyard_env("TOKENYARD_COUNT_OPERATIONS", "sometimes")
    with pytest.raises(ValueError, match="TOKENYARD_COUNT_OPERATIONS"):
        env.settings()


def test_every_kernel_is_written_as_before_and_its_counting_variant_only_adds_the_define():
    define = f"#define {transport.COUNTING_DEFINE} 1\n"
    for spec in dict.fromkeys([*kernels.every_kernel(), *copy_limit.every_kernel()]):
        source = spec.source()
        assert spec.defines == () and source.startswith(f"#include <{spec.header}>\n"), spec.name
        assert transport.COUNTING_DEFINE not in source, spec.name
        variant = transport.counting(spec)
        assert variant.source() == define + source and variant.entry == spec.entry, spec.name
        assert variant != spec and hash(variant) != hash(spec) and transport.counting(spec) is variant


def _bare_transport(count_operations: bool, num_ranks: int = 4):
    """A Transport as `start` leaves it, without NVSHMEM: what `load` and `operation_counts` read."""
    made = transport.Transport.__new__(transport.Transport)
    made.rank, made.num_ranks, made.users = 0, num_ranks, 1
    made._registered, made._counting, made.count_operations = set(), {}, count_operations
    made.shim = types.SimpleNamespace(tokenyard_nvshmem_cumodule_init=lambda module: 0)
    return made


@pytest.mark.parametrize("count_operations", [False, True])
def test_a_transport_loads_the_counting_variant_only_under_the_setting(monkeypatch, count_operations):
    loaded = []

    def load(spec, device_index):
        loaded.append(spec)
        return types.SimpleNamespace(module=len(loaded), spec=spec)

    monkeypatch.setattr(transport.kernel_cache, "load", load)
    made = _bare_transport(count_operations)
    spec = kernels.internode_dispatch()
    made.load(spec, 0)
    assert loaded == [transport.counting(spec) if count_operations else spec]
    assert list(made._counting) == ([1] if count_operations else [])


def test_counts_are_refused_without_the_setting_or_a_transport():
    with pytest.raises(BackendUnavailableError, match="TOKENYARD_COUNT_OPERATIONS"):
        _bare_transport(False).operation_counts()
    from tokenyard.backends.base import Backend

    with pytest.raises(BackendUnavailableError, match="reference backend counts no"):
        Backend.operation_counts(types.SimpleNamespace(name="reference"))


def test_a_group_larger_than_the_counters_rows_is_refused():
    with pytest.raises(BackendUnavailableError, match="rows for 1024 ranks"):
        _bare_transport(True, num_ranks=1025).load(kernels.internode_dispatch(), 0)


def test_the_table_reads_as_a_ranks_counts_and_by_destination_kind():
    assert counted.OPERATIONS == ("puts", "put_bytes", "put_signals", "signals", "quiets", "fences")
    table = torch.zeros(1 + 4, len(counted.OPERATIONS), dtype=torch.int64, device="cpu")
    table[0, 4], table[0, 5] = 512, 3                          # quiets, fences
    table[1 + 1, 0], table[1 + 1, 1] = 2, 200                  # to rank 1: 2 puts of 200 bytes
    table[1 + 2, 3], table[1 + 3, 3], table[1 + 3, 2] = 5, 7, 1  # signals to ranks 2 and 3, a put with signal
    counts = counted.from_table(table)
    assert counts == {"puts": [0, 2, 0, 0], "put_bytes": [0, 200, 0, 0], "put_signals": [0, 0, 0, 1],
                      "signals": [0, 0, 5, 7], "quiets": 512, "fences": 3}
    kinds = counted.by_kind(counts, rank=1, ranks_per_node=2)  # rank 1 of node 0; ranks 2 and 3 remote
    assert (kinds["puts_self"], kinds["put_bytes_self"], kinds["signals_remote"], kinds["put_signals_remote"]) == \
        (2, 200, 12, 1)
    assert kinds["puts_node"] == kinds["signals_node"] == kinds["signals_self"] == 0
    assert (kinds["quiets"], kinds["fences"]) == (512, 3)
    assert set(kinds) <= set(operations.zero())  # NOTE [operation counts]' keys


# 2 nodes x 1 rank, 4 experts (2 a rank), top-2. Rank 0: token 0 -> experts 0, 2 (ranks 0, 1); token 1 -> 1, 0
# (rank 0 twice); token 2 -> 3, -1 (rank 1). Rank 1: token 0 -> 2, 3 (rank 1).
HAND_TOPK = [torch.tensor([[0, 2], [1, 0], [3, -1]]), torch.tensor([[2, 3]])]
HAND_IN_RANK = [torch.tensor([[True, True], [True, False], [False, True]]), torch.tensor([[False, True]])]


def test_low_latency_counts_by_hand():
    dispatch = counted.low_latency("dispatch", HAND_TOPK, 0, 4, 1, hidden=256, num_blocks=2, cast=1)
    assert dispatch["puts"] == [0, 2] and dispatch["signals"] == [0, 3]  # tokens 0, 2; 2 expert counts + 1
    assert dispatch["put_bytes"] == [0, 2 * (80 + 256 + 8)] and dispatch["quiets"] == 2  # a quiet per block
    assert counted.low_latency("dispatch", HAND_TOPK, 0, 4, 1, 256, 2, cast=0)["put_bytes"] == [0, 2 * (80 + 512)]
    assert counted.low_latency("dispatch", HAND_TOPK, 0, 4, 1, 256, 2, cast=2)["put_bytes"] == [0, 2 * (80 + 144)]
    # Rank 1 sent rank 0 nothing; rank 0's weights (3 tokens x 2) go by one put with its signal, then its flag.
    back_to_1 = counted.low_latency("combine", HAND_TOPK, 0, 4, 1, 256, 2)
    assert back_to_1["puts"] == [0, 0] and back_to_1["put_signals"] == [0, 1] and back_to_1["signals"] == [0, 1]
    assert back_to_1["put_bytes"] == [0, 3 * 2 * 8]
    back_to_0 = counted.low_latency("combine", HAND_TOPK, 1, 4, 1, 256, 2)
    assert back_to_0["puts"] == [2, 0] and back_to_0["put_bytes"] == [1024 + 2 * 8, 0]
    assert back_to_0["put_signals"] == [1, 0] and back_to_0["signals"] == [1, 0]
    assert counted.low_latency("dispatch", HAND_TOPK, 0, 4, 2, 256, 2)["puts"] == [0, 0]  # one node: stores


def test_normal_counts_by_hand():
    dispatch = counted.normal("dispatch", HAND_IN_RANK, 0, 1, num_blocks=2, row_bytes=100)
    # Signals: the barrier (block 0's, one to each rank), then from both blocks stage 1 (rank 0 forwards for local
    # rank 0 on every node) and stage 2 (its node is itself).
    assert dispatch["signals"] == [1 + 2 * 2, 1 + 2 * 1]
    # Stage 1: 2 rows to each node, a chunk each, rows of align16(112 + 4) = 128; stage 2: ranks 0's 2 and
    # rank 1's 0 rows for rank 0, of 112 bytes.
    assert dispatch["puts"] == [1 + 2, 1] and dispatch["put_bytes"] == [2 * 128 + 2 * 112, 2 * 128]
    assert dispatch["quiets"] == 2 * 2 and dispatch["fences"] == 0  # a quiet per block, twice
    combine = counted.normal("combine", HAND_IN_RANK, 0, 1, num_blocks=2, hidden=64, num_topk=2)
    assert combine["puts"] == [1, 0] and combine["put_bytes"] == [2 * (128 + 16), 0]  # 2 rows, one chunk
    # Rank 1 forwarded rank 0's tokens 0 and 2 and its own token 0: their partials go back, 128 bytes each, a chunk
    # to each source.
    again = counted.normal("combine", HAND_IN_RANK, 1, 1, 2, hidden=64)
    assert again["puts"] == [1, 1] and again["put_bytes"] == [2 * 128, 128]


def _every_routing(num_experts: int, topk: int) -> torch.Tensor:
    return torch.tensor(list(itertools.combinations(range(num_experts), topk)), dtype=torch.int64, device="cpu")


@pytest.mark.parametrize("call", operations.CALLS)
def test_exact_counts_over_every_routing_are_the_documented_expectations(call):
    """Each rank's tokens are every set of k distinct experts once, so the exact counts are the expectations under
    uniform routing (for the low-latency calls only their remote part: this node's ranks take stores, which the
    expectations count as puts and the seam does not see)."""
    nodes, gpus, num_experts, topk, hidden, blocks = 2, 2, 8, 2, 256, 6
    ranks = nodes * gpus
    routing = _every_routing(num_experts, topk)
    tokens = routing.size(0)  # 28
    every_topk = [routing] * ranks
    in_rank = torch.zeros(tokens, ranks, dtype=torch.bool, device="cpu")
    in_rank.scatter_(1, routing // (num_experts // ranks), True)
    shape = dict(tokens=tokens, topk=topk, num_experts=num_experts, nodes=nodes, gpus_per_node=gpus, hidden=hidden)
    for rank in range(ranks):
        low = counted.by_kind(counted.low_latency(call, every_topk, rank, num_experts, gpus, hidden, blocks, cast=1),
                              rank, gpus)
        expected = operations.tokenyard_low_latency(call, blocks=blocks, **shape)
        for key in ("puts_remote", "put_bytes_remote", "signals_remote", "quiets"):
            assert low[key] == pytest.approx(expected[key]), (call, rank, key)
        normal = counted.by_kind(counted.normal(call, [in_rank] * ranks, rank, gpus, blocks, row_bytes=300,
                                                hidden=hidden, num_topk=topk), rank, gpus)
        expected = operations.tokenyard_normal(call, blocks=blocks, row_bytes=300, **shape)
        for key in [f"{op}_{kind}" for op in counted.PER_PEER for kind in counted.KINDS] + ["quiets", "fences"]:
            assert normal[key] == pytest.approx(expected[key]), (call, rank, key)
