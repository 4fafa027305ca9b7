"""Faults on the reference backend, with real peers (tests/cpu/fault_scenarios.py; each scenario in processes
of its own): every other rank raises a TokenyardError within timeout_s + 2 s, no surviving process dies of a
signal, and the survivors complete a correct call afterwards (NOTE [call agreement] in collectives.py)."""

from __future__ import annotations

import signal

import pytest

from tokenyard.launch import RanksFailed, run_on_ranks

from . import fault_scenarios as scenarios

LIMIT_S = scenarios.TIMEOUT_S + 2


@pytest.mark.parametrize("what", scenarios.MISMATCHES)
def test_ranks_that_make_different_calls_all_raise_before_any_data_moves(what, seed):
    seen = run_on_ranks(scenarios.NUM_RANKS, scenarios.mismatch, seed, what, use_cuda=False, timeout_s=120)
    errors = [s["error"] for s in seen]
    assert all(e is not None and e.startswith("RankMismatchError") and "ranks [0]" in e for e in errors), errors
    assert len(set(errors)) == 1, f"the ranks raised different errors: {errors}"
    assert all(s["detected_s"] < LIMIT_S and s["recovered"] for s in seen), seen
    print(errors[0])


def test_a_rank_that_sleeps_past_the_deadline_makes_the_others_raise_then_a_new_group_works(seed):
    seen = run_on_ranks(scenarios.NUM_RANKS, scenarios.late_peer, seed, "sleeps_past_the_deadline", use_cuda=False,
                        timeout_s=120, group_timeout_s=10)
    for rank, s in enumerate(seen):
        assert s["error"] is not None and "timed out" in s["error"], (rank, s)
        if rank != 1:
            assert s["detected_s"] < LIMIT_S and f"rank {rank}" in s["error"] and "dispatch/" in s["error"], (rank, s)
    assert all(s["recovered"] for s in seen), seen
    print(seen[0]["error"])


def test_a_rank_killed_before_its_call_makes_the_others_raise_then_they_work_on_without_it(seed):
    with pytest.raises(RanksFailed) as failed:
        run_on_ranks(scenarios.NUM_RANKS, scenarios.late_peer, seed, "killed", use_cuda=False, timeout_s=120,
                     group_timeout_s=10)
    assert set(failed.value.failures) == {1}, str(failed.value)  # noticed by its end, not a deadline
    assert failed.value.failures[1].startswith(f"its process ended with exit code -{int(signal.SIGKILL)}")
    for rank, s in failed.value.results.items():
        assert s["error"] is not None and s["detected_s"] < LIMIT_S and s["recovered"], (rank, s)
    print(failed.value.results[0]["error"])
