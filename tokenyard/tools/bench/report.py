"""Turn every rank's samples into the JSON document and the printed table.

The JSON document (`build`), one entry ``{us, nvlink_gbps, logical_gbps, num_sms}`` per operation
(null where not measured in this mode, and every bandwidth null where ranks share GPUs)::

    commit, device, date, settings, env (the TOKENYARD_* variables set), num_ranks, num_tokens,
    num_tokens_low_latency, hidden, num_topk, num_experts, dtype, copy_limit_gbps
    nccl:        {backend ("nccl" or "gloo"), dispatch, combine, dispatch_back_to_back, combine_back_to_back,
                  dispatch_kernel, combine_kernel}
                 the all_to_all_single baseline
    reference, tokenyard (the CUDA backend), for each backend run:
                 {dispatch, dispatch_cached, combine, *_back_to_back and *_kernel of each,
                  low_latency: {dispatch_us, combine_us, dispatch_graph_us, combine_graph_us,
                                dispatch_graph_kernel_us, combine_graph_kernel_us,
                                dispatch_nvlink_gbps, dispatch_logical_gbps, combine_nvlink_gbps,
                                combine_logical_gbps, graph_error}}
    compare_sm:  {backend key: [{num_sms, and each op a backend's entry has: V1's dispatch, dispatch_cached,
                  combine and V2's v2_*, with *_back_to_back and *_kernel}, ...]}  (compare_sm mode)

An op's plain entry is timed with CUDA events around the call after a barrier (host work before its first
kernel included); ``*_back_to_back`` with the same events around calls made one after another with no
barrier between them, as DeepEP's harness times calls; ``*_kernel`` is the GPU time of its own kernels
from the profiler, as DeepEP reports (tokenyard/tools/bench/timing.py). Kernel times exist on GPUs for the
CUDA backend and NCCL's all-to-all.
    affinity:    [each rank's tokenyard.tools.affinity.Binding.as_dict()]             (with --bind)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import List, Optional, Tuple

from . import bandwidth
from .options import BenchSettings
from .runner import BACK_TO_BACK_SUFFIX, ELASTIC_OPS, KERNEL_SUFFIX, NORMAL_OPS


def _timed_ways(ops):
    return tuple(ops) + tuple(op + BACK_TO_BACK_SUFFIX for op in ops) + tuple(op + KERNEL_SUFFIX for op in ops)


OPS = _timed_ways(NORMAL_OPS) + _timed_ways(ELASTIC_OPS)
SWEEP_OPS = OPS  # the SM sweep times V1's calls and V2's
BASELINE_OPS = _timed_ways(("dispatch", "combine"))

BACKEND_KEYS = {"reference": "reference", "cuda": "tokenyard"}
LOW_LATENCY_TABLE_OPS = (("ll_dispatch", "dispatch"), ("ll_combine", "combine"),
                         ("ll_dispatch_graph", "dispatch_graph"), ("ll_combine_graph", "combine_graph"),
                         ("ll_dispatch_graph_kernel", "dispatch_graph_kernel"),
                         ("ll_combine_graph_kernel", "combine_graph_kernel"),
                         ("ll_hook_graph", "hook_graph"), ("ll_hook_graph_kernel", "hook_graph_kernel"))


def git_commit() -> Optional[str]:
    """TOKENYARD_COMMIT when set (a copied tree whose git metadata may be missing or stale, as on the
    device machine); else ``git rev-parse HEAD`` of the checkout tokenyard runs from; else the commit an
    installed copy was built from (setup.py); else None."""
    from ...env import settings

    if settings().commit:
        return settings().commit
    root = pathlib.Path(__file__).resolve().parents[3]
    if (root / ".git").exists():  # a checkout (an editable install included): its HEAD now
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    try:
        from ... import _build_info
    except ImportError:
        return None
    return _build_info.COMMIT


def _low_latency(per_rank: List[dict]) -> dict:
    ops = {op: bandwidth.summarize([p["samples"].get(op) for p in per_rank])
           for op, _ in LOW_LATENCY_TABLE_OPS}
    entry = {}
    for op, name in LOW_LATENCY_TABLE_OPS:
        entry[f"{name}_us"] = ops[op]["us"] if ops[op] else None
    for op, name in LOW_LATENCY_TABLE_OPS[:2] + LOW_LATENCY_TABLE_OPS[4:]:
        for metric in ("nvlink_gbps", "logical_gbps"):
            entry[f"{name}_{metric}"] = ops[op][metric] if ops[op] else None
    entry["graph_error"] = per_rank[0]["graph_error"]
    return entry


def _backend_entry(per_rank: List[dict]) -> dict:
    num_sms = per_rank[0]["num_sms"]
    entry = {op: bandwidth.summarize([p["samples"].get(op) for p in per_rank], num_sms) for op in OPS}
    entry["low_latency"] = _low_latency(per_rank)
    return entry


def _sweep(name: str, per_rank: List[dict], sm_counts) -> List[dict]:
    points = []
    for n in sm_counts:
        point = {"num_sms": n}
        for op in SWEEP_OPS:
            point[op] = bandwidth.summarize([p["sweep"][n].get(op) for p in per_rank], n if name == "cuda" else None)
        points.append(point)
    return points


def build(settings: BenchSettings, ranks: List[dict], commit: Optional[str], date: str) -> dict:
    """The JSON document (see the module docstring) from every rank's samples."""
    first = ranks[0]
    shared = first.get("ranks_per_gpu", 1) > 1
    gpu_label = f"{first['device']} x {first.get('num_gpus', settings.num_ranks)}"
    if shared:
        gpu_label += f" shared by {settings.num_ranks} ranks (MPS)"
    copy_limits = [(p["backends"][name]["copy_limit_gbps"], p["backends"][name].get("copy_limit_method"))
                   for p in ranks for name in first["backends"]]
    copy_limits = [c for c in copy_limits if c[0] is not None]
    slowest_limit = min(copy_limits) if copy_limits else (None, None)  # the slowest rank's limit, and its way
    doc = {
        "commit": commit,
        "device": gpu_label if settings.gpu else f"cpu ({settings.num_ranks} gloo ranks)",
        "date": date,
        "settings": dataclasses.asdict(settings),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("TOKENYARD_")},
        "num_ranks": settings.num_ranks,
        "num_tokens": settings.num_tokens,
        "num_tokens_low_latency": settings.num_tokens_low_latency,
        "hidden": settings.hidden_size,
        "num_topk": settings.num_topk,
        "num_experts": settings.num_experts,
        "dtype": settings.dtype,
        "copy_limit_gbps": slowest_limit[0],
        "copy_limit_method": slowest_limit[1],  # the copy pattern (NOTE [copy patterns] in copy_limit.cuh)
        "nccl": {"backend": first["baseline_backend"],
                 **{op: bandwidth.summarize([p["baseline"].get(op) for p in ranks]) for op in BASELINE_OPS}},
    }
    if any(p.get("affinity") is not None for p in ranks):
        doc["affinity"] = [p.get("affinity") for p in ranks]
    for name in first["backends"]:
        per_rank = [p["backends"][name] for p in ranks]
        doc[BACKEND_KEYS[name]] = _backend_entry(per_rank)
        if settings.runs("compare_sm"):
            doc.setdefault("compare_sm", {})[BACKEND_KEYS[name]] = _sweep(name, per_rank, settings.sm_counts)
    if shared:
        _times_only(doc)
    return doc


def _times_only(doc) -> None:
    """Ranks that share a GPU copy within it: their times say how long the calls took there, but no rate
    of theirs is an NVLink bandwidth, so every one becomes null (and prints as "-")."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        if isinstance(key, str) and key.endswith("gbps"):
            doc[key] = None
        else:
            _times_only(value)


def write_json(doc: dict, path: str) -> None:
    """Write `doc` to `path` (making its folder), indented."""
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def backend_keys(doc: dict) -> List[str]:
    """The backends `doc` holds, by their JSON keys."""
    return [key for key in BACKEND_KEYS.values() if key in doc]


def results(doc: dict) -> List[Tuple[str, str, dict]]:
    """Every measured operation as ``(who, op, {us, nvlink_gbps, logical_gbps, num_sms})``, table order."""
    rows = [(f"{doc['nccl']['backend']} all_to_all", op, doc["nccl"].get(op)) for op in BASELINE_OPS]
    for key in backend_keys(doc):
        entry = doc[key]
        rows += [(key, op, entry.get(op)) for op in OPS]
        ll = entry["low_latency"]
        for _, name in LOW_LATENCY_TABLE_OPS:
            rows.append((key, f"low_latency {name}", None if ll[f"{name}_us"] is None else {
                "us": ll[f"{name}_us"], "nvlink_gbps": ll.get(f"{name}_nvlink_gbps"),
                "logical_gbps": ll.get(f"{name}_logical_gbps"), "num_sms": None}))
        for point in doc.get("compare_sm", {}).get(key, []):
            rows += [(key, f"{op} @ {point['num_sms']} SMs", point.get(op)) for op in SWEEP_OPS]
    return [(who, op, values) for who, op, values in rows if values is not None]


COLUMNS = ("backend", "op", "us", "nvlink_gbps", "logical_gbps", "num_sms")
CPU_COLUMNS = ("backend", "op", "us", "remote_gbps", "logical_gbps")  # the same figures, in words for CPU ranks


def on_gpus(doc: dict) -> bool:
    """Whether `doc` was measured on GPUs (else on CPU ranks, whose rows speak of CPU figures)."""
    return doc.get("settings", {}).get("gpu", True)


def _columns(doc: dict) -> Tuple[str, ...]:
    return COLUMNS if on_gpus(doc) else CPU_COLUMNS


def _cells(who: str, op: str, values: dict, columns: Tuple[str, ...] = COLUMNS) -> List[str]:
    def number(v):  # 2 decimals, or 3 significant digits below 1 (CPU bandwidths are small)
        return "-" if v is None else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"

    cells = [who, op, f"{values['us']:.1f}", number(values["nvlink_gbps"]), number(values["logical_gbps"]),
             "-" if values["num_sms"] is None else str(values["num_sms"])]
    return cells[:len(columns)]


def _notes(doc: dict) -> List[str]:
    mode = doc["settings"].get("mode", "all")
    tokens = {"normal": f"{doc['num_tokens']} tokens per rank", "compare_sm": f"{doc['num_tokens']} tokens per rank",
              "low_latency": f"{doc['num_tokens_low_latency']} tokens per rank (low latency)"}.get(
        mode, f"{doc['num_tokens']} tokens per rank ({doc['num_tokens_low_latency']} in low latency)")
    notes = [f"{doc['device']}; hidden {doc['hidden']}, {tokens}, {doc['num_experts']} experts, "
             f"top-{doc['num_topk']}, {doc['dtype']} dispatch, seed {doc['settings']['seed']}",
             "copy limit: " + ("not measured" if doc["copy_limit_gbps"] is None
                               else f"{doc['copy_limit_gbps']:.1f} GB/s ({doc.get('copy_limit_method')} writer)")]
    if "shared by" in doc["device"]:
        notes.append("ranks share GPUs (MPS): times only, no bandwidth, no NCCL baseline")
    if not on_gpus(doc):
        notes.append("CPU ranks: remote_gbps counts the bytes sent to other ranks"
                     + ("; the reference backend ignores SM counts, so the '@ N SMs' rows time the same calls"
                        if doc.get("compare_sm") else ""))
    for key in backend_keys(doc):
        error = doc[key]["low_latency"]["graph_error"]
        if error and doc[key]["low_latency"]["dispatch_us"] is not None:
            notes.append(f"{key}: no CUDA-graph times ({error})")
    return notes


def table(doc: dict) -> str:
    """The results as fixed-width text (header, one line per operation, then notes)."""
    columns = _columns(doc)
    lines = [_cells(*row, columns) for row in results(doc)]
    widths = [max(len(c) for c in column) for column in zip(columns, *lines)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    body = [fmt(columns), "  ".join("-" * w for w in widths)] + [fmt(cells) for cells in lines]
    return "\n".join(_notes(doc)[:1] + body + _notes(doc)[1:])


# The summary's rows (NOTE [summary table]): (label, the op's key, its all-to-all baseline's op); "ll_" keys are
# the low-latency entry's.
SUMMARY_ROWS = (("layout", "layout", None), ("dispatch", "dispatch", "dispatch"),
                ("dispatch, cached handle", "dispatch_cached", "dispatch"), ("combine", "combine", "combine"),
                ("V2 dispatch", "v2_dispatch", "dispatch"), ("V2 combine", "v2_combine", "combine"),
                ("low-latency dispatch", "ll_dispatch", None), ("low-latency combine", "ll_combine", None))
SUMMARY_COLUMNS = ("operation", "kernel us", "call us", "all-to-all us", "limit us", "% of limit", "SMs")
CPU_SUMMARY_COLUMNS = ("operation", "call us", "all-to-all us")


def main_key(doc: dict) -> Optional[str]:
    """The backend the summary shows: the CUDA backend's where it ran, else the reference backend's."""
    keys = backend_keys(doc)
    return "tokenyard" if "tokenyard" in keys else keys[0] if keys else None


def _timed(entry: Optional[dict]) -> Optional[float]:
    return None if entry is None else entry["us"]


def summary(doc: dict) -> List[dict]:
    """NOTE [summary table]
    One row per operation of `main_key`'s backend, like against like: ``kernel_us`` (the GPU time of its kernels,
    as DeepEP reports it; a low-latency call's CUDA-graph replay), ``call_us`` (a call in a run of calls back to
    back, as DeepEP's harness times them; a low-latency call: one eager call after a barrier), ``all_to_all_us``
    (the baseline moving the same bytes: NCCL's all_to_all_single kernel on GPUs, gloo's call back to back on
    CPU), ``limit_us`` (the time the copy limit needs for the operation's NVLink bytes), ``percent`` (of that
    limit's rate the kernel reaches) and ``num_sms``. Missing figures are None: a layout moves no rows, the
    low-latency calls have no all-to-all baseline, and CPU runs have neither kernels nor a copy limit."""
    key = main_key(doc)
    if key is None:
        return []
    entry, nccl, limit = doc[key], doc["nccl"], doc["copy_limit_gbps"]

    def row(label, op, baseline, values):
        if op.startswith("ll_"):
            ll, name = values["low_latency"], op[3:]
            kernel = ll.get(f"{name}_graph_kernel_us")
            kernel_gbps, call, num_sms = ll.get(f"{name}_graph_kernel_nvlink_gbps"), ll.get(f"{name}_us"), None
        else:
            kernel_entry = values.get(op + KERNEL_SUFFIX)
            kernel, call = _timed(kernel_entry), _timed(values.get(op + BACK_TO_BACK_SUFFIX))
            kernel_gbps = None if kernel_entry is None else kernel_entry["nvlink_gbps"]
            num_sms = (values.get(op) or {}).get("num_sms")
        if kernel is None and call is None:
            return None
        all_to_all = None
        if baseline is not None:
            all_to_all = _timed(nccl.get(baseline + (KERNEL_SUFFIX if on_gpus(doc) else BACK_TO_BACK_SUFFIX)))
        limit_us = percent = None
        if limit and kernel and kernel_gbps:  # a layout moves no bytes: no limit
            limit_us, percent = kernel * kernel_gbps / limit, 100 * kernel_gbps / limit
        return {"operation": label, "op": op, "kernel_us": kernel, "call_us": call, "all_to_all_us": all_to_all,
                "limit_us": limit_us, "percent": percent, "num_sms": num_sms}

    rows = [row(label, op, baseline, entry) for label, op, baseline in SUMMARY_ROWS]
    # compare_sm mode: the data rows at each SM count (the entry itself holds none).
    for point in doc.get("compare_sm", {}).get(key, []):
        rows += [row(f"{label} @ {point['num_sms']} SMs", op, baseline, point)
                 for label, op, baseline in SUMMARY_ROWS if op != "layout" and not op.startswith("ll_")]
    return [r for r in rows if r is not None]


def verdict(doc: dict) -> str:
    """One line that sums the run up: each normal-mode kernel against NCCL and the copy limit (GPU), or what a CPU
    run is good for."""
    rows = {row["op"]: row for row in summary(doc)}
    if not on_gpus(doc):
        return ("CPU ranks over gloo: these times check that everything runs; they say nothing about GPUs, where the "
                "figures that matter come from")
    parts = []
    for op, name in (("dispatch_cached", "cached dispatch"), ("dispatch", "dispatch"), ("combine", "combine")):
        row = rows.get(op)
        if row is None or row["kernel_us"] is None:
            continue
        part = name
        if row["all_to_all_us"]:
            part += f" {row['all_to_all_us'] / row['kernel_us']:.2f}x NCCL's speed"
        if row["percent"] is not None:
            part += f", {row['percent'] / 100:.2f}x the copy limit"
        parts.append(part)
    sms = next((row["num_sms"] for row in rows.values() if row["num_sms"]), None)
    ll = [rows[op]["kernel_us"] for op in ("ll_dispatch", "ll_combine") if op in rows and rows[op]["kernel_us"]]
    line = "; ".join(parts) + (f" at {sms} SMs" if sms and parts else "")
    if len(ll) == 2:
        line += f"{'; ' if line else ''}low-latency kernels {ll[0]:.1f} / {ll[1]:.1f} us"
    return line or "no kernel times (ranks share GPUs, or only the reference backend ran)"


def summary_table(doc: dict) -> Tuple[Tuple[str, ...], List[List[str]]]:
    """The summary's columns and cells (NOTE [summary table])."""
    columns = SUMMARY_COLUMNS if on_gpus(doc) else CPU_SUMMARY_COLUMNS

    def number(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    cells = []
    for row in summary(doc):
        every = [row["operation"], number(row["kernel_us"]), number(row["call_us"]), number(row["all_to_all_us"]),
                 number(row["limit_us"]), number(row["percent"], 0), "-" if not row["num_sms"] else str(row["num_sms"])]
        cells.append(every if on_gpus(doc) else [every[0], every[2], every[3]])
    return columns, cells


def _summary_notes(doc: dict) -> List[str]:
    key = main_key(doc)
    who = {"tokenyard": "tokenyard's CUDA kernels", "reference": "the reference backend (plain PyTorch)"}.get(key, key)
    if on_gpus(doc):
        limit = ("not measured" if doc["copy_limit_gbps"] is None else
                 f"{doc['copy_limit_gbps']:.0f} GB/s per GPU, the fastest way found to write to every peer "
                 f"({doc.get('copy_limit_method')})")
        lines = [f"rows: {who}; kernel = GPU time of its kernels; call = calls back to back (low latency: one call); "
                 f"all-to-all = NCCL all_to_all_single of the same bytes; copy limit: {limit}"]
    else:
        lines = [f"rows: {who} on {doc['num_ranks']} CPU ranks over gloo; call = calls back to back (low latency: "
                 "one call); all-to-all = gloo's all_to_all_single of the same bytes between ranks"]
    if "shared by" in doc["device"]:
        lines.append("ranks share GPUs (MPS): times only, no bandwidth, no NCCL baseline")
    if key and doc[key]["low_latency"]["graph_error"] and on_gpus(doc):
        lines.append(f"{key}: no CUDA-graph times ({doc[key]['low_latency']['graph_error']})")
    return lines


def print_table(doc: dict, verbose: bool = False) -> None:
    """Print the summary (NOTE [summary table]) and its verdict; with `verbose`, every row first (`table`). Through
    rich where it is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806 - plain text below
    columns, cells = summary_table(doc)
    header, notes = _notes(doc)[0], _summary_notes(doc)
    if Console is None:
        if verbose:
            print(table(doc), flush=True)
        widths = [max(len(c) for c in column) for column in zip(columns, *cells)]
        print(header)
        for line in [columns] + cells:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        print("\n".join([verdict(doc)] + notes), flush=True)
        return
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a pipe would get 80 columns
    if verbose:
        every, every_columns = Table(title="every measured row"), _columns(doc)
        for i, column in enumerate(every_columns):
            every.add_column(column, justify="left" if i < 2 else "right", no_wrap=True)
        for row in results(doc):
            every.add_row(*_cells(*row, every_columns))
        console.print(every)
        for note in _notes(doc)[1:]:
            console.print(note, markup=False, highlight=False)
    console.print(header, markup=False, highlight=False)
    rich_table = Table()
    for i, column in enumerate(columns):
        rich_table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for line in cells:
        rich_table.add_row(*line)
    console.print(rich_table)
    for line in [verdict(doc)] + notes:  # whole lines: a log keeps them as printed
        console.print(line, markup=False, highlight=False, soft_wrap=True)
