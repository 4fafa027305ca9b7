"""The physical limit of the same run: every GPU copying into all its peers at once (all SMs), with a
measurement kernel of the benchmark's own (include/tokenyard_bench/copy_limit.cuh, outside the library's
include tree)."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ...jit.spec import KernelSpec, Param
from ...plan import workspace

# NOTE [copy patterns] in copy_limit.cuh
COPY_PATTERNS = {"interleaved": 0, "peer_major": 1, "bulk": 2, "pull": 3, "pull_peer_major": 4, "tma": 5}
# Writers that do more or other than copy to the peers (benchmarks/copy_patterns.py --patterns): never the copy
# limit. tma_add adds into the peers' memory; tma_self also stores every piece into the own rank's memory; tma_load
# only loads.
PROBE_PATTERNS = {"tma_add": 6, "tma_self": 7, "tma_load": 8}
PATTERNS = {**COPY_PATTERNS, **PROBE_PATTERNS}  # copy_limit.cuh's CopyPattern, by name
# The patterns of TMA writers, which take a shape (TMA_WRITERS): "tma" and every probe (copy_limit.cuh's from kCopyTma).
TMA_PATTERNS = ("tma", *PROBE_PATTERNS)
THREADS = 512
# The "tma" pattern's writers: (warps a block, stages of shared memory per warp, their size), template arguments
# of every pattern (the others ignore them); the copy limit's is one writer of four 32 KB stages a block.
TMA_WRITERS = (1, 4, 32 << 10)
BULK_SHARED_BYTES = THREADS // 32 * 2 * 4096  # the "bulk" pattern: two 4 KB stages per warp
# Launches back to back in one timed sample, so that the ranks' skew after the host barrier and the launch's start
# are a small part of it: timed one launch a sample, the limit moved from run to run, at times below NCCL's own rate
# (benchmarks/results/normal.md, "The copy limit, launches back to back").
REPEATS = 8


def shared_bytes(pattern: str, tma: tuple = TMA_WRITERS) -> int:
    """The dynamic shared memory a pattern's launch takes (the "tma" writers' stages with a barrier each)."""
    warps, stages, stage_bytes = tma
    tma_bytes = warps * stages * (stage_bytes + 8)
    return tma_bytes if pattern in TMA_PATTERNS else BULK_SHARED_BYTES if pattern == "bulk" else 0


_INCLUDE_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


@functools.lru_cache(maxsize=None)
def copy_to_peers(num_ranks: int, pattern: str = "interleaved", tma: tuple = TMA_WRITERS) -> KernelSpec:
    return KernelSpec(
        "tokenyard_bench/copy_limit.cuh", "tokenyard::bench::copy_to_peers",
        (num_ranks, THREADS, PATTERNS[pattern], *tma),
        (Param("const int4*", "src"), Param("int64_t", "num_int4"), Param("uint8_t* const*", "peer_bases"),
         Param("int", "rank"), Param("int64_t", "offset_bytes"), Param("int64_t", "stride_bytes")),
        THREADS, include_root=_INCLUDE_ROOT)


def every_kernel():
    """Every pattern at 2, 4 and 8 ranks, for CI's compile check."""
    for ranks in (2, 4, 8):
        for pattern in PATTERNS:
            yield copy_to_peers(ranks, pattern)


def measure_copy_limit_gbps(buffer, num_bytes_per_peer: int, iters: int = 20, warmup: int = 3,
                            pattern: str = "interleaved", num_blocks: int = 0, tma: tuple = TMA_WRITERS,
                            repeats: int = REPEATS) -> float:
    """Egress GB/s per GPU while every rank writes `num_bytes_per_peer` into each peer's buffer.

    Uses the Buffer's normal-mode memory (its rows are overwritten) and every SM of the GPU (or
    `num_blocks` blocks), writing the way `pattern` says (NOTE [copy patterns] in copy_limit.cuh; `tma`: the "tma"
    pattern's writers, TMA_WRITERS' form); the median over `iters` samples, each `repeats` launches back to back
    started after a group barrier.
    """
    backend = buffer.runtime
    ctx = backend.ctx
    num_ranks = ctx.num_ranks
    control = workspace.normal_control_bytes(num_ranks)
    stride = (ctx.num_nvl_bytes - control) // num_ranks // 16 * 16
    num_bytes = min(num_bytes_per_peer, stride) // 16 * 16
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=ctx.device)
    kernel = backend._kernel(copy_to_peers(num_ranks, pattern, tma))
    grid = num_blocks or backend.device_sms
    if pattern in ("peer_major", "pull_peer_major") and grid < num_ranks - 1:
        raise ValueError(f"the peer-major pattern needs a block per peer: {grid} blocks for {num_ranks - 1} peers")
    stream = torch.cuda.current_stream().cuda_stream
    # The launch's arguments, made once: the host builds nothing between the launches a sample times.
    args = dict(shared_bytes=shared_bytes(pattern, tma), src=src.data_ptr(), num_int4=num_bytes // 16,
                peer_bases=backend.normal.bases_tensor.data_ptr(), rank=ctx.rank, offset_bytes=control,
                stride_bytes=stride)
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=ctx.group)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            kernel(grid, stream, **args)
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop) / 1e3 / repeats)
    dist.barrier(group=ctx.group)
    median = sorted(times)[len(times) // 2]
    return (num_ranks - 1) * num_bytes / median / 1e9
