"""Which grids of ranks sharing one GPU under MPS are all resident at once (NOTE [shared GPUs] in devices.py).

The low-latency kernels wait in every block for the other ranks' blocks, so a call completes only where
every co-located rank's whole grid is resident together; otherwise it times out. For each rank count this
runs low-latency dispatch + combine calls with grids of several sizes, each rank either seeing the whole GPU
(no MPS share: tokenyard's launchers) or an even MPS share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / ranks),
and counts the trials that completed. Needs the MPS daemon (benchmarks/run_device.sh residency starts it).

    python benchmarks/mps_residency.py --num_ranks 2,4,8 --json mps_residency.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenyard.plan import devices  # noqa: E402
from tokenyard.tools.launch import run_on_ranks  # noqa: E402

SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def _trials(seed: int, grids, num_trials: int):
    """On every rank: per grid (a fraction of the SMs this rank sees, or "budget" for the Buffer's own rule),
    the trials whose calls completed."""
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    visible = torch.cuda.get_device_properties(device).multi_processor_count
    num_tokens, hidden, num_experts, num_topk = 64, 2048, 16 * num_ranks, 4
    x, topk_idx, weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, "uniform",
                                            "bf16", device)[rank]
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    rows = []
    for grid in grids:
        completed, blocks = 0, None
        for _ in range(num_trials):
            buffer = Buffer(dist.group.WORLD, 0, size, backend="cuda", timeout_s=2)
            blocks = buffer.runtime.device_sms if grid == "budget" else max(num_ranks + 1, int(visible * grid))
            buffer.runtime.device_sms = blocks  # the grid of every low-latency launch
            try:
                for _ in range(3):
                    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                        use_fp8=False)
                    buffer.low_latency_combine(recv, topk_idx, weights, handle)
                torch.cuda.synchronize()
                buffer.runtime.check_failures()
                completed += 1
            except Exception:  # noqa: BLE001 - a timeout is the measurement
                torch.cuda.synchronize()
            buffer.destroy()
            dist.barrier()
        rows.append({"grid": blocks, "of": "budget" if grid == "budget" else f"{grid:g} of visible",
                     "completed": completed, "trials": num_trials})
    return {"visible_sms": visible, "share_percent": os.environ.get(SHARE_ENV), "grids": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", default="2,4,8")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "little"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    runs = []
    for num_ranks in (int(n) for n in args.num_ranks.split(",")):
        _, ranks_per_gpu = devices.launch_layout(num_ranks, torch.cuda.device_count())
        for share in (None, 100 // ranks_per_gpu):
            grids = ["budget"] if share is None else [1.0, 0.875, 0.75, "budget"]
            if share is not None:
                os.environ[SHARE_ENV] = str(share)  # the ranks inherit it before CUDA starts in them
            try:
                found = run_on_ranks(num_ranks, _trials, args.seed, grids, args.trials, use_cuda=True, timeout_s=300)
            finally:
                os.environ.pop(SHARE_ENV, None)
            run = {"num_ranks": num_ranks, "ranks_per_gpu": ranks_per_gpu, **found[0]}
            runs.append(run)
            print(f"{num_ranks} ranks, {ranks_per_gpu} per GPU, MPS share {share or 'none'}% "
                  f"({run['visible_sms']} SMs seen): " + ", ".join(
                      f"{g['grid']} blocks ({g['of']}) {g['completed']}/{g['trials']}" for g in run["grids"]),
                  flush=True)
    if args.json:
        from tokenyard.tools.bench.report import git_commit

        document = {"commit": git_commit(), "device": torch.cuda.get_device_name(0),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "seed": args.seed, "call": "3 x (low_latency_dispatch bf16 + low_latency_combine), 64 tokens, "
                    "hidden 2048, top-4 of 16 experts per rank, timeout 2 s", "runs": runs}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
