"""How fast TMA writers of the normal-mode senders' shapes write to every peer at once (issue 50).

    python benchmarks/tma_pieces.py [--num_ranks 4] [--blocks 8,24] [--json OUT.json]

The copy limit's TMA writer is one thread a block with four 32 KB stages (325 GB/s on 4 H100s with 8 blocks, issue
50's probe); the senders of tokenyard's kernels are more warps a block with smaller stages (the dispatch: 12 warps of
four 4800-byte stages; the combine: 3 warps of 14336-byte rows). Each writer here (`copy_limit.cuh`'s "tma" pattern
with TMA_WRITERS set) takes every n-th piece of one rank's share of the DeepSeek-V3 normal-mode bytes and stores it to
every peer, as the senders store a row, with nothing else to do: what each shape can reach when routing costs
nothing. Prints the egress GB/s per GPU (the slowest rank's median) per shape and grid size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

# (warps a block, stages per warp, stage bytes): the copy limit's writer and smaller pieces of it, then the senders'
# shapes (kernels.data_stage_bytes: the dispatch's FP8 rows of 7168 with scales in pieces of 4800 bytes) and
# neighbours of them within the block's 227 KiB.
SHAPES = ((1, 4, 32768), (1, 4, 16384), (1, 4, 8192), (1, 4, 4800),
          (3, 4, 14336), (3, 2, 14336), (4, 4, 14336), (6, 4, 9600), (12, 4, 4800), (12, 2, 4800), (12, 4, 2400))


def rank_main(blocks, num_bytes_per_peer: int):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.bench.copy_limit import measure_copy_limit_gbps

    num_ranks = dist.get_world_size()
    num_nvl_bytes = ((num_ranks + 1) * num_bytes_per_peer >> 20) + 64 << 20  # room for a slice per rank
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes, 0, backend="cuda")
    result = {}
    for shape in SHAPES:
        for num_blocks in blocks:
            result[f"{'x'.join(map(str, shape))}/{num_blocks}"] = measure_copy_limit_gbps(
                buffer, num_bytes_per_peer, pattern="tma", num_blocks=num_blocks, tma=shape)
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=None)
    parser.add_argument("--blocks", default="8,24")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    from tokenyard.tools.bench import bandwidth
    from tokenyard.tools.bench.report import git_commit
    from tokenyard.tools.launch import run_on_ranks

    num_ranks = args.num_ranks or torch.cuda.device_count()
    num_bytes = round(4096 * bandwidth.row_bytes(7168, fp8=True))
    blocks = [int(b) for b in args.blocks.split(",")]
    per_rank = run_on_ranks(num_ranks, rank_main, blocks, num_bytes, use_cuda=True)
    gbps = {key: min(r[key] for r in per_rank) for key in per_rank[0]}
    print(f"egress GB/s per GPU, {num_ranks} ranks, {num_bytes / 1e6:.1f} MB to each peer (slowest rank); "
          "shape: warps x stages x stage bytes / blocks")
    for key, value in gbps.items():
        print(f"  {key:<20} {value:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": f"{torch.cuda.get_device_name()} x {num_ranks}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python benchmarks/tma_pieces.py " + " ".join(sys.argv[1:]),
                       "num_ranks": num_ranks, "bytes_per_peer": num_bytes, "egress_gbps": gbps}, f, indent=1)


if __name__ == "__main__":
    main()
