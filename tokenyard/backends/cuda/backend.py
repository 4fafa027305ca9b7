"""The CUDA backend: JIT kernels over NVLink-mapped buffers of every rank of the group.

Normal mode runs our kernels (include/tokenyard/kernels); low-latency mode those of low_latency.py, or the
reference implementation over the same group where TOKENYARD_LOW_LATENCY_KERNELS=off. The group carries only
host-side exchanges (the peers' IPC handles), so any group serves, its ranks on GPUs of their own or sharing
GPUs under MPS (NOTE [MPS]).
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from ... import checks, env
from ...errors import BackendUnavailableError, CommTimeoutError, InvalidInputError, TokenyardError
from ...handle import DispatchHandle
from ...jit import load
from ...plan import headers, workspace
from .. import collectives, waiting
from ..base import Backend, GroupContext
from ..requests import CombineRequest, DispatchRequest, DispatchResult
from . import failures, heuristics, kernels, plans, runtime
from .expand import ExpandCalls
from .internode import InternodeCalls
from .memory import OutputArena, SymmetricBuffer, meet

HOST_COUNTS_INTS = 6 + 4096  # NOTE [notify]: the ticket, three counts, the verdict (two), per-local-expert counts
# Where host_counts holds each of them (index 0: the ticket)
_HOST_ROWS_AT, _HOST_MOST_AT, _HOST_CALL_ROWS_AT, _HOST_VERDICT_AT, _HOST_VERDICT_BITS_AT = range(1, 6)
_HOST_EXPERTS_AT = 6
_MASK32 = 0xFFFFFFFF

# The inputs and per-call scalars of every dispatch plan (NOTE [call plans]), in the order a run passes them.
DISPATCH_INPUTS = ("x", "x_scales", "topk_idx", "topk_weights", "is_token_in_rank", "num_tokens_per_expert",
                   "call_tokens_per_rank", "call_prefix_matrix", "recv_first", "cursor", "recv_x", "recv_x_scales",
                   "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "check_topk_idx", "check_in_rank",
                   "check_per_rank", "check_per_expert", "expand_row_of", "expand_source_row", "source_ranks")
# The call numbers the kernels signal with are the GPU's (NOTE [normal-mode call numbers] in
# include/tokenyard/sync.cuh), so a captured call replays with new ones; the host's `ticket` only tells the CPU
# wait which call's counts have arrived.
DISPATCH_SCALARS = ("ticket", "call_num_tokens", "num_worst", "token_base", "num_rows", "check_tokens", "expand_rows")
_NUM_WORST, _NUM_ROWS = DISPATCH_SCALARS.index("num_worst"), DISPATCH_SCALARS.index("num_rows")
_EXPAND_ROWS = DISPATCH_SCALARS.index("expand_rows")
# The scalars a dispatch's counts set, (slot, index of host_counts): one-shot, its received rows; round 0 of a call
# in rounds (a placement), the whole call's, which it allocates (NOTE [placed rounds] in rounds.py).
_COUNT_READS = [(_NUM_ROWS, _HOST_ROWS_AT)]
_PLACED_COUNT_READS = [(_NUM_ROWS, _HOST_CALL_ROWS_AT), (_NUM_WORST, _HOST_CALL_ROWS_AT)]
COMBINE_INPUTS = ("x", "topk_weights", "bias_0", "bias_1", "rank_prefix_matrix", "recv_first", "send_head",
                  "combined_x", "combined_topk_weights")


class CudaBackend(ExpandCalls, InternodeCalls, Backend):
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
        if ctx.num_ranks > failures.MAX_RANKS:
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
        self.low_latency_buffer = self.output_arena = None
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
            if hosts == 1 and ctx.num_nvl_bytes > 0:  # NOTE [placed rows]: as large as the buffer (docs/semantics.md)
                self.output_arena = OutputArena(ctx, ctx.num_nvl_bytes)
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
        self.host_record_ptr = runtime.host_alloc_mapped(failures.RECORD_INTS * 4)
        self.host_record = runtime.int32_view(self.host_record_ptr, failures.RECORD_INTS)
        self._signatures = {}  # signature tuple -> its ints on the device (NOTE [call signatures], `_signature`)
        self.host_counts_ptr = runtime.host_alloc_mapped(HOST_COUNTS_INTS * 4)
        self.host_counts = runtime.int32_view(self.host_counts_ptr, HOST_COUNTS_INTS)
        self.timeout_ns = int(ctx.timeout_s * 1e9)
        # The rank's CallCounter words (sync.cuh), zero on every rank as the buffers are.
        self.call_counts = torch.zeros(headers.enum("sync.cuh", "CallCounter")["kNumCallCounters"],
                                       dtype=torch.int64, device=ctx.device)
        # NOTE [fast calls]: recorded calls, the dispatches' tickets, the low-latency halves, the streams' order
        self.calls = plans.module().Calls(ctx.device, self.host_record_ptr, weakref.WeakMethod(self.check_failures))
        self.calls.set_host_counts(self.host_counts_ptr, _HOST_VERDICT_AT, waiting.POLL_S,
                                   waiting.SLEEP_S)  # NOTE [counted finish]
        self._failure: Optional[TokenyardError] = None
        self._kernels = {}  # id(spec) -> (spec, Kernel), see _kernel
        self._plans = plans.PlanCache()
        self.normal_phases = None  # see start_normal_phases
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

    def start_normal_phases(self) -> torch.Tensor:
        """NOTE [normal-mode phases]: from now on each normal-mode dispatch (0) and combine (1) adds its warps' time
        per phase into the returned int64 tensor ``[2, device_sms * warps * kNumPhaseSlots]`` (SM cycles, then each
        warp's span in ns and in cycles): kernel k's ``[blocks, its block's warps, kNumPhaseSlots]`` from the start
        of row k, room for the widest block's warps; a diagnostic (benchmarks/normal_phases.py), never on in
        production."""
        most_warps = max(heuristics.BLOCK_THREAD_CHOICES) // 32
        self.normal_phases = torch.zeros(2, self.device_sms * most_warps * kernels.PHASES["kNumPhaseSlots"],
                                         dtype=torch.int64, device=self.ctx.device)
        self._plans = plans.PlanCache()  # the plans hold the address
        self.calls.forget()  # so do the recorded calls (NOTE [fast calls])
        return self.normal_phases

    def _phases_ptr(self, kind: int) -> int:
        return 0 if self.normal_phases is None else self.normal_phases[kind].data_ptr()

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
            self._failure = failures.failure_of(self.host_record, self.ctx.num_ranks, self._verdict_experts,
                                                self._normal_state)
        if self._failure is not None:
            raise self._failure

    def fail(self, error: TokenyardError) -> None:
        """Keep `error` as this backend's failure, as a recorded one is kept (a failure found on the host)."""
        if self._failure is None:
            self._failure = error

    @property
    def host_wait_s(self) -> float:
        """How long the CPU waits for a dispatch's counts: a second longer than the kernels' own wait, whose error
        names the late peer."""
        return self.ctx.timeout_s + 1.0

    def _wait_host_counts(self, ticket: int, timeout_s: Optional[float] = None) -> None:
        """The CPU wait of a dispatch: until the notify kernel published the counts of call `ticket`, bounded by
        `timeout_s` (default `host_wait_s`)."""
        if not waiting.wait_until(lambda: (self.host_counts[0] & _MASK32) == ticket,
                                  self.host_wait_s if timeout_s is None else timeout_s, self.check_failures):
            self._failure = CommTimeoutError(self.ctx.rank, -1, "dispatch/notify (CPU wait)", "the counts never arrived")
            raise self._failure

    # -- normal mode ----------------------------------------------------------------------------------

    def plan(self, key: tuple, build) -> plans.Plan:
        """The plan of `key` (NOTE [call plans]), built by `build()` at its first use."""
        return self._plans.get((self.poison_outputs,) + key, build)

    def _builder(self, inputs, scalars=()) -> plans.PlanBuilder:
        return plans.PlanBuilder(self.ctx.device, inputs, scalars, poison_outputs=self.poison_outputs,
                                 arena=None if self.output_arena is None else self.output_arena.native)

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

    def dispatch_shape(self, request: DispatchRequest) -> plans.DispatchShape:
        return plans.DispatchShape.of(request, self.ctx.num_ranks)

    def dispatch_plans(self, shape: plans.DispatchShape) -> Tuple[plans.Plan, Optional[plans.Plan]]:
        """The plans of a dispatch of `shape` (inputs DISPATCH_INPUTS, scalars DISPATCH_SCALARS): the count
        exchange, with the data launch where the outputs' rows are known; and where the CPU must wait for the
        counts first, a second plan that makes the outputs (rows: the scalar num_rows) and launches the data
        kernel."""
        return self.plan(("dispatch", shape), lambda: self._build_dispatch_plans(shape))

    def _build_dispatch_plans(self, m: plans.DispatchShape):
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
                                         workspace.normal_dispatch_row_bytes(data_bytes, m.num_scales * 4, m.num_topk,
                                                                             m.expanded_fresh))
        # The data kernel's shape is decided (and refused) before any kernel runs; where the CPU must wait for
        # the counts to size the outputs, the data kernel is the second plan's, launched after the wait.
        num_blocks = heuristics.data_blocks(m.num_sms, self.device_sms)
        makes_outputs = m.placed_rows is None
        cpu_wait = not m.cached and m.num_rows is None and makes_outputs
        threads = heuristics.dispatch_threads(num_ranks)
        send_warps = heuristics.dispatch_send_warps(threads // 32)
        num_send_warps = num_blocks * send_warps
        chunk_tokens, tail_tokens = heuristics.DISPATCH_CHUNK_TOKENS, heuristics.dispatch_tail_tokens()
        slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens)
        if slots > layout.max_chunks:  # whole chunks to the end (NOTE [tail pieces]); alike on every rank
            tail_tokens = chunk_tokens
            slots = workspace.normal_dispatch_slots(layout.capacity, num_send_warps, chunk_tokens, tail_tokens)
        if slots > layout.max_chunks:
            raise InvalidInputError(f"{num_send_warps} sending warps need {slots} chunk slots per source, more than "
                                    f"the {layout.max_chunks} the buffer has: use fewer SMs (Buffer.set_num_sms)")
        kernel = self._kernel(kernels.dispatch(num_ranks, data_bytes // 16, m.num_scales, m.num_topk, m.topk_dtype,
                                               chunk_tokens, tail_tokens, m.all_weights, send_warps,
                                               heuristics.dispatch_stages(), threads, m.expanded, m.expanded_fresh))
        rows_placed = not makes_outputs or (m.round_0 and cpu_wait)  # rows go where recv_first says
        # NOTE [expanded rows]: the receivers write every row, their own rank's too, where its pairs go.
        own_rows_direct = heuristics.dispatch_own_rows_direct() and not m.expanded
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
        expand_bases = expand_counts = expand_ends = 0
        if m.expanded_fresh:  # NOTE [expanded rows]: where each source's pairs of each expert begin; the handle's
            expand_bases = first.part(rows_whole, "expand_bases", (num_ranks, num_local_experts), torch.int32)
            expand_counts = first.part(handle_whole, "expand_counts", (num_local_experts,), torch.int32)
            expand_ends = first.part(handle_whole, "expand_ends", (num_local_experts,), torch.int32)
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
            expand_bases=expand_bases, expand_counts=expand_counts, expand_ends=expand_ends, **self._wait_args()),
            shared_bytes=num_local_experts * 4 + kernels.JUDGE_WINDOW if m.judged else 0)

        # 2. The rows.
        def launch(b: plans.PlanBuilder, outputs, made_by_first: bool, recv_rows=0) -> None:
            """With `makes_outputs`, `b` made `outputs`, of `recv_rows` rows (recv_x in the output arena where it has
            room: NOTE [placed rows]); else they are the whole call's, given."""
            def made(ref):  # an output of the first plan, seen from `b`
                return ref if made_by_first or ref == 0 else b.inp(first.outputs[ref.index][0])
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs[:5]
            row_of, source_row, metadata = outputs[5:] if m.expanded_fresh else (
                b.inp("expand_row_of"), b.inp("expand_source_row"), 0) if m.expanded else (0, 0, 0)
            b.launch(kernel, num_blocks, dict(
                x=b.inp("x"), x_scales=b.inp("x_scales"), scale_token_stride=m.scale_strides[0],
                scale_hidden_stride=m.scale_strides[1], topk_idx=b.inp("topk_idx"),
                topk_weights=b.inp("topk_weights") if m.with_weights else 0,
                is_token_in_rank=b.inp("is_token_in_rank"), prefix_excl=made(prefix_excl),
                rank_prefix_matrix=made(rank_prefix_matrix), source_num_tokens=made(source_num_tokens), num_tokens=T,
                num_local_experts=num_local_experts, recv_x=recv_x,
                recv_scales=recv_scales, recv_topk_idx=recv_topk_idx, recv_topk_weights=recv_topk_weights,
                recv_src_idx=recv_src_idx, send_head=made(send_head), num_worst_tokens=b.scalar("num_worst"),
                recv_first=b.inp("recv_first") if rows_placed else 0, src_idx_base=b.scalar("token_base"),
                local_direct=int(own_rows_direct), num_send_warps=num_send_warps,
                place_bases=0 if self.output_arena is None else self.output_arena.memory.bases_tensor.data_ptr(),
                place_offset=b.arena_offset(recv_x) if makes_outputs and not m.expanded else -1, recv_rows=recv_rows,
                expand_row_of=row_of, expand_source_row=source_row,
                expand_rows=b.scalar("expand_rows"), expand_zero_fill=int(m.expanded and m.zero_fill),
                source_ranks=b.inp("source_ranks") if m.expanded_fresh else 0, expand_bases=made(expand_bases),
                expand_ends=made(expand_ends), expand_metadata=metadata, expand_num_max=m.num_max_tokens_per_rank,
                **self._normal_buffer_args(layout),
                verdict=0 if m.cached else self.verdict.data_ptr(), **self._wait_args(), phases=self._phases_ptr(0)))

        def make_outputs(b: plans.PlanBuilder, num_rows):
            rows = rows_whole if b is first else b.whole()
            if m.expanded:  # NOTE [expanded rows]: the expanded layout's rows, one weight each
                expanded_rows = b.scalar("expand_rows")
                recv_x = b.output("recv_x", (expanded_rows, m.hidden), m.dtype)
                recv_scales = b.part(rows, "recv_x_scales", (expanded_rows, m.num_scales), m.scale_dtype) \
                    if m.num_scales else 0
                recv_weights = b.part(rows, "recv_topk_weights", (expanded_rows,), torch.float32) \
                    if m.with_weights else 0
                if not m.expanded_fresh:
                    return recv_x, recv_scales, 0, recv_weights, 0
                handle = handle_whole if b is first else b.whole()  # the layout the kernel makes: handle fields
                return (recv_x, recv_scales, b.part(handle, "recv_topk_idx", (num_rows, m.num_topk), m.topk_dtype),
                        recv_weights, b.part(handle, "recv_src_idx", (num_rows,), torch.int32),
                        b.part(handle, "expand_row_of", (num_rows, m.num_topk), torch.int32),
                        b.part(handle, "expand_source_row", (expanded_rows,), torch.int32),
                        b.part(handle, "expand_metadata", (num_rows, m.num_topk + 2), torch.int32))
            recv_x = b.output("recv_x", (num_rows, m.hidden), m.dtype, in_arena=True)  # NOTE [placed rows]
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
            launch(first, make_outputs(first, m.num_rows), True, m.num_rows)
            return first.build(), None
        first_plan = first.build()
        second = self._builder(DISPATCH_INPUTS + first_plan.output_names, DISPATCH_SCALARS)
        num_rows = second.scalar("num_rows")
        launch(second, make_outputs(second, num_rows), False, num_rows)
        return first_plan, second.build()

    def _dispatch_signature(self, m: plans.DispatchShape) -> int:
        """A dispatch's signature, as the front-end agrees on it for the reference backend (buffer.py)."""
        hidden_bytes = m.hidden * m.element_size
        if m.cached:  # an expanded one's rows carry its tails (NOTE [expanded rows]): it differs from one that is not
            return self._signature("cached_dispatch", hidden_bytes=hidden_bytes, num_scales=m.num_scales,
                                   expanded=int(m.expanded))
        return self._signature("dispatch", hidden_bytes=hidden_bytes, num_scales=m.num_scales, num_topk=m.num_topk,
                               num_experts=m.num_experts, num_worst_tokens=m.num_rows or 0,
                               expert_alignment=m.expert_alignment, with_weights=int(m.with_weights),
                               expanded=int(m.expanded_fresh))

    def dispatch_scalars(self, num_tokens: int, call_num_tokens: Optional[int] = None, num_worst: int = 0,
                         token_base: int = 0, check_tokens: int = 0, ticket: Optional[int] = None,
                         expand_rows: int = 0) -> list:
        """A dispatch's per-call values, DISPATCH_SCALARS, with a new ticket (or `ticket`: a recorded call's
        placeholder, which each of its runs replaces with a new one, NOTE [fast calls])."""
        return [self.calls.next_ticket() if ticket is None else ticket,
                num_tokens if call_num_tokens is None else call_num_tokens, num_worst, token_base, 0, check_tokens,
                expand_rows]

    def note_judged(self, num_experts: int) -> None:
        """A dispatch whose values the notify kernel judges: its expert count names the range in the message
        of a verdict recorded without a CPU wait (check_failures)."""
        self._verdict_experts = num_experts

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self.check_failures()
        first, second = self.dispatch_plans(self.dispatch_shape(request))
        inputs, scalars = self.dispatch_values(request)
        stream = self._stream()
        made = first.named(first.run_here(stream, inputs, scalars))
        per_expert_list = most_call_tokens = None
        if second is not None:
            per_expert_list, most_call_tokens = self.counts_arrived(request, scalars)
            made.update(second.named(second.run_here(stream, inputs + tuple(made.values()), scalars)))
        return self.dispatch_result(request, made, inputs[4], per_expert_list, most_call_tokens)

    def dispatch_values(self, request: DispatchRequest) -> Tuple[tuple, list]:
        """A dispatch's inputs (DISPATCH_INPUTS) and per-call values (DISPATCH_SCALARS, with a new ticket)."""
        placement, call, check = request.placement, request.call, request.check
        outputs = None if placement is None else placement.outputs
        expansion = request.expansion
        inputs = (request.x, request.x_scales, request.kernel_topk_idx,
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
        inputs += (None, None, None) if expansion is None else (expansion.row_of, expansion.source_row,
                                                                 expansion.source_ranks)
        scalars = self.dispatch_scalars(request.x.size(0), None if call is None else call.num_tokens,
                                        request.num_worst_tokens if outputs is None else outputs[0].size(0),
                                        0 if outputs is None else placement.token_base,
                                        0 if check is None else check.is_token_in_rank.size(0),
                                        expand_rows=0 if expansion is None else expansion.num_rows)
        return inputs, scalars

    def counts_arrived(self, request: DispatchRequest, scalars: list,
                       timeout_s: Optional[float] = None) -> Tuple[list, int]:
        """The host's half of a dispatch's count exchange, after its first plan ran: waits (bounded, `timeout_s`
        default `host_wait_s`) for the counts of call `scalars[0]`, raises the input verdict, and sets the received
        rows in `scalars` for the second plan (`count_reads`); -> `counts_read`."""
        self._wait_host_counts(scalars[0], timeout_s)
        if self.host_counts[_HOST_VERDICT_AT] != 0:  # NOTE [input verdict]: every rank raises; the Buffer stays usable
            mask = int(self.host_counts[_HOST_VERDICT_AT]) & _MASK32
            raise checks.verdict_error(checks.ranks_in(mask, self.ctx.num_ranks),
                                       int(self.host_counts[_HOST_VERDICT_BITS_AT]), request.num_experts)
        for slot, at in self.count_reads(request):
            scalars[slot] = int(self.host_counts[at])
        per_expert_list, most = self.counts_read(request)
        expansion = request.expansion
        if expansion is not None and expansion.fresh and not expansion.expanded_rows:  # the layout's rows
            scalars[_EXPAND_ROWS] = sum(per_expert_list)  # each expert's count aligned (NOTE [notify])
        return per_expert_list, most

    @staticmethod
    def count_reads(request: DispatchRequest) -> list:
        """The scalars of `request`'s second plan that its counts set: (slot, index of host_counts)."""
        return _COUNT_READS if request.placement is None else _PLACED_COUNT_READS

    def counts_read(self, request: DispatchRequest) -> Tuple[list, int]:
        """Once `request`'s counts arrived: (each local expert's count, the most tokens of any rank's whole call)."""
        num_local_experts = request.num_experts // self.ctx.num_ranks  # a ctypes slice: one list, not an index each
        return (self.host_counts[_HOST_EXPERTS_AT:_HOST_EXPERTS_AT + num_local_experts],
                int(self.host_counts[_HOST_MOST_AT]))

    @staticmethod
    def dispatch_result(request: DispatchRequest, made: dict, in_rank: torch.Tensor, per_expert_list: Optional[list],
                        most_call_tokens: Optional[int]) -> DispatchResult:
        """A dispatch's result from its plans' outputs by name (`made`), the is_token_in_rank they read, and what
        its count exchange told the host."""
        placement, handle = request.placement, request.handle
        outputs = None if placement is None else placement.outputs
        if per_expert_list is None and handle is None and outputs is None and request.num_worst_tokens:
            per_expert_list = []
        if outputs is None:
            outputs = tuple(made.get(n) for n in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                                  "recv_src_idx"))
        if handle is None:
            handle = DispatchHandle(made["rank_prefix_matrix"], made["counts"], made["source_first"], outputs[4],
                                    in_rank, made["send_head"])
        expanded = None
        if request.expansion is not None and request.expansion.fresh:  # NOTE [expanded rows]: the layout made
            expanded = {name: made["expand_" + name] for name in ("counts", "ends", "row_of", "source_row", "metadata")}
        return DispatchResult(*outputs[:4], per_expert_list, handle, most_call_tokens, expanded)

    def combine_plan(self, num_tokens: int, hidden: int, num_topk: int, num_biases: int, num_sms: int,
                     placed: bool) -> plans.Plan:
        """Inputs COMBINE_INPUTS -> (combined_x, combined_topk_weights) unless
        `placed` (a round of a call in rounds writes into the whole call's tensors, given as inputs).
        `num_biases` only enters the call's signature (NOTE [call signatures])."""
        def build():
            num_ranks = self.ctx.num_ranks
            layout = workspace.normal_layout(self.ctx.num_nvl_bytes, num_ranks,
                                             workspace.normal_combine_row_bytes(hidden, num_topk))
            num_blocks = heuristics.data_blocks(num_sms, self.device_sms)
            b = self._builder(COMBINE_INPUTS)
            if placed:
                combined_x, combined_w = b.inp("combined_x"), b.inp("combined_topk_weights")
            else:
                whole = b.whole()  # NOTE [plan allocations]
                combined_x = b.part(whole, "combined_x", (num_tokens, hidden), torch.bfloat16)
                combined_w = b.part(whole, "combined_topk_weights", (num_tokens, num_topk), torch.float32) \
                    if num_topk else 0
            threads = heuristics.combine_threads(num_ranks)
            send_warps = heuristics.combine_send_warps(threads // 32, num_ranks)
            kernel = self._kernel(kernels.combine(num_ranks, hidden * 2 // 16, num_topk, send_warps,
                                                  heuristics.combine_stages(), heuristics.combine_reduce_loads(threads),
                                                  threads))
            b.launch(kernel, num_blocks, dict(
                x=b.inp("x"), topk_weights=b.inp("topk_weights"), bias_0=b.inp("bias_0"), bias_1=b.inp("bias_1"),
                rank_prefix_matrix=b.inp("rank_prefix_matrix"), recv_first=b.inp("recv_first"),
                send_head=b.inp("send_head"), num_tokens=num_tokens,
                combined_x=combined_x, combined_topk_weights=combined_w,
                local_direct=int(heuristics.combine_own_rows_direct()),
                **self._normal_buffer_args(layout),
                signature=self._signature("combine", hidden=hidden, num_topk=num_topk, num_biases=num_biases),
                **self._wait_args(), phases=self._phases_ptr(1)))
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

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer:
            if self._low_latency_kernels is not None:
                return self._low_latency_kernels.buffer.tensor
            return self._low_latency.local_buffer(True)
        return self.normal.tensor

    def destroy(self, together: bool = True) -> None:
        torch.cuda.synchronize(self.device_index)
        # NVSHMEM's frees and stop are collective, without a deadline (NOTE [NVSHMEM stop] in transport.py): only
        # once every rank came to a meeting first (a late peer does, a lost one cannot), never after a peer was lost.
        nvshmem_users = [u for u in (self._internode, self.heap_buffer) if u is not None]
        lost = getattr(self.ctx.collectives, "peer_lost", False)
        if together and not lost and nvshmem_users:
            lost = not meet(self.ctx)
        if self._internode is not None:
            self.ctx.collectives.device_all_gather = None
        for user in nvshmem_users:
            if together and not lost:
                user.free()
            elif together:
                user.transport.abandon()
        self._internode = self.heap_buffer = None
        held = [b for b in (self.normal, self.low_latency_buffer) if b is not None]
        # The arena's memory is unmapped and met over as the buffers', but freed by its last tensor (OutputArena).
        mapped = held + ([self.output_arena.memory] if self.output_arena is not None else [])
        self.normal = self.low_latency_buffer = self.output_arena = None
        for buffer in mapped:
            buffer.unmap_peers()
        if mapped and together:  # NOTE [symmetric lifetime] in memory.py
            meet(self.ctx)
        for buffer in held:
            buffer.free()
        # The arena's memory goes once no tensor holds a block (memory.OutputArena): the plans let go of it here.
        self._plans = plans.PlanCache()
        self.calls.forget()
        self.calls.set_host_counts(0, 0, 0, 0.0)  # NOTE [counted finish]: no fast call reads them after this
        for ptr in (self.host_record_ptr, self.host_counts_ptr):
            runtime.host_free(ptr)
        self.host_record_ptr = self.host_counts_ptr = 0
        self._low_latency.destroy()
