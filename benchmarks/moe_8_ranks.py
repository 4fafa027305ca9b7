"""Diagnostic of benchmarks/results/moe_8_ranks_shared.md: tests/gpu/test_moe_cuda.py's cases at 8 ranks, run
after run, printing which runs time out and what every rank raised.

    python benchmarks/moe_8_ranks.py --seed 591358473 --runs 12 --mode reuse    # MPS daemon running

`--mode reuse`: each run makes its rank processes once, runs the four cases in them, and makes each Buffer once
per process (the cases that share a shape share it; none is destroyed). `--mode fresh`: each case in rank
processes of its own. Set TOKENYARD_TIMEOUT_S (10) so that a stuck wait ends fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _measure_reusing(seed, cases):
    from tests.cpu import moe_scenarios
    from tests.gpu import test_moe_cuda

    made = {}
    make_buffer = moe_scenarios.moe.make_buffer

    def make_once(*args, **kwargs):
        key = (args[1:], tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make_buffer(*args, **kwargs)
            made[key].destroy = lambda: None  # kept for the process's life
        return made[key]

    moe_scenarios.moe.make_buffer = make_once
    return test_moe_cuda._measure_ranks(seed, cases)


def main(argv=None) -> None:
    from tests.gpu import spawn, test_moe_cuda

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--mode", choices=("reuse", "fresh"), default="reuse")
    args = parser.parse_args(argv)
    for run in range(args.runs):
        jobs = ([(_measure_reusing, test_moe_cuda.CASES)] if args.mode == "reuse"
                else [(test_moe_cuda._measure_ranks, [case]) for case in test_moe_cuda.CASES])
        for fn, cases in jobs:
            start = time.time()
            what = f"run {run} seed {args.seed + run} cases {[c[0] + '/' + c[1] for c in cases]}"
            try:
                spawn.run(8, fn, args.seed + run, cases, timeout_s=100)
                print(f"{what}: ok {time.time() - start:.0f} s", flush=True)
            except AssertionError as exc:
                print(f"{what}: FAILED {time.time() - start:.0f} s", flush=True)
                for line in str(exc).splitlines():
                    if "Error:" in line:
                        print("   ", line.strip()[:300], flush=True)


if __name__ == "__main__":
    main()
