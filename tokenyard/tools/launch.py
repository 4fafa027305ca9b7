"""Starting the ranks of a group on one machine and hearing their reports: one launcher for the benchmark, the
examples and the tests (NOTE [rank reports]), and a pool of ranks that runs many tasks (`RankPool`).

NOTE [NVLink multicast]
On the shared multi-GPU machines NVLink multicast (NVLS) must stay off: a program that creates multicast
objects can take the host's GPUs out of service. tokenyard never needs it, and every launcher sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (unless already set)
before NCCL or anything else starts.

NOTE [gloo threads at exit]
A gloo group runs each collective on one of its worker threads, and that thread drops its reference to
the finished collective, and so to the caller's tensors, only after it has woken the caller. Dropping a
C++ reference to a tensor that has a Python object takes the GIL. If the rank has returned and the
interpreter is finalizing by then, Python ends the thread (pthread_exit) inside that noexcept destructor,
and the process aborts with "terminate called without an active exception" after its work is done (core
dumps of the examples: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> THPVariable_dealloc ->
take_gil -> PyThread_exit_thread; pytorch/pytorch#190489). The worker threads are joined only when the
group's C++ object dies, and `dist.destroy_process_group()` drops only torch's own references; whatever
else holds the group keeps it, and its threads, alive into finalization. Two such holders were found:
- a Buffer in a reference cycle, freed only by the garbage collector: Buffer holds none (its closures do
  not capture `self`), tests/cpu/test_lifetime.py;
- default arguments bound at import: torch.distributed.nn.functional has ``group=group.WORLD``, and
  torch.optim imports it (through torch._dynamo) on the first optimizer, so after `init_process_group` it
  pins the group for good: `init_rank` imports it first, while ``group.WORLD`` is None.
So a rank ends in this order: its function returns (its locals, the Buffers among them, go), then
`leave_group` destroys the group and collects the garbage, so the group dies and its threads are joined
while they can still take the GIL. A group that still lives then draws a warning, which
tests/cpu/test_examples.py fails on: a new holder fails every run instead of aborting one in ten.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import time
import traceback
import types
import warnings
import weakref
from typing import Optional

from ..plan import devices

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """See NOTE [NVLink multicast]."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


def group_or_world(group):
    """`group`, or the world where None; InvalidInputError where torch.distributed is not initialized."""
    import torch.distributed as dist

    from ..errors import InvalidInputError

    if not dist.is_initialized():
        raise InvalidInputError("torch.distributed is not initialized: call dist.init_process_group first")
    return group if group is not None else dist.group.WORLD


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, num_ranks: int, port: int, use_cuda: bool, timeout_s: float = 120.0,
              num_gpus: Optional[int] = None, launcher_store: bool = False):
    """Join a group of `num_ranks` on 127.0.0.1:`port`: on GPUs if `use_cuda`, else gloo on the CPU. The group's
    store is rank 0's, or with `launcher_store` the one the launcher holds there (`spawn`).

    On GPUs the ranks spread evenly over `num_gpus` (default: every GPU here; devices.launch_layout), and the
    group is NCCL where each rank has a GPU of its own, gloo where ranks share a GPU (NCCL refuses two ranks
    on one GPU; the CUDA backend then needs MPS, NOTE [shared GPUs] in devices.py).

    Returns the rank's device.
    """
    import torch
    import torch.distributed as dist

    import torch.distributed.nn  # noqa: F401 - before the group exists: NOTE [gloo threads at exit]

    disable_nvlink_multicast()
    # One intra-op thread a rank, as torchrun gives several ranks of one host: ranks that each spread their
    # host work over every core (test oracles, the reference backend) spin against each other's threads.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, num_ranks, is_master=rank == 0 and not launcher_store, timeout=timeout)
    if use_cuda:
        _, ranks_per_gpu = devices.launch_layout(num_ranks, num_gpus or torch.cuda.device_count())
        device = torch.device("cuda", devices.launch_gpu(rank, ranks_per_gpu))
        torch.cuda.set_device(device)
        if ranks_per_gpu == 1:
            dist.init_process_group("nccl", store=store, rank=rank, world_size=num_ranks, device_id=device,
                                    timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=num_ranks, timeout=timeout)
        return device
    dist.init_process_group("gloo", store=store, rank=rank, world_size=num_ranks, timeout=timeout)
    return torch.device("cpu")


def leave_group() -> None:
    """Destroy the default group (if any) and free what still holds it, once the rank's function has
    returned; warns if the group outlives this (NOTE [gloo threads at exit])."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if group() is not None:
        warnings.warn(f"tokenyard: something still holds the process group after destroy_process_group "
                      f"({', '.join(_holders(group()))}), so its threads live on and may abort the process at exit "
                      f"(NOTE [gloo threads at exit] in tokenyard/tools/launch.py)", stacklevel=2)


def _holders(obj) -> list:
    """What refers to `obj`, named for a reader: a module's global, an object's attribute, a closure's variable, a
    function's default argument (found among the functions: a tuple of objects the collector does not track is
    untracked itself), or else the referring object's type. Types are compared directly: an attribute read could
    run code (a deprecated object's warning, say)."""
    names = set()
    for referrer in gc.get_referrers(obj):
        kind = type(referrer)
        if kind is types.FrameType:
            continue
        if kind is types.CellType:
            name = "a closure's variable"
        elif kind in (dict, list, tuple, set):
            name = kind.__name__
        else:
            name = f"an attribute of a {kind.__qualname__}"
        for owner in gc.get_referrers(referrer):
            if issubclass(type(owner), types.ModuleType) and owner.__dict__ is referrer:
                name = f"a global of {owner.__name__}"
        names.add(name)
    for fn in gc.get_objects():  # no comprehension over `obj` here: it would put `obj` in a cell of this frame
        if type(fn) is not types.FunctionType:
            continue
        for value in (fn.__defaults__ or ()) + tuple((fn.__kwdefaults__ or {}).values()):
            if value is obj:
                names.add(f"a default argument of {fn.__module__}.{fn.__qualname__}")
        for cell in fn.__closure__ or ():
            if _filled(cell) and cell.cell_contents is obj:
                names.discard("a closure's variable")
                names.add(f"a variable of {fn.__module__}.{fn.__qualname__}'s closure")
    return sorted(names) or ["a holder the garbage collector does not see"]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a variable not yet assigned
        return False
    return True


# NOTE [launch times]
# With TOKENYARD_LAUNCH_TIMES naming a file, each `run_on_ranks` appends where its seconds went, as JSON lines: the
# launcher's {"run", "what", "spawned", "reported", "stopped"} (before its ranks start, once every rank reported, once
# every process ended) and each rank's {"run", "rank", "entered", "joined", "returned", "left"} (its entry point
# reached, its group joined, its function returned, its group left), every time time.monotonic()'s (one clock for
# every process of a host) and `run` the launcher's store port. benchmarks/gpu_suite.py sums them over the suite's
# runs on ranks of their own.
def _log_times(**fields) -> None:
    path = os.environ.get("TOKENYARD_LAUNCH_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def _rank_entry(rank: int, num_ranks: int, port: int, use_cuda: bool, num_gpus: Optional[int],
                group_timeout_s: float, fn, args, reports) -> None:
    times = {"run": port, "rank": rank, "entered": time.monotonic()}
    try:
        init_rank(rank, num_ranks, port, use_cuda, group_timeout_s, num_gpus, launcher_store=True)
        times["joined"] = time.monotonic()
        result = fn(*args)
        times["returned"] = time.monotonic()
        reports.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported by the launcher
        reports.put((rank, False, traceback.format_exc()))
    finally:
        leave_group()
        _log_times(**times, left=time.monotonic())


class RanksFailed(RuntimeError):
    """Some ranks of `run_on_ranks` failed. Attributes: `results` of the ranks that returned (rank -> value),
    `failures` (rank -> traceback or reason)."""

    def __init__(self, message: str, results: dict, failures: dict):
        super().__init__(message)
        self.results, self.failures = results, failures


# NOTE [rank reports]
# Every launcher (run_on_ranks, the benchmark's, the CPU tests' pool of ranks) hears its ranks the same way: a
# rank sends one report per task, (rank, ok, value), ok False with its traceback. Once a rank has failed, the
# others get FAILURE_GRACE_S, since they may wait in a collective the failed rank never joins. A process that
# ended without a report (killed by a signal, say) is a failure as soon as a poll after its end finds nothing
# (a rank's report is in the queue before its process ends). The cause named first is such a silent end, else
# the first failure to arrive.
FAILURE_GRACE_S = 15.0
_EXIT_GRACE_S = 30.0  # for processes that reported to end on their own, all together


class Reports:
    """What a launcher heard from its ranks (NOTE [rank reports])."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.results: dict = {}
        self.failures: dict = {}  # rank -> traceback or reason, in order of arrival
        self.silent: list = []    # ranks whose process ended without a report

    def record(self, rank: int, ok: bool, value) -> None:
        if ok:
            self.results[rank] = value
            return
        self.failures[rank] = value
        if rank in self.silent:  # its report came after all
            self.silent.remove(rank)

    def record_ends(self, procs) -> None:
        for rank in self.missing():
            if procs[rank].exitcode is not None:
                self.failures[rank] = f"its process ended with exit code {procs[rank].exitcode} without a report"
                self.silent.append(rank)

    def missing(self) -> list:
        return sorted(set(range(self.num_ranks)) - set(self.results) - set(self.failures))

    @property
    def finished(self) -> bool:
        return not self.failures and not self.missing()

    def describe(self, timeout_s: float) -> str:
        """The likely cause in full, every other failure in full after it, and the ranks that never answered."""
        lines = []
        if self.failures:
            cause = self.silent[0] if self.silent else next(iter(self.failures))
            lines.append(f"rank {cause} failed:\n{self.failures[cause].rstrip()}")
            lines += [f"rank {rank} also failed:\n{text.rstrip()}" for rank, text in sorted(self.failures.items())
                      if rank != cause]
        if self.missing():
            lines.append(f"ranks {self.missing()} did not answer within {timeout_s:g} s of the start or "
                         f"{FAILURE_GRACE_S:g} s of the first failure")
        return "\n".join(lines)


def collect(reports_queue, procs, timeout_s: float) -> Reports:
    """One report per rank from `reports_queue`, until every rank has answered or the deadline passes
    (NOTE [rank reports]); `procs[rank]` is rank's process."""
    import queue

    reports = Reports(len(procs))
    deadline = time.monotonic() + timeout_s
    while reports.missing() and time.monotonic() < deadline:
        try:
            reports.record(*reports_queue.get(timeout=min(1.0, max(0.01, deadline - time.monotonic()))))
        except queue.Empty:
            reports.record_ends(procs)
        if reports.failures:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if reports.failures:  # tracebacks that came late replace "ended without a report"
        while True:
            try:
                reports.record(*reports_queue.get(timeout=0.2))
            except queue.Empty:
                break
    return reports


def stop(procs, finished: bool) -> None:
    """Let the processes end (together within _EXIT_GRACE_S if every rank reported, else at once), then kill
    whatever is left."""
    deadline = time.monotonic() + (_EXIT_GRACE_S if finished else 0.5)
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10.0)


# NOTE [rank processes]
# Ranks start from a fork server that has imported torch once (multiprocessing's "forkserver" context, torch
# preloaded), not each from a fresh interpreter ("spawn"): a rank's start then skips torch's import, which most of
# a start on the CPU is, and the GPU suite starts ranks of their own for 17 tests (benchmarks/results/gpu_suite.md).
# The server imports torch and nothing that starts CUDA, so each rank still makes its own CUDA context. A forked
# rank has the server's environment, not the launcher's, so it takes the launcher's as it was when the ranks
# started (`_in_environment`): a test's monkeypatched variable reaches its ranks as under "spawn".
_PRELOAD = ["torch", "torch.distributed"]


def _context():
    """The multiprocessing context every launcher's ranks start in (NOTE [rank processes])."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _in_environment(environment: dict, target, args) -> None:
    """``target(*args)`` with `environment` as the process's (NOTE [rank processes])."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


def spawn(num_ranks: int, target, args_of_rank, use_cuda: bool):
    """`num_ranks` processes (NOTE [rank processes]) running ``target(*args_of_rank(rank, port, reports_queue))``,
    meeting at the store this process holds on `port` of 127.0.0.1; -> (procs, reports_queue, store): keep the
    store while the ranks live.

    The launcher holds the store, not rank 0: a port found free and then bound by rank 0 could be taken meanwhile
    (a lost rank's leftovers: EADDRINUSE at 2 x 2 on 4 x H200), and the store outlives any rank, so the survivors of a
    killed one can still meet on it (fault_scenarios.survivors_group)."""
    import torch.distributed as dist

    if use_cuda:
        disable_nvlink_multicast()
    context = _context()
    reports_queue = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, num_ranks, is_master=True, wait_for_workers=False)
    environment = dict(os.environ)
    # Not daemons: a rank may start processes of its own (torch.compile's workers, say); `stop` ends them.
    procs = [context.Process(target=_in_environment, args=(environment, target, args_of_rank(rank, store.port,
                                                                                                reports_queue)))
             for rank in range(num_ranks)]
    for proc in procs:
        proc.start()
    return procs, reports_queue, store


def run(num_ranks: int, target, args_of_rank, use_cuda: bool, timeout_s: float, what: str = "") -> Reports:
    """`spawn`, `collect` within `timeout_s`, `stop`; -> what the ranks reported (NOTE [launch times]: `what`)."""
    spawned = time.monotonic()
    procs, reports_queue, store = spawn(num_ranks, target, args_of_rank, use_cuda)  # the store lives until return
    reports, reported = Reports(num_ranks), None
    try:
        reports = collect(reports_queue, procs, timeout_s)
        reported = time.monotonic()
    finally:
        stop(procs, reports.finished)
        _log_times(run=store.port, what=what, spawned=spawned, reported=reported, stopped=time.monotonic())
    return reports


def run_on_ranks(num_ranks: int, fn, *args, use_cuda: bool, timeout_s: float = 600.0,
                 group_timeout_s: float = 120.0, num_gpus: Optional[int] = None) -> list:
    """``fn(*args)`` in `num_ranks` spawned processes joined in one group (`init_rank` with `group_timeout_s`
    and `num_gpus`); -> each rank's result.

    Raises:
        RanksFailed (a RuntimeError): what `Reports.describe` says, with `failures` holding every rank's
            traceback or reason (NOTE [rank reports]).
    """
    reports = run(num_ranks, _rank_entry, lambda rank, port, reports_queue: (
        rank, num_ranks, port, use_cuda, num_gpus, group_timeout_s, fn, args, reports_queue), use_cuda, timeout_s,
        getattr(fn, "__name__", "task"))
    if not reports.finished:
        failures = dict(reports.failures)
        failures.update({r: f"no answer within {timeout_s:g} s of the start, or {FAILURE_GRACE_S:g} s of a failure"
                         for r in reports.missing()})
        raise RanksFailed(reports.describe(timeout_s), reports.results, failures)
    return [reports.results[r] for r in range(num_ranks)]


# NOTE [rank pool]
# Starting ranks costs seconds a test (processes, torch's import, the group, on GPUs a CUDA context and NCCL), so
# the test suites keep one pool of ranks per world size and send each test's function to it. A pool with a failed
# or silent rank is killed and started again for the next task (NOTE [rank reports]). Between tasks a rank puts
# back torch's default device and dtype (a test may set them, as clients do), and on GPUs collects the garbage and
# empties the allocator's cache, so that what a task left (a Buffer it did not destroy, cached blocks) is not the
# next task's to carry. What else a task changes in its process stays: a test that starts NVSHMEM (one world per
# process), kills a rank or changes the environment runs on ranks of its own (`run_on_ranks`).
def _pool_rank(rank: int, world_size: int, port: int, use_cuda: bool, group_timeout_s: float, inbox, outbox) -> None:
    import torch

    init_rank(rank, world_size, port, use_cuda, group_timeout_s, launcher_store=True)
    outbox.put((rank, True, "ready"))
    dtype = torch.get_default_dtype()
    while True:
        item = inbox.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the caller
            outbox.put((rank, False, traceback.format_exc()))
        finally:
            torch.set_default_device(None)
            torch.set_default_dtype(dtype)
            if use_cuda:
                gc.collect()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    leave_group()  # NOTE [gloo threads at exit]


class RankPool:
    """`world_size` ranks that stay up and run tasks one after another (NOTE [rank pool])."""

    def __init__(self, world_size: int, use_cuda: bool = False, start_timeout_s: float = 180.0,
                 group_timeout_s: float = 120.0):
        self.world_size = world_size
        self._inboxes = [_context().Queue() for _ in range(world_size)]
        self._procs, self._outbox, self._store = spawn(world_size, _pool_rank, lambda rank, port, outbox: (
            rank, world_size, port, use_cuda, group_timeout_s, self._inboxes[rank], outbox), use_cuda)
        self.broken = False
        self._collect(start_timeout_s, "start")

    def _collect(self, timeout_s: float, what: str):
        reports = collect(self._outbox, self._procs, timeout_s)
        if not reports.finished:
            self.broken = True
            raise AssertionError(f"{what} failed:\n{reports.describe(timeout_s)}")
        return [reports.results[r] for r in range(self.world_size)]

    def run(self, fn, *args, timeout_s: float = 300.0, **kwargs):
        """``fn(*args, **kwargs)`` on every rank; -> the per-rank results. Raises AssertionError with every failing
        rank's traceback (and the pool is then broken: `close` it and start another)."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(timeout_s, getattr(fn, "__name__", "task"))

    def close(self) -> None:
        if not self.broken:
            for inbox in self._inboxes:
                inbox.put(None)
        stop(self._procs, not self.broken)
