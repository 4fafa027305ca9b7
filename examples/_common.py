"""What the examples share: finding tokenyard in this checkout, their command line, starting the ranks."""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "tokenyard")):
    sys.path.insert(0, _ROOT)  # run from a checkout: use it rather than an installed copy

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tokenyard.tools.launch import free_port, init_rank, leave_group  # noqa: E402


def parse_args(description: str, num_experts: int, steps: int) -> argparse.Namespace:
    """--ranks (default: every GPU where there are two or more, else 2 CPU ranks), --steps, --backend."""
    parser = argparse.ArgumentParser(description=description)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--ranks", type=int, default=min(num_gpus, 8) if num_gpus >= 2 else 2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--backend", default="auto", help="tokenyard backend: auto, reference or cuda")
    args = parser.parse_args()
    args.use_cuda = num_gpus >= 2
    if args.use_cuda and args.ranks > num_gpus:
        parser.error(f"--ranks {args.ranks} exceeds the {num_gpus} GPUs")
    if num_experts % args.ranks:
        parser.error(f"--ranks must divide the {num_experts} experts")
    return args


def _rank_main(rank: int, fn, num_ranks: int, port: int, use_cuda: bool, steps: int, backend: str) -> None:
    device = init_rank(rank, num_ranks, port, use_cuda)
    try:
        fn(rank, num_ranks, device, steps, backend)
    finally:
        leave_group()  # after fn has returned and its Buffers are gone: NOTE [gloo threads at exit]


def spawn(fn, args: argparse.Namespace) -> None:
    """fn(rank, num_ranks, device, steps, backend) on every rank, in a group (NCCL on GPUs, else gloo) that
    this joins before fn and leaves after it."""
    mp.spawn(_rank_main, args=(fn, args.ranks, free_port(), args.use_cuda, args.steps, args.backend),
             nprocs=args.ranks)
