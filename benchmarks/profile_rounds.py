"""Where a normal-mode call in rounds spends its time: the GPU timeline of one fresh dispatch and one
combine on rank 0, from the PyTorch profiler (CUPTI), with every kernel's start, length and the gap before it.

    python benchmarks/profile_rounds.py [--num_ranks 2] [--num_tokens 32768] [--budget_bytes 536870912]

DeepSeek-V3 shapes (hidden 7168, top-8 of 256, FP8 dispatch, bf16 combine) at 24 SMs on a Buffer of
`--budget_bytes`, so the calls run in rounds (NOTE [rounds] in tokenyard/rounds.py). A diagnostic: the
figures that count are benchmarks/bounded.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu import spawn  # noqa: E402  (sets the NVLink-multicast-off variables first)


def _timeline(prof) -> list:
    """``(name, start_us, length_us)`` of every GPU kernel and copy, in start order."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events]


def _profile(num_tokens: int, budget_bytes: int):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from tokenyard import Buffer
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, topk_idx, weights = make_rank_inputs(7, num_ranks, num_tokens, 7168, 256, 8, "uniform", "fp8", device)[rank]
    Buffer.set_num_sms(24)
    buffer = Buffer(dist.group.WORLD, budget_bytes, 0, backend="cuda", check_inputs=False)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 256)
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    recv_x, _, _, _, handle, _ = dispatch()
    y = torch.randn(recv_x[0].size(0), 7168, device=device).to(torch.bfloat16)
    lines = [f"{handle.rounds.num_rounds} rounds of {handle.rounds.round_tokens} tokens, {y.size(0)} rows received"]
    for name, call in (("dispatch", dispatch), ("combine", lambda: buffer.combine(y, handle))):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        dist.barrier()
        timeline = _timeline(prof)
        if not timeline:
            continue
        first, end = timeline[0][1], timeline[0][1]
        lines.append(f"-- {name}: kernel, start (us from the first), length, gap before it")
        for kernel, start, length in timeline:
            lines.append(f"{kernel[:70]:70s} {start - first:9.1f} {length:8.1f} {max(0.0, start - end):8.1f}")
            end = max(end, start + length)
        lines.append(f"-- {name}: {end - first:.1f} us from the first kernel's start to the last one's end")
    buffer.destroy()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_ranks", type=int, default=2)
    parser.add_argument("--num_tokens", type=int, default=32768)
    parser.add_argument("--budget_bytes", type=int, default=1 << 29)
    args = parser.parse_args()
    for line in spawn.run(args.num_ranks, _profile, args.num_tokens, args.budget_bytes)[0]:
        print(line)


if __name__ == "__main__":
    main()
