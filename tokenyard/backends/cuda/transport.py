"""NVSHMEM's host side (NOTE [transport seam] in include/tokenyard/transport.cuh): started once per process from a
unique id that the group's ranks exchange over torch.distributed (no MPI, no nvshmrun), symmetric memory, and
the kernels that call NVSHMEM, each module registered before its first launch (NOTE [NVSHMEM units]).

NOTE [NVSHMEM start]
NVSHMEM has one world per process: the ranks of the group that started it, each a PE of the same number. So a
process starts it once, for one group (`Transport.start`; a second start for the same group shares it, one for
another group is refused), and stops it when the last user closes. Before the start we set, unless the user
has: NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off: it can take a host's GPUs out of service);
NVSHMEM_SYMMETRIC_SIZE to what the users ask for, rounded up, where it is unset (NVSHMEM's default reserves a
gigabyte or more of every GPU's memory for the symmetric heap); NVSHMEM_DISABLE_CUDA_VMM=1 (the heap made whole
at the start, as sized: a heap grown as asked refused allocations that fit it, with several PEs on one GPU
(benchmarks/results/internode_low_latency.md) and with one GPU per rank alike: the 1.94 GB low-latency buffer of
the DeepSeek-V3 decode in a 3.96 GB heap, benchmarks/results/low_latency.md); and where ranks share a GPU under
MPS, NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 (NVSHMEM otherwise refuses several PEs per GPU unless their
MPS shares sum to at most 100%). Symmetric allocations are collective: every rank of the group makes the same ones
in the same order.

NOTE [NVSHMEM stop]
NVSHMEM's frees and its stop are collective too, and wait for every PE without a deadline: with a peer's process
gone they would never return. So every rank of a Buffer that holds NVSHMEM memory comes to a bounded meeting at
`destroy` before freeing it (a late peer comes, a lost one cannot). A Buffer that saw a peer's connection close
(`Collectives.peer_lost`), or whose ranks did not all come, leaves its symmetric memory to the process's end
instead (`abandon`), and NVSHMEM is not started again in that process: its world still counts the lost PE. The
meeting is every rank's, not only theirs that timed out: a late rank and its peers time out at different stages
(the peers at the call's host agreement, the late rank in the device exchange after it), and ranks that met only
where they had timed out left the late rank abandoning alone and the others in a free it never joined
(`sleeps_past_the_deadline` at 2 x 2 virtual nodes: benchmarks/results/shared_gpu.md). A rank that saw nothing of a
loss waits in the meeting's deadline, then abandons too.

NOTE [NVSHMEM waits]
A C call cannot be interrupted to raise, so NVSHMEM's collective waits (start, allocation, free, stop) cannot end
at a deadline as tokenyard's own do. They are not silent either: while a rank waits in one, a thread of its process
prints, every STUCK_REPORT_S, which rank waits in which of them and for how long (`_watched`). ctypes lets go of the
GIL during the call, so the thread runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Callable, List, Optional

from ... import env
from ...errors import BackendUnavailableError
from ...jit import cache as kernel_cache
from ...jit import nvshmem
from ...jit.spec import KernelSpec
from ...plan import headers

_HEAP_ALIGN = 1 << 21  # NVSHMEM maps its heap in 2 MiB pages
# NOTE [operation counters] (include/tokenyard/operation_counts.cuh): the define that compiles them in (the setting's
# name too) and the global they are in.
COUNTING_DEFINE = "TOKENYARD_COUNT_OPERATIONS"
COUNTERS_SYMBOL = "tokenyard_operation_counts"
_lock = threading.Lock()
_started: Optional["Transport"] = None
STUCK_REPORT_S = 60.0  # NOTE [NVSHMEM waits]: a minute, far past what they take when every rank comes


@contextlib.contextmanager
def _watched(rank: int, what: str):
    """NOTE [NVSHMEM waits]: while the block runs, a line to stderr every STUCK_REPORT_S naming `rank` and `what`."""
    start, done = time.monotonic(), threading.Event()

    def report():
        while not done.wait(STUCK_REPORT_S):
            print(f"[tokenyard] rank {rank} has waited {time.monotonic() - start:.0f} s in NVSHMEM's {what}, which "
                  "waits for every rank of the group without a deadline (NOTE [NVSHMEM waits]): a rank has not come "
                  "to it (late, or gone)", file=sys.stderr, flush=True)

    reporter = threading.Thread(target=report, name=f"tokenyard-nvshmem-{what}", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()  # no report after the call returned


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _other_world(global_ranks: tuple) -> Optional[str]:
    """Why NVSHMEM, as started in this process, cannot serve the group of `global_ranks` (under _lock)."""
    if _started is not None and _started.abandoned:
        return ("NVSHMEM was left running in this process after a peer of its group was lost (NOTE [NVSHMEM stop]); "
                "it cannot start again here")
    if _started is not None and _started.ranks != tuple(global_ranks):
        return (f"NVSHMEM is started in this process for ranks {_started.ranks}; it has one world per process, so it "
                f"cannot serve ranks {tuple(global_ranks)} too")
    return None


class Transport:
    """NVSHMEM started for one group in this process."""

    abandoned = False  # NOTE [NVSHMEM stop]

    def __init__(self, shim: ctypes.CDLL, ranks: tuple):
        self.shim, self.ranks = shim, ranks
        self.rank, self.num_ranks = shim.tokenyard_nvshmem_my_pe(), shim.tokenyard_nvshmem_n_pes()
        self.users = 0
        self._registered = set()
        self.count_operations = env.settings().count_operations  # NOTE [operation counters]
        self._counting = {}  # module -> (Kernel, device index): the modules whose counters operation_counts reads

    @staticmethod
    def refusal(global_ranks: tuple) -> Optional[str]:
        """Why `start` would refuse the group of `global_ranks` in this process (no collective), or None."""
        if nvshmem.find() is None:
            return nvshmem.missing_reason()
        with _lock:
            return _other_world(global_ranks)

    @staticmethod
    def start(rank: int, num_ranks: int, all_gather_object: Callable, global_ranks: tuple, heap_bytes: int,
              shares_gpu: bool) -> "Transport":
        """NVSHMEM for the group whose members are `global_ranks` (this process being `rank` of `num_ranks`), with
        a symmetric heap of at least `heap_bytes`; collective over the group (NOTE [NVSHMEM start]).

        Raises:
            BackendUnavailableError: NVSHMEM is missing, its shim does not build, it does not start, or it is
                started for another group in this process.
        """
        global _started
        with _lock:
            if _started is not None:
                refused = _other_world(global_ranks)
                if refused is not None:
                    raise BackendUnavailableError(refused)
                _started.users += 1
                return _started
            if nvshmem.find() is None:
                raise BackendUnavailableError(nvshmem.missing_reason())
            os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_round_up(max(heap_bytes, 1), _HEAP_ALIGN)))
            os.environ.setdefault("NVSHMEM_DISABLE_CUDA_VMM", "1")
            if shares_gpu:
                os.environ.setdefault("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "1")
            try:
                shim = ctypes.CDLL(nvshmem.shim_path())
            except Exception as exc:  # CompileError or OSError: the message says what is missing
                raise BackendUnavailableError(f"the NVSHMEM host shim is not usable: {exc}") from exc
            for name in ("tokenyard_nvshmem_calloc", "tokenyard_nvshmem_ptr"):
                getattr(shim, name).restype = ctypes.c_void_p
            shim.tokenyard_nvshmem_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int]
            shim.tokenyard_nvshmem_calloc.argtypes = [ctypes.c_size_t]
            uid = ctypes.create_string_buffer(shim.tokenyard_nvshmem_uid_bytes())
            status = shim.tokenyard_nvshmem_uid(uid) if rank == 0 else 0
            ids = all_gather_object((status, uid.raw if rank == 0 else None))
            if ids[0][0] != 0:
                raise BackendUnavailableError(f"nvshmemx_get_uniqueid failed on rank 0 (status {ids[0][0]})")
            root_id = ids[0][1]
            with _watched(rank, "start"):
                status = shim.tokenyard_nvshmem_init(rank, num_ranks, ctypes.create_string_buffer(root_id,
                                                                                                   len(root_id)))
            if status != 0:
                raise BackendUnavailableError(f"NVSHMEM did not start on rank {rank} (status {status}); "
                                              "NVSHMEM_DEBUG=INFO says why")
            _started = Transport(shim, tuple(global_ranks))
            if (_started.rank, _started.num_ranks) != (rank, num_ranks):
                raise BackendUnavailableError(f"NVSHMEM made rank {rank} of {num_ranks} PE {_started.rank} of "
                                              f"{_started.num_ranks}")
            _started.users = 1
            return _started

    def close(self) -> None:
        """One user less; the last stops NVSHMEM (collective then)."""
        global _started
        with _lock:
            self.users -= 1
            if self.users == 0 and _started is self:
                with _watched(self.rank, "stop"):
                    self.shim.tokenyard_nvshmem_finalize()
                _started = None

    def abandon(self) -> None:
        """NOTE [NVSHMEM stop]: a peer of the group is gone; no collective of NVSHMEM runs in this process again."""
        self.abandoned = True

    def alloc(self, num_bytes: int) -> int:
        """Zeroed symmetric memory (collective: every rank makes the same allocations in the same order)."""
        with _watched(self.rank, "allocation"):
            ptr = self.shim.tokenyard_nvshmem_calloc(num_bytes)
        if not ptr:
            heap = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
            raise BackendUnavailableError(f"NVSHMEM could not allocate {num_bytes} symmetric bytes on rank "
                                          f"{self.rank} (NVSHMEM_SYMMETRIC_SIZE={heap})")
        return ptr

    def free(self, ptr: int) -> None:
        with _watched(self.rank, "free"):
            self.shim.tokenyard_nvshmem_free(ctypes.c_void_p(ptr))

    def peer_pointers(self, ptr: int) -> List[int]:
        """For each PE, `ptr`'s address there where this GPU can load and store it directly, else 0."""
        return [self.shim.tokenyard_nvshmem_ptr(ctypes.c_void_p(ptr), pe) or 0 for pe in range(self.num_ranks)]

    def load(self, spec: KernelSpec, device_index: int, counted: bool = True):
        """The kernel of an NVSHMEM unit, its module registered with NVSHMEM once (NOTE [NVSHMEM units]); under
        TOKENYARD_COUNT_OPERATIONS the unit's counting variant (NOTE [operation counters]), unless not `counted`
        (the calls' small exchanges, NOTE [device exchange])."""
        if self.count_operations and counted:
            most = headers.constant("operation_counts.cuh", "kCountedPeers")
            if self.num_ranks > most:
                raise BackendUnavailableError(f"operation counters have rows for {most} ranks, not {self.num_ranks} "
                                              "(NOTE [operation counters]): unset TOKENYARD_COUNT_OPERATIONS")
            spec = counting(spec)
        kernel = kernel_cache.load(spec, device_index)
        if kernel.module not in self._registered:
            status = self.shim.tokenyard_nvshmem_cumodule_init(ctypes.c_void_p(kernel.module))
            if status != 0:
                raise BackendUnavailableError(f"nvshmemx_cumodule_init failed for {spec.name} (status {status})")
            self._registered.add(kernel.module)
            if self.count_operations and counted:
                self._counting[kernel.module] = (kernel, device_index)
        return kernel

    def operation_counts(self):
        """What this process's NVSHMEM kernels asked of the transport since the last read, which zeroes it (NOTE
        [operation counters]): int64 ``[1 + num_ranks, kNumCountedOperations]`` on the CPU, row 0 what names no rank
        (quiets, fences), row 1 + q what went to rank q, columns as CountedOperation orders them. Waits for the
        device, before the read and after the zeroing.

        Raises:
            BackendUnavailableError: TOKENYARD_COUNT_OPERATIONS is off (the kernels count nothing).
        """
        import torch

        from .runtime import byte_view

        if not self.count_operations:
            raise BackendUnavailableError("operation counts need TOKENYARD_COUNT_OPERATIONS=1 in the environment of "
                                          "the rank's process from its start (NOTE [operation counters])")
        columns = headers.enum("operation_counts.cuh", "CountedOperation")["kNumCountedOperations"]
        total = torch.zeros(1 + self.num_ranks, columns, dtype=torch.int64, device="cpu")
        for kernel, device_index in self._counting.values():
            found = kernel.global_address(COUNTERS_SYMBOL)  # None: a unit that calls no counted function
            if found is None:
                continue
            torch.cuda.synchronize(device_index)
            words = byte_view(*found, torch.device("cuda", device_index)).view(torch.int64).view(-1, columns)
            total += words[:1 + self.num_ranks].cpu()
            words.zero_()
            torch.cuda.synchronize(device_index)
        return total


@functools.lru_cache(maxsize=None)
def counting(spec: KernelSpec) -> KernelSpec:
    """The unit with its operation counters compiled in (NOTE [operation counters])."""
    return dataclasses.replace(spec, defines=spec.defines + (COUNTING_DEFINE,))


class HeapBuffer:
    """`num_bytes` of the symmetric heap on every rank, seen as the low-latency kernels see a buffer (`bases`, one
    per rank, and this rank's `tensor`) where some ranks are on other nodes (NOTE [internode low-latency] in
    include/tokenyard/sync.cuh): a rank of this rank's node by its address here (nvshmem_ptr), one of another
    node by this rank's own address, the symmetric one its puts name; `remote` has a bit per rank of another
    node. Holds one use of the transport. Allocation and free are collective."""

    def __init__(self, transport: Transport, num_bytes: int, device, ranks_per_node: int):
        from .runtime import byte_view

        self.transport = transport
        self.ptr = transport.alloc(num_bytes)
        peers = transport.peer_pointers(self.ptr)
        node = transport.rank // ranks_per_node
        here = [r for r in range(transport.num_ranks) if r // ranks_per_node == node]
        unreachable = [r for r in here if not peers[r]]
        if unreachable:
            self.free()
            raise BackendUnavailableError(f"rank {transport.rank} cannot load from ranks {unreachable} of its node "
                                          "through NVSHMEM")
        self.remote = sum(1 << r for r in range(transport.num_ranks) if r not in here)
        self.bases = [peers[r] if r in here else self.ptr for r in range(transport.num_ranks)]
        self.tensor = byte_view(self.ptr, num_bytes, device)

    def free(self) -> None:
        self.transport.free(self.ptr)
        self.transport.close()
