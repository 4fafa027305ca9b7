"""The benchmark command on gloo ranks, its bandwidth formulas on a hand-computed example, and its options."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tokenyard.tools.bench import bandwidth, options

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
OP_FIELDS = {"us", "nvlink_gbps", "logical_gbps", "num_sms"}


def _run_bench(*args, timeout_s=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "tokenyard.tools.bench", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def _assert_positive_op(entry, name):
    assert set(entry) == OP_FIELDS, f"{name}: fields {sorted(entry)}"
    for field in ("us", "nvlink_gbps", "logical_gbps"):
        assert isinstance(entry[field], float) and entry[field] > 0, f"{name}.{field} = {entry[field]!r}"
    assert entry["num_sms"] is None, f"{name}: only the CUDA backend has an SM count"


def test_bench_command_on_two_gloo_ranks_writes_summary_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    done = _run_bench("--num_ranks", "2", "--num_tokens", "16", "--hidden_size", "256", "--num_experts", "8",
                      "--num_topk", "2", "--iters", "2", "--warmup", "1", "--json", str(json_path),
                      "--plot", str(png_path), "--quiet")
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    printed = done.stdout.splitlines()
    assert len(printed) <= 30, f"the default output is {len(printed)} lines, more than a screen:\n{done.stdout}"
    for operation in ("layout", "dispatch, cached handle", "V2 combine", "low-latency combine"):
        assert operation in done.stdout, f"the summary has no row for {operation}:\n{done.stdout}"
    assert "say nothing about GPUs" in done.stdout and "gloo" in done.stdout, "a CPU run says what its times are"
    assert "NVLink" not in done.stdout and "SMs" not in done.stdout, "a CPU run speaks of CPU ranks, not of GPUs"

    doc = json.loads(json_path.read_text())
    for key in ("commit", "device", "date", "settings", "num_ranks", "num_tokens", "hidden", "num_topk",
                "num_experts", "copy_limit_gbps", "copy_limit_method", "nccl", "reference"):
        assert key in doc, f"missing key {key}"
    assert doc["device"] == "cpu (2 gloo ranks)"
    assert (doc["num_ranks"], doc["num_tokens"], doc["hidden"], doc["num_topk"], doc["num_experts"]) == (2, 16, 256, 2, 8)
    assert doc["copy_limit_gbps"] is None and doc["copy_limit_method"] is None
    assert "tokenyard" not in doc, "the CUDA backend cannot run without GPUs"
    settings = doc["settings"]
    assert {"mode", "hidden_size", "num_tokens", "num_experts", "num_topk", "num_ranks", "sm_counts", "dtype",
            "backends", "iters", "warmup", "json", "plot", "quiet", "seed"} <= set(settings)
    assert settings["iters"] == 2 and settings["quiet"] is True and settings["dtype"] == "fp8"

    for op in ("dispatch", "combine"):
        for timed in (op, op + "_back_to_back"):
            _assert_positive_op(doc["nccl"][timed], f"nccl.{timed}")
    for op in ("dispatch", "dispatch_cached", "combine", "v2_dispatch", "v2_expand_dispatch", "v2_expand_combine"):
        for timed in (op, op + "_back_to_back"):
            _assert_positive_op(doc["reference"][timed], f"reference.{timed}")
    low_latency = doc["reference"]["low_latency"]
    assert low_latency["dispatch_us"] > 0 and low_latency["combine_us"] > 0
    assert low_latency["dispatch_graph_us"] is None and low_latency["combine_graph_us"] is None
    assert low_latency["graph_error"], "a missing graph time must say why"

    # Every measured row stays in the JSON, and --verbose prints each of them.
    from tokenyard.tools.bench import report

    measured = {(who, op) for who, op, _ in report.results(doc)}
    wanted = {("gloo all_to_all", op) for op in ("dispatch", "combine", "dispatch_back_to_back",
                                                   "combine_back_to_back")}
    wanted |= {("reference", op) for op in report.OPS if not op.endswith(report.KERNEL_SUFFIX)}
    wanted |= {("reference", f"low_latency {op}") for op in ("dispatch", "combine")}
    assert wanted <= measured, f"rows missing from the JSON: {sorted(wanted - measured)}"
    report.print_table(doc, verbose=True)
    verbose = capsys.readouterr().out
    assert all(op in verbose for op in ("dispatch_cached_back_to_back", "v2_expand_combine", "layout_back_to_back"))

    png = png_path.read_bytes()
    assert len(png) > 1000 and png.startswith(b"\x89PNG"), "the plot is not a PNG"


def test_bench_refuses_a_problem_the_ranks_would_refuse_with_exit_status_2():
    done = _run_bench("--num_ranks", "3", "--num_experts", "8", timeout_s=60)
    assert done.returncode == 2
    assert "not divisible" in done.stderr


def test_bandwidth_formulas_match_a_hand_computed_example():
    # Rank 0 sends 3 tokens to itself and 1 to rank 1; rank 1 sends 2 to rank 0 and 4 to itself.
    counts = [[3, 1], [2, 4]]
    fp8_row = bandwidth.row_bytes(256, fp8=True)
    assert fp8_row == 264  # 256 bytes of e4m3 + 2 float32 scales
    assert bandwidth.row_bytes(256, fp8=False) == 512
    # Dispatch: remote = rows sent to the other rank; logical = every row received, local ones too.
    assert bandwidth.normal_dispatch_bytes(counts, 0, fp8_row) == (1 * 264, (3 + 2) * 264)
    assert bandwidth.normal_dispatch_bytes(counts, 1, fp8_row) == (2 * 264, (1 + 4) * 264)
    # Combine (bf16): remote = rows coming back from the other rank; logical = rows held and sent back.
    assert bandwidth.normal_combine_bytes(counts, 0, 256) == (1 * 512, (3 + 2) * 512)
    # Low latency, 2 ranks of 4 experts: rank 0's pairs go to experts 0, 5 (rank 1), 3; -1 is no pair.
    topk_idx = torch.tensor([[0, 5], [3, -1]])
    assert bandwidth.low_latency_bytes(topk_idx, 0, 4, bandwidth.row_bytes(128, fp8=True)) == (132, 3 * 132)
    assert bandwidth.gbps(2e9, 0.5) == 4.0


def test_summary_takes_time_and_bytes_from_the_slowest_rank():
    fast, slow = (10e-6, 1e6, 2e6), (20e-6, 3e6, 4e6)
    summary = bandwidth.summarize([fast, slow], num_sms=24)
    assert summary["us"] == pytest.approx(20.0)
    assert summary["nvlink_gbps"] == pytest.approx(150.0)
    assert summary["logical_gbps"] == pytest.approx(200.0)
    assert summary["num_sms"] == 24
    assert bandwidth.summarize([fast, None]) is None, "an operation one rank did not measure has no summary"


def test_dashed_spellings_are_aliases_and_cpu_defaults_are_the_small_problem():
    parser = options.build_parser()
    dashed = options.resolve(parser.parse_args(["--hidden-size", "512", "--num-topk", "2", "--seed", "1"]), 0)
    underscored = options.resolve(parser.parse_args(["--hidden_size", "512", "--num_topk", "2", "--seed", "1"]), 0)
    assert dashed == underscored
    defaults = options.resolve(parser.parse_args([]), num_gpus=0)
    assert (defaults.num_ranks, defaults.hidden_size, defaults.num_tokens, defaults.num_tokens_low_latency,
            defaults.num_experts, defaults.num_topk, defaults.dtype, defaults.gpu) == (4, 1024, 256, 32, 32, 4,
                                                                                       "fp8", False)
    gpu = options.resolve(parser.parse_args([]), num_gpus=8)
    assert (gpu.num_ranks, gpu.hidden_size, gpu.num_tokens, gpu.num_tokens_low_latency, gpu.num_experts,
            gpu.num_topk, gpu.iters) == (8, 7168, 4096, 128, 256, 8, 50)


def test_a_run_of_ranks_sharing_gpus_reports_no_rate_as_bandwidth():
    from tokenyard.tools.bench import report

    doc = {"copy_limit_gbps": 300.0, "nccl": {"dispatch": {"us": 10.0, "nvlink_gbps": 5.0, "logical_gbps": 7.0}},
           "tokenyard": {"low_latency": {"dispatch_us": 20.0, "dispatch_nvlink_gbps": 1.0}},
           "compare_sm": {"tokenyard": [{"num_sms": 8, "dispatch": {"us": 3.0, "nvlink_gbps": 2.0}}]}}
    report._times_only(doc)
    assert doc == {"copy_limit_gbps": None,
                   "nccl": {"dispatch": {"us": 10.0, "nvlink_gbps": None, "logical_gbps": None}},
                   "tokenyard": {"low_latency": {"dispatch_us": 20.0, "dispatch_nvlink_gbps": None}},
                   "compare_sm": {"tokenyard": [{"num_sms": 8, "dispatch": {"us": 3.0, "nvlink_gbps": None}}]}}


def test_the_summary_of_an_sm_sweep_shows_each_sm_counts_kernels_against_nccl_and_the_limit():
    from tokenyard.tools.bench import report

    def op(us, gbps=None, num_sms=None):
        return {"us": us, "nvlink_gbps": gbps, "logical_gbps": gbps, "num_sms": num_sms}

    points = [{"num_sms": n, "dispatch_cached": op(2.0 * us, num_sms=n), "dispatch_cached_kernel": op(us, gbps),
               "v2_dispatch_kernel": op(us + 1.0, gbps / 2)} for n, us, gbps in ((8, 40.0, 150.0), (24, 20.0, 300.0))]
    doc = {"copy_limit_gbps": 300.0, "device": "NVIDIA H200 x 4",
           "nccl": {"dispatch_kernel": op(25.0, 240.0)},
           "tokenyard": {"low_latency": {}}, "compare_sm": {"tokenyard": points}}
    rows = {r["operation"]: r for r in report.summary(doc)}
    assert list(rows) == ["dispatch, cached handle @ 8 SMs", "V2 dispatch @ 8 SMs",
                          "dispatch, cached handle @ 24 SMs", "V2 dispatch @ 24 SMs"]
    assert (rows["dispatch, cached handle @ 8 SMs"]["kernel_us"], rows["dispatch, cached handle @ 8 SMs"]["call_us"],
            rows["dispatch, cached handle @ 8 SMs"]["num_sms"]) == (40.0, None, 8)
    assert rows["dispatch, cached handle @ 24 SMs"]["all_to_all_us"] == 25.0
    assert rows["dispatch, cached handle @ 8 SMs"]["percent"] == 50.0 and rows["V2 dispatch @ 24 SMs"]["percent"] == 50.0


def _structure_ab():
    import importlib.util

    path = REPO_ROOT / "benchmarks" / "structure_ab.py"
    spec = importlib.util.spec_from_file_location("structure_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_structure_ab_takes_each_sides_median_and_refuses_runs_from_another_device_or_settings():
    ab = _structure_ab()

    seeds = iter(range(100))

    def doc(scale, device="H100 x 1", iters=50):
        figures = {name: scale * (10.0 + i) for i, (name, _) in enumerate(ab.FIGURES)}
        tokenyard = {}
        for name, (entry, key) in ab.FIGURES:
            tokenyard.setdefault(entry, {})[key] = figures[name]
        seed = next(seeds)  # each run draws its own inputs and writes its own file: no difference of settings
        return {"device": device, "settings": {"iters": iters, "seed": seed, "json": f"ab_{seed}.json"},
                "tokenyard": tokenyard}

    merged = ab.merge([doc(1.0), doc(3.0), doc(2.0)], [doc(1.5), doc(0.5), doc(1.0)], "c0", "c1", "first")
    first = merged["figures"][ab.FIGURES[0][0]]
    assert (first["before"], first["after"], first["ratio"]) == (20.0, 10.0, 0.5)
    assert merged["runs_per_side"] == [3, 3] and merged["device"] == "H100 x 1"
    assert merged["seeds"] == {"before": [0, 1, 2], "after": [3, 4, 5]}
    assert "| 20.0 | 10.0 | 0.500 |" in ab.table(merged)
    for other in (doc(1.0, device="H200 x 1"), doc(1.0, iters=10)):
        with pytest.raises(ValueError, match="differ"):
            ab.merge([doc(1.0)], [other], "c0", "c1")

    # Sessions (one machine's runs each) gather in one file, only for the same commits and device.
    second = ab.merge([doc(1.0)], [doc(1.0)], "c0", "c1", "second")
    both = ab.add_session(ab.add_session({}, merged), second)
    assert [s["label"] for s in both["sessions"]] == ["first", "second"] and both["commit_after"] == "c1"
    with pytest.raises(ValueError, match="compares"):
        ab.add_session(both, ab.merge([doc(1.0)], [doc(1.0)], "c0", "c2"))


def test_gpu_suite_reads_each_tests_seconds_and_outcome_from_junit(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", REPO_ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    xml = tmp_path / "suite.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.gpu.test_a" name="test_fast" time="1.25"/>'
                   '<testcase classname="tests.gpu.test_a" name="test_broken" time="30.5">'
                   '<failure message="x"/></testcase>'
                   '<testcase classname="tests.gpu.test_b" name="test_bad_setup" time="2"><error message="y"/>'
                   '</testcase>'
                   '<testcase classname="tests.gpu.test_b" name="test_needs_8[8]" time="0.001"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    assert suite.read_junit(str(xml)) == [
        {"test": "tests.gpu.test_a::test_broken", "seconds": 30.5, "outcome": "failed"},
        {"test": "tests.gpu.test_b::test_bad_setup", "seconds": 2.0, "outcome": "failed"},
        {"test": "tests.gpu.test_a::test_fast", "seconds": 1.25, "outcome": "passed"},
        {"test": "tests.gpu.test_b::test_needs_8[8]", "seconds": 0.0, "outcome": "skipped"}]


def test_every_tma_writer_shape_fits_a_block_and_moves_whole_vectors():
    """benchmarks/copy_patterns.py's sender shapes: each writer a warp of the block, its stages of 16-byte multiples,
    all of them (with their barriers) in the shared memory a block may have; the first is the copy limit's writer,
    keyed as the pattern alone. The bulk reduce-add writer ("tma_add"), the one that writes its own memory too
    ("tma_self") and the loads alone ("tma_load") take the same shapes, and are never candidates for the copy
    limit."""
    import importlib.util

    from tokenyard.backends.cuda import kernels
    from tokenyard.tools.bench import copy_limit

    spec = importlib.util.spec_from_file_location("copy_patterns", REPO_ROOT / "benchmarks" / "copy_patterns.py")
    patterns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patterns)
    assert patterns.SENDER_SHAPES[0] == copy_limit.TMA_WRITERS
    for warps, stages, stage_bytes in patterns.SENDER_SHAPES:
        assert 1 <= warps <= copy_limit.THREADS // 32 and stage_bytes % 16 == 0
        assert copy_limit.shared_bytes("tma", (warps, stages, stage_bytes)) <= \
            kernels.SM90_MAX_SHARED - kernels.SHARED_RESERVE
        for pattern in copy_limit.TMA_PATTERNS:
            assert copy_limit.copy_to_peers(4, pattern, (warps, stages, stage_bytes)).template_args[3:] == \
                (warps, stages, stage_bytes)
            assert copy_limit.shared_bytes(pattern, (warps, stages, stage_bytes)) == \
                copy_limit.shared_bytes("tma", (warps, stages, stage_bytes))
    names = [name for name, _, _ in patterns.runs(["interleaved", *copy_limit.TMA_PATTERNS], patterns.SENDER_SHAPES)]
    assert names[:3] == ["interleaved", "tma", "tma 1x4x16384"] and len(set(names)) == len(names)
    assert "tma_add 12x4x4800" in names and "tma_self 3x4x14336" in names and "tma_load 1x4x4800" in names
    assert not set(copy_limit.PROBE_PATTERNS) & set(copy_limit.COPY_PATTERNS)
