"""DeepEP V2's `ElasticBuffer` through the reference backend on gloo ranks, against a loop oracle
(tests/cpu/elastic_scenarios.py) of docs/semantics.md, "ElasticBuffer"."""

import pytest

from . import elastic_scenarios as scenarios


@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("alignment", [1, 64, 128])
def test_dispatch_and_combine_with_and_without_expansion(ranks, seed, do_expand, dtype, alignment):
    ranks(2).run(scenarios.round_trip, seed, 12, 256, 8, 4, "uniform", dtype, do_expand, alignment, True)


@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.parametrize("kind", ["masked", "skewed", "no_tokens"])
def test_without_cpu_sync_outputs_have_the_worst_case_rows(ranks, seed, do_expand, kind):
    ranks(4).run(scenarios.round_trip, seed, 10, 128, 16, 4, kind, "bf16", do_expand, 4, False)


@pytest.mark.parametrize("do_cpu_sync", [True, False])
def test_a_rank_that_receives_nothing_gets_empty_expanded_tensors(ranks, seed, do_cpu_sync):
    ranks(4).run(scenarios.round_trip, seed, 10, 256, 16, 4, "empty_rank", "fp8", True, 64, do_cpu_sync)


@pytest.mark.parametrize("do_expand", [False, True])
def test_eight_ranks_fp8(ranks, seed, do_expand):
    ranks(8).run(scenarios.round_trip, seed, 6, 256, 32, 8, "uniform", "fp8", do_expand, 16, True)


def test_bad_calls_are_refused_before_any_communication(ranks, seed):
    ranks(2).run(scenarios.refusals, seed)


def test_runtime_queries(ranks, seed):
    ranks(4).run(scenarios.queries, seed)


def test_the_same_inputs_give_the_same_bits_whatever_deterministic_says(ranks, seed):
    ranks(2).run(scenarios.deterministic, seed)


def test_virtual_nodes_leave_elastic_buffer_one_node(ranks, seed):
    ranks(4).run(scenarios.round_trip_on_virtual_nodes, seed, 2)


@pytest.mark.parametrize("alignment", [1, 4, 128])
@pytest.mark.parametrize("kind", ["uniform", "masked", "skewed"])
def test_each_pair_expanded_row_is_known_before_its_row_arrives(seed, alignment, kind):
    """NOTE [expanded rows]: a pair's row in the destination's expanded layout is its source's rank of the token
    among those naming the expert (`source_ranks`) past where that source's pairs of the expert begin
    (`expanded_bases`, from the pairs each source sends): what a dispatch kernel can place without the layout pass."""
    import torch

    from tokenyard.semantics import expand
    from tokenyard.tools.testing import make_rank_inputs

    num_ranks, num_tokens, num_experts = 4, 24, 16
    local = num_experts // num_ranks
    topk = [idx for _, idx, _ in make_rank_inputs(seed, num_ranks, num_tokens, 128, num_experts, 4, kind, "bf16")]
    ranks = [expand.source_ranks(idx, num_experts) for idx in topk]
    checked = 0
    for dest in range(num_ranks):
        rows, counts = [], torch.zeros(num_ranks, local, dtype=torch.int32)
        for source, idx in enumerate(topk):
            mine = (idx >= dest * local) & (idx < (dest + 1) * local)
            for t in torch.nonzero(mine.any(1)).flatten().tolist():
                rows.append((source, t, torch.where(mine[t], idx[t] - dest * local, -1)))
            counts[source] = torch.bincount((idx[mine] - dest * local).long(), minlength=local)
        recv_topk_idx = torch.stack([r[2] for r in rows]) if rows else torch.empty(0, 4, dtype=torch.int64)
        row_of = expand.expand_rows(recv_topk_idx, local, alignment)[0]
        bases = expand.expanded_bases(counts, alignment)
        for j, (source, t, local_ids) in enumerate(rows):
            for k, e in enumerate(local_ids.tolist()):
                want = -1 if e < 0 else int(bases[source, e]) + int(ranks[source][t, k])
                assert int(row_of[j, k]) == want, (dest, j, k)
                checked += e >= 0
    assert checked > 0
