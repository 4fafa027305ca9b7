"""Faults on the reference backend, with real peers (tests/cpu/fault_scenarios.py; each scenario in processes
of its own): every other rank raises a TokenyardError within timeout_s + 2 s, no surviving process dies of a
signal, and the survivors complete a correct call afterwards (NOTE [call agreement] in collectives.py)."""

from __future__ import annotations

import pytest

from . import fault_scenarios as scenarios


@pytest.mark.parametrize("what", scenarios.MISMATCHES)
def test_ranks_that_make_different_calls_all_raise_before_any_data_moves(what, seed):
    seen = scenarios.run(scenarios.NUM_RANKS, scenarios.mismatch, seed, what)
    print(scenarios.expect_mismatch(seen, what))


@pytest.mark.parametrize("what", scenarios.BUFFER_MISMATCHES)
def test_a_rank_that_makes_a_buffer_alone_makes_every_rank_raise_and_none_abort(what, seed):
    seen = scenarios.run(scenarios.NUM_RANKS, scenarios.buffer_mismatch, seed, what)
    print(scenarios.expect_buffer_mismatch(seen))


def test_a_buffer_with_a_deadline_of_microseconds_waits_for_a_rank_a_whole_destroy_meeting_late(seed):
    seen = scenarios.run(scenarios.NUM_RANKS, scenarios.skewed_buffer, seed, "buffer_late_rank")
    assert all(s["error"] is None and s["recovered"] for s in seen.values()), seen


@pytest.mark.slow  # waits out the making's deadline (10 s)
def test_a_rank_that_fails_making_its_buffer_makes_the_others_raise_at_the_making_deadline(seed):
    seen = scenarios.run(scenarios.NUM_RANKS, scenarios.failed_buffer, seed, "fails_making_its_buffer",
                         group_timeout_s=60)
    print(scenarios.expect_failed_buffer(seen))


@pytest.mark.slow  # each waits out a deadline, then starts a group for the survivors
@pytest.mark.parametrize("what", scenarios.LATE)
def test_a_late_or_killed_rank_makes_the_others_raise_then_the_survivors_work_on(what, seed):
    seen = scenarios.run(scenarios.NUM_RANKS, scenarios.late_peer, seed, what)
    scenarios.expect_late(seen, what)
    print(seen[0]["error"])
