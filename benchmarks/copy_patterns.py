"""How fast can a GPU write to all its peers at once, by how the writes are issued (NOTE [copy patterns]).

    python benchmarks/copy_patterns.py [--num_ranks 4] [--blocks 4,8,24,0] [--bytes_per_peer N] [--repeats 8]
                                       [--json OUT.json]
                                       [--patterns tma --tma_shapes senders]

Every rank writes one rank's share of the DeepSeek-V3 normal-mode bytes (4096 tokens of 7168 FP8 channels
with scales, ~30 MB, or `--bytes_per_peer`) into each peer's buffer at the same time, with each pattern of
tokenyard/tools/bench/include/tokenyard_bench/copy_limit.cuh and each grid size (0: every SM), and prints the
egress GB/s per GPU (the slowest rank's median; for the pull patterns, which read from the peers, the ingress). The
benchmark's copy limit is the fastest pattern with every SM (its JSON's copy_limit_method names it); issue 50 asks
for the 8-block figures. Small sizes time the launch and the ranks' skew more than the copy.

The "tma" pattern's writers (warps a block x stages per warp x stage bytes; the copy limit's is 1x4x32768) may be
given as `--tma_shapes`, or `senders`: the copy limit's writer, smaller pieces of it, and the shapes of the
normal-mode senders (the dispatch: 12 warps of four 4800-byte stages; the combine: 3 warps of 14336-byte rows) and
their neighbours, each storing every piece to every peer as a sender stores a row: what each shape reaches when
routing costs nothing (issue 50). Keys: pattern/blocks, and "tma WxSxB/blocks" for a shape not the copy limit's.
Three writers not run by default take `--tma_shapes` too: `--patterns tma_add` adds bf16 into the peers' memory by
bulk reduce-adds where "tma" stores (what a combine summing its rows at the destination could send), `--patterns
tma_self` stores every piece into the own rank's memory as well (whether an SM's local writes, such as the
dispatch's own rows and the combine's sums, share the rate of its writes to the peers), and `--patterns tma_load`
only loads (the rate the SMs read at; its figure is the bytes it would have sent over the time) (issue 50). So do
the copy engines, without a kernel or an SM (key "copy_engines/no SM": one stream, one peer after another;
"copy_engines_streams/no SM": a stream per peer, all at once), what a transport on copy engines would reach
(issue 52).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard


# `--tma_shapes senders` (kernels.data_stage_bytes: the dispatch's FP8 rows of 7168 with scales in pieces of 4800
# bytes), within the block's 227 KiB.
SENDER_SHAPES = ((1, 4, 32768), (1, 4, 16384), (1, 4, 8192), (1, 4, 4800), (3, 4, 14336), (3, 2, 14336),
                 (4, 4, 14336), (6, 4, 9600), (12, 4, 4800), (12, 2, 4800), (12, 4, 2400))


def runs(patterns, tma_shapes):
    """(key prefix, pattern, tma shape) of every measurement of a block count."""
    from tokenyard.tools.bench.copy_limit import TMA_PATTERNS, TMA_WRITERS

    for pattern in patterns:
        for shape in (tma_shapes if pattern in TMA_PATTERNS else (TMA_WRITERS,)):
            name = pattern if shape == TMA_WRITERS else f"{pattern} {'x'.join(map(str, shape))}"
            yield name, pattern, shape


def rank_main(blocks, num_bytes_per_peer: int, patterns, tma_shapes, repeats: int):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.tools.bench.copy_limit import ENGINE_PATTERNS, measure_copy_engines_gbps, measure_copy_limit_gbps

    num_ranks = dist.get_world_size()
    num_nvl_bytes = ((num_ranks + 1) * num_bytes_per_peer >> 20) + 64 << 20  # room for a slice per rank
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes, 0, backend="cuda")
    result = {}
    for pattern in (p for p in patterns if p in ENGINE_PATTERNS):  # no SM: one figure, not one per block count
        result[f"{pattern}/no SM"] = measure_copy_engines_gbps(buffer, num_bytes_per_peer, pattern, repeats=repeats)
    for name, pattern, shape in runs([p for p in patterns if p not in ENGINE_PATTERNS], tma_shapes):
        for num_blocks in blocks:
            result[f"{name}/{num_blocks or 'all'}"] = measure_copy_limit_gbps(
                buffer, num_bytes_per_peer, pattern=pattern, num_blocks=num_blocks, tma=shape, repeats=repeats)
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=None)
    parser.add_argument("--blocks", default="4,8,24,0")
    parser.add_argument("--bytes_per_peer", type=int, default=0,
                        help="bytes to each peer (default: one rank's share of the normal-mode setting)")
    parser.add_argument("--patterns", default="", help="comma-separated (default: every pattern)")
    parser.add_argument("--tma_shapes", default="", help="WxSxB,... or senders (default: the copy limit's writer)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="launches back to back a timed sample (default: the benchmark's, copy_limit.REPEATS)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    from tokenyard.tools.bench import bandwidth
    from tokenyard.tools.bench.copy_limit import COPY_PATTERNS, REPEATS, TMA_WRITERS
    from tokenyard.tools.bench.report import git_commit
    from tokenyard.tools.launch import run_on_ranks

    num_ranks = args.num_ranks or torch.cuda.device_count()
    num_bytes = args.bytes_per_peer or round(4096 * bandwidth.row_bytes(7168, fp8=True))
    blocks = [int(b) for b in args.blocks.split(",")]
    patterns = args.patterns.split(",") if args.patterns else list(COPY_PATTERNS)
    tma_shapes = (SENDER_SHAPES if args.tma_shapes == "senders" else
                  [tuple(int(n) for n in s.split("x")) for s in args.tma_shapes.split(",")] if args.tma_shapes
                  else [TMA_WRITERS])
    repeats = args.repeats or REPEATS
    per_rank = run_on_ranks(num_ranks, rank_main, blocks, num_bytes, patterns, tma_shapes, repeats, use_cuda=True)
    gbps = {key: min(r[key] for r in per_rank) for key in per_rank[0]}
    print(f"egress GB/s per GPU, {num_ranks} ranks, {num_bytes / 1e6:.1f} MB to each peer, {repeats} launches a sample "
          "(slowest rank):")
    for key, value in gbps.items():
        print(f"  {key:<28} {value:7.1f}")
    if args.json:
        num_gpus = torch.cuda.device_count()
        device = f"{torch.cuda.get_device_name()} x {min(num_gpus, num_ranks)}"
        if num_ranks > num_gpus:  # ranks sharing GPUs under MPS write to the same GPU's memory, not over NVLink
            device += f" shared by {num_ranks} ranks (MPS)"
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": device,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python benchmarks/copy_patterns.py " + " ".join(sys.argv[1:]),
                       "num_ranks": num_ranks, "bytes_per_peer": num_bytes, "repeats": repeats,
                       "egress_gbps": gbps}, f, indent=1)


if __name__ == "__main__":
    main()
