"""One JSON (an A/B of benchmarks/results/host_cost.md) from runs of benchmarks/host_cost.py in two trees,
alternately, on one machine (`bash benchmarks/run_device.sh host_cost_ab`): the lent machines' host speed differs
between calls
(host_cost.md), so before and after are compared only within one call.

    python benchmarks/host_cost_ab.py --json OUT.json --before B1.json [B2.json ...] --after A1.json [A2.json ...]

Per call and token count it keeps every run's median and the median of those medians.
"""

from __future__ import annotations

import argparse
import json
import statistics


def merge(paths):
    runs = [json.load(open(path)) for path in paths]
    calls = {}
    for name in runs[0]["calls"]:
        calls[name] = {}
        for tokens in runs[0]["calls"][name]["tokens"]:
            values = [run["calls"][name]["tokens"][tokens] for run in runs]
            if all(v is not None for v in values):
                calls[name][tokens] = {"runs": [round(v, 2) for v in values],
                                       "median": round(statistics.median(values), 2)}
    call_vs_kernel = [{name: {key: round(v[key] or 0, 2) for key in ("call_us", "call_us_deepep_harness", "kernel_us")
                              if key in v} for name, v in (run.get("call_vs_kernel") or {}).items()} for run in runs]
    return {"commit": runs[0]["commit"], "device": runs[0]["device"], "date": runs[0]["date"],
            "num_ranks": runs[0]["num_ranks"], "settings": runs[0]["settings"], "calls": calls,
            "call_vs_kernel_4096": call_vs_kernel, "steps": [run.get("steps") for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    args = parser.parse_args()
    before, after = merge(args.before), merge(args.after)
    print(f"host time per call, µs, median of {len(args.before)} / {len(args.after)} runs "
          f"(before {before['commit']} -> after {after['commit']}, {after['device']}):")
    for name, cells in after["calls"].items():
        print(f"  {name:<22}" + "".join(
            f"{tokens:>6}: {before['calls'][name][tokens]['median']:6.1f} -> {cell['median']:6.1f}"
            for tokens, cell in cells.items() if tokens in before["calls"][name]))
    with open(args.json, "w") as f:
        json.dump({"what": "benchmarks/host_cost.py in two trees, alternately, in one call on one machine",
                   "before": before, "after": after}, f, indent=1)


if __name__ == "__main__":
    main()
