"""Start one process per rank, wait for them with a deadline, and turn any failure into a `BenchError`.

Ranks are spawned with ``torch.multiprocessing`` (spawn context) and meet over TCP on a free port of
127.0.0.1. Each sends one report, ``(rank, ok, value)``: rank 0's value is every rank's samples, a
failed rank's is its traceback. Once one rank has failed, the others get `FAILURE_GRACE_S` to report
(they may be stuck in a collective the failed rank never joined) before they are killed.

NOTE [NVLink multicast]
Multicast (NVLS) objects are kept off on GPU machines: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are set (unless already set) before any rank starts. The launcher itself has
imported torch by then (``import tokenyard`` does) but creates no communicator; the ranks inherit the
variables from their first instruction, before they import torch.distributed.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Dict, List

from . import BenchError
from .options import BenchSettings

FAILURE_GRACE_S = 15.0
JOIN_TIMEOUT_S = 10.0
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """See NOTE [NVLink multicast]."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, num_ranks: int, port: int, settings: BenchSettings, reports) -> None:
    """Entry point of one spawned rank: run it and send one report."""
    try:
        from .runner import run_rank

        reports.put((rank, True, run_rank(rank, num_ranks, port, settings)))
    except BenchError as exc:
        reports.put((rank, False, str(exc)))
        raise SystemExit(1)
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        reports.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def _drain(reports, failures: Dict[int, str]) -> None:
    """Late reports of failed ranks replace "exited without a report" with their traceback."""
    while True:
        try:
            rank, ok, value = reports.get(timeout=0.2)
        except queue.Empty:
            return
        if not ok:
            failures[rank] = value


def _describe(failures: Dict[int, str], missing: List[int], timeout_s: float) -> str:
    lines = []
    if failures:
        first = min(failures)
        lines.append(f"rank {first} failed (ranks failed: {sorted(failures)}):\n{failures[first].rstrip()}")
    if missing:
        lines.append(f"ranks {missing} did not finish within {timeout_s:.0f} s of the start or "
                     f"{FAILURE_GRACE_S:.0f} s of the first failure (see --timeout_s)")
    return "\n".join(lines)


def run_ranks(settings: BenchSettings) -> List[dict]:
    """Run `runner.run_rank` on `settings.num_ranks` processes; -> every rank's samples (rank 0's report).

    Raises:
        BenchError: a rank raised, died, or did not finish within ``settings.timeout_s``.
    """
    import torch.multiprocessing as mp

    if settings.gpu:
        disable_nvlink_multicast()
    context = mp.get_context("spawn")
    reports = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank_main, args=(rank, settings.num_ranks, port, settings, reports),
                             daemon=True) for rank in range(settings.num_ranks)]
    for proc in procs:
        proc.start()
    results: Dict[int, object] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + settings.timeout_s
    try:
        while len(results) + len(failures) < len(procs) and time.monotonic() < deadline:
            try:
                rank, ok, value = reports.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                for rank, proc in enumerate(procs):  # a rank killed outright (out of memory) sends nothing
                    if proc.exitcode not in (None, 0) and rank not in results and rank not in failures:
                        failures[rank] = f"rank {rank} exited with code {proc.exitcode} without a report"
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if ok:
                results[rank] = value
            else:
                failures[rank] = value
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    finally:
        if failures:
            _drain(reports, failures)
        finished = not failures and len(results) == len(procs)
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S if finished else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=JOIN_TIMEOUT_S)
    missing = sorted(set(range(len(procs))) - set(results) - set(failures))
    if failures or missing:
        raise BenchError(_describe(failures, missing, settings.timeout_s))
    return results[0]
