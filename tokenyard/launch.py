"""Starting the ranks of a group on one machine: shared by the benchmark, the examples and the GPU tests.

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
import os
import socket
import traceback
import warnings
import weakref
from typing import Optional

from . import devices

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """See NOTE [NVLink multicast]."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, num_ranks: int, port: int, use_cuda: bool, timeout_s: float = 120.0,
              num_gpus: Optional[int] = None):
    """Join a group of `num_ranks` on 127.0.0.1:`port`: on GPUs if `use_cuda`, else gloo on the CPU.

    On GPUs the ranks spread evenly over `num_gpus` (default: every GPU here; devices.launch_layout), and the
    group is NCCL where each rank has a GPU of its own, gloo where ranks share a GPU (NCCL refuses two ranks
    on one GPU; the CUDA backend then needs MPS, NOTE [shared GPUs] in devices.py).

    Returns the rank's device.
    """
    import torch
    import torch.distributed as dist

    import torch.distributed.nn  # noqa: F401 - before the group exists: NOTE [gloo threads at exit]

    disable_nvlink_multicast()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        _, ranks_per_gpu = devices.launch_layout(num_ranks, num_gpus or torch.cuda.device_count())
        device = torch.device("cuda", devices.launch_gpu(rank, ranks_per_gpu))
        torch.cuda.set_device(device)
        if ranks_per_gpu == 1:
            dist.init_process_group("nccl", rank=rank, world_size=num_ranks, device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=num_ranks, timeout=timeout)
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=num_ranks, timeout=timeout)
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
        warnings.warn("tokenyard: something still holds the process group after destroy_process_group, so "
                      "its threads live on and may abort the process at exit (NOTE [gloo threads at exit] in "
                      "tokenyard/launch.py)", stacklevel=2)


def _rank_entry(rank: int, num_ranks: int, port: int, use_cuda: bool, num_gpus: Optional[int],
                group_timeout_s: float, fn, args, reports) -> None:
    try:
        init_rank(rank, num_ranks, port, use_cuda, group_timeout_s, num_gpus)
        reports.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported by the launcher
        reports.put((rank, False, traceback.format_exc()))
    finally:
        leave_group()


class RanksFailed(RuntimeError):
    """Some ranks of `run_on_ranks` failed. Attributes: `results` of the ranks that returned (rank -> value),
    `failures` (rank -> traceback or reason)."""

    def __init__(self, message: str, results: dict, failures: dict):
        super().__init__(message)
        self.results, self.failures = results, failures


def run_on_ranks(num_ranks: int, fn, *args, use_cuda: bool, timeout_s: float = 600.0,
                 group_timeout_s: float = 120.0, num_gpus: Optional[int] = None) -> list:
    """``fn(*args)`` in `num_ranks` spawned processes joined in one group (`init_rank` with `group_timeout_s`
    and `num_gpus`); -> each rank's result.

    Raises:
        RanksFailed (a RuntimeError): with the traceback of every rank that raised, the ranks whose process ended without a
            report (killed by a signal, say: its exit code), and the ranks that sent nothing within `timeout_s`
            (after a failure the others get 20 s, since they may wait in a collective the failed rank never
            joins).
    """
    import queue
    import time

    import torch.multiprocessing as mp

    if use_cuda:
        disable_nvlink_multicast()
    context = mp.get_context("spawn")
    reports = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank_entry,
                             args=(r, num_ranks, port, use_cuda, num_gpus, group_timeout_s, fn, args, reports))
             for r in range(num_ranks)]
    for proc in procs:
        proc.start()
    results, failures, ended, deadline = {}, {}, set(), time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < num_ranks:
            try:
                rank, ok, value = reports.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(num_ranks)) - set(results) - set(failures))
                # A process still without a report a poll after it ended died (killed by a signal, say): a
                # rank's report is in the queue before its process ends.
                failures.update({r: f"its process ended with exit code {procs[r].exitcode} without a report"
                                 for r in missing if r in ended})
                ended = {r for r in missing if procs[r].exitcode is not None}
                if time.monotonic() > deadline:
                    failures.update({r: f"no answer within {timeout_s:.0f} s of the start, or 20 s of a failure"
                                     for r in missing if r not in failures})
                    break
                continue
            (results if ok else failures)[rank] = value
            if failures:
                deadline = min(deadline, time.monotonic() + 20.0)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise RanksFailed("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())), results,
                          failures)
    return [results[r] for r in range(num_ranks)]
