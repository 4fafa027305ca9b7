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


# Shares of sending blocks, from the benchmark (python -m tokenyard.bench, L2 flushed, ranks started together)
# at the DeepSeek-V3 setting with 24 SMs:
# - 2 H200s at 898daf3: cached dispatch 157.8 us at 2/3, 167.4 at 1/2; combine 231.9 us at 1/3, 284.1 at 1/4,
#   296.5 at 1/2. (A likely reason: fewer combine senders finish each chunk sooner, so the reducers start
#   sooner.)
# - 4 H200s at 166cfde (`benchmarks/run_device.sh shares` and a second sweep,
#   benchmarks/results/send_share/README.md):
#   the dispatch is fastest with fewer senders than on 2 ranks, cached kernel 315.1 us at 3/8 (prefetch off),
#   322.8 at 5/12, 339.3 at 1/2, 373.8 at 1/3; the combine is flat from 3/8 to 1/2 (561-583 us) and slower
#   at 1/4 (704-781).
# - 8 H200s at 95ac3ba (benchmarks/results/send_share/README.md): the cached dispatch kernel takes 508 us at 3/8
#   and at 1/3, 563 at 7/24, 575 at 1/2, 640 at 1/4; the combine kernel wants more senders than on 4 ranks:
#   950.5-952.2 us at 1/2 (three runs) against 998.5-1000.5 at 3/8 (four), 970 at 7/12, 978 at 5/12, 1000 at 5/8.
DISPATCH_SEND_SHARE_BY_RANKS = {2: 2 / 3}
DISPATCH_SEND_SHARE = 3 / 8   # any other number of ranks
COMBINE_SEND_SHARE_BY_RANKS = {2: 1 / 3, 8: 1 / 2}
COMBINE_SEND_SHARE = 3 / 8    # any other number of ranks


def dispatch_send_share(num_ranks: int) -> float:
    return _tuned("dispatch_share", DISPATCH_SEND_SHARE_BY_RANKS.get(num_ranks, DISPATCH_SEND_SHARE))


def combine_send_share(num_ranks: int) -> float:
    return _tuned("combine_share", COMBINE_SEND_SHARE_BY_RANKS.get(num_ranks, COMBINE_SEND_SHARE))


# Tokens a dispatch sender warp copies before it publishes them (a multiple of workspace.CHUNK_ROWS), and
# the same for the last DISPATCH_CHUNK_TOKENS of its range (NOTE [tail pieces] in kernels/dispatch.cuh).
# Chunks of 32 made the 4-rank cached dispatch 432 us against 340 with 8 (benchmarks/profile_normal.py at
# a46842c): the last wave of pieces, copied out after the senders finish, is what the tail pieces shrink.
# Tail pieces of 2 against none (8), 4 H200s at 05fd725: cached dispatch 308-311 us against 326-327 in four
# alternating runs (benchmarks/results/send_share/README.md).
DISPATCH_CHUNK_TOKENS = 8
DISPATCH_TAIL_TOKENS = 2


def dispatch_tail_tokens() -> int:
    return min(_tuned("dispatch_tail", DISPATCH_TAIL_TOKENS), DISPATCH_CHUNK_TOKENS)


# Dispatch sender warps in one group per destination (NOTE [peer-major senders] in kernels/dispatch.cuh):
# a plain copy with 9 blocks on 4 H200s sends 298 GB/s so against 278 GB/s with every block writing to every
# peer (benchmarks/results/copy_patterns_few_blocks.json), but the 4-rank dispatch at 23d5409 was not faster:
# cached 396.6 us at 3/8 of the blocks sending and 318.6 at 1/2, against 314.6-318.0 as it is
# (benchmarks/results/send_share/README.md). Off; kept for other rank counts and machines to try.
DISPATCH_PEER_MAJOR = False


def dispatch_peer_major(num_ranks: int, num_send_warps: int) -> bool:
    """Peer-major senders where asked for and every destination gets a warp."""
    return _tuned("dispatch_peer_major", DISPATCH_PEER_MAJOR) and num_send_warps >= num_ranks

# Whether a token's row for its own rank skips the buffer: dispatch senders write it into the outputs,
# combine reducers read it from the expert output (NOTE [dispatch roles], NOTE [combine roles]). The
# benchmark (python -m tokenyard.bench, L2 flushed, ranks started together) on 2 H200s at 55fa43b, both ways
# twice in one session: cached dispatch kernel 168.5 / 168.7 us direct, 186.6 / 186.6 us through the buffer;
# combine unchanged. (benchmarks/profile_normal.py, which neither flushes L2 nor aligns the ranks, had
# pointed the other way: trust the benchmark.)
DISPATCH_OWN_ROWS_DIRECT = True
COMBINE_OWN_ROWS_DIRECT = True

# Dispatch and combine senders can ask L2 for their next row while they move the current one (a bulk
# prefetch, sm_90). On 4 H200s at 166cfde it was never faster and often slower (benchmarks/results/send_share/
# README.md): at 3/8 and 11/24, cached dispatch 326.4 -> 315.1 us and combine 581.1 -> 561.0 us without it;
# at 1/2 and 1/4, 339.3 -> 341.7 and 780.9 -> 703.8. Off.
PREFETCH_NEXT_ROW = False


def dispatch_own_rows_direct() -> bool:
    return _tuned("dispatch_own_rows_direct", DISPATCH_OWN_ROWS_DIRECT)


def combine_own_rows_direct() -> bool:
    return _tuned("combine_own_rows_direct", COMBINE_OWN_ROWS_DIRECT)


def prefetch_next_row() -> bool:
    return _tuned("prefetch", PREFETCH_NEXT_ROW)


# Low-latency senders in one group of blocks per destination (NOTE [peer-major blocks] in
# kernels/low_latency.cuh). Writes to the own rank need no NVLink, so its group gets half the blocks of a
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

# A dispatch that waits on the CPU for the counts launches its senders before the wait and its receivers
# after it, so the rows travel while the host sizes the outputs. Off until measured on the device machine
# (tests/gpu/test_normal_cuda.py runs both ways).
SPLIT_DISPATCH_AROUND_CPU_WAIT = False


def fewest_sms(num_ranks: int) -> int:
    """The fewest SMs a rank's kernels work with: two blocks of a normal-mode kernel (a sender and a
    receiver or reducer), and in low-latency mode one block for the own rank and one per peer
    (low_latency_local_blocks)."""
    return max(2, num_ranks)


def layout_grid(num_tokens: int, threads: int, device_sms: int) -> int:
    return max(1, min(device_sms, (num_tokens + threads - 1) // threads))
