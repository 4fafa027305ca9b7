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


@pytest.mark.slow  # waits out the failure's grace
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


_HELD_GROUP = """
import warnings, torch.distributed as dist
from tokenyard.tools import launch
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
class Keeper: pass
keeper = Keeper(); keeper.group = dist.group.WORLD
def uses(group=dist.group.WORLD): pass
def outer():
    group = dist.group.WORLD
    return lambda: group
inner = outer()
held = dist.group.WORLD
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    launch.leave_group()
print("|".join(str(w.message) for w in seen))
"""


def test_a_group_that_outlives_leave_group_is_reported_with_what_holds_it():
    """NOTE [gloo threads at exit]: the warning names each holder, so the next one found is found at once."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HELD_GROUP.format(port=launch.free_port())], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for holder in ("a default argument of __main__.uses", "a global of __main__", "an attribute of a Keeper",
                   "a variable of __main__.outer.<locals>.<lambda>'s closure"):
        assert holder in out, (holder, out)


def _environment_and_pid():
    import os

    return os.environ.get("TOKENYARD_TEST_LAUNCH_MARK"), os.environ.get("TOKENYARD_TEST_LAUNCH_GONE"), os.getpid()


def test_ranks_take_the_launchers_environment_as_it_is_when_they_start(monkeypatch):
    # NOTE [rank processes]: ranks fork from a server started once, so what a test sets or unsets after the server
    # started must still reach them, as under "spawn".
    monkeypatch.setenv("TOKENYARD_TEST_LAUNCH_GONE", "set before the server")
    first = launch.run_on_ranks(2, _environment_and_pid, use_cuda=False, timeout_s=120)
    assert all(seen[:2] == (None, "set before the server") for seen in first), first
    mark = f"mark {time.monotonic()}"
    monkeypatch.setenv("TOKENYARD_TEST_LAUNCH_MARK", mark)
    monkeypatch.delenv("TOKENYARD_TEST_LAUNCH_GONE")
    second = launch.run_on_ranks(2, _environment_and_pid, use_cuda=False, timeout_s=120)
    assert all(seen[:2] == (mark, None) for seen in second), second
    assert len({seen[2] for seen in first + second}) == 4, "ranks of two runs shared a process"


def _sleep_a_little():
    time.sleep(0.3)
    return "slept"


def test_runs_log_where_their_seconds_went_and_the_gpu_suite_sums_them(tmp_path, monkeypatch):
    # NOTE [launch times]: the launcher's line and each rank's, and benchmarks/gpu_suite.py's sums of them; a rank that
    # raised has no "returned" and a killed one no line, and a run counts as far as its other ranks went.
    import importlib.util
    import json
    import pathlib

    log = tmp_path / "times.jsonl"
    monkeypatch.setenv("TOKENYARD_LAUNCH_TIMES", str(log))
    assert launch.run_on_ranks(2, _sleep_a_little, use_cuda=False, timeout_s=120) == ["slept", "slept"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (run,) = [line for line in lines if "rank" not in line]
    ranks = sorted((line for line in lines if "rank" in line), key=lambda line: line["rank"])
    assert run["what"] == "_sleep_a_little" and [r["rank"] for r in ranks] == [0, 1], lines
    assert all(r["run"] == run["run"] for r in ranks), lines
    for r in ranks:
        assert run["spawned"] < r["entered"] <= r["joined"] < r["returned"] <= r["left"] <= run["stopped"], lines
        assert r["returned"] - r["joined"] >= 0.3, r
    assert run["reported"] >= max(r["returned"] for r in ranks), lines
    spec = importlib.util.spec_from_file_location(
        "gpu_suite", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    with open(log, "a") as f:  # a second run: rank 0 raised in its function, rank 1 was killed
        f.write(json.dumps({"run": 1, "what": "killed", "spawned": 10.0, "reported": None, "stopped": 20.0}) + "\n")
        f.write(json.dumps({"run": 1, "rank": 0, "entered": 11.0, "joined": 12.5, "left": 16.0}) + "\n")
    sums = suite.launch_times(str(log))
    first = {"start_s": max(r["joined"] for r in ranks) - run["spawned"],
             "work_s": max(r["returned"] for r in ranks) - max(r["joined"] for r in ranks),
             "leave_s": max(r["left"] for r in ranks) - max(r["returned"] for r in ranks),
             "exit_s": run["stopped"] - max(r["left"] for r in ranks)}
    second = {"start_s": 2.5, "work_s": 0.0, "leave_s": 3.5, "exit_s": 4.0}
    assert sums["runs"] == 2, sums
    for key, seconds in first.items():
        assert sums[key] == pytest.approx(seconds + second[key], abs=0.06), (key, sums)
