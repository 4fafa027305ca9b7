"""Collectives on a Buffer's device over its group, whatever the group's backend (NOTE [device collectives]).

NOTE [device collectives]
The reference backend and the rounds move tensors of the Buffer's device over the Buffer's group
(NOTE [device rule] in devices.py). `Collectives` does it one of three ways, chosen by `choose_mode`:
- "direct": the group moves them itself: NCCL for CUDA tensors, gloo (or MPI) for CPU tensors;
- "nccl": CUDA tensors over a group that cannot move them (gloo, as vLLM hands DeepEP), where every rank
  has a GPU of its own: a private NCCL group of the same ranks, made on first use (every rank makes the
  same calls, so the ranks reach their first collective, and make it, together);
- "host": CUDA tensors over a gloo group whose ranks share GPUs, which NCCL refuses ("Duplicate GPU
  detected"): each collective copies to host memory, runs over the group and copies back. That waits for
  the GPU on the host, so a CUDA graph cannot capture it; a capture that tries raises InvalidInputError.
Where there is no group (an mpi4py communicator), only the small exchanges of the rounds exist: objects
through the communicator's allgather. Over gloo (CPU tensors, or CUDA tensors staged through the host) every
wait polls against the Buffer's `timeout_s` and raises CommTimeoutError; NCCL's waits are on the GPU stream,
bounded by the process group's own timeout.

NOTE [call agreement]
Before a call of the reference backend moves any data, every rank sends the others a header of HEADER_INTS
ints in one all-gather of fixed size: the call's number on this Buffer, the operation, the operation's shape
signature (CALL_FIELDS), and last the rank's verdict on its call's values, where the call has no count exchange
to carry one (a low-latency dispatch's expert ids, NOTE [input verdict] in checks.py; else 0). Ranks whose
headers but for the verdict differ (another shape, another operation, a call skipped before one of another
kind) all read the same headers and all raise RankMismatchError naming who made which call, and the group stays
usable: every transfer so far had the same size on every rank. Such a call takes back its number, so that a
Buffer whose call met another exchange (a Buffer being made, below) goes on numbering as its peers' do. Where
the calls agree and some verdict is bad, every rank raises the same InvalidInputError, and no data moves.
Calls of one operation and shape are told apart only by their order: a rank that skips one of a run of
identical calls pairs its next call with the others' skipped one, and only the last call, left without a
partner, times out. Under CUDA-graph capture the header is not exchanged (reading it would sync the host).
Making a Buffer begins with the same header (`agree_on_buffer`: call 0, operation "Buffer", the settings its
ranks must share), sent where a Buffer's headers go, before the constructor's own exchanges of objects, whose
sizes differ from rank to rank: so a rank that makes a Buffer while its peers make another call (or a Buffer
with other settings) meets a header of the same size, and every rank raises RankMismatchError, where a
constructor's object exchange would have met another collective's data, which gloo answers by aborting the
process. The header goes over the group as a Buffer's calls send theirs (CUDA tensors over an NCCL group, else
CPU tensors), so it meets them, except where those go over the private NCCL group of NOTE [device collectives];
nor does it meet the CUDA backend's one-node calls, which exchange nothing on the host, nor the headers of a
Buffer across nodes, which go through NVSHMEM (NOTE [device exchange]). Where it meets nothing, the constructor's
wait ends at making_wait_s (twice a destroy meeting's: NOTE [making after a meeting]; NOTE [making waits]).
The CUDA backend's kernels carry the same signature, without the call number, in their own first exchange
(NOTE [call signatures] in include/tokenyard/layout.cuh); both name the disagreement with `mismatch_error`.
Its internode kernels do not: each rank sizes the rows it moves from its own call, so ranks that disagree
would read and write past each other's rows. Their calls begin with a host count exchange anyway, so a Buffer
whose normal mode spans nodes agrees on each normal-mode call as the reference backend does; its exchanges go
through the transport, with the Buffer's deadline, not over the group (`device_all_gather`, NOTE [device
exchange] in include/tokenyard/kernels/exchange.cuh).
"""

from __future__ import annotations

import pickle
import re
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveRefusedError, CommTimeoutError, InvalidInputError, PeerLostError, RankMismatchError
from .waiting import wait_until

MODES = ("direct", "nccl", "host")

# NOTE [call agreement]: each operation's shape signature, the fields every rank's call must agree on.
CALL_FIELDS = {
    "dispatch": ("hidden_bytes", "num_scales", "num_topk", "num_experts", "num_worst_tokens", "expert_alignment",
                 "with_weights", "expanded"),
    "cached_dispatch": ("hidden_bytes", "num_scales", "expanded"),
    "combine": ("hidden", "num_topk", "num_biases"),
    "low_latency_dispatch": ("hidden", "num_topk", "num_experts", "num_max", "cast", "round_scale", "use_ue8m0"),
    "low_latency_combine": ("hidden", "num_topk", "num_experts", "num_max"),
    # A Buffer being made (agree_on_buffer): the settings that plan its calls; 0 for None.
    "Buffer": ("nvl_bytes_held", "num_rdma_bytes", "per_round_tokens", "ranks_per_node", "enable_shrink"),
}
SIGNATURE_INTS = 1 + max(len(fields) for fields in CALL_FIELDS.values())  # the operation, then its fields
HEADER_INTS = 1 + SIGNATURE_INTS + 1  # the call's number, its signature, the rank's verdict (not compared)


def signature(op: str, **fields: int) -> List[int]:
    """`op`'s shape signature as SIGNATURE_INTS ints: the operation's index in CALL_FIELDS, then `fields` in
    CALL_FIELDS[op]'s order, then zeros."""
    values = [list(CALL_FIELDS).index(op)] + [int(fields[name]) for name in CALL_FIELDS[op]]
    return values + [0] * (SIGNATURE_INTS - len(values))


def choose_mode(group_backend: str, device_type: str, shares_gpu: bool) -> str:
    """How tensors of `device_type` cross a group whose backend is `group_backend` (NOTE [device collectives]).

    Examples: ("gloo", "cuda", False) -> "nccl"; ("gloo", "cuda", True) -> "host"; ("nccl", "cuda", _) ->
    "direct"; ("cpu:gloo,cuda:nccl", "cpu", _) -> "direct".

    Raises:
        InvalidInputError: CPU tensors over a group that moves none (NCCL alone).
    """
    names = group_backend.lower()
    if device_type == "cuda":
        if "nccl" in names:
            return "direct"
        return "host" if shares_gpu else "nccl"
    if "gloo" in names or "mpi" in names:
        return "direct"
    raise InvalidInputError(f"CPU tensors need a group that moves CPU tensors (gloo), and this group's backend is "
                            f"{group_backend!r}; pass CUDA tensors, or a gloo group")


class _Done:
    """The work handle of a collective that finished before it was returned."""

    @staticmethod
    def wait() -> bool:
        return True


class _Bounded:
    """A gloo collective's work handle whose `wait()` polls against the deadline (Collectives._finish)."""

    def __init__(self, collectives: "Collectives", work, what: str):
        self.collectives, self.work, self.what = collectives, work, what

    def wait(self) -> bool:
        self.collectives._finish(self.work, self.what)
        return True


def describe_signature(values: List[int]) -> str:
    """``dispatch(hidden_bytes=256, ...)`` for one rank's signature (`signature`)."""
    names = list(CALL_FIELDS)
    op = names[values[0]] if 0 <= values[0] < len(names) else f"operation {values[0]}"
    fields = ", ".join(f"{name}={value}" for name, value in zip(CALL_FIELDS.get(op, ()), values[1:]))
    return f"{op}({fields})"


def describe_header(header: List[int]) -> str:
    """``call 5: dispatch(hidden_bytes=256, ...)`` for one rank's header without its verdict (NOTE [call
    agreement]); ``a new Buffer(...)`` for a Buffer being made."""
    if header[1] == list(CALL_FIELDS).index("Buffer"):
        return f"a new {describe_signature(header[1:])}"
    return f"call {header[0]}: {describe_signature(header[1:])}"


def mismatch_error(calls: List[List[int]], describe: Callable[[List[int]], str], *, rank: int = -1,
                   stage: str = "") -> RankMismatchError:
    """The error every rank raises alike where the ranks' `calls` (headers or signatures, by rank) differ:
    the ranks grouped by the call they made, each call `describe`d; `rank` and `stage` say who raises it where."""
    groups = {}
    for r, call in enumerate(calls):
        groups.setdefault(tuple(call), []).append(r)
    detail = "; ".join(f"ranks {ranks} make {describe(list(call))}" for call, ranks in groups.items())
    return RankMismatchError(f"the ranks make different calls: {detail}. A rank skipped or added a call, or passed "
                             "other shapes or settings; every rank must make the same calls in the same order "
                             "(destroy this Buffer and make a new one on every rank after fixing the caller)",
                             list(groups.values()), rank=rank, stage=stage)


# gloo's words where the connection to a peer failed (its process died, or the link broke): raised by its transport
# ("[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer [addr]:port", "Read error ...: Connection reset
# by peer"). Anything else it raises at a wait is its own or torch's check of this rank's part of the collective
# ("Split sizes doesn't match total dim 0 size", "[enforce fail at .../gloo/alltoallv.cc:138]
# inLengthPerRank[myRank] == outLengthPerRank[myRank]"), made before this rank sent anything.
_CONNECTION_FAILED = re.compile(r"gloo/transport/|connection|closed|reset by peer|broken pipe|read error|write error|"
                                r"timed out|timeout", re.IGNORECASE)


# A wait where the ranks come at the host's pace, making a Buffer or destroying one (NOTE [symmetric lifetime]), ends
# at timeout_s but no sooner than this: the host's skew (seconds) is not bounded by a deadline set for the kernels'
# waits, which is microseconds where a low-latency decoder masks late peers.
HOST_SKEW_FLOOR_S = 5.0


def meeting_wait_s(timeout_s: float) -> float:
    """How long a Buffer's destroy meeting waits for the ranks (NOTE [symmetric lifetime])."""
    return max(timeout_s, HOST_SKEW_FLOOR_S)


# NOTE [making waits]
# Making a Buffer exchanges over its group: the agreement's header (agree_on_buffer), then objects (the ranks'
# places, IPC handles, NVSHMEM's id, whether each rank can start a backend: gather_objects). A rank that fails
# between two of them (out of memory, say) or never comes leaves its peers waiting in the next, which over NCCL
# (torch's all_gather_object) ended only at the group's own timeout, ten minutes by default, where the watchdog
# ends the process. So every one of them ends at making_wait_s with CommTimeoutError at stage "Buffer/agree" or
# "Buffer/exchange": over NCCL the all-gather runs on a stream of its own and the host polls an event (max_int's way,
# which bounds the destroy's meeting); over gloo the host polls the work (`finish`). The group then holds the
# unfinished all-gather: the ranks make a new group, or the rank that failed makes its part of the exchange (an
# all-gather of one int64, the pickles' sizes). Limits: a group whose NCCL communicator is made lazily, at its first
# collective (init_process_group without device_id), makes it in the agreement, which blocks the host until every
# rank comes (NCCL's own wait); an mpi4py communicator's exchanges are its own.
def making_wait_s(timeout_s: float) -> float:
    """How long making a Buffer waits for the ranks (NOTE [making waits]): twice a destroy meeting's wait. NOTE
    [making after a meeting]: a rank may come to its next Buffer a whole meeting after its peers, where a lost peer
    ended the meeting at once on the ranks gloo told (their connection to it closed) and at its deadline on the
    others."""
    return 2 * meeting_wait_s(timeout_s)


def _not_joined(timeout_s: float, also: str = "") -> str:
    """A timed-out collective's words: no peer joined within `timeout_s` (`also`: what else the wait covered)."""
    return (f"a peer did not join within {timeout_s:g} s{also}. The group still holds this unfinished collective: "
            "make a new group, and a new Buffer on it, for the next call")


def finish(work, rank: int, stage: str, timeout_s: float) -> None:
    """Wait for a gloo collective's `work` until `timeout_s`, and say how it failed, if it did.

    Raises:
        CommTimeoutError: a peer did not join within `timeout_s` (the group still holds the collective).
        PeerLostError: a peer's connection failed (gloo's transport said so).
        CollectiveRefusedError: gloo or torch refused this rank's part (a check of its sizes, say).
    """
    if not wait_until(work.is_completed, timeout_s):
        raise CommTimeoutError(rank, -1, stage, _not_joined(timeout_s))
    try:
        work.wait()
    except RuntimeError as exc:
        text = str(exc).strip()
        # gloo's own words, without its source location and advice.
        said = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else "").split(". ")[0].rstrip(".")
        if _CONNECTION_FAILED.search(text):
            raise PeerLostError(rank, stage, said) from exc
        raise CollectiveRefusedError(rank, stage, said) from exc


def gather_tensors(group: dist.ProcessGroup, t: torch.Tensor, device: torch.device, rank: int, stage: str,
                   timeout_s: float) -> torch.Tensor:
    """``[group.size(), *t.shape]`` on the host: every rank's CPU tensor `t` (one shape and dtype on every rank) over
    `group`, within `timeout_s`. Where `device` is a GPU and the group moves its tensors with NCCL, the all-gather
    and the copy back run on a stream of their own and the host polls an event (NOTE [making waits]); else a gloo
    all-gather of CPU tensors, ended as `finish` ends it.

    Raises:
        CommTimeoutError: a peer did not join within `timeout_s` (the group still holds the all-gather).
        PeerLostError, CollectiveRefusedError: as `finish` (gloo).
    """
    if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)).lower():
        pieces = [torch.empty_like(t) for _ in range(group.size())]
        finish(dist.all_gather(pieces, t, group=group, async_op=True), rank, stage, timeout_s)
        return torch.stack(pieces)
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        mine = t.to(device)
        gathered = torch.empty((group.size(), *t.shape), dtype=t.dtype, device=device)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        host = torch.empty(gathered.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    if not wait_until(done.query, timeout_s):
        raise CommTimeoutError(rank, -1, stage, _not_joined(timeout_s))
    return host


def gather_objects(group: dist.ProcessGroup, obj, device: torch.device, rank: int, stage: str,
                   timeout_s: float) -> list:
    """Every rank's picklable `obj` over `group`, by rank, as `dist.all_gather_object` gives them, within `timeout_s`
    (NOTE [making waits]): the pickles' sizes, then the pickles padded to the longest, through `gather_tensors`."""
    data = pickle.dumps(obj)
    sizes = gather_tensors(group, torch.tensor([len(data)], dtype=torch.int64, device="cpu"), device, rank, stage,
                           timeout_s).flatten().tolist()
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device="cpu")
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pieces = gather_tensors(group, mine, device, rank, stage, timeout_s)
    return [pickle.loads(piece[:size].numpy().tobytes()) for piece, size in zip(pieces, sizes)]


def agree_on_buffer(group: Optional[dist.ProcessGroup], rank: int, device: torch.device, timeout_s: float,
                    **fields: int) -> None:
    """NOTE [call agreement]: check, before a Buffer's first exchange of objects, that every rank of `group` is
    making a Buffer with the same `fields` (CALL_FIELDS["Buffer"]), with a header of the size every call's has.

    Raises:
        RankMismatchError: on every rank alike, where some rank makes another Buffer or another call.
        CommTimeoutError: a peer made no exchange within making_wait_s(timeout_s) (NOTE [making waits]).
    """
    if group is None:  # an mpi4py comm: its exchanges are of objects, which it sizes itself
        return
    mine = torch.tensor([0] + signature("Buffer", **fields) + [0], dtype=torch.int64, device="cpu")
    # Where a Buffer's calls send their headers (Collectives.agree): over the group, CUDA tensors where it is NCCL's.
    gathered = gather_tensors(group, mine, device, rank, "Buffer/agree", making_wait_s(timeout_s))
    headers = [h[:-1] for h in gathered.tolist()]
    if any(h != headers[0] for h in headers):
        raise mismatch_error(headers, describe_header, rank=rank, stage="Buffer/agree")


class Collectives:
    """`all_to_all_single`, `all_gather` and `max_int` of tensors on `device` over `group`, and `agree` on each
    call (NOTE [call agreement]).

    Arguments:
        group: the Buffer's process group, or None with `all_gather_object` from an mpi4py communicator.
        device: the Buffer's device.
        mode: one of MODES (`choose_mode`); ignored without a group.
        rank, num_ranks: this rank's place in the group.
        all_gather_object: a function that gathers one picklable object from every rank.
        timeout_s: the deadline of every wait over gloo, and of `max_int`'s wait on the GPU.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, mode: str, rank: int,
                 num_ranks: int, all_gather_object: Callable, timeout_s: float = 100.0):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.group, self.device, self.mode = group, device, mode
        self.rank, self.num_ranks = rank, num_ranks
        self._all_gather_object = all_gather_object
        self.timeout_s = timeout_s
        self._nccl_group = None
        self._stream = None  # CUDA: max_int's own stream
        self._calls = 0  # calls agreed on (NOTE [call agreement])
        self.peer_lost = False  # a collective failed because a peer's connection closed (NOTE [NVSHMEM stop])
        self.op = "call"  # the operation under way: the first part of every stage a timeout names
        # NOTE [device exchange] (include/tokenyard/kernels/exchange.cuh): set by a CUDA backend whose normal mode
        # spans nodes; (tensor, stage) -> every rank's tensor, or None where it does not take that tensor.
        self.device_all_gather: Optional[Callable[[torch.Tensor, str], Optional[torch.Tensor]]] = None

    def _device_group(self) -> dist.ProcessGroup:
        """The group that moves this device's tensors: the Buffer's, or the private NCCL group."""
        if self.mode != "nccl":
            return self.group
        if self._nccl_group is None:
            self._nccl_group = dist.new_group(dist.get_process_group_ranks(self.group), backend="nccl",
                                              use_local_synchronization=True)
        return self._nccl_group

    def _staged(self) -> bool:
        """Whether tensors of this device go through host memory; refuses inside a CUDA graph capture."""
        if self.mode != "host" or self.device.type != "cuda":
            return False
        if torch.cuda.is_current_stream_capturing():
            raise InvalidInputError("this group cannot move CUDA tensors and its ranks share GPUs, so the reference "
                                    "backend stages every collective through host memory, which a CUDA graph cannot "
                                    "capture (NOTE [device collectives]); capture the CUDA backend's calls instead")
        return True

    def _bounded(self) -> bool:
        """Whether waits poll against the deadline: over gloo (CPU tensors, or CUDA tensors staged through
        the host); NCCL's waits are on the GPU stream."""
        return self.group is not None and (self.device.type == "cpu" or self.mode == "host")

    def _finish(self, work, what: str, timeout_s: Optional[float] = None) -> None:
        """Wait for a gloo collective until `timeout_s` (the Buffer's if None), as `finish`."""
        try:
            finish(work, self.rank, f"{self.op}/{what}", self.timeout_s if timeout_s is None else timeout_s)
        except PeerLostError:
            self.peer_lost = True
            raise

    def agree(self, op: str, verdict: Optional[Callable[[], torch.Tensor]] = None, **fields: int) -> List[int]:
        """NOTE [call agreement]: check that every rank makes this call, `op` with `fields` (CALL_FIELDS[op]),
        before any data moves; -> every rank's verdict, by rank: what `verdict()` gave on it (an int tensor of one
        value, its NOTE [input verdict] bits on its call's values, computed only where the header is exchanged;
        0 without), all 0 where no header was exchanged.

        Raises:
            RankMismatchError: on every rank alike, where some rank's call differs.
            CommTimeoutError: a peer did not make a call within `timeout_s` (over NCCL: NOTE [bounded reads]).
        """
        self.op = op
        self._calls += 1
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.group is None or capturing:
            return [0] * self.num_ranks
        # Through the transport wherever it serves (NOTE [device exchange]), over gloo too: its timeout names the
        # late peer, where a gloo collective's cannot.
        on_host = (self.device.type == "cpu" or self.mode == "host") and self.device_all_gather is None
        mine = torch.tensor([self._calls] + signature(op, **fields) + [0], dtype=torch.int64,
                            device="cpu" if on_host else self.device)
        if verdict is not None:  # no host sync here: the all-gather's reading below is the one
            mine[-1:] = verdict().reshape(1).to(mine.device, torch.int64)
        headers = self.all_gather(mine, "agree", read=True).tolist()
        if any(h[:-1] != headers[0][:-1] for h in headers):
            self._calls -= 1  # no rank made this call: NOTE [call agreement]
            raise mismatch_error([h[:-1] for h in headers], describe_header, rank=self.rank, stage=f"{op}/agree")
        return [h[-1] for h in headers]

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]] = None,
                          in_splits: Optional[List[int]] = None, async_op: bool = False):
        """`dist.all_to_all_single` over the group; with `async_op`, a handle whose `wait()` ends it (bounded
        over gloo)."""
        if self.group is None:
            raise InvalidInputError("an all-to-all needs a torch.distributed process group")
        staged = self._staged()
        if not self._bounded():
            return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self._device_group(),
                                          async_op=async_op)
        landed = torch.empty(out.shape, dtype=out.dtype, device="cpu") if staged else out
        work = dist.all_to_all_single(landed, inp.cpu() if staged else inp, out_splits, in_splits, group=self.group,
                                      async_op=True)
        if staged:  # the copy back needs the data: finished here
            self._finish(work, "all_to_all")
            out.copy_(landed)
            return _Done() if async_op else None
        if async_op:
            return _Bounded(self, work, "all_to_all")
        self._finish(work, "all_to_all")
        return None

    def all_gather(self, t: torch.Tensor, what: str = "all_gather", read: bool = False) -> torch.Tensor:
        """``[num_ranks, *t.shape]``: every rank's `t` (no host sync in the direct and NCCL modes; through the
        transport where `device_all_gather` is set, bounded, with one). `read`: the host reads the result next,
        and waits for it with a deadline in the direct and NCCL modes too (NOTE [bounded reads])."""
        if self.device_all_gather is not None and t.device.type == "cuda" and \
                not torch.cuda.is_current_stream_capturing():
            gathered = self.device_all_gather(t, f"{self.op}/{what}")
            if gathered is not None:
                return gathered
        if self.group is None:
            return torch.stack([p.to(t.device) for p in self._all_gather_object(t.cpu())])
        staged = self._staged()
        mine = t.cpu() if staged else t.contiguous()
        pieces = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        if self._bounded():
            self._finish(dist.all_gather(pieces, mine, group=self.group, async_op=True), what)
        else:
            dist.all_gather(pieces, mine, group=self._device_group())
            if read:
                self._wait_to_read(what)
        gathered = torch.stack(pieces)
        return gathered.to(t.device) if staged else gathered

    def _wait_to_read(self, what: str) -> None:
        """NOTE [bounded reads]
        Over NCCL a collective waits on the GPU stream, and the host's next read of its result (`.tolist()`)
        would wait for a late or lost peer until the group's own timeout (ten minutes by default, then the
        watchdog ends the process). Where the host reads it next (a call's header, a fresh dispatch's counts: the
        reference backend's first exchanges of a call, which a peer late to the call meets first), it polls an
        event recorded after the collective instead, until meeting_wait_s of the Buffer's deadline: the event also
        waits for the GPU work queued before the call, which a deadline set for the kernels' waits (microseconds,
        where a decoder masks late peers) does not cover. The group then holds the unfinished collective, as a
        gloo group does after `finish`'s timeout. The data's all-to-all, which the host does not read, is bounded
        by the next call's header. Not inside a CUDA-graph capture (no header is exchanged there)."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # which the collective's stream joined
        wait_s = meeting_wait_s(self.timeout_s)
        if not wait_until(done.query, wait_s):
            raise CommTimeoutError(self.rank, -1, f"{self.op}/{what}",
                                   _not_joined(wait_s, " (or the GPU work queued before this call took longer)"))

    def barrier(self, what: str = "barrier", timeout_s: Optional[float] = None) -> None:
        """Return once every rank has called it (as max_int, which it is)."""
        self.max_int(0, what, timeout_s)

    def meeting(self, op: str, what: str) -> None:
        """A barrier where the ranks come at the host's pace (a Buffer's destroy, a low-latency clean), bounded by
        meeting_wait_s of the Buffer's deadline; a timeout names stage `op`/`what`."""
        self.op = op
        self.barrier(what, meeting_wait_s(self.timeout_s))

    def max_int(self, value: int, what: str = "rounds", timeout_s: Optional[float] = None) -> int:
        """The largest `value` over the ranks (a host sync), within `timeout_s` (the Buffer's if None); `what`
        names the stage a timeout reports.

        On CUDA the all-reduce and a copy into pinned memory run on a stream of their own, so they wait for
        none of the work queued before them, and the wait is for them alone (an event), bounded: a rank
        that failed round 0 after this one passed it never joins.
        """
        if self.group is None:
            return max(self._all_gather_object(int(value)))
        if self._bounded():
            t = torch.full((1,), value, dtype=torch.int64, device="cpu")
            self._finish(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what, timeout_s)
            return int(t[0])
        group = self._device_group()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            t = torch.full((1,), value, dtype=torch.int64, device=self.device)  # no host-to-device copy
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            host = torch.empty(1, dtype=torch.int64, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        if not wait_until(done.query, self.timeout_s if timeout_s is None else timeout_s):
            raise CommTimeoutError(self.rank, -1, f"{self.op}/{what}",
                                   "a peer did not join; destroy this Buffer")
        return int(host[0])

    def destroy(self) -> None:
        """Release the private NCCL group, if one was made."""
        if self._nccl_group is not None:
            dist.destroy_process_group(self._nccl_group)
            self._nccl_group = None
