"""Start one process per rank, wait for them with a deadline, and turn any failure into a `BenchError`.

Ranks are spawned with ``torch.multiprocessing`` (spawn context) and meet over TCP on a free port of
127.0.0.1. Each sends one report, ``(rank, ok, value)``: rank 0's value is every rank's samples, a
failed rank's is its traceback. Once one rank has failed, the others get `FAILURE_GRACE_S` to report
(they may be stuck in a collective the failed rank never joined) before they are killed. The error
names the likely cause in full (a rank that died without a report, else the first to fail) and the
other failed ranks in one line each.

NVLink multicast stays off (NOTE [NVLink multicast] in tokenyard/launch.py): the variables are set before
any rank starts; the launcher has imported torch by then (``import tokenyard`` does) but creates no
communicator, and the ranks inherit the variables before they import torch.distributed.
"""

from __future__ import annotations

import queue
import time
import traceback
from typing import Dict, List

from ..launch import disable_nvlink_multicast, free_port
from . import BenchError
from .options import BenchSettings

FAILURE_GRACE_S = 15.0
JOIN_TIMEOUT_S = 10.0


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


class _Reports:
    """What the launcher has heard: results, failures in arrival order, and ranks that died silently."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.results: Dict[int, object] = {}
        self.failures: Dict[int, str] = {}  # insertion order = arrival order
        self.silent: List[int] = []

    def record(self, rank: int, ok: bool, value) -> None:
        if ok:
            self.results[rank] = value
            return
        self.failures[rank] = value
        if rank in self.silent:  # its report came after all
            self.silent.remove(rank)

    def record_deaths(self, procs) -> None:
        """Ranks killed outright (out of memory, a signal) send nothing; notice them by exit code."""
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (None, 0) and rank not in self.results and rank not in self.failures:
                self.failures[rank] = f"rank {rank} exited with code {proc.exitcode} without a report"
                self.silent.append(rank)

    def missing(self) -> List[int]:
        return sorted(set(range(self.num_ranks)) - set(self.results) - set(self.failures))

    def describe(self, timeout_s: float) -> str:
        """The likely cause in full (a silent death, else the first failure), the others in one line each."""
        lines = []
        if self.failures:
            cause = self.silent[0] if self.silent else next(iter(self.failures))
            lines.append(f"rank {cause} failed:\n{self.failures[cause].rstrip()}")
            for rank, text in sorted(self.failures.items()):
                if rank != cause:
                    last = text.strip().splitlines()[-1] if text.strip() else ""
                    lines.append(f"rank {rank} also failed: {last}")
        if self.missing():
            lines.append(f"ranks {self.missing()} did not finish within {timeout_s:.0f} s of the start or "
                         f"{FAILURE_GRACE_S:.0f} s of the first failure (see --timeout_s)")
        return "\n".join(lines)


def _wait(procs, reports_queue, timeout_s: float) -> _Reports:
    """Collect one report per rank until all are in or the deadline passes (15 s after a failure)."""
    reports = _Reports(len(procs))
    deadline = time.monotonic() + timeout_s
    while reports.missing() and time.monotonic() < deadline:
        try:
            reports.record(*reports_queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic()))))
        except queue.Empty:
            reports.record_deaths(procs)
        if reports.failures:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if reports.failures:  # late tracebacks replace "exited without a report"
        while True:
            try:
                reports.record(*reports_queue.get(timeout=0.2))
            except queue.Empty:
                break
    return reports


def run_ranks(settings: BenchSettings) -> List[dict]:
    """Run `runner.run_rank` on `settings.num_ranks` processes; -> every rank's samples (rank 0's report).

    Raises:
        BenchError: a rank raised, died, or did not finish within ``settings.timeout_s``.
    """
    import torch.multiprocessing as mp

    if settings.gpu:
        disable_nvlink_multicast()
    context = mp.get_context("spawn")
    reports_queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank_main, args=(rank, settings.num_ranks, port, settings, reports_queue),
                             daemon=True) for rank in range(settings.num_ranks)]
    for proc in procs:
        proc.start()
    finished = False
    try:
        reports = _wait(procs, reports_queue, settings.timeout_s)
        finished = not reports.failures and not reports.missing()
    finally:
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S if finished else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=JOIN_TIMEOUT_S)
    if not finished:
        raise BenchError(reports.describe(settings.timeout_s))
    return reports.results[0]
