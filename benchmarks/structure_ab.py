"""Issue 22's A/B: the README's benchmark at the same settings in the tree before the structural change and in
this one, on the same machine, merged into one JSON (as in benchmarks/results/structure_ab.json).

    bash benchmarks/run_device.sh structure_ab    # runs the benchmark in both trees, then this
    python3 benchmarks/structure_ab.py --before-commit C0 --after-commit C1 --json OUT \
        --before ab_before_*.json --after ab_after_*.json [--label NAME]

Each side's figure is the median of its runs; `ratio` is after / before (below 1: faster after). One machine's
runs make a session; where OUT exists (same commits and device), the session is added to its `sessions`.

Call times come two ways: "back to back" (CUDA events around each of the calls, no barrier between them, as
DeepEP's harness times calls) and "barrier before each" (a device barrier, then the call on an idle GPU: the
host's latency to its first launch counts in full, so these follow the host's state, on both sides alike).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

# (name, path in the benchmark JSON's "tokenyard" entry): kernel times, call times, low-latency graph replays.
FIGURES = (
    ("dispatch kernel us", ("dispatch_kernel", "us")),
    ("cached dispatch kernel us", ("dispatch_cached_kernel", "us")),
    ("combine kernel us", ("combine_kernel", "us")),
    ("dispatch call us, back to back", ("dispatch_back_to_back", "us")),
    ("cached dispatch call us, back to back", ("dispatch_cached_back_to_back", "us")),
    ("combine call us, back to back", ("combine_back_to_back", "us")),
    ("dispatch call us, barrier before each", ("dispatch", "us")),
    ("cached dispatch call us, barrier before each", ("dispatch_cached", "us")),
    ("combine call us, barrier before each", ("combine", "us")),
    ("low-latency dispatch graph kernel us", ("low_latency", "dispatch_graph_kernel_us")),
    ("low-latency combine graph kernel us", ("low_latency", "combine_graph_kernel_us")),
)


def _figure(doc: dict, path) -> float:
    value = doc["tokenyard"]
    for key in path:
        value = value[key]
    return float(value)


def _compared(settings: dict) -> dict:
    """The settings both sides must share: each run draws its own inputs and writes its own file."""
    return {k: v for k, v in settings.items() if k not in ("seed", "json", "plot")}


def merge(before: list, after: list, commit_before: str, commit_after: str, label: str = "") -> dict:
    """`before`, `after`: benchmark JSON documents of one side each, run at the same settings on one device."""
    docs = before + after
    devices = {d["device"] for d in docs}
    settings = {json.dumps(_compared(d["settings"]), sort_keys=True) for d in docs}
    if len(devices) != 1 or len(settings) != 1:
        raise ValueError(f"the runs differ in device {sorted(devices)} or settings ({len(settings)} kinds)")
    figures = {}
    for name, path in FIGURES:
        b = statistics.median(_figure(d, path) for d in before)
        a = statistics.median(_figure(d, path) for d in after)
        figures[name] = {"before": b, "after": a, "ratio": a / b,
                         "before_runs": [_figure(d, path) for d in before],
                         "after_runs": [_figure(d, path) for d in after]}
    return {"label": label, "commit_before": commit_before, "commit_after": commit_after, "device": devices.pop(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": json.loads(settings.pop()), "runs_per_side": [len(before), len(after)],
            "seeds": {side: [d["settings"].get("seed") for d in runs] for side, runs in (("before", before),
                                                                                        ("after", after))},
            "figures": figures}


def add_session(doc: dict, session: dict) -> dict:
    """`doc` (an earlier output, or {}) with `session` added; every session compares the same commits on one
    kind of device."""
    keys = ("commit_before", "commit_after", "device")
    if doc and tuple(doc[k] for k in keys) != tuple(session[k] for k in keys):
        raise ValueError(f"the session compares {[session[k] for k in keys]}, the file {[doc[k] for k in keys]}")
    return {**{k: session[k] for k in keys}, "sessions": doc.get("sessions", []) + [session]}


def table(session: dict) -> str:
    lines = [f"| figure ({session['device']}, {session['label'] or 'one session'}) | before "
             f"({session['commit_before']}) | after ({session['commit_after']}) | after / before |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {f['before']:.1f} | {f['after']:.1f} | {f['ratio']:.3f} |"
              for name, f in session["figures"].items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-commit", required=True)
    parser.add_argument("--after-commit", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    parser.add_argument("--label", default="", help="what sets this session apart (machine, order of the runs)")
    args = parser.parse_args(argv)
    docs = {side: [json.load(open(path)) for path in paths] for side, paths in (("before", args.before),
                                                                                 ("after", args.after))}
    session = merge(docs["before"], docs["after"], args.before_commit, args.after_commit, args.label)
    doc = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    doc = add_session(doc, session)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(session))


if __name__ == "__main__":
    main()
