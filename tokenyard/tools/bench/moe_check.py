"""The MoE step benchmark's check (tokenyard/tools/bench/moe_step.py): every variant against the same layer run
through the reference backend, before anything is timed."""

from __future__ import annotations

from typing import Dict, List

import torch


def canonical_rows(step: str, rows_info, num_local: int, num_tokens: int) -> List[torch.Tensor]:
    """Each local expert's received rows in one order for every variant: by source rank, then source token.

    Normal mode and the all-to-all deliver an expert's rows by source rank in token order already; the
    low-latency layout is ordered by its handle's `src_info` and `layout_range`.
    """
    if step == "train" or len(rows_info) == 2:
        grouped, counts = rows_info
        return list(grouped.split(list(counts)))
    packed_x, packed_count, handle = rows_info
    src_info, layout_range = handle[0], handle[1]
    out = []
    for expert in range(num_local):
        keys, slots = [], []
        for src_rank, packed in enumerate(layout_range[expert].tolist()):
            begin, count = packed >> 32, packed & 0xFFFFFFFF
            slots += range(begin, begin + count)
            keys += [src_rank * num_tokens + int(t) for t in src_info[expert, begin:begin + count].tolist()]
        order = torch.tensor(keys, dtype=torch.int64, device=packed_x.device).argsort()
        out.append(packed_x[expert][torch.tensor(slots, dtype=torch.int64, device=packed_x.device)[order]])
    return out


def check_step(rank, results: Dict[str, tuple], want: tuple) -> List[str]:
    """Each variant against the reference backend's layer: rows per expert bit for bit, the output and the
    input gradient within bf16 rounding; a variant of several micro-batches of the same tokens (the overlapped
    ones) returns them stacked, each checked. Raises AssertionError naming the variant; -> the checks made."""
    from ..testing import assert_within_bf16_rounding

    shape = rank.shape
    want_rows = canonical_rows(rank.step, want[2], rank.num_local, shape.num_tokens)
    done = []
    for variant, (out, grad_x, rows_info) in results.items():
        micro_batches = out.size(0) // want[0].size(0)
        assert_within_bf16_rounding(out, want[0].repeat(micro_batches, 1),
                                    f"{rank.step} {variant}: output (rank {rank.rank})")
        done.append(f"{variant} output")
        if grad_x is not None:
            assert_within_bf16_rounding(grad_x, want[1].repeat(micro_batches, 1),
                                        f"{rank.step} {variant}: input gradient (rank {rank.rank})")
            done.append(f"{variant} input gradient")
        if rows_info is not None:
            got_rows = canonical_rows(rank.step, rows_info, rank.num_local, shape.num_tokens)
            for expert, (got, expected) in enumerate(zip(got_rows, want_rows)):
                if not torch.equal(got, expected):
                    raise AssertionError(f"{rank.step} {variant}: rank {rank.rank} expert {expert} received other "
                                         f"rows than the reference dispatch ({got.size(0)} vs {expected.size(0)})")
            done.append(f"{variant} dispatch")
    return done
