"""`Benchmark`: the benchmark command's measurements, run in-process on a group the caller already has.

Naive equivalent: ``python -m tokenyard.tools.bench --mode normal ...`` without spawning processes; every rank
of `group` calls the same method with the same arguments, and every rank gets the same JSON document
the command writes (tokenyard/tools/bench/report.py). The calls timed, the bandwidth formulas and the
summary across ranks are the command's own (tokenyard/tools/bench/runner.py, bandwidth.py, timing.py).
"""

from __future__ import annotations

import datetime
import secrets
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .buffer import Buffer
from .errors import InvalidInputError
from .plan import devices
from .tools.launch import group_or_world

DEFAULT_SM_COUNTS = (8, 16, 24, 32, 40, 48)


class Benchmark:
    """Time dispatch and combine on every rank of `group`; collective: all ranks call each method alike.

    Arguments:
        group: the EP process group (default: the world).
        backends: backends to time, of "reference" and "cuda" (default: every one that runs on all ranks).
        iters, warmup: timed and untimed calls per operation (default: the command's for CPU or GPU).
        seed: seed of the random inputs (default: a fresh one per call, drawn on rank 0).
        quiet: no progress bar (shown on rank 0's stderr otherwise).
    Each method returns the command's JSON document (a dict): an all_to_all_single baseline (``nccl``) and one
    entry per backend (``reference``, ``tokenyard``), each op ``{us, nvlink_gbps, logical_gbps, num_sms}``.
    Raises:
        InvalidInputError: a problem no backend can run (experts not divisible by ranks, FP8 with
            hidden % 128, ...), before any communication; or torch.distributed is not initialized.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, backends: Optional[Sequence[str]] = None,
                 iters: Optional[int] = None, warmup: Optional[int] = None, seed: Optional[int] = None,
                 quiet: bool = False) -> None:
        self.group = group_or_world(group)
        self.backends = None if backends is None else tuple(backends)
        self.iters, self.warmup, self.seed, self.quiet = iters, warmup, seed, quiet

    def _settings(self, mode: str, **problem):
        from .tools.bench import options, runner

        seed = self.seed if self.seed is not None else runner.from_rank_0(self.group, secrets.randbelow(2**31))
        gpu = devices.default_device().type == "cuda"
        try:
            return options.for_group(mode=mode, num_ranks=self.group.size(), gpu=gpu, seed=seed,
                                     backends=self.backends, iters=self.iters, warmup=self.warmup, quiet=self.quiet,
                                     num_sms=Buffer.num_sms, **problem)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None

    def _run(self, settings) -> dict:
        from .tools.bench import report, runner

        samples = runner.measure_group(runner.group_context(settings, self.group))
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return report.build(settings, samples, commit=report.git_commit(), date=date)

    def benchmark_dispatch_combine(self, hidden_size: int, num_tokens: int, num_experts: int, num_topk: int = 8,
                                   dtype=torch.bfloat16, num_sms: Optional[int] = None) -> dict:
        """Normal mode: layout + dispatch, dispatch with a cached handle, and combine.

        Arguments:
            hidden_size, num_tokens (per rank), num_experts, num_topk: the problem.
            dtype: dispatch dtype, torch.bfloat16 or torch.float8_e4m3fn (or "bf16" / "fp8"); combine is bf16.
            num_sms: SMs of the CUDA kernels for this run (default `Buffer.num_sms`; restored afterwards).
        Returns:
            the JSON document; its ``reference`` / ``tokenyard`` entries hold ``dispatch``,
            ``dispatch_cached`` and ``combine``.
        """
        settings = self._settings("normal", hidden_size=hidden_size, num_tokens=num_tokens, num_experts=num_experts,
                                  num_topk=num_topk, dtype=dtype)
        previous = Buffer.num_sms
        if num_sms is not None:
            Buffer.set_num_sms(num_sms)
        try:
            return self._run(settings)
        finally:
            Buffer.num_sms = previous

    def compare_sm_counts(self, hidden_size: int, num_tokens: int, num_experts: int, num_topk: int = 8,
                          dtype=torch.bfloat16, sm_counts: Sequence[int] = DEFAULT_SM_COUNTS) -> dict:
        """Normal mode at each SM count (`Buffer.set_num_sms`; the previous count is restored afterwards).

        Returns:
            the JSON document with ``compare_sm``: ``{backend: [{num_sms, dispatch, dispatch_cached,
            combine, v2_dispatch, v2_expand_dispatch, ...}, ...]}`` (V1's calls and `ElasticBuffer`'s). The
            reference backend ignores the SM count; its points differ by noise only.
        """
        settings = self._settings("compare_sm", hidden_size=hidden_size, num_tokens=num_tokens,
                                  num_experts=num_experts, num_topk=num_topk, dtype=dtype, sm_counts=tuple(sm_counts))
        return self._run(settings)

    def benchmark_low_latency(self, hidden_size: int, num_tokens: int, num_experts: int, num_topk: int = 8,
                              dtype=torch.bfloat16) -> dict:
        """Low-latency (decode) mode: dispatch and combine of `num_tokens` per rank, eager and as CUDA graphs.

        Arguments:
            num_tokens: tokens per rank, also ``num_max_dispatch_tokens_per_rank``.
            dtype: torch.float8_e4m3fn (or "fp8") dispatches with ``use_fp8=True`` (hidden % 128 == 0).
        Returns:
            the JSON document; each backend's ``low_latency`` holds ``dispatch_us``, ``combine_us``, the graph
            times (None on CPU, with ``graph_error`` saying why) and the bandwidths.
        """
        settings = self._settings("low_latency", hidden_size=hidden_size, num_tokens=num_tokens,
                                  num_tokens_low_latency=num_tokens, num_experts=num_experts, num_topk=num_topk,
                                  dtype=dtype)
        return self._run(settings)
