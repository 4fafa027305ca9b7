"""A pool of gloo ranks that stays up for the whole test session.

Spawning processes and importing torch costs seconds, so each world size is started once and every test
sends it a function to run on all ranks. A failure on any rank becomes an AssertionError in the test with
that rank's traceback; a pool whose ranks stop answering is killed and started again for the next test.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback

from tokenyard.launch import free_port, init_rank, leave_group


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    init_rank(rank, world_size, port, use_cuda=False)
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
    leave_group()  # NOTE [gloo threads at exit] in tokenyard/launch.py


class RankPool:
    def __init__(self, world_size: int, start_timeout_s: float = 180.0):
        self.world_size = world_size
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._inboxes[r], self._outbox),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect(start_timeout_s, "start")
        self.broken = False

    def _collect(self, timeout_s: float, what: str):
        results, failures = {}, {}
        deadline = timeout_s
        waited = f"within {timeout_s:.0f} s"
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=deadline)
            except queue.Empty:
                self.broken = True
                missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failures.items())
                raise AssertionError(f"{what}: ranks {missing} did not answer {waited}{detail}")
            (results if ok else failures)[rank] = value
            if failures:
                deadline = 15.0  # the others may be stuck in a collective the failed rank never joined
                waited = "within 15 s of another rank's failure"
        if failures:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{what} failed on ranks {sorted(failures)}:{detail}")
        return [results[r] for r in range(self.world_size)]

    def run(self, fn, *args, timeout_s: float = 300.0, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        try:
            return self._collect(timeout_s, getattr(fn, "__name__", "task"))
        except AssertionError:
            self.broken = True
            raise

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive() and not self.broken:
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=5 if not self.broken else 0.1)
            if proc.is_alive():
                proc.kill()
