"""The one way launchers hear their ranks (NOTE [rank reports] in tokenyard/tools/launch.py)."""

from __future__ import annotations

import time

import pytest

from tokenyard.tools import launch


def _fail_on_rank_0_while_the_others_hang():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(600)  # stuck, as in a wait the failed rank never ends
    return "unreachable"


def test_a_failed_rank_ends_the_run_within_the_grace_and_names_the_cause_first():
    start = time.monotonic()
    with pytest.raises(launch.RanksFailed) as failed:
        launch.run_on_ranks(3, _fail_on_rank_0_while_the_others_hang, use_cuda=False, timeout_s=300)
    elapsed = time.monotonic() - start
    message = str(failed.value)
    assert message.startswith("rank 0 failed:") and "ValueError: rank 0 gives up" in message, message
    assert "ranks [1, 2] did not answer" in message, message
    assert set(failed.value.failures) == {0, 1, 2} and failed.value.results == {}
    assert elapsed < 300 / 2, f"the waiting ranks were given up after {elapsed:.0f} s, not the failure's grace"


def test_reports_name_a_silent_end_before_tracebacks_and_a_late_traceback_replaces_it():
    class Ended:
        exitcode = -9

    class Running:
        exitcode = None

    reports = launch.Reports(3)
    reports.record(2, False, "Traceback ...\nRuntimeError: peer gone")
    reports.record_ends([Running(), Ended(), Running()])
    assert reports.failures[1] == "its process ended with exit code -9 without a report"
    assert reports.describe(60).startswith("rank 1 failed:\nits process ended with exit code -9")
    assert "rank 2 also failed:\nTraceback ...\nRuntimeError: peer gone" in reports.describe(60)
    assert "ranks [0] did not answer within 60 s" in reports.describe(60)
    reports.record(1, False, "Traceback ...\nMemoryError")
    assert reports.describe(60).startswith("rank 2 failed:") and not reports.finished
    reports = launch.Reports(2)
    reports.record(0, True, "a")
    reports.record(1, True, "b")
    assert reports.finished and reports.describe(60) == ""
