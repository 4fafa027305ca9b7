"""`AutoTuner`: choose the SM count of the normal-mode kernels by measuring, and keep the choice as a profile.

Naive equivalent::

    times = {n: time_of(dispatch + combine with Buffer.set_num_sms(n)) for n in sm_counts}
    Buffer.set_num_sms(min(n for n in times if times[n] <= 1.05 * min(times.values())))

Every method is collective: all ranks of the group call it with the same arguments. Each rank times the
calls (the benchmark's own measurements, tokenyard/tools/bench/runner.py); the slowest rank's time counts for
each SM count (bandwidth.summarize); rank 0 chooses and broadcasts, so all ranks agree.

NOTE [SM choice]
The tuner takes the fewest SMs whose dispatch + combine time is within `tolerance` (5%) of the fastest
count's: an SM the communication kernels do not need is an SM the experts' GEMMs can use. Example: 8, 16,
24 SMs at 900, 610, 600 us -> 16 (610 <= 1.05 * 600). On the reference backend the SM count changes
nothing, so its choice follows the noise; the calls run anyway, so CPU tests walk the same path.

Profiles are JSON files in one folder (``TOKENYARD_PROFILE_DIR``, default ``~/.cache/tokenyard/profiles``),
one file per profile name. A file holds entries keyed by what the choice depends on: GPU model ("cpu"
without GPUs), number of ranks, hidden size and the dispatch and combine dtypes, e.g.
``"NVIDIA H200 | 8 ranks | hidden 7168 | dispatch bf16 | combine bf16"``; an entry holds the chosen
``num_sms``, the problem it was tuned on and every count's times. Rank 0 reads and writes the file.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import secrets
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import env
from ..buffer import Buffer
from ..config import Config
from ..errors import InvalidInputError, TokenyardError
from ..plan import devices
from . import launch

PROFILE_FORMAT = "tokenyard-profile/1"
DEFAULT_TOLERANCE = 0.05
CPU_SM_COUNTS = (8, 16, 24)
GPU_SM_COUNTS = (8, 16, 24, 32, 40, 48)
COMBINE_DTYPE = "bf16"  # combine always moves bf16
_PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def profile_key(device: str, num_ranks: int, hidden_size: int, dispatch_dtype: str,
                combine_dtype: str = COMBINE_DTYPE) -> str:
    """The key of one tuned setting inside a profile file (see the module docstring)."""
    return (f"{device} | {num_ranks} ranks | hidden {hidden_size} | dispatch {dispatch_dtype} | "
            f"combine {combine_dtype}")


def choose_sm_count(total_us: Dict[int, float], tolerance: float = DEFAULT_TOLERANCE) -> int:
    """NOTE [SM choice]: the fewest SMs within `tolerance` of the fastest; ``{8: 900, 16: 610, 24: 600}`` -> 16."""
    best = min(total_us.values())
    return min(n for n, t in total_us.items() if t <= best * (1 + tolerance))


class AutoTuner:
    """Tune `Buffer.set_num_sms` for a problem on `group`, and save or load the result as a named profile.

    Arguments:
        group: the EP process group (default: the world); every method is collective over it.
        backend: the backend to tune, as `Buffer(backend=...)` takes it (default TOKENYARD_BACKEND, "auto").
        iters, warmup: timed and untimed calls per SM count (default: the benchmark's for CPU or GPU).
        tolerance: NOTE [SM choice] (0.05).
        profile_dir: folder of the profile files (default TOKENYARD_PROFILE_DIR).
        seed: seed of the random inputs (default: drawn on rank 0).
        quiet: no progress bar (tqdm on rank 0's stderr otherwise).
    Raises:
        InvalidInputError: torch.distributed is not initialized.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, backend: Optional[str] = None,
                 iters: Optional[int] = None, warmup: Optional[int] = None, tolerance: float = DEFAULT_TOLERANCE,
                 profile_dir: Optional[str] = None, seed: Optional[int] = None, quiet: bool = False) -> None:
        self.group = launch.group_or_world(group)
        self.backend = backend or env.settings().backend
        self.iters, self.warmup, self.tolerance, self.seed, self.quiet = iters, warmup, tolerance, seed, quiet
        self.profile_dir = pathlib.Path(profile_dir or env.settings().profile_dir).expanduser()
        self.last_tuning: Optional[dict] = None
        """The latest tuning's record (what a profile entry holds), the same on every rank."""
        self.profile: Optional[dict] = None
        """The profile entry `load_profile` applied last."""

    # -- tuning ---------------------------------------------------------------------------------------------

    def _device_name(self) -> str:
        device = devices.default_device()
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def _default_sm_counts(self) -> Sequence[int]:
        device = devices.default_device()
        if device.type != "cuda":
            return CPU_SM_COUNTS
        num_device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return tuple(n for n in GPU_SM_COUNTS if n <= num_device_sms) or (num_device_sms // 2 * 2,)

    def tune_sm_count(self, hidden_size: int, num_tokens: int, num_experts: int, dtype=torch.bfloat16,
                      num_topk: int = 8, sm_counts: Optional[Sequence[int]] = None) -> int:
        """Time layout + dispatch + combine at each SM count and return the count to use (NOTE [SM choice]).

        Leaves `Buffer.num_sms` as it was; apply the result with `Buffer.set_num_sms`.

        Arguments:
            hidden_size, num_tokens (per rank), num_experts, num_topk: the problem, random uniform routing.
            dtype: dispatch dtype, torch.bfloat16 or torch.float8_e4m3fn (or "bf16" / "fp8").
            sm_counts: even counts to try (default 8..48 in steps of 8 up to the GPU's SMs; 8, 16, 24 on CPU).
        Returns:
            the chosen SM count, the same on every rank. `last_tuning` holds every count's times.
        Raises:
            InvalidInputError: a problem no backend can run, or an odd / non-positive SM count.
        """
        from tqdm import tqdm

        from .bench import bandwidth, options, runner

        counts = tuple(sm_counts) if sm_counts is not None else tuple(self._default_sm_counts())
        seed = self.seed if self.seed is not None else runner.from_rank_0(self.group, secrets.randbelow(2**31))
        device = devices.default_device()
        try:
            settings = options.for_group(mode="compare_sm", hidden_size=hidden_size, num_tokens=num_tokens,
                                         num_experts=num_experts, num_topk=num_topk, num_ranks=self.group.size(),
                                         gpu=device.type == "cuda", seed=seed, dtype=dtype, sm_counts=counts,
                                         num_sms=Buffer.num_sms, iters=self.iters, warmup=self.warmup, quiet=True)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        ctx = runner.group_context(settings, self.group)
        backend = runner.resolve_backend(ctx, self.backend)
        with tqdm(total=len(counts), desc="tuning SM count", file=sys.stderr, leave=False,
                  disable=self.quiet or ctx.rank != 0) as progress:
            sweep = runner.measure_backend(ctx, backend, seed, progress)["sweep"]
        per_rank = ctx.all_gather(sweep)

        record = None
        if ctx.rank == 0:
            measurements = []
            for n in counts:
                dispatch = bandwidth.summarize([p[n]["dispatch"] for p in per_rank])
                combine = bandwidth.summarize([p[n]["combine"] for p in per_rank])
                measurements.append({"num_sms": n, "dispatch_us": dispatch["us"], "combine_us": combine["us"],
                                     "total_us": dispatch["us"] + combine["us"]})
            chosen = choose_sm_count({m["num_sms"]: m["total_us"] for m in measurements}, self.tolerance)
            record = {"device": self._device_name(), "num_ranks": ctx.num_ranks, "hidden_size": hidden_size,
                      "dispatch_dtype": settings.dtype, "combine_dtype": COMBINE_DTYPE, "num_sms": chosen,
                      "backend": backend, "num_tokens": num_tokens, "num_experts": num_experts,
                      "num_topk": num_topk, "tolerance": self.tolerance, "iters": settings.iters,
                      "measurements": measurements}
        self.last_tuning = runner.from_rank_0(self.group, record)
        return self.last_tuning["num_sms"]

    def tune_chunk_size(self, *args, **kwargs) -> None:
        """Nothing to tune: returns None.

        tokenyard has no chunk or round size to choose. Normal mode sends into fixed-size per-source regions
        (NOTE [normal-mode buffer] in workspace.py); the ``Config`` chunk arguments are DeepEP's, accepted
        and ignored, and the chunk rows a sender publishes at once (``workspace.CHUNK_ROWS``) are part of
        the buffer layout, not a setting. A backend that gains such a size will tune it here.
        """
        del args, kwargs
        return None

    def create_optimized_buffer(self, hidden_size: int, num_tokens: int, num_experts: int, dtype=torch.bfloat16,
                                num_topk: int = 8, sm_counts: Optional[Sequence[int]] = None,
                                low_latency_mode: bool = False,
                                num_max_dispatch_tokens_per_rank: Optional[int] = None) -> Buffer:
        """Tune the SM count, apply it (`Buffer.set_num_sms`) and return a `Buffer` sized for the problem.

        The normal-mode buffer holds `num_tokens` tokens per rank of `hidden_size` (not the 4096-token
        default of the size hints); with `low_latency_mode` the low-latency buffer holds
        `num_max_dispatch_tokens_per_rank` (default `num_tokens`).
        """
        num_sms = self.tune_sm_count(hidden_size, num_tokens, num_experts, dtype=dtype, num_topk=num_topk,
                                     sm_counts=sm_counts)
        Buffer.set_num_sms(num_sms)
        num_ranks = self.group.size()
        num_nvl_bytes = Config(num_sms, num_max_tokens_per_rank=num_tokens).get_nvl_buffer_size_hint(
            hidden_size * 2, num_ranks)
        num_rdma_bytes = 0
        if low_latency_mode:
            num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank or num_tokens,
                                                                   hidden_size, num_ranks, num_experts)
        return Buffer(self.group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency_mode,
                      backend=self.last_tuning["backend"])

    # -- profiles -------------------------------------------------------------------------------------------

    def profile_path(self, profile_name: str) -> pathlib.Path:
        """``<profile_dir>/<profile_name>.json``.

        Raises:
            InvalidInputError: a name that is not letters, digits, ``.``, ``_`` and ``-``.
        """
        if not isinstance(profile_name, str) or not _PROFILE_NAME.match(profile_name):
            raise InvalidInputError(f"a profile name is letters, digits, '.', '_' and '-', got {profile_name!r}")
        return self.profile_dir / f"{profile_name}.json"

    def tune_and_save_profile(self, profile_name: str, hidden_size: int, num_tokens: int, num_experts: int,
                              dtype=torch.bfloat16, num_topk: int = 8,
                              sm_counts: Optional[Sequence[int]] = None) -> dict:
        """`tune_sm_count`, then save the result as this machine's entry of profile `profile_name`.

        Other entries of the file (other GPUs, rank counts, hidden sizes, dtypes) are kept; the entry of
        the same key is replaced. Rank 0 writes the file (through a temporary file and a rename); all ranks
        return once it is written. Leaves `Buffer.num_sms` as it was: `load_profile` applies it.

        Returns:
            the saved entry (``num_sms``, the key's fields, the problem, every count's times).
        Raises:
            InvalidInputError: a bad profile name or problem.
        """
        path = self.profile_path(profile_name)
        self.tune_sm_count(hidden_size, num_tokens, num_experts, dtype=dtype, num_topk=num_topk, sm_counts=sm_counts)
        entry, error = None, None
        if self.group.rank() == 0:
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            entry = dict(self.last_tuning, saved=now)
            try:
                doc = _read_profile(path) if path.exists() else {"format": PROFILE_FORMAT, "name": profile_name,
                                                                  "entries": {}}
                key = profile_key(entry["device"], entry["num_ranks"], hidden_size, entry["dispatch_dtype"])
                doc["entries"][key] = entry
                _write_profile(path, doc)
            except (OSError, TokenyardError) as exc:
                error = f"cannot save profile {path}: {exc}"
        entry, error = _from_rank_0(self.group, (entry, error))
        if error:
            raise TokenyardError(error)
        return entry

    def load_profile(self, name: str, hidden_size: Optional[int] = None, dtype=None) -> bool:
        """Apply this machine's entry of profile `name` (`Buffer.set_num_sms`); False where there is none.

        The entry must match this group's GPU model and rank count; where the file holds several such
        entries, `hidden_size` and `dtype` choose among them. Rank 0 reads the file and sends the entry to
        every rank, so all apply the same SM count.

        Returns:
            True when an entry was applied (`profile` holds it), False when the file or a matching entry
            is missing.
        Raises:
            InvalidInputError: several entries match (name `hidden_size` / `dtype`), or a bad name or dtype.
            TokenyardError: the file is not a tokenyard profile.
        """
        from .bench import options

        path = self.profile_path(name)
        dispatch_dtype = None if dtype is None else options.dtype_name(dtype)
        found, error = None, None
        if self.group.rank() == 0:
            try:
                found = self._matching_entry(path, hidden_size, dispatch_dtype) if path.exists() else None
            except TokenyardError as exc:
                error = (type(exc).__name__, str(exc))
        found, error = _from_rank_0(self.group, (found, error))
        if error:
            raise (InvalidInputError if error[0] == "InvalidInputError" else TokenyardError)(error[1])
        if found is None:
            return False
        Buffer.set_num_sms(found["num_sms"])
        self.profile = found
        return True

    def _matching_entry(self, path: pathlib.Path, hidden_size: Optional[int],
                        dispatch_dtype: Optional[str]) -> Optional[dict]:
        doc = _read_profile(path)
        device, num_ranks = self._device_name(), self.group.size()
        matches: List[str] = [
            key for key, e in doc["entries"].items()
            if e.get("device") == device and e.get("num_ranks") == num_ranks
            and (hidden_size is None or e.get("hidden_size") == hidden_size)
            and (dispatch_dtype is None or e.get("dispatch_dtype") == dispatch_dtype)]
        if len(matches) > 1:
            raise InvalidInputError(f"profile {path} has {len(matches)} entries for {device} on {num_ranks} ranks "
                                    f"({'; '.join(matches)}); pass hidden_size and dtype to choose")
        return doc["entries"][matches[0]] if matches else None


def _from_rank_0(group: dist.ProcessGroup, obj):
    from .bench import runner

    return runner.from_rank_0(group, obj)


def _read_profile(path: pathlib.Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TokenyardError(f"cannot read profile {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or not isinstance(doc.get("entries"), dict):
        raise TokenyardError(f"{path} is not a tokenyard profile (expected format {PROFILE_FORMAT!r})")
    return doc


def _write_profile(path: pathlib.Path, doc: dict) -> None:
    """Write `doc` as indented JSON; a reader never sees half a file (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(temporary, path)
