"""Start the ranks of a GPU test, run a function on each, collect failures.

Ranks spread evenly over the GPUs here (tokenyard.tools.launch.init_rank): one per GPU in an NCCL group where there
are enough GPUs, else several per GPU in a gloo group, under MPS (NOTE [shared GPUs] in tokenyard/plan/devices.py;
`benchmarks/run_device.sh` starts the daemon). TOKENYARD_TEST_NUM_RANKS chooses the rank counts.

The tests of a rank count share one pool of ranks (NOTE [rank pool] in tokenyard/tools/launch.py), as the CPU tests
do. A test runs on ranks of its own (`fresh=True`) where it starts NVSHMEM (virtual nodes: a ranks_per_node
argument or an internode Buffer, or TOKENYARD_RANKS_PER_NODE in the environment) or makes and destroys groups of
its own; TOKENYARD_TEST_FRESH_RANKS=1 gives every test ranks of its own (to tell whether a failure depends on the
tests before it).
"""

from __future__ import annotations

import atexit
import os

import pytest
import torch

from tokenyard.plan import devices
from tokenyard.tools.launch import RankPool, disable_nvlink_multicast, run_on_ranks

disable_nvlink_multicast()

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_counts(largest_only: bool = False) -> list:
    """The rank counts a test runs at: those of 2, 4 and 8 that the machine has GPUs for, or the largest of
    them only (the slower tests). TOKENYARD_TEST_NUM_RANKS (comma-separated) names them instead, on as many
    GPUs as share them evenly: "8" runs the whole suite at 8 ranks, on an 8-GPU machine one rank per GPU,
    on a 1-GPU machine 8 ranks on one GPU (under MPS).
    """
    wanted = _chosen_counts()
    if wanted is None:
        counts = [n for n in (2, 4, 8) if n <= NUM_GPUS]
    else:
        counts = sorted(n for n in wanted if n >= 2) if NUM_GPUS else []
    return counts[-1:] if largest_only else counts


def virtual_node_layouts() -> list:
    """(num_ranks, ranks_per_node) of the internode tests: every split of the rank counts into 2 or more virtual
    nodes of 2 or 4 ranks, then, at 2 ranks, 2 nodes of one, so that a machine of 2 GPUs runs the internode paths
    with a GPU per rank, as real nodes have them (last: a test that takes the first layout keeps nodes of 2 where
    there are 4 GPUs)."""
    counts = rank_counts()
    return [(n, p) for n in counts for p in (2, 4) if n % p == 0 and n // p >= 2] + [(2, 1)] * (2 in counts)


def needs_ranks(counts=None):
    """The skip marker of a multi-rank GPU test file: skipped where `counts` (default: `rank_counts()`) is
    empty."""
    return pytest.mark.skipif(not (rank_counts() if counts is None else counts),
                              reason="needs 2 or more GPUs, or TOKENYARD_TEST_NUM_RANKS on a GPU with MPS (run on the "
                                     "device machine)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor as what `torch.equal` compares bit for bit: 1-byte types (FP8, which has no equality) as bytes."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def assert_same(what: str, a, b) -> None:
    """`a` and `b` both None, or of one shape and equal bit for bit (`bits`)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: None on one side only"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what} differs"


def describe(num_ranks: int) -> str:
    """The GPUs `num_ranks` ranks run on, for reports: "NVIDIA H200 x 4", or "NVIDIA H100 80GB HBM3 x 1 shared
    by 8 ranks (MPS)"."""
    used, per_gpu = devices.launch_layout(num_ranks, NUM_GPUS)
    name = torch.cuda.get_device_name(0)
    return f"{name} x {used}" + (f" shared by {num_ranks} ranks (MPS)" if per_gpu > 1 else "")


def shares_gpu(num_ranks: int) -> bool:
    """Whether `num_ranks` ranks share GPUs here (under MPS)."""
    return devices.launch_layout(num_ranks, NUM_GPUS)[1] > 1


def on_virtual_nodes(num_ranks: int) -> bool:
    """Whether TOKENYARD_RANKS_PER_NODE makes `num_ranks` ranks several (virtual) nodes."""
    per_node = int(os.environ.get("TOKENYARD_RANKS_PER_NODE", "0"))
    return 0 < per_node < num_ranks


ONE_NODE_BUFFER = ("its Buffers are one node's (num_rdma_bytes=0): on several nodes a normal-mode call raises "
                   "CapacityError (NOTE [internode region]), as DeepEP's; test_internode_cuda runs those paths")


def skip_on_virtual_nodes(num_ranks: int, why: str) -> None:
    """Skips the test where the ranks form several virtual nodes, saying `why` it is one node's."""
    if on_virtual_nodes(num_ranks):
        pytest.skip(f"one node's test on {num_ranks} ranks as virtual nodes: {why}")


def one_rank_wanted() -> bool:
    """Whether the one-rank tests (test_one_gpu.py) run: on a machine of one GPU, where the others skip, or
    where TOKENYARD_TEST_NUM_RANKS names 1."""
    wanted = _chosen_counts()
    if wanted is not None:
        return NUM_GPUS >= 1 and 1 in wanted
    return NUM_GPUS == 1


def _chosen_counts():
    """The rank counts TOKENYARD_TEST_NUM_RANKS names (a set), or None where it is unset."""
    chosen = os.environ.get("TOKENYARD_TEST_NUM_RANKS", "")
    if not chosen.strip():
        return None
    return {int(part) for part in chosen.split(",") if part.strip()}


_POOLS = {}  # num_ranks -> RankPool


def _pool(num_ranks: int) -> RankPool:
    pool = _POOLS.get(num_ranks)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[num_ranks] = RankPool(num_ranks, use_cuda=True)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


def run(num_ranks: int, fn, *args, timeout_s: float = 600.0, fresh: bool = False):
    """fn(*args) on `num_ranks` GPU ranks (several per GPU where there are fewer GPUs): the pool's, or ranks of its
    own where `fresh` or the module docstring says so; raise AssertionError with every failing rank's traceback."""
    if fresh or os.environ.get("TOKENYARD_RANKS_PER_NODE") or os.environ.get("TOKENYARD_TEST_FRESH_RANKS") == "1":
        try:
            return run_on_ranks(num_ranks, fn, *args, use_cuda=True, timeout_s=timeout_s)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
    return _pool(num_ranks).run(fn, *args, timeout_s=timeout_s)
