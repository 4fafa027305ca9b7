"""The one table of environment variables tokenyard reads.

Settings go through the API first; these variables only override defaults. Each is declared once here
with its type and default, and read once (the first time `settings()` is called) so that a value cannot
change under a running program.

| variable                      | type  | default  | meaning                                                  |
|-------------------------------|-------|----------|----------------------------------------------------------|
| TOKENYARD_BACKEND             | str   | "auto"   | backend when `Buffer(backend=None)`: auto/reference/cuda |
| TOKENYARD_TIMEOUT_S           | float | 100.0    | deadline of every device-side and host-side wait         |
| TOKENYARD_CHECK_INPUTS        | bool  | false    | debug: also check values on the host, with a device sync  |
| TOKENYARD_CACHE_DIR           | str   | ~/.cache/tokenyard | folder of the JIT kernel cache                 |
| TOKENYARD_COMPILER            | str   | "auto"   | JIT compiler: auto (NVRTC, else nvcc), nvrtc or nvcc     |
| TOKENYARD_COMMIT              | str   | ""       | commit the benchmark records (before git rev-parse)      |
| TOKENYARD_VERBOSE             | bool  | false    | log backend choice and JIT compiles to stderr            |
| TOKENYARD_PROFILE_DIR         | str   | ~/.cache/tokenyard/profiles | folder of AutoTuner's profile files   |
| TOKENYARD_LOW_LATENCY_KERNELS | str   | "auto"   | CUDA low-latency calls: auto (kernels once validated), on, off |
| TOKENYARD_NVL_BUFFER_BYTES    | int   | 0        | cap on every Buffer's num_nvl_bytes (0: no cap); calls that |
|                               |       |          | need more run in rounds (NOTE [rounds] in rounds.py)     |
| TOKENYARD_RANKS_PER_NODE      | int   | 0        | ranks per node, as the runtime queries see the group (0: |
|                               |       |          | a node per host; NOTE [virtual nodes] in devices.py)     |
| TOKENYARD_VIRTUAL_HOSTS       | int   | 0        | tests: blocks of this many consecutive ranks of a machine |
|                               |       |          | act as separate hosts (NOTE [virtual hosts] in devices.py) |
| TOKENYARD_TUNING              | str   | ""       | "key=value,...": overrides of the CUDA backend's launch  |
|                               |       |          | heuristics, for tuning sweeps (TUNING_KEYS below)        |
| TOKENYARD_COUNT_OPERATIONS    | bool  | false    | debug: the NVSHMEM kernels count what they ask of the    |
|                               |       |          | transport, per rank (NOTE [operation counters]); slower  |
| TOKENYARD_JIT_MANIFEST        | str   | ""       | file to which every kernel loaded is appended, for       |
|                               |       |          | `python -m tokenyard.tools.precompile` (NOTE [kernel manifest]) |
"""

from __future__ import annotations

import dataclasses
import functools
import os


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"cannot read {text!r} as a boolean")


def _parse_share(text: str) -> float:
    share = float(text)
    if not 0.0 < share < 1.0:
        raise ValueError(f"a share is strictly between 0 and 1, got {share}")
    return share


def _parse_count(text: str) -> int:
    count = int(text)
    if count < 1:
        raise ValueError(f"a count is at least 1, got {count}")
    return count


# TOKENYARD_TUNING: what each key overrides in tokenyard/backends/cuda/heuristics.py, and how it is read.
TUNING_KEYS = {
    "dispatch_own_rows_direct": _parse_bool,   # DISPATCH_OWN_ROWS_DIRECT
    "combine_own_rows_direct": _parse_bool,    # COMBINE_OWN_ROWS_DIRECT
    "dispatch_tail": _parse_count,             # DISPATCH_TAIL_TOKENS
    "low_latency_local_share": _parse_share,   # low_latency_local_blocks: share of the grid for the own rank
    "dispatch_send_warps": _parse_count,       # DISPATCH_SEND_WARPS
    "dispatch_threads": _parse_count,          # DISPATCH_THREADS
    "combine_threads": _parse_count,           # COMBINE_THREADS
    "combine_send_warps": _parse_count,        # COMBINE_SEND_WARPS
    "dispatch_stages": _parse_count,           # DISPATCH_STAGES
    "combine_stages": _parse_count,            # COMBINE_STAGES
    "combine_reduce_loads": _parse_count,      # COMBINE_REDUCE_LOADS
    "expand_in_dispatch_min_sms": _parse_count,  # EXPAND_IN_DISPATCH_MIN_SMS
}


def _parse_tuning(text: str) -> tuple:
    """"dispatch_send_warps=10,dispatch_own_rows_direct=0" -> (("dispatch_send_warps", 10),
    ("dispatch_own_rows_direct", False))."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in TUNING_KEYS or not value:
            raise ValueError(f"expected key=value with a key among {sorted(TUNING_KEYS)}, got {item!r}")
        pairs.append((key, TUNING_KEYS[key](value)))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str = "auto"
    timeout_s: float = 100.0
    check_inputs: bool = False
    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "tokenyard")
    compiler: str = "auto"
    commit: str = ""
    verbose: bool = False
    profile_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "tokenyard", "profiles")
    low_latency_kernels: str = "auto"
    nvl_buffer_bytes: int = 0
    ranks_per_node: int = 0
    virtual_hosts: int = 0
    tuning: tuple = ()
    count_operations: bool = False
    jit_manifest: str = ""


# field name -> (variable, parser)
_TABLE = {
    "backend": ("TOKENYARD_BACKEND", str),
    "timeout_s": ("TOKENYARD_TIMEOUT_S", float),
    "check_inputs": ("TOKENYARD_CHECK_INPUTS", _parse_bool),
    "cache_dir": ("TOKENYARD_CACHE_DIR", str),
    "compiler": ("TOKENYARD_COMPILER", str),
    "commit": ("TOKENYARD_COMMIT", str),
    "verbose": ("TOKENYARD_VERBOSE", _parse_bool),
    "profile_dir": ("TOKENYARD_PROFILE_DIR", str),
    "low_latency_kernels": ("TOKENYARD_LOW_LATENCY_KERNELS", str),
    "nvl_buffer_bytes": ("TOKENYARD_NVL_BUFFER_BYTES", int),
    "ranks_per_node": ("TOKENYARD_RANKS_PER_NODE", int),
    "virtual_hosts": ("TOKENYARD_VIRTUAL_HOSTS", int),
    "tuning": ("TOKENYARD_TUNING", _parse_tuning),
    "count_operations": ("TOKENYARD_COUNT_OPERATIONS", _parse_bool),
    "jit_manifest": ("TOKENYARD_JIT_MANIFEST", str),
}


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """Read the table once; later calls return the same object."""
    values = {}
    for field, (variable, parse) in _TABLE.items():
        raw = os.environ.get(variable)
        if raw is None:
            continue
        try:
            values[field] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {variable}={raw!r}: {exc}") from None
    chosen = Settings(**values)
    if chosen.backend not in ("auto", "reference", "cuda"):
        raise ValueError(f"TOKENYARD_BACKEND must be auto, reference or cuda, not {chosen.backend!r}")
    if chosen.compiler not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"TOKENYARD_COMPILER must be auto, nvrtc or nvcc, not {chosen.compiler!r}")
    if chosen.low_latency_kernels not in ("auto", "on", "off"):
        raise ValueError(f"TOKENYARD_LOW_LATENCY_KERNELS must be auto, on or off, not {chosen.low_latency_kernels!r}")
    if chosen.nvl_buffer_bytes < 0:
        raise ValueError(f"TOKENYARD_NVL_BUFFER_BYTES must be >= 0, not {chosen.nvl_buffer_bytes}")
    if chosen.ranks_per_node < 0:
        raise ValueError(f"TOKENYARD_RANKS_PER_NODE must be >= 0, not {chosen.ranks_per_node}")
    if chosen.virtual_hosts < 0:
        raise ValueError(f"TOKENYARD_VIRTUAL_HOSTS must be >= 0, not {chosen.virtual_hosts}")
    return chosen


def log(message: str) -> None:
    """One line to stderr when TOKENYARD_VERBOSE is set."""
    if settings().verbose:
        import sys

        print(f"[tokenyard] {message}", file=sys.stderr, flush=True)
