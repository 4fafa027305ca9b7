"""The CUDA backend's kernels: each one's header, template arguments and parameter list, written once.

The parameter lists must match the device functions in tokenyard/include/tokenyard/kernels/*.cuh; the
compiler checks that whenever a unit is built (CI builds every kernel, see tokenyard/tools/ci_compile.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...jit import KernelSpec, Param
from ...plan import headers, workspace
from ..collectives import SIGNATURE_INTS
from . import heuristics

LAYOUT_THREADS = 256
NOTIFY_THREADS = 512
LOW_LATENCY_THREADS = 512
CHUNK_TOKENS = workspace.CHUNK_ROWS  # dispatch chunk (tokens) and combine chunk (rows)
NORMAL_MAX_TOPK = headers.constant("types.cuh", "kWarpSize")  # the normal-mode kernels: a lane per top-k entry
JUDGE_WINDOW = 8192  # tokens the notify kernel judges at once (a shared byte each, NOTE [input verdict])
# NOTE [warp stages] (include/tokenyard/staging.cuh): each sending warp of a normal-mode data kernel moves rows
# through its stages of shared memory (heuristics.DISPATCH_STAGES, COMBINE_STAGES), as large as a row's data or as
# the warp's part of the block's allows (sm_90 gives a block up to 227 KiB; SHARED_RESERVE of it is left to the
# kernels' static shared variables).
SM90_MAX_SHARED = 227 << 10
SHARED_RESERVE = 1 << 10

_TOPK_CTYPES = {torch.int64: "int64_t", torch.int32: "int"}

_WAIT = (Param("int*", "error_flag"), Param("int*", "host_record"), Param("uint64_t", "timeout_ns"))
_BUFFERS = (Param("uint8_t* const*", "peer_bases"), Param("int", "rank"), Param("int64_t", "control_bytes"),
            Param("int64_t", "region_bytes"), Param("int64_t", "slots_offset"), Param("int", "max_chunks"),
            Param("int64_t", "row_bytes"), Param("unsigned long long*", "call_counts"))
# call_counts: the rank's CallCounter words (NOTE [normal-mode call numbers] in include/tokenyard/sync.cuh).
# NOTE [normal-mode phases] (include/tokenyard/phases.cuh): nullptr except in benchmarks/normal_phases.py.
_PHASES = (Param("uint64_t*", "phases"),)
PHASES = headers.enum("phases.cuh", "NormalPhase")


def topk_ctype(dtype: torch.dtype) -> str:
    return _TOPK_CTYPES[dtype]


def data_stage_bytes(row_bytes: int, warps: int, stages: int) -> int:
    """A stage of a data kernel's sending warp (NOTE [warp stages]): a row of `row_bytes` (a multiple of 16) in one
    piece where the block's shared memory allows it, shared by `warps` warps of `stages` stages. Example: 3 warps
    of 4 stages get stages of 14336 bytes (a BF16 row of hidden 7168 in one piece), 12 warps stages of 4800."""
    per_warp = (SM90_MAX_SHARED - SHARED_RESERVE) // warps
    return min(row_bytes, (per_warp // stages - 8) // 16 * 16)


def data_shared_bytes(stage_bytes: int, warps: int, stages: int) -> int:
    return warps * stages * (stage_bytes + 8)


@functools.lru_cache(maxsize=None)
def dispatch_layout(num_ranks: int, topk_dtype: torch.dtype) -> KernelSpec:
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/dispatch_layout.cuh", "tokenyard::kernels::dispatch_layout", (num_ranks, topk_t),
        (Param(f"const {topk_t}*", "topk_idx"), Param("int", "num_tokens"), Param("int", "num_topk"),
         Param("int", "num_experts"), Param("int*", "num_tokens_per_rank"), Param("int*", "num_tokens_per_expert"),
         Param("bool*", "is_token_in_rank"), Param("int*", "verdict"), Param("int*", "totals"),
         Param("uint32_t*", "ticket")),
        LAYOUT_THREADS, name="tokenyard::normal::layout")


@functools.lru_cache(maxsize=None)
def dispatch_notify(num_ranks: int, topk_dtype: torch.dtype) -> KernelSpec:
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/notify.cuh", "tokenyard::kernels::dispatch_notify",
        (num_ranks, NOTIFY_THREADS, topk_t, JUDGE_WINDOW, SIGNATURE_INTS),
        (Param("const bool*", "is_token_in_rank"), Param("int", "num_tokens"),
         Param("const int*", "num_tokens_per_expert"), Param("int", "num_experts"), Param("int", "expert_alignment"),
         Param("int*", "prefix_excl"), Param("int*", "rank_prefix_matrix"), Param("int*", "source_num_tokens"),
         Param("int*", "counts"), Param("int*", "source_first"), Param("int", "call_num_tokens"),
         Param("const int*", "call_tokens_per_rank"),
         Param("int*", "call_prefix_matrix"), Param("int*", "recv_first"), Param("int*", "cursor"),
         Param(f"const {topk_t}*", "check_topk_idx"), Param("int", "num_topk"), Param("int", "check_num_tokens"),
         Param("const bool*", "check_in_rank"), Param("const int*", "check_per_rank"),
         Param("const int*", "check_per_expert"), Param("int*", "verdict"), Param("int", "record_verdict"),
         Param("int*", "host_counts"), Param("const int*", "signature"), Param("uint32_t", "ticket"),
         Param("uint8_t* const*", "peer_bases"), Param("int", "rank"),
         Param("unsigned long long*", "call_counts"), Param("int*", "expand_bases"), Param("int*", "expand_counts"),
         Param("int*", "expand_ends")) + _WAIT,
        NOTIFY_THREADS, name="tokenyard::normal::notify")


@functools.lru_cache(maxsize=None)
def dispatch(num_ranks: int, data_int4: int, num_scales: int, num_topk: int, topk_dtype: torch.dtype,
             chunk_tokens: int = CHUNK_TOKENS, tail_tokens: int = CHUNK_TOKENS,
             all_weights: bool = False, send_warps: int = heuristics.DISPATCH_SEND_WARPS,
             stages: int = heuristics.DISPATCH_STAGES, threads: int = heuristics.DISPATCH_THREADS,
             expand: bool = False, expand_fresh: bool = False) -> KernelSpec:
    """`chunk_tokens`: the most tokens a sender warp publishes at once (NOTE [sender ranges]), a multiple
    of CHUNK_TOKENS, for which workspace.MAX_CHUNKS is sized; `tail_tokens`: the same for the last
    `chunk_tokens` of its range (NOTE [tail pieces]), at most chunk_tokens; `all_weights`: every slot's
    weight arrives (DeepEP V2), not only the local slots'; `send_warps`: a block's warps that send (the others
    receive), each through `stages` stages; `threads`: the block's (NOTE [dispatch block width]); `expand`: the rows go
    to their pairs' expanded rows (NOTE [expanded rows]): the handle's (cached) or, `expand_fresh`, those the rows'
    source ranks give."""
    assert chunk_tokens % CHUNK_TOKENS == 0 and 1 <= tail_tokens <= chunk_tokens, (chunk_tokens, tail_tokens)
    topk_t = topk_ctype(topk_dtype)
    staged_warps = threads // 32 if expand else send_warps  # expanded: the receivers' bulk copies too
    stage_bytes = data_stage_bytes(data_int4 * 16, staged_warps, stages)
    return KernelSpec(
        "tokenyard/kernels/dispatch.cuh", "tokenyard::kernels::dispatch",
        (num_ranks, threads, data_int4, num_scales, num_topk, topk_t, chunk_tokens, tail_tokens,
         "true" if all_weights else "false", stages, stage_bytes, send_warps, "true" if expand else "false",
         "true" if expand_fresh else "false"),
        (Param("const int4*", "x"), Param("const uint32_t*", "x_scales"), Param("int64_t", "scale_token_stride"),
         Param("int64_t", "scale_hidden_stride"), Param(f"const {topk_t}*", "topk_idx"),
         Param("const float*", "topk_weights"), Param("const bool*", "is_token_in_rank"),
         Param("const int*", "prefix_excl"), Param("const int*", "rank_prefix_matrix"),
         Param("const int*", "source_num_tokens"), Param("int", "num_tokens"), Param("int", "num_local_experts"),
         Param("int4*", "recv_x"), Param("uint32_t*", "recv_scales"),
         Param(f"{topk_t}*", "recv_topk_idx"), Param("float*", "recv_topk_weights"), Param("int*", "recv_src_idx"),
         Param("int*", "send_head"), Param("int", "num_worst_tokens"), Param("const int*", "recv_first"),
         Param("int", "src_idx_base"), Param("int", "local_direct"),
         Param("int", "num_send_warps"), Param("uint8_t* const*", "place_bases"), Param("int64_t", "place_offset"),
         Param("int", "recv_rows"), Param("int*", "expand_row_of"), Param("int*", "expand_source_row"),
         Param("int64_t", "expand_rows"), Param("int", "expand_zero_fill"), Param("const int*", "source_ranks"),
         Param("const int*", "expand_bases"), Param("const int*", "expand_ends"), Param("int*", "expand_metadata"),
         Param("int", "expand_num_max"))
        + _BUFFERS + (Param("const int*", "verdict"),) + _WAIT + _PHASES,
        threads, name="tokenyard::normal::dispatch",
        shared_bytes=data_shared_bytes(stage_bytes, staged_warps, stages))


@functools.lru_cache(maxsize=None)
def combine(num_ranks: int, hidden_int4: int, num_topk: int,
            send_warps: int = heuristics.COMBINE_SEND_WARPS, stages: int = heuristics.COMBINE_STAGES,
            reduce_loads: Optional[int] = None, threads: int = heuristics.COMBINE_THREADS) -> KernelSpec:
    """`send_warps`: a block's warps that send (the others reduce), each through `stages` stages, a row's data and
    its weights a stage where the shared memory allows (NOTE [combine weights]); `reduce_loads`: the loads a reducing
    lane keeps in flight (default: heuristics.default_reduce_loads); `threads`: the block's (NOTE [combine block
    width])."""
    if reduce_loads is None:
        reduce_loads = heuristics.default_reduce_loads(threads)
    stage_bytes = data_stage_bytes(hidden_int4 * 16 + workspace.align(num_topk * 4), send_warps, stages)
    return KernelSpec(
        "tokenyard/kernels/combine.cuh", "tokenyard::kernels::combine",
        (num_ranks, threads, hidden_int4, num_topk, CHUNK_TOKENS, SIGNATURE_INTS, stages, stage_bytes,
         send_warps, reduce_loads),
        (Param("const int4*", "x"), Param("const float*", "topk_weights"), Param("const int4*", "bias_0"),
         Param("const int4*", "bias_1"), Param("const int*", "rank_prefix_matrix"), Param("const int*", "recv_first"),
         Param("const int*", "send_head"),
         Param("int", "num_tokens"), Param("int4*", "combined_x"),
         Param("float*", "combined_topk_weights"), Param("int", "local_direct"))
        + _BUFFERS + (Param("const int*", "signature"),) + _WAIT + _PHASES,
        threads, name="tokenyard::normal::combine",
        shared_bytes=data_shared_bytes(stage_bytes, send_warps, stages))


# What LowLatencyBuffers::of (layout.cuh) reads, and which half of the work a launch does.
_LOW_LATENCY_BUFFERS = (Param("uint8_t* const*", "peer_bases"), Param("int", "rank"), Param("int", "num_ranks"),
                        Param("int", "num_max"), Param("int64_t", "dispatch_recv"), Param("int64_t", "message_bytes"),
                        Param("int64_t", "header_bytes"), Param("int64_t", "dispatch_positions"),
                        Param("int64_t", "dispatch_counts"), Param("int64_t", "dispatch_expert_counts"),
                        Param("int64_t", "combine_weights"),
                        Param("int64_t", "combine_recv"), Param("int64_t", "combine_flags"), Param("int64_t", "state"),
                        Param("uint32_t", "tag_factor"), Param("int", "do_send"), Param("int", "do_recv"),
                        Param("uint32_t", "remote_ranks"), Param("int64_t", "staged_messages"),
                        Param("int64_t", "staged_rows"), Param("int64_t", "arrivals"),
                        Param("int64_t", "combine_deferred"), Param("int64_t", "weights_flags"),
                        Param("int64_t", "staged_weights"))
# NOTE [internode low-latency] (sync.cuh): with ranks on other nodes the same kernels, given the transport, in an
# NVSHMEM unit.
_LOW_LATENCY_INTERNODE = "tokenyard/kernels/low_latency_internode.cuh"
_REMOTE = {False: "tokenyard::NoRemote", True: "tokenyard::transport::Remote"}
_TRACE = (Param("uint64_t*", "trace"),)  # NOTE [low-latency trace]; nullptr except in benchmarks/ll_phases.py


@functools.lru_cache(maxsize=None)
def low_latency_dispatch(num_topk: int, topk_dtype: torch.dtype, cast: int, use_ue8m0: bool,
                         internode: bool = False) -> KernelSpec:
    """`cast`: 0 bf16, 1 FP8, 2 NVFP4 (LowLatencyDispatchRequest.cast, quant.cuh's Cast)."""
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        _LOW_LATENCY_INTERNODE if internode else "tokenyard/kernels/low_latency_dispatch.cuh",
        "tokenyard::kernels::low_latency_dispatch",
        (num_topk, topk_t, int(cast), "true" if use_ue8m0 else "false", _REMOTE[internode]),
        (Param("const int4*", "x"), Param(f"const {topk_t}*", "topk_idx"), Param("int", "num_tokens"),
         Param("int", "hidden"), Param("int", "num_experts"), Param("int", "round_scale"),
         Param("const float*", "x_global_scale"),
         Param("uint8_t*", "packed_recv_x"), Param("uint32_t*", "packed_recv_scales"),
         Param("int*", "packed_recv_count"), Param("int*", "src_info"), Param("int64_t*", "layout_range"),
         Param("int*", "cumulative_stats"), Param("int*", "rank_mask"), Param("int64_t*", "wait_costs"))
        + _LOW_LATENCY_BUFFERS + _WAIT + _TRACE,
        LOW_LATENCY_THREADS, name="tokenyard::low_latency::dispatch", nvshmem=internode)


@functools.lru_cache(maxsize=None)
def low_latency_combine(num_topk: int, topk_dtype: torch.dtype, internode: bool = False) -> KernelSpec:
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        _LOW_LATENCY_INTERNODE if internode else "tokenyard/kernels/low_latency_combine.cuh",
        "tokenyard::kernels::low_latency_combine", (num_topk, topk_t, _REMOTE[internode]),
        (Param("const int4*", "x"), Param(f"const {topk_t}*", "topk_idx"), Param("const float*", "topk_weights"),
         Param("int", "num_tokens"), Param("int", "hidden"),
         Param("int", "num_experts"), Param("int4*", "combined_x"), Param("int*", "rank_mask"),
         Param("int64_t*", "wait_costs"), Param("int", "local_blocks"), Param("int", "x_row_int4"),
         Param("const int*", "comp_signal"), Param("int", "signal_blocks"), Param("int", "block_m"),
         Param("int", "signal_threshold"))
        + _LOW_LATENCY_BUFFERS + _WAIT + _TRACE,
        LOW_LATENCY_THREADS, name="tokenyard::low_latency::combine", nvshmem=internode)


EXPAND_THREADS = 512


@functools.lru_cache(maxsize=None)
def expand_count(num_topk: int, topk_dtype: torch.dtype) -> KernelSpec:
    """ElasticBuffer's layout, first launch: per-expert counts, source metadata (kernels/expand.cuh)."""
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::expand_count", (num_topk, topk_t),
        (Param(f"const {topk_t}*", "recv_topk_idx"), Param("const int*", "recv_src_idx"),
         Param("const int*", "psum_per_rank"), Param("int64_t", "psum_stride"), Param("int", "num_ranks"),
         Param("int", "num_rows"),
         Param("int", "num_local"), Param("int", "num_max"), Param("int*", "counts"), Param("int*", "row_of"),
         Param("int*", "metadata")),
        EXPAND_THREADS, name="tokenyard::elastic::expand_count")


@functools.lru_cache(maxsize=None)
def expand_place(num_topk: int, topk_dtype: torch.dtype) -> KernelSpec:
    """ElasticBuffer's layout, second launch: each pair's expanded row, a block per local expert."""
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::expand_place", (num_topk, topk_t),
        (Param(f"const {topk_t}*", "recv_topk_idx"), Param("int", "num_rows"), Param("int", "alignment"),
         Param("const int*", "counts"), Param("int*", "ends"), Param("int*", "row_of"), Param("int*", "metadata"),
         Param("int*", "source_row")),
        EXPAND_THREADS, name="tokenyard::elastic::expand_place")


@functools.lru_cache(maxsize=None)
def expand_psum() -> KernelSpec:
    """ElasticBuffer's layout, second launch where the dispatch is not expanded: the aligned counts' running sum."""
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::expand_psum", (),
        (Param("int", "num_local"), Param("int", "alignment"), Param("const int*", "counts"), Param("int*", "psum")),
        EXPAND_THREADS, name="tokenyard::elastic::expand_psum")


SOURCE_RANKS_THREADS = 256  # tokens a block (its warps' running counts: (warps + 1) * num_experts ints)


@functools.lru_cache(maxsize=None)
def source_ranks(num_topk: int, topk_dtype: torch.dtype) -> KernelSpec:
    """Each slot's rank among the tokens naming its expert (semantics.expand.source_ranks; kernels/expand.cuh)."""
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::source_ranks", (num_topk, topk_t),
        (Param(f"const {topk_t}*", "topk_idx"), Param("int64_t", "num_tokens"), Param("int", "num_experts"),
         Param("int*", "ranks")),
        SOURCE_RANKS_THREADS, name="tokenyard::elastic::source_ranks")


@functools.lru_cache(maxsize=None)
def expand_rows(row_int4: int) -> KernelSpec:
    """ElasticBuffer's expanded rows: each a copy of the received row it holds, or zeros (padding)."""
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::expand_rows", (row_int4,),
        (Param("const int4*", "rows"), Param("const int*", "source_row"), Param("int64_t", "num_expanded"),
         Param("int", "zero_fill"), Param("int4*", "out")),
        EXPAND_THREADS, name="tokenyard::elastic::expand_rows")


@functools.lru_cache(maxsize=None)
def move_weights() -> KernelSpec:
    """ElasticBuffer's pair weights, received layout [N, K] to expanded [M] or back (kernels/expand.cuh)."""
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::move_weights", (),
        (Param("const int*", "row_of"), Param("int64_t", "num_pairs"), Param("int", "to_expanded"),
         Param("float*", "pairs"), Param("float*", "expanded")),
        EXPAND_THREADS, name="tokenyard::elastic::move_weights")


@functools.lru_cache(maxsize=None)
def local_weights(topk_dtype: torch.dtype) -> KernelSpec:
    """ElasticBuffer's combine (not expanded): the weights of the slots whose expert is local, 0 elsewhere."""
    topk_t = topk_ctype(topk_dtype)
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::local_weights", (topk_t,),
        (Param(f"const {topk_t}*", "recv_topk_idx"), Param("const float*", "weights"), Param("int64_t", "num_pairs"),
         Param("float*", "out")),
        EXPAND_THREADS, name="tokenyard::elastic::local_weights")


@functools.lru_cache(maxsize=None)
def reduce_expanded(hidden_int4: int, num_topk: int) -> KernelSpec:
    """ElasticBuffer's combine: each received row's expanded rows summed (bf16 rows, float32 sums)."""
    return KernelSpec(
        "tokenyard/kernels/expand.cuh", "tokenyard::kernels::reduce_expanded", (hidden_int4, num_topk),
        (Param("const int4*", "x"), Param("const int*", "row_of"), Param("int64_t", "num_rows"),
         Param("int4*", "out")),
        EXPAND_THREADS, name="tokenyard::elastic::reduce_expanded")


TRANSPORT_CHECK_THREADS = 512  # a sending warp per node: 16 nodes at most


@functools.lru_cache(maxsize=None)
def transport_check() -> KernelSpec:
    """The check of the transport seam between nodes (NOTE [transport seam]); an NVSHMEM unit."""
    return KernelSpec(
        "tokenyard/kernels/transport_check.cuh", "tokenyard::kernels::transport_check", (),
        (Param("const void*", "send"), Param("void*", "recv"), Param("uint64_t*", "signals"),
         Param("uint64_t*", "arrivals"), Param("void*", "out"), Param("int64_t", "bytes"), Param("int", "num_nodes"),
         Param("int", "ranks_per_node"), Param("int", "num_ranks"), Param("uint64_t", "expected"),
         Param("int", "do_send"), Param("int", "rank"), *_WAIT),
        TRANSPORT_CHECK_THREADS, name="tokenyard::internode::transport_check", nvshmem=True)


EXCHANGE_THREADS = 256
EXCHANGE_SLOT_BYTES = headers.constant("kernels/exchange.cuh", "kExchangeSlotBytes")


@functools.lru_cache(maxsize=None)
def exchange() -> KernelSpec:
    """An internode call's small exchange through the transport (NOTE [device exchange]); an NVSHMEM unit."""
    return KernelSpec(
        "tokenyard/kernels/exchange.cuh", "tokenyard::kernels::exchange", (),
        (Param("const void*", "send"), Param("void*", "slots"), Param("uint64_t*", "signals"),
         Param("int64_t", "bytes"), Param("uint64_t", "tag"), Param("int", "num_ranks"), Param("int", "rank"),
         *_WAIT),
        EXCHANGE_THREADS, name="tokenyard::internode::exchange", nvshmem=True)


INTERNODE_THREADS = 512


@functools.lru_cache(maxsize=None)
def internode_dispatch() -> KernelSpec:
    """Both stages of an internode dispatch (NOTE [internode kernels]); an NVSHMEM unit."""
    return KernelSpec(
        "tokenyard/kernels/internode.cuh", "tokenyard::kernels::internode_dispatch", (),
        (Param("const uint8_t*", "send_rows"), Param("const int*", "node_row_begin"), Param("uint8_t*", "fwd_recv"),
         Param("const int*", "fwd_rows"), Param("const int*", "dest_first"), Param("uint8_t*", "recv"),
         Param("uint64_t*", "signals"), Param("unsigned long long*", "call_counter"), Param("int", "num_nodes"),
         Param("int", "ranks_per_node"), Param("int", "rank"), Param("int64_t", "row_bytes"),
         Param("int64_t", "out_row_bytes"), Param("int64_t", "fwd_capacity"), *_WAIT),
        INTERNODE_THREADS, name="tokenyard::internode::dispatch", nvshmem=True)


@functools.lru_cache(maxsize=None)
def internode_combine(hidden_int4: int, num_topk: int) -> KernelSpec:
    """Both stages of an internode combine (NOTE [internode kernels]); an NVSHMEM unit."""
    return KernelSpec(
        "tokenyard/kernels/internode.cuh", "tokenyard::kernels::internode_combine", (hidden_int4, num_topk),
        (Param("const int4*", "x"), Param("const float*", "topk_weights"), Param("int", "num_recv"),
         Param("int4*", "comb_in"), Param("int4* const*", "peer_comb_in"),
         Param("const int*", "fwd_row_begin"), Param("const int*", "send_nvl_head"), Param("int4*", "comb_stage"),
         Param("int4*", "comb_out"), Param("int64_t", "fwd_capacity"), Param("int", "num_tokens"),
         Param("const int*", "send_rdma_pos"), Param("const int4*", "bias_0"), Param("const int4*", "bias_1"),
         Param("int4*", "out"), Param("float*", "out_weights"), Param("uint64_t*", "signals"),
         Param("unsigned long long*", "call_counter"), Param("int", "num_nodes"), Param("int", "ranks_per_node"),
         Param("int", "rank"), *_WAIT),
        INTERNODE_THREADS, name="tokenyard::internode::combine", nvshmem=True)


def every_kernel():
    """Representative instantiations of every kernel, for CI's compile check."""
    for ranks in (2, 4, 8):
        for dtype in (torch.int64, torch.int32):
            yield dispatch_layout(ranks, dtype)
            yield dispatch_notify(ranks, dtype)
        # The blocks shaped as the backend launches them (NOTE [block shapes by ranks]).
        threads = heuristics.dispatch_threads(ranks)
        combine_threads = heuristics.combine_threads(ranks)
        send_warps = heuristics.combine_send_warps(combine_threads // 32, ranks)
        yield dispatch(ranks, 7168 * 1 // 16, 56, 8, torch.int64, threads=threads)   # FP8 with scales, DeepSeek-V3
        yield dispatch(ranks, 7168 * 1 // 16, 56, 8, torch.int64, all_weights=True, threads=threads)  # ElasticBuffer's
        yield dispatch(ranks, 7168 * 1 // 16, 56, 8, torch.int64, threads=threads, expand=True)  # and its expanded
        yield dispatch(ranks, 7168 * 1 // 16, 56, 8, torch.int64, threads=threads, expand=True, expand_fresh=True)
        yield dispatch(ranks, 7168 * 2 // 16, 0, 8, torch.int64, threads=threads)    # bf16
        yield dispatch(ranks, 2048 * 2 // 16, 0, 0, torch.int64, threads=threads)    # cached: no top-k
        yield combine(ranks, 7168 * 2 // 16, 8, send_warps, threads=combine_threads)
        yield combine(ranks, 4096 * 2 // 16, 0, send_warps, threads=combine_threads)
    yield combine(2, 7168 * 2 // 16, 8, reduce_loads=32, threads=512)  # TOKENYARD_TUNING combine_reduce_loads's sweep
    yield combine(4, 7168 * 2 // 16, 8, 6, reduce_loads=8, threads=1024)  # and combine_threads' candidates
    yield expand_count(8, torch.int64)
    yield expand_place(8, torch.int64)
    yield expand_psum()
    yield source_ranks(8, torch.int64)
    yield expand_rows(7168 // 16)       # FP8 rows, DeepSeek-V3
    yield expand_rows(56 * 4 // 16)     # their scales
    yield reduce_expanded(7168 * 2 // 16, 8)
    yield move_weights()
    yield local_weights(torch.int64)
    for num_topk in (1, 8):
        for cast, use_ue8m0 in ((1, False), (1, True), (0, False), (2, False)):
            yield low_latency_dispatch(num_topk, torch.int64, cast, use_ue8m0)
        yield low_latency_combine(num_topk, torch.int64)
    yield transport_check()
    yield exchange()
    yield internode_dispatch()
    yield internode_combine(7168 * 2 // 16, 8)
    yield low_latency_dispatch(8, torch.int64, 1, False, internode=True)
    yield low_latency_combine(8, torch.int64, internode=True)
