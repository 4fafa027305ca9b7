"""Stream and event keywords drawn at random over hundreds of calls on a `Buffer` (normal and low-latency mode)
and an `ElasticBuffer`, with late inputs, scribbled inputs and late reads of outputs, every output compared with
the reference backend (NOTE [stream stress] in stream_stress.py). benchmarks/stream_stress.py runs it at several
seeds and records what it covered."""

from __future__ import annotations

import pytest

from . import spawn
from .stream_stress import stress

pytestmark = spawn.needs_ranks()

NUM_ROUNDS = 60  # about 250 calls a seed


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_random_stream_modes_match_the_reference(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    reports = spawn.run(num_ranks, stress, seed, NUM_ROUNDS)
    failures = [f for report in reports for f in report["failures"]]
    print(f"{reports[0]['num_calls']} calls a rank, {len(reports[0]['covered'])} keyword values covered")
    assert not failures, f"{len(failures)} outputs differ from the reference; the first: " + "; ".join(failures[:5])
