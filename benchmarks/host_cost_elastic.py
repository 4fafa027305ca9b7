"""The host's cost of ElasticBuffer's calls (DeepEP V2's API), beside the V1 calls they are made of: one rank,
CUDA backend, DeepSeek-V3 shapes (hidden 7168, top-8 of 256, FP8 dispatch, 4096 tokens). Per call, the median
`time.perf_counter` of calls after warm-ups, each from an idle GPU, and a profile of where the time goes (cProfile:
each function's own time per call), as benchmarks/host_cost.py. From an idle GPU, a call's time is the host's own:
back to back, a V2 call's ten or so launches fill the launch queue within a hundred calls wherever its kernels take
longer than the host, and the host's time then holds the GPU's. The dispatches with the CPU sync add the count
exchange's kernel (NOTE [fresh dispatch time] in benchmarks/host_cost.py).

    python benchmarks/host_cost_elastic.py [--iters 200] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

from host_cost import _own_time_rows  # noqa: E402  (beside this script)

WARMUP = 20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from tokenyard.tools.launch import run_on_ranks

    return run_on_ranks(1, _measure, args, use_cuda=True)[0]


def _measure(args) -> int:
    """One rank of a group of one (tokenyard.tools.launch.run_on_ranks joins and leaves it)."""
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer, ElasticBuffer
    from tokenyard.tools.bench.report import git_commit
    from tokenyard.tools.testing import make_rank_inputs

    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts, num_topk, tokens = 7168, 256, 8, args.num_tokens
    elastic = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=num_topk,
                            backend="cuda")
    v1 = elastic.buffer
    x, topk_idx, weights = make_rank_inputs(1, 1, tokens, hidden, num_experts, num_topk, "uniform", "fp8",
                                            device)[0]
    layout = v1.get_dispatch_layout(topk_idx, num_experts)
    v1_out = v1.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=layout[0],
                         is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], num_worst_tokens=tokens)
    v1_handle, v1_rows = v1_out[4], v1_out[0][0].float().to(torch.bfloat16)
    outs = {}
    for expand in (False, True):
        recv, _, recv_w, handle, _ = elastic.dispatch(x, topk_idx, weights, None, num_experts, do_cpu_sync=False,
                                                      do_expand=expand)
        outs[expand] = (handle, recv[0].float().to(torch.bfloat16), recv_w)
    torch.cuda.synchronize()

    calls = {
        "v1 layout": lambda: v1.get_dispatch_layout(topk_idx, num_experts),
        "v1 dispatch_worst": lambda: v1.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                 num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2], num_worst_tokens=tokens),
        "v1 dispatch_cached": lambda: v1.dispatch(x, handle=v1_handle),
        "v1 combine": lambda: v1.combine(v1_rows, v1_handle),
    }
    for expand, name in ((False, "v2"), (True, "v2 expand")):
        handle, rows, recv_w = outs[expand]
        calls[f"{name} dispatch"] = (lambda e=expand: elastic.dispatch(x, topk_idx, weights, None, num_experts,
                                                                       do_cpu_sync=False, do_expand=e))
        calls[f"{name} dispatch_cached"] = (lambda h=handle, e=expand: elastic.dispatch(x, handle=h, do_expand=e))
        calls[f"{name} combine"] = (lambda h=handle, r=rows, w=recv_w: elastic.combine(r, h, w))
    # With the CPU sync (DeepEP V2's default): the host's time and the count exchange's kernel.
    for expand, name in ((False, "v2 dispatch, cpu sync"), (True, "v2 expand dispatch, cpu sync")):
        calls[name] = (lambda e=expand: elastic.dispatch(x, topk_idx, weights, None, num_experts, do_expand=e))

    results, profiles = {}, {}
    for name, call in calls.items():
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        results[name] = statistics.median(times) * 1e6
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        profiles[name] = _own_time_rows(profiler, 50, top=10)
        print(f"{name:>24}: {results[name]:7.1f} us host per call", flush=True)
    for name, rows in profiles.items():
        if name.startswith("v2"):
            print(f"-- {name}: own time per call (us), top rows")
            for where, per_call, own, cumulative in rows:
                print(f"   {own:7.1f} {cumulative:8.1f} x{per_call:<5} {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": torch.cuda.get_device_name(device),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "settings": dict(vars(args), hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                                        dtype="fp8", num_ranks=1, num_sms=Buffer.num_sms),
                       "host_us": results, "profiles": profiles}, f, indent=1)
    elastic.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
