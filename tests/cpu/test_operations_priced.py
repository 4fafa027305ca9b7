"""The models price operations beside bytes (issue 53, item 3; NOTE [operations priced] in
tokenyard/tools/bench/model/pricing.py): DeepEP's published low-latency tables within 10% after calibrating on one
point, the work requests (WRs) binding none of DeepEP's calls, and a call with many more WRs per byte predicted
slower where the WR rate binds."""

from __future__ import annotations

import json

import pytest

from tokenyard.tools.bench import model
from tokenyard.tools.bench.model import common, low_latency, normal, operations, pricing

SEED = low_latency.PUBLISHED["deepep"]            # DeepEP README: pure RDMA
NVLINK = low_latency.PUBLISHED["deepep_nvlink"]   # DeepEP docs/legacy.md: same-node peers over NVLink


def _worst(result: dict) -> float:
    return max(abs(point[op]["error"]) for point in result["points"] for op in common.OPS)


@pytest.mark.parametrize("calibrate_ep", sorted(SEED.points))
def test_every_readme_time_within_ten_percent_calibrated_on_any_one_dispatch(calibrate_ep):
    """EP8 included: t0 assumed, the efficiency the one fitted parameter."""
    result = low_latency.compare(SEED, calibrate_ep)
    assert result["overhead_us"] == low_latency.OVERHEAD_US and result["overhead_fitted_on"] is None
    assert _worst(result) < 0.10, calibrate_ep


@pytest.mark.parametrize("calibrate_ep", [16, 32, 64])
def test_every_legacy_time_within_ten_percent_with_t0_from_its_nvlink_only_point(calibrate_ep):
    """legacy.md's table: t0 from EP8 (every peer on NVLink, no byte on the NIC), the efficiency from one dispatch."""
    result = low_latency.compare(NVLINK, calibrate_ep)
    assert result["overhead_fitted_on"] == {"ep": 8, "op": "dispatch"}
    ep8 = result["points"][0]
    assert ep8["ep"] == 8 and ep8["dispatch"]["nic_bytes"] == 0 and ep8["dispatch"]["bound"] == "nvlink"
    assert ep8["dispatch"]["error"] == pytest.approx(0, abs=1e-9)  # t0 is fitted there
    assert _worst(result) < 0.10, calibrate_ep


def test_legacy_table_needs_its_own_t0():
    """With the README table's assumed t0 the legacy table's NVLink-only EP8 misses by far, and EP8 cannot fit the
    efficiency (nothing crosses the NIC there): the reason it is calibrated on two points."""
    assumed = low_latency.compare(NVLINK, overhead_us=low_latency.OVERHEAD_US)
    assert abs(assumed["points"][0]["dispatch"]["error"]) > 0.3
    with pytest.raises(ValueError, match="crosses the NIC"):
        low_latency.compare(NVLINK, 8)
    fitted = low_latency.fit_overhead(NVLINK)
    nvlink_bytes = 128 * 8 * 7 / 8 * 7408  # every pair on another rank of the node, DeepEP's message
    assert fitted == pytest.approx(77.0 - nvlink_bytes / (common.DEEPEP_NVLINK_GBS * 1e3))
    with pytest.raises(ValueError, match="names no point"):
        low_latency.fit_overhead(SEED)


@pytest.mark.parametrize("published", [SEED, NVLINK])
def test_work_requests_bind_no_published_deepep_call(published):
    """DeepEP's 7 to 14 KB per WR: at the datasheet rate the bytes' term is the larger at every point, and the
    published times allow any WR rate above a few million per second, so they cannot fit one."""
    result = low_latency.compare(published)
    for point in result["points"]:
        for op in common.OPS:
            r = point[op]
            assert r["bound"] in ("nic", "nvlink") and r["terms_us"]["wr"] < 0.05 * r["us"], (point["ep"], op)
            assert r["wr_rate_at_least"] < 10 < pricing.WORK_REQUESTS_PER_US


def test_work_requests_follow_the_operation_counts():
    setting = SEED.setting(32)
    counts = operations.deepep_low_latency("dispatch", 128, 8, setting["num_experts"], 4, 8, 7168)
    ours = operations.tokenyard_low_latency("combine", 128, 8, setting["num_experts"], 4, 8, 7168)
    # DeepEP, pure RDMA: a put per pair on another rank and an atomic per expert there
    assert operations.work_requests(counts, "rdma") == pytest.approx(counts["nic_puts"] + counts["nic_atomics"])
    predicted = low_latency.predict(efficiency=0.8, **setting)["dispatch"]
    assert predicted["work_requests"] == pytest.approx(counts["nic_puts"] + counts["nic_atomics"])
    assert predicted["messages"] == 128 * 8
    # ours: a remote row per (token, remote rank); per remote rank the weights' put with its signal, then a flag
    assert operations.work_requests(ours) == pytest.approx(ours["puts_remote"] + 24 * 2 + 24)
    mine = low_latency.predict(efficiency=0.8, message_format="tokenyard", route="nvlink", **setting)["combine"]
    assert mine["work_requests"] == pytest.approx(operations.work_requests(ours))
    # the model carries k weight words per message, the kernel every token's k per remote rank: within 2% here
    assert mine["nic_bytes"] == pytest.approx(ours["put_bytes_remote"], rel=0.02)
    with pytest.raises(ValueError):
        operations.work_requests(counts, "ib")


def test_work_requests_set_the_time_where_the_rate_binds():
    """At EP32 with NVLink, bytes set both combines' times at the datasheet rate, ours the shorter (fewer NIC bytes).
    At 2 WRs per µs the work requests set both, and ours, which puts a rank's weights at once (issue 53's cut),
    posts fewer than DeepEP's rows and flags: a model of bytes alone would not move either."""
    setting = dict(NVLINK.setting(32), nvlink_gbs=300.0)
    calls = {(fmt, rate): low_latency.predict(efficiency=0.9, message_format=fmt, route="nvlink", wr_rate=rate,
                                              **setting)["combine"]
             for fmt in ("deepep", "tokenyard") for rate in (pricing.WORK_REQUESTS_PER_US, 2.0)}
    for fmt in ("deepep", "tokenyard"):
        fast, slow = calls[fmt, pricing.WORK_REQUESTS_PER_US], calls[fmt, 2.0]
        assert fast["bound"] == "nic" and slow["bound"] == "wr"
        assert slow["us"] == pytest.approx(low_latency.OVERHEAD_US + slow["work_requests"] / 2.0)
        assert slow["us"] > fast["us"]
    ours, theirs = calls["tokenyard", 2.0], calls["deepep", 2.0]
    assert ours["nic_bytes"] < theirs["nic_bytes"] and ours["work_requests"] < theirs["work_requests"]
    assert calls["tokenyard", pricing.WORK_REQUESTS_PER_US]["us"] < calls["deepep", pricing.WORK_REQUESTS_PER_US]["us"]


def test_normal_mode_prices_work_requests_that_bind_nowhere_published():
    result = normal.compare(normal.PUBLISHED["deepep"])
    for point in result["points"]:
        for op in common.OPS:
            assert point[op]["work_requests"] > 0 and point[op]["bound"] == "rdma"
    slow = normal.predict(rdma_efficiency=0.9, wr_rate=0.5, **normal.PUBLISHED["deepep"].setting(32))["dispatch"]
    assert slow["bound"] == "wr" and slow["us"] == pytest.approx(20.0 + slow["work_requests"] / 0.5)
    with pytest.raises(ValueError, match="WR rate"):
        pricing.work_request_us(1.0, 0.0)


def test_model_json_says_it_prices_operations(tmp_path, capsys):
    path = tmp_path / "model.json"
    for argv in (["--mode", "low_latency"], ["--mode", "low_latency", "--published", "deepep_nvlink"], []):
        assert model.main([*argv, "--json", str(path)]) == 0
        doc = json.loads(path.read_text())
        assert doc["model_prices_operations"] is True
    printed = capsys.readouterr().out
    assert "NIC WRs" in printed
    # the legacy table's calibration for a cluster: its EP32 efficiency and its EP8 t0
    assert model.main(["--mode", "low_latency", "--calibration_table", "deepep_nvlink", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    fit = low_latency.compare(NVLINK)
    assert doc["efficiency"] == pytest.approx(fit["efficiency"]) and doc["overhead_us"] == pytest.approx(
        fit["overhead_us"])
    assert doc["dispatch"]["work_requests"] > 0 and "wr" in doc["dispatch"]["terms_us"]
    assert model.main(["--mode", "low_latency", "--published", "deepep_nvlink", "--calibrate_on", "8"]) == 2
    assert "crosses the NIC" in capsys.readouterr().err
