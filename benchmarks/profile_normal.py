"""Per-kernel GPU time of the CUDA backend's normal mode, from the PyTorch profiler (CUPTI).

    python benchmarks/profile_normal.py [--num_ranks 4] [--sms 24]

Prints, on rank 0, the average time of each kernel for a cached dispatch and a combine at the
DeepSeek-V3 setting, and where the host's time of those calls goes. A diagnostic; the figures that count are
the benchmark's (python -m tokenyard.tools.bench), and the launch choices are swept by `run_device.sh tuning`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu import spawn  # noqa: E402  (sets the NVLink-multicast-off variables first)


HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8  # DeepSeek-V3's


def deepseek_inputs(num_tokens: int):
    """This rank's inputs of `num_tokens` tokens in the DeepSeek-V3 setting (FP8 dispatch, hidden 7168, top-8 of 256,
    uniform routing, seed 7) -> (x, topk_idx, weights)."""
    import torch
    import torch.distributed as dist

    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    return make_rank_inputs(7, num_ranks, num_tokens, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "fp8", device)[rank]


def deepseek_buffer(num_tokens: int):
    """This rank's CUDA Buffer sized for `num_tokens` tokens of the DeepSeek-V3 setting and its inputs
    (`deepseek_inputs`) -> (buffer, x, topk_idx, weights)."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config

    size = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(HIDDEN * 2, dist.get_world_size())
    return (Buffer(dist.group.WORLD, size, 0, backend="cuda", check_inputs=False),) + tuple(deepseek_inputs(num_tokens))


def first_dispatch(buffer, x, topk_idx, weights):
    """The layout and a dispatch that makes the handle, at the Buffer's SM count -> (handle, expert outputs y:
    random bf16 rows, one per received row)."""
    import torch

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                 num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert)
    y = torch.randn(recv_x[0].size(0), HIDDEN, device=recv_x[0].device).to(torch.bfloat16)
    return handle, y


def _profile(num_sms: int, num_tokens: int):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from tokenyard import Buffer

    rank = dist.get_rank()
    buffer, x, topk_idx, weights = deepseek_buffer(num_tokens)
    Buffer.set_num_sms(num_sms)
    handle, y = first_dispatch(buffer, x, topk_idx, weights)
    lines = []
    import time

    for name, call in (("cached dispatch", lambda: buffer.dispatch(x, handle=handle)),
                       ("combine", lambda: buffer.combine(y, handle))):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            call()
        lines.append(f"host time per {name} call (enqueue only): {(time.perf_counter() - start) / 20 * 1e6:.1f} us")
        torch.cuda.synchronize()
        dist.barrier()
    # Where the host time of a call goes (Python functions, by own time), for the calls above.
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        buffer.dispatch(x, handle=handle)
        buffer.combine(y, handle)
    profiler.disable()
    torch.cuda.synchronize()
    dist.barrier()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    lines.append("--- cProfile of 20 cached dispatch + combine calls (host) ---")
    lines += [line for line in text.getvalue().splitlines() if line.strip()][-16:]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            dist.barrier()
            buffer.dispatch(x, handle=handle)
            dist.barrier()
            buffer.combine(y, handle)
        torch.cuda.synchronize()
    lines.append(f"--- kernels at {num_sms} SMs, rank {rank} ---")
    for event in prof.key_averages():
        if event.device_time_total > 0 and "nccl" not in event.key.lower():
            lines.append(f"{event.key[:60]:60s} {event.count:4d} x {event.device_time_total / max(event.count, 1):9.1f} us")
    buffer.destroy()
    return "\n".join(lines)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--num_ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--num_tokens", type=int, default=4096)
    args = parser.parse_args()
    for text in spawn.run(args.num_ranks, _profile, args.sms, args.num_tokens)[:1]:
        print(text)


if __name__ == "__main__":
    main()
