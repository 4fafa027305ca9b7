"""How each fault of tests/cpu/fault_scenarios.py was detected (issue 23).

Per scenario and backend: the ranks, the longest time a rank other than the one at fault took from the start
of its call to its error (`detected_s`), rank 0's error, and whether every surviving rank then completed a
correct call. The reference backend on CPU gloo ranks; where there is a GPU, the CUDA backend too, its ranks
on GPUs of their own or sharing one (under MPS: benchmarks/run_device.sh faults starts the daemon).

    python benchmarks/faults.py --json OUT.json [--backend reference cuda] [--cuda_ranks 4]

`--gpus_json` records the CUDA backend's run in the form of benchmarks/results/faults_gpus.json (issue 48): one
run per layout of nodes (TOKENYARD_RANKS_PER_NODE for virtual nodes) and GPUs, replacing that layout's run in the
file where there is one, every scenario in it, skipped ones named as skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.cpu import fault_scenarios as scenarios  # noqa: E402
from tests.gpu import spawn  # noqa: E402
from tokenyard.tools.bench.report import git_commit  # noqa: E402


def _device(backend: str, num_ranks: int) -> str:
    if backend != "cuda":
        return f"cpu ({num_ranks} gloo ranks)"
    return spawn.describe(num_ranks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int, default=secrets.randbelow(2**31))
    parser.add_argument("--backend", nargs="+", choices=("reference", "cuda"),
                        default=["reference"] + (["cuda"] if torch.cuda.is_available() else []))
    parser.add_argument("--cuda_ranks", type=int, default=4, help="the CUDA backend's ranks (dividing the 12 experts)")
    parser.add_argument("--gpus_json", help="record the CUDA backend's run into this file (faults_gpus.json's form)")
    args = parser.parse_args(argv)
    if args.gpus_json:
        record_gpus(args.gpus_json, args.cuda_ranks, args.seed)
        return
    rows, device = [], {}
    for backend in args.backend:
        num_ranks = args.cuda_ranks if backend == "cuda" else scenarios.NUM_RANKS
        device[backend] = _device(backend, num_ranks)
        for fn, names, at_fault in ((scenarios.mismatch, scenarios.MISMATCHES, None),
                                    (scenarios.late_peer, scenarios.LATE, 1)):
            for what in names:
                if backend == "cuda" and what in scenarios.NOT_UNDER_MPS and spawn.shares_gpu(num_ranks):
                    print(f"{backend} {what}: not run, the ranks share a GPU (fault_scenarios.NOT_UNDER_MPS)")
                    continue
                seen = scenarios.run(num_ranks, fn, args.seed, what, backend)
                others = [s for r, s in seen.items() if r != at_fault]
                row = {"scenario": what, "backend": backend, "num_ranks": num_ranks, "timeout_s": scenarios.TIMEOUT_S,
                       "detected_s": round(max(s["detected_s"] for s in others), 3), "error": seen[0]["error"],
                       "survivors_recovered": all(s["recovered"] for s in seen.values())}
                rows.append(row)
                print(f"{backend} {what}: detected in {row['detected_s']:.2f} s, recovered "
                      f"{row['survivors_recovered']}: {(row['error'] or '')[:110]}", flush=True)
    if args.json:
        document = {"commit": git_commit(), "device": device,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "seed": args.seed, "scenarios": rows}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")


def record_gpus(path: str, num_ranks: int, seed: int) -> None:
    """Every scenario on the CUDA backend at `num_ranks` ranks, as one run of faults_gpus.json."""
    from tests.gpu.test_faults import skip_reason

    per_node = int(os.environ.get("TOKENYARD_RANKS_PER_NODE", "0")) or num_ranks
    shared = spawn.shares_gpu(num_ranks)
    rows = []
    for fn, names, at_fault in ((scenarios.mismatch, scenarios.MISMATCHES, None),
                                (scenarios.late_peer, scenarios.LATE, 1)):
        for what in names:
            row = {"scenario": what, "timeout_s": scenarios.TIMEOUT_S, "detected_s": None, "error": None,
                   "survivors_recovered": None, "skipped": skip_reason(what, num_ranks) if at_fault else None}
            if row["skipped"] is None:
                try:
                    seen = scenarios.run(num_ranks, fn, seed, what, "cuda")
                    others = [s for r, s in seen.items() if r != at_fault]
                    row.update(detected_s=round(max(s["detected_s"] for s in others), 3), error=seen[0]["error"],
                               survivors_recovered=all(s["recovered"] for s in seen.values()))
                except Exception as exc:  # noqa: BLE001 - a rank failed: recorded as such
                    row.update(error=f"the scenario failed: {str(exc)[-600:]}", survivors_recovered=False)
            rows.append(row)
            print(f"{num_ranks // per_node}x{per_node} {what}: {row['skipped'] or row['error']} "
                  f"(detected in {row['detected_s']} s, recovered {row['survivors_recovered']})", flush=True)
    stamp = {"commit": git_commit(), "device": spawn.describe(num_ranks),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "seed": seed}
    command = f"python benchmarks/faults.py --cuda_ranks {num_ranks} --gpus_json {os.path.basename(path)}"
    if per_node != num_ranks:
        command = f"TOKENYARD_RANKS_PER_NODE={per_node} {command}"
    run = {"nodes": num_ranks // per_node, "ranks_per_node": per_node,
           "num_gpus": min(num_ranks, torch.cuda.device_count()), "mps": shared, **stamp, "command": command,
           "scenarios": rows}
    document = {"runs": []}
    if os.path.exists(path):
        with open(path) as f:
            document = json.load(f)
    layout = ("nodes", "ranks_per_node", "mps")
    document["runs"] = [r for r in document["runs"] if [r[k] for k in layout] != [run[k] for k in layout]] + [run]
    document.update(stamp)  # the latest run's; each run keeps its own
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
