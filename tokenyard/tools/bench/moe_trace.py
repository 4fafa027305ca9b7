"""Where a MoE step's time goes (issue 52): one step of a variant traced with the PyTorch profiler (CUPTI), its
kernels sorted into kinds, and the step's span split into what ran and what did not.

NOTE [step breakdown]
Per variant, from the kernels of one traced step (GPU only; intervals in µs):
  span          first kernel start to last kernel end;
  <kind>_us     the time at least one kernel of that kind ran (the union of its intervals, so two micro-batches'
                kernels that overlap count once): gemm (cuBLAS/CUTLASS GEMM kernels), tokenyard (our kernels,
                `tokenyard::...`), nccl, other (the layer's own work around the GEMMs: sorts, gathers, the
                weighting, index_add, casts, and their backward);
  idle_us       the span with no kernel running: the GPU waiting for the host (a host sync, launch gaps);
  communication_alone_us
                the span where tokenyard or NCCL kernels ran and nothing else did: communication not hidden.
The kinds are told apart by kernel name (`KINDS`); a kernel that matches none is "other".
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from .timing import gpu_events

KINDS = (("tokenyard", re.compile(r"tokenyard::")), ("nccl", re.compile(r"nccl", re.IGNORECASE)),
         ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|wgmma|cublas", re.IGNORECASE)))
COMMUNICATION = ("tokenyard", "nccl")

Kernel = Tuple[str, float, float]  # name, start, end (µs)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _union(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(keep: Sequence[Tuple[float, float]], cut: Sequence[Tuple[float, float]]) -> float:
    """The length of `keep` outside `cut` (both unions: sorted, disjoint)."""
    inside, j = 0.0, 0
    for a, b in keep:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            inside += min(b, cut[k][1]) - max(a, cut[k][0])
            k += 1
    return _length(keep) - inside


def breakdown(kernels: Sequence[Kernel]) -> Dict[str, float]:
    """NOTE [step breakdown] of one step's kernels."""
    if not kernels:
        return {}
    by_kind: Dict[str, list] = {}
    for name, start, end in kernels:
        by_kind.setdefault(kind_of(name), []).append((start, end))
    span = max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)
    out = {"span_us": span}
    for kind in [k for k, _ in KINDS] + ["other"]:
        out[f"{kind}_us"] = _length(_union(by_kind.get(kind, [])))
    out["idle_us"] = span - _length(_union((s, e) for _, s, e in kernels))
    talking = _union(i for kind in COMMUNICATION for i in by_kind.get(kind, []))
    working = _union(i for kind, intervals in by_kind.items() if kind not in COMMUNICATION for i in intervals)
    out["communication_alone_us"] = _minus(talking, working)
    return out


def traced_kernels(step: Callable[[], object], device) -> List[Kernel]:
    """The kernels one call of `step` ran on the GPU (the PyTorch profiler's CUDA activity)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:  # as Timer.kernel_medians
        step()
        torch.cuda.synchronize(device)
    return [(e.name, e.time_range.start, e.time_range.end) for e in gpu_events(prof)]
