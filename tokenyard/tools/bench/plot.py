"""Draw the results as a PNG a person can read: one panel per mode, like against like (NOTE [summary table]).

Normal mode and low latency each get a panel of grouped bars, one group per operation of the summary: the main
backend's kernel time beside NCCL's all_to_all_single kernel for the same bytes (on CPU ranks: calls back to
back, beside gloo's), and the time the copy limit allows drawn as a marker. In compare_sm mode the panel is a line
chart instead: each normal-mode kernel's NVLink GB/s against the SM count (V1's and V2's dispatches), with NCCL's
and the copy limit's rates as horizontal lines.
"""

from __future__ import annotations

from . import BenchError
from .report import KERNEL_SUFFIX, on_gpus, main_key, summary

FONT = 10


def require_matplotlib() -> None:
    """Raises `BenchError` with the fix where matplotlib is missing (checked before any rank starts)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or tokenyard[plot])") from None


def _bars(ax, doc: dict, rows: list, title: str) -> None:
    gpu = on_gpus(doc)
    timed = "kernel_us" if gpu else "call_us"
    rows = [r for r in rows if r[timed] is not None]
    labels = [r["operation"].replace("low-latency ", "").replace(", cached handle", "\n(cached)") for r in rows]
    xs = range(len(rows))
    paired = any(r["all_to_all_us"] is not None for r in rows)  # bars side by side; else one centred bar each
    width = 0.38 if paired else 0.5
    ours = [x - width / 2 if paired else x for x in xs]
    ax.bar(ours, [r[timed] for r in rows], width, color="tab:blue",
           label=f"{main_key(doc)} ({'kernel' if gpu else 'calls back to back'})")
    if paired:
        baseline = [(x + width / 2, r["all_to_all_us"]) for x, r in zip(xs, rows) if r["all_to_all_us"] is not None]
        ax.bar([x for x, _ in baseline], [v for _, v in baseline], width, color="tab:gray",
               label=f"{doc['nccl']['backend']} all_to_all_single ({'kernel' if gpu else 'calls back to back'})")
    limits = [(x, r["limit_us"]) for x, r in zip(ours, rows) if r["limit_us"] is not None]
    if limits:
        ax.scatter([x for x, _ in limits], [v for _, v in limits], marker="_", s=900, linewidths=3, color="red",
                   zorder=3, label="copy limit: time for the same NVLink bytes")
    ax.set_ylim(0, 1.3 * max([r[timed] for r in rows] + [r["all_to_all_us"] or 0 for r in rows] +
                             [v for _, v in limits]))
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=FONT)
    ax.set_ylabel("us (lower is faster)", fontsize=FONT)
    ax.set_title(title, fontsize=FONT + 1)
    ax.legend(fontsize=FONT - 1, loc="upper left")


def _sweep(ax, doc: dict) -> None:
    key = main_key(doc)
    for op, name in (("dispatch_cached", "cached dispatch"), ("dispatch", "dispatch"), ("combine", "combine"),
                     ("v2_dispatch", "V2 dispatch"), ("v2_expand_dispatch", "V2 expanded dispatch")):
        points = [(p["num_sms"], p.get(op + KERNEL_SUFFIX) or p.get(op)) for p in doc["compare_sm"].get(key, [])]
        points = [(n, e["nvlink_gbps"]) for n, e in points if e is not None and e["nvlink_gbps"] is not None]
        if points:
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=f"{key} {name}")
    for op, style in (("dispatch", "--"), ("combine", ":")):
        entry = doc["nccl"].get(op + KERNEL_SUFFIX) or doc["nccl"].get(op)
        if entry is not None and entry["nvlink_gbps"] is not None:
            ax.axhline(entry["nvlink_gbps"], color="gray", linestyle=style, label=f"NCCL all_to_all_single {op}")
    if doc["copy_limit_gbps"] is not None:
        ax.axhline(doc["copy_limit_gbps"], color="red", label="copy limit")
    ax.set_xlabel("SMs (Buffer.set_num_sms)", fontsize=FONT)
    ax.set_ylabel("NVLink GB/s per GPU (kernel time)" if on_gpus(doc) else "GB/s between ranks", fontsize=FONT)
    ax.set_title("normal mode against the SM count", fontsize=FONT + 1)
    ax.legend(fontsize=FONT - 1)


def plot(doc: dict, path: str) -> None:
    """Write the chart of `doc` (a `report.build` document) to `path`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(doc)
    normal = [r for r in rows if not r["op"].startswith("ll_") and r["op"] != "layout"]
    low_latency = [r for r in rows if r["op"].startswith("ll_")]
    panels = (["sweep"] if "compare_sm" in doc else []) + (["normal"] if normal else []) + \
        (["low_latency"] if low_latency else [])
    widths = [3 if p == "normal" else 2 if p == "sweep" else 1.3 for p in panels] or [1]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * sum(widths), 5.2),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "sweep":
            _sweep(ax, doc)
        elif panel == "normal":
            _bars(ax, doc, normal, f"normal mode, {doc['num_tokens']} tokens per rank")
        else:
            _bars(ax, doc, low_latency, f"low latency, {doc['num_tokens_low_latency']} tokens per rank")
    where = doc["device"] if on_gpus(doc) else f"{doc['device']}: CPU times, not GPU figures"
    fig.suptitle(f"tokenyard.tools.bench on {where}; hidden {doc['hidden']}, {doc['num_experts']} experts, "
                 f"top-{doc['num_topk']}, {doc['dtype']} dispatch", fontsize=FONT + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
