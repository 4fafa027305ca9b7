"""A dispatch's recv_x in the Buffer's output arena (NOTE [output arena] in csrc/call_plan.cpp, NOTE [placed rows] in
kernels/dispatch.cuh), against the reference backend: outputs the caller keeps stay whole while later dispatches
place rows in the arena, a call that finds no free block takes the staged path with the same result, and a recv_x
outlives its Buffer (device machine only)."""

from __future__ import annotations

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()


def _held_outputs(seed):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_tokens, hidden, num_experts, num_topk = 384, 2048, 32, 4
    size = Config(num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    ref = Buffer(dist.group.WORLD, size, 0, backend="reference")
    cuda = Buffer(dist.group.WORLD, size, 0, backend="cuda", timeout_s=30)
    cuda.runtime.poison_outputs = True
    arena = cuda.runtime.output_arena
    assert arena is not None, "a CUDA Buffer on one host has an output arena"
    lo, hi = arena.memory.local, arena.memory.local + arena.memory.num_bytes

    def in_arena(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi

    held, kinds = [], set()
    # Fresh inputs each call, every output kept, until the arena has no room and a call takes the staged path.
    for call in range(64):
        x, topk_idx, weights = make_rank_inputs(seed + call, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                                "uniform", "bf16", device)[rank]
        outs = []
        for b in (ref, cuda):
            per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk_idx, num_experts)
            outs.append(b.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)[0])
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), f"call {call}: recv_x differs (in the arena: {in_arena(outs[1])})"
        placed = in_arena(outs[1])
        kinds.add(placed)
        held.append((outs[1], outs[1].clone(), placed))
        for i, (kept, copy, _) in enumerate(held):  # the arena's blocks still held were not written again
            assert torch.equal(kept, copy), f"call {call}: the recv_x of call {i} changed"
        # Every rank stops together: one that stopped alone would leave the others' dispatches without it.
        done = torch.tensor([int(kinds == {True, False})], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
    calls = len(held)
    assert kinds == {True, False}, f"after {calls} calls every output was {'placed' if True in kinds else 'staged'}"
    cuda.runtime.check_failures()
    # Given back: a new call takes a block again, and recv_x outlives the Buffer.
    held = [h for h in held if not h[2]]
    x, topk_idx, weights = make_rank_inputs(seed + 999, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                            "uniform", "bf16", device)[rank]
    per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
    last = cuda.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)[0]
    assert in_arena(last), "a block given back is taken again"
    torch.cuda.synchronize()
    copy = last.clone()
    ref.destroy()
    cuda.destroy()
    torch.cuda.synchronize()
    assert torch.equal(last, copy), "a recv_x that outlived its Buffer changed"
    return f"rank {rank}: {calls} calls, {len(held)} of them staged, matched the reference"


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_outputs_held_stay_whole_and_a_full_arena_takes_the_staged_path(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    spawn.run(num_ranks, _held_outputs, seed)
