"""One table of `run_device.sh tuning`'s (or `proxy`'s) runs: the normal-mode kernels per TOKENYARD_TUNING variant.

    python benchmarks/tuning_table.py out/tuning_*.json [--merge benchmarks/results/normal_tuning.json]

Prints, per run, the kernel times (µs) and NVLink GB/s of dispatch, cached dispatch and combine at each SM count,
beside the same run's NCCL all_to_all_single kernels and copy limit (times only where the ranks shared a GPU). `--merge` writes the runs into one JSON, a key
per run named as its file was (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib

KERNELS = ("dispatch_kernel", "dispatch_cached_kernel", "combine_kernel")


def label(doc: dict, path: pathlib.Path) -> str:
    tuning = (doc.get("env") or {}).get("TOKENYARD_TUNING")
    return f"{tuning or path.stem.removeprefix('tuning_')} ({doc.get('num_ranks')} ranks, {doc.get('device')})"


def cell(entry: dict) -> str:
    gbps = entry.get("nvlink_gbps")
    return f"{entry['us']:7.1f} ({gbps:5.1f})" if gbps is not None else f"{entry['us']:7.1f}        "


def rows(doc: dict) -> list:
    lines = []
    for point in sorted(doc["compare_sm"]["tokenyard"], key=lambda p: p["num_sms"]):
        lines.append(f"    {point['num_sms']:>3} SMs  " + "  ".join(cell(point[k]) for k in KERNELS))
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
        dispatch, combine = (nccl.get(k) or {} for k in ("dispatch_kernel", "combine_kernel"))
        print(f"{label(doc, path)}  [commit {doc.get('commit')}, copy limit {doc.get('copy_limit_gbps') or 0:.0f} GB/s, "
              f"NCCL kernels {dispatch.get('us', 0):.0f} / {combine.get('us', 0):.0f} µs]")
        print("\n".join(rows(doc)))
    if args.merge:
        args.merge.write_text(json.dumps(merged, indent=1) + "\n")


if __name__ == "__main__":
    main()
