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


SETTING = dict(gpus_per_node=8, nic_gbps=400, nvlink_gbs=153, num_tokens=4096, hidden=7168, num_topk=8,
               num_experts=256, topk_groups=4)


def test_bytes_where_they_are_known_exactly():
    one_node = model.predict(num_nodes=1, gpus_per_node=8, nic_gbps=400, nvlink_gbs=300, num_tokens=100, hidden=128,
                             num_topk=8, num_experts=64, rdma_efficiency=0.8)
    assert one_node["dispatch"]["nic_bytes"] == 0
    one_gpu_nodes = model.predict(num_nodes=4, gpus_per_node=1, nic_gbps=400, nvlink_gbs=300, num_tokens=100,
                                  hidden=128, num_topk=1, num_experts=4, rdma_efficiency=0.8, overhead_us=0)
    # top-1 of 4 experts on 4 single-GPU nodes: every token reaches one node, 3/4 of them a remote one, and none
    # crosses NVLink; the own node's rows take the RDMA stage too. DeepEP's row: 128 data + 4 scale + 8 source
    # record + 4 id + 4 weight bytes = 148, padded to 160; its combine row: 256 + 8 + 4 = 268, padded to 272.
    dispatch, combine = one_gpu_nodes["dispatch"], one_gpu_nodes["combine"]
    assert dispatch["row_bytes"] == 160 and combine["row_bytes"] == 272
    assert dispatch["rdma_stage_bytes"] == pytest.approx(100 * 160)
    assert dispatch["nic_bytes"] == pytest.approx(100 * 0.75 * 160)
    assert dispatch["nvlink_bytes"] == 0 and dispatch["bound"] == "rdma"
    assert dispatch["us"] == pytest.approx(100 * 160 / (400 / 8 * 1e3 * 0.8))
    assert combine["nic_bytes"] == pytest.approx(100 * 0.75 * 272)
    # DeepEP's figure counts the data and FP8 scales of every node a token reaches: 100 x 132 bytes
    assert dispatch["bottleneck_rdma_gbps"] == pytest.approx(100 * 132 / dispatch["us"] / 1e3)
    # top-4 of 4 experts on 2 nodes of 2 GPUs: every token reaches both nodes and, in each, both ranks; the
    # forwarder feeds itself and one peer over NVLink, so half of 2 x 2 rows cross it
    everywhere = model.predict(num_nodes=2, gpus_per_node=2, nic_gbps=400, nvlink_gbs=300, num_tokens=100,
                               hidden=128, num_topk=4, num_experts=4, rdma_efficiency=0.8)["dispatch"]
    assert everywhere["row_bytes"] == 176  # 128 data + 4 scale + 8 source record + 4 x 8 top-k = 172, padded
    assert everywhere["rdma_stage_bytes"] == pytest.approx(100 * 2 * 176)
    assert everywhere["nic_bytes"] == pytest.approx(100 * 176)
    assert everywhere["nvlink_bytes"] == pytest.approx(100 * 2 * 176)


def test_rows_at_deepeps_published_setting():
    # hidden 7168 FP8, top-8: 7168 + 224 scales + 8 + 32 + 32 = 7464 -> 7472; combine 14336 + 8 + 32 = 14376 -> 14384
    assert model.row_bytes(7168, 8, "fp8", False, "deepep") == 7472
    assert model.row_bytes(7168, 8, "fp8", True, "deepep") == 14384
    assert model.row_bytes(7168, 8, "fp8", False, "tokenyard") == 7552  # NOTE [normal-mode buffer]'s example
    assert model.row_bytes(7168, 8, "fp8", True, "tokenyard") == 14464
    with pytest.raises(ValueError, match="row format"):
        model.row_bytes(7168, 8, "fp8", False, "nccl")


@pytest.mark.parametrize("op", model.OPS)
@pytest.mark.parametrize("shape", [(2, 8, 256, 4, 0.73, 20.0), (8, 8, 256, 4, 0.9, 0.0), (4, 4, 64, None, 1.1, 50.0)])
def test_calibration_recovers_the_efficiency_of_a_synthetic_point(op, shape):
    num_nodes, gpus_per_node, num_experts, groups, efficiency, overhead_us = shape
    setting = dict(SETTING, num_nodes=num_nodes, gpus_per_node=gpus_per_node, num_experts=num_experts,
                   topk_groups=groups, nvlink_gbs=300)
    point = model.predict(rdma_efficiency=efficiency, overhead_us=overhead_us, **setting)[op]["bottleneck_rdma_gbps"]
    assert model.calibrate(point, op, overhead_us=overhead_us, **setting) == pytest.approx(efficiency)


def test_calibration_refuses_figures_that_say_nothing_about_the_rdma_stage():
    with pytest.raises(ValueError, match="NVLink bounds"):  # forwarding at 10 GB/s is slower than any NIC figure
        model.calibrate(43.0, **dict(SETTING, num_nodes=2, nvlink_gbs=10))
    with pytest.raises(ValueError, match="line rate bounds"):  # 3/4 of 200 GB/s over a 50 GB/s wire
        model.calibrate(200.0, **dict(SETTING, num_nodes=4, nvlink_gbs=1e4))
    with pytest.raises(ValueError, match="no time"):
        model.calibrate(1e9, **dict(SETTING, num_nodes=4))


@pytest.mark.parametrize("calibrate_ep", sorted(model.PUBLISHED["deepep"].points))
def test_predictions_within_ten_percent_of_deepeps_published_figures(calibrate_ep):
    """Issue 25's goal: calibrated on any one of DeepEP's dispatch figures, the model lands within 10% of every
    other (benchmarks/results/internode_model.md). Counting only the remote nodes' rows on the RDMA stage, or
    dropping the own node from the bottleneck figure, fails this."""
    result = model.compare(model.PUBLISHED["deepep"], calibrate_ep)
    for point in result["points"]:
        for op in model.OPS:
            assert abs(point[op]["error"]) < 0.10, (calibrate_ep, point["ep"], op, point[op])
            assert point[op]["bound"] == "rdma"
    fitted = next(p for p in result["points"] if p["ep"] == calibrate_ep)
    assert fitted["dispatch"]["error"] == pytest.approx(0, abs=1e-9)


def test_uccl_dispatch_within_ten_percent_calibrated_on_its_ep16():
    # its combine is not: NOTE [internode model]'s bytes do not explain UCCL-EP's combine (internode_model.md)
    for point in model.compare(model.PUBLISHED["uccl"])["points"]:
        assert abs(point["dispatch"]["error"]) < 0.10, point


def test_command_line(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert model.main(["--nodes", "4", "--topk_groups", "4", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("predicted, not measured") and "dispatch" in printed and "combine" in printed
    doc = json.loads(path.read_text())
    assert doc["predicted"] and doc["settings"]["nodes"] == 4 and doc["dispatch"]["us"] > doc["settings"]["overhead_us"]
    assert doc["rdma_efficiency"] == pytest.approx(model.default_efficiency())
    # --calibrate on DeepEP's EP32 dispatch in DeepEP's setting fits the default efficiency
    assert model.main(["--topk_groups", "4", "--nvlink_gbs", "153", "--calibrate", "32,44", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["rdma_efficiency"] == pytest.approx(model.default_efficiency())
    assert model.main(["--published", "deepep", "--json", str(path)]) == 0
    capsys.readouterr()
    doc = json.loads(path.read_text())
    assert doc["calibrated_on"] == {"ep": 32, "op": "dispatch", "gbps": 44.0} and len(doc["points"]) == 3
    assert model.main(["--nodes", "3", "--num_experts", "256"]) == 2  # 256 experts over 24 ranks
    assert "do not divide" in capsys.readouterr().err
    assert model.main(["--published", "deepep", "--calibrate", "32,44"]) == 2
    assert model.main(["--calibrate_on", "16"]) == 2
    assert model.main(["--published", "deepep", "--calibrate_on", "24"]) == 2
    with pytest.raises(SystemExit):
        model.main(["--calibrate", "32"])
