"""Does ElasticBuffer's `async_with_compute_stream` let compute overlap the communication (NOTE [elastic streams]
in tokenyard/elastic.py)? One rank, CUDA backend: a decode-like step (dispatch without the CPU sync, combine)
beside a bf16 matmul chain on the caller's stream, timed with CUDA events on that stream:

- compute alone; the step alone;
- serial: the step, then the matmuls (async_with_compute_stream=False: the caller's stream waits);
- overlapped: the matmuls, then the step with async_with_compute_stream=True after an event captured before
  them, then the wait for the step's event.

    python benchmarks/elastic_overlap.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num_experts", type=int, default=256)
    parser.add_argument("--num_topk", type=int, default=8)
    parser.add_argument("--matmul", type=int, default=6144, help="side of the square bf16 matmuls")
    parser.add_argument("--matmuls", type=int, default=4, help="matmuls per step")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from tokenyard.tools.launch import run_on_ranks

    return run_on_ranks(1, _measure, args, use_cuda=True)[0]


def _measure(args) -> int:
    """One rank of a group of one (tokenyard.tools.launch.run_on_ranks joins and leaves it)."""
    from tokenyard import ElasticBuffer
    from tokenyard.tools.bench.report import git_commit
    from tokenyard.tools.testing import make_rank_inputs

    device = torch.device("cuda", torch.cuda.current_device())
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=args.num_tokens, hidden=args.hidden,
                           num_topk=args.num_topk, backend="cuda", check_inputs=False)
    x, topk_idx, weights = make_rank_inputs(1, 1, args.num_tokens, args.hidden, args.num_experts, args.num_topk,
                                            "uniform", "bf16", device)[0]
    a = torch.randn(args.matmul, args.matmul, dtype=torch.bfloat16, device=device)

    def compute():
        out = a
        for _ in range(args.matmuls):
            out = out @ a
        return out

    def step(async_):
        recv, _, recv_w, handle, event = buffer.dispatch(x, topk_idx, weights, None, args.num_experts,
                                                         do_cpu_sync=False, async_with_compute_stream=async_)
        event.current_stream_wait()
        return buffer.combine(recv, handle, recv_w, async_with_compute_stream=async_)

    def serial():
        step(False)
        compute()

    def overlapped():
        # The matmuls are queued first (the host's time per call would otherwise keep the caller's stream
        # idle while it queues the step); the step waits for what the caller's stream had done before them
        # (`capture`), not for them: without previous_event the comm stream waits for all of the caller's
        # stream so far.
        ready = buffer.capture()
        compute()
        recv, _, recv_w, handle, event = buffer.dispatch(x, topk_idx, weights, None, args.num_experts,
                                                         do_cpu_sync=False, previous_event=ready,
                                                         async_with_compute_stream=True)
        combined, _, done = buffer.combine(recv, handle, recv_w, previous_event=event.event,
                                           async_with_compute_stream=True)
        done.current_stream_wait()

    cases = {"compute alone": compute, "step alone": lambda: step(False), "serial": serial,
             "overlapped": overlapped}
    results = {}
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        results[name] = statistics.median(times)
        print(f"{name:>14}: {results[name]:8.1f} us (median of {args.iters})", flush=True)
    saved = results["serial"] - results["overlapped"]
    print(f"overlap saved {saved:.1f} us of the {results['step alone']:.1f} us step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": torch.cuda.get_device_name(device),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": vars(args),
                       "median_us": results, "saved_us": saved}, f, indent=1)
    buffer.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
