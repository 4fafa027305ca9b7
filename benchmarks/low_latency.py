"""Low-latency figures in the form of benchmarks/results/low_latency.json's key `low_latency` (issue 4's keys), in one call.

    python benchmarks/low_latency.py --json OUT.json [--tokens 1,32,64,128,256] [--num_ranks 4]

Runs ``python -m tokenyard.tools.bench --mode low_latency`` once per token count (the CUDA kernels beside the
reference backend over NCCL) and keeps, per count: tokenyard's CUDA-graph replay times (``*_graph_us``,
CUDA events around the replay) and the GPU time of its kernels in those replays (``dispatch_us``,
``combine_us``, the figure DeepEP reports), and the reference backend's graph replay times as ``nccl``.
The top-level entry is the DeepSeek-V3 setting (128 tokens); every count is under ``sweep``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_bench(num_tokens: int, num_ranks: int, backends: str, folder: str) -> dict:
    path = os.path.join(folder, f"ll_{num_ranks}_{num_tokens}.json")
    env = dict(os.environ, TOKENYARD_LOW_LATENCY_KERNELS="on")
    subprocess.run([sys.executable, "-m", "tokenyard.tools.bench", "--quiet", "--mode", "low_latency", "--num_ranks",
                    str(num_ranks), "--num_tokens", str(max(num_tokens, 128)), "--num_tokens_low_latency",
                    str(num_tokens), "--backends", backends, "--json", path], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def entry(doc: dict) -> dict:
    ll = doc["tokenyard"]["low_latency"]
    out = {"num_ranks": doc["num_ranks"], "num_tokens": doc["num_tokens_low_latency"],
           "tokenyard": {"dispatch_us": ll["dispatch_graph_kernel_us"], "combine_us": ll["combine_graph_kernel_us"],
                         "dispatch_combine_hook_us": ll.get("hook_graph_kernel_us"),
                         "dispatch_graph_us": ll["dispatch_graph_us"], "combine_graph_us": ll["combine_graph_us"],
                         "dispatch_eager_us": ll["dispatch_us"], "combine_eager_us": ll["combine_us"]}}
    if "reference" in doc:
        ref = doc["reference"]["low_latency"]
        out["nccl"] = {"dispatch_us": ref["dispatch_graph_us"], "combine_us": ref["combine_graph_us"],
                       "what": "the reference backend over NCCL, CUDA-graph replay (events)"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--tokens", default="1,32,64,128,256")
    parser.add_argument("--num_ranks", type=int, default=None)
    parser.add_argument("--two_ranks", action="store_true", help="also 2 ranks at 128 tokens")
    args = parser.parse_args()
    import torch

    num_ranks = args.num_ranks or torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as folder:
        docs = {n: run_bench(n, num_ranks, "reference,cuda", folder) for n in map(int, args.tokens.split(","))}
        main_doc = docs.get(128) or next(iter(docs.values()))
        result = {"commit": main_doc["commit"], "device": main_doc["device"], "date": main_doc["date"],
                  "hidden": main_doc["hidden"], "num_topk": main_doc["num_topk"],
                  "num_experts": main_doc["num_experts"], "dtype": "fp8 dispatch, bf16 combine",
                  **entry(main_doc),
                  "timing": "dispatch_us/combine_us: GPU time of tokenyard's kernels per CUDA-graph replay "
                            "(profiler, ranks started together); dispatch_combine_hook_us: the same for one graph "
                            "of dispatch and combine with return_recv_hook=True, both hooks called (send and "
                            "receive launches summed); *_graph_us: CUDA events around the replay",
                  "sweep": [entry(doc) for doc in docs.values()]}
        if args.two_ranks and num_ranks > 2:
            result["sweep"].append(entry(run_bench(128, 2, "cuda", folder)))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'ranks':>5} {'tokens':>6} {'dispatch us':>12} {'combine us':>11} {'hook d+c us':>12} "
          f"{'ref dispatch':>13} {'ref combine':>12}")
    nan = float("nan")
    for e in result["sweep"]:
        ref, ours = e.get("nccl", {}), e["tokenyard"]
        print(f"{e['num_ranks']:>5} {e['num_tokens']:>6} {ours['dispatch_us'] or nan:>12.1f} "
              f"{ours['combine_us'] or nan:>11.1f} {ours['dispatch_combine_hook_us'] or nan:>12.1f} "
              f"{ref.get('dispatch_us') or nan:>13.1f} {ref.get('combine_us') or nan:>12.1f}")


if __name__ == "__main__":
    main()
