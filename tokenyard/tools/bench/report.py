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
    compare_sm:  {backend key: [{num_sms, dispatch, dispatch_cached, combine, *_kernel}, ...]}  (compare_sm mode)

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


SWEEP_OPS = _timed_ways(NORMAL_OPS)  # the SM sweep times the V1 calls
OPS = SWEEP_OPS + _timed_ways(ELASTIC_OPS)
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
    copy_limits = [p["backends"][name]["copy_limit_gbps"] for p in ranks for name in first["backends"]]
    copy_limits = [c for c in copy_limits if c is not None]
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
        "copy_limit_gbps": min(copy_limits) if copy_limits else None,  # the slowest rank's limit
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


def _on_gpus(doc: dict) -> bool:
    return doc.get("settings", {}).get("gpu", True)


def _columns(doc: dict) -> Tuple[str, ...]:
    return COLUMNS if _on_gpus(doc) else CPU_COLUMNS


def _cells(who: str, op: str, values: dict, columns: Tuple[str, ...] = COLUMNS) -> List[str]:
    def number(v):  # 2 decimals, or 3 significant digits below 1 (CPU bandwidths are small)
        return "-" if v is None else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"

    cells = [who, op, f"{values['us']:.1f}", number(values["nvlink_gbps"]), number(values["logical_gbps"]),
             "-" if values["num_sms"] is None else str(values["num_sms"])]
    return cells[:len(columns)]


def _notes(doc: dict) -> List[str]:
    notes = [f"{doc['device']}; hidden {doc['hidden']}, {doc['num_tokens']} tokens per rank "
             f"({doc['num_tokens_low_latency']} low-latency), {doc['num_experts']} experts, top-{doc['num_topk']}, "
             f"{doc['dtype']} dispatch, seed {doc['settings']['seed']}",
             "copy limit: " + ("not measured" if doc["copy_limit_gbps"] is None
                               else f"{doc['copy_limit_gbps']:.1f} GB/s")]
    if "shared by" in doc["device"]:
        notes.append("ranks share GPUs (MPS): times only, no bandwidth, no NCCL baseline")
    if not _on_gpus(doc):
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


def print_table(doc: dict) -> None:
    """Print `table`, through rich where it is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(table(doc), flush=True)
        return
    notes = _notes(doc)
    rich_table, columns = Table(), _columns(doc)
    for i, column in enumerate(columns):
        rich_table.add_column(column, justify="left" if i < 2 else "right", no_wrap=True)
    for row in results(doc):
        rich_table.add_row(*_cells(*row, columns))
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a pipe would get 80 columns
    console.print(notes[0], markup=False, highlight=False)
    console.print(rich_table)
    for note in notes[1:]:
        console.print(note, markup=False, highlight=False)
