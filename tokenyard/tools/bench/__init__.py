"""The benchmark command ``python -m tokenyard.tools.bench``: time dispatch and combine on every backend.

It starts one process per rank, times each backend's normal-mode and low-latency calls on fresh random
inputs, times an ``all_to_all_single`` moving the same bytes as a baseline, and prints a table (also JSON
and a plot on request). The pieces, in the order a run uses them:

    options.py    the command line and its machine-dependent defaults
    launch.py     spawning the ranks, with deadlines, and reporting a failed rank
    runner.py     what each rank runs: problems, buffers, the calls timed
    timing.py     median times of calls on one rank (CPU clock or CUDA events)
    bandwidth.py  bytes and GB/s, each formula written once
    copy_limit.py the physical copy limit: a kernel of its own (include/tokenyard_bench/copy_limit.cuh), copy engines
    report.py     the table and the JSON document;  plot.py: the chart

``--model`` measures nothing: model/normal.py predicts internode normal-mode calls, model/low_latency.py (``--model
--mode low_latency``) the low-latency ones, each calibrated on a published figure (model/__init__.py picks one).
"""


class BenchError(RuntimeError):
    """A benchmark run that cannot go on; the message says why (which rank, which setting)."""
