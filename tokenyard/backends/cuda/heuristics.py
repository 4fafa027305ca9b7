"""Launch configurations: pure functions of the problem, testable on CPU."""

from __future__ import annotations

import dataclasses
import functools
import math

from ... import env


@dataclasses.dataclass(frozen=True)
class DataGrid:
    num_blocks: int
    num_send_blocks: int


def data_grid(num_sms: int, device_sms: int, send_share: float) -> DataGrid:
    """Blocks of a dispatch or combine kernel: one per SM allowed, `send_share` of them sending.

    Example: 24 SMs at 1/2 -> 12 senders and 12 receivers (dispatch) or reducers (combine).
    """
    blocks = max(2, min(num_sms, device_sms))
    senders = max(1, int(blocks * send_share))
    return DataGrid(blocks, min(senders, blocks - 1))


# Shares of sending blocks at 24 SMs: per rank count, the fastest of the shares swept
# (benchmarks/results/send_share.md).
DISPATCH_SEND_SHARE_BY_RANKS = {2: 2 / 3}
DISPATCH_SEND_SHARE = 3 / 8   # any other number of ranks
COMBINE_SEND_SHARE_BY_RANKS = {2: 1 / 3, 8: 1 / 2}
COMBINE_SEND_SHARE = 3 / 8    # any other number of ranks


def dispatch_send_share(num_ranks: int) -> float:
    return tuned("dispatch_share", DISPATCH_SEND_SHARE_BY_RANKS.get(num_ranks, DISPATCH_SEND_SHARE))


def combine_send_share(num_ranks: int) -> float:
    return tuned("combine_share", COMBINE_SEND_SHARE_BY_RANKS.get(num_ranks, COMBINE_SEND_SHARE))


# Tokens a dispatch sender warp copies before it publishes them (a multiple of workspace.CHUNK_ROWS), and
# the same for the last DISPATCH_CHUNK_TOKENS of its range (NOTE [tail pieces] in kernels/dispatch.cuh): the
# smallest pieces that were faster (benchmarks/results/send_share.md).
DISPATCH_CHUNK_TOKENS = 8
DISPATCH_TAIL_TOKENS = 2


def dispatch_tail_tokens() -> int:
    return min(tuned("dispatch_tail", DISPATCH_TAIL_TOKENS), DISPATCH_CHUNK_TOKENS)


# Whether a token's row for its own rank skips the buffer: dispatch senders write it into the outputs,
# combine reducers read it from the expert output (NOTE [dispatch roles], NOTE [combine roles]). On: the cached
# dispatch was faster so and the combine no slower (benchmarks/results/send_share.md).
DISPATCH_OWN_ROWS_DIRECT = True
COMBINE_OWN_ROWS_DIRECT = True


def dispatch_own_rows_direct() -> bool:
    return tuned("dispatch_own_rows_direct", DISPATCH_OWN_ROWS_DIRECT)


def combine_own_rows_direct() -> bool:
    return tuned("combine_own_rows_direct", COMBINE_OWN_ROWS_DIRECT)


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
    """The fewest SMs a rank's kernels work with: two blocks of a normal-mode kernel (a sender and a
    receiver or reducer), and in low-latency mode one block for the own rank and one per peer
    (low_latency_local_blocks)."""
    return max(2, num_ranks)


# NOTE [SM model]
# How many SMs a normal-mode kernel needs before more stop helping (DeepEP V2's get_theoretical_num_sms). A
# kernel of n SMs gives int(n * share) blocks to senders, which write rows to the peers at about
# `sm_write_gbs` each, and the rest to receivers (reducers in a combine), which copy rows out of the local
# buffer at about `sm_read_gbs` each (data_grid). A GPU's NVLink carries about `nvlink_gbs` out of it. So the
# senders fill NVLink from nvlink_gbs / sm_write_gbs of them on, and the receivers keep up from
# nvlink_gbs / sm_read_gbs: n is the fewest SMs whose split gives both, under the dispatch's share and the
# combine's, rounded up to even (DeepEP's SM counts are even). Example, 4 ranks at the defaults: 8 senders
# and 2 receivers; a share of 3/8 gives 8 senders from 22 SMs on, for both kernels: 22.
# The figures: a sending SM's from the SM sweep where NVLink was not yet full, NVLink's from the copy limits
# measured on 2, 4 and 8 GPUs, a receiving SM's DeepEP V2's (not measured alone here);
# benchmarks/results/sm_model.md gives where each comes from and sets the model beside the sweeps.
SM_WRITE_GBS = 40.0
SM_READ_GBS = 200.0
NVLINK_GBS = 300.0


@functools.lru_cache(maxsize=64)  # asked at every ElasticBuffer call without num_sms
def theoretical_num_sms(num_ranks: int, nvlink_gbs: float = NVLINK_GBS, sm_write_gbs: float = SM_WRITE_GBS,
                        sm_read_gbs: float = SM_READ_GBS) -> int:
    """NOTE [SM model]: the SMs at which the normal-mode kernels of `num_ranks` ranks fill NVLink.

    Example: 4 ranks -> 22; 2 ranks -> 24 (the combine sends from a third of its blocks).
    """
    if min(nvlink_gbs, sm_write_gbs, sm_read_gbs) <= 0:
        raise ValueError("the SM model's rates must be positive")
    senders, receivers = math.ceil(nvlink_gbs / sm_write_gbs), math.ceil(nvlink_gbs / sm_read_gbs)
    need = fewest_sms(num_ranks)
    for share in (dispatch_send_share(num_ranks), combine_send_share(num_ranks)):
        n = max(need, math.floor(senders / share))
        while True:
            grid = data_grid(n, n, share)
            if grid.num_send_blocks >= senders and grid.num_blocks - grid.num_send_blocks >= receivers:
                break
            n += 1
        need = max(need, n)
    return need + need % 2


def layout_grid(num_tokens: int, threads: int, device_sms: int) -> int:
    return max(1, min(device_sms, (num_tokens + threads - 1) // threads))
