"""Bounded buffers: dispatch and combine of growing token counts through a fixed `num_nvl_bytes` budget.

    python benchmarks/bounded.py [--json OUT.json] [--num_tokens 4096,8192,16384,32768]
                                 [--budget_bytes 1073741824]

One rank per GPU (4 by default), hidden 7168, top-8 of 256 experts, FP8 dispatch and bf16 combine: each
token count runs on a Buffer of `--budget_bytes` (calls that need more run in rounds, NOTE [rounds] in
tokenyard/rounds.py), and 4096 tokens also run on a Buffer sized by the hint (the unbounded path). Without
GPUs it runs a small problem on gloo ranks through the reference backend (a check that it works, not a
measurement).

Timing is tokenyard.tools.bench's: `Timer.medians` (L2 flush and a barrier before every call, CUDA events,
median of `--iters`); "dispatch" is get_dispatch_layout plus dispatch, as in `python -m tokenyard.tools.bench`;
the expert output combined is the received rows as bf16. Bandwidth is tokenyard.tools.bench.bandwidth's NVLink
GB/s (bytes crossing between GPUs over the time of the slowest rank). peak_bytes is the largest over the
ranks of torch.cuda.max_memory_allocated during the timed calls (the inputs, the expert output, the
outputs and the calls' temporaries; the timer's L2-flush scratch left out) plus num_nvl_bytes (the CUDA
backend's buffer is allocated outside PyTorch); None on CPU.

JSON: commit, device, date, budget_bytes, settings, runs (one per token count: num_tokens, num_rounds,
round_tokens, dispatch_us, combine_us, dispatch_nvlink_gbps, combine_nvlink_gbps, peak_bytes, num_nvl_bytes),
unbounded_4096 (the same figures for the hint-sized Buffer, at --unbounded_tokens, measured before the
runs) and unbounded_4096_measured_last (the same again after them). A markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import secrets
import datetime
import json
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU_DEFAULTS = dict(num_ranks=4, hidden=7168, num_experts=256, num_topk=8, num_tokens=(4096, 8192, 16384, 32768),
                    budget_bytes=1 << 30, unbounded_tokens=4096, iters=30, warmup=5)
# On CPU the budget holds CPU_ROUND_TOKENS tokens of the combine's rows per round, for any number of ranks (2
# ranks: 545792 bytes): 24 tokens run in one round, 96 in two.
CPU_ROUND_TOKENS = 68
CPU_DEFAULTS = dict(num_ranks=2, hidden=256, num_experts=16, num_topk=4, num_tokens=(24, 96), budget_bytes=None,
                    unbounded_tokens=24, iters=3, warmup=1)
FIGURES = ("dispatch_us", "combine_us", "dispatch_nvlink_gbps", "combine_nvlink_gbps")


def _int_list(text: str):
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse(argv: Optional[List[str]], gpu: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/bounded.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--num_tokens", type=_int_list, help="tokens per rank, comma-separated")
    parser.add_argument("--budget_bytes", type=int,
                        help="num_nvl_bytes of the bounded Buffer (GPU: 1 GiB; CPU: room for 68 tokens per round)")
    parser.add_argument("--unbounded_tokens", type=int, help="tokens per rank of the hint-sized run (GPU: 4096)")
    parser.add_argument("--per_round_tokens", type=int, help="Buffer(per_round_tokens=...) of the bounded runs")
    parser.add_argument("--num_ranks", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--num_experts", type=int)
    parser.add_argument("--num_topk", type=int)
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--iters", type=int, help="timed calls per operation (at least 20 on GPU)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--num_sms", type=int, default=24)
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "cuda"))
    parser.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: random, recorded)")
    parser.add_argument("--timeout_s", type=float, default=540.0)
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = secrets.randbelow(1 << 30)
    defaults = GPU_DEFAULTS if gpu else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if gpu and args.iters < 20:
        parser.error("--iters must be at least 20 on GPUs")
    if args.budget_bytes is None:
        from tokenyard.plan import workspace

        args.budget_bytes = workspace.normal_required_bytes(
            args.num_ranks, CPU_ROUND_TOKENS, workspace.normal_combine_row_bytes(args.hidden, args.num_topk))
    args.gpu = gpu
    return args


# ------------------------------------------------------------------------------------------------------
# on every rank
# ------------------------------------------------------------------------------------------------------

def _problem(args, rank: int, num_ranks: int, num_tokens: int, device, group):
    """This rank's inputs (made on its device) and every rank's send counts ``counts[s][d]``."""
    import torch

    from tokenyard import quantize_fp8
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_topk_idx, make_topk_weights

    generator = torch.Generator().manual_seed(args.seed * 1009 + rank + 7919 * num_tokens)
    topk_idx = make_topk_idx(num_tokens, args.num_experts, args.num_topk, num_ranks, "uniform", generator, rank)
    topk_weights = make_topk_weights(topk_idx, generator)
    device_generator = torch.Generator(device=device).manual_seed(args.seed * 1009 + rank)
    x = (torch.randn(num_tokens, args.hidden, device=device, generator=device_generator) * 2).to(torch.bfloat16)
    if args.dtype == "fp8":
        x = quantize_fp8(x)
    topk_idx, topk_weights = topk_idx.to(device), topk_weights.to(device)
    per_rank = routing.dispatch_layout(topk_idx, args.num_experts, num_ranks)[0]
    gathered = [torch.empty_like(per_rank) for _ in range(num_ranks)]
    torch.distributed.all_gather(gathered, per_rank, group=group)
    return x, topk_idx, topk_weights, [g.tolist() for g in gathered]


def _measure(args, ctx, num_tokens: int, num_nvl_bytes: int, per_round_tokens: Optional[int]) -> dict:
    """One configuration on this rank: bandwidth samples of dispatch and combine, rounds, peak memory."""
    import torch

    from tokenyard import Buffer, dequantize_fp8
    from tokenyard.tools.bench import bandwidth, timing

    rank, num_ranks, group, device, timer = ctx
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.empty_cache()
    x, topk_idx, topk_weights, counts = _problem(args, rank, num_ranks, num_tokens, device, group)
    buffer = Buffer(group, num_nvl_bytes, 0, backend=args.backend, check_inputs=False,
                    per_round_tokens=per_round_tokens)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.num_experts)
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    recv_x, _, _, _, handle, _ = dispatch()
    expert_output = dequantize_fp8(*recv_x).to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x
    del recv_x
    if gpu:  # the peak of the timed calls: inputs, outputs and temporaries alive while they run
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t_dispatch, t_combine = timer.medians([dispatch, lambda: buffer.combine(expert_output, handle)], args.iters,
                                          args.warmup)
    row = bandwidth.row_bytes(args.hidden, fp8=args.dtype == "fp8")
    peak = None
    if gpu:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - timing.L2_FLUSH_BYTES + buffer.nvl_bytes_held
    out = {"dispatch": (t_dispatch, *bandwidth.normal_dispatch_bytes(counts, rank, row)),
           "combine": (t_combine, *bandwidth.normal_combine_bytes(counts, rank, args.hidden)),
           "num_rounds": handle.rounds.num_rounds, "round_tokens": handle.rounds.round_tokens, "peak_bytes": peak,
           "num_nvl_bytes": buffer.nvl_bytes_held, "backend": buffer.backend}
    buffer.destroy()
    return out


def _rank_samples(args) -> Optional[List[dict]]:
    """This rank's measurements, gathered: every rank's on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.tools.bench.timing import Timer

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    Buffer.set_num_sms(args.num_sms)
    group = dist.group.WORLD
    ctx = (rank, args.num_ranks, group, device, Timer(group, device))
    samples = {"device": torch.cuda.get_device_name(device) if args.gpu else "cpu", "runs": []}
    hint = Config(num_max_tokens_per_rank=args.unbounded_tokens).get_nvl_buffer_size_hint(args.hidden * 2,
                                                                                         args.num_ranks)
    # The hint-sized run comes first and again last: at a31a4f0 it ran only last, slower than the same single
    # round through the 1 GiB buffer, so the order is measured too.
    samples["unbounded"] = (args.unbounded_tokens, _measure(args, ctx, args.unbounded_tokens, hint, None))
    for num_tokens in args.num_tokens:
        samples["runs"].append((num_tokens, _measure(args, ctx, num_tokens, args.budget_bytes, args.per_round_tokens)))
    samples["unbounded_last"] = (args.unbounded_tokens, _measure(args, ctx, args.unbounded_tokens, hint, None))
    gathered = [None] * args.num_ranks
    dist.all_gather_object(gathered, samples, group=group)
    return gathered if rank == 0 else None


def run_ranks(args) -> List[dict]:
    """Every rank's samples (rank 0's report); raises RuntimeError with the failing ranks' tracebacks."""
    from tokenyard.tools.launch import run_on_ranks

    return run_on_ranks(args.num_ranks, _rank_samples, args, use_cuda=args.gpu, timeout_s=args.timeout_s,
                        group_timeout_s=args.timeout_s)[0]


# ------------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------------

def _entry(num_tokens: int, per_rank: List[dict]) -> dict:
    """One configuration's figures from every rank's samples (the slowest rank decides, bandwidth.py)."""
    from tokenyard.tools.bench import bandwidth

    dispatch = bandwidth.summarize([p["dispatch"] for p in per_rank])
    combine = bandwidth.summarize([p["combine"] for p in per_rank])
    peaks = [p["peak_bytes"] for p in per_rank]
    return {"num_tokens": num_tokens, "num_rounds": per_rank[0]["num_rounds"],
            "round_tokens": per_rank[0]["round_tokens"],
            "dispatch_us": dispatch["us"], "combine_us": combine["us"],
            "dispatch_nvlink_gbps": dispatch["nvlink_gbps"], "combine_nvlink_gbps": combine["nvlink_gbps"],
            "peak_bytes": None if None in peaks else max(peaks), "num_nvl_bytes": per_rank[0]["num_nvl_bytes"]}


def build(args, gathered: List[dict], commit: Optional[str], date: str) -> dict:
    first = gathered[0]
    runs = [_entry(num_tokens, [g["runs"][i][1] for g in gathered]) for i, (num_tokens, _) in enumerate(first["runs"])]
    unbounded_tokens = first["unbounded"][0]
    device = first["device"] if args.gpu else f"cpu ({args.num_ranks} gloo ranks)"
    settings = {name: getattr(args, name) for name in ("num_ranks", "hidden", "num_experts", "num_topk", "dtype",
                                                       "iters", "warmup", "num_sms", "seed", "per_round_tokens")}
    settings["backend"] = first["runs"][0][1]["backend"] if first["runs"] else first["unbounded"][1]["backend"]
    return {"commit": commit, "device": device, "date": date, "budget_bytes": args.budget_bytes,
            "settings": settings, "runs": runs,
            "unbounded_4096": _entry(unbounded_tokens, [g["unbounded"][1] for g in gathered]),
            "unbounded_4096_measured_last": _entry(unbounded_tokens, [g["unbounded_last"][1] for g in gathered])}


def markdown(doc: dict) -> str:
    """The runs and the unbounded run as a markdown table, with each bandwidth as a share of the unbounded."""
    base = doc["unbounded_4096"]
    lines = [f"{doc['device']}, {doc['settings']['backend']} backend; hidden {doc['settings']['hidden']}, "
             f"top-{doc['settings']['num_topk']} of {doc['settings']['num_experts']}, {doc['settings']['dtype']} "
             f"dispatch, bf16 combine; budget {doc['budget_bytes'] / 2**30:.3g} GiB per GPU",
             "",
             "| buffer | tokens/rank | rounds | dispatch µs | combine µs | dispatch GB/s | combine GB/s "
             "| vs unbounded (d / c) | peak GiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def row(name: str, e: dict) -> str:
        share = (f"{e['dispatch_nvlink_gbps'] / base['dispatch_nvlink_gbps']:.0%} / "
                 f"{e['combine_nvlink_gbps'] / base['combine_nvlink_gbps']:.0%}")
        peak = "-" if e["peak_bytes"] is None else f"{e['peak_bytes'] / 2**30:.2f}"
        return (f"| {name} | {e['num_tokens']} | {e['num_rounds']} | {e['dispatch_us']:.1f} | {e['combine_us']:.1f} "
                f"| {e['dispatch_nvlink_gbps']:.3g} | {e['combine_nvlink_gbps']:.3g} | {share} | {peak} |")

    lines += [row(f"{doc['budget_bytes'] / 2**30:.3g} GiB", e) for e in doc["runs"]]
    lines.append(row(f"hint ({base['num_nvl_bytes'] / 2**30:.3g} GiB), measured first", base))
    lines.append(row("hint, measured last", doc["unbounded_4096_measured_last"]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    from tokenyard.tools.bench.report import git_commit

    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    args = parse(argv, gpu)
    if gpu and torch.cuda.device_count() < args.num_ranks:
        print(f"bounded.py: {args.num_ranks} ranks need as many GPUs, this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        doc = build(args, run_ranks(args), git_commit(), date)
    except RuntimeError as exc:
        print(f"bounded.py: a rank failed:{exc}", file=sys.stderr)
        return 1
    print(markdown(doc), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
