"""benchmarks/moe_step.py (tokenyard/tools/bench/moe_step.py) at 2 gloo ranks, CPU-sized: the record's keys, the
correctness checks it runs before timing, and a wrong variant failing them."""

import dataclasses
import json

import pytest

from tokenyard.tools.bench import BenchError, moe_step

FEW_ITERS = ["--cpu", "--num_ranks", "2", "--iters", "1", "--warmup", "0"]
STEP_KEYS = {"gemm_only_us", "tokenyard_us", "tokenyard_overlap_us", "all_to_all_us", "num_sms",
             "gemm_slowdown_by_num_sms", "tokenyard_overlap_us_by_num_sms", "counts", "checks", "gemm"}


def test_both_steps_write_the_issue_record_after_checking_every_variant(tmp_path, capsys):
    out = tmp_path / "moe_step.json"
    assert moe_step.main(FEW_ITERS + ["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"commit", "device", "date", "num_gpus", "settings", "train", "decode"} <= set(doc)
    for step in ("train", "decode"):
        assert STEP_KEYS <= set(doc[step]), f"{step} lacks {STEP_KEYS - set(doc[step])}"
        assert all(doc[step][k] > 0 for k in STEP_KEYS if k.endswith("_us"))
        assert {"hbm_floor_us", "tensor_core_floor_us", "flop", "hbm_bytes"} <= set(doc[step]["counts"])
    for variant in ("tokenyard", "tokenyard_overlap", "all_to_all"):
        assert f"{variant} output" in doc["train"]["checks"] and f"{variant} input gradient" in doc["train"]["checks"]
        assert f"{variant} output" in doc["decode"]["checks"]
    for step, variant in (("train", "tokenyard"), ("train", "all_to_all"), ("decode", "tokenyard"),
                          ("decode", "all_to_all")):
        assert f"{variant} dispatch" in doc[step]["checks"]
    assert "overlaps nothing" in capsys.readouterr().out


def test_three_train_micro_batches_are_each_checked_and_the_record_says_how_many(tmp_path):
    """Train takes --micro_batches; decode keeps two (SGLang's two-batch overlap, NOTE [whole micro-batches])."""
    out = tmp_path / "moe_step.json"
    assert moe_step.main(FEW_ITERS + ["--micro_batches", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["train"]["micro_batches"] == 3 and doc["decode"]["micro_batches"] == 2
    assert {"tokenyard_overlap output", "tokenyard_overlap input gradient"} <= set(doc["train"]["checks"])
    with pytest.raises(SystemExit):
        moe_step.parse(FEW_ITERS + ["--micro_batches", "1"], 0)


@pytest.mark.parametrize("step,variant", [("train", "tokenyard_overlap"), ("decode", "all_to_all")])
def test_a_variant_whose_output_is_wrong_fails_the_check_before_timing(step, variant):
    settings = dataclasses.replace(moe_step.parse(FEW_ITERS + ["--step", step], 0), corrupt=variant)
    with pytest.raises(BenchError, match=f"{step} {variant}: output"):
        moe_step.run(settings)


def test_the_floors_of_deepseek_v3_decode_read_the_local_experts_weights_once():
    counts = moe_step.step_counts(moe_step.GPU_SHAPES["decode"], 4, train=False)
    assert counts["weight_bytes"] == 8 * 3 * 7168 * 2048 * 2  # 8 local experts' gate_up and down, bf16
    assert 200 < counts["hbm_floor_us"] < 230
    train = moe_step.step_counts(moe_step.GPU_SHAPES["train"], 4, train=True)
    assert train["flop"] == 3 * 6 * 7168 * 2048 * 4096 * 8
    h200 = moe_step.step_counts(moe_step.GPU_SHAPES["decode"], 4, train=False, device_name="NVIDIA H200")
    assert h200["hbm_floor_us"] == pytest.approx(counts["hbm_floor_us"] * 3.35 / 4.8)
    assert h200["floors_from"].startswith("H200")


def test_the_main_command_runs_the_step_as_its_moe_mode(capsys):
    from tokenyard.tools.bench.__main__ import main

    assert main(["--mode", "moe", "--step", "decode"] + FEW_ITERS) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "all_to_all" in out and "train" not in out


def test_the_step_breakdown_splits_a_span_into_kinds_idle_time_and_communication_not_hidden():
    from tokenyard.tools.bench import moe_trace

    kernels = [("tokenyard::normal::dispatch(Params)", 0.0, 10.0),
               ("sm90_xmma_gemm_bf16bf16_bf16f32", 5.0, 30.0),  # overlaps the dispatch's last 5 µs
               ("nvjet_hsh_128x256_grouped", 20.0, 35.0),       # overlaps the first GEMM: counted once
               ("void at::native::index_add_kernel", 40.0, 45.0),  # after a 5 µs gap
               ("ncclDevKernel_SendRecv", 44.0, 50.0)]
    parts = moe_trace.breakdown(kernels)
    assert parts == {"span_us": 50.0, "tokenyard_us": 10.0, "nccl_us": 6.0, "gemm_us": 30.0, "other_us": 5.0,
                     "idle_us": 5.0, "communication_alone_us": 5.0 + 5.0}
    assert moe_trace.breakdown([]) == {}
