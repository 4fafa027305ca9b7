"""Bounded buffers on the CUDA backend: calls in rounds against the reference backend's one-shot calls on
the same inputs (device machine only; NOTE [rounds] in tokenyard/rounds.py).

Dispatch must match bit for bit (data, scales, indices, weights, counts, order, every handle field); combine
too, since each token is summed in one round in the same order. Ranks have very different token counts,
one has none.
"""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

# (max tokens per rank, hidden, num_experts, num_topk, dtype, per_round_tokens or None for a budget of
# `budget_tokens` combine rows per rank)
CASES = [
    (700, 7168, 256, 8, "fp8", 97, None),
    (700, 4096, 64, 4, "bf16", None, 128),
    (300, 2048, 32, 8, "fp8", 1, None),
]
HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")


def _same(what, name, a, b):
    spawn.assert_same(f"{what}: {name}", a, b)


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def compare_rounds(seed, cases, backend="cuda"):
    """Run every case on this rank; `backend` is the one under test (the reference backend on CPU ranks,
    where this function checks itself)."""
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.plan import workspace
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    reports = []
    for case_id, case in enumerate(cases):
        max_tokens, hidden, num_experts, num_topk, dtype, per_round_tokens, budget_tokens = case
        # Full, a third, none and nearly full, over and over for more than 4 ranks.
        counts = [(max_tokens, max_tokens // 3, 0, max_tokens - 187)[r % 4] for r in range(num_ranks)]
        x, topk_idx, topk_weights = make_rank_inputs(seed + case_id, num_ranks, max_tokens, hidden, num_experts,
                                                     num_topk, "uniform", dtype, device)[rank]
        num_tokens = counts[rank]
        x = tuple(t[:num_tokens] for t in x) if isinstance(x, tuple) else x[:num_tokens]
        topk_idx, topk_weights = topk_idx[:num_tokens].contiguous(), topk_weights[:num_tokens].contiguous()
        data = _split(x)[0]
        hint = Config(num_max_tokens_per_rank=max_tokens).get_nvl_buffer_size_hint(
            hidden * max(data.element_size(), 2), num_ranks)
        size = hint
        if budget_tokens is not None:
            rows = (workspace.normal_combine_row_bytes(hidden, num_topk),
                    workspace.normal_dispatch_row_bytes(hidden * data.element_size(), 0 if dtype == "bf16" else
                                                        hidden // 128 * 4, num_topk))
            size = workspace.normal_required_bytes(num_ranks, budget_tokens, max(rows))
        ref = Buffer(dist.group.WORLD, hint, 0, backend="reference")
        bounded = Buffer(dist.group.WORLD, size, 0, backend=backend, timeout_s=30, per_round_tokens=per_round_tokens)
        if backend == "cuda":
            bounded.runtime.poison_outputs = True
        what = f"case {case_id} {dtype}/h{hidden}/k{num_topk}/rounds of {per_round_tokens or budget_tokens}"
        print(f"rank {rank}: {what}", flush=True)

        per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(topk_idx, num_experts)
        for num_worst_tokens in (0, max_tokens * num_ranks):
            kwargs = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                          is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=4,
                          num_worst_tokens=num_worst_tokens)
            (rx, ri, rw, rl, rh, _), (cx, ci, cw, cl, ch, _) = ref.dispatch(x, **kwargs), bounded.dispatch(x, **kwargs)
            if backend == "cuda":
                torch.cuda.synchronize()
            tag = f"{what}{' worst' if num_worst_tokens else ''}"
            num_rounds = ch.rounds.num_rounds
            assert num_rounds > 1, f"{tag}: ran in one round; the case is meant to need rounds"
            n = int(rh.rank_prefix_matrix[-1, rank])
            for name, a, b in (("recv_x", _split(rx)[0], _split(cx)[0]),
                               ("recv_x_scales", _split(rx)[1], _split(cx)[1]),
                               ("recv_topk_idx", ri, ci), ("recv_topk_weights", rw, cw)):
                _same(tag, name, None if a is None else a[:n], None if b is None else b[:n])
            _same(tag, "padding recv_topk_idx", ri[n:], ci[n:])
            _same(tag, "padding recv_topk_weights", rw[n:], cw[n:])
            for field in HANDLE_FIELDS:
                _same(tag, field, getattr(rh, field), getattr(ch, field))
            assert rl == cl, f"{tag}: per-expert counts {rl} vs {cl}"
            if num_worst_tokens:
                continue

            again = _split(bounded.dispatch(x, handle=ch)[0])
            _same(tag, "cached recv_x", again[0], _split(cx)[0])
            _same(tag, "cached recv_x_scales", again[1], _split(cx)[1])

            y = torch.randn(n, hidden, device=device).to(torch.bfloat16)
            bias = torch.randn(num_tokens, hidden, device=device).to(torch.bfloat16)
            rc = ref.combine(y, rh, topk_weights=rw, bias=bias)
            cc = bounded.combine(y, ch, topk_weights=cw, bias=bias)
            if backend == "cuda":
                torch.cuda.synchronize()
            _same(tag, "combined_x", rc[0], cc[0])
            _same(tag, "combined_topk_weights", rc[1], cc[1])
            reports.append(f"{tag}: ok ({n} rows in {num_rounds} rounds)")
        if backend == "cuda":
            bounded.runtime.check_failures()
        ref.destroy()
        bounded.destroy()
    return reports


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_cuda_calls_in_rounds_match_reference_one_shot(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    for line in spawn.run(num_ranks, compare_rounds, seed, CASES)[0]:
        print(line)
