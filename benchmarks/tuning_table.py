"""One table of `run_device.sh tuning`'s runs: the normal-mode kernels at 8 and 24 SMs per TOKENYARD_TUNING variant.

    python benchmarks/tuning_table.py out/tuning_*.json [--merge benchmarks/results/normal_tuning.json]

Prints, per run, the kernel times (µs) and NVLink GB/s of dispatch, cached dispatch and combine at each SM count,
beside the same run's NCCL all_to_all_single kernels and copy limit. `--merge` writes the runs into one JSON, a key
per run named as its file was (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib

KERNELS = ("dispatch_kernel", "dispatch_cached_kernel", "combine_kernel")


def label(doc: dict, path: pathlib.Path) -> str:
    tuning = (doc.get("env") or {}).get("TOKENYARD_TUNING")
    return tuning or path.stem.removeprefix("tuning_")


def rows(doc: dict) -> list:
    lines = []
    for point in sorted(doc["compare_sm"]["tokenyard"], key=lambda p: p["num_sms"]):
        cells = [f"{point[k]['us']:7.1f} ({point[k]['nvlink_gbps']:5.1f})" for k in KERNELS]
        lines.append(f"    {point['num_sms']:>3} SMs  " + "  ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    parser.add_argument("--merge", type=pathlib.Path)
    args = parser.parse_args()
    merged = {}
    print("µs (NVLink GB/s):      dispatch          cached dispatch   combine")
    for path in args.runs:
        doc = json.loads(path.read_text())
        merged[path.stem] = doc
        nccl = doc.get("nccl") or {}
        print(f"{label(doc, path)}  [commit {doc.get('commit')}, copy limit {doc.get('copy_limit_gbps') or 0:.0f} GB/s, "
              f"NCCL kernels {nccl.get('dispatch_kernel', {}).get('us', 0):.0f} / "
              f"{nccl.get('combine_kernel', {}).get('us', 0):.0f} µs]")
        print("\n".join(rows(doc)))
    if args.merge:
        args.merge.write_text(json.dumps(merged, indent=1) + "\n")


if __name__ == "__main__":
    main()
