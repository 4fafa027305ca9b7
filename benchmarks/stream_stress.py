"""benchmarks/results/stream_stress.json: the stream stress run (tests/gpu/stream_stress.py) at several seeds and
rank counts, with the calls it made, the keyword values it covered and every output that differed from the
reference backend (issue 56). `benchmarks/run_device.sh stream_stress` runs it in an earlier tree too (its
copy of this script and of the run), so that one call records the code before a fix beside the code after it.

    python benchmarks/stream_stress.py --ranks 2 4 --seeds 3 --rounds 60 --json stream_stress.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu import spawn  # noqa: E402
from tests.gpu.stream_stress import stress  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, default=3, help="how many fresh seeds per rank count")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--commit", default=os.environ.get("TOKENYARD_COMMIT"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    runs = []
    for num_ranks in args.ranks:
        for _ in range(args.seeds):
            seed = secrets.randbelow(2**31)
            start = time.time()
            try:
                reports = spawn.run(num_ranks, stress, seed, args.rounds, timeout_s=150)
                failures = sorted({f for r in reports for f in r["failures"]})
                covered, calls = reports[0]["covered"], reports[0]["num_calls"]
            except AssertionError as exc:  # a rank died or hung: the run's own failure
                failures, covered, calls = [str(exc)[-2000:]], {}, 0
            runs.append({"num_ranks": num_ranks, "seed": seed, "rounds": args.rounds, "calls_per_rank": calls,
                         "seconds": round(time.time() - start, 1), "failures": failures, "covered": covered})
            print(f"{num_ranks} ranks, seed {seed}: {calls} calls a rank, {len(covered)} keyword values, "
                  f"{len(failures)} failures{': ' + failures[0][:300] if failures else ''}", flush=True)
    record = {"commit": args.commit, "device": spawn.describe(max(args.ranks)),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "command": "python " + " ".join(sys.argv), "runs": runs,
              "passed": all(not r["failures"] for r in runs)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print(f"stream stress at {args.commit}: {'passed' if record['passed'] else 'FAILED'}")


if __name__ == "__main__":
    main()
