"""Start one process per rank with `tokenyard.tools.launch` and turn any failure into a `BenchError`.

Each rank sends one report (NOTE [rank reports] in tokenyard/tools/launch.py): rank 0's value is every rank's
samples, a failed rank's is its traceback (a `BenchError`'s message alone). The ranks meet on a free port of
127.0.0.1 in `runner.run_rank`, which makes the group itself.

NVLink multicast stays off (NOTE [NVLink multicast] in tokenyard/tools/launch.py): the variables are set before
any rank starts; the launcher has imported torch by then (``import tokenyard`` does) but creates no
communicator, and the ranks inherit the variables before they import torch.distributed.
"""

from __future__ import annotations

import traceback
from typing import List

from .. import launch
from . import BenchError
from .options import BenchSettings


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


def run_ranks(settings: BenchSettings) -> List[dict]:
    """Run `runner.run_rank` on `settings.num_ranks` processes; -> every rank's samples (rank 0's report).

    Raises:
        BenchError: a rank raised, died, or did not finish within ``settings.timeout_s`` (see --timeout_s).
    """
    num_ranks = settings.num_ranks
    reports = launch.run(num_ranks, _rank_main, lambda rank, port, reports_queue: (
        rank, num_ranks, port, settings, reports_queue), settings.gpu, settings.timeout_s)
    if not reports.finished:
        raise BenchError(reports.describe(settings.timeout_s))
    return reports.results[0]
