"""The CUDA backend: JIT kernels over NVLink-mapped buffers of every rank of the group.

Normal mode runs our kernels (include/tokenyard/kernels); low-latency mode those of low_latency.py, or the
reference implementation over the same group where TOKENYARD_LOW_LATENCY_KERNELS=off. The group carries only
host-side exchanges (the peers' IPC handles), so any group serves, its ranks on GPUs of their own or sharing
GPUs under MPS (NOTE [MPS]).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ... import checks, env
from ...errors import BackendUnavailableError, CapacityError, CommTimeoutError, InvalidInputError, TokenyardError
from ...handle import DispatchHandle
from ...jit import load
from ...plan import headers, workspace
from .. import collectives
from ..base import Backend, GroupContext
from ..requests import CombineRequest, DispatchRequest, DispatchResult
from ..waiting import wait_until
from . import heuristics, kernels, plans, runtime

HOST_COUNTS_INTS = 6 + 4096  # NOTE [notify]: the ticket, three counts, the verdict (two), per-local-expert counts
_HOST_EXPERTS_AT = 6
# NOTE [error record] in include/tokenyard/sync.cuh: the kinds of error and the stages, numbered there; the
# stages' names in errors, here.
_ERRORS = headers.enum("sync.cuh", "ErrorKind")
_STAGE_NAMES = {"kStageBarrier": "combine/barrier", "kStageNotify": "dispatch/notify",
                "kStageDispatchRecv": "dispatch/receive", "kStageCombineRecv": "combine/receive",
                "kStageLowLatencyDispatchRecv": "low_latency_dispatch/receive",
                "kStageLowLatencyCombineRecv": "low_latency_combine/receive",
                "kStageLowLatencyCombineWeights": "low_latency_combine/weights",
                "kStageLowLatencyDispatchCounts": "low_latency_dispatch/expert_counts",
                "kStageLowLatencyDispatchSend": "low_latency_dispatch/send",
                "kStageInternodeSignal": "internode/signal", "kStageInternodeBarrier": "internode/barrier",
                "kStageLowLatencyCombineOverlap": "low_latency_combine/overlap"}
_STAGES = {value: _STAGE_NAMES[member] for member, value in headers.enum("sync.cuh", "Stage").items()}
_MASK32 = 0xFFFFFFFF
# From kRecordSignaturesAt, the table of every rank's signature: kMaxRanks rows of kMaxSignatureInts.
_RECORD_SIGNATURES_AT = headers.constant("sync.cuh", "kRecordSignaturesAt")
_MAX_RANKS = headers.constant("layout.cuh", "kMaxRanks")
_INTERNODE_HEAP_SLACK = 64 << 20  # NVSHMEM's heap beyond the internode region: its signals and NVSHMEM's own
_MAX_SIGNATURE_INTS = headers.constant("layout.cuh", "kMaxSignatureInts")
_RECORD_INTS = _RECORD_SIGNATURES_AT + _MAX_RANKS * _MAX_SIGNATURE_INTS

# The inputs and per-call scalars of every dispatch plan (NOTE [call plans]), in the order a run passes them.
DISPATCH_INPUTS = ("x", "x_scales", "topk_idx", "topk_weights", "is_token_in_rank", "num_tokens_per_expert",
                   "call_tokens_per_rank", "call_prefix_matrix", "recv_first", "cursor", "recv_x", "recv_x_scales",
                   "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "check_topk_idx", "check_in_rank",
                   "check_per_rank", "check_per_expert")
# The call numbers the kernels signal with are the GPU's (NOTE [normal-mode call numbers] in
# include/tokenyard/sync.cuh), so a captured call replays with new ones; the host's `ticket` only tells the CPU
# wait which call's counts have arrived.
DISPATCH_SCALARS = ("ticket", "call_num_tokens", "num_worst", "token_base", "num_rows", "check_tokens")
_NUM_WORST, _NUM_ROWS = DISPATCH_SCALARS.index("num_worst"), DISPATCH_SCALARS.index("num_rows")
COMBINE_INPUTS = ("x", "topk_weights", "bias_0", "bias_1", "rank_prefix_matrix", "recv_first", "send_head",
                  "combined_x", "combined_topk_weights")


@dataclasses.dataclass(frozen=True)
class DispatchShape:
    """Everything that decides a dispatch's plans (CudaBackend.dispatch_shape)."""

    num_tokens: int
    hidden: int
    dtype: torch.dtype
    element_size: int
    num_scales: int
    scale_dtype: Optional[torch.dtype]
    scale_strides: Tuple[int, int]
    num_topk: int
    topk_dtype: torch.dtype
    with_weights: bool
    num_experts: int
    expert_alignment: int
    num_rows: Optional[int]            # known before the count exchange: a handle's, or num_worst_tokens
    cached: bool
    num_sms: int
    round_0: bool                      # round 0 of a call in rounds (its placement makes no tensors)
    placed_rows: Optional[int]         # a later round: the whole call's tensors' rows
    placed_by_notify: bool             # the count exchange places the round (recv_first and cursor given)
    whole_call: bool                   # round 0: the whole call's counts are exchanged too
    judged: bool                       # the count exchange judges the whole call's values (request.check)
    judged_topk: bool                  # ... with its topk_idx
    all_weights: bool                  # every slot's weight arrives (DispatchRequest.all_topk_weights)


class SymmetricBuffer:
    """`num_bytes` of device memory on every rank, each rank's mapped into every process by CUDA IPC.

    NOTE [symmetric lifetime]
    A rank zeroes its memory before its IPC handle leaves the process: cudaMemset runs on the legacy stream,
    behind whatever the process queued before, and a peer may write as soon as it holds the handle. A rank
    frees its memory only once no rank maps it (CUDA leaves a cudaFree before every importer's
    cudaIpcCloseMemHandle undefined): at the Buffer's destroy each rank waits for its own kernels, closes its
    mappings of the peers' memory, meets the others once (`meet`), then frees its own. Every rank that calls
    destroy posts that one meeting, met or not, so the group's collectives stay in step for the next Buffer.
    A meeting that fails (a peer gone, or later than its deadline) releases the memory regardless.
    """

    def __init__(self, ctx: GroupContext, num_bytes: int, peers: Optional[Sequence[int]] = None):
        """`peers`: the ranks whose memory this rank maps (default all; the others' bases are 0: ranks of other
        hosts, whose memory CUDA IPC cannot reach)."""
        self.num_bytes = num_bytes
        self.local = runtime.malloc(max(num_bytes, 16))
        runtime.memset(self.local, 0, max(num_bytes, 16))
        torch.cuda.synchronize(ctx.device)
        handles = ctx.all_gather_object(runtime.ipc_handle(self.local))
        mapped = set(range(ctx.num_ranks) if peers is None else peers)
        self.bases = [self.local if r == ctx.rank else runtime.ipc_open(h) if r in mapped else 0
                      for r, h in enumerate(handles)]
        self.rank = ctx.rank
        self.bases_tensor = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
        self.tensor = runtime.byte_view(self.local, num_bytes, ctx.device)

    def unmap_peers(self) -> None:
        for r, base in enumerate(self.bases):
            if r != self.rank and base:
                runtime.ipc_close(base)
        self.bases = [self.local]

    def free(self) -> None:
        runtime.free(self.local)
        self.bases = []


# The destroy meeting's deadline is timeout_s, but no less than this: ranks reach destroy with the host's
# skew (seconds), which a deadline set for the kernels' waits (microseconds where a low-latency decoder
# masks late peers) does not bound.
MEETING_FLOOR_S = 5.0


def meet(ctx: GroupContext) -> None:
    """A bounded barrier of the group (NOTE [symmetric lifetime]); a rank that does not come is not waited for."""
    try:
        ctx.collectives.op = "destroy"
        ctx.collectives.barrier("meeting", max(ctx.timeout_s, MEETING_FLOOR_S))
    except (TokenyardError, RuntimeError, ValueError):  # ValueError: the group was destroyed first
        pass


class CudaBackend(Backend):
    """NOTE [several hosts]
    CUDA IPC maps memory only between processes of one host. On a group over several hosts (real ones, or
    virtual: NOTE [virtual hosts] in devices.py) the CUDA backend therefore runs only what needs no such
    mapping: normal mode on its internode kernels, every byte between nodes through NVSHMEM (nodes default to
    hosts, and a node never spans two). Each rank maps the normal-mode buffers of its own host's ranks only (the
    intranode kernels, which write into every rank's, never run there), and low-latency calls on the low-latency
    kernels given the transport (NOTE [internode low-latency] in include/tokenyard/sync.cuh), their buffer in
    NVSHMEM's heap, the ranks of other nodes reached by puts. Without NVSHMEM the backend does not start on such
    a group, and `backend="auto"` takes the reference backend."""

    name = "cuda"
    # `backend="auto"` picks this backend only once its GPU tests have passed on the device machine
    # (tests/gpu/test_normal_cuda.py: bit for bit against the reference backend; benchmarks/results/ep8.md and
    # shared_gpu.md record where they ran).
    VALIDATED = True
    # The low-latency kernels serve low-latency calls once their GPU tests have passed
    # (tests/gpu/test_low_latency_cuda.py: dispatch bit for bit against the reference, combine bit for bit
    # against its pre-reduced arithmetic, graph replays, a masked rank; benchmarks/results/low_latency.md).
    # TOKENYARD_LOW_LATENCY_KERNELS=off hands the calls to the reference implementation over the same group.
    LOW_LATENCY_KERNELS_VALIDATED = True
    # NOTE [normal-mode call numbers] in include/tokenyard/sync.cuh; tests/gpu/test_graph_capture.py.
    CAPTURES_NORMAL_MODE = True

    @staticmethod
    def available() -> bool:
        if not torch.cuda.is_available():
            return False
        try:
            from ...jit.cache import get_compiler
            from ...jit.driver import libcuda

            libcuda()
            runtime.libcudart()
            get_compiler()
        except Exception as exc:  # noqa: BLE001 - any missing piece means "not here"
            env.log(f"CUDA backend unavailable: {exc}")
            return False
        return True

    def __init__(self, ctx: GroupContext):
        super().__init__(ctx)
        if ctx.num_ranks > _MAX_RANKS:
            raise BackendUnavailableError("the CUDA backend handles up to 32 ranks (one NVLink domain)")
        # NOTE [MPS]: ranks that share a GPU wait in their kernels for each other's kernels, which run at the
        # same time only where MPS serves the GPU; without it they would take turns (time slices of
        # milliseconds), so every wait would crawl or time out. Refused before any buffer is made.
        unserved = ctx.topology.without_mps()
        if unserved:
            raise BackendUnavailableError(
                f"ranks share {'; '.join(unserved)} without MPS: the CUDA backend's kernels wait for each other's "
                "kernels, which run at the same time on a shared GPU only under MPS. Start the MPS daemon "
                "(`nvidia-cuda-mps-control -d`, as root) before the ranks start (no MPS percentage is needed: "
                "tokenyard sizes each rank's grids to fit beside the others'), or give each rank a GPU of its own")
        torch.cuda.init()
        self.device_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        # SMs this rank's grids may fill: every co-located rank's grid must be resident at once (NOTE [shared
        # GPUs] in devices.py); the whole GPU where a rank has one of its own.
        self.device_sms = ctx.topology.sm_budget
        if self.device_sms < heuristics.fewest_sms(ctx.num_ranks):
            visible = ctx.topology.places[ctx.rank].visible_sms
            raise BackendUnavailableError(
                f"rank {ctx.rank} may fill {self.device_sms} SMs (the {visible} it sees over the "
                f"{ctx.topology.ranks_per_gpu} ranks of its GPU), fewer than the {heuristics.fewest_sms(ctx.num_ranks)} "
                "the kernels need: run fewer ranks per GPU, or without an MPS share "
                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), which caps the SMs a rank sees (NOTE [shared GPUs] in devices.py)")
        self.low_latency_buffer = None
        # NOTE [several hosts]: across hosts only the internode kernels run; each rank maps its host's buffers.
        hosts, nodes = ctx.topology.num_hosts, ctx.num_ranks // ctx.topology.ranks_per_node
        missing = self.internode_missing() if hosts > 1 or (ctx.num_rdma_bytes > 0 and nodes > 1) else None
        if hosts > 1 and missing is not None:
            raise BackendUnavailableError(f"the group spans {hosts} hosts, where the CUDA backend runs only its "
                                          f"internode kernels, and here {missing}")
        # NOTE [internode low-latency] (sync.cuh): with ranks on other nodes and NVSHMEM, the low-latency buffer is
        # in its symmetric heap, and ranks of other nodes are reached by puts; else on one host all ranks by IPC.
        internode_low_latency = ctx.num_rdma_bytes > 0 and nodes > 1 and missing is None
        if internode_low_latency:  # every rank takes the same path: NVSHMEM serves one group per process
            from .transport import Transport

            refused = [r for r in ctx.all_gather_object(Transport.refusal(self._group_ranks())) if r]
            if refused:
                env.log(f"low-latency calls run {'on the reference path' if hosts > 1 else 'over CUDA IPC'}: "
                        f"{refused[0]}")
                internode_low_latency = False
        try:
            self.normal = SymmetricBuffer(ctx, ctx.num_nvl_bytes, ctx.topology.same_host() if hosts > 1 else None)
            if ctx.num_rdma_bytes > 0 and hosts == 1 and not internode_low_latency:
                self.low_latency_buffer = SymmetricBuffer(ctx, ctx.num_rdma_bytes)
        except runtime.RuntimeError_ as exc:
            raise BackendUnavailableError(f"could not map the peers' buffers: {exc}") from exc
        self.heap_buffer = None
        if internode_low_latency:
            from .transport import HeapBuffer

            self.heap_buffer = HeapBuffer(self._transport(), ctx.num_rdma_bytes, ctx.device,
                                          ctx.topology.ranks_per_node)
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        # [layout's kLayoutBadIds, the last judged dispatch's mask of bad ranks] (NOTE [input verdict] in checks.py)
        self.verdict = torch.zeros(2, dtype=torch.int32, device=ctx.device)
        self._verdict_experts: Optional[int] = None  # num_experts of the last fresh dispatch, for messages
        self._layout_scratch = {}  # num_experts -> the layout kernel's ticket and totals (`layout_scratch`)
        self.host_record_ptr = runtime.host_alloc_mapped(_RECORD_INTS * 4)
        self.host_record = runtime.int32_view(self.host_record_ptr, _RECORD_INTS)
        self._signatures = {}  # signature tuple -> its ints on the device (NOTE [call signatures], `_signature`)
        self.host_counts_ptr = runtime.host_alloc_mapped(HOST_COUNTS_INTS * 4)
        self.host_counts = runtime.int32_view(self.host_counts_ptr, HOST_COUNTS_INTS)
        self.timeout_ns = int(ctx.timeout_s * 1e9)
        # The rank's CallCounter words (sync.cuh), zero on every rank as the buffers are.
        self.call_counts = torch.zeros(headers.enum("sync.cuh", "CallCounter")["kNumCallCounters"],
                                       dtype=torch.int64, device=ctx.device)
        # NOTE [fast calls]: recorded calls, the dispatches' tickets, the low-latency halves, the streams' order
        self.calls = plans.module().Calls(ctx.device, self.host_record_ptr, weakref.WeakMethod(self.check_failures))
        self._failure: Optional[TokenyardError] = None
        self._kernels = {}  # id(spec) -> (spec, Kernel), see _kernel
        self._plans = plans.PlanCache()
        from ..reference import ReferenceBackend
        from .low_latency import LowLatencyKernels

        self._low_latency = ReferenceBackend(ctx)
        self._low_latency_kernels = None
        self._internode = None  # InternodeKernels, made at the first internode call
        if self.heap_buffer is not None or self.low_latency_buffer is not None:
            self._low_latency_kernels = LowLatencyKernels(self, self.heap_buffer or self.low_latency_buffer)
        choice = env.settings().low_latency_kernels
        self.use_low_latency_kernels = self.LOW_LATENCY_KERNELS_VALIDATED if choice == "auto" else choice == "on"

    # -- helpers --------------------------------------------------------------------------------------

    def _kernel(self, spec):
        """The loaded kernel of `spec`; specs come from lru_caches, so one object per kernel: looked up by
        identity (hashing a spec hashes its ~40 parameters, microseconds per call)."""
        entry = self._kernels.get(id(spec))
        if entry is None:
            entry = self._kernels[id(spec)] = (spec, load(spec, self.device_index))  # holds spec: ids stay unique
        return entry[1]

    def _stream(self) -> int:
        """The current stream of this backend's device, as a raw handle (NOTE [host cost per call])."""
        return torch._C._cuda_getCurrentRawStream(self.device_index)

    def _wait_args(self) -> dict:
        """Every kernel's bounded-wait parameters (kernels._WAIT)."""
        return dict(error_flag=self.error_flag.data_ptr(), host_record=self.host_record_ptr, timeout_ns=self.timeout_ns)

    def _normal_buffer_args(self, layout: workspace.NormalLayout) -> dict:
        """The normal-mode kernels' view of every rank's buffer (kernels._BUFFERS)."""
        return dict(peer_bases=self.normal.bases_tensor.data_ptr(), rank=self.ctx.rank,
                    control_bytes=layout.control_bytes, region_bytes=layout.region_bytes,
                    slots_offset=layout.slots_offset, max_chunks=layout.max_chunks, row_bytes=layout.row_bytes,
                    call_counts=self.call_counts.data_ptr())

    def _signature(self, op: str, **fields: int) -> int:
        """The device address of `op`'s shape signature (collectives.signature), which the call's first exchange
        compares across the ranks (NOTE [call signatures] in include/tokenyard/layout.cuh); kept for the
        backend's life, one per distinct signature."""
        values = tuple(collectives.signature(op, **fields))
        tensor = self._signatures.get(values)
        if tensor is None:
            tensor = self._signatures[values] = plans.device_constant(values, torch.int32, self.ctx.device)
        return tensor.data_ptr()

    def _normal_state(self) -> str:
        """What a normal-mode timeout adds: whether the device's table of peer addresses still holds what this
        process mapped, and the combine barrier's counters here (how many combines each rank has begun)."""
        try:
            table = "" if self.normal.bases_tensor.tolist() == self.normal.bases else \
                "this rank's table of peer addresses on the device was overwritten; "
            counts = self.normal.tensor[:4 * self.ctx.num_ranks].view(torch.int32).tolist()
        except RuntimeError:  # a device that can no longer be read: the error says what it can without
            return ""
        return f"{table}combine barriers passed here by rank: {counts}; "

    def check_failures(self) -> None:
        """Raise the error a kernel recorded (a timeout, an overflow); once failed, always failed."""
        if self._failure is None and self.host_record[0] != 0:
            kind, rank, peer, stage, seen, expected = (self.host_record[i] for i in range(6))
            stage_name = _STAGES.get(stage, f"stage {stage}")
            if kind == _ERRORS["kErrorOverflow"]:
                self._failure = InvalidInputError(
                    f"rank {rank} received at least {seen} rows at {stage_name}, more than "
                    f"num_worst_tokens={expected}; "
                    "rows past it were dropped")
            elif kind == _ERRORS["kErrorBadValues"]:
                mask = expected & _MASK32
                error = checks.verdict_error(checks.ranks_in(mask, self.ctx.num_ranks), seen, self._verdict_experts)
                self._failure = InvalidInputError(f"{error} (a dispatch with num_worst_tokens, which does not wait "
                                                  "for the counts, moved no rows; destroy this Buffer and make a new "
                                                  "one)")
            elif kind == _ERRORS["kErrorBadLowLatencyIds"]:
                self._failure = InvalidInputError(f"{checks.low_latency_bad_ids(rank, expected, seen)}; destroy "
                                                  "this Buffer and make a new one")
            elif kind == _ERRORS["kErrorCallMismatch"]:
                # NOTE [call signatures]: every rank's signature, copied from the table
                ints = collectives.SIGNATURE_INTS
                at = _RECORD_SIGNATURES_AT
                rows = [[int(self.host_record[at + r * _MAX_SIGNATURE_INTS + i]) for i in range(ints)]
                        for r in range(self.ctx.num_ranks)]
                self._failure = collectives.mismatch_error(rows, collectives.describe_signature, rank=rank,
                                                           stage=stage_name)
            elif kind == _ERRORS["kErrorMismatch"]:
                self._failure = InvalidInputError(
                    f"rank {peer} dispatched with {seen} sending warps and rank {rank} with {expected}: every rank "
                    "must use the same number of SMs (Buffer.set_num_sms, Config.num_sms); destroy this Buffer "
                    "and make a new one")
            else:
                # NOTE [call tags]: a low-latency peer whose call had another shape signals tags never awaited.
                if stage_name == "low_latency_combine/overlap":  # NOTE [combine overlap]
                    cause = ("the expert outputs' blocks were never signalled done (comp_signal below threshold, "
                             "or src_signals below src_signal_expect_value); ")
                elif stage_name.startswith("low_latency"):
                    cause = ("the peer did not make this call, or made it with another shape (hidden, top-k, experts, "
                             "num_max_dispatch_tokens_per_rank, FP8 flags); ")
                elif stage_name.startswith("internode"):  # signal counts (NOTE [internode kernels])
                    cause = ("a rank did not launch this call's kernel, or launched it with another grid; "
                             "the flag counts signals of every call so far; ")
                else:
                    cause = self._normal_state()
                self._failure = CommTimeoutError(rank, peer, stage_name,
                                                 f"flag was {seen & _MASK32}, expected {expected & _MASK32}; {cause}"
                                                 "destroy this Buffer and make a new one")
        if self._failure is not None:
            raise self._failure

    def _wait_host_counts(self, ticket: int) -> None:
        """The CPU wait of a dispatch: until the notify kernel published the counts of call `ticket`, bounded."""
        # A second longer than the kernel's own wait, whose error names the late peer.
        if not wait_until(lambda: (self.host_counts[0] & _MASK32) == ticket, self.ctx.timeout_s + 1.0,
                          self.check_failures):
            self._failure = CommTimeoutError(self.ctx.rank, -1, "dispatch/notify (CPU wait)", "the counts never arrived")
            raise self._failure

    # -- normal mode ----------------------------------------------------------------------------------

    def plan(self, key: tuple, build) -> plans.Plan:
        """The plan of `key` (NOTE [call plans]), built by `build()` at its first use."""
        return self._plans.get((self.poison_outputs,) + key, build)

    def _builder(self, inputs, scalars=()) -> plans.PlanBuilder:
        return plans.PlanBuilder(self.ctx.device, inputs, scalars, poison_outputs=self.poison_outputs)

    def layout_plan(self, topk_dtype: torch.dtype, num_tokens: int, num_topk: int, num_experts: int) -> plans.Plan:
        """Inputs (topk_idx,) -> (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)."""
        def build():
            num_ranks = self.ctx.num_ranks
            b = self._builder(("topk_idx",))
            # NOTE [plan allocations]: one allocation; is_token_in_rank keeps the counters' few bytes alive as long
            # as a handle holds it. The kernel writes every byte (NOTE [layout without a fill]); without
            # tokens, no kernel runs and the counters are zeroed.
            per_rank, per_expert, in_rank = b.outputs_in_one((
                ("num_tokens_per_rank", (num_ranks,), torch.int32),
                ("num_tokens_per_expert", (num_experts,), torch.int32),
                ("is_token_in_rank", (num_tokens, num_ranks), torch.bool)), zero=num_tokens == 0)
            if num_tokens > 0:
                ticket, totals = self.layout_scratch(num_experts)
                b.launch(self._kernel(kernels.dispatch_layout(num_ranks, topk_dtype)),
                         heuristics.layout_grid(num_tokens, kernels.LAYOUT_THREADS, self.device_sms), dict(
                             topk_idx=b.inp("topk_idx"), num_tokens=num_tokens, num_topk=num_topk,
                             num_experts=num_experts, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                             is_token_in_rank=in_rank, verdict=self.verdict.data_ptr(),
                             totals=totals, ticket=ticket),
                         shared_bytes=(num_experts + num_ranks) * 4)
            return b.build()

        return self.plan(("layout", topk_dtype, num_tokens, num_topk, num_experts), build)

    def layout_scratch(self, num_experts: int) -> Tuple[int, int]:
        """-> the addresses of the layout kernel's ticket and of its num_experts + num_ranks running totals, for
        calls of `num_experts` (NOTE [layout without a fill]): one zeroed tensor, the ticket in its first 16
        bytes, made at the first such call and kept, as plans hold the addresses."""
        scratch = self._layout_scratch.get(num_experts)
        if scratch is None:
            ints = 4 + num_experts + self.ctx.num_ranks
            scratch = self._layout_scratch[num_experts] = torch.zeros(ints, dtype=torch.int32, device=self.ctx.device)
        return scratch.data_ptr(), scratch.data_ptr() + 16

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.check_failures()
        plan = self.layout_plan(topk_idx.dtype, topk_idx.size(0), topk_idx.size(1), num_experts)
        return plan.run_here(self._stream(), (topk_idx,))

    def dispatch_shape(self, request: DispatchRequest) -> DispatchShape:
        """What decides a dispatch's plans, from the request's metadata (no value read)."""
        x, scales, placement = request.x, request.x_scales, request.placement
        cached = request.handle is not None
        topk_idx = None if cached else request.topk_idx
        outputs = None if placement is None else placement.outputs
        return DispatchShape(
            num_tokens=x.size(0), hidden=x.size(1), dtype=x.dtype, element_size=x.element_size(),
            num_scales=0 if scales is None else scales.size(1), scale_dtype=None if scales is None else scales.dtype,
            scale_strides=(0, 0) if scales is None else (scales.stride(0), scales.stride(1)),
            num_topk=0 if topk_idx is None else topk_idx.size(1),
            topk_dtype=torch.int64 if topk_idx is None else topk_idx.dtype,
            with_weights=not cached and request.topk_weights is not None,
            num_experts=self.ctx.num_ranks if cached else request.num_experts,
            expert_alignment=request.expert_alignment,
            num_rows=request.handle.num_rows if cached else (request.num_worst_tokens or None),
            cached=cached, num_sms=request.config.num_sms,
            round_0=placement is not None and outputs is None, placed_rows=None if outputs is None else outputs[0].size(0),
            placed_by_notify=placement is not None and placement.cursor is not None,
            whole_call=request.call is not None, judged=request.check is not None,
            judged_topk=request.check is not None and request.check.topk_idx is not None,
            all_weights=request.all_topk_weights)

    def dispatch_plans(self, shape: DispatchShape) -> Tuple[plans.Plan, Optional[plans.Plan]]:
        """The plans of a dispatch of `shape` (inputs DISPATCH_INPUTS, scalars DISPATCH_SCALARS): the count
        exchange, with the data launch where the outputs' rows are known; and where the CPU must wait for the
        counts first, a second plan that makes the outputs (rows: the scalar num_rows) and launches the data
        kernel."""
        return self.plan(("dispatch", shape), lambda: self._build_dispatch_plans(shape))

    def _build_dispatch_plans(self, m: DispatchShape):
        num_ranks, rank = self.ctx.num_ranks, self.ctx.rank
        if m.num_topk > kernels.NORMAL_MAX_TOPK:
            raise InvalidInputError(f"the CUDA backend handles top-k up to {kernels.NORMAL_MAX_TOPK}, got {m.num_topk}")
        num_local_experts = m.num_experts // num_ranks
        most_local_experts = min(HOST_COUNTS_INTS - _HOST_EXPERTS_AT, workspace.normal_max_local_experts(num_ranks))
        if num_local_experts > most_local_experts:
            raise InvalidInputError(f"the CUDA backend handles up to {most_local_experts} experts per rank on "
                                    f"{num_ranks} ranks, got {num_local_experts}")
        data_bytes = m.hidden * m.element_size
        layout = workspace.normal_layout(self.ctx.num_nvl_bytes, num_ranks,
                                         workspace.normal_dispatch_row_bytes(data_bytes, m.num_scales * 4, m.num_topk))
        # The data kernel's shape is decided (and refused) before any kernel runs; where the CPU must wait for
        # the counts to size the outputs, the data kernel is the second plan's, launched after the wait.
        grid = heuristics.data_grid(m.num_sms, self.device_sms, heuristics.dispatch_send_share(num_ranks))
        makes_outputs = m.placed_rows is None
        cpu_wait = not m.cached and m.num_rows is None and makes_outputs
        num_send_warps = grid.num_send_blocks * (kernels.DATA_THREADS // 32)
        chunk_tokens, tail_tokens = heuristics.DISPATCH_CHUNK_TOKENS, heuristics.dispatch_tail_tokens()
        slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens)
        if slots > layout.max_chunks:  # whole chunks to the end (NOTE [tail pieces]); alike on every rank
            tail_tokens = chunk_tokens
            slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens)
        if slots > layout.max_chunks:
            raise InvalidInputError(f"{num_send_warps} sending warps need {slots} chunk slots per source, more than "
                                    f"the {layout.max_chunks} the buffer has: use fewer SMs (Buffer.set_num_sms)")
        kernel = self._kernel(kernels.dispatch(num_ranks, data_bytes // 16, m.num_scales, m.num_topk, m.topk_dtype,
                                               chunk_tokens, tail_tokens, m.all_weights))
        rows_placed = not makes_outputs or (m.round_0 and cpu_wait)  # rows go where recv_first says
        own_rows_direct = heuristics.dispatch_own_rows_direct()
        T = m.num_tokens

        # 1. Count exchange (also the barrier before rows land in the peers' buffers).
        first = self._builder(DISPATCH_INPUTS, DISPATCH_SCALARS)
        # NOTE [plan allocations]: the call's temporaries and the received rows (which live as long as the caller
        # keeps them) are parts of one allocation; a fresh dispatch's handle fields (which live as long as the
        # handle) of another.
        rows_whole = first.whole()
        handle_whole = rows_whole if m.cached else first.whole()
        counts = source_first = send_head = 0
        prefix_excl = first.part(rows_whole, "prefix_excl", ((T + 1) * num_ranks,), torch.int32)
        source_num_tokens = first.part(rows_whole, "source_num_tokens", (num_ranks,), torch.int32)
        rank_prefix_matrix = first.part(handle_whole, "rank_prefix_matrix", (num_ranks, num_ranks), torch.int32)
        if not m.cached:
            counts = first.part(handle_whole, "counts", (num_ranks, 1), torch.int32)
            source_first = first.part(handle_whole, "source_first", (num_ranks, 1), torch.int32)
            send_head = first.part(handle_whole, "send_head", (T, num_ranks), torch.int32)

        def given(name: str, present: bool):  # the input where this call has it, else a null pointer
            return first.inp(name) if present else 0

        first.launch(self._kernel(kernels.dispatch_notify(num_ranks, m.topk_dtype)), num_ranks + 1, dict(
            is_token_in_rank=first.inp("is_token_in_rank"), num_tokens=T,
            num_tokens_per_expert=given("num_tokens_per_expert", not m.cached), num_experts=m.num_experts,
            expert_alignment=m.expert_alignment, prefix_excl=prefix_excl, rank_prefix_matrix=rank_prefix_matrix,
            source_num_tokens=source_num_tokens, counts=counts, source_first=source_first,
            call_num_tokens=first.scalar("call_num_tokens"),
            call_tokens_per_rank=given("call_tokens_per_rank", m.whole_call),
            call_prefix_matrix=given("call_prefix_matrix", m.whole_call),
            recv_first=given("recv_first", m.placed_by_notify), cursor=given("cursor", m.placed_by_notify),
            check_topk_idx=given("check_topk_idx", m.judged_topk), num_topk=m.num_topk,
            check_num_tokens=first.scalar("check_tokens"), check_in_rank=given("check_in_rank", m.judged),
            check_per_rank=given("check_per_rank", m.judged), check_per_expert=given("check_per_expert", m.judged),
            verdict=self.verdict.data_ptr(), record_verdict=int(m.judged and not cpu_wait),
            host_counts=self.host_counts_ptr, signature=self._dispatch_signature(m), ticket=first.scalar("ticket"),
            peer_bases=self.normal.bases_tensor.data_ptr(), rank=rank, call_counts=self.call_counts.data_ptr(),
            **self._wait_args()),
            shared_bytes=num_local_experts * 4 + kernels.JUDGE_WINDOW if m.judged else 0)

        # 2. The rows.
        def launch(b: plans.PlanBuilder, outputs, made_by_first: bool) -> None:
            def made(ref):  # an output of the first plan, seen from `b`
                return ref if made_by_first or ref == 0 else b.inp(first.outputs[ref.index][0])
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs
            b.launch(kernel, grid.num_blocks, dict(
                x=b.inp("x"), x_scales=b.inp("x_scales"), scale_token_stride=m.scale_strides[0],
                scale_hidden_stride=m.scale_strides[1], topk_idx=b.inp("topk_idx"),
                topk_weights=b.inp("topk_weights") if m.with_weights else 0,
                is_token_in_rank=b.inp("is_token_in_rank"), prefix_excl=made(prefix_excl),
                rank_prefix_matrix=made(rank_prefix_matrix), source_num_tokens=made(source_num_tokens), num_tokens=T,
                num_local_experts=num_local_experts, num_send_blocks=grid.num_send_blocks, recv_x=recv_x,
                recv_scales=recv_scales, recv_topk_idx=recv_topk_idx, recv_topk_weights=recv_topk_weights,
                recv_src_idx=recv_src_idx, send_head=made(send_head), num_worst_tokens=b.scalar("num_worst"),
                recv_first=b.inp("recv_first") if rows_placed else 0, src_idx_base=b.scalar("token_base"),
                local_direct=int(own_rows_direct), num_send_warps=num_send_warps,
                **self._normal_buffer_args(layout),
                verdict=0 if m.cached else self.verdict.data_ptr(), **self._wait_args()))

        def make_outputs(b: plans.PlanBuilder, num_rows):
            rows = rows_whole if b is first else b.whole()
            recv_x = b.part(rows, "recv_x", (num_rows, m.hidden), m.dtype)
            recv_scales = b.part(rows, "recv_x_scales", (num_rows, m.num_scales), m.scale_dtype) if m.num_scales else 0
            recv_topk_idx = recv_topk_weights = 0
            if m.num_topk:
                recv_topk_idx = b.part(rows, "recv_topk_idx", (num_rows, m.num_topk), m.topk_dtype)
                if m.with_weights:
                    recv_topk_weights = b.part(rows, "recv_topk_weights", (num_rows, m.num_topk), torch.float32)
            src_idx_whole = handle_whole if b is first else b.whole()  # a handle field
            return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, b.part(src_idx_whole, "recv_src_idx",
                                                                                 (num_rows,), torch.int32)

        if not makes_outputs:  # a placed round: the whole call's tensors are inputs
            placed_outputs = tuple(first.inp(n) for n in ("recv_x", "recv_x_scales", "recv_topk_idx",
                                                         "recv_topk_weights", "recv_src_idx"))
            launch(first, placed_outputs, True)
            return first.build(), None
        if not cpu_wait:
            launch(first, make_outputs(first, m.num_rows), True)
            return first.build(), None
        first_plan = first.build()
        second = self._builder(DISPATCH_INPUTS + first_plan.output_names, DISPATCH_SCALARS)
        launch(second, make_outputs(second, second.scalar("num_rows")), False)
        return first_plan, second.build()

    def _dispatch_signature(self, m: DispatchShape) -> int:
        """A dispatch's signature, as the front-end agrees on it for the reference backend (buffer.py)."""
        hidden_bytes = m.hidden * m.element_size
        if m.cached:
            return self._signature("cached_dispatch", hidden_bytes=hidden_bytes, num_scales=m.num_scales)
        return self._signature("dispatch", hidden_bytes=hidden_bytes, num_scales=m.num_scales, num_topk=m.num_topk,
                               num_experts=m.num_experts, num_worst_tokens=m.num_rows or 0,
                               expert_alignment=m.expert_alignment, with_weights=int(m.with_weights))

    def dispatch_scalars(self, num_tokens: int, call_num_tokens: Optional[int] = None, num_worst: int = 0,
                         token_base: int = 0, check_tokens: int = 0, ticket: Optional[int] = None) -> list:
        """A dispatch's per-call values, DISPATCH_SCALARS, with a new ticket (or `ticket`: a recorded call's
        placeholder, which each of its runs replaces with a new one, NOTE [fast calls])."""
        return [self.calls.next_ticket() if ticket is None else ticket,
                num_tokens if call_num_tokens is None else call_num_tokens, num_worst, token_base, 0, check_tokens]

    def note_judged(self, num_experts: int) -> None:
        """A dispatch whose values the notify kernel judges: its expert count names the range in the message
        of a verdict recorded without a CPU wait (check_failures)."""
        self._verdict_experts = num_experts

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self.check_failures()
        num_ranks = self.ctx.num_ranks
        first, second = self.dispatch_plans(self.dispatch_shape(request))
        placement, call, handle, check = request.placement, request.call, request.handle, request.check
        outputs = None if placement is None else placement.outputs
        inputs = (request.x, request.x_scales, None if handle is not None else request.topk_idx,
                  request.topk_weights, request.is_token_in_rank.contiguous(), request.num_tokens_per_expert,
                  None if call is None else call.tokens_per_rank, None if call is None else call.prefix_matrix,
                  None if placement is None else placement.recv_first,
                  None if placement is None else placement.cursor) + (outputs or (None,) * 5)
        if check is None:
            inputs += (None,) * 4
        else:
            inputs += (check.topk_idx, check.is_token_in_rank.contiguous(), check.num_tokens_per_rank,
                       check.num_tokens_per_expert)
            self.note_judged(request.num_experts)
        scalars = self.dispatch_scalars(request.x.size(0), None if call is None else call.num_tokens,
                                        request.num_worst_tokens if outputs is None else outputs[0].size(0),
                                        0 if outputs is None else placement.token_base,
                                        0 if check is None else check.is_token_in_rank.size(0))
        ticket = scalars[0]
        stream = self._stream()
        made = first.named(first.run_here(stream, inputs, scalars))
        per_expert_list = most_call_tokens = None
        if second is not None:
            self._wait_host_counts(ticket)
            if self.host_counts[4] != 0:  # NOTE [input verdict]: every rank raises; the Buffer stays usable
                mask = int(self.host_counts[4]) & _MASK32
                raise checks.verdict_error(checks.ranks_in(mask, num_ranks), int(self.host_counts[5]),
                                           request.num_experts)
            num_rows, most_call_tokens = int(self.host_counts[1]), int(self.host_counts[2])
            if placement is not None:  # round 0 of a call in rounds: the whole call's rows, this round's placed
                num_rows = int(self.host_counts[3])
                scalars[_NUM_WORST] = num_rows
            scalars[_NUM_ROWS] = num_rows
            num_local_experts = request.num_experts // num_ranks
            per_expert_list = [int(self.host_counts[_HOST_EXPERTS_AT + l]) for l in range(num_local_experts)]
            made.update(second.named(second.run_here(stream, inputs + tuple(made.values()), scalars)))
        elif handle is None and outputs is None and request.num_worst_tokens:
            per_expert_list = []
        if outputs is None:
            outputs = tuple(made.get(n) for n in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                                  "recv_src_idx"))
        if handle is None:
            handle = DispatchHandle(made["rank_prefix_matrix"], made["counts"], made["source_first"], outputs[4],
                                    inputs[4], made["send_head"])
        return DispatchResult(*outputs[:4], per_expert_list, handle, most_call_tokens)

    def combine_plan(self, num_tokens: int, hidden: int, num_topk: int, num_biases: int, num_sms: int,
                     placed: bool) -> plans.Plan:
        """Inputs COMBINE_INPUTS -> (combined_x, combined_topk_weights) unless
        `placed` (a round of a call in rounds writes into the whole call's tensors, given as inputs).
        `num_biases` only enters the call's signature (NOTE [call signatures])."""
        def build():
            num_ranks = self.ctx.num_ranks
            layout = workspace.normal_layout(self.ctx.num_nvl_bytes, num_ranks,
                                             workspace.normal_combine_row_bytes(hidden, num_topk))
            grid = heuristics.data_grid(num_sms, self.device_sms, heuristics.combine_send_share(num_ranks))
            b = self._builder(COMBINE_INPUTS)
            if placed:
                combined_x, combined_w = b.inp("combined_x"), b.inp("combined_topk_weights")
            else:
                whole = b.whole()  # NOTE [plan allocations]
                combined_x = b.part(whole, "combined_x", (num_tokens, hidden), torch.bfloat16)
                combined_w = b.part(whole, "combined_topk_weights", (num_tokens, num_topk), torch.float32) \
                    if num_topk else 0
            b.launch(self._kernel(kernels.combine(num_ranks, hidden * 2 // 16, num_topk)), grid.num_blocks, dict(
                x=b.inp("x"), topk_weights=b.inp("topk_weights"), bias_0=b.inp("bias_0"), bias_1=b.inp("bias_1"),
                rank_prefix_matrix=b.inp("rank_prefix_matrix"), recv_first=b.inp("recv_first"),
                send_head=b.inp("send_head"), num_tokens=num_tokens, num_send_blocks=grid.num_send_blocks,
                combined_x=combined_x, combined_topk_weights=combined_w,
                local_direct=int(heuristics.combine_own_rows_direct()),
                **self._normal_buffer_args(layout),
                signature=self._signature("combine", hidden=hidden, num_topk=num_topk, num_biases=num_biases),
                **self._wait_args()))
            return b.build()

        return self.plan(("combine", num_tokens, hidden, num_topk, num_biases, num_sms, placed), build)

    def combine(self, request: CombineRequest):
        self.check_failures()
        x, handle, weights, placement = request.x, request.handle, request.topk_weights, request.placement
        plan = self.combine_plan(handle.num_tokens, x.size(1), 0 if weights is None else weights.size(1),
                                 (request.bias_0 is not None) + (request.bias_1 is not None),
                                 request.config.num_sms, placement is not None)
        placed = (None, None) if placement is None else placement.outputs
        inputs = (x, weights, request.bias_0, request.bias_1, handle.rank_prefix_matrix,
                  None if placement is None else placement.recv_first, handle.send_head) + tuple(placed)
        made = plan.run_here(self._stream(), inputs)
        if placement is not None:
            return placement.outputs
        return made if weights is not None else (made[0], None)

    # -- low-latency mode -----------------------------------------------------------------------------

    def _low_latency_impl(self):
        if self.use_low_latency_kernels and self._low_latency_kernels is not None:
            return self._low_latency_kernels
        return None

    def wants_call_agreement(self, low_latency: bool) -> bool:
        # Only where the reference implementation serves the call: the kernels' calls must cost the host no
        # exchange (their own checks of the call belong in their count exchange).
        return low_latency and self._low_latency_impl() is None

    def low_latency_dispatch(self, request):
        self.check_failures()
        impl = self._low_latency_impl()
        return impl.dispatch(request) if impl else self._low_latency.low_latency_dispatch(request)

    def low_latency_combine(self, request):
        self.check_failures()
        impl = self._low_latency_impl()
        return impl.combine(request) if impl else self._low_latency.low_latency_combine(request)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        impl = self._low_latency_impl()
        if impl is not None:
            impl.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def next_low_latency_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self._low_latency.next_low_latency_combine_buffer(num_max_dispatch_tokens_per_rank, hidden,
                                                                 num_experts)

    # -- DeepEP V2's expanded layout (tokenyard/semantics/expand.py) ------------------------------------------
    # Each runs as a plan (NOTE [call plans]) whose row counts are scalars, so a dispatch with the CPU sync,
    # whose counts change at every call, reuses it too; the kernels stride over their rows, so the grids are
    # sized for the most rows there can be.

    def _strided_grid(self, most_items: int, per_block: int = kernels.EXPAND_THREADS // 32) -> int:
        """Blocks for up to `most_items` (a warp each by default), at most four per SM."""
        return max(1, min(-(-most_items // per_block), self.device_sms * 4))

    def expanded_layout(self, recv_topk_idx, recv_src_idx, psum_per_rank, num_local, alignment, num_max,
                        num_expanded):
        usable = recv_topk_idx.is_contiguous() and recv_src_idx.is_contiguous() and recv_src_idx.dtype == torch.int32
        if recv_topk_idx.device.type != "cuda" or psum_per_rank.dtype != torch.int32 or not usable:
            return super().expanded_layout(recv_topk_idx, recv_src_idx, psum_per_rank, num_local, alignment, num_max,
                                           num_expanded)
        num_rows, num_topk = recv_topk_idx.shape
        num_ranks, expanded = psum_per_rank.numel(), num_expanded is not None
        topk_dtype, stride = recv_topk_idx.dtype, psum_per_rank.stride(0)

        def build():
            i32 = torch.int32
            b = self._builder(("recv_topk_idx", "recv_src_idx", "psum_per_rank"), ("num_rows", "num_expanded"))
            rows = b.scalar("num_rows")
            counts = b.output("counts", (num_local,), i32, zero=True)
            row_of = b.output("row_of", (rows, num_topk), i32)
            metadata = b.output("metadata", (rows, num_topk + 2), i32)
            b.launch(self._kernel(kernels.expand_count(num_topk, topk_dtype)),
                     self._strided_grid(num_ranks * num_max, per_block=kernels.EXPAND_THREADS), dict(
                         recv_topk_idx=b.inp("recv_topk_idx"), recv_src_idx=b.inp("recv_src_idx"),
                         psum_per_rank=b.inp("psum_per_rank"), psum_stride=stride, num_ranks=num_ranks,
                         num_rows=rows, num_local=num_local, num_max=num_max, counts=counts, row_of=row_of,
                         metadata=metadata), shared_bytes=num_local * 4)
            if expanded:
                ends = b.output("ends", (num_local,), i32)
                source_row = b.output("source_row", (b.scalar("num_expanded"),), i32, fill=0xFF)  # -1: padding
                b.launch(self._kernel(kernels.expand_place(num_topk, topk_dtype)), num_local, dict(
                    recv_topk_idx=b.inp("recv_topk_idx"), num_rows=rows, alignment=alignment, counts=counts,
                    ends=ends, row_of=row_of, metadata=metadata, source_row=source_row))
            return b.build()

        plan = self.plan(("expanded_layout", num_topk, topk_dtype, num_ranks, stride, num_local, alignment, num_max,
                          expanded), build)
        made = plan.named(plan.run_here(self._stream(), (recv_topk_idx, recv_src_idx, psum_per_rank),
                                        (num_rows, num_expanded or 0)))
        return made["counts"], made.get("ends"), made["row_of"] if expanded else None, made.get("source_row"), \
            made["metadata"]

    def gather_rows(self, rows: torch.Tensor, source_row: torch.Tensor, zero_fill: bool) -> torch.Tensor:
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()  # also where no row was received
        if rows.device.type != "cuda" or rows.dim() == 1 or row_bytes % 16 or not rows.is_contiguous() or \
                source_row.dtype != torch.int32 or not source_row.is_contiguous():
            return super().gather_rows(rows, source_row, zero_fill)
        tail = tuple(rows.shape[1:])

        def build():
            b = self._builder(("rows", "source_row"), ("num_expanded",))
            m = b.scalar("num_expanded")
            out = b.output("out", (m,) + tail, rows.dtype)
            b.launch(self._kernel(kernels.expand_rows(row_bytes // 16)), self._strided_grid(1 << 30), dict(
                rows=b.inp("rows"), source_row=b.inp("source_row"), num_expanded=m, zero_fill=int(zero_fill),
                out=out))
            return b.build()

        plan = self.plan(("gather_rows", tail, rows.dtype, zero_fill), build)
        return plan.run_here(self._stream(), (rows, source_row), (source_row.numel(),))[0]

    def reduce_expanded(self, x: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.size(1) % 8 or not x.is_contiguous() or \
                row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().reduce_expanded(x, row_of)
        num_rows, num_topk = row_of.shape
        hidden = x.size(1)

        def build():
            b = self._builder(("x", "row_of"), ("num_rows",))
            n = b.scalar("num_rows")
            out = b.output("out", (n, hidden), torch.bfloat16)
            b.launch(self._kernel(kernels.reduce_expanded(hidden // 8, num_topk)), self._strided_grid(1 << 30),
                     dict(x=b.inp("x"), row_of=b.inp("row_of"), num_rows=n, out=out))
            return b.build()

        plan = self.plan(("reduce_expanded", hidden, num_topk), build)
        return plan.run_here(self._stream(), (x, row_of), (num_rows,))[0]

    def _move_weights(self, row_of: torch.Tensor, given: torch.Tensor, out_rows: int, to_expanded: bool,
                      zero_fill: bool) -> torch.Tensor:
        """move_weights as a plan: `given` the pairs' weights ([N, K]) to an expanded [out_rows], or the
        expanded weights to the pairs' [N, K]."""
        num_topk = row_of.size(1)

        def build():
            b = self._builder(("row_of", "given"), ("num_pairs", "out_rows"))
            shape = (b.scalar("out_rows"),) if to_expanded else (b.scalar("out_rows"), num_topk)
            out = b.output("out", shape, torch.float32, zero=to_expanded and zero_fill)
            pairs, expanded = (b.inp("given"), out) if to_expanded else (out, b.inp("given"))
            b.launch(self._kernel(kernels.move_weights()), self._strided_grid(1 << 30, kernels.EXPAND_THREADS),
                     dict(row_of=b.inp("row_of"), num_pairs=b.scalar("num_pairs"), to_expanded=int(to_expanded),
                          pairs=pairs, expanded=expanded))
            return b.build()

        plan = self.plan(("move_weights", num_topk, to_expanded, zero_fill), build)
        return plan.run_here(self._stream(), (row_of, given), (row_of.numel(), out_rows))[0]

    def expand_weights(self, topk_weights, row_of, num_expanded, zero_fill):
        if topk_weights.device.type != "cuda" or row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().expand_weights(topk_weights, row_of, num_expanded, zero_fill)
        return self._move_weights(row_of, topk_weights.float().contiguous(), num_expanded, True, zero_fill)

    def gather_weights(self, topk_weights, row_of):
        if topk_weights.device.type != "cuda" or row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().gather_weights(topk_weights, row_of)
        return self._move_weights(row_of, topk_weights.float().contiguous(), row_of.size(0), False, False)

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer:
            if self._low_latency_kernels is not None:
                return self._low_latency_kernels.buffer.tensor
            return self._low_latency.local_buffer(True)
        return self.normal.tensor

    # -- internode normal mode (NOTE [internode kernels] in kernels/internode.cuh) ---------------------------

    def internode_missing(self) -> Optional[str]:
        """None where this rank can run the internode kernels, else what it lacks (NOTE [NVSHMEM units])."""
        from ...jit import compiler as compilers
        from ...jit import nvshmem

        if nvshmem.find() is None:
            return nvshmem.missing_reason()
        if compilers.nvcc_path() is None:
            return "no nvcc, which links the kernels that call NVSHMEM"
        most = headers.constant("kernels/internode.cuh", "kMaxRanksPerNode")
        if self.ctx.topology.ranks_per_node > most:
            return f"nodes of {self.ctx.topology.ranks_per_node} ranks, more than the kernels' {most}"
        return None

    def start_internode(self) -> None:
        """NOTE [internode start]
        NVSHMEM's start and its allocations are collective and wait without a deadline. A Buffer whose normal
        mode spans nodes therefore makes its internode kernels' region while it is made, a step every rank
        joins, rather than at its first call, where a rank late to the call would hold the others past their
        deadline (or, gone, forever). A Buffer without num_rdma_bytes makes none: its calls raise
        CapacityError."""
        if self.ctx.num_rdma_bytes > 0:
            self._internode_kernels()

    def _internode_kernels(self):
        """The internode kernels, NVSHMEM started for the group (collective; NOTE [internode start])."""
        if self._internode is None:
            from .internode import InternodeKernels

            ctx = self.ctx
            if ctx.num_rdma_bytes <= 0:
                raise CapacityError("internode normal mode on the CUDA backend keeps its rows in num_rdma_bytes "
                                    "of NVSHMEM memory (NOTE [internode region]); this Buffer has none",
                                    required_bytes=0, available_bytes=0, which="num_rdma_bytes")
            self._internode = InternodeKernels(self, self._transport(), ctx.num_rdma_bytes,
                                               ctx.topology.ranks_per_node)
        return self._internode

    def _group_ranks(self) -> tuple:
        ctx = self.ctx
        return tuple(dist.get_process_group_ranks(ctx.group)) if ctx.group is not None else tuple(range(ctx.num_ranks))

    def _transport(self):
        """NVSHMEM started for the group, or a use more of it (collective at the start), its heap room for the
        low-latency buffer and the internode kernels' region, num_rdma_bytes each."""
        from .transport import Transport

        ctx = self.ctx
        return Transport.start(ctx.rank, ctx.num_ranks, ctx.all_gather_object, self._group_ranks(),
                               heap_bytes=2 * ctx.num_rdma_bytes + _INTERNODE_HEAP_SLACK,
                               shares_gpu=ctx.topology.shares_gpu)

    def internode_dispatch(self, request: DispatchRequest) -> DispatchResult:
        from .. import internode

        return internode.dispatch(self._low_latency, request, self._internode_kernels())

    def internode_combine(self, request: CombineRequest):
        from .. import internode

        return internode.combine(self._low_latency, request, self._internode_kernels())

    def destroy(self, together: bool = True) -> None:
        torch.cuda.synchronize(self.device_index)
        # NVSHMEM's frees and stop are collective, without a deadline (NOTE [NVSHMEM stop] in transport.py).
        nvshmem_together = together and not getattr(self.ctx.collectives, "peer_lost", False)
        for user in (self._internode, self.heap_buffer):
            if user is not None and nvshmem_together:
                user.free()
            elif user is not None and together:
                user.transport.abandon()
        self._internode = self.heap_buffer = None
        held = [b for b in (self.normal, self.low_latency_buffer) if b is not None]
        self.normal = self.low_latency_buffer = None
        for buffer in held:
            buffer.unmap_peers()
        if held and together:  # NOTE [symmetric lifetime]
            meet(self.ctx)
        for buffer in held:
            buffer.free()
        for ptr in (self.host_record_ptr, self.host_counts_ptr):
            runtime.host_free(ptr)
        self.host_record_ptr = self.host_counts_ptr = 0
        self._low_latency.destroy()
