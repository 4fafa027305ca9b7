"""Normal-mode calls in rounds: any number of tokens through a fixed `num_nvl_bytes` budget.

NOTE [rounds]
A buffer of `num_nvl_bytes` carries at most ``capacity`` tokens per rank in one call
(workspace.normal_token_capacity). A call whose largest rank has more tokens than the round size R runs in
rounds: round r carries tokens ``[r*R, min((r+1)*R, T_s))`` of every rank s (a rank with fewer tokens sends
an empty round), each as one request to the backend. Since every rank's tokens are cut into contiguous
slices, the rows rank q receives from source s in round r are one contiguous range of the one-shot receive
order (NOTE [recv order] in routing.py: source rank major, then token index): they follow the rows of
every lower source (all rounds) and the rows of s in earlier rounds. So the outputs equal the one-shot
outputs bit for bit, every handle field keeps its canonical meaning (NOTE [handle contents]), and combine
sums each token in exactly one round, in the same order.

Example: 2 ranks, R = 2. Rank 0 sends its tokens 0..4 to rank 1, rank 1 sends its one token to itself.
One-shot, rank 1 receives [s0:t0 t1 t2 t3 t4, s1:t0]. Round 0 brings s0:t0 t1 and s1:t0 (final rows 0-1
and 5), round 1 s0:t2 t3 (rows 2-3), round 2 s0:t4 (row 4); rank 1 sends two empty rounds.

NOTE [placed rounds]
A round makes no tensors of its own: its request carries a `Placement`, and the backend writes the round's
rows straight into the whole call's receive tensors (dispatch), or reads them straight from the whole
call's `x` and writes its tokens' rows of the whole output (combine). The placement is, per source s, the
row where the round's first row from s goes: ``recv_first[r][s]`` = the rows from every lower source
plus the rows from s in earlier rounds (the example: recv_first[1] = [2, 6] on rank 1), and the round's
first token, added to recv_src_idx. The CUDA kernels address rows through it; the reference backend runs
the round as a call of its own and copies (routing.placed_rows).
In a fresh dispatch no host computes recv_first: round 0 carries the whole call (`WholeCall`: this rank's
tokens and what it sends each rank) into its count exchange, which so learns where each source's rows
start in the whole call, and each round's count exchange writes its recv_first from a cursor per source
(`Placement.cursor`) and moves the cursor past the round's rows (NOTE [notify] in kernels/notify.cuh).
So the rounds are sent back to back: no collective, no host sync and no host arithmetic between them
(the host was what kept the GPU idle between rounds, benchmarks/profile_rounds.py). Round 0's count
exchange also gives the whole call's rank_prefix_matrix, from which the whole call's handle and the
rounds' handles are made while the rounds run.
Round 0 without `num_worst_tokens` runs before the ranks know that there are rounds (below), so its
backend makes the whole call's tensors, of the rows the count exchange learned, and places round 0 in
them (one-shot, the whole call is round 0 and nothing changes); the rounds after it need no CPU wait.

Every rank must run the same rounds, so the round count n = ceil(max_s T_s / R) is agreed on:
- fresh dispatch: round 0's count exchange also carries every rank's whole token count, so the host
  learns n with round 0's counts (the call waits for the CPU anyway; a backend that does not report it
  adds one all-reduce, after round 0's count exchange, a bounded wait: NOTE [agree after the count
  exchange]).
- with `num_worst_tokens` = W: no host sync. W bounds num_ranks * tokens per rank, so n is
  ``ceil(ceil(W / num_ranks) / R)`` on every rank (a rank with more than n * R tokens is refused); the
  outputs have W rows, the padding values written when they are made.
- cached dispatch and combine replay the rounds stored on the handle (`DispatchHandle.rounds`) when they
  fit this call's rows; otherwise (a plain 6-tuple, or wider rows) the rounds are derived from the
  handle's six fields with an all-reduce of the token counts and an all-gather of every rank's tokens
  per (round, destination), ``counts[s, r, d]``, which gives every offset on the device.
Round handles (kept for combine and cached dispatch) have ``min(N, num_ranks * R)`` rows for N rows of
the whole call, -1 past the round's own, as a one-shot num_worst_tokens dispatch of the round's slices
makes them: their exact sizes would take a device-to-host copy.
Per-expert counts: round 0's request carries the caller's whole ``num_tokens_per_expert`` and later rounds
zeros, so round 0's list is the one-shot list (backends only sum those counts).

Round size: ``per_round_tokens`` if given, else the capacity for the dispatch rows and, so that the
combine can replay the dispatch's rounds, for the combine rows of the same hidden size and top-k.

Streams: the rounds run one after another on the stream the call runs on (the Buffer's communication
stream), so `async_finish`, `previous_event` and `allocate_on_comm_stream` hold for the call as a whole;
the rounds' own tensors (round handles, offsets) are made and used on that stream only. Each round is a
whole backend call, its count exchange included: round r + 1's exchange does not overlap round r's
transfer (that needs a backend that alternates two halves of its buffer).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from . import checks
from .backends.collectives import Collectives
from .backends.requests import CombineRequest, DispatchRequest, DispatchResult, Placement, WholeCall
from .errors import InvalidInputError
from .handle import DispatchHandle
from .plan import workspace
from .semantics import routing


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rows(t: Optional[torch.Tensor], begin: int, end: int) -> Optional[torch.Tensor]:
    return None if t is None else t[begin:end]


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The rounds of one dispatch, kept on its handle (`DispatchHandle.rounds`) for combine and cached
    dispatch. Identical on every rank except `handles` and `recv_first`.

    round_tokens: each rank's tokens are cut into slices of this many.
    num_rounds: 1 means one-shot (the handle itself is the round's handle).
    max_round_tokens: the most tokens any rank sends in one round; a call whose round size is at least
        this replays these rounds.
    most_tokens: the most tokens any rank dispatched, where the dispatch learned it (None with
        num_worst_tokens): a call that cannot replay these rounds derives its own from it without a host sync.
    handles: per round, its handle, as a one-shot dispatch of the slices makes it; empty when one-shot.
    recv_first: per round, ``[R]`` int32 on the device: where the round's rows from source s start in the
        whole call's receive order (NOTE [placed rounds]); None when one-shot.
    """

    round_tokens: int
    num_rounds: int
    max_round_tokens: int
    most_tokens: Optional[int] = None
    handles: Tuple[DispatchHandle, ...] = ()
    recv_first: Optional[Tuple[torch.Tensor, ...]] = None

    def bounds(self, r: int, num_tokens: int) -> Tuple[int, int]:
        """Tokens [begin, end) of a rank with `num_tokens` tokens in round r."""
        begin = min(r * self.round_tokens, num_tokens)
        return begin, min(begin + self.round_tokens, num_tokens)

    def fits(self, round_tokens: int) -> bool:
        return self.max_round_tokens <= round_tokens


# --------------------------------------------------------------------------------------------------
# offsets from the count matrix
# --------------------------------------------------------------------------------------------------

def per_round_counts(is_token_in_rank: torch.Tensor, round_tokens: int, num_rounds: int) -> torch.Tensor:
    """``[num_rounds, R]`` int32: this rank's tokens of each round that go to each rank."""
    num_tokens, num_ranks = is_token_in_rank.shape
    padded = is_token_in_rank.new_zeros(num_rounds * round_tokens, num_ranks)
    padded[:num_tokens] = is_token_in_rank
    return padded.view(num_rounds, round_tokens, num_ranks).sum(1, dtype=torch.int32)


class _Offsets:
    """Offsets of every round from ``counts[s, r, d]`` (int64, the same on every rank), on the device, for
    rounds derived from a handle's fields (`derive`); each is made when first asked for."""

    def __init__(self, counts: torch.Tensor, rank: int):
        self.counts, self.rank = counts, rank

    @functools.cached_property
    def total(self) -> torch.Tensor:
        return self.counts.sum(1)                               # [s, d] rows s sends d, all rounds

    @functools.cached_property
    def final_excl(self) -> torch.Tensor:
        return self.total.cumsum(0) - self.total                # [s, d] rows on d before source s

    @functools.cached_property
    def prior(self) -> torch.Tensor:
        return self.counts.cumsum(1) - self.counts              # [s, r, d] rows s sent d in rounds < r

    @functools.cached_property
    def round_excl(self) -> torch.Tensor:
        return self.counts.cumsum(0) - self.counts              # [s, r, d] rows on d before s in round r

    @functools.cached_property
    def recv_first(self) -> torch.Tensor:
        """Per round r, [s]: where round r's rows from source s start on this rank (NOTE [placed rounds]);
        contiguous, as the kernels read it (a sum with a transposed view would be laid out like the view)."""
        column = self.counts[:, :, self.rank].t()              # [r, s] rows s sends this rank in round r
        mine = column.sum(0)
        before = (mine.cumsum(0) - mine).unsqueeze(0)           # rows from lower sources, all rounds
        return (before + column.cumsum(0) - column).to(torch.int32).contiguous().unbind(0)

    def shift(self, r: int) -> torch.Tensor:
        """[d]: this rank's token at row j of round r's rows on d lands at row j + shift one-shot."""
        return self.final_excl[self.rank] + self.prior[self.rank, r] - self.round_excl[self.rank, r]

    def round_handle_fields(self, r: int):
        """rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix of round r."""
        counts_r = self.counts[:, r, :]
        return (counts_r.cumsum(0).to(torch.int32).contiguous(), counts_r[self.rank].to(torch.int32).view(-1, 1),
                self.round_excl[:, r, self.rank].to(torch.int32).view(-1, 1))


# --------------------------------------------------------------------------------------------------
# the calls
# --------------------------------------------------------------------------------------------------

def _round_request(request: DispatchRequest, r: int, begin: int, end: int, placement: Placement,
                   call: Optional[WholeCall]) -> DispatchRequest:
    """Round r's request: tokens [begin, end) of this rank, the whole per-expert count in round 0 only."""
    if r == 0 and end == request.x.size(0):
        return request.whole_round(placement, call)
    in_rank = request.is_token_in_rank[begin:end]
    per_expert = request.num_tokens_per_expert
    return dataclasses.replace(
        request, x=request.x[begin:end], x_scales=_rows(request.x_scales, begin, end),
        topk_idx=_rows(request.topk_idx, begin, end), topk_weights=_rows(request.topk_weights, begin, end),
        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert if r == 0 else torch.zeros_like(per_expert),
        num_worst_tokens=0, placement=placement, call=call, check=request.check if r == 0 else None)


def _int32(shape, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int32, device=device)


def dispatch(backend, request: DispatchRequest, *, round_tokens: int, exchange: Collectives,
             check_values: bool) -> Tuple[DispatchResult, Rounds]:
    """A fresh dispatch in rounds of `round_tokens` tokens per rank (one-shot where one round is enough).

    Round 0 is the same request whatever the round count, so it is sent while the ranks agree on the
    count; where every rank fits in one round, it is the whole call.

    Raises:
        InvalidInputError: with `num_worst_tokens`, more tokens than its fixed rounds carry, or (with
            `check_values`) more received rows than num_worst_tokens on some rank.
    """
    num_ranks, num_tokens, num_worst = exchange.num_ranks, request.x.size(0), request.num_worst_tokens
    if num_worst:
        num_rounds = max(1, _ceil_div(_ceil_div(num_worst, num_ranks), round_tokens))
        if num_tokens > num_rounds * round_tokens:
            raise InvalidInputError(
                f"dispatch of {num_tokens} tokens with num_worst_tokens={num_worst} on {num_ranks} ranks: the "
                f"rounds are fixed without a host sync at {num_rounds} of {round_tokens} tokens "
                f"(num_worst_tokens / num_ranks tokens per rank), which carry at most {num_rounds * round_tokens}; "
                f"pass num_worst_tokens >= {num_tokens * num_ranks} or give the Buffer more num_nvl_bytes")
        rounds = Rounds(round_tokens, num_rounds, round_tokens)
        if num_rounds == 1:
            return backend.dispatch(request), rounds
        return _dispatch_rounds(backend, request, rounds, check_values)
    # NOTE [agree after the count exchange]: a rank that skips this call must make the others fail in round
    # 0's count exchange, a bounded wait that raises CommTimeoutError, and not leave them inside a host
    # collective it never joins: that collective would pair with the skipping rank's next one (a barrier,
    # a new Buffer's handle exchange) and every later call would hang. So round 0 goes first, and its count
    # exchange also carries every rank's whole token count (WholeCall), which gives the round count
    # with no collective of its own; a backend that does not report it (most_call_tokens None) has the
    # count agreed on once round 0's exchange has succeeded on this rank, on a stream of its own so that
    # it does not wait for round 0's transfer.
    round_0, call, placement = first_round(request, round_tokens)
    return after_first_round(backend, request, backend.dispatch(round_0), call, placement, round_tokens, exchange,
                             check_values)


def first_round(request: DispatchRequest, round_tokens: int) -> Tuple[DispatchRequest, WholeCall, Placement]:
    """Round 0 of a fresh dispatch without num_worst_tokens (the whole call where one round holds it): its
    request, the whole call its count exchange shares, its placement."""
    num_ranks, device = request.is_token_in_rank.size(1), request.x.device
    call = _whole_call(request)
    placement = Placement(_int32(num_ranks, device), None, 0, _int32(num_ranks, device))
    return _round_request(request, 0, 0, min(request.x.size(0), round_tokens), placement, call), call, placement


def after_first_round(backend, request: DispatchRequest, first: DispatchResult, call: WholeCall, placement: Placement,
                      round_tokens: int, exchange: Collectives, check_values: bool) -> Tuple[DispatchResult, Rounds]:
    """A fresh dispatch without num_worst_tokens once round 0 (`first_round`) has run as `first`: the rounds
    the call takes, those after round 0 sent."""
    num_tokens = request.x.size(0)
    most = first.most_call_tokens if first.most_call_tokens is not None else exchange.max_int(num_tokens)
    rounds = Rounds(round_tokens, max(1, _ceil_div(most, round_tokens)), min(round_tokens, most), most)
    if rounds.num_rounds == 1:
        return first, rounds
    return _dispatch_rounds(backend, request, rounds, check_values, (first, call, placement))


def _whole_call(request: DispatchRequest) -> WholeCall:
    """The whole call round 0's count exchange shares (its prefix matrix written by that exchange)."""
    num_ranks = request.is_token_in_rank.size(1)
    return WholeCall(request.x.size(0), request.num_tokens_per_rank.to(torch.int32).contiguous(),
                     _int32((num_ranks, num_ranks), request.x.device))


def _whole_outputs(backend, request: DispatchRequest, num_rows: int) -> Tuple[Optional[torch.Tensor], ...]:
    """The whole call's (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx) of a
    `num_worst_tokens` dispatch, which its rounds fill; the rows none fills keep the padding values of
    docs/semantics.md (-1 indices and sources, 0 weights)."""
    x, scales, topk_idx, weights = request.x, request.x_scales, request.topk_idx, request.topk_weights

    def padded(row_shape, dtype, value):
        return torch.full((num_rows,) + tuple(row_shape), value, dtype=dtype, device=x.device)

    return (backend.empty(num_rows, *x.shape[1:], dtype=x.dtype, device=x.device),
            None if scales is None else backend.empty(num_rows, *scales.shape[1:], dtype=scales.dtype, device=x.device),
            padded(topk_idx.shape[1:], topk_idx.dtype, -1),
            None if weights is None else padded(topk_idx.shape[1:], torch.float32, 0), padded((), torch.int32, -1))


def _round_src_idx(recv_src_idx: torch.Tensor, rank_prefix_matrix: torch.Tensor, rank: int,
                   recv_first: torch.Tensor, num_round_rows: int, token_base: int) -> torch.Tensor:
    """A round handle's recv_src_idx, read from the whole call's: the round's own token indices, -1 on its
    padding rows (and on rows past the whole call's, which the kernels dropped)."""
    index = routing.placed_rows(rank_prefix_matrix, rank, recv_first, num_round_rows)
    valid = (index >= 0) & (index < recv_src_idx.size(0))
    taken = recv_src_idx[index.clamp(0, max(recv_src_idx.size(0) - 1, 0))] if recv_src_idx.numel() else index
    return torch.where(valid, taken - token_base, -1).to(torch.int32)


def _dispatch_rounds(backend, request: DispatchRequest, rounds: Rounds, check_values: bool,
                     started: Optional[Tuple[DispatchResult, WholeCall, Placement]] = None
                     ) -> Tuple[DispatchResult, Rounds]:
    """Rounds of a fresh dispatch, round 0 already sent where `started` holds its (result, call, placement):
    see NOTE [rounds]. Each round's count exchange places it (Placement.cursor), so the rounds are sent
    back to back with no collective and no host sync between them, and the handles are made while they run."""
    x, device, num_ranks, rank = request.x, request.x.device, request.is_token_in_rank.size(1), backend.ctx.rank
    num_tokens, num_worst, round_tokens = x.size(0), request.num_worst_tokens, rounds.round_tokens
    if started is not None:  # round 0 made the whole call's tensors (NOTE [placed rounds])
        first, call, placement = started
        parts = [first]
        outputs = (first.recv_x, first.recv_x_scales, first.recv_topk_idx, first.recv_topk_weights,
                   first.handle.recv_src_idx)
    else:
        call, parts = _whole_call(request), []
        outputs = _whole_outputs(backend, request, num_worst)
        placement = Placement(_int32(num_ranks, device), outputs, 0, _int32(num_ranks, device))
    recv_firsts = [placement.recv_first]
    for r in range(len(parts), rounds.num_rounds):
        begin, end = rounds.bounds(r, num_tokens)
        if r > 0:
            placement = dataclasses.replace(placement, recv_first=_int32(num_ranks, device), outputs=outputs,
                                            token_base=r * round_tokens)  # every source's round starts there
            recv_firsts.append(placement.recv_first)
        parts.append(backend.dispatch(_round_request(request, r, begin, end, placement, call if r == 0 else None)))
        if r == 0 and num_worst and check_values:  # round 0's count exchange gave every rank's received rows
            checks.received_rows(call.prefix_matrix[-1], num_worst)
    # The handles: round r's rows on destination d land, in the whole call, after every lower source's rows
    # (the whole call's rank_prefix_matrix) and this rank's rows of earlier rounds, instead of after the
    # lower sources' rows of round r (the round's).
    # A round handle is sized like a one-shot num_worst_tokens dispatch of the round's slices: its rows on
    # the host would take a device-to-host copy, and a backend asks none of a placed round's handle.
    num_rows = outputs[0].size(0)
    round_rows = min(num_rows, num_ranks * round_tokens)
    per_rank = request.num_tokens_per_rank.to(torch.int32)
    shift = call.prefix_matrix[rank] - per_rank                   # rows on d before this rank, whole call
    send_head = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=device)
    handles = []
    for r, part in enumerate(parts):
        begin, end = rounds.bounds(r, num_tokens)
        round_handle, sent = part.handle, part.handle.channel_prefix_matrix[:, 0]
        head = round_handle.send_head
        round_shift = shift - (round_handle.rank_prefix_matrix[rank] - sent)
        send_head[begin:end] = torch.where(head >= 0, head + round_shift, -1)
        shift = shift + sent
        fields = list(round_handle)
        fields[3] = _round_src_idx(outputs[4], round_handle.rank_prefix_matrix, rank, recv_firsts[r], round_rows,
                                   r * round_tokens)
        handles.append(DispatchHandle(*fields))
    per_expert_list = [] if num_worst else parts[0].num_recv_tokens_per_expert_list  # num_worst: as one-shot
    recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs
    handle = DispatchHandle(call.prefix_matrix, per_rank.view(-1, 1).clone(), recv_firsts[0].view(-1, 1),
                            recv_src_idx, request.is_token_in_rank, send_head)
    result = DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle)
    return result, dataclasses.replace(rounds, handles=tuple(handles), recv_first=tuple(recv_firsts))


def cached_dispatch(backend, request: DispatchRequest, rounds: Rounds) -> DispatchResult:
    """A dispatch with a handle, replaying `rounds` (from `plan_for`)."""
    if rounds.num_rounds == 1:
        return backend.dispatch(request)
    handle, x, scales = request.handle, request.x, request.x_scales
    recv_x = backend.empty(handle.num_rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    recv_scales = None if scales is None else backend.empty(handle.num_rows, *scales.shape[1:], dtype=scales.dtype,
                                                           device=x.device)
    outputs = (recv_x, recv_scales, None, None, None)
    for r, round_handle in enumerate(rounds.handles):
        begin, end = rounds.bounds(r, handle.num_tokens)
        backend.dispatch(dataclasses.replace(
            request, x=x[begin:end], x_scales=_rows(scales, begin, end),
            is_token_in_rank=round_handle.is_token_in_rank, handle=round_handle,
            placement=Placement(rounds.recv_first[r], outputs, r * rounds.round_tokens)))
    return DispatchResult(recv_x, recv_scales, None, None, None, handle)


def combine(backend, request: CombineRequest, rounds: Rounds):
    """A combine replaying `rounds` (from `plan_for`): -> (combined_x, combined_topk_weights)."""
    if rounds.num_rounds == 1:
        return backend.combine(request)
    x, weights, num_tokens = request.x, request.topk_weights, request.handle.num_tokens
    combined_x = backend.empty(num_tokens, x.size(1), dtype=x.dtype, device=x.device)
    combined_w = None if weights is None else backend.empty(num_tokens, weights.size(1), dtype=torch.float32,
                                                            device=x.device)
    for r, round_handle in enumerate(rounds.handles):
        begin, end = rounds.bounds(r, num_tokens)
        backend.combine(dataclasses.replace(
            request, handle=round_handle, bias_0=_rows(request.bias_0, begin, end),
            bias_1=_rows(request.bias_1, begin, end),
            placement=Placement(rounds.recv_first[r], (combined_x[begin:end], _rows(combined_w, begin, end)))))
    return combined_x, combined_w


def derive(handle: DispatchHandle, round_tokens: int, exchange: Collectives, most: Optional[int] = None) -> Rounds:
    """The rounds of `round_tokens` tokens for a handle's layout, from its six fields: a collective for the
    largest rank's token count unless `most` gives it, and one more where there are several rounds.

    Each round's handle is the one a one-shot dispatch of the round's slices makes (NOTE [handle contents]).
    """
    num_tokens, rank = handle.num_tokens, exchange.rank
    if most is None:
        most = exchange.max_int(num_tokens)
    num_rounds = max(1, _ceil_div(most, round_tokens))
    rounds = Rounds(round_tokens, num_rounds, min(round_tokens, most), most)
    if num_rounds == 1:
        return rounds
    counts = exchange.all_gather(per_round_counts(handle.is_token_in_rank, round_tokens, num_rounds)).long()
    offsets = _Offsets(counts, rank)
    round_rows = min(handle.num_rows, exchange.num_ranks * round_tokens)  # as _dispatch_rounds sizes them
    handles = []
    for r in range(num_rounds):
        begin, end = rounds.bounds(r, num_tokens)
        head = handle.send_head[begin:end]
        send_head = torch.where(head >= 0, head - offsets.shift(r), -1).to(torch.int32)
        fields = offsets.round_handle_fields(r)
        recv_src_idx = _round_src_idx(handle.recv_src_idx, fields[0], rank, offsets.recv_first[r], round_rows,
                                      r * round_tokens)
        handles.append(DispatchHandle(*fields, recv_src_idx, handle.is_token_in_rank[begin:end], send_head))
    return dataclasses.replace(rounds, handles=tuple(handles), recv_first=offsets.recv_first)


def plan_for(handle: DispatchHandle, round_tokens: int, exchange: Collectives) -> Rounds:
    """The rounds a cached dispatch or combine with rounds of at most `round_tokens` runs: the handle's
    own where they fit, else derived (every rank decides alike: stored rounds are the same everywhere, and
    so is whether they fit, which the fast paths check too: NOTE [fast paths])."""
    stored = getattr(handle, "rounds", None)
    if stored is not None and stored.fits(round_tokens):
        return stored
    return derive(handle, round_tokens, exchange, None if stored is None else stored.most_tokens)


# --------------------------------------------------------------------------------------------------
# what a problem needs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NormalRoundPlan:
    """What `Buffer.normal_round_plan` reports for dispatch and combine of one problem.

    buffer_bytes: the `num_nvl_bytes` the Buffer holds (after TOKENYARD_NVL_BUFFER_BYTES).
    one_shot_bytes: the `num_nvl_bytes` that runs both calls in one round.
    min_bytes: the `num_nvl_bytes` of rounds of one token; below it the calls cannot run.
    dispatch_row_bytes, combine_row_bytes: one row of each call (NOTE [normal-mode buffer]).
    round_tokens: tokens per rank per round (0: the calls cannot run in this Buffer).
    num_rounds: rounds when the largest rank has `num_tokens` tokens (0: cannot run).
    """

    num_tokens: int
    buffer_bytes: int
    one_shot_bytes: int
    min_bytes: int
    dispatch_row_bytes: int
    combine_row_bytes: int
    round_tokens: int
    num_rounds: int


def round_plan(num_nvl_bytes: int, num_ranks: int, num_tokens: int, dispatch_row_bytes: int,
               combine_row_bytes: int, per_round_tokens: Optional[int]) -> NormalRoundPlan:
    rows = (dispatch_row_bytes, combine_row_bytes)
    capacity = min(workspace.normal_token_capacity(num_nvl_bytes, num_ranks, row) for row in rows)
    round_tokens = capacity
    if per_round_tokens is not None:
        round_tokens = per_round_tokens if per_round_tokens <= capacity else 0
    num_rounds = max(1, _ceil_div(num_tokens, round_tokens)) if round_tokens else 0

    def needed(tokens: int) -> int:
        return max(workspace.normal_required_bytes(num_ranks, tokens, row) for row in rows)

    return NormalRoundPlan(num_tokens, num_nvl_bytes, needed(max(num_tokens, 1)), needed(1), dispatch_row_bytes,
                           combine_row_bytes, round_tokens, num_rounds)

