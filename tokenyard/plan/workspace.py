"""Sizes of the communication buffers: the one owner of every byte count.

The `Config` size hints, the capacity checks of the `Buffer` front-end (for every backend) and the CUDA
backend's byte offsets all come from these functions, so a request the reference backend accepts is a
request the CUDA backend has room for, and the refusal reads the same on both.

NOTE [normal-mode buffer]
The normal-mode (NVLink) buffer of ``num_nvl_bytes`` on every rank is a control block followed by one
region of rows per source rank. The control block holds the barrier and notify words (NOTE [control
block] in include/tokenyard/layout.cuh) and, from `NORMAL_HEADER_BYTES` on, `MAX_CHUNKS` 16-byte chunk
slots per source rank, where a sender publishes each finished chunk of `CHUNK_ROWS` rows. The slots sit at
fixed addresses whatever the row size, so no call can mistake another call's rows for its slots. (A
dispatch publishes pieces of its sender warps' token ranges in them, a combine chunks of rows.) Each
region holds up to ``capacity`` rows; a dispatch row is the token's data
bytes, its scale bytes, and ``num_topk`` (int32 index, float32 weight) pairs plus its int32 source index,
each part padded to 16 bytes. A combine row is the bf16 hidden vector plus ``num_topk`` float32 weights.
Both are padded to 128 bytes, so that every row starts on a cache line: rows that did not (7472 bytes
apart) split each 512-byte warp store over five lines, partly written, instead of four whole ones.
A rank can send at most ``capacity`` tokens per call, since in the worst case every token goes to every
rank; a call with more runs in rounds of at most that many (NOTE [rounds] in rounds.py). Example: 4 ranks,
hidden 7168 FP8 (7168 + 224 scale bytes), top-8: a row is 7168 + 224 + 80 = 7472 bytes padded to 7552,
and 4096 tokens need 64 KiB + 4 * 192 KiB of slots + 4 * 4096 * 7552 bytes = 118.8 MiB.

NOTE [low-latency buffer]
The low-latency buffer of ``num_rdma_bytes`` is two halves used alternately by consecutive calls (so
one call's outputs survive the next call). Each half holds a dispatch receive region of one message per
(source rank, token), since a token crosses to a rank once whatever number of its experts live there
(NOTE [low-latency dispatch] in kernels/low_latency_dispatch.cuh), where each message landed among its experts'
rows, the combine's weights and a combine receive region of one pre-reduced row per (rank, message)
(NOTE [low-latency combine]), plus signalling words, and where a message or a row for a rank of another node is
assembled before it is put (NOTE [internode low-latency]). The size hint depends only on (tokens per rank, hidden,
ranks, experts), as DeepEP's does, and covers the layout, whatever the nodes (with more than one expert per
rank DeepEP's room for one message per pair is the larger); top-k up to ``LOW_LATENCY_MAX_TOPK``.
"""

from __future__ import annotations

import dataclasses
import functools

from . import headers

ALIGN_BYTES = 16
REGION_ALIGN_BYTES = 128
ROW_ALIGN_BYTES = 128  # a normal-mode row starts on a cache line, so its stores over NVLink are whole lines
NORMAL_HEADER_BYTES = 1 << 16
CHUNK_ROWS = 8
MAX_NORMAL_TOKENS_PER_RANK = 8192 * CHUNK_ROWS
MAX_CHUNKS = 12288  # the slots of 65536 tokens in chunks of 8, plus one per sending warp (4096 warps)
HINT_MAX_TOPK = 16  # the top-k a normal-mode size hint makes room for
DEFAULT_HINT_TOKENS_PER_RANK = 4096
# The top-k a low-latency message's header has room for (kernels/low_latency_common.cuh).
LOW_LATENCY_MAX_TOPK = headers.constant("kernels/low_latency_common.cuh", "kHeaderMaxTopk")
# (tag << 32) | token index, padded to kHeaderChoices bytes; then per top-k choice, as int16, its local expert,
# and as int16 its pair slot.
LOW_LATENCY_MESSAGE_HEADER_BYTES = (headers.constant("kernels/low_latency_common.cuh", "kHeaderChoices")
                                    + 2 * 2 * LOW_LATENCY_MAX_TOPK)
# Counters, epochs and tags, then block 0's verdicts [stages][a warp of ranks] uint64 (layout.cuh).
# A low-latency combine's item is a piece of kReduceVectors 16-byte vectors per lane of a row
# (kernels/low_latency_combine.cuh).
LOW_LATENCY_REDUCE_INT4 = (headers.constant("kernels/low_latency_combine.cuh", "kReduceVectors")
                           * headers.constant("types.cuh", "kWarpSize"))
LOW_LATENCY_STATE_BYTES = (headers.constant("layout.cuh", "kGroupCountersAt")
                           + headers.constant("types.cuh", "kWarpSize") * 4)


def align(num_bytes: int, alignment: int = ALIGN_BYTES) -> int:
    return (num_bytes + alignment - 1) // alignment * alignment


def normal_dispatch_row_bytes(data_bytes: int, scale_bytes: int, num_topk: int, source_ranks: bool = False) -> int:
    """Bytes of one dispatch row (see NOTE [normal-mode buffer]); `source_ranks`: a fresh expanded dispatch's rows
    carry each slot's source rank too (NOTE [row tail] in kernels/dispatch.cuh)."""
    return align(align(data_bytes) + align(scale_bytes) + align(num_topk * (12 if source_ranks else 8) + 4),
                 ROW_ALIGN_BYTES)


def normal_combine_row_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one combine row: bf16 hidden plus float32 top-k weights."""
    return align(align(hidden * 2) + align(num_topk * 4), ROW_ALIGN_BYTES)


def dispatch_pieces(num_tokens: int, chunk_tokens: int, tail_tokens: int) -> int:
    """Pieces a dispatch sender warp publishes a range of `num_tokens` tokens in: `chunk_tokens` at a time,
    its last `chunk_tokens` (or fewer) `tail_tokens` at a time (NOTE [tail pieces] in kernels/dispatch.cuh).
    Example: 28 tokens, 8 and 2: 8 8 4 | 2 2 2 2, 7 pieces."""
    tail = min(num_tokens, chunk_tokens)
    return -(-(num_tokens - tail) // chunk_tokens) + -(-tail // tail_tokens)


def normal_dispatch_slots(num_tokens: int, num_send_warps: int, chunk_tokens: int, tail_tokens: int) -> int:
    """Chunk slots per source a dispatch of `num_tokens` tokens uses: each of `num_send_warps` sender warps
    publishes its range in pieces (NOTE [sender ranges] in kernels/dispatch.cuh)."""
    if num_send_warps == 0:
        return 0
    return num_send_warps * dispatch_pieces(-(-num_tokens // num_send_warps), chunk_tokens, tail_tokens)


NOTIFY_DATA_OFFSET = headers.constant("layout.cuh", "kNotifyDataOffset")


def normal_max_local_experts(num_ranks: int) -> int:
    """The most experts per rank the count exchange has room for in the control block's header: a row of
    ``3 * num_ranks + 2 + num_local_experts`` int32 per source (NOTE [notify] in kernels/notify.cuh)."""
    return (NORMAL_HEADER_BYTES - NOTIFY_DATA_OFFSET) // 4 // num_ranks - 3 * num_ranks - 2


def normal_control_bytes(num_ranks: int) -> int:
    """The control block: header words, then `MAX_CHUNKS` slots per source rank."""
    return NORMAL_HEADER_BYTES + num_ranks * MAX_CHUNKS * 16


def normal_required_bytes(num_ranks: int, num_tokens: int, row_bytes: int) -> int:
    """`num_nvl_bytes` a call with `num_tokens` tokens per rank and rows of `row_bytes` needs."""
    return normal_control_bytes(num_ranks) + num_ranks * num_tokens * row_bytes


def normal_token_capacity(num_nvl_bytes: int, num_ranks: int, row_bytes: int) -> int:
    """How many tokens per rank one call can carry in a buffer of `num_nvl_bytes`."""
    per_region = (num_nvl_bytes - normal_control_bytes(num_ranks)) // num_ranks
    return max(0, min(per_region // row_bytes, MAX_NORMAL_TOKENS_PER_RANK))


@dataclasses.dataclass(frozen=True)
class NormalLayout:
    """Byte offsets of one normal-mode call in a buffer (NOTE [normal-mode buffer])."""

    control_bytes: int
    region_bytes: int
    slots_offset: int
    max_chunks: int
    row_bytes: int
    capacity: int


@functools.lru_cache(maxsize=256)  # pure, and asked on every call
def normal_layout(num_nvl_bytes: int, num_ranks: int, row_bytes: int) -> NormalLayout:
    capacity = normal_token_capacity(num_nvl_bytes, num_ranks, row_bytes)
    return NormalLayout(normal_control_bytes(num_ranks), capacity * row_bytes, NORMAL_HEADER_BYTES, MAX_CHUNKS,
                        row_bytes, capacity)


def normal_size_hint(hidden_bytes: int, num_ranks: int,
                     num_tokens: int = DEFAULT_HINT_TOKENS_PER_RANK) -> int:
    """A buffer that carries `num_tokens` tokens per rank of `hidden_bytes` (DeepEP's convention:
    ``hidden * max(element_size, 2)``, which leaves room for FP8 scales) with top-k up to `HINT_MAX_TOPK`."""
    row = max(normal_dispatch_row_bytes(hidden_bytes, 0, HINT_MAX_TOPK),
              align(hidden_bytes) + align(HINT_MAX_TOPK * 4))
    return align(normal_required_bytes(num_ranks, num_tokens, row), REGION_ALIGN_BYTES)


def low_latency_dispatch_message_bytes(hidden: int) -> int:
    """One dispatch slot: header plus the larger of bf16 data and FP8 data with float32 scales."""
    payload = max(hidden * 2, hidden + hidden // 128 * 4)
    return LOW_LATENCY_MESSAGE_HEADER_BYTES + align(payload)


def low_latency_combine_message_bytes(hidden: int) -> int:
    return align(hidden * 2)


def low_latency_combine_pieces(hidden: int) -> int:
    """The pieces a combine's row is reduced in, an item each (NOTE [low-latency combine])."""
    return -(-(hidden * 2 // 16) // LOW_LATENCY_REDUCE_INT4)


def zero_copy_row_elems(hidden: int) -> int:
    """The row stride, in bf16 elements, of `get_next_low_latency_combine_buffer`'s tensor: DeepEP's combine message,
    the row and a bf16 pair of LogFMT bounds per 128 channels, so that the view has DeepEP's strides."""
    return hidden + 2 * (hidden // 128)


@functools.lru_cache(maxsize=256)  # pure, and asked on every call
def low_latency_half_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                           num_experts: int) -> int:
    """One of the two alternating halves (see NOTE [low-latency buffer]): room for one message per pair
    (DeepEP's sizing, which the reference implementation uses), and never less than the CUDA kernels'
    layout needs."""
    num_slots = num_experts * num_max_dispatch_tokens_per_rank
    dispatch_msg = low_latency_dispatch_message_bytes(hidden)
    combine_msg = low_latency_combine_message_bytes(hidden)
    send = num_max_dispatch_tokens_per_rank * max(dispatch_msg, combine_msg * LOW_LATENCY_MAX_TOPK)
    recv = num_slots * (dispatch_msg + combine_msg)
    signals = 4 * (num_experts + num_ranks) * 8
    pairs = align(send, REGION_ALIGN_BYTES) + align(recv, REGION_ALIGN_BYTES) + align(signals, REGION_ALIGN_BYTES)
    return max(pairs, _low_latency_regions(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)[1])


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                          num_experts: int) -> int:
    """`num_rdma_bytes` a low-latency `Buffer` needs (both halves)."""
    return 2 * low_latency_half_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


@dataclasses.dataclass(frozen=True)
class LowLatencyLayout:
    """Byte offsets inside one half of the low-latency buffer (NOTE [low-latency buffer]).

    state           LOW_LATENCY_STATE_BYTES, this rank only, at offset 0: [8] uint32, blocks done sending
                    (dispatch, combine), the dispatch and combine epochs (NOTE [low-latency epochs] in
                    sync.cuh), the tags their latest launches signalled with (NOTE [call
                    tags]), two unused; then [3][32] uint64, block 0's verdicts on each peer at three receive
                    stages (NOTE [one verdict]); then [32] uint32, the combine's sending blocks done with each
                    rank (NOTE [group release] in kernels/low_latency_combine.cuh)
    dispatch_recv   [R][M] messages of `dispatch_message_bytes`, source r's token j at slot j: header
                    (uint64 ``(tag << 32) | j`` at 0; per top-k choice, int16 local expert, -1 where
                    elsewhere, at 16 and int16 pair slot at 48), then the FP8 data and float32 scales, or
                    the bf16 data
    dispatch_positions [R][M][LOW_LATENCY_MAX_TOPK] int32: for message j of source r and its top-k choice k on this
                    rank, the packed row it was copied to (``l * R * M + row`` for local expert l)
    dispatch_counts [R] uint64: ``(tag << 32) | tokens`` of source r (its message slots) once sent
    dispatch_expert_counts [R][L] uint64: ``(tag << 32) | tokens`` of source r that chose local expert l
    combine_weights [R][M][LOW_LATENCY_MAX_TOPK] uint64: ``(tag << 32) | float32 bits``, source r's top-k weights of
                    the token of its message j, sent at combine
    combine_recv    [R][M] bf16 rows: owner r's partial sum for this rank's message slot j to r
                    (NOTE [low-latency combine])
    combine_flags   [R] uint64: ``(tag << 32) | 1`` once owner r has sent every row back
    staged_messages [R][M] dispatch messages, this rank's to rank r, and
    staged_rows     [R][M] bf16 rows, this rank's partial sums for rank r's messages: where the kernels assemble
                    what goes to a rank of another node before one put carries it (NOTE [internode low-latency]
                    in kernels/low_latency_common.cuh); unused within a node
    arrivals        [R + 1][M] uint64 ``(tag << 32) | pieces``: the pieces of each staged row (r < R) and message
                    (R) written so far
    combine_deferred [R] uint32, then [R][M][pieces] uint32, this rank's own: the tag of the combine whose
                    sending launch left rows for rank r to the receiving launch, and the tag on each item
                    (message slot j, piece) of r's it left (NOTE [deferred rows] in kernels/low_latency_combine.cuh)
    weights_flags   [R] uint64: ``(tag << 32) | 1`` once source r (of another node) put its combine weights here
    staged_weights  [R][M][LOW_LATENCY_MAX_TOPK] uint64: this rank's combine weights words for rank r of another
                    node, assembled before one put carries them (NOTE [internode low-latency])
    A tag is the call's epoch times the odd factor of its shape signature (NOTE [call tags]).
    """

    half_bytes: int
    dispatch_recv: int
    dispatch_message_bytes: int
    dispatch_positions: int
    dispatch_counts: int
    dispatch_expert_counts: int
    combine_weights: int
    combine_recv: int
    combine_flags: int
    staged_messages: int
    staged_rows: int
    arrivals: int
    combine_deferred: int
    weights_flags: int
    staged_weights: int
    state: int


def low_latency_region_bytes(num_max: int, hidden: int, num_ranks: int, num_experts: int) -> dict:
    """``{region: bytes}`` of one half, in LowLatencyLayout's order."""
    num_messages = num_ranks * num_max
    return {"state": LOW_LATENCY_STATE_BYTES,
            "dispatch_recv": num_messages * low_latency_dispatch_message_bytes(hidden),
            "dispatch_positions": num_messages * LOW_LATENCY_MAX_TOPK * 4,
            "dispatch_counts": num_ranks * 8,
            "dispatch_expert_counts": num_experts * 8,
            "combine_weights": num_messages * LOW_LATENCY_MAX_TOPK * 8,
            "combine_recv": num_messages * low_latency_combine_message_bytes(hidden),
            "combine_flags": num_ranks * 8,
            "staged_messages": num_messages * low_latency_dispatch_message_bytes(hidden),
            "staged_rows": num_messages * low_latency_combine_message_bytes(hidden),
            "arrivals": (num_ranks + 1) * num_max * 8,
            "combine_deferred": (num_ranks + num_messages * low_latency_combine_pieces(hidden)) * 4,
            "weights_flags": num_ranks * 8,
            "staged_weights": num_messages * LOW_LATENCY_MAX_TOPK * 8}


def _low_latency_regions(num_max: int, hidden: int, num_ranks: int, num_experts: int):
    """``({region: offset}, end)`` of one half, in LowLatencyLayout's order."""
    offsets, end = {}, 0
    for name, num_bytes in low_latency_region_bytes(num_max, hidden, num_ranks, num_experts).items():
        offsets[name] = end
        end = align(end + num_bytes, REGION_ALIGN_BYTES)
    return offsets, end


@functools.lru_cache(maxsize=256)  # pure, and asked on every call
def low_latency_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                       num_experts: int) -> LowLatencyLayout:
    """Offsets of one half; the regions end within `low_latency_half_bytes`. `state` comes first, at the
    same offset whatever the problem's sizes, so its counters and epochs stay true when a Buffer's calls
    change shape (the signal words of the new shape need `clean_low_latency_buffer`, as in DeepEP)."""
    offsets, _ = _low_latency_regions(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return LowLatencyLayout(low_latency_half_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts),
                            dispatch_message_bytes=low_latency_dispatch_message_bytes(hidden), **offsets)
