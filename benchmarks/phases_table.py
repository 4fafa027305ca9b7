"""One table of `run_device.sh proxy_phases`'s runs: where the normal-mode kernels' warps spend their time, per
TOKENYARD_TUNING variant (benchmarks/normal_phases.py's JSON, rank 0).

    python benchmarks/phases_table.py out/phases_*.json

Prints, per run and SM count, each role's span and its largest phases (µs per call): a change to the senders shows in
their phases even where the receivers or reducers set the kernel's time.
"""

from __future__ import annotations

import argparse
import json
import pathlib

PHASES = {"send": ("meta", "data", "ownrow", "ahead", "tail", "publish"), "other": ("wait", "copy")}


def lines(report: dict) -> list:
    out = []
    for num_sms, kinds in report["phases"].items():
        for kind, roles in kinds.items():
            cells = []
            for role, names in PHASES.items():
                values = roles[role]
                shown = " ".join(f"{name} {values[name]:.0f}" for name in names if values.get(name, 0) >= 0.5)
                cells.append(f"{role} {values['span']:.0f} ({shown})")
            out.append(f"    {num_sms:>3} SMs {kind:<8}  " + "   ".join(cells))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    args = parser.parse_args()
    print("µs per call, rank 0: each role's span (its phases); send = sending warps, other = receiving or reducing")
    for path in args.runs:
        report = json.loads(path.read_text())[0]
        print(f"{report.get('tuning') or '(defaults)'}  [commit {report.get('commit')}]")
        print("\n".join(lines(report)))


if __name__ == "__main__":
    main()
