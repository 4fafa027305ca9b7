"""`Buffer`: the DeepEP-compatible front-end.

It checks every argument (checks.py), chooses a backend, moves work onto the communication stream as
DeepEP does, and hands the backend one validated request per call. The meaning of each call is
docs/semantics.md and routing.py.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import checks, env, ops
from .backends import create_backend, make_reference, normal_mode_backend
from .backends.base import GroupContext
from .backends.collectives import Collectives, agree_on_buffer, choose_mode, gather_objects, making_wait_s
from .buffer_low_latency import LowLatencyCalls
from .buffer_normal import NormalCalls
from .config import Config
from .errors import BackendUnavailableError, InvalidInputError, TokenyardError
from .event import EventHandle, EventOverlap
from .plan import devices, workspace

_buffer_ids = itertools.count(1)


class _Scope:
    """What a stream scope leaves behind: the caller's event and the stream that owns new tensors."""

    def __init__(self):
        self.event = EventOverlap(None)
        self.owner = None


def _as_field(value) -> int:
    """An optional int setting in a header (NOTE [call agreement]): 0 for None, -1 for what is no int (which a
    later check refuses)."""
    if value is None:
        return 0
    return value if type(value) is int else -1


def _chosen_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """`Buffer(device=...)`: None for the rule (NOTE [device rule]), else "cpu" or a CUDA device."""
    if device is None:
        return devices.default_device()
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError("device='cuda', but PyTorch sees no GPU here")
        return torch.device("cuda", chosen.index if chosen.index is not None else torch.cuda.current_device())
    if chosen.type != "cpu":
        raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return chosen


class Buffer(NormalCalls, LowLatencyCalls):
    """Communication buffers and operations for expert-parallel dispatch and combine.

    Naive equivalent: `dispatch` is an all-to-all that sends each token to every rank holding one of
    its top-k experts; `combine` is the reverse all-to-all followed by a sum per token.

    Arguments (DeepEP's, in the order of DeepEP main's legacy Buffer, which dropped V1's `use_fabric`):
        group: the EP process group (any `torch.distributed` group; a subgroup is fine).
        num_nvl_bytes: normal-mode buffer size per rank, the memory budget of `dispatch` and `combine`
            (see `Config.get_nvl_buffer_size_hint`); capped by TOKENYARD_NVL_BUFFER_BYTES where that is set
            and smaller (the attribute `num_nvl_bytes` keeps the value asked for, `nvl_bytes_held` the
            bytes held). A call with more tokens than one round of the buffer holds runs in rounds, with
            the one-shot results (NOTE [rounds] in rounds.py; `normal_round_plan` reports the sizes).
        num_rdma_bytes: low-latency buffer size per rank (see `get_low_latency_rdma_size_hint`).
        low_latency_mode: accepted; low-latency calls work on any Buffer with enough `num_rdma_bytes`.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: RDMA settings of DeepEP; accepted and
            ignored (every rank is reached over NVLink).
        explicitly_destroy: accepted; `destroy()` works either way, and the destructor frees what is left.
        enable_shrink: allow rank masking in low-latency mode (`low_latency_update_mask_buffer` ...).
        comm: an mpi4py communicator used where `group` is None (CUDA backend only).
    Keyword only:
        use_fabric: DeepEP V1's fabric setting (its eighth positional parameter there, dropped by DeepEP main);
            accepted and ignored.
    tokenyard's own, keyword only:
        backend: "auto" (CUDA where it works, else reference), "reference" or "cuda"; default from
            TOKENYARD_BACKEND.
        timeout_s: deadline of every wait for a peer (default TOKENYARD_TIMEOUT_S, 100 s); destroying the Buffer
            waits at least HOST_SKEW_FLOOR_S (5 s), making it twice as long as that (backends/collectives.py,
            making_wait_s).
        check_inputs: debug mode: also check values (expert ids, layout tensors) on the host before any
            communication, at the cost of a device sync per call (default TOKENYARD_CHECK_INPUTS, off: the
            dispatch's count exchange judges them, NOTE [input verdict] in checks.py).
        per_round_tokens: tokens per rank in one round of a normal-mode call (default: as many as
            `num_nvl_bytes` holds for the dispatch rows and for combine rows of the same hidden size);
            a call whose rows do not fit that many raises CapacityError saying the bytes it needs.
        ranks_per_node: split the group into nodes of this many consecutive ranks, as the runtime queries
            and normal mode see it (default TOKENYARD_RANKS_PER_NODE, else a node per host; NOTE [virtual nodes]
            in devices.py); on several nodes normal mode takes the hierarchical path (docs/semantics.md
            "Internode normal mode"): the CUDA backend's internode kernels where NVSHMEM is installed, else the
            reference backend's (NOTE [internode normal mode]).
        device: "cpu" or "cuda" (the current CUDA device) to override the device rule: by default the
            current CUDA device wherever PyTorch sees a GPU, whatever the group's backend, else the CPU
            (NOTE [device rule] in devices.py). Calls given CPU tensors on a GPU Buffer run on the CPU.

    The group only carries host-side exchanges and collectives: its ranks may share GPUs (under MPS for the
    CUDA backend, NOTE [shared GPUs] in devices.py), and a gloo group serves a Buffer on GPUs.

    Raises:
        BackendUnavailableError: ``backend="cuda"`` where the CUDA backend cannot run.
        InvalidInputError: a negative size, `per_round_tokens` not a positive int, a bad `ranks_per_node`,
            ranks on GPUs and on the CPU in one group, or GPUs that serve different numbers of ranks.
    """

    num_sms: int = 20
    # Whether normal mode takes the hierarchical path on several nodes (NOTE [internode normal mode]); False
    # for ElasticBuffer's Buffer (NOTE [elastic nodes] in elastic.py).
    _normal_mode_sees_nodes: bool = True

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 use_fabric: bool = False, backend: Optional[str] = None, timeout_s: Optional[float] = None,
                 check_inputs: Optional[bool] = None, per_round_tokens: Optional[int] = None,
                 ranks_per_node: Optional[int] = None, device: Optional[Union[str, torch.device]] = None) -> None:
        del num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric  # see docstring
        settings = env.settings()
        self.timeout_s = checks.timeout_s(timeout_s if timeout_s is not None else settings.timeout_s)
        self.device = _chosen_device(device)
        if group is not None:
            self.rank, self.group_size = group.rank(), group.size()
            rank, chosen, wait_s = self.rank, self.device, making_wait_s(self.timeout_s)

            def all_gather_object(obj):  # not `self`: see NOTE [gloo threads at exit] in launch.py
                return gather_objects(group, obj, chosen, rank, "Buffer/exchange", wait_s)  # NOTE [making waits]
        elif comm is not None:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
            all_gather_object = comm.allgather
        else:
            raise InvalidInputError("Buffer needs a process group (or an mpi4py comm)")
        num_nvl_bytes = checks.size_int("num_nvl_bytes", num_nvl_bytes)
        num_rdma_bytes = checks.size_int("num_rdma_bytes", num_rdma_bytes)
        if per_round_tokens is not None:
            per_round_tokens = checks.size_int("per_round_tokens", per_round_tokens, positive=True)
        # NOTE [requested and held bytes]: `num_nvl_bytes` stays what the caller asked for, since DeepEP
        # code compares it with a size hint to decide whether to make a new Buffer (Megatron's get_buffer
        # does, before every call): a capped value would make it rebuild the Buffer at every call. What the
        # Buffer holds, and plans its rounds by, is `nvl_bytes_held`.
        self.nvl_bytes_held = num_nvl_bytes
        if settings.nvl_buffer_bytes and num_nvl_bytes > settings.nvl_buffer_bytes:
            env.log(f"num_nvl_bytes {num_nvl_bytes} capped at TOKENYARD_NVL_BUFFER_BYTES={settings.nvl_buffer_bytes}")
            self.nvl_bytes_held = settings.nvl_buffer_bytes
        self.group = group if group is not None else comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.per_round_tokens = per_round_tokens
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.check_inputs = settings.check_inputs if check_inputs is None else bool(check_inputs)
        if ranks_per_node is None and settings.ranks_per_node:
            ranks_per_node = settings.ranks_per_node
        # NOTE [call agreement] in collectives.py: the first exchange has the size of a call's header
        agree_on_buffer(group, self.rank, self.device, self.timeout_s, nvl_bytes_held=self.nvl_bytes_held,
                        num_rdma_bytes=num_rdma_bytes, per_round_tokens=per_round_tokens or 0,
                        ranks_per_node=_as_field(ranks_per_node),
                        enable_shrink=int(bool(enable_shrink)))
        self._id = next(_buffer_ids)
        ops.register(self)
        self._twin: Optional["Buffer"] = None
        self.ranks_per_node = ranks_per_node
        self.topology = devices.gather_topology(self.rank, all_gather_object, self.device, ranks_per_node)
        mode = "direct" if group is None else choose_mode(str(dist.get_backend(group)), self.device.type,
                                                          self.topology.shares_gpu)
        self._exchange = Collectives(group, self.device, mode, self.rank, self.group_size, all_gather_object,
                                     self.timeout_s)

        context = GroupContext(group=group, rank=self.rank, num_ranks=self.group_size, device=self.device,
                               all_gather_object=all_gather_object, num_nvl_bytes=self.nvl_bytes_held,
                               num_rdma_bytes=num_rdma_bytes, timeout_s=self.timeout_s, topology=self.topology,
                               collectives=self._exchange)
        self.runtime = create_backend(backend or settings.backend, context)
        self.backend = self.runtime.name
        # NOTE [internode normal mode] in backends/__init__.py
        self._internode = self._normal_mode_sees_nodes and self.topology.num_nodes > 1
        self._normal_runtime = self._normal_mode_runtime(backend or settings.backend, context)
        if self._internode and self._normal_runtime is not None:
            self._normal_runtime.start_internode()
        self._comm_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._fast = None  # NOTE [fast paths]
        self._last_rounds = self._last_round_tokens = 0  # the last normal call's, for the fast paths to learn
        self._learnable_shape = None  # the CUDA backend's DispatchShape of the last dispatch (a fresh one's round 0)
        if self.backend == "cuda":
            from .backends.cuda.fast_paths import FastPaths

            self._fast = FastPaths(self)
        self._rank_mask = None
        if enable_shrink:
            self._rank_mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)

    def _normal_mode_runtime(self, requested: str, context: GroupContext):
        """NOTE [internode normal mode]: the backend that runs this Buffer's normal-mode calls, None where
        they are refused (`backend="cuda"` on several nodes)."""
        num_nodes = self.topology.num_nodes if self._internode else 1
        missing = None
        if self.runtime.name == "cuda" and num_nodes == 1 and self.topology.num_hosts > 1:
            # One node over several hosts (ElasticBuffer's Buffer): the intranode kernels cannot span them.
            num_nodes = self.topology.num_hosts
            missing = "the intranode kernels cannot span hosts (NOTE [several hosts])"
        elif num_nodes > 1 and self.runtime.name == "cuda":  # decided together: every rank takes the same path
            reasons = context.all_gather_object(self.runtime.internode_missing())
            missing = next((r for r in reasons if r is not None), None)
        runs_on = normal_mode_backend(requested, self.runtime.name, num_nodes, internode_kernels=missing is None)
        if runs_on is None or runs_on == self.runtime.name:
            return None if runs_on is None else self.runtime
        if context.group is None:  # an mpi4py comm: the reference backend needs a torch.distributed group
            return None
        message = (f"the group has {self.topology.num_nodes} nodes and the CUDA backend cannot run its internode "
                   f"kernels here ({missing}): normal mode (layout, dispatch, combine) runs on the reference "
                   "backend, low-latency mode on CUDA")
        env.log(f"rank {self.rank}: {message}")
        if self.rank == 0:
            warnings.warn(f"tokenyard: {message}", stacklevel=3)
        return make_reference(context)

    def _normal_backend(self):
        """The backend of a normal-mode call (NOTE [internode normal mode])."""
        own = self._backend()
        if self._normal_runtime is None:
            raise BackendUnavailableError(
                f"normal-mode calls on a group of {self.topology.num_nodes} nodes need the {own.name} backend's "
                "internode kernels, which cannot run here (NVSHMEM: pip install tokenyard[internode], and nvcc): "
                "install them, or use backend='auto' or 'reference' (the reference backend's hierarchical path), or "
                "ranks_per_node equal to the group size; low-latency calls work here")
        return self._normal_runtime

    def _cpu_twin(self) -> "Buffer":
        """NOTE [device rule]: the Buffer that serves this one's calls on CPU tensors, made at the first such
        call (every rank makes the same calls, so all make it together)."""
        if self._twin is None:
            if not isinstance(self.group, dist.ProcessGroup):
                raise InvalidInputError("CPU tensors on a GPU Buffer need a torch.distributed group (gloo)")
            self._twin = type(self)(self.group, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode,
                                explicitly_destroy=self.explicitly_destroy, enable_shrink=self.enable_shrink,
                                backend="reference", timeout_s=self.timeout_s, check_inputs=self.check_inputs,
                                per_round_tokens=self.per_round_tokens, ranks_per_node=self.ranks_per_node,
                                device="cpu")
        return self._twin

    # -- lifetime ---------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the buffers; later calls raise. Safe to call twice. Every rank calls it, as DeepEP's (NOTE
        [symmetric lifetime] in backends/cuda/memory.py: the ranks meet, bounded by timeout_s but never less
        than HOST_SKEW_FLOOR_S, collectives.meeting_wait_s)."""
        self._destroy(together=True)

    def _destroy(self, together: bool) -> None:
        self._fast = None
        if self.runtime is not None:
            if self._normal_runtime is not None and self._normal_runtime is not self.runtime:
                self._normal_runtime.destroy(together)
            self._normal_runtime = None
            self.runtime.destroy(together)
            self.runtime = None
            self._exchange.destroy()
        if self._twin is not None:
            self._twin._destroy(together)

    def __del__(self):
        try:
            self._destroy(together=False)  # the ranks collect their Buffers at different times
        except Exception:  # noqa: BLE001 - nothing useful to do at interpreter teardown
            pass

    def _backend(self):
        if self.runtime is None:
            raise TokenyardError("this Buffer was destroyed")
        return self.runtime

    # -- static helpers (DeepEP's) ----------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the CUDA backend can compile its kernels for this machine's GPU."""
        from .backends import cuda_available

        return cuda_available()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the normal-mode kernels may use (even, as in DeepEP)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise InvalidInputError(f"the SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (empty on a machine without CUDA)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """`num_rdma_bytes` a low-latency Buffer needs (NOTE [low-latency buffer] in workspace.py)."""
        return workspace.low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default dispatch `Config` for `num_ranks` ranks (any count works). One for every count: its chunk
        sizes mean nothing here (each source writes a region of its own, docs/semantics.md), which leaves the
        SM count, `Buffer.num_sms`: 20, DeepEP's (the kernels' times by SM count at 2 and 4 ranks:
        benchmarks/results/normal.md, "The SM sweep")."""
        del num_ranks
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default combine `Config` for `num_ranks` ranks (any count works; see `get_dispatch_config`)."""
        del num_ranks
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream communication runs on (None on CPU)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's raw buffer from byte `offset`, viewed as `dtype` (and as `size` where given)."""
        raw = self._backend().local_buffer(use_rdma_buffer)
        element = dtype.itemsize
        if offset < 0 or offset % element != 0 or offset > raw.numel():
            raise InvalidInputError(f"offset {offset} is outside the buffer or not a multiple of {element}")
        usable = (raw.numel() - offset) // element * element
        tensor = raw[offset:offset + usable].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if tensor.numel() < size.numel():
            raise InvalidInputError(f"the buffer holds {tensor.numel()} elements, fewer than {size.numel()}")
        return tensor[:size.numel()].view(size)

    # -- streams ----------------------------------------------------------------------------------------

    def _refuse_capture(self, backend, what: str, cpu_wait: bool = False) -> None:
        """NOTE [graph capture]
        A normal-mode call inside a CUDA-graph capture runs on replay only what the GPU does, so it is
        refused unless the GPU does all of it: the backend counts its calls on the GPU
        (Backend.CAPTURES_NORMAL_MODE; the reference backend exchanges counts through the host), and the
        CPU waits for nothing (a fresh dispatch without num_worst_tokens waits for the received counts to
        size its outputs). Host values the call reads (shapes, the rounds, which derive from them) are the
        same at every replay; DeepEP's value checks (check_inputs) are skipped while capturing."""
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return
        if self._internode:
            raise InvalidInputError(f"a {what} on a group of {self.topology.num_nodes} nodes cannot run inside a "
                                    "CUDA-graph capture: internode calls exchange counts through the host")
        if not backend.CAPTURES_NORMAL_MODE:
            raise InvalidInputError(f"the {backend.name} backend cannot run a {what} inside a CUDA-graph capture: "
                                    "its count exchange goes through the host; use the CUDA backend")
        if cpu_wait:
            raise InvalidInputError(f"a {what} inside a CUDA-graph capture needs num_worst_tokens "
                                    "(ElasticBuffer: do_cpu_sync=False): without it the CPU waits for the "
                                    "received counts, which a capture never computes")

    def _check_values(self, previous_event: Optional[EventOverlap] = None) -> bool:
        """Whether the debug mode's host checks read the inputs' values (NOTE [input verdict] in checks.py). They
        read them on the caller's stream, so where the inputs are ready only at `previous_event` (made on
        another stream, NOTE [stream contract]) the host first waits for that event."""
        if not self.check_inputs or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return False
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.synchronize()
        return True

    @contextlib.contextmanager
    def _stream_scope(self, *, use_comm_stream: bool, previous_event: Optional[EventOverlap] = None,
                      async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Run the body on the communication stream, as DeepEP's kernels run (NOTE [stream contract]).

        The comm stream first waits for `previous_event` (or the current stream). Afterwards, with
        `async_finish` the scope's event is recorded for the caller; otherwise the current stream waits
        for the comm stream. Tensors made in the body are handed to the caller's stream (`scope.owner`),
        whichever stream's pool they came from. Without CUDA, or with `use_comm_stream` False, the body runs
        where it is; so does a synchronous call on a stream that already waited for all of the comm
        stream's work (NOTE [joined stream]).

        NOTE [stream contract]
        docs/semantics.md ("Streams and events") states it for users; this scope is where it is kept. Every
        piece of a call's device work, the torch operations around the kernels included (a `.contiguous()`
        copy, ElasticBuffer's expanded layout), runs inside one scope, after the comm stream waited for
        `previous_event`: the inputs are ready at that event, which may come from a stream the caller's never
        waited for, so no work of the call may run on the caller's stream before the scope. Outputs are
        marked as used by the caller's stream (`record_stream`) even with `allocate_on_comm_stream`, where
        DeepEP marks them only in an asynchronous call: otherwise an output the caller frees while its stream
        still reads it goes back to the comm stream's pool, and a later call that waits only for a
        `previous_event` recorded before those reads could write into it.

        NOTE [joined stream]
        A synchronous call (no `async_finish`, no `previous_event`, outputs on the caller's stream) ends with
        the caller's stream waiting for the comm stream, so its kernels could as well have run on the
        caller's stream itself: nothing else can run between them. The *joined* stream is the caller's
        stream that has waited for everything this Buffer put on the comm stream, none after an asynchronous
        call; a synchronous call on that stream runs its kernels there directly, saving the four driver calls
        (two event records, two waits) that cross to the comm stream and back. The stream that last ran
        kernels so is noted; the next call that uses the comm stream makes it wait for that stream first,
        unless it waits for it anyway, so the Buffer's kernels stay in one order whatever streams the calls
        use. A CUDA-backend Buffer keeps this state in C++, where its fast paths read it too (`runs_straight`,
        `catch_up`, NOTE [fast calls] in csrc/call_plan.cpp); other Buffers always cross.
        """
        scope = _Scope()
        if self._comm_stream is None or not use_comm_stream:
            yield scope
            return
        # NOTE [host cost per call]: torch.cuda.current_stream() and torch.cuda.stream() resolve the device
        # through several Python layers; the raw getters below do the same at a fraction of the host time.
        device_index = self.device.index
        waited = previous_event.event if previous_event is not None else None
        waits_for_event = waited is not None and waited.event is not None
        caller_device = torch._C._cuda_getDevice()  # set_stream also makes the stream's device current
        order = self._fast.calls if self._fast is not None else None
        if order is not None and not allocate_on_comm_stream and caller_device == device_index and order.runs_straight(
                torch._C._cuda_getCurrentRawStream(device_index), waits_for_event, async_finish):
            yield scope  # tensors made here are the caller's stream's already: scope.owner stays None
            return
        stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(device_index)
        compute = torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        behind = -1 if order is None else order.catch_up(compute.cuda_stream, not waits_for_event)
        if behind >= 0:
            self._comm_stream.wait_stream(torch.cuda.ExternalStream(behind, device=self.device))
        if waits_for_event:
            self._comm_stream.wait_event(waited.event)
        else:
            self._comm_stream.wait_stream(compute)
        torch.cuda.set_stream(self._comm_stream)
        try:
            yield scope
        except BaseException:
            # A call that raised (a refusal, a timeout) leaves no work forked off the caller's stream: a capture
            # would end with "unjoined work", and the caller's next work would not follow the comm stream's.
            compute.wait_stream(self._comm_stream)
            if order is not None:
                order.set_joined(compute.cuda_stream)
            raise
        finally:
            torch.cuda.set_stream(compute)
            if caller_device != device_index:
                torch.cuda.set_device(caller_device)
        if async_finish:
            scope.event = EventOverlap(EventHandle(self._comm_stream))
        else:
            compute.wait_stream(self._comm_stream)
        if order is not None:
            order.set_joined(-1 if async_finish else compute.cuda_stream)
        scope.owner = compute

    @staticmethod
    def _hand_over(stream, tensors) -> None:
        """Mark `tensors` (tensors, Nones, or tuples of them such as FP8 data with scales) as used by `stream`."""
        if stream is None:
            return
        for t in tensors:
            for u in t if isinstance(t, (tuple, list)) else (t,):
                if isinstance(u, torch.Tensor):
                    u.record_stream(stream)
