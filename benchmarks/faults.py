"""benchmarks/results/faults.json: how each fault of tests/cpu/fault_scenarios.py was detected (issue 23).

Per scenario: the backend, the ranks, the longest time a rank other than the one at fault took from the start
of its call to its error (`detected_s`), rank 0's error, and whether every surviving rank then completed a
correct call. The reference backend on CPU gloo ranks; on a GPU machine the same scenarios run there too
once they exist for the CUDA backend.

    python benchmarks/faults.py --json benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.cpu import fault_scenarios as scenarios  # noqa: E402
from tokenyard.bench.report import git_commit  # noqa: E402
from tokenyard.launch import RanksFailed, run_on_ranks  # noqa: E402


def _run(fn, seed, what) -> dict:
    """Every rank's view of one scenario (rank -> dict); a rank that died is left out."""
    try:
        return dict(enumerate(run_on_ranks(scenarios.NUM_RANKS, fn, seed, what, use_cuda=False, timeout_s=120,
                                           group_timeout_s=10)))
    except RanksFailed as failed:
        if set(failed.failures) != {1} or what != "killed":
            raise
        return failed.results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int, default=secrets.randbelow(2**31))
    args = parser.parse_args(argv)
    rows = []
    for fn, names, at_fault in ((scenarios.mismatch, scenarios.MISMATCHES, None),
                                (scenarios.late_peer, scenarios.LATE, 1)):
        for what in names:
            seen = _run(fn, args.seed, what)
            others = [s for r, s in seen.items() if r != at_fault]
            row = {"scenario": what, "backend": "reference", "num_ranks": scenarios.NUM_RANKS,
                   "timeout_s": scenarios.TIMEOUT_S, "detected_s": round(max(s["detected_s"] for s in others), 3),
                   "error": seen[0]["error"], "survivors_recovered": all(s["recovered"] for s in seen.values())}
            rows.append(row)
            print(f"{what}: detected in {row['detected_s']:.2f} s, recovered {row['survivors_recovered']}: "
                  f"{(row['error'] or '')[:110]}", flush=True)
    if args.json:
        document = {"commit": git_commit(), "device": f"cpu ({scenarios.NUM_RANKS} gloo ranks)",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "seed": args.seed, "scenarios": rows}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
