"""A DeepSeek-V3 routed MoE layer step (issue 52): tokenyard against the expert GEMMs alone and an all-to-all
dispatcher.

Two steps, each timed in four variants on every rank:

    gemm_only           the grouped expert GEMMs on the rows a dispatch delivers, already in place: the floor
    tokenyard           train: ElasticBuffer's expanded dispatch/combine through tokenyard.layers.autograd, forward
                        and backward (NOTE [expanded train layer]); decode: low-latency dispatch/combine, forward only
    tokenyard_overlap   two micro-batches of the step's tokens, timed per micro-batch (NOTE [whole micro-batches]):
                        train with async_with_compute_stream on the communication stream while the other
                        micro-batch's GEMMs run; decode with return_recv_hook (SGLang's two-batch overlap). On CPU
                        the calls are synchronous, so this variant runs but overlaps nothing.
    all_to_all          Megatron's all-to-all token dispatcher, written here (megatron-core is not a dependency):
                        permute by expert, exchange counts, exchange rows, regroup by expert; the reverse to combine

Before anything is timed, every variant is checked against the same layer run through the reference backend
(`check_step`): the rows each local expert receives bit for bit, the output (and for train the input gradient)
within bf16 rounding. The JSON also records each step's bytes and FLOPs and the floors they imply at the
datasheet's HBM and tensor-core speeds, and on GPUs how much the GEMMs slow down while the step's communication
runs beside them (`gemm_slowdown`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import BenchError, moe_report, moe_trace

# SXM datasheet figures: HBM bandwidth and dense bf16 tensor-core throughput (no sparsity), by the GPU's name; the
# floors are the H100's (the issue's GPU) where the name is none of these, and on CPU ranks.
DATASHEETS = {"H100": ("H100 SXM datasheet: HBM3", 3.35e12, 989e12),
              "H200": ("H200 SXM datasheet: HBM3e", 4.8e12, 989e12)}
BF16_BYTES = 2
# NOTE [whole micro-batches]
# The overlapped train step runs `--micro_batches` micro-batches (MICRO_BATCHES unless given), decode MICRO_BATCHES,
# each of the step's tokens (the same ones, so each is checked against the reference), and their time is per
# micro-batch: micro-batches as a trainer's gradient accumulation or a server's concurrent batches have them, each
# already paying for its own pass over the experts' weights. Halves of one step's tokens, the first design, make each
# half read (decode) or write (train, the weight gradients) every local expert's weights again, which costs more than
# the overlap hides (benchmarks/results/moe_step.md). More micro-batches in train leave the first dispatch and the
# last combine, which nothing overlaps, a smaller share of each; decode keeps two, SGLang's two-batch overlap (the
# low-latency buffer holds two calls' data, as DeepEP's).
MICRO_BATCHES = 2
SWEEP_NUM_SMS = 24  # the second SM count for the overlapped step and the GEMM slowdown


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One step's problem, per rank: tokens, the layer's sizes, the routing."""
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int


# DeepSeek-V3's routed MoE (issue 52); decode uses 32 experts: the per-rank load of a 32-way deployment.
GPU_SHAPES = {"train": StepShape(4096, 7168, 2048, 256, 8), "decode": StepShape(128, 7168, 2048, 32, 8)}
CPU_SHAPES = {"train": StepShape(64, 256, 128, 16, 4), "decode": StepShape(32, 256, 128, 16, 4)}


@dataclasses.dataclass(frozen=True)
class MoeStepSettings:
    num_ranks: int
    steps: tuple
    shapes: Dict[str, StepShape]
    iters: int
    warmup: int
    gpu: bool
    seed: int
    timeout_s: float
    micro_batches: int = MICRO_BATCHES
    json: Optional[str] = None
    plot: Optional[str] = None
    corrupt: Optional[str] = None  # a variant whose output is perturbed, so a test can see the check fail


def parse(argv: Optional[Sequence[str]], num_gpus: int, prog: str = "benchmarks/moe_step.py") -> MoeStepSettings:
    """The command line; shapes default to DeepSeek-V3's on GPUs and to CPU_SHAPES on the CPU."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--num_ranks", type=int, default=None, help="default: every GPU, or 2 on the CPU")
    parser.add_argument("--step", choices=["train", "decode", "both"], default="both")
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU even where GPUs are")
    for name in dataclasses.fields(StepShape):
        parser.add_argument(f"--{name.name}", type=int, default=None, help="override both steps' value")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20 on GPU, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5 on GPU, 1 on CPU)")
    parser.add_argument("--seed", type=int, default=None, help="default: fresh, from the clock")
    parser.add_argument("--micro_batches", type=int, default=MICRO_BATCHES,
                        help="micro-batches in flight in the overlapped train step (NOTE [whole micro-batches])")
    parser.add_argument("--timeout_s", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write the record here")
    parser.add_argument("--plot", default=None, help="draw each step's four bars into this PNG (matplotlib)")
    args = parser.parse_args(argv)
    if args.micro_batches < 2:
        parser.error(f"--micro_batches {args.micro_batches}: an overlap needs 2 or more")
    gpu = num_gpus > 0 and not args.cpu
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(StepShape)
                 if getattr(args, f.name) is not None}
    shapes = {step: dataclasses.replace(shape, **overrides) for step, shape in shapes.items()}
    num_ranks = args.num_ranks or (num_gpus if gpu else 2)
    for step, shape in shapes.items():
        if shape.num_experts % num_ranks or shape.num_topk > shape.num_experts:
            parser.error(f"{step}: {shape.num_experts} experts, top-{shape.num_topk}, on {num_ranks} ranks")
    steps = ("train", "decode") if args.step == "both" else (args.step,)
    return MoeStepSettings(num_ranks, steps, shapes, args.iters or (20 if gpu else 3),
                           args.warmup if args.warmup is not None else (5 if gpu else 1), gpu,
                           args.seed if args.seed is not None else time.time_ns() % (1 << 31), args.timeout_s,
                           args.micro_batches, args.json, args.plot)


# -- bytes, FLOPs and their floors ---------------------------------------------------------------------------

def step_counts(shape: StepShape, num_ranks: int, train: bool, device_name: str = "H100") -> dict:
    """Per rank and step, for balanced routing (T*K rows reach each rank's L = E/R experts in all).

    Forward: two GEMMs, ``6*H*I`` FLOPs per row, reading the L experts' weights (``3*H*I`` bf16 each) once.
    Backward adds the input and the weight gradients (twice the forward FLOPs), reads the weights again and
    writes their gradients. Activations: each row's input, its gate/up output and the down output, read or
    written once per GEMM.
    """
    rows = shape.num_tokens * shape.num_topk
    num_local = shape.num_experts // num_ranks
    flop = 6 * shape.hidden * shape.intermediate * rows
    weight_bytes = num_local * 3 * shape.hidden * shape.intermediate * BF16_BYTES
    activation_bytes = rows * (2 * shape.hidden + 3 * shape.intermediate) * BF16_BYTES
    if train:
        flop, weight_bytes, activation_bytes = 3 * flop, 3 * weight_bytes, 3 * activation_bytes
    hbm_bytes = weight_bytes + activation_bytes
    sheet, hbm_per_s, flop_per_s = next((DATASHEETS[gpu] for gpu in DATASHEETS if gpu in device_name),
                                        DATASHEETS["H100"])
    return {"rows_per_rank": rows, "flop": flop, "hbm_bytes": hbm_bytes, "weight_bytes": weight_bytes,
            "dispatch_bytes": rows * shape.hidden * BF16_BYTES,
            "hbm_floor_us": hbm_bytes / hbm_per_s * 1e6, "tensor_core_floor_us": flop / flop_per_s * 1e6,
            "floors_from": f"{sheet} {hbm_per_s / 1e12:g} TB/s, {flop_per_s / 1e12:g} TFLOP/s dense bf16"}


# -- the experts --------------------------------------------------------------------------------------------

def gemm_kind(device: torch.device) -> str:
    """The experts' GEMMs (bf16): tokenyard.layers.moe.grouped_gemm_kind."""
    from ...layers.moe import grouped_gemm_kind

    return grouped_gemm_kind(device, torch.bfloat16)


def grouped_experts(x: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, kind: str,
                    row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DeepSeek-V3's SwiGLU experts on rows grouped by expert: tokenyard.layers.moe.gated_experts_on_groups with
    silu."""
    from ...layers.moe import gated_experts_on_groups

    return gated_experts_on_groups(x, ends, gate_up, down, F.silu, kind, row_weights)


def packed_experts(packed_x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Low-latency layout ``[L, R*M, H]`` -> ``[L, R*M, H]`` with one batched GEMM over every slot.

    Decision: bmm over the padded slots, as a masked grouped GEMM would, reads no count on the host, so the
    step captures in a CUDA graph; slots past a count hold garbage that the combine never reads.
    """
    gate, up = torch.bmm(packed_x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, down.transpose(1, 2))


def experts_on_received(recv_x, recv_topk_idx, recv_topk_weights, weights, kind, counts=None):
    """The layer's expert part on normal-mode rows (tokenyard.layers.moe.experts_on_received with silu): -> (out in
    recv_x's dtype, the rows each expert received, their counts), the rows for the dispatch check."""
    from ...layers.moe import experts_on_received as on_received

    gate_up, down = weights
    return on_received(recv_x, recv_topk_idx, recv_topk_weights, gate_up, down, F.silu, kind, counts)


# -- one rank's step variants --------------------------------------------------------------------------------

class Rank:
    """What one rank holds for a step: its inputs, its experts, the buffers and the calls of each variant."""

    def __init__(self, step: str, shape: StepShape, settings: MoeStepSettings, device: torch.device):
        import torch.distributed as dist

        from ...buffer import Buffer
        from ...elastic import ElasticBuffer
        from ...layers import moe

        self.step, self.shape, self.device = step, shape, device
        self.group = dist.group.WORLD
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        self.num_local = shape.num_experts // self.num_ranks
        self.kind = gemm_kind(device)
        # Drawn on the device: DeepSeek-V3's 64 local experts are 2.8 G values, too slow to draw on the host.
        seed = settings.seed * 1009 + self.rank + (7 if step == "decode" else 0)
        draw = dict(generator=torch.Generator(device=device).manual_seed(seed), device=device)
        T, H, I, E, K = shape.num_tokens, shape.hidden, shape.intermediate, shape.num_experts, shape.num_topk
        self.x = torch.randn(T, H, **draw).to(torch.bfloat16)
        self.topk_idx = torch.rand(T, E, **draw).topk(K, dim=1).indices
        self.topk_weights = torch.rand(T, K, **draw).softmax(dim=1)
        self.grad_out = torch.randn(T, H, **draw).to(torch.bfloat16)
        gate_up = torch.randn(self.num_local, 2 * I, H, dtype=torch.bfloat16, **draw) * H ** -0.5
        down = torch.randn(self.num_local, H, I, dtype=torch.bfloat16, **draw) * I ** -0.5
        self.gate_up = gate_up.requires_grad_(step == "train")
        self.down = down.requires_grad_(step == "train")
        self.corrupt = settings.corrupt
        self.micro_batches = settings.micro_batches if step == "train" else MICRO_BATCHES
        self.releases: List[Callable[[], None]] = []  # what destroy() frees beside the buffers
        if step == "train":
            self.buffer = ElasticBuffer(self.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
            self.reference = moe.make_buffer(self.group, H, T, torch.bfloat16, backend="reference")
        else:
            hint = Buffer.get_low_latency_rdma_size_hint(T, H, self.num_ranks, E)
            self.buffer = Buffer(self.group, 0, hint, low_latency_mode=True, num_qps_per_rank=self.num_local)
            self.reference = Buffer(self.group, 0, hint, low_latency_mode=True, num_qps_per_rank=self.num_local,
                                    backend="reference")

    def destroy(self) -> None:
        for release in self.releases:
            release()
        self.buffer.destroy()
        self.reference.destroy()

    def _finish(self, variant: str, out: torch.Tensor) -> torch.Tensor:
        if variant == self.corrupt:  # the test's way to see a wrong variant fail the check
            out = out.clone()
            out[0, 0] += 1.0 + out[0, 0].abs() * 4
        return out

    # -- train -----------------------------------------------------------------------------------------------

    def train_reference(self):
        """The oracle: the reference backend's V1 dispatch and combine through tokenyard.layers.autograd, the rows
        grouped by expert in the layer, the experts one GEMM each; forward and backward. -> (out, x.grad, the rows
        each expert received and their counts)."""
        from ...layers import autograd

        x = self.x.detach().requires_grad_()
        recv_x, recv_idx, recv_w, per_expert, handle = autograd.dispatch(self.reference, x, self.topk_idx,
                                                                         self.topk_weights, self.shape.num_experts)
        expert_out, grouped, counts = experts_on_received(recv_x, recv_idx, recv_w, (self.gate_up, self.down),
                                                          "loop over experts", per_expert)
        out, _ = autograd.combine(self.reference, expert_out, handle)
        out.backward(self.grad_out)
        return out.detach(), x.grad, (grouped.detach(), counts)

    def train_layer(self):
        """NOTE [expanded train layer]
        The layer as DeepEP V2 serves it: tokenyard.layers.autograd's expanded dispatch delivers each received
        (token, local expert) pair as a row, grouped by expert; the grouped GEMMs read them in place, bounded by
        the handle's per-expert ends (on the GPU); each row's weight scales its activation; the expanded combine
        sums a token's rows in our kernels. No sort, gather or index_add of the layer's own remains, nor their
        backward (they took more time than the communication: benchmarks/results/moe_step.md). Forward and
        backward; -> (out, x.grad, the rows each expert received and their counts)."""
        from ...buffer import Buffer
        from ...layers import autograd

        x = self.x.detach().requires_grad_()
        recv_x, recv_w, handle, _ = autograd.expanded_dispatch(self.buffer, x, self.topk_idx, self.topk_weights,
                                                               self.shape.num_experts, num_sms=Buffer.num_sms)
        y = grouped_experts(recv_x, handle.psum_num_recv_tokens_per_expert, self.gate_up, self.down, self.kind,
                            recv_w)
        out, _, _ = autograd.expanded_combine(self.buffer, y, handle, num_sms=Buffer.num_sms)
        out = self._finish("tokenyard", out)
        out.backward(self.grad_out)
        counts = handle.num_recv_tokens_per_expert_list
        return out.detach(), x.grad, (recv_x.detach()[:sum(counts)], counts)

    def train_overlap(self):
        """`micro_batches` micro-batches of the step's tokens (NOTE [whole micro-batches]) through the
        expanded layout (NOTE [expanded train layer]); each communication call runs on the communication stream
        (async_with_compute_stream) while another micro-batch's GEMMs run, in the order of NOTE [overlap order].
        -> the micro-batches' outputs and input gradients, stacked.

        NOTE [overlap order]
        A call is launched before the GEMMs it overlaps: a kernel launched after them waits for the SMs they hold.
        The communication stream runs its calls in the order they are launched, so a call queued behind one that
        waits for GEMMs waits too. Every micro-batch's dispatch goes first (a fresh dispatch makes the host wait for
        its counts; the first one's transfer runs meanwhile); then, micro-batch by micro-batch, its forward GEMMs,
        its combine and the cached dispatch of its output gradient, as a schedule that interleaves one
        micro-batch's backward with the next one's forward (1F1B, DualPipe) has that gradient; then each
        backward's GEMMs and its combine. So only the first dispatches (the host waits for each one's counts before
        it queues the first GEMMs) and the last combine run with no GEMMs beside them. (With every gradient's
        dispatch after the last forward combine, that combine and the first of them ran alone too:
        benchmarks/results/moe_step.md, "The overlap order".)"""
        from ...buffer import Buffer

        buffer, E = self.buffer, self.shape.num_experts
        on_comm = dict(async_with_compute_stream=True, allocate_on_comm_stream=True, num_sms=Buffer.num_sms)
        batches = []
        for _ in range(self.micro_batches):
            recv_x, _, recv_w, handle, event = buffer.dispatch(self.x, self.topk_idx, self.topk_weights,
                                                               num_experts=E, do_expand=True, do_handle_copy=False,
                                                               **on_comm)
            batches.append(dict(recv_x=recv_x, recv_w=recv_w, handle=handle, event=event))
        for b in batches:
            b["event"].current_stream_wait()
            b["recv_x"] = b["recv_x"].detach().requires_grad_()
            b["y"] = grouped_experts(b["recv_x"], b["handle"].psum_num_recv_tokens_per_expert, self.gate_up,
                                     self.down, self.kind, b["recv_w"])
            b["out"], _, b["event"] = buffer.combine(b["y"].detach(), b["handle"], **on_comm)
            b["grad_y"], _, _, _, b["grad_event"] = buffer.dispatch(self.grad_out, handle=b["handle"], do_expand=True,
                                                                    **on_comm)
        for b in batches:
            b["grad_event"].current_stream_wait()
            b["y"].backward(b["grad_y"])
            b["grad_x"], _, b["grad_event"] = buffer.combine(b["recv_x"].grad, b["handle"], **on_comm)
        for b in batches:
            b["event"].current_stream_wait()
            b["grad_event"].current_stream_wait()
        out = self._finish("tokenyard_overlap", torch.cat([b["out"] for b in batches]))
        return out, torch.cat([b["grad_x"] for b in batches]), None

    # -- the all-to-all dispatcher (both steps) -------------------------------------------------------------

    def all_to_all_layer(self, train: bool):
        """Megatron's all-to-all token dispatcher: one row per (token, expert) pair, permuted by expert; counts
        exchanged, then rows (all_to_all_single, differentiable through torch.distributed.nn); the received
        (source rank, expert) chunks regrouped by expert; the GEMMs; the reverse; unpermute with the weights.
        -> (out, x.grad or None, (rows per local expert, counts))."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        from ...layers.moe import group_ends

        R, L, K = self.num_ranks, self.num_local, self.shape.num_topk
        x = self.x.detach().requires_grad_(train)
        flat_expert = self.topk_idx.flatten()
        order = torch.sort(flat_expert, stable=True).indices  # permute: (token, k) pairs by expert
        permuted = x[order // K]
        counts = torch.bincount(flat_expert, minlength=self.shape.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # exchange counts
        send_split = counts.view(R, L).sum(1).tolist()
        recv_by_rank = recv_counts.view(R, L)  # [source rank, local expert]
        recv_split = recv_by_rank.sum(1).tolist()
        received = all_to_all_single(permuted.new_empty(sum(recv_split), permuted.size(1)), permuted,
                                     recv_split, send_split, group=self.group)
        # Regroup chunks (source rank s, expert l) to (l, s), as Megatron's sort_chunks_by_idxs.
        chunk_rows = received.split(recv_by_rank.flatten().tolist())
        to_expert = [s * L + e for e in range(L) for s in range(R)]
        grouped = torch.cat([chunk_rows[c] for c in to_expert])
        per_expert = recv_by_rank.sum(0).tolist()
        y = grouped_experts(grouped, group_ends(per_expert, x.device), self.gate_up, self.down, self.kind)
        back_chunks = y.split(recv_by_rank.t().flatten().tolist())  # (l, s) chunks back to (s, l)
        back = torch.cat([back_chunks[e * R + s] for s in range(R) for e in range(L)])
        returned = all_to_all_single(back.new_empty(permuted.shape), back, send_split, recv_split, group=self.group)
        weighted = returned.float() * self.topk_weights.flatten()[order][:, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, order // K, weighted)
        out = self._finish("all_to_all", out.to(torch.bfloat16))
        if not train:
            return out, None, (grouped, per_expert)
        out.backward(self.grad_out)
        return out.detach(), x.grad, (grouped.detach(), per_expert)

    # -- decode ---------------------------------------------------------------------------------------------

    def decode_layer(self, buffer, variant: str = "tokenyard"):
        """Low-latency dispatch, the experts on the packed rows, low-latency combine; -> (out, None, rows)."""
        T, E = self.shape.num_tokens, self.shape.num_experts
        packed_x, packed_count, handle, _, _ = buffer.low_latency_dispatch(self.x, self.topk_idx, T, E,
                                                                           use_fp8=False)
        expert_out = packed_experts(packed_x, self.gate_up, self.down)
        out = buffer.low_latency_combine(expert_out, self.topk_idx, self.topk_weights, handle)[0]
        return self._finish(variant, out), None, (packed_x, packed_count, handle)

    def decode_overlap(self):
        """SGLang's two-batch overlap, two micro-batches of the step's tokens (NOTE [whole
        micro-batches]): each call returns at once with return_recv_hook and the receive runs when the hook is
        called, so one micro-batch's GEMMs run while another's transfers are in flight."""
        T, E = self.shape.num_tokens, self.shape.num_experts
        sends = [self.buffer.low_latency_dispatch(self.x, self.topk_idx, T, E, use_fp8=False, return_recv_hook=True)
                 for _ in range(self.micro_batches)]
        combines = []
        for packed_x, _, handle, _, receive in sends:
            receive()
            expert_out = packed_experts(packed_x, self.gate_up, self.down)
            combines.append(self.buffer.low_latency_combine(expert_out, self.topk_idx, self.topk_weights, handle,
                                                            return_recv_hook=True))
        for _, _, receive in combines:
            receive()
        return self._finish("tokenyard_overlap", torch.cat([c[0] for c in combines])), None, None

    def communication(self) -> Callable[[], object]:
        """The step's communication alone, for the GEMM slowdown: train, a cached expanded dispatch of the tokens
        and the expanded combine of what arrived (at the current SM count: the handle is made here); decode, the
        low-latency pair."""
        buffer, T, E = self.buffer, self.shape.num_tokens, self.shape.num_experts
        if self.step == "decode":
            def decode():
                packed_x, _, handle, _, _ = buffer.low_latency_dispatch(self.x, self.topk_idx, T, E, use_fp8=False)
                buffer.low_latency_combine(packed_x, self.topk_idx, self.topk_weights, handle)
            return decode
        from ...buffer import Buffer

        num_sms = Buffer.num_sms
        handle = buffer.dispatch(self.x, self.topk_idx, self.topk_weights, num_experts=E, do_expand=True,
                                 num_sms=num_sms)[3]

        def train():
            buffer.combine(buffer.dispatch(self.x, handle=handle, do_expand=True, num_sms=num_sms)[0], handle,
                           num_sms=num_sms)
        return train

    def copy_engine_communication(self) -> Tuple[Callable[[], object], int]:
        """The bytes `communication` moves in train, each peer's rows of a dispatch and of a combine (bf16),
        written into the peer's memory by copy engines (cudaMemcpyAsync over CUDA IPC: no SM held), for the GEMMs'
        slowdown beside a transfer that holds no SM (benchmarks/results/moe_step.md, "Copy engines").
        Nothing tells the peer that its rows arrived. -> (one call, the bytes it writes to peers)."""
        from ...backends.cuda import memory, runtime

        owner = (self.topk_idx // self.num_local).unsqueeze(2) == torch.arange(self.num_ranks, device=self.device)
        row_bytes = self.shape.hidden * BF16_BYTES
        rows = owner.any(1).sum(0).tolist()  # the tokens this rank sends to each rank
        peers = [p for p in range(self.num_ranks) if p != self.rank]
        slot = 2 * self.shape.num_tokens * row_bytes  # each source's own slot of every rank's buffer, any rows fit
        source = torch.randint(0, 256, (slot,), dtype=torch.uint8, device=self.device)
        ctx = self.buffer.buffer.runtime.ctx  # the ElasticBuffer's group, as its CUDA backend holds it
        shared = memory.SymmetricBuffer(ctx, self.num_ranks * slot)
        views = {p: runtime.byte_view(shared.bases[p] + self.rank * slot, slot, self.device) for p in peers}

        def release():  # NOTE [symmetric lifetime]
            torch.cuda.synchronize(self.device)
            shared.unmap_peers()
            memory.meet(ctx)
            shared.free()
        self.releases.append(release)

        def transfers():
            for p in peers:
                n = rows[p] * row_bytes
                views[p][:n].copy_(source[:n])  # the dispatch's rows
                views[p][n:2 * n].copy_(source[n:2 * n])  # the combine's
        return transfers, sum(2 * rows[p] * row_bytes for p in peers)

    # -- the variants, the check, the floor ------------------------------------------------------------------

    def variants(self) -> Dict[str, Callable[[], tuple]]:
        train = self.step == "train"
        if train:
            return {"tokenyard": self.train_layer, "tokenyard_overlap": self.train_overlap,
                    "all_to_all": lambda: self.all_to_all_layer(True)}
        return {"tokenyard": lambda: self.decode_layer(self.buffer), "tokenyard_overlap": self.decode_overlap,
                "all_to_all": lambda: self.all_to_all_layer(False)}

    def gemm_only(self, rows: torch.Tensor, counts: List[int]) -> Callable[[], object]:
        """The GEMMs alone on `rows` (grouped by expert, `counts` each); train adds their backward."""
        from ...layers.moe import group_ends

        if self.step == "decode":
            packed = rows  # the low-latency layout, [L, R*M, H]
            return lambda: packed_experts(packed, self.gate_up, self.down)
        rows = rows.detach().requires_grad_()
        grad = torch.ones_like(rows)
        ends = group_ends(counts, rows.device)

        def forward_backward():
            grouped_experts(rows, ends, self.gate_up, self.down, self.kind).backward(grad)
        return forward_backward


def run_step(step: str, settings: MoeStepSettings, device: torch.device) -> dict:
    """One step on this rank: check every variant, then time them; -> this rank's record of the step."""
    from ...buffer import Buffer
    from .moe_check import check_step
    from .timing import Timer

    rank = Rank(step, settings.shapes[step], settings, device)
    train = step == "train"
    if train:
        want = rank.train_reference()
    else:
        want = rank.decode_layer(rank.reference, "reference")
    if train:
        rank.gate_up.grad = rank.down.grad = None
    variants = rank.variants()
    checks = check_step(rank, {name: call() for name, call in variants.items()}, want)
    rank.corrupt = None
    if train:
        gemm_rows, gemm_counts = want[2]
    else:
        gemm_rows, gemm_counts = want[2][0], None
    calls = {"gemm_only": rank.gemm_only(gemm_rows, gemm_counts), **variants}
    graphs = capture_decode(calls) if settings.gpu and not train else {}
    timer = Timer(rank.group, device)
    medians = timer.medians(list(calls.values()), settings.iters, settings.warmup)
    record = {f"{name}_us": seconds * 1e6 for name, seconds in zip(calls, medians)}
    record["tokenyard_overlap_us"] /= rank.micro_batches  # per micro-batch (NOTE [whole micro-batches])
    overlap_by_num_sms = {Buffer.num_sms: record["tokenyard_overlap_us"]}
    slowdown, communication = {}, {}  # per SM count: the GEMMs' slowdown beside the communication, its time alone
    if settings.gpu:  # nothing runs beside anything on CPU ranks
        key = Buffer.num_sms if train else "low_latency"
        slowdown[key], communication[key] = gemm_slowdown(timer, calls["gemm_only"], rank.communication(),
                                                          settings.iters)
    if settings.gpu and train:  # the normal-mode kernels' SM count matters only on GPUs
        default_num_sms = Buffer.num_sms
        try:
            Buffer.set_num_sms(SWEEP_NUM_SMS)
            overlap_by_num_sms[SWEEP_NUM_SMS] = timer.medians([variants["tokenyard_overlap"]], settings.iters,
                                                              settings.warmup)[0] * 1e6 / rank.micro_batches
            slowdown[SWEEP_NUM_SMS], communication[SWEEP_NUM_SMS] = gemm_slowdown(
                timer, calls["gemm_only"], rank.communication(), settings.iters)
        finally:
            Buffer.set_num_sms(default_num_sms)
        transfers, record["copy_engine_bytes"] = rank.copy_engine_communication()
        slowdown["copy_engines"], communication["copy_engines"] = gemm_slowdown(timer, calls["gemm_only"], transfers,
                                                                                settings.iters)
    if settings.gpu:  # NOTE [step breakdown]: one traced step per variant, the overlapped one's micro-batches together
        record["breakdown"] = {}
        for name, call in calls.items():
            timer.barrier()
            record["breakdown"][name] = moe_trace.breakdown(moe_trace.traced_kernels(call, device))
    record.update(num_sms=Buffer.num_sms, tokenyard_overlap_us_by_num_sms=overlap_by_num_sms,
                  gemm_slowdown_by_num_sms=slowdown or None, communication_us_by_num_sms=communication or None,
                  checks=checks, micro_batches=rank.micro_batches,
                  cuda_graph=graphs or None, gemm=rank.kind if train else "torch.bmm over padded slots")
    rank.destroy()
    return record


def gemm_slowdown(timer, gemm: Callable[[], object], communication: Callable[[], object],
                  iters: int) -> Tuple[float, float]:
    """How much longer the GEMMs take while the step's communication runs beside them (the price of the SMs its
    kernels hold): `communication` enqueued back to back on a side stream right after the GEMMs, as many calls as
    outlast them twice on every rank; the median GEMM time so over the median alone, minus 1. -> (that, the median
    time of one `communication` call alone, in µs)."""
    import torch.distributed as dist

    current = torch.cuda.current_stream(timer.device)
    side = torch.cuda.Stream(timer.device)

    def median_ms(call, beside=None) -> float:
        times = []
        for _ in range(iters):
            timer.barrier()
            side.wait_stream(current)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            if beside is not None:  # enqueued after the GEMMs, so that they start together
                with torch.cuda.stream(side):
                    beside()
            current.wait_stream(side)
            torch.cuda.synchronize(timer.device)
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    alone, once = median_ms(gemm), median_ms(communication)
    calls = torch.tensor([2 * math.ceil(alone / once) + 2], device=timer.device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=timer.group)  # every rank makes the same calls

    def communications():
        for _ in range(int(calls.item())):
            communication()
    return median_ms(gemm, communications) / alone - 1, once * 1e3


def capture_decode(calls: Dict[str, Callable[[], object]]) -> Dict[str, str]:
    """Decode is timed as CUDA-graph replays (issue 52), each call captured once; the all-to-all reads its
    split sizes on the host, so it runs eagerly, as Megatron's does. -> per call, "graph" or why not."""
    from .timing import capture_graph

    how = {"all_to_all": "eager: split sizes are read on the host"}
    for name in ("gemm_only", "tokenyard", "tokenyard_overlap"):
        try:
            graph, _ = capture_graph(calls[name])
        except Exception as exc:  # noqa: BLE001 - timed eagerly, and the record says why
            how[name] = f"eager: capture failed ({type(exc).__name__}: {exc})"
            continue
        calls[name] = graph.replay
        how[name] = "graph"
    return how


def rank_main(settings: MoeStepSettings) -> dict:
    """Every requested step on this rank (started by tokenyard.tools.launch.run_on_ranks)."""
    import warnings

    import torch.distributed as dist

    # torch.distributed.nn's all_to_all_single warns that it is deprecated; it is kept because it is
    # differentiable and runs on gloo (this file's CPU runs) as on NCCL.
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

    device = torch.device("cuda", torch.cuda.current_device()) if settings.gpu else torch.device("cpu")
    records = {step: run_step(step, settings, device) for step in settings.steps}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return {step: merge_ranks([r[step] for r in gathered]) for step in settings.steps}


def merge_ranks(records: List[dict]) -> dict:
    """The slowest rank's time of each variant (a step ends when its last rank does); the rest from rank 0."""
    merged = dict(records[0])
    for key in merged:
        if key.endswith("_us"):
            merged[key] = max(r[key] for r in records)
    for by_num_sms in ("tokenyard_overlap_us_by_num_sms", "gemm_slowdown_by_num_sms", "communication_us_by_num_sms"):
        if merged[by_num_sms]:
            merged[by_num_sms] = {n: max(r[by_num_sms][n] for r in records) for n in merged[by_num_sms]}
    return merged


def build_record(settings: MoeStepSettings, steps: dict, commit: Optional[str], date: str) -> dict:
    device = torch.cuda.get_device_name(0) if settings.gpu else "cpu (gloo ranks, reference backend)"
    doc = {"commit": commit, "device": device, "date": date, "num_gpus": settings.num_ranks if settings.gpu else 0,
           "num_ranks": settings.num_ranks, "seed": settings.seed, "iters": settings.iters,
           "settings": {step: dataclasses.asdict(settings.shapes[step]) for step in settings.steps},
           "overlap": None if settings.gpu else "on the CPU every call is synchronous: the overlap variant runs "
                                                "its calls but overlaps nothing"}
    for step, record in steps.items():
        doc[step] = dict(record, counts=step_counts(settings.shapes[step], settings.num_ranks, step == "train", device))
    return doc


def run(settings: MoeStepSettings) -> dict:
    """Start the ranks, check and time; -> the record. Raises BenchError naming the rank that failed."""
    from .. import launch
    from .report import git_commit

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        steps = launch.run_on_ranks(settings.num_ranks, rank_main, settings, use_cuda=settings.gpu,
                                    timeout_s=settings.timeout_s)[0]
    except launch.RanksFailed as exc:
        raise BenchError(str(exc)) from None
    return build_record(settings, steps, git_commit(), date)


def main(argv: Optional[Sequence[str]] = None, prog: str = "benchmarks/moe_step.py") -> int:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    settings = parse(argv, num_gpus, prog)
    try:
        doc = run(settings)
    except BenchError as exc:
        print(f"{prog}: {exc}")
        return 1
    moe_report.print_table(doc)
    if settings.json:
        with open(settings.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {settings.json}")
    if settings.plot:
        moe_report.plot(doc, settings.plot)
        print(f"wrote {settings.plot}")
    return 0
