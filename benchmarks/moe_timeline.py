"""The kernel timeline of one traced MoE layer step (issue 52; benchmarks/results/moe_step.md): every kernel's start
and length on rank 0 and its kind (NOTE [step breakdown] in tokenyard/tools/bench/moe_trace.py), to see what each
communication kernel ran beside or waited for. GPU only.

    python benchmarks/moe_timeline.py [--variant tokenyard_overlap|tokenyard|all_to_all|gemm_only]
                                      [--step train|decode] [moe_step options]

The step's options are benchmarks/moe_step.py's (say ``--num_ranks 1 --num_experts 64`` for one GPU holding a
4-rank rank's 64 experts); three untimed steps run before the traced one. Decode steps replay their CUDA graphs,
as the record times them (moe_step.capture_decode; the all-to-all runs eagerly).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

import torch  # noqa: E402

from tokenyard.tools import launch  # noqa: E402
from tokenyard.tools.bench import moe_step, moe_trace  # noqa: E402

WARMUP_STEPS = 3


def rank_timeline(variant: str, step: str, step_argv: list) -> str:
    """One `step` of `variant` traced on this rank: a line per kernel, ``start length kind name`` (µs from the
    first kernel's start)."""
    device = torch.device("cuda", torch.cuda.current_device())
    settings = moe_step.parse(step_argv, torch.cuda.device_count())
    rank = moe_step.Rank(step, settings.shapes[step], settings, device)
    calls = dict(rank.variants())
    if step == "train" and variant == "gemm_only":
        calls["gemm_only"] = rank.gemm_only(*rank.train_reference()[2])
    if step == "decode":  # captured as moe_step.run_step does, the GEMMs alone among them
        calls["gemm_only"] = rank.gemm_only(rank.decode_layer(rank.reference, "reference")[2][0], None)
        moe_step.capture_decode(calls)
    call = calls[variant]
    for _ in range(WARMUP_STEPS):
        call()
    kernels = sorted(moe_trace.traced_kernels(call, device), key=lambda k: k[1])
    rank.destroy()
    t0 = kernels[0][1]
    return "\n".join(f"{start - t0:9.1f} {end - start:8.1f} {moe_trace.kind_of(name):9s} {name.split('(')[0][-70:]}"
                     for name, start, end in kernels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="tokenyard_overlap",
                        choices=["tokenyard_overlap", "tokenyard", "all_to_all", "gemm_only"])
    parser.add_argument("--step", default="train", choices=["train", "decode"])
    args, step_argv = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("moe_timeline.py traces GPU kernels: run it where there is a GPU")
        return 1
    step_argv += ["--step", args.step]
    settings = moe_step.parse(step_argv, torch.cuda.device_count())
    lines = launch.run_on_ranks(settings.num_ranks, rank_timeline, args.variant, args.step, step_argv,
                                use_cuda=True)[0]
    print(f"   start µs  length µs kind  kernel (rank 0, one traced {args.step} step)")
    print(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
