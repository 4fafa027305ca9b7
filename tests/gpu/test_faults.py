"""Faults on the CUDA backend, with real peers (tests/cpu/fault_scenarios.py; the ranks on GPUs of their own or
sharing one under MPS), device machine only: ranks whose normal-mode calls disagree all raise RankMismatchError
before any row moves (NOTE [call signatures] in include/tokenyard/layout.cuh), as do ranks that make Buffers of
other settings (NOTE [call agreement]); low-latency calls that disagree (NOTE [call tags] in sync.cuh), a skipped
call, a late rank and a killed one make the others raise CommTimeoutError within timeout_s + 2 s, and a rank late
to a low-latency combine raises too rather than sum rows its peers never sent; no surviving process dies of a
signal, and the survivors complete a correct call on a new Buffer afterwards.

A late or killed rank's scenario runs in processes of its own; the calls that disagree run on the suite's pool of
ranks (NOTE [rank pool]), which they leave able to serve the next test (benchmarks/faults.py runs every scenario in
processes of its own)."""

from __future__ import annotations

import pytest

from ..cpu import fault_scenarios as scenarios
from . import spawn

# The ranks the scenarios' experts divide over, the most there are.
COUNTS = [n for n in spawn.rank_counts() if scenarios.NUM_EXPERTS % n == 0][-1:]

pytestmark = spawn.needs_ranks(COUNTS)


@pytest.mark.parametrize("what", scenarios.MISMATCHES)
def test_ranks_that_make_different_calls_all_raise_before_any_data_moves(what, seed):
    seen = dict(enumerate(spawn.run(COUNTS[0], scenarios.mismatch, seed, what, "cuda", timeout_s=120)))
    print(scenarios.expect_mismatch(seen, what, "cuda"))


def skip_reason(what: str, num_ranks: int):
    """Why the late-rank scenario `what` does not run at `num_ranks` ranks here, or None."""
    if what in scenarios.NOT_UNDER_MPS and spawn.shares_gpu(num_ranks):
        return "under MPS a client killed inside a kernel is a fatal fault for every client of the GPU"
    if what in scenarios.NOT_UNDER_MPS_ON_NODES and spawn.shares_gpu(num_ranks) and spawn.on_virtual_nodes(num_ranks):
        return "under MPS a client killed while NVSHMEM holds its memory leaves the GPU unusable"
    return None


@pytest.mark.parametrize("what", scenarios.CUDA_BUFFER_MISMATCHES)
def test_ranks_that_make_buffers_of_other_settings_all_raise(what, seed):
    seen = dict(enumerate(spawn.run(COUNTS[0], scenarios.buffer_mismatch, seed, what, "cuda", timeout_s=120)))
    print(scenarios.expect_buffer_mismatch(seen))


def test_a_rank_that_fails_making_its_buffer_makes_the_others_raise_at_the_making_deadline(seed):
    # Over NCCL (a GPU a rank) the making's exchanges ended only at the group's own timeout (NOTE [making waits]).
    seen = scenarios.run(COUNTS[0], scenarios.failed_buffer, seed, "fails_making_its_buffer", "cuda",
                         group_timeout_s=60)
    print(scenarios.expect_failed_buffer(seen))


def test_a_rank_late_to_a_reference_call_over_nccl_makes_the_others_raise_at_the_deadline(seed):
    # The reference backend over NCCL (the fallback, and normal mode across nodes without the internode kernels)
    # read its exchanges with no deadline but the group's own (NOTE [bounded reads] in collectives.py).
    if spawn.shares_gpu(COUNTS[0]) or spawn.on_virtual_nodes(COUNTS[0]):
        pytest.skip("over an NCCL group of one node: a GPU per rank")
    seen = scenarios.run(COUNTS[0], scenarios.late_over_nccl, seed, "late_to_a_reference_call", use_cuda=True,
                         group_timeout_s=60)
    print(scenarios.expect_late_over_nccl(seen))


@pytest.mark.parametrize("what", scenarios.LATE)
def test_a_late_or_killed_rank_makes_the_others_raise_then_the_survivors_work_on(what, seed):
    reason = skip_reason(what, COUNTS[0])
    if reason:
        pytest.skip(reason)
    seen = scenarios.run(COUNTS[0], scenarios.late_peer, seed, what, "cuda")
    scenarios.expect_late(seen, what, "cuda")
    print(seen[0]["error"])
