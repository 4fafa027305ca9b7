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


def _report_stuck(rank, op, streams):
    """Every thread's stack, and whether each stream has finished its work (a query does not wait)."""
    import faulthandler

    idle = {name: stream.query() for name, stream in streams.items() if stream is not None}
    print(f"trace rank {rank} {op} still running after 3 s; streams idle: {idle}\n", end="", flush=True)
    faulthandler.dump_traceback()


def _report_done(rank, op, event):
    event.synchronize()
    print(f"trace rank {rank} {op} ends on the GPU at {time.time():.3f}\n", end="", flush=True)


def _trace_calls():
    """Wrap Buffer's calls so that each prints `rank r <op> begins|returns at <t>` (time.time(), one clock),
    whether it took a fast path, when its work ends on the GPU, and every thread's stack (and whether the streams
    are idle) if it has not returned within 3 s."""
    import functools
    import threading

    import torch
    import torch.distributed as dist

    from tokenyard.buffer import Buffer

    for op in ("get_dispatch_layout", "dispatch", "combine"):
        def wrap(method, op=op):
            @functools.wraps(method)
            def traced(self, *args, **kwargs):
                rank, fast = dist.get_rank(), getattr(self, "_fast", None)
                hits = fast.hits if fast is not None else 0
                print(f"trace rank {rank} {op} begins at {time.time():.3f}\n", end="", flush=True)
                streams = {"current": torch.cuda.current_stream(), "comm": self.get_comm_stream()}
                watchdog = threading.Timer(3.0, _report_stuck, (rank, op, streams))
                watchdog.start()
                try:
                    out = method(self, *args, **kwargs)
                finally:
                    watchdog.cancel()
                path = "fast" if fast is not None and fast.hits > hits else "full"
                print(f"trace rank {rank} {op} returns at {time.time():.3f} ({path})\n", end="", flush=True)
                done = torch.cuda.Event()
                done.record()
                threading.Thread(target=_report_done, args=(rank, op, done), daemon=True).start()
                return out
            return traced
        setattr(Buffer, op, wrap(getattr(Buffer, op)))


def _measure_reusing(seed, cases, trace=False):
    from tests.cpu import moe_scenarios
    from tests.gpu import test_moe_cuda

    if trace:
        _trace_calls()

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
    parser.add_argument("--trace", action="store_true", help="stamp every Buffer call (reuse mode)")
    args = parser.parse_args(argv)
    for run in range(args.runs):
        jobs = ([(_measure_reusing, test_moe_cuda.CASES, args.trace)] if args.mode == "reuse"
                else [(test_moe_cuda._measure_ranks, [case]) for case in test_moe_cuda.CASES])
        for fn, cases, *extra in jobs:
            start = time.time()
            what = f"run {run} seed {args.seed + run} cases {[c[0] + '/' + c[1] for c in cases]}"
            try:
                spawn.run(8, fn, args.seed + run, cases, *extra, timeout_s=100)
                print(f"{what}: ok {time.time() - start:.0f} s", flush=True)
            except AssertionError as exc:
                print(f"{what}: FAILED {time.time() - start:.0f} s", flush=True)
                for line in str(exc).splitlines():
                    if "Error:" in line:
                        print("   ", line.strip()[:1000], flush=True)


if __name__ == "__main__":
    main()
