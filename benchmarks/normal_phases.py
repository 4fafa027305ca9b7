"""Where the normal-mode kernels' warps spend their time: NOTE [normal-mode phases] of a cached dispatch and a combine.

    python benchmarks/normal_phases.py [--num_ranks 2] [--sm_counts 8,24] [--iters 20] [--elastic] [--json OUT.json]

For each SM count, every warp of `iters` cached dispatches and combines (DeepSeek-V3 setting, FP8 dispatch, ranks
started together after a barrier) adds the SM cycles of each phase of its work (include/tokenyard/phases.cuh);
with --elastic the calls are ElasticBuffer's expanded ones (its cached dispatch and combine of a handle made with
do_expand at each SM count: NOTE [expanded rows] in kernels/dispatch.cuh, NOTE [expanded sums] where a branch has it);
this prints, per kernel and role (sending warps; receiving or reducing ones), the mean microseconds per call a
warp spent in each phase, its span, and the kernel's span. A diagnostic for issue 50: what it found is in
benchmarks/results/normal_tuning.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu import spawn  # noqa: E402  (sets the NVLink-multicast-off variables first)

import profile_normal  # noqa: E402  (beside this file: the same Buffer, inputs and first dispatch)

KINDS = ("dispatch", "combine")


def summarize(phases, num_blocks: int, send_warps: int, iters: int) -> dict:
    """One kernel's slots [blocks, warps, kNumPhaseSlots] (summed over `iters` calls) -> {role: {phase: µs per
    call}}, each a mean over the role's warps of the first `num_blocks` blocks."""
    from tokenyard.backends.cuda import kernels

    names = {v: k[len("kPhase"):].lower() for k, v in kernels.PHASES.items()
             if k.startswith("kPhase") and v < kernels.PHASES["kNumPhases"]}
    span_ns, span_cycles = kernels.PHASES["kPhaseSpanNs"], kernels.PHASES["kPhaseSpanCycles"]
    out = {}
    for role, warps in (("send", range(send_warps)), ("other", range(send_warps, phases.shape[1]))):
        per_warp = [phases[b, w] for b in range(num_blocks) for w in warps]
        per_warp = [slots for slots in per_warp if int(slots[span_cycles]) > 0]
        if not per_warp:
            continue
        sums = {name: 0.0 for name in names.values()}
        span = 0.0
        for slots in per_warp:
            ns_per_cycle = int(slots[span_ns]) / int(slots[span_cycles])
            for index, name in names.items():
                sums[name] += int(slots[index]) * ns_per_cycle
            span += int(slots[span_ns])
        out[role] = {name: value / len(per_warp) / iters / 1e3 for name, value in sums.items()}
        out[role]["span"] = span / len(per_warp) / iters / 1e3
        out[role]["warps"] = len(per_warp)
    return out


def _elastic_calls(num_tokens: int, x, topk_idx, weights):
    """ElasticBuffer's expanded cached dispatch and combine at `num_sms` SMs: -> calls(num_sms) -> (dispatch,
    combine), the handle made by a fresh expanded dispatch there (expert alignment 128)."""
    import torch
    import torch.distributed as dist

    from tokenyard import ElasticBuffer

    hidden, num_topk = profile_normal.HIDDEN, profile_normal.NUM_TOPK
    elastic = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk,
                            backend="cuda", check_inputs=False)

    def calls(num_sms: int):
        recv_x, _, _, handle, _ = elastic.dispatch(x, topk_idx, weights, num_experts=profile_normal.NUM_EXPERTS,
                                                   num_sms=num_sms, expert_alignment=128, do_expand=True)
        rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        y = torch.randn(rows.size(0), hidden, device=rows.device).to(torch.bfloat16)
        return (lambda: elastic.dispatch(x, handle=handle, do_expand=True), lambda: elastic.combine(y, handle))

    return elastic, calls


def rank_main(sm_counts, iters: int, num_tokens: int, elastic: bool = False):
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer
    from tokenyard.backends.cuda import heuristics, kernels

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if elastic:
        x, topk_idx, weights = profile_normal.deepseek_inputs(num_tokens)
        buffer, elastic_calls = _elastic_calls(num_tokens, x, topk_idx, weights)
    else:
        buffer, x, topk_idx, weights = profile_normal.deepseek_buffer(num_tokens)
    backend = buffer.buffer.runtime if elastic else buffer.runtime
    block_warps = {"dispatch": heuristics.dispatch_threads(num_ranks) // 32,
                   "combine": heuristics.combine_threads(num_ranks) // 32}
    send_warps = {"dispatch": heuristics.dispatch_send_warps(block_warps["dispatch"]),
                  "combine": heuristics.combine_send_warps(block_warps["combine"], num_ranks)}
    report = {}
    for num_sms in sm_counts:
        Buffer.set_num_sms(num_sms)
        if elastic:
            dispatch, combine = elastic_calls(num_sms)
        else:
            handle, y = profile_normal.first_dispatch(buffer, x, topk_idx, weights)
            dispatch, combine = (lambda h=handle: buffer.dispatch(x, handle=h)), (lambda h=handle, y=y:
                                                                                  buffer.combine(y, h))
        phases = backend.start_normal_phases()
        for _ in range(3):  # warm: the plans with the phases' address built, the kernels loaded
            dispatch()
            combine()
        torch.cuda.synchronize()
        phases.zero_()
        torch.cuda.synchronize()
        for _ in range(iters):
            dist.barrier()
            dispatch()
            torch.cuda.synchronize()
            dist.barrier()
            combine()
            torch.cuda.synchronize()
        slots = phases.cpu()
        num_blocks = heuristics.data_blocks(num_sms, backend.device_sms)
        num_slots = kernels.PHASES["kNumPhaseSlots"]
        report[num_sms] = {kind: summarize(slots[i, :backend.device_sms * block_warps[kind] * num_slots].view(
                               backend.device_sms, block_warps[kind], num_slots), num_blocks, send_warps[kind], iters)
                           for i, kind in enumerate(KINDS)}
    backend.normal_phases = None
    buffer.destroy()
    return {"rank": rank, "commit": os.environ.get("TOKENYARD_COMMIT"), "tuning": os.environ.get("TOKENYARD_TUNING"),
            "elastic": elastic, "send_warps": send_warps, "phases": report}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--sm_counts", default="8,24")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--num_tokens", type=int, default=4096)
    parser.add_argument("--elastic", action="store_true", help="ElasticBuffer's expanded cached dispatch and combine")
    parser.add_argument("--json")
    args = parser.parse_args()
    sm_counts = [int(n) for n in args.sm_counts.split(",")]
    reports = spawn.run(args.num_ranks, rank_main, sm_counts, args.iters, args.num_tokens, args.elastic)
    for report in reports[:1]:
        print(f"TOKENYARD_TUNING={report['tuning'] or ''} (commit {report['commit']})")
        for num_sms, kinds in report["phases"].items():
            for kind, roles in kinds.items():
                for role, values in roles.items():
                    cells = " ".join(f"{name} {value:.1f}" for name, value in values.items()
                                     if name not in ("span", "warps") and value >= 0.05)
                    print(f"rank {report['rank']}, {num_sms} SMs, {kind}, {values['warps']} {role} warps: span "
                          f"{values['span']:.1f} µs per call = {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
