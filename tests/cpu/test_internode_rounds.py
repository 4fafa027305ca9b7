"""The bookkeeping of internode rounds on the CUDA path (NOTE [internode rounds] in backends/cuda/internode.py),
without a GPU: with every rank's per-round counts, the rounds' received rows put in order of source then round
are the whole call's rows, so are the forwarders' rows, and a combine round's rows and remapped landing rows are
those the round's own dispatch would have given, all against routing.internode_handles on random routings."""

from __future__ import annotations

import pytest
import torch

from tokenyard.backends.cuda.internode import _source_major, combine_round_rows, round_counts
from tokenyard.semantics import routing


def _routings(num_ranks, num_tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for s in range(num_ranks):
        tokens = 0 if s == 1 else num_tokens - 3 * s  # rank 1 sends nothing; the others differ
        out.append(torch.rand(tokens, num_ranks, generator=generator) < 0.35)
    return out


@pytest.mark.parametrize("num_ranks,per_node,per_round", [(4, 2, 7), (8, 4, 5), (8, 2, 11)])
def test_rounds_regroup_into_the_whole_call_and_remap_its_landing_rows(num_ranks, per_node, per_round):
    seed = int(torch.randint(0, 2**30, ()).item())
    in_ranks = _routings(num_ranks, 29, seed)
    most = max(t.size(0) for t in in_ranks)
    num_rounds = -(-most // per_round)
    num_nodes = num_ranks // per_node
    table = torch.stack([round_counts(t, per_node, per_round, num_rounds)[0] for t in in_ranks]).long()
    whole = routing.internode_handles(in_ranks, per_node)
    rounds = [routing.internode_handles([t[r * per_round:(r + 1) * per_round] for t in in_ranks], per_node)
              for r in range(num_rounds)]

    for q in range(num_ranks):
        node, local = divmod(q, per_node)
        # Dispatch: each round's received rows (tokens back in whole-call numbering), regrouped.
        metas = []
        for r in range(num_rounds):
            meta = rounds[r][q]["recv_src_meta"].clone()
            meta[:, 1] += r * per_round
            metas.append(meta)
        regrouped = torch.cat(metas)[_source_major(table[:, :, q])]
        assert torch.equal(regrouped, whole[q]["recv_src_meta"]), f"seed {seed} rank {q}: received rows"
        sources = [k * per_node + local for k in range(num_nodes)]
        masks = torch.cat([rounds[r][q]["send_nvl_head"] >= 0 for r in range(num_rounds)])
        forwarded_order = _source_major(table[sources, :, num_ranks + node])
        assert torch.equal(masks[forwarded_order], whole[q]["send_nvl_head"] >= 0), f"seed {seed} rank {q}: forwarded"

        # Combine: the round's rows and landing rows, from the whole call's handle.
        forwarded_per_node = whole[q]["recv_rdma_channel_prefix_matrix"][:, 0].tolist()
        for r in range(num_rounds):
            mine, _, head, forwarded = combine_round_rows(table, r, per_round, q, per_node,
                                                          whole[q]["recv_src_meta"][:, 1], whole[q]["send_nvl_head"],
                                                          forwarded_per_node)
            got = whole[q]["recv_src_meta"][mine].clone()
            got[:, 1] -= r * per_round
            assert torch.equal(got, rounds[r][q]["recv_src_meta"]), f"seed {seed} rank {q} round {r}: rows"
            assert torch.equal(head, rounds[r][q]["send_nvl_head"]), f"seed {seed} rank {q} round {r}: landing rows"
            assert forwarded == rounds[r][q]["recv_rdma_channel_prefix_matrix"][:, 0].tolist()
