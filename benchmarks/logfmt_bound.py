"""How far DeepEP's LogFMT-10 low-latency combine lands from tokenyard's, which ignores `use_logfmt` (issue 27).

tokenyard's low-latency combine sends bf16 rows whatever `use_logfmt` says, so its result is the exact combine
(docs/semantics.md). DeepEP's, with `use_logfmt=True`, sends each expert's row in LogFMT-10 and decodes it before
the weighted sum. This measures the difference on random expert outputs, on the CPU, with the format as DeepEP's
kernels define it (internode_ll.cu, `logfmt_encode` / `decode_and_accumulate`), written here in torch:

- per 128 channels of a row, amax and amin of |x|; log_amax = log2(amax), log_amin = max(log2(amin), log_amax - 32);
- the group is encoded only if log_amax < 0 (amax < 1) and log_amin < log_amax, else it travels as bf16;
- step = (log_amax - log_amin) / 510; a value's 9-bit code is floor(max((log2|x| - log_amin) / step + 2 -
  log2((1 + 2^step) / 2) / step, 0)) (0: zero; the offset rounds at the midpoint of two levels in the linear
  domain), plus its sign; it decodes to 2^((code - 1) * step + log_amin).

DeepEP's kernels take log2 and exp2 with the GPU's approximate instructions; this uses float32 torch.log2 and
torch.exp2, so single values may round to the neighbouring level, which the bound below covers. The bound per
value: levels a ratio r = 2^step apart, rounded at their linear midpoint, err at most (r - 1) / (r + 1) of the
value, r <= 2^(32/510), i.e. 2.17%, plus zero for values below amax * 2^-32.

    python benchmarks/logfmt_bound.py --json OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

GROUP, LEVELS, CLIP = 128, 1 << 9, 32.0


def logfmt_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """float32 values of bf16 `rows` [N, H] (H a multiple of 128) after LogFMT-10 encoding and decoding."""
    x = rows.float().view(rows.size(0), -1, GROUP)
    magnitude = x.abs()
    amax, amin = magnitude.amax(2, keepdim=True), magnitude.amin(2, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - CLIP)
    cast = (log_amax < 0) & (log_amin < log_amax)
    step = (log_amax - log_amin) / (LEVELS - 2)
    step = torch.where(cast, step, torch.ones_like(step))  # groups sent as bf16 need none
    offset = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    code = torch.floor(torch.clamp((torch.log2(magnitude) - log_amin) / step + offset, min=0.0))
    decoded = torch.where(code == 0, torch.zeros_like(x), torch.exp2((code - 1) * step + log_amin))
    decoded = torch.where(torch.signbit(x), -decoded, decoded)
    return torch.where(cast, decoded, x).view(rows.shape)


def _case(seed: int, scale: float, num_tokens: int, hidden: int, num_topk: int) -> dict:
    """Expert outputs N(0, scale^2) in bf16; the combine of `num_topk` of them with random softmax weights, as
    DeepEP sums them (float32 products and sums of decoded rows, then bf16) and exactly."""
    generator = torch.Generator().manual_seed(seed)
    rows = (torch.randn(num_tokens * num_topk, hidden, generator=generator) * scale).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(num_tokens, num_topk, generator=generator), 1)
    decoded = logfmt_round_trip(rows)
    value_error = (decoded - rows.float()).abs()
    nonzero = rows.float() != 0
    relative = (value_error[nonzero] / rows.float().abs()[nonzero])
    groups = rows.float().view(-1, hidden // GROUP, GROUP).abs()
    cast = ((groups.amax(2) < 1) & (groups.amin(2) < groups.amax(2))).float().mean().item()

    def combine(values):
        values = values.view(num_tokens, num_topk, hidden)
        return (values * weights.unsqueeze(2)).sum(1).to(torch.bfloat16).float()

    exact, logfmt = combine(rows.float()), combine(decoded)
    scale_of_token = exact.abs().amax(1, keepdim=True)
    bf16_ulp = torch.finfo(torch.bfloat16).eps
    return {"seed": seed, "expert_output_std": scale, "groups_encoded": round(cast, 4),
            "value_relative_error_max": relative.max().item(),
            "value_relative_error_mean": relative.mean().item(),
            "combined_error_max_over_token_amax": ((logfmt - exact).abs() / scale_of_token).max().item(),
            "combined_elements_differing": (logfmt != exact).float().mean().item(),
            "bf16_relative_spacing": bf16_ulp}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num_topk", type=int, default=8)
    parser.add_argument("--scales", type=float, nargs="*", default=[0.01, 0.05, 0.2, 0.5, 2.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    bound = (2 ** (CLIP / (LEVELS - 2)) - 1) / (2 ** (CLIP / (LEVELS - 2)) + 1)
    cases = [_case(seed, scale, args.num_tokens, args.hidden, args.num_topk)
             for scale in args.scales for seed in range(args.seeds)]
    print(f"per-value bound (r - 1) / (r + 1), r = 2^(32/510): {bound:.4%}")
    print("| expert output std | groups encoded | value error max | value error mean | combined error max "
          "(of the token's amax) | combined elements differing |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for scale in args.scales:
        mine = [c for c in cases if c["expert_output_std"] == scale]
        print(f"| {scale} | {min(c['groups_encoded'] for c in mine):.1%} | "
              f"{max(c['value_relative_error_max'] for c in mine):.3%} | "
              f"{max(c['value_relative_error_mean'] for c in mine):.3%} | "
              f"{max(c['combined_error_max_over_token_amax'] for c in mine):.3%} | "
              f"{max(c['combined_elements_differing'] for c in mine):.1%} |")
    if args.json:
        from tokenyard.tools.bench.report import git_commit

        result = {"commit": git_commit(), "device": "cpu",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "settings": {k: v for k, v in vars(args).items() if k != "json"},
                  "per_value_bound": bound, "cases": cases}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
