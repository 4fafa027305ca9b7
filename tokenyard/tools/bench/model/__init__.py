"""``python -m tokenyard.tools.bench --model``: predicted internode dispatch and combine times for a cluster, before
any internode kernel runs; nothing is measured. ``main`` reads ``--mode`` and hands the command line to its model:

    normal.py           normal mode (the default; NOTE [internode model])
    low_latency.py      ``--mode low_latency`` (NOTE [low-latency model]); low_latency_cli.py its command line
    operations.py       the NVSHMEM operations of each call, DeepEP's and ours (NOTE [operation counts])
    pricing.py          what those operations cost: the NIC's work requests (NOTE [operations priced])
    common.py           what both share: the modes and operations, a token's reach, the command line's pieces
"""

from __future__ import annotations

import argparse
from typing import Sequence

from . import low_latency_cli, normal
from .common import MODEL_MODES


def _mode(argv: Sequence[str], prog: str) -> str:
    """The --mode of a --model command line, before the mode's own parser reads the rest."""
    parser = argparse.ArgumentParser(prog=f"{prog} --model", add_help=False)
    parser.add_argument("--mode", choices=MODEL_MODES, default="normal")
    return parser.parse_known_args(argv)[0].mode


def main(argv: Sequence[str], prog: str = "python -m tokenyard.tools.bench") -> int:
    """A --model command line (without --model) run by the model its --mode names; -> the exit status."""
    model = low_latency_cli if _mode(argv, prog) == "low_latency" else normal
    return model.main(argv, prog)
