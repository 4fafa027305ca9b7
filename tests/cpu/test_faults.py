"""Faults on the reference backend, with real peers (tests/cpu/fault_scenarios.py; each scenario in processes
of its own): every other rank raises a TokenyardError within timeout_s + 2 s, no surviving process dies of a
signal, and the survivors complete a correct call afterwards (NOTE [call agreement] in collectives.py)."""

from __future__ import annotations

import signal

import pytest

from tokenyard.launch import RanksFailed, run_on_ranks

from . import fault_scenarios as scenarios


@pytest.mark.parametrize("what", scenarios.MISMATCHES)
def test_ranks_that_make_different_calls_all_raise_before_any_data_moves(what, seed):
    seen = run_on_ranks(scenarios.NUM_RANKS, scenarios.mismatch, seed, what, use_cuda=False, timeout_s=120)
    print(scenarios.expect_mismatch(seen, what))


@pytest.mark.parametrize("what", ("sleeps_past_the_deadline", "late_to_low_latency_combine"))
def test_a_rank_that_sleeps_past_the_deadline_makes_the_others_raise_then_a_new_group_works(what, seed):
    seen = run_on_ranks(scenarios.NUM_RANKS, scenarios.late_peer, seed, what, use_cuda=False,
                        timeout_s=120, group_timeout_s=10)
    scenarios.expect_late(dict(enumerate(seen)), what)
    print(seen[0]["error"], "|", seen[1]["error"])


def test_a_rank_killed_before_its_call_makes_the_others_raise_then_they_work_on_without_it(seed):
    with pytest.raises(RanksFailed) as failed:
        run_on_ranks(scenarios.NUM_RANKS, scenarios.late_peer, seed, "killed", use_cuda=False, timeout_s=120,
                     group_timeout_s=10)
    assert set(failed.value.failures) == {1}, str(failed.value)  # noticed by its end, not a deadline
    assert failed.value.failures[1].startswith(f"its process ended with exit code -{int(signal.SIGKILL)}")
    scenarios.expect_late(failed.value.results, "killed")
    print(failed.value.results[0]["error"])
