"""Random problems for tests and benchmarks: routings of several shapes and the inputs that go with them.

Every generator takes a `torch.Generator`, so one seed reproduces all ranks' inputs on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..semantics import quant

ROUTING_KINDS = ("uniform", "skewed", "masked", "empty_rank", "no_tokens", "repeated")


def make_topk_idx(num_tokens: int, num_experts: int, num_topk: int, num_ranks: int, kind: str,
                  generator: torch.Generator, rank: int = 0) -> torch.Tensor:
    """``[T, K]`` int64 experts, distinct per row except with ``repeated``.

    Kinds: ``uniform`` (random experts), ``skewed`` (about 3/4 of choices on rank 0's experts),
    ``masked`` (about a quarter of entries -1, some rows all -1), ``empty_rank`` (no token picks the
    experts of the last rank), ``no_tokens`` (rank 1 has zero tokens; others uniform), ``repeated``
    (uniform, then every third row names its first expert again in its last column, where K > 1).
    """
    if kind == "no_tokens" and rank == 1:
        num_tokens = 0
    num_local_experts = num_experts // num_ranks
    scores = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float32, device=generator.device)
    if kind == "skewed":
        heavy = torch.rand(num_tokens, 1, generator=generator, dtype=torch.float32, device=generator.device) < 0.75
        scores[:, :num_local_experts] += 0.75 * heavy.to(torch.float32)
    if kind == "empty_rank":
        scores[:, num_experts - num_local_experts:] = -1.0
    num_topk = min(num_topk, num_experts - (num_local_experts if kind == "empty_rank" else 0))
    topk_idx = scores.topk(num_topk, dim=1).indices
    if kind == "masked":
        dropped = torch.rand(topk_idx.shape, generator=generator, dtype=torch.float32, device=generator.device)
        topk_idx[dropped < 0.25] = -1
        topk_idx[::5] = -1
    if kind == "repeated" and num_topk > 1:
        topk_idx[::3, -1] = topk_idx[::3, 0]
    return topk_idx.to(torch.int64)


def make_topk_weights(topk_idx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    weights = torch.rand(topk_idx.shape, generator=generator, dtype=torch.float32, device=generator.device) + 0.1
    return torch.where(topk_idx >= 0, weights, torch.zeros_like(weights)).to(torch.float32)


def make_x(num_tokens: int, hidden: int, dtype: str, generator: torch.Generator):
    """``dtype`` is ``bf16`` (a tensor), ``fp8`` or ``int8`` (a ``(data, scales)`` tuple)."""
    x = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float32, device=generator.device)
    x = (x * 2).to(torch.bfloat16)
    if dtype == "bf16":
        return x
    if dtype == "fp8":
        return quant.quantize_fp8(x)
    if dtype == "int8":
        return quant.quantize_int8(x)
    raise ValueError(f"unknown dtype {dtype!r}")


def make_rank_inputs(seed: int, num_ranks: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                     kind: str = "uniform", dtype: str = "bf16", device: Optional[torch.device] = None):
    """Every rank's ``(x, topk_idx, topk_weights)``, the same on every rank for one seed."""
    inputs = []
    for rank in range(num_ranks):
        generator = torch.Generator(device="cpu").manual_seed(seed * 1009 + rank)
        topk_idx = make_topk_idx(num_tokens, num_experts, num_topk, num_ranks, kind, generator, rank)
        weights = make_topk_weights(topk_idx, generator)
        x = make_x(topk_idx.size(0), hidden, dtype, generator)
        if device is not None:
            x = tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
            topk_idx, weights = topk_idx.to(device), weights.to(device)
        inputs.append((x, topk_idx, weights))
    return inputs


def unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a contiguous tensor that starts one element past a 16-byte boundary (a view into a larger
    allocation): what checks.tensor's `aligned` refuses and the kernels' fallbacks must take."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Two bf16 results of the same sums, rounded at different points (a combine pre-reduced per rank, as
    the CUDA low-latency kernels do, against one sum): elementwise within a few bf16 roundings of the row's
    largest value. A wrong row, weight or token is off by about the values themselves and fails."""
    got, want = got.float(), want.float()
    bound = 2.0**-6 * want.abs().amax(dim=-1, keepdim=True) + 2.0**-7 * want.abs()
    excess = (got - want).abs() - bound
    if want.numel() and excess.max() > 0:
        where = tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
        raise AssertionError(f"{what}: {int((excess > 0).sum())} values beyond bf16 rounding; at {where} "
                             f"got {got[where]:.6g}, want {want[where]:.6g}")


def all_gather(t: torch.Tensor, group=None) -> torch.Tensor:
    """``[world, *t.shape]``: every rank's `t`, over any group: through host memory where the group cannot move
    `t`'s device (gloo and CUDA tensors; NOTE [device collectives]). For tests and benchmarks, which gather
    results to compare on every rank."""
    import torch.distributed as dist

    from ..backends.collectives import Collectives, choose_mode

    group = group if group is not None else dist.group.WORLD
    mode = choose_mode(str(dist.get_backend(group)), t.device.type, shares_gpu=True)
    return Collectives(group, t.device, mode, group.rank(), group.size(), None).all_gather(t)
