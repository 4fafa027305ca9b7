"""The command line of ``python -m tokenyard.tools.bench`` and the settings it resolves to.

Every option has DeepEP's underscore spelling (``--num_tokens``) and a dashed alias (``--num-tokens``).
Options left out take machine-dependent defaults: a small problem on CPU gloo ranks, or DeepSeek-V3's
setting with one rank per GPU (`CPU_DEFAULTS`, `GPU_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from typing import Optional, Sequence, Tuple

from ...plan import workspace

MODES = ("normal", "low_latency", "compare_sm", "all", "moe")
BACKENDS = ("reference", "cuda")
DTYPES = ("fp8", "bf16")
MAX_TOPK = workspace.LOW_LATENCY_MAX_TOPK  # the benchmark runs low-latency calls too


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Problem and timing defaults of one kind of machine (None ranks: one per GPU)."""

    num_ranks: Optional[int]
    hidden_size: int
    num_tokens: int
    num_tokens_low_latency: int
    num_experts: int
    num_topk: int
    iters: int
    warmup: int


CPU_DEFAULTS = Defaults(num_ranks=4, hidden_size=1024, num_tokens=256, num_tokens_low_latency=32, num_experts=32,
                        num_topk=4, iters=5, warmup=1)
GPU_DEFAULTS = Defaults(num_ranks=None, hidden_size=7168, num_tokens=4096, num_tokens_low_latency=128,
                        num_experts=256, num_topk=8, iters=50, warmup=10)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """Everything one run needs, resolved and checked; sent to every rank."""

    mode: str
    hidden_size: int
    num_tokens: int
    num_tokens_low_latency: int
    num_experts: int
    num_topk: int
    num_ranks: int
    sm_counts: Tuple[int, ...]
    num_sms: int
    dtype: str
    backends: Optional[Tuple[str, ...]]  # None: every backend that runs on all ranks
    iters: int
    warmup: int
    seed: int
    timeout_s: float
    json: Optional[str]
    plot: Optional[str]
    quiet: bool
    gpu: bool
    bind: bool = False  # each rank binds to its GPU's NUMA node, cores and NIC (tokenyard.tools.affinity)
    verbose: bool = False  # print every measured row too (report.table), not only the summary

    def runs(self, part: str) -> bool:
        """Whether this run measures `part` (``normal``, ``low_latency`` or ``compare_sm``)."""
        if self.mode == "all":
            return part in ("normal", "low_latency")
        return part == self.mode


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _int_list(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _name_list(text: str) -> Tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"backends are a comma-separated subset of {','.join(BACKENDS)}, "
                                         f"got {text!r}")
    return names


COLUMNS_HELP = """what it prints: one row per operation (NOTE [summary table] in tokenyard/tools/bench/report.py):
  operation      layout, dispatch (layout and dispatch), a dispatch with a cached handle, combine, DeepEP V2's
                 dispatch and combine (ElasticBuffer), the low-latency dispatch and combine
  kernel us      GPU time of the operation's kernels, as DeepEP reports it (low latency: CUDA-graph replays)
  call us        one call in a run of calls back to back, host work included, as DeepEP's harness times them
                 (low latency: one call after a barrier)
  all-to-all us  the baseline moving the same bytes: NCCL's all_to_all_single kernel (CPU: gloo's calls)
  limit us       the time the copy limit (the fastest way found to write to every peer) needs for those bytes
  % of limit     the kernel's NVLink rate as a share of the copy limit's
  SMs            the SMs the normal-mode kernels ran on (--num_sms)
then one line that sums the run up. On CPU ranks only the call and all-to-all times print: they check that
everything runs and say nothing about GPUs. --verbose adds every measured row (each backend, the expanded V2
calls, every timing way, bandwidths); --json keeps them all."""


def build_parser(prog: str = "python -m tokenyard.tools.bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time tokenyard's dispatch and combine on every backend against an all-to-all baseline.",
        epilog=COLUMNS_HELP)

    def add(name: str, **kwargs) -> None:
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*spellings, dest=name, **kwargs)

    add("mode", choices=MODES, default="all", help="all = normal and low_latency (default); moe = a DeepSeek-V3 MoE "
                                                   "layer step (its own options: --mode moe --help)")
    add("hidden_size", type=_positive_int, help="hidden size (CPU 1024, GPU 7168)")
    add("num_tokens", type=_positive_int, help="tokens per rank in normal mode (CPU 256, GPU 4096)")
    add("num_tokens_low_latency", type=_positive_int,
        help="tokens per rank in low-latency mode (CPU 32, GPU 128, never above --num_tokens by default)")
    add("num_experts", type=_positive_int, help="total experts (CPU 32, GPU 256)")
    add("num_topk", type=_positive_int, help="experts per token (CPU 4, GPU 8)")
    add("num_ranks", type=_positive_int, help="ranks (CPU 4 processes, GPU one per GPU)")
    add("sm_counts", type=_int_list, default=(8, 16, 24), help="SM counts for --mode compare_sm (even)")
    add("num_sms", type=_positive_int, default=24, help="SMs of the CUDA kernels in normal mode (Buffer.set_num_sms)")
    add("dtype", choices=DTYPES, default="fp8", help="normal-mode dispatch dtype; fp8 also sets use_fp8 in "
                                                     "low-latency dispatch")
    add("backends", type=_name_list, help="comma-separated, of reference,cuda (default: every available)")
    add("iters", type=_positive_int, help="timed calls per operation (CPU 5, GPU 50)")
    add("warmup", type=int, help="untimed calls first (CPU 1, GPU 10)")
    add("seed", type=int, help="seed of the random inputs (default: random, recorded in the JSON)")
    add("timeout_s", type=float, default=600.0, help="give up on ranks after this many seconds")
    add("json", metavar="PATH", help="write the results as JSON")
    add("plot", metavar="PATH.png", help="draw bandwidth per op and backend (needs matplotlib)")
    add("quiet", action="store_true", help="no progress bar")
    add("verbose", action="store_true", help="also print every measured row: each backend, API, timing way and SM "
                                             "count (the JSON always holds them all)")
    add("model", action="store_true", help="print predicted internode times for a cluster instead, from a "
                                           "documented model of the bytes and the NIC's work requests per call "
                                           "(`--model --help` lists its arguments)")
    add("bind", action="store_true", help="bind each rank to the cores, NUMA memory and RDMA NIC of its GPU "
                                          "(tokenyard.tools.affinity.bind); the JSON records it under 'affinity'")
    return parser


def resolve(args: argparse.Namespace, num_gpus: int) -> BenchSettings:
    """Fill defaults for this machine (`num_gpus` > 0: GPU) and check the problem.

    Raises:
        ValueError: a setting no backend can run, with the reason.
    """
    gpu = num_gpus > 0
    defaults = GPU_DEFAULTS if gpu else CPU_DEFAULTS

    def pick(name: str):
        value = getattr(args, name)
        return getattr(defaults, name) if value is None else value

    num_ranks = args.num_ranks or defaults.num_ranks or num_gpus
    num_tokens = pick("num_tokens")
    settings = BenchSettings(
        mode=args.mode, hidden_size=pick("hidden_size"), num_tokens=num_tokens,
        num_tokens_low_latency=args.num_tokens_low_latency or min(defaults.num_tokens_low_latency, num_tokens),
        num_experts=pick("num_experts"), num_topk=pick("num_topk"), num_ranks=num_ranks,
        sm_counts=tuple(args.sm_counts), num_sms=args.num_sms, dtype=args.dtype, backends=args.backends, iters=pick("iters"),
        warmup=pick("warmup"), seed=secrets.randbelow(2**31) if args.seed is None else args.seed,
        timeout_s=args.timeout_s, json=args.json, plot=args.plot, quiet=args.quiet, gpu=gpu,
        bind=args.bind, verbose=args.verbose)
    check(settings, num_gpus)
    return settings


def dtype_name(dtype) -> str:
    """The dispatch dtype as the benchmark names it: ``torch.bfloat16`` -> "bf16", an FP8 dtype -> "fp8".

    Raises:
        ValueError: a dtype the benchmark does not dispatch.
    """
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    text = str(dtype)
    if text == "torch.bfloat16":
        return "bf16"
    if text.startswith("torch.float8_e4m3"):
        return "fp8"
    raise ValueError(f"dispatch dtype must be torch.bfloat16, torch.float8_e4m3fn, 'bf16' or 'fp8', got {dtype!r}")


def for_group(*, mode: str, hidden_size: int, num_tokens: int, num_experts: int, num_topk: int, num_ranks: int,
              gpu: bool, seed: int, dtype="bf16", num_tokens_low_latency: Optional[int] = None,
              sm_counts: Sequence[int] = (8, 16, 24), num_sms: int = 20,
              backends: Optional[Sequence[str]] = None, iters: Optional[int] = None, warmup: Optional[int] = None,
              quiet: bool = False) -> BenchSettings:
    """Settings of an in-process run (tokenyard.Benchmark, tokenyard.AutoTuner) on a group the caller made.

    Unset `iters` and `warmup` take this kind of machine's defaults, as on the command line.

    Raises:
        ValueError: a setting no backend can run, with the reason (as `check`).
    """
    defaults = GPU_DEFAULTS if gpu else CPU_DEFAULTS
    settings = BenchSettings(
        mode=mode, hidden_size=hidden_size, num_tokens=num_tokens,
        num_tokens_low_latency=num_tokens_low_latency or min(defaults.num_tokens_low_latency, num_tokens),
        num_experts=num_experts, num_topk=num_topk, num_ranks=num_ranks, sm_counts=tuple(sm_counts),
        num_sms=num_sms, dtype=dtype_name(dtype), backends=None if backends is None else tuple(backends),
        iters=defaults.iters if iters is None else iters, warmup=defaults.warmup if warmup is None else warmup,
        seed=seed, timeout_s=600.0, json=None, plot=None, quiet=quiet, gpu=gpu)
    if settings.iters <= 0:
        raise ValueError(f"iters must be positive, got {settings.iters}")
    if settings.backends is not None and (not settings.backends or set(settings.backends) - set(BACKENDS)):
        raise ValueError(f"backends are a non-empty subset of {BACKENDS}, got {settings.backends}")
    check(settings, num_gpus=num_ranks if gpu else 0)  # the group's ranks may span machines
    return settings


def check(s: BenchSettings, num_gpus: int) -> None:
    """Refuse, before any process starts, a problem that some call would refuse later."""
    del num_gpus  # more ranks than GPUs share them (tokenyard.tools.launch.init_rank): times only, no bandwidth
    problems = []
    if not s.gpu and s.backends and "cuda" in s.backends:
        problems.append("--backends cuda needs GPUs; this machine has none")
    if s.num_experts % s.num_ranks:
        problems.append(f"--num_experts {s.num_experts} is not divisible by --num_ranks {s.num_ranks}")
    if not 1 <= s.num_topk <= min(MAX_TOPK, s.num_experts):
        problems.append(f"--num_topk must be in [1, min({MAX_TOPK}, num_experts)], got {s.num_topk}")
    if s.dtype == "fp8" and s.hidden_size % 128:
        problems.append(f"FP8 needs --hidden_size % 128 == 0, got {s.hidden_size}")
    if s.hidden_size % 8:
        problems.append(f"bf16 rows must be a multiple of 16 bytes: --hidden_size % 8 == 0, got {s.hidden_size}")
    if s.num_sms % 2:
        problems.append(f"--num_sms must be even, got {s.num_sms}")
    if any(n <= 0 or n % 2 for n in s.sm_counts) or not s.sm_counts:
        problems.append(f"--sm_counts must be positive even numbers, got {s.sm_counts}")
    if s.warmup < 0:
        problems.append(f"--warmup must be >= 0, got {s.warmup}")
    if s.timeout_s <= 0:
        problems.append(f"--timeout_s must be positive, got {s.timeout_s}")
    if problems:
        raise ValueError("; ".join(problems))


def parse(argv: Optional[Sequence[str]], num_gpus: int, prog: str = "python -m tokenyard.tools.bench") -> BenchSettings:
    """Parse `argv` and resolve it; exits with usage (status 2, naming `prog`) on a bad setting."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return resolve(args, num_gpus)
    except ValueError as exc:
        parser.error(str(exc))
