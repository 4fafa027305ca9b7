"""The internode model of `python -m tokenyard.tools.bench --model` (NOTE [internode model] in
tokenyard/tools/bench/model/normal.py): its reach against sampled routings, its bytes where they are known exactly,
and its command line."""

from __future__ import annotations

import json

import pytest
import torch

from tokenyard.tools.bench import model
from tokenyard.tools.bench.model import common, low_latency, normal


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
    predicted = common.reach(num_nodes, gpus_per_node, num_experts, num_topk, groups)
    nodes, ranks = _sampled_reach(seed, num_nodes, gpus_per_node, num_experts, num_topk, groups)
    assert predicted["nodes"] == pytest.approx(nodes, abs=0.03), (predicted, nodes)
    assert predicted["ranks"] == pytest.approx(ranks, abs=0.06), (predicted, ranks)
    assert predicted["nodes"] <= (groups or num_nodes) + 1e-9


SETTING = dict(gpus_per_node=8, nic_gbps=400, nvlink_gbs=153, num_tokens=4096, hidden=7168, num_topk=8,
               num_experts=256, topk_groups=4)


def test_bytes_where_they_are_known_exactly():
    one_node = normal.predict(num_nodes=1, gpus_per_node=8, nic_gbps=400, nvlink_gbs=300, num_tokens=100, hidden=128,
                              num_topk=8, num_experts=64, rdma_efficiency=0.8)
    assert one_node["dispatch"]["nic_bytes"] == 0
    one_gpu_nodes = normal.predict(num_nodes=4, gpus_per_node=1, nic_gbps=400, nvlink_gbs=300, num_tokens=100,
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
    everywhere = normal.predict(num_nodes=2, gpus_per_node=2, nic_gbps=400, nvlink_gbs=300, num_tokens=100,
                                hidden=128, num_topk=4, num_experts=4, rdma_efficiency=0.8)["dispatch"]
    assert everywhere["row_bytes"] == 176  # 128 data + 4 scale + 8 source record + 4 x 8 top-k = 172, padded
    assert everywhere["rdma_stage_bytes"] == pytest.approx(100 * 2 * 176)
    assert everywhere["nic_bytes"] == pytest.approx(100 * 176)
    assert everywhere["nvlink_bytes"] == pytest.approx(100 * 2 * 176)


def test_rows_at_deepeps_published_setting():
    # hidden 7168 FP8, top-8: 7168 + 224 scales + 8 + 32 + 32 = 7464 -> 7472; combine 14336 + 8 + 32 = 14376 -> 14384
    assert normal.row_bytes(7168, 8, "fp8", False, "deepep") == 7472
    assert normal.row_bytes(7168, 8, "fp8", True, "deepep") == 14384
    assert normal.row_bytes(7168, 8, "fp8", False, "tokenyard") == 7552  # NOTE [normal-mode buffer]'s example
    assert normal.row_bytes(7168, 8, "fp8", True, "tokenyard") == 14464
    with pytest.raises(ValueError, match="row format"):
        normal.row_bytes(7168, 8, "fp8", False, "nccl")


@pytest.mark.parametrize("op", common.OPS)
@pytest.mark.parametrize("shape", [(2, 8, 256, 4, 0.73, 20.0), (8, 8, 256, 4, 0.9, 0.0), (4, 4, 64, None, 1.1, 50.0)])
def test_calibration_recovers_the_efficiency_of_a_synthetic_point(op, shape):
    num_nodes, gpus_per_node, num_experts, groups, efficiency, overhead_us = shape
    setting = dict(SETTING, num_nodes=num_nodes, gpus_per_node=gpus_per_node, num_experts=num_experts,
                   topk_groups=groups, nvlink_gbs=300)
    point = normal.predict(rdma_efficiency=efficiency, overhead_us=overhead_us, **setting)[op]["bottleneck_rdma_gbps"]
    assert normal.calibrate(point, op, overhead_us=overhead_us, **setting) == pytest.approx(efficiency)


def test_calibration_refuses_figures_that_say_nothing_about_the_rdma_stage():
    with pytest.raises(ValueError, match="NVLink bounds"):  # forwarding at 10 GB/s is slower than any NIC figure
        normal.calibrate(43.0, **dict(SETTING, num_nodes=2, nvlink_gbs=10))
    with pytest.raises(ValueError, match="line rate bounds"):  # 3/4 of 200 GB/s over a 50 GB/s wire
        normal.calibrate(200.0, **dict(SETTING, num_nodes=4, nvlink_gbs=1e4))
    with pytest.raises(ValueError, match="no time"):
        normal.calibrate(1e9, **dict(SETTING, num_nodes=4))


@pytest.mark.parametrize("calibrate_ep", sorted(normal.PUBLISHED["deepep"].points))
def test_predictions_within_ten_percent_of_deepeps_published_figures(calibrate_ep):
    """Issue 25's goal: calibrated on any one of DeepEP's dispatch figures, the model lands within 10% of every
    other (benchmarks/results/internode_model.md). Counting only the remote nodes' rows on the RDMA stage, or
    dropping the own node from the bottleneck figure, fails this."""
    result = normal.compare(normal.PUBLISHED["deepep"], calibrate_ep)
    for point in result["points"]:
        for op in common.OPS:
            assert abs(point[op]["error"]) < 0.10, (calibrate_ep, point["ep"], op, point[op])
            assert point[op]["bound"] == "rdma"
    fitted = next(p for p in result["points"] if p["ep"] == calibrate_ep)
    assert fitted["dispatch"]["error"] == pytest.approx(0, abs=1e-9)


def test_uccl_dispatch_within_ten_percent_calibrated_on_its_ep16():
    # its combine is not: NOTE [internode model]'s bytes do not explain UCCL-EP's combine (internode_model.md)
    for point in normal.compare(normal.PUBLISHED["uccl"])["points"]:
        assert abs(point["dispatch"]["error"]) < 0.10, point


def test_command_line(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert model.main(["--nodes", "4", "--topk_groups", "4", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("predicted, not measured") and "dispatch" in printed and "combine" in printed
    doc = json.loads(path.read_text())
    assert doc["predicted"] and doc["settings"]["nodes"] == 4 and doc["dispatch"]["us"] > doc["settings"]["overhead_us"]
    assert doc["rdma_efficiency"] == pytest.approx(normal.default_efficiency())
    # --calibrate on DeepEP's EP32 dispatch in DeepEP's setting fits the default efficiency
    assert model.main(["--topk_groups", "4", "--nvlink_gbs", "153", "--calibrate", "32,44", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["rdma_efficiency"] == pytest.approx(normal.default_efficiency())
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


# The low-latency model (NOTE [low-latency model] in tokenyard/tools/bench/model/low_latency.py).

LL_SETTING = dict(gpus_per_node=8, nic_gbps=400, nvlink_gbs=153, num_tokens=128, hidden=7168, num_topk=8,
                  num_experts=256)


def test_low_latency_messages_at_the_published_setting():
    # DeepEP: a 16-byte header, 7168 FP8 values and 56 float32 scales; the combine, the bf16 row alone
    assert low_latency.message_bytes(7168, 8, "dispatch") == 16 + 7168 + 224 == 7408
    assert low_latency.message_bytes(7168, 8, "dispatch", dtype="bf16") == 16 + 2 * 7168
    assert low_latency.message_bytes(7168, 8, "combine") == 2 * 7168
    # ours: an 80-byte header (the tag and token index, then per choice its local expert and pair slot, room for
    # 16) before the same data; the combine's row follows k weight words of 8 bytes
    assert low_latency.message_bytes(7168, 8, "dispatch", "tokenyard") == 80 + 7168 + 224
    assert low_latency.message_bytes(7168, 8, "combine", "tokenyard") == 2 * 7168 + 8 * 8
    with pytest.raises(ValueError, match="message format"):
        low_latency.message_bytes(7168, 8, "dispatch", "nccl")


def test_low_latency_bytes_where_they_are_known_exactly():
    ll = low_latency
    # pure RDMA on 2 nodes of 8: every message but the 1/16 to this rank itself crosses the NIC, a message per choice
    two_nodes = ll.predict(num_nodes=2, efficiency=0.5, overhead_us=3.0, **LL_SETTING)
    dispatch, combine = two_nodes["dispatch"], two_nodes["combine"]
    assert dispatch["messages"] == 128 * 8 and dispatch["nvlink_bytes"] == 0
    assert dispatch["nic_bytes"] == pytest.approx(128 * 8 * 15 / 16 * 7408)
    assert combine["nic_bytes"] == pytest.approx(128 * 8 * 15 / 16 * 14336)
    assert dispatch["us"] == pytest.approx(3.0 + 128 * 8 * 15 / 16 * 7408 / (400 / 8 * 1e3 * 0.5))
    # DeepEP's count: every selected pair's message, this rank's own included, over the call
    assert dispatch["counted_gbps"] == pytest.approx(128 * 8 * 7408 / dispatch["us"] / 1e3)
    # NVLink for same-node peers: half the ranks are on the other node; the other 7/16 go over NVLink
    nvlink = ll.predict(num_nodes=2, efficiency=0.5, route="nvlink", **LL_SETTING)["dispatch"]
    assert nvlink["nic_bytes"] == pytest.approx(128 * 8 * 8 / 16 * 7408)
    assert nvlink["nvlink_bytes"] == pytest.approx(128 * 8 * 7 / 16 * 7408)
    one_node = ll.predict(num_nodes=1, efficiency=0.5, route="nvlink", **LL_SETTING)["combine"]
    assert one_node["nic_bytes"] == 0 and one_node["bound"] == "nvlink"
    # ours: top-8 of 14 experts on 2 single-GPU nodes reaches both ranks (7 experts each: 8 distinct choices do
    # not fit on one), so a token makes 2 messages, one to itself, instead of 8
    ours = ll.predict(num_nodes=2, gpus_per_node=1, nic_gbps=400, nvlink_gbs=153, num_tokens=10, hidden=128,
                      num_topk=8, num_experts=14, efficiency=1.0, message_format="tokenyard")
    assert ours["messages_per_token"] == pytest.approx(2.0)
    assert ours["dispatch"]["nic_bytes"] == pytest.approx(10 * 2 * 1 / 2 * (80 + 128 + 4))
    assert ours["combine"]["nic_bytes"] == pytest.approx(10 * 2 * 1 / 2 * (256 + 8 * 8))


@pytest.mark.parametrize("op", common.OPS)
@pytest.mark.parametrize("shape", [(2, "deepep", "rdma", 0.83, 5.0), (4, "tokenyard", "nvlink", 0.6, 0.0),
                                   (32, "deepep", "nvlink", 0.95, 12.0), (3, "tokenyard", "rdma", 0.4, 20.0)])
def test_low_latency_calibration_recovers_the_efficiency_of_a_synthetic_point(op, shape):
    num_nodes, message_format, route, efficiency, overhead_us = shape
    setting = dict(LL_SETTING, num_nodes=num_nodes, num_experts=num_nodes * 8 * 4)
    us = low_latency.predict(efficiency=efficiency, overhead_us=overhead_us, message_format=message_format,
                             route=route, **setting)[op]["us"]
    fitted = low_latency.calibrate(us, op, overhead_us=overhead_us, message_format=message_format, route=route,
                                   **setting)
    assert fitted == pytest.approx(efficiency)


def test_low_latency_calibration_refuses_times_that_say_nothing_about_the_nic():
    ll = low_latency
    with pytest.raises(ValueError, match="no time"):
        ll.calibrate(4.0, overhead_us=5.0, num_nodes=2, **LL_SETTING)
    with pytest.raises(ValueError, match="line rate"):  # 7.1 MB through a 50 GB/s NIC in 100 µs
        ll.calibrate(100.0, num_nodes=2, **LL_SETTING)
    with pytest.raises(ValueError, match="crosses the NIC"):
        ll.calibrate(200.0, num_nodes=1, route="nvlink", **LL_SETTING)
    with pytest.raises(ValueError, match="NVLink alone"):
        ll.calibrate(200.0, num_nodes=2, route="nvlink", **dict(LL_SETTING, nvlink_gbs=1.0))


def test_low_latency_within_ten_percent_of_deepeps_published_times_from_ep16():
    """Issue 26's goal: calibrated on DeepEP's EP32 dispatch (the committed default), the model lands within 10% of
    every published time from EP16 up, dispatch and combine (benchmarks/results/internode_model.md). Counting the
    sending and the receiving together fails it (no efficiency of at most 1 fits), and so does counting only the
    messages to other nodes. Counting every message on the NIC (the rank's own too), or one message per rank reached
    for DeepEP, passes here but fails the next test, calibrated on another point."""
    result = low_latency.compare(low_latency.PUBLISHED["deepep"])
    assert result["calibrated_on"] == {"ep": 32, "op": "dispatch", "us": 182.0}
    assert 0 < result["efficiency"] <= 1
    assert result["efficiency"] == pytest.approx(low_latency.default_efficiency())
    for point in result["points"]:
        for op in common.OPS:
            if point["ep"] >= 16:
                assert abs(point[op]["error"]) < 0.10, (point["ep"], op, point[op])
    fitted = next(p for p in result["points"] if p["ep"] == 32)
    assert fitted["dispatch"]["error"] == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("calibrate_ep", sorted(low_latency.PUBLISHED["deepep"].points))
def test_low_latency_goal_holds_whichever_deepep_dispatch_is_fitted(calibrate_ep):
    for point in low_latency.compare(low_latency.PUBLISHED["deepep"], calibrate_ep)["points"]:
        for op in common.OPS:
            assert abs(point[op]["error"]) < 0.10 or point["ep"] < 16, (calibrate_ep, point["ep"], op, point[op])


def test_low_latency_uccl_times_grow_with_ranks_not_bytes():
    # internode_model.md's reason the model cannot explain UCCL-EP: from EP16 to EP32 its times double while the bytes
    # a GPU sends grow by 1/30 (15/16 -> 31/32 of its messages), so no efficiency fits both ends within 10%
    published = low_latency.PUBLISHED["uccl"]
    result = low_latency.compare(published)
    ep16, ep32 = result["points"][0], result["points"][-1]
    assert ep32["dispatch"]["nic_bytes"] / ep16["dispatch"]["nic_bytes"] == pytest.approx(31 / 30)
    assert published.points[32][0] / published.points[16][0] > 2
    assert abs(ep32["dispatch"]["error"]) > 0.4


def test_low_latency_per_rank_messages_save_nic_bytes_where_ranks_hold_several_experts():
    choice = low_latency.nic_bytes_by_choice(low_latency.PUBLISHED["deepep"], 16, 0.8)
    dispatch = {key: c["dispatch"]["nic_bytes"] for key, c in choice.items()}
    assert dispatch["tokenyard_rdma"] < dispatch["deepep_rdma"]
    assert dispatch["deepep_nvlink"] == pytest.approx(dispatch["deepep_rdma"] * 8 / 15)  # 8 of the 15 peers remote
    assert dispatch["tokenyard_nvlink"] < dispatch["deepep_nvlink"]
    # one expert per rank (EP256 of 256): nothing to merge, and our larger header costs 64 bytes a message
    one_each = low_latency.nic_bytes_by_choice(low_latency.PUBLISHED["deepep"], 256, 0.8)
    assert one_each["tokenyard_rdma"]["messages_per_token"] == pytest.approx(8)
    assert one_each["tokenyard_rdma"]["dispatch"]["nic_bytes"] == pytest.approx(
        one_each["deepep_rdma"]["dispatch"]["nic_bytes"] * 7472 / 7408)


def test_low_latency_command_line(tmp_path, capsys):
    path = tmp_path / "ll.json"
    assert model.main(["--mode", "low_latency", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("predicted, not measured (NOTE [low-latency model]")
    doc = json.loads(path.read_text())
    assert doc["predicted"] and doc["settings"]["mode"] == "low_latency" and doc["settings"]["num_tokens"] == 128
    assert doc["efficiency"] == pytest.approx(low_latency.default_efficiency())
    assert doc["dispatch"]["us"] == pytest.approx(182.0)  # 4 nodes of 8 is DeepEP's EP32, the fitted point
    assert model.main(["--mode", "low_latency", "--calibrate", "16,173", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["efficiency"] == pytest.approx(
        low_latency.compare(low_latency.PUBLISHED["deepep"], 16)["efficiency"])
    assert model.main(["--mode", "low_latency", "--published", "deepep", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert len(doc["points"]) == 6 and set(doc["nic_bytes"]["16"]) == {f"{f}_{r}" for f, r in
                                                                        low_latency.CHOICES}
    assert model.main(["--mode", "low_latency", "--published", "uccl", "--calibrate_on", "24"]) == 0
    capsys.readouterr()
    assert model.main(["--mode", "low_latency", "--published", "deepep", "--calibrate_on", "24"]) == 2
    assert model.main(["--mode", "low_latency", "--published", "deepep", "--efficiency", "0.8"]) == 2
    assert model.main(["--mode", "low_latency", "--calibrate", "16,50"]) == 2  # faster than the wire
    assert "line rate" in capsys.readouterr().err
    # normal mode stays the default, and --mode normal says so explicitly
    assert model.main(["--mode", "normal", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["rdma_efficiency"] == pytest.approx(normal.default_efficiency())
    with pytest.raises(SystemExit):
        model.main(["--mode", "compare_sm"])


def test_bench_command_line_reaches_the_low_latency_model(capsys):
    from tokenyard.tools.bench.__main__ import main

    assert main(["--model", "--mode", "low_latency", "--nodes", "2"]) == 0
    assert "NOTE [low-latency model]" in capsys.readouterr().out
