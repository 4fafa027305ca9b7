"""The CUDA backend at one rank, on a machine with a single GPU (the tests of 2+ ranks skip there; on more
GPUs these run only where TOKENYARD_TEST_NUM_RANKS names 1).

One rank sends everything to itself, so the cross-GPU paths stay untested here; what is tested is that
every kernel compiles and loads on this GPU through the JIT, and that the own-rank paths, the counts, the
handles and the graph capture give the reference backend's results: the same comparisons as the multi-GPU
tests, at one rank.
"""

from __future__ import annotations

import pytest

from . import spawn, test_low_latency_cuda, test_normal_cuda

pytestmark = pytest.mark.skipif(not spawn.one_rank_wanted(),
                                reason="needs one GPU, or TOKENYARD_TEST_NUM_RANKS=1 on more (the device machine)")

# The multi-GPU cases but "empty_rank" (no token for the last rank's experts: at one rank, for any expert).
NORMAL_CASES = [case for case in test_normal_cuda.CASES if case[4] != "empty_rank"]
LOW_LATENCY_CASES = [case for case in test_low_latency_cuda.CASES if case[5] != "empty_rank"]


def test_normal_mode_at_one_rank_matches_reference(seed):
    for line in spawn.run(1, test_normal_cuda._compare_ranks, seed, NORMAL_CASES)[0]:
        print(line)


def test_low_latency_kernels_at_one_rank_match_reference(seed):
    for line in spawn.run(1, test_low_latency_cuda._compare, seed, LOW_LATENCY_CASES)[0]:
        print(line)


def test_low_latency_graph_replay_at_one_rank(seed):
    print(spawn.run(1, test_low_latency_cuda._graph_replay, seed)[0])


def test_plain_tuple_handles_and_wait_costs_at_one_rank(seed):
    print(spawn.run(1, test_low_latency_cuda._plain_handles_and_wait_costs, seed)[0])
