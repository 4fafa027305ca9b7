"""The internode model of `python -m tokenyard.tools.bench --model` (NOTE [internode model] in
tokenyard/tools/bench/model.py): its reach against sampled routings, its bytes where they are known exactly, and
its command line."""

from __future__ import annotations

import json

import pytest
import torch

from tokenyard.tools.bench import model


def _sampled_reach(seed, num_nodes, gpus_per_node, num_experts, num_topk, topk_groups=None, tokens=20000):
    """Mean distinct nodes and ranks of `tokens` routings: k distinct experts, uniform, from `topk_groups` random
    nodes' experts where given."""
    gen = torch.Generator().manual_seed(seed)
    per_node, per_rank = num_experts // num_nodes, num_experts // (num_nodes * gpus_per_node)
    groups = num_nodes if topk_groups is None else topk_groups
    nodes = ranks = 0.0
    for _ in range(tokens // 100):
        chosen = torch.stack([torch.randperm(num_nodes, generator=gen)[:groups] for _ in range(100)])  # [100, M]
        pool = (chosen.unsqueeze(-1) * per_node + torch.arange(per_node)).flatten(1)  # the chosen nodes' experts
        picks = torch.stack([torch.randperm(pool.size(1), generator=gen)[:num_topk] for _ in range(100)])
        experts = pool.gather(1, picks)
        for row in experts:
            nodes += (row // per_node).unique().numel()
            ranks += (row // per_rank).unique().numel()
    return nodes / tokens, ranks / tokens


@pytest.mark.parametrize("shape", [(4, 8, 256, 8, None), (2, 8, 256, 8, None), (8, 8, 256, 8, 4), (4, 2, 64, 6, 2)])
def test_reach_matches_sampled_routings(seed, shape):
    num_nodes, gpus_per_node, num_experts, num_topk, groups = shape
    predicted = model.reach(num_nodes, gpus_per_node, num_experts, num_topk, groups)
    nodes, ranks = _sampled_reach(seed, num_nodes, gpus_per_node, num_experts, num_topk, groups)
    assert predicted["nodes"] == pytest.approx(nodes, abs=0.03), (predicted, nodes)
    assert predicted["ranks"] == pytest.approx(ranks, abs=0.06), (predicted, ranks)
    assert predicted["nodes"] <= (groups or num_nodes) + 1e-9


def test_bytes_where_they_are_known_exactly():
    one_node = model.predict(num_nodes=1, gpus_per_node=8, nic_gbps=400, nvlink_gbs=300, num_tokens=100, hidden=128,
                             num_topk=8, num_experts=64)
    assert one_node["dispatch"]["rdma_bytes"] == 0 and one_node["dispatch"]["bound"] == "nvlink"
    one_gpu_nodes = model.predict(num_nodes=4, gpus_per_node=1, nic_gbps=400, nvlink_gbs=300, num_tokens=100,
                                  hidden=128, num_topk=1, num_experts=4, overhead_us=0)
    # top-1 of 4 experts on 4 single-GPU nodes: 3/4 of the tokens leave the node, none crosses NVLink
    row = 128 * (1 + 4 / 128) + 8 + 4
    assert one_gpu_nodes["dispatch"]["rdma_bytes"] == pytest.approx(100 * 0.75 * row)
    assert one_gpu_nodes["dispatch"]["nvlink_bytes"] == 0
    assert one_gpu_nodes["dispatch"]["us"] == pytest.approx(100 * 0.75 * row / (400 / 8 * 1e3 * 0.8))
    assert one_gpu_nodes["combine"]["rdma_bytes"] == pytest.approx(100 * 0.75 * (2 * 128 + 4))


def test_command_line(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert model.main(["--nodes", "4", "--topk_groups", "4", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("predicted, not measured") and "dispatch" in printed and "combine" in printed
    doc = json.loads(path.read_text())
    assert doc["predicted"] and doc["settings"]["nodes"] == 4 and doc["dispatch"]["us"] > doc["settings"]["overhead_us"]
    assert model.main(["--nodes", "3", "--num_experts", "256"]) == 2  # 256 experts over 24 ranks
    assert "do not divide" in capsys.readouterr().err
