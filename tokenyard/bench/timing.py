"""Time a round of calls many times on this rank and return each call's median, in seconds.

On CPU each call is timed with ``time.perf_counter`` after a ``dist.barrier``, so all ranks start it
together. On GPU each call is timed with CUDA events on the current stream; before it, a 256 MB write
evicts the L2 cache (50-60 MB on H100/H200), so no call finds its inputs there, and a barrier lines the
ranks up. Calls of one round run in order (``dispatch`` then ``combine``), so a call may use the
previous call's outputs, as low-latency combine needs the latest dispatch's handle.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 << 20


class Timer:
    """Median times of calls on one rank of `group`, on `device` (CPU or one GPU)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device
        self.gpu = device.type == "cuda"
        self._scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.gpu else None

    def barrier(self) -> None:
        if self.gpu:
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
