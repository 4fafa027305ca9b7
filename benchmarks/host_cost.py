"""The host's cost of each call: what the CPU spends before a call returns, at several token counts.

    python benchmarks/host_cost.py [--num_ranks N] [--tokens 128,512,4096,8192] [--iters 200] [--rounds 3]
                                   [--json OUT.json] [--cpu]

Per call and token count (tokens per rank), the median of twice `--rounds` rounds of `--iters` back-to-back
calls (NOTE [rounds of calls]) timed with ``time.perf_counter`` after 20 warm-ups, with no synchronisation in
the loop, on a Buffer made with the defaults (so the default checks run). The calls are those that return
without waiting for the GPU: `layout` (get_dispatch_layout), `dispatch_cached` (a handle given),
`dispatch_worst` (num_worst_tokens), `combine`, and the low-latency pair (at token counts whose low-latency
buffer fits the GPU); and `dispatch_fresh`, the fresh dispatch that waits for its counts, each call timed from an
idle GPU (NOTE [fresh dispatch time]).

At 4096 tokens it also measures, per call, the call time back to back (CUDA events around each of
back-to-back calls: made before the loop, and as DeepEP's harness makes them, `_events_around`) beside the
summed time of its kernels (PyTorch profiler), the
steps of its C++ run beside the Python around them (NOTE [plan profile] in csrc/call_plan.cpp), and a
profile of the Python (cProfile: each function's own time per call).

DeepSeek-V3 shapes: hidden 7168, top-8 of 256 experts; FP8 dispatch, bf16 combine and low-latency calls.
``--cpu`` runs the reference backend on gloo ranks instead (a smoke test of the script, small shapes).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

CALLS = ("layout", "dispatch_cached", "dispatch_worst", "dispatch_fresh", "combine", "low_latency_dispatch",
         "low_latency_combine")
# NOTE [fresh dispatch time]: a fresh dispatch without num_worst_tokens waits on the host for its counts, so back to
# back it would wait behind the previous call's transfer: it is timed with the GPU idle at each call's start (a
# synchronisation before each, outside the timing), which gives its host time plus the count exchange's kernel.
SYNCED_CALLS = ("dispatch_fresh",)
WARMUP = 20
PROFILE_TOKENS = 4096
# NOTE [launch queue]: a call whose GPU work outlasts its host work fills the stream's launch queue within a
# few hundred back-to-back calls, after which a launch waits for room and the host time per call becomes the
# GPU time. The median of the first EARLY_CALLS timed calls (after the warm-ups) is reported beside the
# median of all, to tell the two apart.
EARLY_CALLS = 50
# NOTE [rounds of calls]: the lent hosts' speed drifts over seconds, even within one call (the crossing from
# Python in benchmarks/results/host_cost.md). Each size times its calls in `--rounds` rounds, one
# call after another within a round, so that a slow phase falls on every call alike; the sizes are visited up,
# then down again, so that a drift over the run does not pass for a cost that grows with the token count. A
# figure is the median of all of its samples; `rounds` in the JSON keeps each round's median, in the order run.
LOW_LATENCY_MEMORY_SHARE = 0.4  # of the GPU's memory, at most, for the low-latency buffer and its outputs


def _own_time_rows(profiler: cProfile.Profile, num_calls: int, top: int = 14):
    """[(function, calls per call, own µs per call, cumulative µs per call)], by own time."""
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = f"{os.path.basename(path)}:{line}({name})" if path != "~" else name
        rows.append((where, calls / num_calls, own / num_calls * 1e6, cumulative / num_calls * 1e6))
    rows.sort(key=lambda r: -r[2])
    return [[w, round(c, 2), round(o, 2), round(t, 2)] for w, c, o, t in rows[:top]]


def rank_main(token_counts, profile_tokens: int, iters: int, rounds: int, gpu: bool):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    hidden, num_experts, num_topk = (7168, 256, 8) if gpu else (512, 16, 4)
    memory = torch.cuda.get_device_properties(device).total_memory if gpu else 1 << 34

    def sync():
        if gpu:
            torch.cuda.synchronize(device)

    results = {name: {} for name in CALLS}
    early = {name: {} for name in CALLS}  # NOTE [launch queue]
    by_round = {name: {} for name in CALLS}  # NOTE [rounds of calls]
    extra = {"early": early, "rounds": by_round}
    times = {name: {num_tokens: [] for num_tokens in token_counts} for name in CALLS}
    profiled = False
    for num_tokens in token_counts + token_counts[::-1]:  # NOTE [rounds of calls]: up, then down
        ll_bytes = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
        with_low_latency = 3 * ll_bytes <= LOW_LATENCY_MEMORY_SHARE * memory * (num_ranks if not gpu else 1)
        num_nvl_bytes = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
        buffer = Buffer(dist.group.WORLD, num_nvl_bytes, ll_bytes if with_low_latency else 0,
                        low_latency_mode=with_low_latency, backend="cuda" if gpu else "reference")
        x, topk_idx, weights = make_rank_inputs(1234 + num_tokens, num_ranks, num_tokens, hidden, num_experts,
                                                num_topk, dtype="fp8", device=device)[rank]
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                          num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                          num_tokens_per_expert=layout[2])
        rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).float().to(torch.bfloat16)
        ops = {
            "layout": lambda: buffer.get_dispatch_layout(topk_idx, num_experts),
            "dispatch_cached": lambda: buffer.dispatch(x, handle=handle),
            "dispatch_worst": lambda: buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=layout[0],
                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                num_worst_tokens=num_tokens * num_ranks),
            "dispatch_fresh": lambda: buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=layout[0],
                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2]),
            "combine": lambda: buffer.combine(rows, handle, topk_weights=recv_w),
        }
        if with_low_latency:
            ll_x, ll_idx, ll_w = make_rank_inputs(99 + num_tokens, num_ranks, num_tokens, hidden, num_experts,
                                                  num_topk, device=device)[rank]
            ll_handle = buffer.low_latency_dispatch(ll_x, ll_idx, num_tokens, num_experts)[2]
            ll_out = torch.randn(num_experts // num_ranks, num_ranks * num_tokens, hidden,
                                 device=device).to(torch.bfloat16)
            ops["low_latency_dispatch"] = lambda: buffer.low_latency_dispatch(ll_x, ll_idx, num_tokens, num_experts)
            ops["low_latency_combine"] = lambda: buffer.low_latency_combine(ll_out, ll_idx, ll_w, ll_handle)
        for round_index in range(rounds):  # NOTE [rounds of calls]
            for name, op in ops.items():
                if round_index == 0:
                    for _ in range(WARMUP):
                        op()
                sync()
                dist.barrier()
                samples = times[name][num_tokens]
                for _ in range(iters):
                    if name in SYNCED_CALLS:  # NOTE [fresh dispatch time]
                        sync()
                    start = time.perf_counter()
                    op()
                    samples.append(time.perf_counter() - start)
                sync()
        if num_tokens == profile_tokens and not profiled:
            profiled = True
            extra["call_vs_kernel"] = _call_vs_kernel(ops, iters, rounds, device) if gpu else None
            extra["steps"] = _plan_steps(buffer, topk_idx, num_experts, iters) if gpu else None
            extra["plan_profile"] = _plan_profile(ops, iters) if gpu else None
            extra["profile"] = {}
            for name, op in ops.items():
                profiler = cProfile.Profile()
                sync()
                profiler.enable()
                for _ in range(iters):
                    op()
                profiler.disable()
                sync()
                extra["profile"][name] = _own_time_rows(profiler, iters)
        sync()
        dist.barrier()
        buffer.destroy()
        buffer = ops = None  # freed before the next size's buffer is made
    for name in CALLS:
        for num_tokens, samples in times[name].items():
            if not samples:
                results[name][str(num_tokens)] = early[name][str(num_tokens)] = None  # the buffer would not fit
                continue
            results[name][str(num_tokens)] = statistics.median(samples) * 1e6
            early[name][str(num_tokens)] = statistics.median(samples[:EARLY_CALLS]) * 1e6
            by_round[name][str(num_tokens)] = [round(statistics.median(samples[r:r + iters]) * 1e6, 2)
                                               for r in range(0, len(samples), iters)]
    return {"calls": results, **extra}


def _plan_steps(buffer, topk_idx, num_experts: int, iters: int):
    """The median host time (µs) of the steps a call's C++ run is made of (NOTE [call plans]), each timed as a
    plan of its own: the crossing from Python, allocations, a stream switch to the comm stream and back, and
    the layout's whole plan on the caller's stream."""
    import torch

    from tokenyard.backends.cuda import plans

    device, fast = buffer.device, buffer._fast

    def plan_of(num_outputs: int, in_one: bool = False):
        b = plans.PlanBuilder(device, ())
        shapes = [(f"o{i}", (1024,)) for i in range(num_outputs)]
        if in_one and num_outputs:
            b.outputs_in_one([(name, shape, torch.int32) for name, shape in shapes])
        else:
            for name, shape in shapes:
                b.output(name, shape, torch.int32)
        return b.build().native

    empty, one, six, six_in_one = plan_of(0), plan_of(1), plan_of(6), plan_of(6, in_one=True)
    layout = buffer.runtime.layout_plan(topk_idx.dtype, topk_idx.size(0), topk_idx.size(1), num_experts).native
    compute = torch.cuda.current_stream(device).cuda_stream
    comm = buffer.get_comm_stream()
    here = (compute, 0, 0, 0, 0, False, False, 0)
    switch = (compute, comm.cuda_stream, 0, plans.new_event(), plans.new_event(), True, False, comm.stream_id)
    steps = {
        "crossing (a plan of nothing)": lambda: empty.run((), [], *here),
        "one allocation": lambda: one.run((), [], *here),
        "six allocations": lambda: six.run((), [], *here),
        "six outputs in one allocation": lambda: six_in_one.run((), [], *here),
        "stream switch and back (a plan of nothing)": lambda: empty.run((), [], *switch),
        "layout plan (its outputs in one allocation, a launch)": lambda: layout.run((topk_idx,), [], *here),
        "layout plan with the stream switch": lambda: layout.run((topk_idx,), [], *switch),
    }
    if hasattr(fast, "calls"):  # NOTE [fast calls] (an A/B's earlier tree may predate them)
        steps["a fast call's lookup, nothing recorded"] = lambda: fast.calls.run((-1,), (), compute, None, False, 0)
    out = {}
    for name, step in steps.items():
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize(device)
        out[name] = round(statistics.median(times) * 1e6, 2)
    return out


def _plan_profile(ops, iters: int):
    """Per call: its median host time, and the mean time per call of each step of its C++ runs (NOTE [plan
    profile] in csrc/call_plan.cpp); the rest, `python`, is the call's Python and its crossings into C++."""
    import torch

    from tokenyard.backends.cuda import plans

    native = plans.module()
    out = {}
    for name, op in ops.items():
        for _ in range(WARMUP):
            op()
        torch.cuda.synchronize()
        native.set_profiling(True)
        native.take_profile()
        times = []
        try:
            for _ in range(iters):
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            steps = native.take_profile()
        finally:
            native.set_profiling(False)
        torch.cuda.synchronize()
        runs = steps.pop("runs") / iters
        steps = {step: round(us * runs, 2) for step, us in steps.items()}
        call = statistics.median(times) * 1e6
        out[name] = {"call_us": round(call, 2), "runs_per_call": runs,
                     "steps_us": {**steps, "python": round(call - sum(steps.values()), 2)}}
    return out


def _events_around(op, iters: int, device, made_ahead: bool) -> list:
    """The times between CUDA events recorded before and after each of `iters` back-to-back calls (µs).

    `made_ahead`: the events exist before the loop and are recorded on the stream, given, so the interval holds
    the call and one record. Otherwise as DeepEP's harness (its `bench`): the Event objects are made before the
    loop, but each CUDA event at its first record, which also looks the current stream up; the interval then
    also holds the end event's making."""
    import torch

    stream = torch.cuda.current_stream(device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    if made_ahead:
        for start, end in pairs:
            start.record(stream)
            end.record(stream)
    torch.cuda.synchronize(device)
    for start, end in pairs:
        if made_ahead:
            start.record(stream)
            op()
            end.record(stream)
        else:
            start.record()
            op()
            end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def _call_vs_kernel(ops, iters: int, rounds: int, device):
    """Per call: the median CUDA-event time around each of back-to-back calls (events made ahead, and as
    DeepEP's harness makes them: `_events_around`; over `rounds` rounds, NOTE [rounds of calls]), the median
    summed time of its kernels, and each kernel's mean time per call (µs; other kernels than tokenyard's too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ahead, lazy = {name: [] for name in ops}, {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            ahead[name] += _events_around(op, iters, device, made_ahead=True)
            lazy[name] += _events_around(op, iters, device, made_ahead=False)
    out = {}
    for name, op in ops.items():
        call_us, call_us_lazy = statistics.median(ahead[name]), statistics.median(lazy[name])
        marker = torch.empty(1, device=device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                marker.neg_()  # marks the start of a call
                op()
            torch.cuda.synchronize(device)
        per_call, by_name = [], {}
        for event in sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                            key=lambda e: e.time_range.start):
            if "neg" in event.name:
                per_call.append(0.0)
                continue
            by_name[event.name[:48]] = by_name.get(event.name[:48], 0.0) + event.time_range.elapsed_us() / iters
            if per_call and event.name.startswith("tokenyard::"):
                per_call[-1] += event.time_range.elapsed_us()
        kernel_us = statistics.median(per_call) if len(per_call) == iters else None
        out[name] = {"call_us": call_us, "call_us_deepep_harness": call_us_lazy, "kernel_us": kernel_us,
                     "kernels": {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=None, help="default: one per GPU (one on CPU: 2)")
    parser.add_argument("--tokens", default="128,512,4096,8192")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="per size and pass (NOTE [rounds of calls])")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.cpu:
        token_counts = [max(1, t // 128) for t in token_counts]
    profile_tokens = PROFILE_TOKENS // 128 if args.cpu else PROFILE_TOKENS
    import torch

    num_ranks = args.num_ranks or (2 if args.cpu else max(1, torch.cuda.device_count()))
    from tokenyard.tools.launch import run_on_ranks

    per_rank = run_on_ranks(num_ranks, rank_main, token_counts, profile_tokens, args.iters, args.rounds,
                            not args.cpu, use_cuda=not args.cpu)
    calls = {name: {"tokens": {t: (max(r["calls"][name][t] for r in per_rank)
                                   if per_rank[0]["calls"][name][t] is not None else None)
                               for t in per_rank[0]["calls"][name]}}
             for name in CALLS}
    print(f"host time per call, µs (median of {2 * args.rounds} rounds of {args.iters} back-to-back calls, "
          f"{args.rounds} as the sizes go up and {args.rounds} as they come down; the slowest of {num_ranks} ranks):")
    print(f"  {'call':<22}" + "".join(f"{t:>10}" for t in map(str, token_counts)))
    for name in CALLS:
        cells = calls[name]["tokens"]
        print(f"  {name:<22}" + "".join(f"{'-' if cells[str(t)] is None else format(cells[str(t)], '.1f'):>10}"
                                        for t in token_counts))
    early = {name: {t: (max(r["early"][name][t] for r in per_rank) if per_rank[0]["early"][name][t] is not None
                        else None) for t in per_rank[0]["early"][name]} for name in CALLS}
    print(f"the same, median of the first {EARLY_CALLS} timed calls (NOTE [launch queue]):")
    for name in CALLS:
        print(f"  {name:<22}" + "".join(f"{'-' if early[name][str(t)] is None else format(early[name][str(t)], '.1f'):>10}"
                                        for t in token_counts))
    rank0 = per_rank[0]
    if rank0.get("call_vs_kernel"):
        print(f"\nat {profile_tokens} tokens, back to back (rank 0): call time (CUDA events made ahead; as DeepEP's "
              "harness makes them) vs kernel time, µs")
        for name, entry in rank0["call_vs_kernel"].items():
            kernel, deepep = entry["kernel_us"], entry.get("call_us_deepep_harness")
            deepep = "-" if deepep is None else format(deepep, ".1f")
            print(f"  {name:<22} call {entry['call_us']:9.1f}; {deepep:>7}   kernels "
                  f"{'-' if kernel is None else format(kernel, '9.1f')}   "
                  + ", ".join(f"{k} {v:.1f}" for k, v in entry.get("kernels", {}).items()))
    if rank0.get("steps"):
        print(f"\nthe C++ run's steps, each as a plan of its own (rank 0, µs, median of {args.iters}):")
        for name, us in rank0["steps"].items():
            print(f"  {us:7.2f}  {name}")
    if rank0.get("plan_profile"):
        steps = next(iter(rank0["plan_profile"].values()))["steps_us"]
        print(f"\nat {profile_tokens} tokens, where each call's host time goes (rank 0; the C++ steps' mean µs per call, "
              "python: the median call's rest):")
        print(f"  {'call':<22}{'call':>8}" + "".join(f"{step:>10}" for step in steps))
        for name, entry in rank0["plan_profile"].items():
            print(f"  {name:<22}{entry['call_us']:8.1f}" + "".join(f"{us:10.2f}" for us in entry["steps_us"].values()))
    for name, rows in (rank0.get("profile") or {}).items():
        print(f"\n=== where the host time goes: {name} at {profile_tokens} tokens (rank 0, cProfile, µs per call) ===")
        print(f"  {'own':>7} {'cumul':>7} {'calls':>6}  function")
        for where, count, own, cumulative in rows:
            print(f"  {own:7.2f} {cumulative:7.2f} {count:6.2f}  {where}")
    if args.json:
        from tokenyard.tools.bench.report import git_commit

        device = torch.cuda.get_device_name() if not args.cpu else "cpu"
        with open(args.json, "w") as f:
            json.dump({"commit": os.environ.get("TOKENYARD_COMMIT") or git_commit(), "device": device,
                       "date": datetime.date.today().isoformat(), "num_ranks": num_ranks,
                       "backend": "reference (gloo)" if args.cpu else "cuda",
                       "settings": {"iters": args.iters, "rounds": args.rounds, "warmup": WARMUP,
                                    "hidden": 7168 if not args.cpu else 512,
                                    "num_experts": 256 if not args.cpu else 16, "num_topk": 8 if not args.cpu else 4,
                                    "dispatch_dtype": "fp8", "buffer": "defaults (check_inputs as configured)",
                                    "timing": "time.perf_counter around each of back-to-back calls, median over the "
                                              "rounds (NOTE [rounds of calls])"},
                       "calls": calls, "rounds_rank0": rank0.get("rounds"), "steps": rank0.get("steps"),
                       "first_calls": {"num_calls": EARLY_CALLS, "tokens": early},
                       "call_vs_kernel": rank0.get("call_vs_kernel"), "plan_profile": rank0.get("plan_profile"),
                       "profile": rank0.get("profile")}, f, indent=1)


if __name__ == "__main__":
    main()
