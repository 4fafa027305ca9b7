"""Low-latency mode through the reference backend on gloo ranks."""

import pytest

from . import scenarios


@pytest.mark.parametrize("num_ranks,num_experts", [(2, 8), (3, 12), (4, 16), (8, 32)])
@pytest.mark.parametrize("kind", ["uniform", "masked", "empty_rank", "no_tokens", "repeated"])
def test_fp8_dispatch_and_combine_match_the_oracle(ranks, seed, num_ranks, num_experts, kind):
    ranks(num_ranks).run(scenarios.low_latency_round_trip, seed, 12, 16, 256, num_experts, 4, kind)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(True, False), (True, True)])
def test_power_of_two_and_ue8m0_scales(ranks, seed, round_scale, use_ue8m0):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 9, 12, 1024, 16, 4, "uniform", True, round_scale,
                 use_ue8m0)


@pytest.mark.parametrize("num_ranks,with_global_scale,hook", [(2, True, False), (4, False, True)])
def test_nvfp4_dispatch_gives_deepeps_layouts_of_the_oracles_values(ranks, seed, num_ranks, with_global_scale, hook):
    ranks(num_ranks).run(scenarios.low_latency_nvfp4, seed, 12, 40, 256, 4 * num_ranks, 3, with_global_scale, hook)


def test_bf16_dispatch_then_identity_combine_is_the_weighted_sum(ranks, seed):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 16, 16, 384, 16, 6, "masked", False)


def test_repeated_expert_takes_one_slot_and_combines_to_the_weighted_sum(ranks, seed):
    """NOTE [repeated experts]: against the oracle, and bf16 identity experts give sum_k w_k * x."""
    ranks(4).run(scenarios.low_latency_round_trip, seed, 16, 16, 384, 16, 6, "repeated", False)


def test_without_return_recv_hook_the_hook_is_none_as_deepeps(ranks, seed):
    """DeepEP returns None as the hook without `return_recv_hook`, and clients assert it (issue 47)."""
    ranks(2).run(scenarios.low_latency_round_trip, seed, 8, 8, 256, 8, 3, "uniform", True, False, False, False)


def test_hooks_zero_copy_and_out(ranks, seed):
    ranks(2).run(scenarios.low_latency_round_trip, seed, 8, 8, 256, 8, 3, "uniform", True, False, False,
                 True, True, True)


def test_hidden_7168_topk_8_like_deepseek(ranks, seed):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 16, 16, 7168, 32, 8, "uniform")


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 2), (8, 4)])
def test_nodes_change_nothing_of_the_meaning(ranks, seed, num_ranks, ranks_per_node):
    """Across nodes (issue 26) low-latency mode means what it means within one: the same oracle, with hooks,
    zero_copy and `out=`."""
    ranks(num_ranks).run(scenarios.low_latency_round_trip, seed, 12, 16, 512, 4 * num_ranks, 4, "masked", True, False,
                         False, True, True, True, ranks_per_node)


@pytest.mark.parametrize("block_m", [4, 64])
def test_combine_overlap_waits_for_the_expert_outputs_blocks(ranks, seed, block_m):
    ranks(2).run(scenarios.low_latency_overlap, seed, 12, 256, 8, 3, block_m)


def test_masked_rank_is_skipped(ranks, seed):
    ranks(4).run(scenarios.low_latency_masked_rank, seed, 8, 128, 16, 4)


def test_pre_reduced_combine_is_within_bf16_rounding_of_one_sum(seed):
    """routing's pre_reduce (the CUDA kernels' arithmetic, NOTE [low-latency combine]) against the plain sum:
    equal on one rank, within bf16 rounding (and not always equal) on four."""
    import torch

    from tokenyard.semantics import routing
    from tokenyard.tools.testing import assert_within_bf16_rounding, make_rank_inputs

    for num_ranks in (1, 4):
        num_experts, num_max = 8 * num_ranks, 24
        inputs = make_rank_inputs(seed, num_ranks, num_max, 256, num_experts, 6, "masked")
        oracle = routing.low_latency_dispatch([i[0] for i in inputs], [i[1] for i in inputs], num_max, num_experts,
                                              use_fp8=False)
        outputs = [torch.randn(o["packed_recv_x"].shape).to(torch.bfloat16) for o in oracle]
        args = (outputs, [i[1] for i in inputs], [i[2] for i in inputs], [o["layout_range"] for o in oracle],
                num_experts)
        plain, pre = routing.low_latency_combine(*args), routing.low_latency_combine(*args, pre_reduce=True)
        for r in range(num_ranks):
            assert_within_bf16_rounding(pre[r], plain[r], f"rank {r} of {num_ranks}")
        same = all(torch.equal(a, b) for a, b in zip(plain, pre))
        assert same == (num_ranks == 1), "one rank must agree bit for bit; four ranks round partials"
        broken = [p.clone() for p in pre]
        broken[0][1] += 1.0  # a wrong row is caught
        with pytest.raises(AssertionError):
            assert_within_bf16_rounding(broken[0], plain[0], "broken")
