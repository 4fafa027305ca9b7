"""``python -m tokenyard.tools.bench``: time dispatch and combine; print a table, write JSON and a plot.

Exit status: 0 on success, 1 when a rank fails or the run times out (the message names the rank), 2 for a
bad command line.
"""

from __future__ import annotations

import datetime
import sys
from typing import Optional, Sequence

from . import BenchError, launch, options, plot, report


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m tokenyard.tools.bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" in argv:  # predictions for a cluster: no ranks, no GPU (tokenyard/tools/bench/model/)
        from . import model

        return model.main([a for a in argv if a != "--model"], prog)
    for i, arg in enumerate(argv):  # the MoE layer step (issue 52) has options of its own
        if arg == "--mode=moe" or (arg == "--mode" and argv[i + 1:i + 2] == ["moe"]):
            from . import moe_step

            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            return moe_step.main(rest, f"{prog} --mode moe")
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    settings = options.parse(argv, num_gpus, prog)
    if not settings.quiet:  # starting the ranks takes seconds before the first progress
        where = f"{min(num_gpus, settings.num_ranks)} GPU(s)" if settings.gpu else "the CPU (gloo)"
        print(f"{prog}: starting {settings.num_ranks} ranks on {where}...", file=sys.stderr, flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        if settings.plot:
            plot.require_matplotlib()
        doc = report.build(settings, launch.run_ranks(settings), commit=report.git_commit(), date=date)
        report.print_table(doc, settings.verbose)
        if settings.json:
            report.write_json(doc, settings.json)
            print(f"wrote {settings.json}")
        if settings.plot:
            plot.plot(doc, settings.plot)
            print(f"wrote {settings.plot}")
    except BenchError as exc:
        print(f"tokenyard.tools.bench: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
