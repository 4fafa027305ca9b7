"""A JSON (a run of benchmarks/results/shared_gpu.md) from the logs of `benchmarks/run_device.sh shared` (the
GPU tests at several rank counts on the GPUs there are, ranks sharing GPUs under MPS).

Each log starts with the header run_device.sh writes (device, num_gpus, num_ranks, commit, date, pytest
args) and ends with pytest's summary line. Runs already in the JSON stay unless a log of the same rank
count and pytest arguments replaces them; a log whose run was cut off (no summary) is refused.

    python benchmarks/shared_gpu.py --json OUT.json LOG [LOG ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

SUMMARY = re.compile(r"^=+ (.*) in [\d.]+s.* =+$")


def read_log(path: str) -> dict:
    header, summary = {}, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            key, sep, value = line.partition(": ")
            if sep and key in ("device", "num_gpus", "num_ranks", "commit", "date", "pytest args") and key not in header:
                header[key] = value
            match = SUMMARY.match(line)
            if match:
                summary = match.group(1)
    if summary is None:
        raise SystemExit(f"{path}: no pytest summary line: the run was cut off")
    counts = {kind: 0 for kind in ("passed", "failed", "skipped", "error")}
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts["error" if kind.startswith("error") else kind] += int(number)
    return {"header": header, "run": {"num_ranks": int(header["num_ranks"]), "num_gpus": int(header["num_gpus"]),
                                      "passed": counts["passed"], "failed": counts["failed"] + counts["error"],
                                      "skipped": counts["skipped"], "pytest_args": header.get("pytest args", ""),
                                      "log": os.path.basename(path)}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args(argv)
    document = {"commit": None, "device": None, "date": None, "runs": []}
    if os.path.exists(args.json):
        with open(args.json) as f:
            document = json.load(f)
    folder = os.path.dirname(os.path.abspath(args.json))
    for path in args.logs:
        found = read_log(path)
        header, run = found["header"], found["run"]
        if document["commit"] not in (None, header["commit"]):
            sys.exit(f"{path} is of commit {header['commit']}, the JSON of {document['commit']}: start a new JSON")
        document.update(commit=header["commit"], device=header["device"],
                        date=max(document.get("date") or "", header["date"]))  # the newest run's
        document["runs"] = [r for r in document["runs"]
                            if (r["num_ranks"], r.get("pytest_args", "")) != (run["num_ranks"], run["pytest_args"])]
        document["runs"].append(run)
        if os.path.abspath(path) != os.path.join(folder, run["log"]):
            shutil.copyfile(path, os.path.join(folder, run["log"]))
    document["runs"].sort(key=lambda r: (r["num_ranks"], r.get("pytest_args", "")))
    with open(args.json, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    for run in document["runs"]:
        print(f"{run['num_ranks']} ranks on {run['num_gpus']} GPU(s) {run['pytest_args']}: {run['passed']} passed, "
              f"{run['failed']} failed, {run['skipped']} skipped")


if __name__ == "__main__":
    main()
