"""Launch configurations: pure functions of the problem, testable on CPU (STYLE.md habit 7)."""

from __future__ import annotations

import dataclasses

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


# Shares of sending blocks at 24 SMs, the fastest the benchmark found per rank count (2, 4 and 8 H200s:
# benchmarks/results/send_share/README.md).
DISPATCH_SEND_SHARE_BY_RANKS = {2: 2 / 3}
DISPATCH_SEND_SHARE = 3 / 8   # any other number of ranks
COMBINE_SEND_SHARE_BY_RANKS = {2: 1 / 3, 8: 1 / 2}
COMBINE_SEND_SHARE = 3 / 8    # any other number of ranks


def dispatch_send_share(num_ranks: int) -> float:
    return _tuned("dispatch_share", DISPATCH_SEND_SHARE_BY_RANKS.get(num_ranks, DISPATCH_SEND_SHARE))


def combine_send_share(num_ranks: int) -> float:
    return _tuned("combine_share", COMBINE_SEND_SHARE_BY_RANKS.get(num_ranks, COMBINE_SEND_SHARE))


# Tokens a dispatch sender warp copies before it publishes them (a multiple of workspace.CHUNK_ROWS), and
# the same for the last DISPATCH_CHUNK_TOKENS of its range (NOTE [tail pieces] in kernels/dispatch.cuh): the
# smallest pieces that were faster (benchmarks/results/send_share/README.md).
DISPATCH_CHUNK_TOKENS = 8
DISPATCH_TAIL_TOKENS = 2


def dispatch_tail_tokens() -> int:
    return min(_tuned("dispatch_tail", DISPATCH_TAIL_TOKENS), DISPATCH_CHUNK_TOKENS)


# Whether a token's row for its own rank skips the buffer: dispatch senders write it into the outputs,
# combine reducers read it from the expert output (NOTE [dispatch roles], NOTE [combine roles]). On: the cached
# dispatch was faster so and the combine no slower (benchmarks/results/send_share/README.md).
DISPATCH_OWN_ROWS_DIRECT = True
COMBINE_OWN_ROWS_DIRECT = True


def dispatch_own_rows_direct() -> bool:
    return _tuned("dispatch_own_rows_direct", DISPATCH_OWN_ROWS_DIRECT)


def combine_own_rows_direct() -> bool:
    return _tuned("combine_own_rows_direct", COMBINE_OWN_ROWS_DIRECT)


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
    share = _tuned("low_latency_local_share", 1 / (2 * (num_ranks - 1) + 1))
    local = max(1, round(grid * share))
    if grid - local < num_ranks - 1:
        raise ValueError(f"a low-latency kernel of {grid} blocks cannot give each of {num_ranks - 1} peers a "
                         f"block and its own rank {local}")
    return local


def _tuned(key: str, default):
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


def layout_grid(num_tokens: int, threads: int, device_sms: int) -> int:
    return max(1, min(device_sms, (num_tokens + threads - 1) // threads))
