"""Training through tokenyard: differentiable dispatch/combine, and the expert-parallel MoE layer against
Hugging Face transformers' sparse MoE blocks (Mixtral, Qwen2-MoE, DeepSeek-V3) on gloo ranks.

The dense block runs in this process, once on each rank's slice of the tokens; the ranks each hold that
slice and their share of the experts, and must reproduce its output and every gradient.

Float32 tolerances: the layer's output and its input's gradient pass through `Buffer.combine`, whose rows
are bf16 (NOTE [combine wire dtype] in tokenyard/layers/autograd.py), so they match to bf16 rounding; the
weights' gradients never pass through it and match to float32 rounding.
"""

import pytest
import torch

from . import moe_scenarios

BF16_UNIT = moe_scenarios.BF16_UNIT
FLOAT32_TOLERANCES = {"out": 4 * BF16_UNIT, "x.grad": 4 * BF16_UNIT, "weights": 1e-5}
BF16_TOLERANCES = {"out": 8 * BF16_UNIT, "x.grad": 8 * BF16_UNIT, "weights": 8 * BF16_UNIT}


def _report(case, errors):
    """Print the worst error of each compared tensor over the ranks, in units of its scale."""
    worst = {name: max(e[name][1] for e in errors) for name in errors[0]}
    print(f"transformers {case['transformers']} {case['model']} {case['dtype']}: "
          + ", ".join(f"{name} {value:.2g}" for name, value in worst.items()))


@pytest.fixture(scope="module")
def transformers_case():
    """transformers_case(model, seed, num_ranks, ...) with the import checked once."""
    pytest.importorskip("transformers")
    return moe_scenarios.transformers_case


# -- autograd ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("num_ranks,kind", [(2, "uniform"), (4, "masked"), (4, "no_tokens")])
def test_dispatch_backward_is_combine_and_matches_autograd_through_the_oracle(ranks, seed, num_ranks, kind, dtype):
    ranks(num_ranks).run(moe_scenarios.dispatch_backward_is_combine, seed, 12, 64, 4 * num_ranks, 3, kind, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
def test_dispatch_backward_ignores_padding_rows_of_num_worst_tokens(ranks, seed, dtype):
    ranks(4).run(moe_scenarios.dispatch_backward_is_combine, seed, 10, 64, 16, 3, "masked", dtype, 4 * 10 + 3)


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("num_worst_tokens", [0, 40])
def test_combine_backward_is_cached_dispatch_of_the_gradients(ranks, seed, dtype, num_worst_tokens):
    ranks(4).run(moe_scenarios.combine_backward_is_cached_dispatch, seed, 10, 64, 16, 3, "masked", dtype,
                 num_worst_tokens)


@pytest.mark.parametrize("num_ranks,kind,alignment,cpu_sync", [(2, "uniform", 1, True), (4, "masked", 4, True),
                                                              (4, "masked", 1, False), (4, "no_tokens", 4, False)])
def test_expanded_dispatch_backward_is_expanded_combine(ranks, seed, num_ranks, kind, alignment, cpu_sync):
    ranks(num_ranks).run(moe_scenarios.expanded_dispatch_backward_is_combine, seed, 10, 64, 4 * num_ranks, 3, kind,
                         alignment, cpu_sync)


@pytest.mark.parametrize("alignment", [1, 4])
def test_expanded_combine_backward_is_cached_expanded_dispatch(ranks, seed, alignment):
    ranks(4).run(moe_scenarios.expanded_combine_backward_is_cached_dispatch, seed, 10, 64, 16, 3, "masked",
                 alignment)


def test_combine_refuses_dtypes_other_than_bf16_and_float32(ranks):
    ranks(2).run(moe_scenarios.autograd_refuses_other_dtypes)


# -- the MoE layer -----------------------------------------------------------------------------------------

def test_layer_across_virtual_nodes_gets_the_nvshmem_bytes_they_need_and_matches_dense(ranks, seed):
    ranks(4).run(moe_scenarios.layer_on_virtual_nodes_matches_dense, seed, 2)


@pytest.mark.parametrize("kind", ["empty_rank", "no_tokens"])
def test_layer_backward_completes_and_matches_dense_when_a_rank_gets_no_tokens(ranks, seed, kind):
    ranks(4).run(moe_scenarios.layer_with_given_routing_matches_dense, seed, 16, 64, 96, 8, 2, kind)


# -- the MoE layer against transformers -----------------------------------------------------------------

@pytest.mark.parametrize("num_ranks", [2, 4])
def test_mixtral_block_outputs_and_grads_match_in_float32(ranks, seed, transformers_case, num_ranks):
    case = transformers_case("mixtral", seed, num_ranks, 24, hidden=128)
    errors = ranks(num_ranks).run(moe_scenarios.layer_matches_transformers, case, FLOAT32_TOLERANCES)
    _report(case, errors)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_qwen2_moe_block_with_gated_shared_expert_matches_in_float32(ranks, seed, transformers_case, num_ranks):
    case = transformers_case("qwen2_moe", seed, num_ranks, 24)
    errors = ranks(num_ranks).run(moe_scenarios.layer_matches_transformers, case, FLOAT32_TOLERANCES)
    _report(case, errors)


def test_deepseek_v3_block_with_group_limited_sigmoid_router_matches_in_float32(ranks, seed, transformers_case):
    case = transformers_case("deepseek_v3", seed, 4, 24)
    errors = ranks(4).run(moe_scenarios.layer_matches_transformers, case, FLOAT32_TOLERANCES)
    _report(case, errors)


def test_mixtral_block_matches_in_bf16_within_bf16_rounding(ranks, seed, transformers_case):
    case = transformers_case("mixtral", seed, 4, 24, dtype=torch.bfloat16, hidden=128)
    errors = ranks(4).run(moe_scenarios.layer_matches_transformers, case, BF16_TOLERANCES)
    _report(case, errors)


@pytest.mark.parametrize("model,dtype,tolerances", [("mixtral", torch.bfloat16, BF16_TOLERANCES),
                                                    ("qwen2_moe", torch.bfloat16, BF16_TOLERANCES),
                                                    ("deepseek_v3", torch.float32, FLOAT32_TOLERANCES)])
def test_layer_on_an_elastic_buffer_matches_the_block(ranks, seed, transformers_case, model, dtype, tolerances):
    """With an ElasticBuffer, bf16 runs through the expanded layout (NOTE [expanded experts]), float32 through the
    V1 calls of the Buffer it holds; both match the dense block as the Buffer's layer does."""
    case = transformers_case(model, seed, 4, 24, dtype=dtype, hidden=128)
    errors = ranks(4).run(moe_scenarios.layer_matches_transformers, case, tolerances, "reference", True)
    _report(case, errors)


# -- decode ----------------------------------------------------------------------------------------------

def test_packed_experts_between_low_latency_dispatch_and_combine_give_the_dense_sum(ranks, seed):
    ranks(4).run(moe_scenarios.packed_experts_match_dense, seed, 6, 128, 64, 16, 4)


def test_importing_tokenyard_moe_and_autograd_loads_no_cuda_library():
    import subprocess
    import sys

    unwanted = ("tokenyard.backends.cuda", "tokenyard.jit", "transformers")
    code = ("import sys, tokenyard.layers.moe, tokenyard.layers.autograd; "
            f"bad = [m for m in sys.modules if m.startswith({unwanted!r})]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
