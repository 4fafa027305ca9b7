"""The physical limit of the same run: every GPU copying into all its peers at once, with every SM by a
measurement kernel of the benchmark's own (include/tokenyard_bench/copy_limit.cuh, outside the library's
include tree) or by the copy engines."""

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
# Writers without a kernel: the copy engines (no SM), cudaMemcpyAsync into each peer's memory over its CUDA IPC
# mapping, one peer after another on one stream, or each peer on a stream of its own at once
# (`measure_copy_engines_gbps`). The copy limit's candidates as COPY_PATTERNS are (issue 50: the fastest writer
# there is), and what a transport on copy engines would reach (issue 52).
ENGINE_PATTERNS = {"copy_engines": False, "copy_engines_streams": True}  # name -> a stream per peer
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
    control, stride, num_bytes, src = _slices(buffer, num_bytes_per_peer)
    kernel = backend._kernel(copy_to_peers(ctx.num_ranks, pattern, tma))
    grid = num_blocks or backend.device_sms
    if pattern in ("peer_major", "pull_peer_major") and grid < ctx.num_ranks - 1:
        raise ValueError(f"the peer-major pattern needs a block per peer: {grid} blocks for {ctx.num_ranks - 1} peers")
    stream = torch.cuda.current_stream().cuda_stream
    # The launch's arguments, made once: the host builds nothing between the launches a sample times.
    args = dict(shared_bytes=shared_bytes(pattern, tma), src=src.data_ptr(), num_int4=num_bytes // 16,
                peer_bases=backend.normal.bases_tensor.data_ptr(), rank=ctx.rank, offset_bytes=control,
                stride_bytes=stride)
    return _egress_gbps(ctx, lambda: kernel(grid, stream, **args), num_bytes, iters, warmup, repeats)


def measure_copy_engines_gbps(buffer, num_bytes_per_peer: int, pattern: str = "copy_engines", iters: int = 20,
                              warmup: int = 3, repeats: int = REPEATS) -> float:
    """Egress GB/s per GPU while every rank's copy engines write `num_bytes_per_peer` into each peer's buffer, at
    the place the kernels' patterns write (ENGINE_PATTERNS), as `measure_copy_limit_gbps` times them."""
    from ...backends.cuda import runtime

    ctx = buffer.runtime.ctx
    control, stride, num_bytes, src = _slices(buffer, num_bytes_per_peer)
    bases = buffer.runtime.normal.bases
    peers = [q for q in range(ctx.num_ranks) if q != ctx.rank]
    dsts = [runtime.byte_view(bases[q] + control + ctx.rank * stride, num_bytes, ctx.device) for q in peers]
    streams = [torch.cuda.Stream(ctx.device) for _ in peers] if ENGINE_PATTERNS[pattern] else []

    def copy():
        if not streams:
            for dst in dsts:
                dst.copy_(src, non_blocking=True)
            return
        current = torch.cuda.current_stream()
        for dst, stream in zip(dsts, streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return _egress_gbps(ctx, copy, num_bytes, iters, warmup, repeats)


def _slices(buffer, num_bytes_per_peer: int):
    """(control bytes, a source rank's stride, bytes to each peer, random source bytes): where every rank writes in
    each peer's normal-mode buffer, a slice per source rank after the control words."""
    ctx = buffer.runtime.ctx
    control = workspace.normal_control_bytes(ctx.num_ranks)
    stride = (ctx.num_nvl_bytes - control) // ctx.num_ranks // 16 * 16
    num_bytes = min(num_bytes_per_peer, stride) // 16 * 16
    return control, stride, num_bytes, torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=ctx.device)


def _egress_gbps(ctx, launch, num_bytes: int, iters: int, warmup: int, repeats: int) -> float:
    """The median over `iters` samples (after `warmup`) of `repeats` launches back to back after a group barrier,
    as GB/s of `num_bytes` to each peer."""
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=ctx.group)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            launch()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop) / 1e3 / repeats)
    dist.barrier(group=ctx.group)
    median = sorted(times)[len(times) // 2]
    return (ctx.num_ranks - 1) * num_bytes / median / 1e9
