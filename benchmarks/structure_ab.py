"""Issue 22's A/B: the README's benchmark at the same settings in the tree before the structural change and in
this one, on the same machine, merged into one JSON (benchmarks/results/structure_ab.json).

    bash benchmarks/run_device.sh structure_ab    # runs the benchmark in both trees, then this
    python3 benchmarks/structure_ab.py --before-commit C0 --after-commit C1 --json OUT \
        --before ab_before_*.json --after ab_after_*.json

Each side's figure is the median of its runs; `ratio` is after / before (below 1: faster after).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

# (name, path in the benchmark JSON's "tokenyard" entry): kernel times, call times, low-latency graph replays.
FIGURES = (
    ("dispatch kernel us", ("dispatch_kernel", "us")),
    ("cached dispatch kernel us", ("dispatch_cached_kernel", "us")),
    ("combine kernel us", ("combine_kernel", "us")),
    ("dispatch call us", ("dispatch", "us")),
    ("cached dispatch call us", ("dispatch_cached", "us")),
    ("combine call us", ("combine", "us")),
    ("low-latency dispatch graph kernel us", ("low_latency", "dispatch_graph_kernel_us")),
    ("low-latency combine graph kernel us", ("low_latency", "combine_graph_kernel_us")),
)


def _figure(doc: dict, path) -> float:
    value = doc["tokenyard"]
    for key in path:
        value = value[key]
    return float(value)


def merge(before: list, after: list, commit_before: str, commit_after: str) -> dict:
    """`before`, `after`: benchmark JSON documents of one side each, run at the same settings on one device."""
    docs = before + after
    devices = {d["device"] for d in docs}
    settings = {json.dumps(d["settings"], sort_keys=True) for d in docs}
    if len(devices) != 1 or len(settings) != 1:
        raise ValueError(f"the runs differ in device {sorted(devices)} or settings ({len(settings)} kinds)")
    figures = {}
    for name, path in FIGURES:
        b = statistics.median(_figure(d, path) for d in before)
        a = statistics.median(_figure(d, path) for d in after)
        figures[name] = {"before": b, "after": a, "ratio": a / b,
                         "before_runs": [_figure(d, path) for d in before],
                         "after_runs": [_figure(d, path) for d in after]}
    return {"commit_before": commit_before, "commit_after": commit_after, "device": devices.pop(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": json.loads(settings.pop()), "runs_per_side": [len(before), len(after)], "figures": figures}


def table(doc: dict) -> str:
    lines = [f"| figure ({doc['device']}) | before ({doc['commit_before']}) | after ({doc['commit_after']}) "
             "| after / before |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {f['before']:.1f} | {f['after']:.1f} | {f['ratio']:.3f} |"
              for name, f in doc["figures"].items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-commit", required=True)
    parser.add_argument("--after-commit", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    args = parser.parse_args(argv)
    docs = {side: [json.load(open(path)) for path in paths] for side, paths in (("before", args.before),
                                                                                 ("after", args.after))}
    doc = merge(docs["before"], docs["after"], args.before_commit, args.after_commit)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))


if __name__ == "__main__":
    main()
