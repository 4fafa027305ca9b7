"""Megatron-LM's own DeepEP code (megatron-core's `fused_a2a.fused_dispatch` / `fused_combine`) through the
`deep_ep` alias (tokenyard.compat.alias), forward and backward, on 2 and 4 gloo ranks, with `async_finish` and
`allocate_on_comm_stream` both ways, against the oracle (routing.py) and exact gradients. The ranks import
Megatron once and run every pair of flags in turn (a start of ranks costs more than the steps).

The expert doubles its rows, so with loss = sum(out * g) + sum(recv_probs): out[t] = 2 * n_t * x[t] for a token
that reached n_t ranks; x.grad[t] = bf16(2 * n_t * bf16(g[t])) (one float32 sum over the ranks, one rounding);
probs.grad[t, k] = n_t (the combine of the probabilities' gradient, ones, over the ranks the token reached).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tokenyard.tools.launch import run_on_ranks

pytest.importorskip("megatron.core", reason="megatron-core is in the test extra: pip install '.[test]'")

HIDDEN, NUM_EXPERTS, NUM_TOPK, NUM_TOKENS = 256, 16, 4, 24


FLAGS = [(False, False), (True, True), (True, False)]  # (async_finish, allocate_on_comm_stream)


def _megatron_steps(alias_dir, seed, flags):
    import importlib
    import warnings

    sys.path.insert(0, alias_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.transformer.moe import fused_a2a
    # Megatron looks for deep_ep when fused_a2a is first imported, which importing this test module (its
    # importorskip) did before the alias was on the path: import it again, as a fresh process would.
    fused_a2a = importlib.reload(fused_a2a)
    assert fused_a2a.HAVE_DEEP_EP, "megatron did not find deep_ep"
    return [_megatron_step(fused_a2a, seed, *pair) for pair in flags]


def _megatron_step(fused_a2a, seed, async_finish, allocate_on_comm_stream):
    import torch.distributed as dist

    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    inputs = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK)
    x, topk_idx, probs = (t.clone() for t in inputs[rank])
    x.requires_grad_(), probs.requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 101 * rank)).to(torch.bfloat16)

    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x, topk_idx, probs, NUM_EXPERTS, dist.group.WORLD, async_finish, allocate_on_comm_stream)
    out, _ = fused_a2a.fused_combine(recv_x * 2, dist.group.WORLD, handle, async_finish, allocate_on_comm_stream)
    ((out.float() * g.float()).sum() + recv_probs.sum()).backward()

    want = routing.dispatch([i[0] for i in inputs], [None] * num_ranks, [i[1] for i in inputs],
                            [i[2] for i in inputs], NUM_EXPERTS)[rank]
    assert torch.equal(recv_x.detach(), want["recv_x"]), "recv_x differs from the oracle"
    assert torch.equal(recv_idx, want["recv_topk_idx"]) and torch.equal(recv_probs.detach(), want["recv_topk_weights"])
    assert tokens_per_expert.tolist() == want["num_recv_tokens_per_expert_list"]
    reached = routing.dispatch_layout(topk_idx, NUM_EXPERTS, num_ranks)[2].sum(1)  # n_t: ranks token t reached
    assert torch.equal(out.detach(), (2 * reached.view(-1, 1) * x.detach().float()).to(torch.bfloat16)), "combine"
    assert torch.equal(x.grad, (2 * reached.view(-1, 1) * g.float()).to(torch.bfloat16)), "x.grad"
    assert torch.equal(probs.grad, reached.view(-1, 1).float().expand_as(probs)), "probs.grad"
    return int(recv_x.size(0))


@pytest.fixture(scope="module")
def alias_dir(tmp_path_factory):
    from tokenyard.compat import alias

    folder = str(tmp_path_factory.mktemp("alias"))
    alias.install(folder)
    return folder


@pytest.mark.parametrize("num_ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_megatron_fused_dispatch_and_combine_through_the_alias_forward_and_backward(alias_dir, num_ranks, seed):
    rows = run_on_ranks(num_ranks, _megatron_steps, alias_dir, seed, FLAGS, use_cuda=False, timeout_s=180)
    print(f"{num_ranks} ranks, (async_finish, allocate_on_comm_stream) {FLAGS}: rows received {rows}")
