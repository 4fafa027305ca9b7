"""Low-latency mode through the reference backend on gloo ranks."""

import pytest

from . import scenarios


@pytest.mark.parametrize("num_ranks,num_experts", [(2, 8), (3, 12), (4, 16), (8, 32)])
@pytest.mark.parametrize("kind", ["uniform", "masked", "empty_rank", "no_tokens"])
def test_fp8_dispatch_and_combine_match_the_oracle(ranks, seed, num_ranks, num_experts, kind):
    ranks(num_ranks).run(scenarios.low_latency_round_trip, seed, 12, 16, 256, num_experts, 4, kind)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(True, False), (True, True)])
def test_power_of_two_and_ue8m0_scales(ranks, seed, round_scale, use_ue8m0):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 9, 12, 1024, 16, 4, "uniform", True, round_scale,
                 use_ue8m0)


def test_bf16_dispatch_then_identity_combine_is_the_weighted_sum(ranks, seed):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 16, 16, 384, 16, 6, "masked", False)


def test_hooks_zero_copy_and_out(ranks, seed):
    ranks(2).run(scenarios.low_latency_round_trip, seed, 8, 8, 256, 8, 3, "uniform", True, False, False,
                 True, True, True)


def test_hidden_7168_topk_8_like_deepseek(ranks, seed):
    ranks(4).run(scenarios.low_latency_round_trip, seed, 16, 16, 7168, 32, 8, "uniform")


def test_masked_rank_is_skipped(ranks, seed):
    ranks(4).run(scenarios.low_latency_masked_rank, seed, 8, 128, 16, 4)
