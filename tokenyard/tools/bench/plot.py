"""Draw the results as a PNG: bandwidth per operation and backend, or against the SM count.

Two panels, NVLink (remote) and logical bandwidth (bandwidth.py). The all-to-all baseline's dispatch
and combine bandwidths and, where measured, the copy limit are horizontal reference lines. In
compare_sm mode each (backend, operation) is a line over the SM counts; otherwise bars.
"""

from __future__ import annotations

from . import BenchError
from .report import backend_keys, results

METRICS = (("nvlink_gbps", "NVLink (remote) bytes"), ("logical_gbps", "logical bytes (DeepEP)"))


def require_matplotlib() -> None:
    """Raises `BenchError` with the fix where matplotlib is missing (checked before any rank starts)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or tokenyard[plot])") from None


def _reference_lines(ax, doc: dict, metric: str) -> None:
    for op, style in (("dispatch", "--"), ("combine", ":")):
        entry = doc["nccl"][op]
        if entry is not None:
            ax.axhline(entry[metric], color="gray", linestyle=style, label=f"{doc['nccl']['backend']} {op}")
    if metric == "nvlink_gbps" and doc["copy_limit_gbps"] is not None:
        ax.axhline(doc["copy_limit_gbps"], color="red", label="copy limit")


def _bars(ax, doc: dict, metric: str) -> None:
    rows = [(who, op, v) for who, op, v in results(doc) if who in backend_keys(doc) and v[metric] is not None]
    ops = list(dict.fromkeys(op for _, op, _ in rows))
    keys = backend_keys(doc)
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        values = {op: v[metric] for who, op, v in rows if who == key}
        xs = [j + i * width for j, op in enumerate(ops) if op in values]
        ax.bar(xs, [values[op] for op in ops if op in values], width, label=key)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(ops))])
    ax.set_xticklabels(ops, rotation=30, ha="right", fontsize=8)


def _sweep(ax, doc: dict, metric: str) -> None:
    for key, points in doc["compare_sm"].items():
        for op in ("dispatch", "dispatch_cached", "combine"):
            xs = [p["num_sms"] for p in points if p[op] is not None]
            ax.plot(xs, [p[op][metric] for p in points if p[op] is not None], marker="o", label=f"{key} {op}")
    ax.set_xlabel("SMs (Buffer.set_num_sms)")


def plot(doc: dict, path: str) -> None:
    """Write the chart of `doc` (a `report.build` document) to `path`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(13, 5))
    for ax, (metric, title) in zip(axes, METRICS):
        (_sweep if "compare_sm" in doc else _bars)(ax, doc, metric)
        _reference_lines(ax, doc, metric)
        ax.set_title(title)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"tokenyard.tools.bench: {doc['device']}, hidden {doc['hidden']}, {doc['num_tokens']} tokens, "
                 f"{doc['num_experts']} experts, top-{doc['num_topk']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
