"""Bytes and bandwidths the benchmark reports. Each formula is written once, here.

Notation: R ranks; ``counts[s][d]`` = tokens rank s sends to rank d in a normal dispatch (a token counts
once per destination rank, ``is_token_in_rank[:, d].sum()`` on rank s); H = hidden size.

Bytes per row (`row_bytes`), as DeepEP's tests count them:
    FP8   H * (1 + 4/128)   e4m3 data plus one float32 scale per 128 channels
    bf16  2 * H             (combine always moves bf16)

Two bandwidths per operation and rank r, both in GB/s (1e9 bytes per second):
    nvlink_gbps   bytes that cross between GPUs, divided by the time:
                  dispatch: rows r sends to other ranks        sum_{d != r} counts[r][d] * row
                  combine:  rows r receives back from others    sum_{d != r} counts[r][d] * 2H
    logical_gbps  DeepEP's "bottleneck bandwidth", local rows included:
                  dispatch: every row r receives               sum_s counts[s][r] * row
                  combine:  every row r got in the dispatch and now sends back (DeepEP's
                            ``combine_bf16_nvl_send_bytes``)    sum_s counts[s][r] * 2H

Low-latency mode counts (token, expert) pairs instead of rows (DeepEP's ``num_selections``; the
16-byte message header is not counted): logical = this rank's valid pairs * row, nvlink = those whose
expert lives on another rank * row. Dispatch rows are FP8 or bf16, combine rows bf16.

Across ranks: each rank reports the median time of its calls and its own two byte counts. The
operation is as slow as its slowest rank, so `summarize` takes the rank with the largest median time
and divides that rank's bytes by that rank's time: time and bytes always come from the same rank.
Example: ranks with (time 10 us, 1 MB) and (time 20 us, 3 MB) report 20 us and 3 MB / 20 us = 150 GB/s.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

FP8_SCALE_BYTES_PER_CHANNEL = 4 / 128
BF16_BYTES = 2

Sample = Tuple[float, float, float]
"""One rank's measurement of one operation: (median seconds, nvlink bytes, logical bytes)."""


def row_bytes(hidden: int, fp8: bool) -> float:
    """Bytes of one token row: ``H * (1 + 4/128)`` in FP8, ``2 * H`` in bf16."""
    return hidden * (1 + FP8_SCALE_BYTES_PER_CHANNEL) if fp8 else BF16_BYTES * hidden


def normal_dispatch_bytes(counts: Sequence[Sequence[int]], rank: int, bytes_per_row: float) -> Tuple[float, float]:
    """``(nvlink, logical)`` bytes of rank `rank`'s normal dispatch: rows sent to others, rows received."""
    remote_rows = sum(n for d, n in enumerate(counts[rank]) if d != rank)
    received_rows = sum(row[rank] for row in counts)
    return remote_rows * bytes_per_row, received_rows * bytes_per_row


def normal_combine_bytes(counts: Sequence[Sequence[int]], rank: int, hidden: int) -> Tuple[float, float]:
    """``(nvlink, logical)`` bytes of rank `rank`'s combine: rows back from others, rows it sends back."""
    bf16_row = row_bytes(hidden, fp8=False)
    remote_rows = sum(n for d, n in enumerate(counts[rank]) if d != rank)
    held_rows = sum(row[rank] for row in counts)
    return remote_rows * bf16_row, held_rows * bf16_row


def low_latency_bytes(topk_idx: torch.Tensor, rank: int, num_local_experts: int,
                      bytes_per_row: float) -> Tuple[float, float]:
    """``(nvlink, logical)`` bytes of one low-latency call: (token, expert) pairs to other ranks, all pairs."""
    valid = topk_idx >= 0
    remote = valid & (topk_idx // num_local_experts != rank)
    return int(remote.sum()) * bytes_per_row, int(valid.sum()) * bytes_per_row


def gbps(num_bytes: float, time_s: float) -> float:
    """GB/s, with 1 GB = 1e9 bytes."""
    return num_bytes / 1e9 / time_s


def summarize(samples: Sequence[Optional[Sample]], num_sms: Optional[int] = None) -> Optional[dict]:
    """Every rank's `Sample` of one operation -> ``{us, nvlink_gbps, logical_gbps, num_sms}``.

    The slowest rank decides: its median time, and its own bytes over that time. None where the
    operation was not measured (any rank's sample is None).
    """
    if not samples or any(s is None for s in samples):
        return None
    time_s, nvlink_bytes, logical_bytes = max(samples, key=lambda s: s[0])
    return {"us": time_s * 1e6, "nvlink_gbps": gbps(nvlink_bytes, time_s),
            "logical_gbps": gbps(logical_bytes, time_s), "num_sms": num_sms}
