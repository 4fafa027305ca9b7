"""What every rank runs: make random problems, time each backend's calls and the all-to-all baseline.

Each rank measures its own median time and byte counts per operation (a `bandwidth.Sample`); at the end
the samples of all ranks are gathered, and rank 0 hands them to the launcher, which summarizes them
(report.py). The baseline and each backend get a problem of their own seed (``seed``, ``seed + 1``, ...),
all of the same shape; a backend's low-latency problem has its seed plus `LOW_LATENCY_SEED_OFFSET`.

The same functions serve the in-process API on a group the caller made (tokenyard.Benchmark through
`group_context` and `measure_group`; tokenyard.AutoTuner through `measure_backend`), so the command and
the API time the same calls the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...buffer import Buffer
from ...config import Config
from ...elastic import ElasticBuffer
from ...plan import devices
from ...semantics import quant, routing
from ..launch import init_rank, leave_group
from ..testing import make_rank_inputs
from . import BenchError, bandwidth, timing
from .options import BenchSettings

NORMAL_OPS = ("layout", "dispatch", "dispatch_cached", "combine")  # dispatch: the layout's call and the dispatch
# DeepEP V2's calls (ElasticBuffer), rows as received and expanded per local expert (aligned to EXPAND_ALIGNMENT).
ELASTIC_OPS = ("v2_dispatch", "v2_dispatch_cached", "v2_combine",
               "v2_expand_dispatch", "v2_expand_dispatch_cached", "v2_expand_combine")
EXPAND_ALIGNMENT = 128
LOW_LATENCY_OPS = ("ll_dispatch", "ll_combine", "ll_dispatch_graph", "ll_combine_graph")
HOOK_OP = "ll_hook_graph"  # dispatch and combine with return_recv_hook=True, both hooks called, as one graph
KERNEL_SUFFIX = "_kernel"  # the same operation timed as the GPU time of its kernels (timing.kernel_medians)
BACK_TO_BACK_SUFFIX = "_back_to_back"  # timed with no barrier between calls (timing.back_to_back_medians)
TOKENYARD_KERNELS = ("tokenyard::",)  # NOTE [kernel names] in jit/spec.py
NCCL_ALL_TO_ALL_KERNELS = ("ncclDevKernel_SendRecv", "ncclKernel_SendRecv")
LOW_LATENCY_SEED_OFFSET = 1 << 20  # a backend's low-latency problem: its seed plus this


@dataclasses.dataclass
class Problem:
    """This rank's share of one random problem, plus every rank's send counts."""

    x: object  # a bf16 tensor, or an FP8 (data, scales) tuple
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    counts: List[List[int]]  # counts[s][d]: tokens rank s sends to rank d


def _all_gather_object(group: dist.ProcessGroup, obj) -> list:
    """Every rank's `obj`, in rank order."""
    gathered = [None] * group.size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


@dataclasses.dataclass
class RankContext:
    """Who this rank is, and the settings, group, device and timer every measurement uses."""

    settings: BenchSettings
    rank: int
    num_ranks: int
    group: dist.ProcessGroup
    device: torch.device
    timer: timing.Timer
    topology: devices.Topology  # where every rank works: ranks that share a GPU measure times only

    def all_gather(self, obj) -> list:
        return _all_gather_object(self.group, obj)

    def medians(self, steps) -> List[float]:
        return self.timer.medians(steps, self.settings.iters, self.settings.warmup)

    def kernel_medians(self, steps, prefixes) -> List[Optional[float]]:
        return self.timer.kernel_medians(steps, self.settings.iters, prefixes)

    def back_to_back_medians(self, steps) -> List[float]:
        return self.timer.back_to_back_medians(steps, self.settings.iters, self.settings.warmup)


def with_times(samples: Dict[str, bandwidth.Sample], times, suffix: str) -> Dict[str, bandwidth.Sample]:
    """`samples` plus, for each op timed again another way (`times`, None where not), ``op + suffix`` with
    the same bytes."""
    out = dict(samples)
    for (op, sample), seconds in zip(samples.items(), times):
        if seconds is not None:
            out[op + suffix] = (seconds, *sample[1:])
    return out


def with_other_times(ctx: RankContext, samples: Dict[str, bandwidth.Sample], steps,
                     kernels: Optional[Tuple[str, ...]]) -> Dict[str, bandwidth.Sample]:
    """`samples` (one per step) plus each step's back-to-back time and, with `kernels` (name prefixes), the
    GPU time of those kernels."""
    out = with_times(samples, ctx.back_to_back_medians(steps), BACK_TO_BACK_SUFFIX)
    if kernels is None:
        return out
    return {**out, **with_times(samples, ctx.kernel_medians(steps, kernels), KERNEL_SUFFIX)}


def make_problem(ctx: RankContext, seed: int, num_tokens: int, dtype: str) -> Problem:
    """Every rank builds all ranks' inputs from `seed` (so it knows all counts) and keeps its own."""
    s = ctx.settings
    inputs = make_rank_inputs(seed, ctx.num_ranks, num_tokens, s.hidden_size, s.num_experts, s.num_topk,
                              "uniform", dtype)
    counts = [routing.dispatch_layout(topk_idx, s.num_experts, ctx.num_ranks)[0].tolist()
              for _, topk_idx, _ in inputs]
    x, topk_idx, topk_weights = inputs[ctx.rank]
    x = tuple(t.to(ctx.device) for t in x) if isinstance(x, tuple) else x.to(ctx.device)
    return Problem(x, topk_idx.to(ctx.device), topk_weights.to(ctx.device), counts)


def measure_all_to_all(ctx: RankContext, problem: Problem) -> Dict[str, bandwidth.Sample]:
    """The baseline: one ``all_to_all_single`` with the dispatch's bytes per peer, one with combine's."""
    s, r, counts = ctx.settings, ctx.rank, problem.counts
    row = bandwidth.row_bytes(s.hidden_size, fp8=s.dtype == "fp8")
    bf16_row = bandwidth.row_bytes(s.hidden_size, fp8=False)

    def step(send_bytes: List[int], recv_bytes: List[int]) -> Callable[[], object]:
        send = torch.zeros(sum(send_bytes), dtype=torch.uint8, device=ctx.device)
        recv = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=ctx.device)
        return lambda: dist.all_to_all_single(recv, send, recv_bytes, send_bytes, group=ctx.group)

    dispatch = step([round(n * row) for n in counts[r]], [round(c[r] * row) for c in counts])
    combine = step([round(c[r] * bf16_row) for c in counts], [round(n * bf16_row) for n in counts[r]])
    t_dispatch, t_combine = ctx.medians([dispatch, combine])
    samples = {"dispatch": (t_dispatch, *bandwidth.normal_dispatch_bytes(counts, r, row)),
               "combine": (t_combine, *bandwidth.normal_combine_bytes(counts, r, s.hidden_size))}
    return with_other_times(ctx, samples, [dispatch, combine], NCCL_ALL_TO_ALL_KERNELS)


def _as_bf16(recv_x) -> torch.Tensor:
    """Received rows as the bf16 expert output that combine takes."""
    if isinstance(recv_x, tuple):
        return quant.dequantize_fp8(*recv_x).to(torch.bfloat16)
    return recv_x


def measure_normal(ctx: RankContext, buffer: Buffer, problem: Problem) -> Dict[str, bandwidth.Sample]:
    """Layout + dispatch, dispatch with the cached handle, and combine of the received rows (bf16)."""
    s, p = ctx.settings, problem

    def full_dispatch():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(p.topk_idx, s.num_experts)
        return buffer.dispatch(p.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=p.topk_idx, topk_weights=p.topk_weights)

    recv_x, _, _, _, handle, _ = full_dispatch()
    expert_output = _as_bf16(recv_x)
    steps = [lambda: buffer.get_dispatch_layout(p.topk_idx, s.num_experts), full_dispatch,
             lambda: buffer.dispatch(p.x, handle=handle), lambda: buffer.combine(expert_output, handle)]
    times = ctx.medians(steps)
    row = bandwidth.row_bytes(s.hidden_size, fp8=s.dtype == "fp8")
    dispatch_bytes = bandwidth.normal_dispatch_bytes(p.counts, ctx.rank, row)
    combine_bytes = bandwidth.normal_combine_bytes(p.counts, ctx.rank, s.hidden_size)
    samples = dict(zip(NORMAL_OPS, [(times[0], 0.0, 0.0), (times[1], *dispatch_bytes), (times[2], *dispatch_bytes),
                                    (times[3], *combine_bytes)]))
    return with_other_times(ctx, samples, steps, TOKENYARD_KERNELS if buffer.backend == "cuda" else None)


@contextlib.contextmanager
def elastic_buffer(ctx: RankContext, backend: str) -> Iterator[ElasticBuffer]:
    """The ElasticBuffer V2's calls are timed on, alive only inside the block: V1's calls and the low-latency ones
    are timed with none alive."""
    s = ctx.settings
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=s.num_tokens, hidden=s.hidden_size,
                           num_topk=s.num_topk, backend=backend, check_inputs=False)
    try:
        yield buffer
    finally:
        buffer.destroy()


def measure_elastic(ctx: RankContext, buffer: ElasticBuffer, problem: Problem) -> Dict[str, bandwidth.Sample]:
    """DeepEP V2's dispatch (layout included, weights sent), cached dispatch and combine on `buffer`, with rows
    as received and expanded, at the V1 rows' SM count (not get_theoretical_num_sms: the rows compare the two
    APIs); the bytes counted are the V1 calls' (the same rows cross)."""
    s, p = ctx.settings, problem
    steps = []
    for do_expand in (False, True):
        def dispatch(do_expand=do_expand):
            return buffer.dispatch(p.x, p.topk_idx, p.topk_weights, num_experts=s.num_experts,
                                   num_sms=Buffer.num_sms, expert_alignment=EXPAND_ALIGNMENT if do_expand else 1,
                                   do_expand=do_expand)

        recv_x, _, _, handle, _ = dispatch()
        expert_output = _as_bf16(recv_x)
        steps += [dispatch, lambda h=handle, e=do_expand: buffer.dispatch(p.x, handle=h, do_expand=e),
                  lambda o=expert_output, h=handle: buffer.combine(o, h, num_sms=Buffer.num_sms)]
    times = ctx.medians(steps)
    row = bandwidth.row_bytes(s.hidden_size, fp8=s.dtype == "fp8")
    dispatch_bytes = bandwidth.normal_dispatch_bytes(p.counts, ctx.rank, row)
    combine_bytes = bandwidth.normal_combine_bytes(p.counts, ctx.rank, s.hidden_size)
    samples = dict(zip(ELASTIC_OPS, [(t, *(combine_bytes if op.endswith("combine") else dispatch_bytes))
                                     for op, t in zip(ELASTIC_OPS, times)]))
    return with_other_times(ctx, samples, steps, TOKENYARD_KERNELS if buffer.backend == "cuda" else None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _agree(ctx: RankContext, error: Optional[str]) -> Optional[str]:
    """None if every rank succeeded, else the first failing rank's reason (so all ranks decide alike)."""
    failed = [(r, why) for r, why in enumerate(ctx.all_gather(error)) if why]
    return None if not failed else f"rank {failed[0][0]}: {failed[0][1]}"


def time_graphs(ctx: RankContext, dispatch, combine_with,
                kernels: Optional[Tuple[str, ...]]) -> Tuple[Optional[List[float]], Optional[str]]:
    """Replay times of a CUDA graph of `dispatch` and one of ``combine_with(handle)``, or (None, why);
    with `kernels` (name prefixes), then also the GPU time of those kernels per replay (None where none ran).

    The dispatch graph is replayed once before the combine is captured, so the handle it fills holds real
    values when the combine's warm-up call reads them. Ranks agree after each capture, so no rank replays
    a graph with collectives that another rank failed to record.
    """
    if not ctx.timer.gpu:
        return None, "CUDA graphs need GPUs"
    graphs, error = [], None
    try:
        graph, handle = timing.capture_graph(dispatch)
        graphs.append(graph)
    except Exception as exc:  # noqa: BLE001 - any capture failure is reported, not fatal
        error = _first_line(exc)
    error = _agree(ctx, error)
    if error is None:
        graphs[0].replay()
        try:
            graphs.append(timing.capture_graph(lambda: combine_with(handle))[0])
        except Exception as exc:  # noqa: BLE001
            error = _first_line(exc)
        error = _agree(ctx, error)
    if error is not None:
        torch.cuda.synchronize(ctx.device)
        return None, error
    replays = [g.replay for g in graphs]
    times = ctx.medians(replays)
    return times + (ctx.kernel_medians(replays, kernels) if kernels else [None, None]), None


def time_hook_graph(ctx: RankContext, round_trip, kernels: Optional[Tuple[str, ...]]):
    """Replay time of a CUDA graph of `round_trip` and, with `kernels`, the GPU time of those kernels in it
    -> ``([event seconds, kernel seconds or None], None)`` or ``(None, why)``."""
    if not ctx.timer.gpu:
        return None, "CUDA graphs need GPUs"
    graph, error = None, None
    try:
        graph = timing.capture_graph(round_trip)[0]
    except Exception as exc:  # noqa: BLE001 - any capture failure is reported, not fatal
        error = _first_line(exc)
    error = _agree(ctx, error)
    if error is not None:
        torch.cuda.synchronize(ctx.device)
        return None, error
    return ctx.medians([graph.replay]) + (ctx.kernel_medians([graph.replay], kernels) if kernels else [None]), None


def measure_low_latency(ctx: RankContext, buffer: Buffer, problem: Problem):
    """Low-latency dispatch and combine, eager and as CUDA graphs -> (samples, why graphs are missing)."""
    s, p = ctx.settings, problem
    num_max, use_fp8 = s.num_tokens_low_latency, s.dtype == "fp8"
    num_local_experts = s.num_experts // ctx.num_ranks
    expert_output = torch.randn(num_local_experts, ctx.num_ranks * num_max, s.hidden_size, dtype=torch.float32,
                                device=ctx.device).to(torch.bfloat16)
    latest = {}

    def dispatch():
        handle = buffer.low_latency_dispatch(p.x, p.topk_idx, num_max, s.num_experts, use_fp8=use_fp8)[2]
        latest["handle"] = handle
        return handle

    def combine_with(handle):
        return buffer.low_latency_combine(expert_output, p.topk_idx, p.topk_weights, handle)[0]

    def round_trip_with_hooks():  # the sends return at once; each hook receives (DeepEP's overlap mode)
        *_, handle, _, receive = buffer.low_latency_dispatch(p.x, p.topk_idx, num_max, s.num_experts,
                                                             use_fp8=use_fp8, return_recv_hook=True)
        receive()
        combined, _, receive = buffer.low_latency_combine(expert_output, p.topk_idx, p.topk_weights, handle,
                                                          return_recv_hook=True)
        receive()
        return combined

    buffer.clean_low_latency_buffer(num_max, s.hidden_size, s.num_experts)
    dispatch()
    t_dispatch, t_combine = ctx.medians([dispatch, lambda: combine_with(latest["handle"])])
    dispatch_bytes = bandwidth.low_latency_bytes(p.topk_idx, ctx.rank, num_local_experts,
                                                 bandwidth.row_bytes(s.hidden_size, fp8=use_fp8))
    combine_bytes = bandwidth.low_latency_bytes(p.topk_idx, ctx.rank, num_local_experts,
                                                bandwidth.row_bytes(s.hidden_size, fp8=False))
    kernels = TOKENYARD_KERNELS if buffer.backend == "cuda" else None
    graph_times, graph_error = time_graphs(ctx, dispatch, combine_with, kernels)
    t_graphs = graph_times or [None] * 4
    samples = [(t_dispatch, *dispatch_bytes), (t_combine, *combine_bytes),
               None if t_graphs[0] is None else (t_graphs[0], *dispatch_bytes),
               None if t_graphs[1] is None else (t_graphs[1], *combine_bytes)]
    out = dict(zip(LOW_LATENCY_OPS, samples))
    for op, seconds, sample in zip(LOW_LATENCY_OPS[2:], t_graphs[2:], samples[2:]):
        if seconds is not None:  # the graph replays' kernels
            out[op + KERNEL_SUFFIX] = (seconds, *sample[1:])
    if graph_error is None:
        hook_times, graph_error = time_hook_graph(ctx, round_trip_with_hooks, kernels)
        both_bytes = tuple(a + b for a, b in zip(dispatch_bytes, combine_bytes))
        for op, seconds in zip((HOOK_OP, HOOK_OP + KERNEL_SUFFIX), hook_times or ()):
            if seconds is not None:
                out[op] = (seconds, *both_bytes)
    return out, graph_error


def copy_limit_gbps(ctx: RankContext, buffer: Buffer) -> Tuple[Optional[float], Optional[str]]:
    """NOTE [copy limit] The physical bound: every GPU copying into all peers at once; -> (GB/s, the way).

    Measuring it needs peer memory mapped across processes, which only the CUDA backend has: with it,
    copy_limit.measure_copy_limit_gbps runs with the bytes one rank's tokens take, with every SM, once per way
    of issuing the writes (NOTE [copy patterns] in include/tokenyard_bench/copy_limit.cuh), and so does
    measure_copy_engines_gbps, the copy engines' (no SM; at 2 ranks on 2 H200s faster than every SM writer:
    benchmarks/results/moe_step.md, "Copy engines"), and the fastest counts: the limit is the best rate a plain
    copy reached, never a slow way of copying, and the way that reached it is recorded beside it. Otherwise, and
    at one rank (no peers to copy to), the limit is not measured (None, None).
    """
    if buffer.backend != "cuda" or ctx.num_ranks < 2 or ctx.topology.shares_gpu:
        return None, None
    from .copy_limit import COPY_PATTERNS, ENGINE_PATTERNS, measure_copy_engines_gbps, measure_copy_limit_gbps

    s = ctx.settings
    num_bytes = round(s.num_tokens * bandwidth.row_bytes(s.hidden_size, s.dtype == "fp8"))
    rates = {pattern: measure_copy_limit_gbps(buffer, num_bytes, pattern=pattern) for pattern in COPY_PATTERNS}
    rates.update({pattern: measure_copy_engines_gbps(buffer, num_bytes, pattern) for pattern in ENGINE_PATTERNS})
    best = max(rates, key=rates.get)
    return rates[best], best


def measure_backend(ctx: RankContext, name: str, seed: int, progress) -> dict:
    """Every measurement of one backend, per this run's mode."""
    s = ctx.settings
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(s.num_tokens_low_latency, s.hidden_size, ctx.num_ranks,
                                                           s.num_experts) if s.runs("low_latency") else 0
    num_nvl_bytes = Config(num_max_tokens_per_rank=s.num_tokens).get_nvl_buffer_size_hint(s.hidden_size * 2,
                                                                                           ctx.num_ranks)
    buffer = Buffer(ctx.group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=s.runs("low_latency"),
                    backend=name, check_inputs=False)  # value checks sync the device: not part of the cost
    out = {"samples": {}, "sweep": {}, "graph_error": None, "copy_limit_gbps": None, "copy_limit_method": None,
           "num_sms": Buffer.num_sms if name == "cuda" else None}
    try:
        out["copy_limit_gbps"], out["copy_limit_method"] = copy_limit_gbps(ctx, buffer)
        if s.runs("normal") or s.runs("compare_sm"):
            problem = make_problem(ctx, seed, s.num_tokens, s.dtype)
        if s.runs("normal"):
            progress.set_description(f"{name} normal")
            out["samples"].update(measure_normal(ctx, buffer, problem))
            with elastic_buffer(ctx, name) as elastic:
                out["samples"].update(measure_elastic(ctx, elastic, problem))
            progress.update()
        if s.runs("compare_sm"):  # V1's calls at each SM count, then V2's
            default_num_sms = Buffer.num_sms
            try:
                for num_sms in s.sm_counts:
                    progress.set_description(f"{name} {num_sms} SMs")
                    Buffer.set_num_sms(num_sms)
                    out["sweep"][num_sms] = measure_normal(ctx, buffer, problem)
                    progress.update()
                with elastic_buffer(ctx, name) as elastic:
                    for num_sms in s.sm_counts:
                        progress.set_description(f"{name} V2 {num_sms} SMs")
                        Buffer.set_num_sms(num_sms)
                        out["sweep"][num_sms].update(measure_elastic(ctx, elastic, problem))
            finally:
                Buffer.num_sms = default_num_sms
        if s.runs("low_latency"):
            progress.set_description(f"{name} low-latency")
            problem = make_problem(ctx, seed + LOW_LATENCY_SEED_OFFSET, s.num_tokens_low_latency, "bf16")
            samples, out["graph_error"] = measure_low_latency(ctx, buffer, problem)
            out["samples"].update(samples)
            progress.update()
    finally:
        buffer.destroy()
    return out


def choose_backends(ctx: RankContext) -> List[str]:
    """The requested backends, or every one that runs on all ranks; raises where one cannot run."""
    from ...backends import cuda_available

    cuda_everywhere = all(ctx.all_gather(ctx.device.type == "cuda" and cuda_available()))
    if ctx.settings.backends is None:
        return ["reference", "cuda"] if cuda_everywhere else ["reference"]
    if "cuda" in ctx.settings.backends and not cuda_everywhere:
        raise BenchError("--backends cuda: the CUDA backend cannot run on every rank here "
                         "(tokenyard.backends.cuda_available() is False or there are no GPUs)")
    return list(ctx.settings.backends)


def resolve_backend(ctx: RankContext, name: str) -> str:
    """A backend name as ``Buffer(backend=name)`` settles it: "auto" becomes "cuda" where every rank can run
    the validated CUDA backend, else "reference" (the rule of tokenyard.backends.create_backend)."""
    if name != "auto":
        return name
    from ...backends import cuda_available, cuda_validated

    usable = ctx.device.type == "cuda" and cuda_available() and cuda_validated()
    return "cuda" if all(ctx.all_gather(usable)) else "reference"


def measure_all(ctx: RankContext) -> dict:
    """This rank's samples: baseline and every backend."""
    from tqdm import tqdm

    s = ctx.settings
    backends = choose_backends(ctx)
    steps_per_backend = (s.runs("normal") + s.runs("low_latency") + len(s.sm_counts) * s.runs("compare_sm"))
    with tqdm(total=1 + steps_per_backend * len(backends), disable=s.quiet or ctx.rank != 0, file=sys.stderr,
              desc="all_to_all baseline", leave=False) as progress:
        baseline = {}  # GPU ranks in a group that moves no GPU tensors (sharing GPUs, NCCL refuses): no NCCL
        if ctx.timer.on_device or not ctx.timer.gpu:
            baseline = measure_all_to_all(ctx, make_problem(ctx, s.seed, s.num_tokens, s.dtype))
        progress.update()
        per_backend = {name: measure_backend(ctx, name, s.seed + 1 + i, progress) for i, name in enumerate(backends)}
    device = torch.cuda.get_device_name(ctx.device) if ctx.timer.gpu else "cpu"
    topology = ctx.topology
    return {"device": device, "baseline_backend": dist.get_backend(ctx.group), "baseline": baseline,
            "backends": per_backend, "num_gpus": len({(p.host, p.gpu) for p in topology.places}),
            "ranks_per_gpu": topology.ranks_per_gpu}


def group_context(settings: BenchSettings, group: dist.ProcessGroup) -> RankContext:
    """The context of this rank of `group`, on the device a Buffer takes (NOTE [device rule])."""
    device = devices.default_device()
    topology = devices.gather_topology(group.rank(), lambda obj: _all_gather_object(group, obj), device)
    return RankContext(settings, group.rank(), group.size(), group, device, timing.Timer(group, device), topology)


def from_rank_0(group: dist.ProcessGroup, obj):
    """Rank 0's `obj` on every rank of `group` (a broadcast), so all ranks act on one decision."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


def measure_group(ctx: RankContext, affinity: Optional[dict] = None) -> List[dict]:
    """Every rank's samples (`measure_all`, and its `affinity` binding) on every rank, for `report.build`.

    The one entry point of a measurement, shared by the command's ranks (`run_rank`) and the in-process
    API (tokenyard.Benchmark), so both time the same calls the same way.
    """
    samples = measure_all(ctx)
    samples["affinity"] = affinity
    return ctx.all_gather(samples)


def run_rank(rank: int, num_ranks: int, port: int, settings: BenchSettings) -> Optional[List[dict]]:
    """Join the group, measure, gather; rank 0 returns every rank's samples, the others None.

    With ``--bind`` the rank first binds itself (tokenyard.tools.affinity.bind: one rank per GPU of this machine),
    before it creates threads or communicators, and records the binding with its samples. On GPUs the ranks
    spread over the GPUs as tokenyard.tools.launch.init_rank spreads them (several per GPU where there are fewer).
    """
    binding = None
    if settings.bind:
        from .. import affinity

        binding = affinity.bind(rank, num_ranks).as_dict()
    num_cores = len(binding["cores"]) if binding and "cpu affinity" in binding["applied"] else None
    init_rank(rank, num_ranks, port, settings.gpu, settings.timeout_s, launcher_store=True)  # launch.run's
    torch.set_num_threads(max(1, num_cores or (os.cpu_count() or 1) // num_ranks))  # ranks share the cores
    Buffer.set_num_sms(settings.num_sms)
    try:
        gathered = measure_group(group_context(settings, dist.group.WORLD), binding)
        return gathered if rank == 0 else None
    finally:
        leave_group()  # NOTE [gloo threads at exit]
