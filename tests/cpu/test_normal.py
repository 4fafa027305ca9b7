"""Normal mode through the reference backend on gloo ranks, against tokenyard.semantics.routing and properties."""

import pytest

from . import scenarios


@pytest.mark.parametrize("num_ranks,num_experts", [(2, 8), (3, 12), (4, 16), (8, 32)])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "masked", "empty_rank", "no_tokens", "repeated"])
def test_dispatch_and_combine_match_the_oracle_for_each_routing(ranks, seed, num_ranks, num_experts, kind):
    ranks(num_ranks).run(scenarios.normal_round_trip, seed, 24, 256, num_experts, 4, kind, "bf16")


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
@pytest.mark.parametrize("hidden", [128, 2048, 7168])
def test_quantized_tuple_dispatch_carries_data_and_scales_bit_for_bit(ranks, seed, dtype, hidden):
    ranks(4).run(scenarios.normal_round_trip, seed, 12, hidden, 16, 8, "uniform", dtype)


@pytest.mark.parametrize("num_topk", [1, 8, 16])
def test_any_topk_up_to_16(ranks, seed, num_topk):
    ranks(2).run(scenarios.normal_round_trip, seed, 16, 128, 32, num_topk, "uniform", "bf16")


def test_expert_alignment_rounds_counts_up(ranks, seed):
    ranks(4).run(scenarios.normal_round_trip, seed, 20, 128, 16, 4, "skewed", "bf16", 8)


@pytest.mark.parametrize("kind", ["uniform", "no_tokens"])
def test_num_worst_tokens_pads_rows_with_minus_one(ranks, seed, kind):
    ranks(4).run(scenarios.normal_round_trip, seed, 10, 128, 16, 4, kind, "bf16", 1, 4 * 10 + 3)


def test_hidden_7168_bf16_on_8_ranks(ranks, seed):
    ranks(8).run(scenarios.normal_round_trip, seed, 8, 7168, 64, 8, "uniform", "bf16")
