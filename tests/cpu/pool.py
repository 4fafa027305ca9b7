"""A pool of gloo ranks that stays up for the whole test session.

Spawning processes and importing torch costs seconds, so each world size is started once and every test
sends it a function to run on all ranks. Ranks answer as every launcher's do (NOTE [rank reports] in
tokenyard/tools/launch.py): a failure on any rank becomes an AssertionError in the test with that rank's traceback,
and a pool with a failed or silent rank is killed and started again for the next test.
"""

from __future__ import annotations

import traceback

from tokenyard.tools import launch


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    launch.init_rank(rank, world_size, port, use_cuda=False)
    outbox.put((rank, True, "ready"))
    while True:
        item = inbox.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            outbox.put((rank, False, traceback.format_exc()))
    launch.leave_group()  # NOTE [gloo threads at exit] in tokenyard/tools/launch.py


class RankPool:
    def __init__(self, world_size: int, start_timeout_s: float = 180.0):
        import multiprocessing

        self.world_size = world_size
        self._inboxes = [multiprocessing.get_context("spawn").Queue() for _ in range(world_size)]
        self._procs, self._outbox = launch.spawn(world_size, _worker, lambda rank, port, outbox: (
            rank, world_size, port, self._inboxes[rank], outbox), use_cuda=False)
        self.broken = False
        self._collect(start_timeout_s, "start")

    def _collect(self, timeout_s: float, what: str):
        reports = launch.collect(self._outbox, self._procs, timeout_s)
        if not reports.finished:
            self.broken = True
            raise AssertionError(f"{what} failed:\n{reports.describe(timeout_s)}")
        return [reports.results[r] for r in range(self.world_size)]

    def run(self, fn, *args, timeout_s: float = 300.0, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(timeout_s, getattr(fn, "__name__", "task"))

    def close(self) -> None:
        if not self.broken:
            for inbox in self._inboxes:
                inbox.put(None)
        launch.stop(self._procs, not self.broken)
