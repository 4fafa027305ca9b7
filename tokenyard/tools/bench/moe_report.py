"""The MoE step benchmark's record for a person (tokenyard/tools/bench/moe_step.py): its table, and its plot, four
bars per step (the GEMMs alone, tokenyard in sequence and overlapped, the all-to-all dispatcher)."""

from __future__ import annotations

VARIANTS = ("gemm_only", "tokenyard", "tokenyard_overlap", "all_to_all")
LABELS = {"gemm_only": "GEMMs alone", "tokenyard": "tokenyard", "tokenyard_overlap": "tokenyard, overlapped\n"
          "(per micro-batch)", "all_to_all": "all-to-all\ndispatcher"}


def print_table(doc: dict) -> None:
    """Each step's times, the GEMMs' slowdown beside the communication, and the floors."""
    print(f"MoE layer step on {doc['device']}, {doc['num_ranks']} ranks, seed {doc['seed']}")
    if doc["overlap"]:
        print(f"note: {doc['overlap']}")
    for step in ("train", "decode"):
        if step not in doc:
            continue
        r, c = doc[step], doc[step]["counts"]
        print(f"{step} {doc['settings'][step]} gemm: {r['gemm']}; checked: {len(r['checks'])} "
              f"({', '.join(r['checks'])})")
        for name in VARIANTS:
            per = f" per micro-batch, {r['micro_batches']} in flight" if name == "tokenyard_overlap" else ""
            print(f"  {name:<18} {r[name + '_us']:12.1f} us{per}")
        if r["gemm_slowdown_by_num_sms"]:
            alone = r.get("communication_us_by_num_sms") or {}
            cells = []
            for n, v in r["gemm_slowdown_by_num_sms"].items():
                where = f"{n} SMs" if str(n).isdigit() else {"low_latency": "the low-latency kernels' SMs",
                                                             "copy_engines": "copy engines (0 SMs)"}[n]
                cells.append(f"{100 * v:+.1f}% at {where}" + (f" ({alone[n]:.1f} us)" if n in alone else ""))
            print("  GEMMs beside the communication (its calls alone): " + ", ".join(cells))
            if "copy_engines" in alone:  # moe_step.Rank.copy_engine_communication
                print(f"  copy engines alone: {r['copy_engine_bytes'] / 1e6:.1f} MB to peers a call, "
                      f"{r['copy_engine_bytes'] / alone['copy_engines'] / 1e3:.0f} GB/s")
        for name, parts in (r.get("breakdown") or {}).items():  # NOTE [step breakdown] in moe_trace.py
            if parts:
                print(f"  {name} traced (us): " + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in parts.items()))
        print(f"  floors: HBM {c['hbm_floor_us']:.1f} us ({c['hbm_bytes'] / 1e6:.1f} MB), tensor core "
              f"{c['tensor_core_floor_us']:.1f} us ({c['flop'] / 1e9:.2f} GFLOP) [{c['floors_from']}]")


def plot(doc: dict, path: str) -> None:
    """One panel per step: the four variants' times, the GEMMs' floor at HBM speed as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step in ("train", "decode") if step in doc]
    fig, axes = plt.subplots(1, len(steps), figsize=(5.5 * len(steps), 4.2), squeeze=False)
    for ax, step in zip(axes[0], steps):
        r = doc[step]
        times = [r[f"{name}_us"] / (1000 if step == "train" else 1) for name in VARIANTS]
        unit = "ms" if step == "train" else "µs"
        ax.bar(range(len(VARIANTS)), times, color=["tab:gray", "tab:blue", "tab:cyan", "tab:orange"])
        ax.set_xticks(range(len(VARIANTS)), [LABELS[name] for name in VARIANTS], fontsize=8)
        for x, t in enumerate(times):
            ax.text(x, t, f"{t:.1f}" if step == "train" else f"{t:.0f}", ha="center", va="bottom", fontsize=8)
        floor = r["counts"]["hbm_floor_us"] / (1000 if step == "train" else 1)
        sheet = r["counts"]["floors_from"].split(":")[0]
        ax.axhline(floor, color="black", linestyle=":", linewidth=1, label=f"HBM floor ({sheet})")
        ax.set_ylabel(f"step time, {unit}")
        shape = doc["settings"][step]
        ax.set_title(f"{step}: {shape['num_tokens']} tokens/rank, top-{shape['num_topk']} of "
                     f"{shape['num_experts']}", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"DeepSeek-V3 MoE layer step, {doc['num_ranks']} ranks, {doc['device']} ({doc['commit']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
