"""Internode normal mode: the hierarchical path of the reference backend on virtual nodes of gloo ranks,
against tokenyard.semantics.routing (docs/semantics.md "Internode normal mode")."""

import pytest

from tokenyard.backends import normal_mode_backend

from . import internode_scenarios, scenarios


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "masked", "no_tokens"])
def test_internode_dispatch_and_combine_match_the_oracle(ranks, seed, num_ranks, ranks_per_node, kind):
    ranks(num_ranks).run(internode_scenarios.internode_round_trip, seed, ranks_per_node, 12, 128, 4 * num_ranks, 4,
                         kind, "bf16")


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_internode_quantized_rows_carry_data_and_scales_bit_for_bit(ranks, seed, dtype):
    ranks(4).run(internode_scenarios.internode_round_trip, seed, 2, 10, 256, 16, 4, "skewed", dtype)


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(4, 2), (8, 2)])
def test_internode_num_worst_tokens_pads_rows_and_src_meta(ranks, seed, num_ranks, ranks_per_node):
    ranks(num_ranks).run(internode_scenarios.internode_round_trip, seed, ranks_per_node, 10, 128, 4 * num_ranks, 4,
                         "masked", "bf16", num_ranks * 10 + 3, 2)


def test_internode_combine_without_bias(ranks, seed):
    ranks(4).run(internode_scenarios.internode_round_trip, seed, 2, 9, 128, 16, 6, "uniform", "bf16", 0, 0)


def test_one_rank_per_node_is_internode_too(ranks, seed):
    ranks(4).run(internode_scenarios.internode_round_trip, seed, 1, 8, 128, 16, 4, "uniform", "bf16")


def test_ranks_per_node_equal_to_the_group_changes_nothing(ranks, seed):
    ranks(4).run(scenarios.normal_round_trip, seed, 12, 128, 16, 4, "skewed", "bf16", ranks_per_node=4)


def test_a_one_node_handle_is_refused_on_several_nodes(ranks, seed):
    ranks(4).run(internode_scenarios.one_node_handle_refused_on_nodes, seed, 2)


def test_normal_mode_without_its_backend_raises_and_names_the_way_out(ranks):
    ranks(4).run(internode_scenarios.normal_mode_refused_with_cuda_backend_on_nodes, 2)


@pytest.mark.parametrize("requested,chosen,num_nodes,want", [
    ("auto", "cuda", 2, "reference"), ("cuda", "cuda", 2, None), ("cuda", "cuda", 1, "cuda"),
    ("auto", "cuda", 1, "cuda"), ("auto", "reference", 4, "reference"), ("reference", "reference", 2, "reference")])
def test_normal_mode_backend_on_several_nodes(requested, chosen, num_nodes, want):
    assert normal_mode_backend(requested, chosen, num_nodes) == want
    # Where every rank can run the CUDA backend's internode kernels, the Buffer's own backend runs normal mode.
    assert normal_mode_backend(requested, chosen, num_nodes, internode_kernels=True) == chosen


def test_autograd_backward_on_nodes_is_the_internode_combine_and_cached_dispatch(ranks, seed):
    ranks(8).run(internode_scenarios.autograd_on_nodes, seed, 4, 10, 128, 32, 4)
