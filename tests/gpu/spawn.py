"""Start one process per GPU with an NCCL group, run a function on each, collect failures."""

from __future__ import annotations

from tokenyard.launch import disable_nvlink_multicast, run_on_ranks

disable_nvlink_multicast()


def run(num_ranks: int, fn, *args, timeout_s: float = 600.0):
    """fn(*args) on `num_ranks` GPU ranks; raise AssertionError with every failing rank's traceback."""
    try:
        return run_on_ranks(num_ranks, fn, *args, use_cuda=True, timeout_s=timeout_s)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
