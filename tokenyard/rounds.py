"""Normal-mode calls in rounds: any number of tokens through a fixed `num_nvl_bytes` budget.

NOTE [rounds]
A buffer of `num_nvl_bytes` carries at most ``capacity`` tokens per rank in one call
(workspace.normal_token_capacity). A call whose largest rank has more tokens than the round size R runs in
rounds: round r carries tokens ``[r*R, min((r+1)*R, T_s))`` of every rank s (a rank with fewer tokens sends
an empty round), each as an ordinary one-call request to the backend, and this module assembles the
outputs. Since every rank's tokens are cut into contiguous slices, the rows rank q receives from source s
in round r are one contiguous range of the one-shot receive order (NOTE [recv order] in routing.py: source
rank major, then token index): they follow the rows of every lower source (all rounds) and the rows of s
in earlier rounds. So the outputs are slice copies of the rounds' outputs, equal to the one-shot outputs
bit for bit, every handle field keeps its canonical meaning (NOTE [handle contents]), and combine sums
each token in exactly one round, in the same order.

Example: 2 ranks, R = 2. Rank 0 sends its tokens 0..4 to rank 1, rank 1 sends its one token to itself.
One-shot, rank 1 receives [s0:t0 t1 t2 t3 t4, s1:t0]. Round 0 brings s0:t0 t1 and s1:t0 (final rows 0-1
and 5), round 1 s0:t2 t3 (rows 2-3), round 2 s0:t4 (row 4); rank 1 sends two empty rounds.

Every rank must run the same rounds, so the round count n = ceil(max_s T_s / R) is agreed on:
- fresh dispatch: one all-reduce of the token counts (the call waits for the CPU anyway), then, when
  n > 1, one all-gather of every rank's tokens per (round, destination); that count matrix
  ``counts[s, r, d]`` gives every offset on the host. The all-reduce comes after round 0's backend call,
  whose count exchange is a bounded wait (NOTE [agree after the count exchange]). Later rounds run
  without a CPU wait (NOTE [rounds without a CPU wait]).
- with `num_worst_tokens` = W: no host sync. W bounds num_ranks * tokens per rank, so n is
  ``ceil(ceil(W / num_ranks) / R)`` on every rank (a rank with more than n * R tokens is refused); the
  count matrix stays on the device and rows are placed with ``index_copy_``; each round's request has
  ``min(W, num_ranks * R)`` worst-case rows.
- cached dispatch and combine replay the rounds stored on the handle (`DispatchHandle.rounds`) when they
  fit this call's rows; otherwise (a plain 6-tuple, or wider rows) the rounds are derived from the
  handle's six fields with the same two collectives.
Per-expert counts: round 0's request carries the caller's whole ``num_tokens_per_expert`` and later rounds
zeros, so round 0's list is the one-shot list (backends only sum those counts).

Round size: ``per_round_tokens`` if given, else the capacity for the dispatch rows and, so that the
combine can replay the dispatch's rounds, for the combine rows of the same hidden size and top-k.

Streams: the rounds run one after another on the stream the call runs on (the Buffer's communication
stream), so `async_finish`, `previous_event` and `allocate_on_comm_stream` hold for the call as a whole;
the rounds' own tensors (round handles, offsets) are made and used on that stream only. Each round is a
whole backend call, its count exchange included: round r + 1's exchange does not yet overlap round r's
transfer (that needs a backend that alternates two halves of its buffer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import workspace
from .errors import CommTimeoutError, InvalidInputError
from .handle import DispatchHandle
from .requests import CombineRequest, DispatchRequest, DispatchResult
from .waiting import wait_until


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rows(t: Optional[torch.Tensor], begin: int, end: int) -> Optional[torch.Tensor]:
    return None if t is None else t[begin:end]


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """A view index_copy_ accepts: FP8 has no index kernels, so 1-byte dtypes move as uint8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


# --------------------------------------------------------------------------------------------------
# where one round's rows go in the final receive order
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spans:
    """Host offsets: ``(round_row, final_row, num_rows)`` per source with rows in the round."""

    spans: Tuple[Tuple[int, int, int], ...]
    num_rows: int  # rows of the round

    def put(self, final: torch.Tensor, part: torch.Tensor) -> None:
        for round_row, final_row, num_rows in self.spans:
            final.narrow(0, final_row, num_rows).copy_(part.narrow(0, round_row, num_rows))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The round's rows of a tensor in the final order (a view where they are one range)."""
        if len(self.spans) == 1:
            return full.narrow(0, self.spans[0][1], self.num_rows)
        part = full.new_empty((self.num_rows,) + tuple(full.shape[1:]))
        for round_row, final_row, num_rows in self.spans:
            part.narrow(0, round_row, num_rows).copy_(full.narrow(0, final_row, num_rows))
        return part


@dataclasses.dataclass(frozen=True)
class Scatter:
    """Device offsets (`num_worst_tokens`): ``index[i]`` is the final row of round row i, or `dump`
    (= the final row count) for the round's padding rows and for rows past the final count."""

    index: torch.Tensor
    dump: int

    def put(self, final: torch.Tensor, part: torch.Tensor) -> None:
        _indexable(final).index_copy_(0, self.index[:part.size(0)], _indexable(part))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        # Padding rows read some valid row: a backend reads only the rows its handle counts.
        return full.index_select(0, self.index.clamp_max(max(self.dump - 1, 0)))


Place = Union[Spans, Scatter]


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The rounds of one dispatch, kept on its handle (`DispatchHandle.rounds`) for combine and cached
    dispatch. Identical on every rank except `handles` and `places`.

    round_tokens: each rank's tokens are cut into slices of this many.
    num_rounds: 1 means one-shot (the handle itself is the round's handle).
    max_round_tokens: the most tokens any rank sends in one round; a call whose round size is at least
        this replays these rounds.
    handles, places: per round, its handle (as a one-shot dispatch of the slices makes it) and where its
        rows sit in the final receive order; empty when one-shot.
    """

    round_tokens: int
    num_rounds: int
    max_round_tokens: int
    handles: Tuple[DispatchHandle, ...] = ()
    places: Tuple[Place, ...] = ()

    def bounds(self, r: int, num_tokens: int) -> Tuple[int, int]:
        """Tokens [begin, end) of a rank with `num_tokens` tokens in round r."""
        begin = min(r * self.round_tokens, num_tokens)
        return begin, min(begin + self.round_tokens, num_tokens)

    def fits(self, round_tokens: int) -> bool:
        return self.max_round_tokens <= round_tokens


class Exchange:
    """The two small collectives the rounds need, over the Buffer's group (on its device: CPU for gloo,
    CUDA for NCCL), or over an mpi4py communicator's `allgather` where there is no group."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, rank: int, num_ranks: int,
                 all_gather_object: Callable, timeout_s: float = 100.0):
        self.group, self.device, self.rank, self.num_ranks = group, device, rank, num_ranks
        self._all_gather_object = all_gather_object
        self.timeout_s = timeout_s
        self._stream = None  # CUDA: max_int's own stream

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks (a host sync).

        On CUDA the all-reduce and a copy into pinned memory run on a stream of their own, so they wait for
        none of the work queued before them, and the wait is for them alone (an event), bounded: a rank
        that failed round 0 after this one passed it never joins.
        """
        if self.group is None:
            return max(self._all_gather_object(int(value)))
        if self.device.type != "cuda":
            t = torch.full((1,), value, dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            return int(t[0])
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            t = torch.full((1,), value, dtype=torch.int64, device=self.device)  # no host-to-device copy
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        if not wait_until(done.query, self.timeout_s):
            raise CommTimeoutError(self.rank, -1, "dispatch/rounds",
                                   "the ranks did not agree on the round count; destroy this Buffer")
        return int(host[0])

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[num_ranks, *t.shape]``: every rank's `t` (no host sync on a group)."""
        if self.group is None:
            return torch.stack([p.to(t.device) for p in self._all_gather_object(t.cpu())])
        pieces = [torch.empty_like(t) for _ in range(self.num_ranks)]
        dist.all_gather(pieces, t.contiguous(), group=self.group)
        return torch.stack(pieces)


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
    """Offsets of every round from ``counts[s, r, d]`` (int64, the same on every rank), on the device."""

    def __init__(self, counts: torch.Tensor, rank: int):
        self.counts, self.rank = counts, rank
        total = counts.sum(1)                                   # [s, d] rows s sends d, all rounds
        self.final_excl = total.cumsum(0) - total               # [s, d] rows on d before source s
        self.prior = counts.cumsum(1) - counts                  # [s, r, d] rows s sent d in rounds < r
        self.round_excl = counts.cumsum(0) - counts             # [s, r, d] rows on d before s in round r
        self.rank_prefix_matrix = total.cumsum(0).to(torch.int32)
        self.channel_prefix_matrix = total[rank].to(torch.int32).view(-1, 1)
        self.recv_channel_prefix_matrix = self.final_excl[:, rank].to(torch.int32).view(-1, 1)
        # [r, d]: this rank's token at row j of round r's rows on d lands at row j + shift[r, d] one-shot.
        self.shift = self.final_excl[rank].unsqueeze(0) + self.prior[rank] - self.round_excl[rank]

    def round_handle_fields(self, r: int):
        """rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix of round r."""
        counts_r = self.counts[:, r, :]
        return (counts_r.cumsum(0).to(torch.int32), counts_r[self.rank].to(torch.int32).view(-1, 1),
                self.round_excl[:, r, self.rank].to(torch.int32).view(-1, 1))

    def scatter(self, r: int, num_round_rows: int, num_rows: int) -> Scatter:
        """Round r's rows (`num_round_rows` of them, padding included) in a final order of `num_rows`."""
        num_ranks = self.counts.size(0)
        column = self.counts[:, r, self.rank]
        row = torch.arange(num_round_rows, device=column.device)
        source = torch.searchsorted(column.cumsum(0), row, right=True)   # num_ranks past the round's rows
        valid = source < num_ranks
        source = source.clamp_max(num_ranks - 1)
        dest = (self.final_excl[:, self.rank][source] + self.prior[:, r, self.rank][source] + row
                - self.round_excl[:, r, self.rank][source])
        return Scatter(torch.where(valid & (dest < num_rows), dest, num_rows), num_rows)


def _spans(host: List[List[List[int]]], rank: int) -> List[Spans]:
    """Host twin of `_Offsets.scatter`, for every round, from ``host[s][r][d]`` (no padding rows)."""
    columns = [[per_round[rank] for per_round in per_source] for per_source in host]   # [s][r] rows to rank
    first, source_first = 0, []
    for column in columns:
        source_first.append(first)
        first += sum(column)
    prior = [0] * len(columns)
    out = []
    for r in range(len(columns[0])):
        spans, round_row = [], 0
        for s, column in enumerate(columns):
            if column[r]:
                spans.append((round_row, source_first[s] + prior[s], column[r]))
            round_row += column[r]
            prior[s] += column[r]
        out.append(Spans(tuple(spans), round_row))
    return out


class _Final:
    """One output of a rounded call, allocated like the first round's part and filled round by round.

    With `dump` (the `Scatter` case) it has one extra row that padding rows land in, and the rows no round
    fills keep `fill` (``-1`` for recv_topk_idx and recv_src_idx, ``0`` for weights, as docs/semantics.md
    has them); without, the rounds fill every row.
    """

    def __init__(self, num_rows: int, dump: bool, fill=None):
        self.num_rows, self.dump, self.fill, self.tensor = num_rows, dump, fill, None

    def put(self, place: Place, part: Optional[torch.Tensor]) -> None:
        if part is None:
            return
        if self.tensor is None:
            shape = (self.num_rows + int(self.dump),) + tuple(part.shape[1:])
            fill = self.fill if self.dump else None
            self.tensor = part.new_empty(shape) if fill is None else part.new_full(shape, fill)
        place.put(self.tensor, part)

    def result(self) -> Optional[torch.Tensor]:
        if self.tensor is None or not self.dump:
            return self.tensor
        return self.tensor[:self.num_rows]


# --------------------------------------------------------------------------------------------------
# the calls
# --------------------------------------------------------------------------------------------------

def _round_request(request: DispatchRequest, r: int, begin: int, end: int, round_rows: int) -> DispatchRequest:
    """Round r's request: tokens [begin, end) of this rank, the whole per-expert count in round 0 only."""
    if begin == 0 and end == request.x.size(0) and round_rows == request.num_worst_tokens:
        return request
    in_rank = request.is_token_in_rank[begin:end]
    per_expert = request.num_tokens_per_expert
    return dataclasses.replace(
        request, x=request.x[begin:end], x_scales=_rows(request.x_scales, begin, end),
        topk_idx=_rows(request.topk_idx, begin, end), topk_weights=_rows(request.topk_weights, begin, end),
        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert if r == 0 else torch.zeros_like(per_expert), num_worst_tokens=round_rows)


def dispatch(backend, request: DispatchRequest, *, round_tokens: int, exchange: Exchange,
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
        return _dispatch_rounds(backend, request, rounds, exchange, check_values, None)
    # NOTE [agree after the count exchange]: a rank that skips this call must make the others fail in round
    # 0's count exchange, a bounded wait that raises CommTimeoutError, and not leave them inside a host
    # collective it never joins: that collective would pair with the skipping rank's next one (a barrier,
    # a new Buffer's handle exchange) and every later call would hang. So the round count is agreed on
    # only once round 0's exchange has succeeded on this rank, on a stream of its own so that it does not
    # wait for round 0's transfer.
    first = backend.dispatch(_round_request(request, 0, 0, min(num_tokens, round_tokens), 0))
    most = exchange.max_int(num_tokens)
    rounds = Rounds(round_tokens, max(1, _ceil_div(most, round_tokens)), min(round_tokens, most))
    if rounds.num_rounds == 1:
        return first, rounds
    return _dispatch_rounds(backend, request, rounds, exchange, check_values, first)


def _dispatch_rounds(backend, request: DispatchRequest, rounds: Rounds, exchange: Exchange, check_values: bool,
                     first: Optional[DispatchResult]) -> Tuple[DispatchResult, Rounds]:
    """Rounds of a fresh dispatch (round 0's result already in `first` where given): see NOTE [rounds]."""
    x, num_ranks, rank = request.x, exchange.num_ranks, exchange.rank
    num_tokens, num_worst, round_tokens = x.size(0), request.num_worst_tokens, rounds.round_tokens
    in_rank = request.is_token_in_rank
    counts = exchange.all_gather(per_round_counts(in_rank, round_tokens, rounds.num_rounds)).long()
    offsets = _Offsets(counts, rank)
    host = None
    if num_worst:
        num_rows, round_rows = num_worst, min(num_worst, num_ranks * round_tokens)
        if check_values:  # every rank holds all counts, so every rank raises together
            most_rows, which = (int(v) for v in torch.max(counts.sum((0, 1)), dim=0))
            if most_rows > num_worst:
                raise InvalidInputError(f"rank {which} receives {most_rows} tokens, more than "
                                        f"num_worst_tokens={num_worst}")
    else:
        host_counts = counts.tolist()  # [s][r][d], one device-to-host copy for everything below
        host = _spans(host_counts, rank)
        num_rows, round_rows = sum(place.num_rows for place in host), 0
        # NOTE [rounds without a CPU wait]: every rank now knows every round's receive counts, so rounds
        # after the first are sized for the most rows any rank receives in them, the same number on every
        # rank, and run as num_worst_tokens calls: no CPU wait, so the host queues round r + 1 while round r
        # is still moving. Each rank keeps its own rows (the spans), and its round handles hold only those;
        # the padding rows are dropped.
        most_per_round = [max(sum(per_source[r][d] for per_source in host_counts) for d in range(num_ranks))
                          for r in range(rounds.num_rounds)]
    dump = host is None
    outputs = [_Final(num_rows, dump), _Final(num_rows, dump), _Final(num_rows, dump, -1),
               _Final(num_rows, dump, 0), _Final(num_rows, dump, -1)]
    send_head = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=x.device)
    handles, places, per_expert_list = [], [], None
    for r in range(rounds.num_rounds):
        begin, end = rounds.bounds(r, num_tokens)
        if first is not None:  # round 0, sent while the ranks agreed on the round count
            part, first = first, None
        else:
            part = backend.dispatch(_round_request(request, r, begin, end,
                                                   round_rows if dump else int(most_per_round[r])))
        place = offsets.scatter(r, part.recv_x.size(0), num_rows) if dump else host[r]
        round_handle = part.handle
        for final, piece in zip(outputs, (part.recv_x, part.recv_x_scales, part.recv_topk_idx,
                                          part.recv_topk_weights, round_handle.recv_src_idx + r * round_tokens)):
            final.put(place, piece)
        head = round_handle.send_head
        send_head[begin:end] = torch.where(head >= 0, head + offsets.shift[r], -1)
        if r == 0:
            per_expert_list = part.num_recv_tokens_per_expert_list
        fields = list(round_handle)
        if not dump:  # a round padded to the most rows of any rank keeps its own rows in its handle
            fields[3] = round_handle.recv_src_idx[:place.num_rows]
        handles.append(DispatchHandle(*fields, num_recv_tokens=None if dump else place.num_rows))
        places.append(place)
    recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = (f.result() for f in outputs)
    handle = DispatchHandle(offsets.rank_prefix_matrix, offsets.channel_prefix_matrix,
                            offsets.recv_channel_prefix_matrix, recv_src_idx, in_rank, send_head)
    result = DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle)
    return result, dataclasses.replace(rounds, handles=tuple(handles), places=tuple(places))


def cached_dispatch(backend, request: DispatchRequest, rounds: Rounds) -> DispatchResult:
    """A dispatch with a handle, replaying `rounds` (from `plan_for`)."""
    if rounds.num_rounds == 1:
        return backend.dispatch(request)
    handle = request.handle
    dump = isinstance(rounds.places[0], Scatter)
    outputs = [_Final(handle.num_rows, dump), _Final(handle.num_rows, dump)]
    for r, (round_handle, place) in enumerate(zip(rounds.handles, rounds.places)):
        begin, end = rounds.bounds(r, handle.num_tokens)
        part = backend.dispatch(dataclasses.replace(
            request, x=request.x[begin:end], x_scales=_rows(request.x_scales, begin, end),
            is_token_in_rank=round_handle.is_token_in_rank, handle=round_handle))
        outputs[0].put(place, part.recv_x)
        outputs[1].put(place, part.recv_x_scales)
    return DispatchResult(outputs[0].result(), outputs[1].result(), None, None, None, handle)


def combine(backend, request: CombineRequest, rounds: Rounds):
    """A combine replaying `rounds` (from `plan_for`): -> (combined_x, combined_topk_weights)."""
    if rounds.num_rounds == 1:
        return backend.combine(request)
    num_tokens = request.handle.num_tokens
    weights, combined = request.topk_weights, [None, None]
    for r, (round_handle, place) in enumerate(zip(rounds.handles, rounds.places)):
        begin, end = rounds.bounds(r, num_tokens)
        parts = backend.combine(CombineRequest(
            x=place.take(request.x), handle=round_handle, topk_weights=None if weights is None else place.take(weights),
            bias_0=_rows(request.bias_0, begin, end), bias_1=_rows(request.bias_1, begin, end),
            config=request.config))
        for i, part in enumerate(parts):
            if part is None:
                continue
            if combined[i] is None:
                combined[i] = part.new_empty((num_tokens,) + tuple(part.shape[1:]))
            combined[i].narrow(0, begin, end - begin).copy_(part)
    return combined[0], combined[1]


def derive(handle: DispatchHandle, round_tokens: int, exchange: Exchange) -> Rounds:
    """The rounds of `round_tokens` tokens for a handle's layout, from its six fields (two collectives).

    Each round's handle is the one a one-shot dispatch of the round's slices makes (NOTE [handle contents]).
    """
    num_tokens, rank = handle.num_tokens, exchange.rank
    most = exchange.max_int(num_tokens)
    num_rounds = max(1, _ceil_div(most, round_tokens))
    rounds = Rounds(round_tokens, num_rounds, min(round_tokens, most))
    if num_rounds == 1:
        return rounds
    counts = exchange.all_gather(per_round_counts(handle.is_token_in_rank, round_tokens, num_rounds)).long()
    offsets = _Offsets(counts, rank)
    handles, places = [], _spans(counts.tolist(), rank)
    for r, place in enumerate(places):
        begin, end = rounds.bounds(r, num_tokens)
        head = handle.send_head[begin:end]
        send_head = torch.where(head >= 0, head - offsets.shift[r], -1).to(torch.int32)
        recv_src_idx = place.take(handle.recv_src_idx) - r * round_tokens
        handles.append(DispatchHandle(*offsets.round_handle_fields(r), recv_src_idx, handle.is_token_in_rank[begin:end],
                                      send_head, num_recv_tokens=place.num_rows))
    return dataclasses.replace(rounds, handles=tuple(handles), places=tuple(places))


def plan_for(handle: DispatchHandle, round_tokens: int, exchange: Exchange) -> Rounds:
    """The rounds a cached dispatch or combine with rounds of at most `round_tokens` runs: the handle's
    own where they fit, else derived (every rank decides alike: stored rounds are the same everywhere)."""
    stored = getattr(handle, "rounds", None)
    if stored is not None and stored.fits(round_tokens):
        return stored
    return derive(handle, round_tokens, exchange)


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

