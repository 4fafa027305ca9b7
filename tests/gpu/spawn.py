"""Start one process per GPU with an NCCL group, run a function on each, collect failures."""

from __future__ import annotations

import os

import torch

from tokenyard.launch import disable_nvlink_multicast, run_on_ranks

disable_nvlink_multicast()

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_counts(largest_only: bool = False) -> list:
    """The rank counts a test runs at: those of 2, 4 and 8 that the machine has GPUs for, or the largest of
    them only (the slower tests). TOKENYARD_TEST_NUM_RANKS (comma-separated) keeps some: "8" runs the whole
    suite at 8 ranks on an 8-GPU machine.
    """
    counts = [n for n in (2, 4, 8) if n <= NUM_GPUS]
    wanted = _chosen_counts()
    if wanted is not None:
        counts = [n for n in counts if n in wanted]
    return counts[-1:] if largest_only else counts


def one_rank_wanted() -> bool:
    """Whether the one-rank tests (test_one_gpu.py) run: on a machine of one GPU, where the others skip, or
    where TOKENYARD_TEST_NUM_RANKS names 1."""
    wanted = _chosen_counts()
    if wanted is not None:
        return NUM_GPUS >= 1 and 1 in wanted
    return NUM_GPUS == 1


def _chosen_counts():
    """The rank counts TOKENYARD_TEST_NUM_RANKS names (a set), or None where it is unset."""
    chosen = os.environ.get("TOKENYARD_TEST_NUM_RANKS", "")
    if not chosen.strip():
        return None
    return {int(part) for part in chosen.split(",") if part.strip()}


def run(num_ranks: int, fn, *args, timeout_s: float = 600.0):
    """fn(*args) on `num_ranks` GPU ranks; raise AssertionError with every failing rank's traceback."""
    try:
        return run_on_ranks(num_ranks, fn, *args, use_cuda=True, timeout_s=timeout_s)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
