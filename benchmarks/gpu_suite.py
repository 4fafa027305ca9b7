"""Issue 48's record of the GPU suite's time: tests/gpu at one rank count, each test's duration and outcome.

    TOKENYARD_COMMIT=<hash> python benchmarks/gpu_suite.py --num_ranks 4 --json gpu_suite.json [--timeout_s 300]

Runs `pytest tests/gpu` with TOKENYARD_TEST_NUM_RANKS=<num_ranks> (the ranks spread over the GPUs there are, one
per GPU where there are enough: tests/gpu/spawn.py) and pytest's JUnit XML, and writes one run of the record:
the commit, device, date and command, the wall time, the outcomes, and every test's seconds (setup, call and
teardown together, as JUnit counts them), slowest first. The goal it is read against (issue 48): the whole suite in
at most 5 minutes at 4 ranks on 4 GPUs and 3 at 2, with the kernels cached. A run cut by `--timeout_s` is recorded
as such, with the tests that finished (none where pytest wrote no XML). `kernels_compiled` counts the kernels the run
had to compile (cubins new in the cache folder, NVSHMEM units among them): 0 is a run with the kernels cached.
`own_ranks` sums where the seconds of the tests on ranks of their own went (NOTE [launch times] in
tokenyard/tools/launch.py). On a machine without a GPU every test skips.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenyard import env  # noqa: E402
from tokenyard.tools.bench.report import git_commit  # noqa: E402


def outcome(case: ElementTree.Element) -> str:
    """A JUnit test case's outcome: passed, failed (a failure or an error) or skipped."""
    tags = {child.tag for child in case}
    if tags & {"failure", "error"}:
        return "failed"
    return "skipped" if "skipped" in tags else "passed"


def read_junit(path: str) -> list:
    """Every test case of a JUnit XML file: {"test", "seconds", "outcome"}, slowest first."""
    tests = [{"test": f"{case.get('classname', '')}::{case.get('name', '')}",
              "seconds": round(float(case.get("time", 0)), 2), "outcome": outcome(case)}
             for case in ElementTree.parse(path).getroot().iter("testcase")]
    return sorted(tests, key=lambda t: -t["seconds"])


def cached_kernels(folder: str) -> set:
    """The compiled kernels in the JIT cache folder: every unit, NVRTC's and NVSHMEM's alike, is a cubin there
    (jit/cache.cubin_path); its shared objects are the host's extension and NVSHMEM's shim, not kernels."""
    return {os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
            if name.endswith(".cubin")}


def launch_times(path: str) -> dict:
    """The suite's runs on ranks of their own, summed from NOTE [launch times]' lines: how many, and the seconds
    from the launcher's start to the last rank's group joined (`start_s`: the processes, torch, CUDA, the group),
    to its function returned (`work_s`), to its group left (`leave_s`), and to the last process ended (`exit_s`)."""
    runs, ranks = {}, {}
    if os.path.exists(path):
        with open(path) as f:
            for entry in map(json.loads, f):
                if "rank" in entry:
                    ranks.setdefault(entry["run"], []).append(entry)
                else:
                    runs[entry["run"]] = entry
    sums = {"runs": len(runs), "start_s": 0.0, "work_s": 0.0, "leave_s": 0.0, "exit_s": 0.0}
    for run, launcher in runs.items():
        marks = [launcher["spawned"]]
        for key in ("joined", "returned", "left"):  # the last rank's; a killed rank has none
            seen = [r[key] for r in ranks.get(run, []) if key in r]
            marks.append(max(seen) if seen else marks[-1])
        marks.append(launcher["stopped"])
        for key, (a, b) in zip(("start_s", "work_s", "leave_s", "exit_s"), zip(marks, marks[1:])):
            sums[key] += max(0.0, b - a)
    return {key: value if key == "runs" else round(value, 1) for key, value in sums.items()}


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, required=True)
    parser.add_argument("--timeout_s", type=float, default=300.0)
    parser.add_argument("--json", required=True)
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (say, -k)")
    args = parser.parse_args(argv)
    cache_dir = env.settings().cache_dir
    kernels_before = cached_kernels(cache_dir)
    with tempfile.TemporaryDirectory() as folder:
        junit = os.path.join(folder, "suite.xml")
        times = os.path.join(folder, "launch_times.jsonl")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests/gpu",
                   *args.pytest_args]
        environment = dict(os.environ, TOKENYARD_TEST_NUM_RANKS=str(args.num_ranks), TOKENYARD_LAUNCH_TIMES=times)
        start = time.monotonic()
        pytest = subprocess.Popen(command, env=environment)
        try:
            status = "exit code %d" % pytest.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            # An interrupted pytest still writes the XML of the tests that finished; a pytest that does not stop
            # within 30 s more is killed (then there is no XML).
            pytest.send_signal(signal.SIGINT)
            try:
                pytest.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.kill()
                pytest.wait()
            status = f"cut at {args.timeout_s:g} s"
        wall_s = round(time.monotonic() - start, 1)
        tests = read_junit(junit) if os.path.exists(junit) else []
        own_ranks = launch_times(times)
    kernels_compiled = len(cached_kernels(cache_dir) - kernels_before)
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "skipped")}
    record = {"commit": git_commit(), "device": device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": (f"TOKENYARD_TEST_NUM_RANKS={args.num_ranks} python "
                          + " ".join(command[1:]).replace(junit, "<xml>")),
              "num_ranks": args.num_ranks, "wall_s": wall_s, "status": status,
              "kernels_compiled": kernels_compiled, **counts, "own_ranks": own_ranks, "tests": tests}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"tests/gpu at {args.num_ranks} ranks on {record['device']}: {wall_s} s ({status}); "
          f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
          f"{kernels_compiled} kernels compiled")
    print(f"  runs on ranks of their own: {own_ranks['runs']}, seconds to the groups joined {own_ranks['start_s']}, "
          f"working {own_ranks['work_s']}, leaving the groups {own_ranks['leave_s']}, ending {own_ranks['exit_s']}")
    for t in tests[:10]:
        print(f"  {t['seconds']:8.2f} s  {t['outcome']:7}  {t['test']}")


if __name__ == "__main__":
    main()
