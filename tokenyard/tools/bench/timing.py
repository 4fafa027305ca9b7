"""Time a round of calls many times on this rank and return each call's median, in seconds.

On CPU each call is timed with ``time.perf_counter`` after a ``dist.barrier``, so all ranks start it
together. On GPU each call is timed with CUDA events on the current stream; before it, a 256 MB write
evicts the L2 cache (50-60 MB on H100/H200), so no call finds its inputs there, and a barrier lines the
ranks up. Calls of one round run in order (``dispatch`` then ``combine``), so a call may use the
previous call's outputs, as low-latency combine needs the latest dispatch's handle.

Three times per call on GPU. `medians`: CUDA events around the call after a barrier, so the host's work
before its first kernel counts too (the GPU idles behind the barrier meanwhile). `back_to_back_medians`:
the same events with no barrier between calls, as DeepEP's harness times them (its ``bench``: flush, events,
call, over and over): the host enqueues the next call while the GPU still runs the last, so a call's time
is its GPU time unless its host work is longer. `kernel_medians`: the summed GPU time of the call's own
kernels from the PyTorch profiler (CUPTI), the figure DeepEP's benchmarks report; there the flush is a
``bitwise_not_`` whose kernel marks where each call's kernels begin.

NOTE [aligned start]: a kernel that waits for its peers counts their lateness as its own time. After the
host barrier the ranks' hosts still enqueue the call at different moments (host work per call differs),
so for kernel times each GPU first sleeps (`ALIGN_SLEEP_CYCLES`, ~1 ms, longer than any call's host
work) and then joins an all-reduce: every rank's call then starts when that all-reduce ends, within a few
microseconds of the others, as DeepEP's benchmarks do with a large GEMM before each call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 << 20
ALIGN_SLEEP_CYCLES = 2_000_000  # ~1 ms at H100/H200 clocks (NOTE [aligned start])


class Timer:
    """Median times of calls on one rank of `group`, on `device` (CPU or one GPU)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device
        self.gpu = device.type == "cuda"
        # Whether the group itself moves this device's tensors (NCCL on GPUs): then barriers and the aligned
        # start run on the GPU; over gloo on GPUs (ranks that share a GPU) they are host barriers.
        self.on_device = self.gpu and "nccl" in str(dist.get_backend(group)).lower()
        self._scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.gpu else None

    def barrier(self) -> None:
        if self.on_device:
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def medians(self, steps: Sequence[Callable[[], object]], iters: int, warmup: int) -> List[float]:
        """Run ``warmup`` untimed rounds, then ``iters`` timed rounds of `steps`; one median per step."""
        for _ in range(warmup):
            for step in steps:
                step()
        times = self._cuda_times(steps, iters) if self.gpu else self._cpu_times(steps, iters)
        return [statistics.median(t) for t in times]

    def back_to_back_medians(self, steps: Sequence[Callable[[], object]], iters: int, warmup: int) -> List[float]:
        """Per step: ``warmup`` untimed calls, then ``iters`` calls back to back (one barrier before the
        first); the median of each call's time."""
        medians = []
        for step in steps:
            for _ in range(warmup):
                step()
            medians.append(statistics.median(self._back_to_back_times(step, iters)))
        return medians

    def _back_to_back_times(self, step, iters: int) -> List[float]:
        if not self.gpu:
            self.barrier()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            self.barrier()
            return times
        torch.cuda.synchronize(self.device)
        self.barrier()
        pairs = []
        for _ in range(iters):
            self._scratch.zero_()  # evict L2, as before every timed call
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(self.device)
        self.barrier()
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]

    def _cpu_times(self, steps, iters: int) -> List[List[float]]:
        times = [[] for _ in steps]
        for _ in range(iters):
            for i, step in enumerate(steps):
                self.barrier()
                start = time.perf_counter()
                step()
                times[i].append(time.perf_counter() - start)
        self.barrier()
        return times

    def _cuda_times(self, steps, iters: int) -> List[List[float]]:
        torch.cuda.synchronize(self.device)
        events: List[List[Tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in steps]
        for _ in range(iters):
            for i, step in enumerate(steps):
                self._scratch.zero_()  # evict L2 (see the module docstring)
                self.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                events[i].append((start, end))
        torch.cuda.synchronize(self.device)
        self.barrier()
        return [[start.elapsed_time(end) / 1e3 for start, end in pairs] for pairs in events]


    def kernel_medians(self, steps: Sequence[Callable[[], object]], iters: int,
                       prefixes: Tuple[str, ...]) -> List[Optional[float]]:
        """Per step, the median over `iters` rounds of the summed GPU time (seconds) of the kernels whose
        name starts with one of `prefixes`; None for a step that ran none (or on CPU)."""
        if not self.gpu:
            return [None for _ in steps]
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(self.device)
        self.barrier()
        start_together = torch.ones(1, dtype=torch.float32, device=self.device)
        # acc_events: one profile, one cycle, so nothing to clear; without it torch warns mid-progress-bar
        with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(iters):
                for step in steps:
                    self._scratch.bitwise_not_()  # evicts L2 and marks the start of a call
                    self.barrier()
                    torch.cuda._sleep(ALIGN_SLEEP_CYCLES)  # NOTE [aligned start]
                    if self.on_device:
                        dist.all_reduce(start_together, group=self.group)
                    step()
            torch.cuda.synchronize(self.device)
        self.barrier()
        kernels = gpu_events(prof)
        calls: List[float] = []
        for event in kernels:
            if "bitwise_not" in event.name:
                calls.append(0.0)
            elif calls and event.name.startswith(prefixes):
                calls[-1] += event.time_range.elapsed_us() / 1e6
        if len(calls) != iters * len(steps):  # a marker lost: no figure rather than a wrong one
            return [None for _ in steps]
        per_step = [calls[i::len(steps)] for i in range(len(steps))]
        return [statistics.median(t) if any(t) else None for t in per_step]


def gpu_events(prof) -> list:
    """A PyTorch profile's GPU activity (kernels, copies, fills), in the order it started."""
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def capture_graph(fn: Callable[[], object]):
    """Record ``fn()`` into a CUDA graph after one call on a side stream; -> ``(graph, fn's outputs)``.

    Raises whatever capture raises (an operation that syncs the host, a backend without capture support).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
