"""tokenyard.Benchmark in-process on gloo ranks: the command's JSON document, the same on every rank."""

import torch

from tokenyard.errors import InvalidInputError

OP_FIELDS = {"us", "nvlink_gbps", "logical_gbps", "num_sms"}


def _every_mode(seed):
    from tokenyard import Benchmark, Buffer

    bench = Benchmark(iters=2, warmup=0, seed=seed, quiet=True)
    before = Buffer.num_sms
    normal = Benchmark(iters=2, warmup=0, quiet=True).benchmark_dispatch_combine(128, 16, 8, num_topk=2, num_sms=12)
    restored = Buffer.num_sms == before
    sweep = bench.compare_sm_counts(128, 16, 8, num_topk=2, dtype=torch.float8_e4m3fn, sm_counts=[8, 16])
    low = bench.benchmark_low_latency(128, 8, 8, num_topk=2, dtype="fp8")
    try:
        bench.benchmark_dispatch_combine(128, 16, 7, num_topk=2)
        refused = None
    except InvalidInputError as exc:
        refused = str(exc)
    return normal, restored, sweep, low, refused


def test_benchmark_returns_the_commands_document_for_each_mode_on_every_rank(ranks, seed):
    results = ranks(2).run(_every_mode, seed)
    normal, restored, sweep, low, refused = results[0]
    assert results[1][0] == normal and results[1][2] == sweep, "every rank gets the same document"
    assert restored and "not divisible" in refused

    assert normal["device"] == "cpu (2 gloo ranks)" and normal["settings"]["mode"] == "normal"
    assert (normal["num_ranks"], normal["hidden"], normal["num_tokens"], normal["dtype"]) == (2, 128, 16, "bf16")
    for who, op in (("nccl", "dispatch"), ("nccl", "combine"), ("reference", "dispatch"),
                    ("reference", "dispatch_cached"), ("reference", "combine")):
        entry = normal[who][op]
        assert set(entry) == OP_FIELDS and entry["us"] > 0 and entry["logical_gbps"] > 0, (who, op, entry)
    assert "tokenyard" not in normal and "affinity" not in normal

    assert sweep["dtype"] == "fp8" and sweep["settings"]["seed"] == low["settings"]["seed"]
    points = sweep["compare_sm"]["reference"]
    assert [p["num_sms"] for p in points] == [8, 16] and all(p["combine"]["us"] > 0 for p in points)
    assert all(p[op]["us"] > 0 for p in points for op in ("v2_dispatch", "v2_expand_dispatch", "v2_expand_combine"))

    ll = low["reference"]["low_latency"]
    assert low["num_tokens_low_latency"] == 8 and ll["dispatch_us"] > 0 and ll["combine_us"] > 0
    assert ll["dispatch_graph_us"] is None and ll["graph_error"]


def test_autotuner_and_benchmark_load_on_first_use_without_cuda_jit_or_matplotlib():
    import subprocess
    import sys

    code = ("import sys, tokenyard\n"
            "loaded = lambda *names: [m for m in sys.modules if m.startswith(names)]\n"
            "assert not loaded('tokenyard.tools.autotune', 'tokenyard.benchmark', 'tokenyard.tools.bench',"
            " 'tokenyard.tools.affinity', 'matplotlib'), "
            "loaded('tokenyard.tools.autotune', 'tokenyard.benchmark', 'tokenyard.tools.bench', 'matplotlib')\n"
            "assert tokenyard.AutoTuner.__module__ == 'tokenyard.tools.autotune'\n"
            "assert tokenyard.Benchmark.__module__ == 'tokenyard.benchmark'\n"
            "assert not loaded('tokenyard.backends.cuda', 'tokenyard.jit', 'matplotlib'), "
            "loaded('tokenyard.backends.cuda', 'tokenyard.jit', 'matplotlib')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
