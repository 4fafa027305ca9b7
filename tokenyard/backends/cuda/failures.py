"""What the error record a kernel leaves means (NOTE [error record] in include/tokenyard/sync.cuh): the exception
the host raises, naming rank, peer and stage."""

from __future__ import annotations

from typing import Callable, Optional

from ... import checks
from ...errors import CommTimeoutError, InvalidInputError, TokenyardError
from ...plan import headers
from .. import collectives

# NOTE [error record] in include/tokenyard/sync.cuh: the kinds of error and the stages, numbered there; the
# stages' names in errors, here.
ERRORS = headers.enum("sync.cuh", "ErrorKind")
STAGE_NAMES = {"kStageBarrier": "combine/barrier", "kStageNotify": "dispatch/notify",
                "kStageDispatchRecv": "dispatch/receive", "kStageCombineRecv": "combine/receive",
                "kStageLowLatencyDispatchRecv": "low_latency_dispatch/receive",
                "kStageLowLatencyCombineRecv": "low_latency_combine/receive",
                "kStageLowLatencyCombineWeights": "low_latency_combine/weights",
                "kStageLowLatencyDispatchCounts": "low_latency_dispatch/expert_counts",
                "kStageLowLatencyDispatchSend": "low_latency_dispatch/send",
                "kStageInternodeSignal": "internode/signal", "kStageInternodeBarrier": "internode/barrier",
                "kStageLowLatencyCombineOverlap": "low_latency_combine/overlap",
                "kStageDispatchPlace": "dispatch/place"}
STAGES = {value: STAGE_NAMES[member] for member, value in headers.enum("sync.cuh", "Stage").items()}
MASK32 = 0xFFFFFFFF
MAX_RANKS = headers.constant("layout.cuh", "kMaxRanks")
# From kRecordSignaturesAt, the table of every rank's signature: kMaxRanks rows of kMaxSignatureInts.
RECORD_SIGNATURES_AT = headers.constant("sync.cuh", "kRecordSignaturesAt")
MAX_SIGNATURE_INTS = headers.constant("layout.cuh", "kMaxSignatureInts")
RECORD_INTS = RECORD_SIGNATURES_AT + MAX_RANKS * MAX_SIGNATURE_INTS


def failure_of(record, num_ranks: int, verdict_experts: Optional[int],
               normal_state: Callable[[], str]) -> Optional[TokenyardError]:
    """The error that `record` (the host record's int32 words) holds, None where it holds none; `verdict_experts`:
    num_experts of the last fresh dispatch, for messages; `normal_state()`: what a normal-mode timeout adds."""
    if record[0] == 0:
        return None
    kind, rank, peer, stage, seen, expected = (record[i] for i in range(6))
    stage_name = STAGES.get(stage, f"stage {stage}")
    if kind == ERRORS["kErrorOverflow"]:
        return InvalidInputError(f"rank {rank} received at least {seen} rows at {stage_name}, more than "
                                 f"num_worst_tokens={expected}; rows past it were dropped")
    if kind == ERRORS["kErrorBadValues"]:
        error = checks.verdict_error(checks.ranks_in(expected & MASK32, num_ranks), seen, verdict_experts)
        return InvalidInputError(f"{error} (a dispatch with num_worst_tokens, which does not wait for the counts, "
                                 "moved no rows; destroy this Buffer and make a new one)")
    if kind == ERRORS["kErrorBadLowLatencyIds"]:
        return InvalidInputError(f"{checks.low_latency_bad_ids(rank, expected, seen)}; destroy this Buffer and make "
                                 "a new one")
    if kind == ERRORS["kErrorCallMismatch"]:
        # NOTE [call signatures]: every rank's signature, copied from the table
        rows = [[int(record[RECORD_SIGNATURES_AT + r * MAX_SIGNATURE_INTS + i])
                 for i in range(collectives.SIGNATURE_INTS)] for r in range(num_ranks)]
        return collectives.mismatch_error(rows, collectives.describe_signature, rank=rank, stage=stage_name)
    if kind == ERRORS["kErrorMismatch"]:
        return InvalidInputError(
            f"rank {peer} dispatched with {seen} sending warps and rank {rank} with {expected}: every rank "
            "must use the same number of SMs (Buffer.set_num_sms, Config.num_sms); destroy this Buffer "
            "and make a new one")
    # NOTE [call tags]: a low-latency peer whose call had another shape signals tags never awaited.
    if stage_name == "low_latency_combine/overlap":  # NOTE [combine overlap]
        cause = ("the expert outputs' blocks were never signalled done (comp_signal below threshold, "
                 "or src_signals below src_signal_expect_value); ")
    elif stage_name.startswith("low_latency"):
        cause = ("the peer did not make this call, or made it with another shape (hidden, top-k, experts, "
                 "num_max_dispatch_tokens_per_rank, FP8 flags); ")
    elif stage_name.startswith("internode"):  # signal counts (NOTE [internode kernels])
        cause = ("a rank did not launch this call's kernel, or launched it with another grid; "
                 "the flag counts signals of every call so far; ")
    else:
        cause = normal_state()
    return CommTimeoutError(rank, peer, stage_name, f"flag was {seen & MASK32}, expected {expected & MASK32}; "
                            f"{cause}destroy this Buffer and make a new one")
