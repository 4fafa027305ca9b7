"""The expert-parallel MoE layer through the CUDA backend against transformers' blocks (device machine only).

The same comparison as tests/cpu/test_moe.py, on one GPU per rank: every rank builds the dense
transformers block on its GPU and runs it on every rank's slice of the tokens (the same shapes as the
layer's, so both routers see the same bits), then runs `tokenyard.layers.moe.ExpertParallelMoE` with
``backend="cuda"`` on its own slice and compares output, input gradient and every weight's gradient.
With TOKENYARD_RESULTS_DIR set, the measured errors are written to ``moe_equivalence.json`` there
(benchmarks/results/ in the repository) before any tolerance is checked.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

import pytest
import torch

from . import spawn

pytestmark = spawn.needs_ranks()

BF16_UNIT = 2.0 ** -8
# Float32: the output and input gradient travel as bf16 through combine; weight gradients are float32
# sums in another order (cuBLAS, TF32 off) than the dense block's.
TOLERANCES = {"float32": {"out": 4 * BF16_UNIT, "x.grad": 4 * BF16_UNIT, "weights": 1e-4},
              "bf16": {"out": 8 * BF16_UNIT, "x.grad": 8 * BF16_UNIT, "weights": 8 * BF16_UNIT}}
CASES = [
    # (model, dtype, hidden, tokens per rank, on an ElasticBuffer: bf16 through the expanded layout)
    ("mixtral", "float32", 256, 64, False),
    ("qwen2_moe", "float32", 128, 64, False),
    ("deepseek_v3", "float32", 128, 64, False),
    ("mixtral", "bf16", 256, 64, False),
    ("mixtral", "bf16", 256, 64, True),
    ("qwen2_moe", "bf16", 128, 64, True),
]


def _measure_ranks(seed, cases):
    """On every rank: each case's errors, the worst over ranks, as ``{name: [max_abs, rel]}``."""
    import torch.distributed as dist

    from tests.cpu import moe_scenarios

    device = torch.device("cuda", torch.cuda.current_device())
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    measured = []
    for case_id, (model, dtype, hidden, num_tokens, elastic) in enumerate(cases):
        case = moe_scenarios.transformers_case(model, seed + case_id, dist.get_world_size(), num_tokens,
                                               dtype=dtypes[dtype], hidden=hidden, device=device)
        errors = moe_scenarios.layer_matches_transformers(case, None, backend="cuda", elastic=elastic)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors)
        worst = {name: [max(e[name][0] for e in gathered), max(e[name][1] for e in gathered)] for name in errors}
        measured.append({"model": model, "dtype": dtype, "hidden": hidden, "num_tokens_per_rank": num_tokens,
                         "elastic": elastic, "transformers": case["transformers"], "errors": worst})
    return measured


def _write(results, seed):
    folder = os.environ.get("TOKENYARD_RESULTS_DIR")
    if not folder:
        return
    from tokenyard.tools.bench.report import git_commit

    document = {
        "commit": git_commit(),
        "device": f"{torch.cuda.get_device_name(0)} x {spawn.NUM_GPUS}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "seed": seed,
        "errors": "per tensor [max abs error, max abs error / max abs of the transformers value], worst rank",
        "tolerances": TOLERANCES,
        "runs": results,
    }
    path = pathlib.Path(folder) / "moe_equivalence.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}")


def test_moe_layer_on_cuda_backend_matches_transformers_blocks(seed):
    pytest.importorskip("transformers")
    results = []
    for num_ranks in spawn.rank_counts():
        for run in spawn.run(num_ranks, _measure_ranks, seed, CASES)[0]:
            results.append({"num_ranks": num_ranks, "gpus": spawn.describe(num_ranks), **run})
    _write(results, seed)
    failures = []
    for run in results:
        limits = TOLERANCES[run["dtype"]]
        what = f"{run['num_ranks']} ranks {run['model']} {run['dtype']}" + (" elastic" if run["elastic"] else "")
        for name, (max_abs, rel) in run["errors"].items():
            print(f"{what} {name}: max abs {max_abs:.3g}, rel {rel:.3g}")
            if rel > limits.get(name, limits["weights"]):
                failures.append(f"{what} {name}: rel {rel:.3g}")
    assert not failures, "beyond tolerance: " + "; ".join(failures)


def _expanded_autograd(seed):
    """tokenyard.layers.autograd's expanded dispatch and combine on the CUDA backend, against the single-process
    oracle (tests/cpu/moe_scenarios.py): exact rows, weights and gradients; padding rows' gradients go nowhere."""
    import torch.distributed as dist

    from tests.cpu import moe_scenarios

    num_experts = 8 * dist.get_world_size()
    pairs = [moe_scenarios.expanded_dispatch_backward_is_combine(seed + i, 24, 256, num_experts, 4, "masked",
                                                                  alignment, cpu_sync, "cuda")
             for i, (alignment, cpu_sync) in enumerate(((1, True), (4, False)))]
    pairs.append(moe_scenarios.expanded_combine_backward_is_cached_dispatch(seed, 24, 256, num_experts, 4, "masked", 4,
                                                                            "cuda"))
    return pairs


def test_expanded_dispatch_and_combine_gradients_on_cuda_backend(seed):
    for num_ranks in spawn.rank_counts():
        pairs = spawn.run(num_ranks, _expanded_autograd, seed)
        assert all(p > 0 for rank_pairs in pairs for p in rank_pairs), pairs
