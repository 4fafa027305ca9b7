"""Launch configurations: pure functions of the problem, testable on CPU."""

from __future__ import annotations

import functools
import math

from ... import env


def data_blocks(num_sms: int, device_sms: int) -> int:
    """Blocks of a dispatch or combine kernel: one per SM allowed, at least 2, each sending and receiving
    (NOTE [dispatch roles], NOTE [combine roles]). Example: 24 SMs -> 24 blocks."""
    return max(2, min(num_sms, device_sms))


# NOTE [block shapes by ranks]
# A block's rows go to more peers as the ranks grow, and the shapes that serve them best change: from MANY_RANKS on,
# a wider dispatch block and one more sending warp in the combine's. The MPS proxy chose them
# (benchmarks/results/normal_tuning.md, `shapes_4_ranks_proxy`); on 4 GPUs none of their neighbours was faster
# ("Block shapes on 4 GPUs").
MANY_RANKS = 4


def _by_ranks(num_ranks: int, few: int, many: int) -> int:
    return many if num_ranks >= MANY_RANKS else few


# NOTE [dispatch block width]
# A dispatch block's threads (BLOCK_THREAD_CHOICES). The warps past the sending ones receive, each with one row's
# loads in flight, as many as the registers of a block that wide hold (kernels/dispatch.cuh, receive_row): a wider
# block receives with more warps, each with fewer loads in flight. 512 at 2 ranks (768 and 1024 no faster:
# normal_tuning.md, `claims_call`), 768 from 4 ranks on (faster than 512 and 1024 at 8 SMs, by the MPS proxy and on
# 4 GPUs: `shapes_4_ranks_proxy`, `shapes_4_gpus`).
DISPATCH_THREADS = 512
DISPATCH_THREADS_MANY_RANKS = 768
# NOTE [combine block width]: the same for the combine's block, whose warps past the sending ones reduce, each lane
# with combine_reduce_loads loads in flight: a reducer reads as fast as it keeps loads in flight, so a wider block
# (more reducing warps, each with fewer loads: COMBINE_REDUCE_LOADS) reads faster. 1024 threads below 4 ranks: at 2
# its combine was faster than 512's at every SM count measured on 2 GPUs (benchmarks/results/normal_tuning.md,
# "Wider combine blocks on 2 GPUs"); 512 from 4 ranks on, where neither the MPS proxy found 768 or 1024 faster
# ("Wider combine blocks") nor 4 GPUs 1024 ("Block shapes on 4 GPUs").
COMBINE_THREADS = 1024
COMBINE_THREADS_MANY_RANKS = 512
BLOCK_THREAD_CHOICES = (512, 768, 1024)


def _block_threads(key: str, default: int) -> int:
    threads = tuned(key, default)
    if threads not in BLOCK_THREAD_CHOICES:
        raise ValueError(f"TOKENYARD_TUNING {key}={threads}: a block has "
                         f"{', '.join(map(str, BLOCK_THREAD_CHOICES[:-1]))} or {BLOCK_THREAD_CHOICES[-1]} threads")
    return threads


def dispatch_threads(num_ranks: int) -> int:
    return _block_threads("dispatch_threads", _by_ranks(num_ranks, DISPATCH_THREADS, DISPATCH_THREADS_MANY_RANKS))


def combine_threads(num_ranks: int) -> int:
    return _block_threads("combine_threads", _by_ranks(num_ranks, COMBINE_THREADS, COMBINE_THREADS_MANY_RANKS))


# The warps of each data-kernel block that send (by TMA bulk copies, NOTE [warp stages]); its other warps
# receive (dispatch) or reduce (combine). The fastest at 8 SMs of the counts swept, and no slower at 24
# (benchmarks/results/normal_tuning.md): at 2 ranks 12 and 3, from 4 ranks on the combine's 4 (NOTE [block shapes
# by ranks]).
DISPATCH_SEND_WARPS = 12
COMBINE_SEND_WARPS = 3
COMBINE_SEND_WARPS_MANY_RANKS = 4


def _send_warps(key: str, default: int, block_warps: int) -> int:
    warps = tuned(key, default)
    if not 1 <= warps < block_warps:
        raise ValueError(f"TOKENYARD_TUNING {key}={warps}: a block of {block_warps} warps needs 1 to "
                         f"{block_warps - 1} sending warps")
    return warps


def dispatch_send_warps(block_warps: int) -> int:
    return _send_warps("dispatch_send_warps", DISPATCH_SEND_WARPS, block_warps)


def combine_send_warps(block_warps: int, num_ranks: int) -> int:
    return _send_warps("combine_send_warps", _by_ranks(num_ranks, COMBINE_SEND_WARPS, COMBINE_SEND_WARPS_MANY_RANKS),
                       block_warps)


# The stages of shared memory per sending warp (NOTE [warp stages]; WarpStages takes 2 to 4): 2 and 4 were alike,
# 3 slower for the dispatch (its pieces not lined up with rows) (benchmarks/results/normal_tuning.md).
DISPATCH_STAGES = 4
COMBINE_STAGES = 4


def _stages(key: str, default: int) -> int:
    stages = tuned(key, default)
    if not 2 <= stages <= 4:
        raise ValueError(f"TOKENYARD_TUNING {key}={stages}: a sending warp has 2 to 4 stages")
    return stages


def dispatch_stages() -> int:
    return _stages("dispatch_stages", DISPATCH_STAGES)


def combine_stages() -> int:
    return _stages("combine_stages", COMBINE_STAGES)


# Tokens a dispatch sender warp copies before it publishes them (a multiple of workspace.CHUNK_ROWS), and
# the same for the last DISPATCH_CHUNK_TOKENS of its range (NOTE [tail pieces] in kernels/dispatch.cuh): the
# smallest pieces that were faster (benchmarks/results/normal_tuning.md).
DISPATCH_CHUNK_TOKENS = 8
DISPATCH_TAIL_TOKENS = 2


def dispatch_tail_tokens() -> int:
    return min(tuned("dispatch_tail", DISPATCH_TAIL_TOKENS), DISPATCH_CHUNK_TOKENS)


# Whether a token's row for its own rank skips the buffer: dispatch senders write it into the outputs,
# combine reducers read it from the expert output (NOTE [dispatch roles], NOTE [combine roles]). On: the cached
# dispatch was faster so and the combine no slower (benchmarks/results/normal_tuning.md).
DISPATCH_OWN_ROWS_DIRECT = True
COMBINE_OWN_ROWS_DIRECT = True


def dispatch_own_rows_direct() -> bool:
    return tuned("dispatch_own_rows_direct", DISPATCH_OWN_ROWS_DIRECT)


def combine_own_rows_direct() -> bool:
    return tuned("combine_own_rows_direct", COMBINE_OWN_ROWS_DIRECT)


# ElasticBuffer's expanded dispatch writes the expanded rows in the dispatch kernel (NOTE [expanded rows] in
# kernels/dispatch.cuh) from EXPAND_IN_DISPATCH_MIN_SMS SMs, a fresh one with peers and a cached one from
# EXPAND_CACHED_IN_DISPATCH_MIN_RANKS ranks; else kernels of their own over the whole GPU gather them after a plain
# dispatch. On 2 GPUs at 2 ranks a cached one gathered was faster in kernel and call time, and a fresh one gathered
# took less kernel time but longer calls back to back, its gather waiting for the counts on the CPU
# (benchmarks/results/elastic.md, "Expanded rows on 2 GPUs"). Ranks sharing one GPU under MPS had the one kernel
# faster for both from 16 SMs and slower below (its receivers' copies); from 4 ranks on only that proxy has measured
# it. At one rank, where no row leaves the GPU, the whole-GPU kernels won ("The fresh expanded dispatch in the
# kernel").
EXPAND_IN_DISPATCH_MIN_SMS = 16
EXPAND_CACHED_IN_DISPATCH_MIN_RANKS = MANY_RANKS


def expand_in_dispatch_min_sms() -> int:
    return tuned("expand_in_dispatch_min_sms", EXPAND_IN_DISPATCH_MIN_SMS)


def expands_in_dispatch(num_sms: int, num_ranks: int, fresh: bool) -> bool:
    """Whether the dispatch kernel on `num_sms` SMs over `num_ranks` ranks writes the expanded rows of a `fresh`
    (else cached) expanded dispatch."""
    min_ranks = 2 if fresh else EXPAND_CACHED_IN_DISPATCH_MIN_RANKS
    return num_ranks >= min_ranks and num_sms >= expand_in_dispatch_min_sms()


# The loads a combine reducer's lane keeps in flight, rounded down to whole vectors of every rank (at 8 SMs the
# reducers sum three quarters of the kernel). In a block of 512 or 768 threads, 12: it fits in the 128 registers at
# 2, 4 and 8 ranks where 16 spills; its combine was 4% faster than 16's at 8 SMs and 2% at 24 on 2 ranks, the same on
# 4; 8 and 32 slower (benchmarks/results/normal_tuning.md, issue 50's sweep). In a block of 1024 threads (64
# registers a thread), 8 (NOTE [combine block width]; its spills: normal_tuning.md, "Wider combine blocks on 2 GPUs").
COMBINE_REDUCE_LOADS = 12
COMBINE_REDUCE_LOADS_WIDE = 8


def default_reduce_loads(threads: int) -> int:
    """COMBINE_REDUCE_LOADS for a combine block of `threads` threads."""
    return COMBINE_REDUCE_LOADS_WIDE if threads > 768 else COMBINE_REDUCE_LOADS


def combine_reduce_loads(threads: int) -> int:
    loads = tuned("combine_reduce_loads", default_reduce_loads(threads))
    if not 1 <= loads <= 64:
        raise ValueError(f"TOKENYARD_TUNING combine_reduce_loads={loads}: 1 to 64 loads in flight per lane")
    return loads


# Low-latency senders in one group of blocks per destination (NOTE [peer-major blocks] in
# kernels/low_latency_common.cuh). Writes to the own rank need no NVLink, so its group gets half the blocks of a
# peer's: 1 / (2 (R - 1) + 1) of the grid.
def low_latency_local_blocks(grid: int, num_ranks: int) -> int:
    """Blocks of a low-latency kernel of `grid` blocks that write to their own rank; the others are dealt
    among the peers, at least one each.

    Example: 132 blocks on 4 ranks -> 19 for the own rank, 38 (or 37) for each of the 3 peers.
    """
    if num_ranks == 1:
        return grid
    share = tuned("low_latency_local_share", 1 / (2 * (num_ranks - 1) + 1))
    local = max(1, round(grid * share))
    if grid - local < num_ranks - 1:
        raise ValueError(f"a low-latency kernel of {grid} blocks cannot give each of {num_ranks - 1} peers a "
                         f"block and its own rank {local}")
    return local


def tuned(key: str, default):
    """The TOKENYARD_TUNING value of `key` (env.TUNING_KEYS), for tuning sweeps, else `default`."""
    for name, value in env.settings().tuning:
        if name == key:
            return value
    return default


def fewest_sms(num_ranks: int) -> int:
    """The fewest SMs a rank's kernels work with: two blocks of a normal-mode kernel (data_blocks), and in
    low-latency mode one block for the own rank and one per peer (low_latency_local_blocks)."""
    return max(2, num_ranks)


# NOTE [SM model]
# How many SMs a normal-mode kernel needs before more stop helping (DeepEP V2's get_theoretical_num_sms). Every
# block of a kernel of n SMs sends rows to the peers and copies the rows that arrive out of the local buffer
# (reduces them, in a combine) at about `sm_read_gbs` per SM (data_blocks). What it writes into its own GPU's memory
# (a dispatch's own rows, a combine's sums) goes through the same SM's writes as what it sends, a byte of it costing
# `OWN_WRITE_COST` of a byte to a peer; with the tokens spread over the ranks a rank's own share is one in num_ranks,
# so an SM writing `sm_write_gbs` sends sm_write_gbs / (1 + OWN_WRITE_COST / (num_ranks - 1)) to the peers. A GPU's
# NVLink carries about `nvlink_gbs` out of it. So n is the fewest SMs whose sending fills NVLink and whose receiving
# keeps up, rounded up to even (DeepEP's SM counts are even): 16 at 2 ranks, 12 at 4 and 8. Where each rate comes
# from, and the model beside the SM sweeps at 2 and 4 ranks: benchmarks/results/sm_model.md.
SM_WRITE_GBS = 31.0
OWN_WRITE_COST = 0.64
SM_READ_GBS = 200.0
NVLINK_GBS = 300.0


def sending_gbs_per_sm(num_ranks: int, sm_write_gbs: float = SM_WRITE_GBS) -> float:
    """NOTE [SM model]: what one SM of a normal-mode kernel sends to the peers, its own memory's share written too
    (one rank alone writes only its own memory: taken as two)."""
    return sm_write_gbs / (1 + OWN_WRITE_COST / max(1, num_ranks - 1))


@functools.lru_cache(maxsize=64)  # asked at every ElasticBuffer call without num_sms
def theoretical_num_sms(num_ranks: int, nvlink_gbs: float = NVLINK_GBS, sm_write_gbs: float = SM_WRITE_GBS,
                        sm_read_gbs: float = SM_READ_GBS) -> int:
    """NOTE [SM model]: the SMs at which the normal-mode kernels of `num_ranks` ranks fill NVLink.

    Example: 4 ranks -> 12, 2 ranks -> 16; 4 ranks with sm_write_gbs=50 -> 8 (NVLink full from 8 sending SMs).
    """
    if min(nvlink_gbs, sm_write_gbs, sm_read_gbs) <= 0:
        raise ValueError("the SM model's rates must be positive")
    sending = nvlink_gbs / sending_gbs_per_sm(num_ranks, sm_write_gbs)
    need = max(fewest_sms(num_ranks), math.ceil(sending), math.ceil(nvlink_gbs / sm_read_gbs))
    return need + need % 2


def layout_grid(num_tokens: int, threads: int, device_sms: int) -> int:
    return max(1, min(device_sms, (num_tokens + threads - 1) // threads))
