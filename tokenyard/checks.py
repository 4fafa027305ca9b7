"""Input checks: every refusal happens here, before any communication, with a message that says
what was expected. Shape, dtype and device checks are free; value checks (expert ids in range) read
the tensor on the host, so they run only where the caller allows a device sync (`values=True`)."""

from __future__ import annotations

import math
import operator
from typing import Iterable, Optional, Sequence

import torch

from .errors import CapacityError, HandleError, InvalidInputError
from .handle import InternodeHandle, LowLatencyHandle, as_low_latency_handle, as_normal_handle
from .plan import headers, workspace
from .semantics import routing

TOPK_DTYPES = (torch.int64, torch.int32)
SCALE_DTYPES = (torch.float32, torch.int32)


def _fail(message: str):
    raise InvalidInputError(message)


def tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = None, dim: Optional[int] = None,
           shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None,
           contiguous: bool = True, aligned: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``None`` in `shape` means any size on that axis. `aligned`: rows the kernels move
    16 bytes at a time (TMA included) must start on a 16-byte boundary, as every allocation does; a view into a
    larger tensor may not, and would fault on the GPU (docs/semantics.md, "Errors")."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            _fail(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        _fail(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
            wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            _fail(f"{name} must have shape {wanted}, got {list(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, but this Buffer works on {device}")
    if contiguous and not t.is_contiguous():
        _fail(f"{name} must be contiguous (call .contiguous() first)")
    if aligned and t.data_ptr() % workspace.ALIGN_BYTES:
        _fail(f"{name} starts {t.data_ptr() % workspace.ALIGN_BYTES} bytes past a {workspace.ALIGN_BYTES}-byte "
              "boundary; the kernels read its rows 16 bytes at a time (a view into a larger tensor: .clone() it)")
    return t


def size_int(name: str, value, *, positive: bool = False) -> int:
    """A size given as any integer (int, numpy or 0-D torch integers, as DeepEP's C++ binding takes them)
    -> int; refuses bools, floats and negatives (zero too with `positive`)."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < (1 if positive else 0):
        _fail(f"{name} must be a {'positive' if positive else 'non-negative'} int, got {value!r}")
    return int(number)


def num_experts(value: int, num_ranks: int) -> int:
    """`value` as an int (any integer type, as `size_int`), positive and divisible by the group size."""
    value = size_int("num_experts", value, positive=True)
    if value % num_ranks != 0:
        _fail(f"num_experts={value} is not divisible by the group size {num_ranks}")
    return value


# NOTE [input verdict]
# A fresh dispatch's values (expert ids in [-1, E); num_tokens_per_rank, is_token_in_rank and
# num_tokens_per_expert equal to the layout of its topk_idx) are checked where they are read, without a host
# sync: each rank computes a verdict, a mask of the bits below, over its whole call's inputs, and sends it
# with the counts of the count exchange every fresh dispatch makes (the CUDA notify kernel, the reference
# backend's all_gather). So every rank learns which ranks gave bad values, and all raise the same
# `verdict_error`; no rows move, and the Buffer stays usable. A dispatch with num_worst_tokens does not wait
# for the counts on the host: its kernels skip the rows and the error is recorded, to be raised by the next
# call on every rank (the CUDA backend; that Buffer is done). LAYOUT_BAD_IDS is what get_dispatch_layout,
# which has no exchange, leaves for the next fresh dispatch without topk_idx (which could not see the ids
# itself). The layout could raise only by reading its ids on the host (a device sync), and only on its own rank,
# whose peers would then wait at their dispatch until timeout_s and leave the group holding it; so it counts such
# an id nowhere, and the next fresh dispatch refuses on every rank, the Buffer staying usable (one given topk_idx
# judges the ids themselves). A low-latency dispatch has no count exchange: the reference backend sends its verdict on
# the ids with the call's header (NOTE [call agreement] in collectives.py), so every rank refuses alike before
# any data moves; the CUDA backend's kernels send none of a bad id's pairs and the rank that gave it raises
# (`low_latency_bad_ids`). The bits are include/tokenyard/sync.cuh's (Verdict), which the kernels set.
_VERDICT = headers.enum("sync.cuh", "Verdict")
BAD_EXPERT_ID = _VERDICT["kBadExpertId"]
PER_RANK_DISAGREES = _VERDICT["kPerRankDisagrees"]
PER_EXPERT_DISAGREES = _VERDICT["kPerExpertDisagrees"]
IN_RANK_DISAGREES = _VERDICT["kInRankDisagrees"]
LAYOUT_BAD_IDS = _VERDICT["kLayoutBadIds"]


def bad_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where `topk_idx` holds an id outside [-1, num_experts) (bool, its shape)."""
    return (topk_idx < -1) | (topk_idx >= num_experts)


def layout_verdict(topk_idx: Optional[torch.Tensor], num_experts: int, num_tokens_per_rank: torch.Tensor,
                   is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Per rank. The NOTE [input verdict] bits of a fresh dispatch's inputs, as an int32 0-D tensor
    on their device (no host sync): ids outside [-1, E), and layout tensors unlike `dispatch_layout` of the
    ids in range. Without `topk_idx`, only `num_tokens_per_rank` against `is_token_in_rank`."""
    num_ranks = is_token_in_rank.size(1)
    tests = [(PER_RANK_DISAGREES, (is_token_in_rank.sum(0, dtype=torch.int32) != num_tokens_per_rank).any())]
    if topk_idx is not None:
        bad = bad_expert_ids(topk_idx, num_experts)
        _, per_expert, in_rank = routing.dispatch_layout(torch.where(bad, -1, topk_idx), num_experts, num_ranks)
        tests += [(BAD_EXPERT_ID, bad.any()),
                  (PER_EXPERT_DISAGREES, (per_expert != num_tokens_per_expert).any()),
                  (IN_RANK_DISAGREES, (in_rank != is_token_in_rank).any())]
    verdict = torch.zeros((), dtype=torch.int32, device=is_token_in_rank.device)
    for bit, failed in tests:
        verdict = verdict | failed.int() * bit
    return verdict


def _verdict_text(kinds: int, num_experts: Optional[int]) -> str:
    """What the `kinds` bits of NOTE [input verdict] say was wrong."""
    experts = f"[-1, {num_experts})" if num_experts is not None else "[-1, num_experts)"
    what = [text for bit, text in (
        (BAD_EXPERT_ID, f"topk_idx holds expert ids outside {experts}"),
        (LAYOUT_BAD_IDS, f"get_dispatch_layout was given expert ids outside {experts} since its last dispatch"),
        (PER_RANK_DISAGREES, "num_tokens_per_rank disagrees with is_token_in_rank"),
        (PER_EXPERT_DISAGREES, "num_tokens_per_expert disagrees with topk_idx"),
        (IN_RANK_DISAGREES, "is_token_in_rank disagrees with topk_idx")) if kinds & bit]
    hint = "" if kinds == BAD_EXPERT_ID else " (pass what get_dispatch_layout(topk_idx, num_experts) returned)"
    return "; ".join(what) + hint


def verdict_error(bad_ranks: Sequence[int], kinds: int, num_experts: Optional[int],
                  op: str = "dispatch") -> InvalidInputError:
    """The error every rank raises for a call (`op`: a fresh dispatch, or the reference backend's low-latency
    dispatch) in which `bad_ranks` gave values with the `kinds` bits of NOTE [input verdict]."""
    ranks = ", ".join(str(r) for r in bad_ranks)
    return InvalidInputError(f"{op} refused on every rank: rank{'s' if len(bad_ranks) > 1 else ''} {ranks} "
                             f"gave bad values: {_verdict_text(kinds, num_experts)}")


def ranks_in(mask: int, num_ranks: int) -> list:
    """The ranks whose bits are set in a mask of ranks."""
    return [r for r in range(num_ranks) if mask >> r & 1]


def layout_agrees(topk_idx: Optional[torch.Tensor], num_experts: int, num_tokens_per_rank: torch.Tensor,
                  is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> None:
    """The debug mode's host check of a dispatch's layout tensors: the judgement of NOTE [input verdict], read
    on the host (a device sync) and refused on this rank before any communication."""
    kinds = int(layout_verdict(topk_idx, num_experts, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert))
    if kinds:
        _fail(_verdict_text(kinds, num_experts))


def low_latency_bad_ids(rank: int, num_experts, seen: Optional[int] = None) -> InvalidInputError:
    """The CUDA backend's low-latency dispatch has no exchange that could refuse it on every rank before rows
    move: the rank whose topk_idx holds ids outside [-1, E) sends none of those pairs and raises this itself, at
    its next call (NOTE [input verdict])."""
    value = "" if seen is None else f" (such as {seen})"
    return InvalidInputError(f"rank {rank}: the topk_idx of low_latency_dispatch holds expert ids outside "
                             f"[-1, {num_experts}){value}; those pairs were not sent")


def timeout_s(value) -> float:
    """A deadline in seconds: a positive, finite number."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        _fail(f"timeout_s must be a positive, finite number of seconds, got {value!r}")
    return seconds


def topk_idx(t, *, num_tokens: Optional[int], device, max_topk: Optional[int] = None) -> torch.Tensor:
    tensor("topk_idx", t, dtypes=TOPK_DTYPES, dim=2, device=device)
    if num_tokens is not None and t.size(0) != num_tokens:
        _fail(f"topk_idx has {t.size(0)} rows but x has {num_tokens} tokens")
    if t.size(1) < 1:
        _fail("topk_idx must have at least one column")
    if max_topk is not None and t.size(1) > max_topk:
        _fail(f"top-k {t.size(1)} is above the supported maximum {max_topk}")
    return t


def topk_values(t: torch.Tensor, num_experts: int) -> None:
    """Expert ids in [-1, num_experts). Syncs the device."""
    if t.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(t))
    if low < -1 or high >= num_experts:
        bad = t[bad_expert_ids(t, num_experts)].flatten()[0].item()
        _fail(f"topk_idx holds expert id {bad}, outside [-1, {num_experts})")


def topk_weights(t, *, like: torch.Tensor, device) -> torch.Tensor:
    return tensor("topk_weights", t, dtypes=(torch.float32,), shape=tuple(like.shape), device=device)


def dispatch_x(x, *, device):
    """``x`` or ``(x, x_scales)`` -> ``(x, x_scales, scales_1d)``; rows must be a multiple of 16 bytes. [T]
    scales come back as [T, 1], and `scales_1d` says so (the received scales go back to [N])."""
    x_scales = None
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            _fail(f"a tuple x must be (data, scales), got {len(x)} elements")
        x, x_scales = x
    tensor("x", x, dim=2, device=device, aligned=True)
    if x.size(1) * x.element_size() % 16 != 0:
        _fail(f"x rows are {x.size(1) * x.element_size()} bytes; they must be a multiple of 16 bytes")
    if x_scales is not None:
        tensor("x_scales", x_scales, dtypes=SCALE_DTYPES, device=device, contiguous=False)
        if x_scales.dim() not in (1, 2) or x_scales.size(0) != x.size(0):
            _fail(f"x_scales must be [{x.size(0)}] or [{x.size(0)}, num_scales], got {list(x_scales.shape)}")
        if x_scales.dim() == 1:
            return x, x_scales.view(-1, 1), True
    return x, x_scales, False


def wait_recv_cost_stats(name: str, t, *, num_ranks: int, device) -> None:
    """NOTE [wait costs]
    DeepEP's `dispatch_wait_recv_cost_stats` / `combine_wait_recv_cost_stats`: an int64 tensor of one entry
    per rank (DeepEP's C++ checks ``size(0) == num_ranks``), to which every low-latency receive adds, for
    each rank r it receives from, the GPU clock cycles (clock64 of one SM) from the start of the receive
    until r's signal was seen; never reset, so a rank that is slow to send shows as the largest entry on its
    peers (DeepEP's diagnose gathers them into a [source, destination] matrix). The CUDA kernels count them
    in block 0. The reference backend has no per-rank waits (its all-to-all waits for all at once) and
    leaves them unchanged."""
    if t is not None:
        tensor(name, t, dtypes=(torch.int64,), shape=(num_ranks,), device=device)


def received_rows(rows_per_rank: torch.Tensor, num_worst_tokens: int) -> None:
    """Refuse a dispatch in which some rank receives more rows than `num_worst_tokens`. `rows_per_rank`
    ([R], the same on every rank after a count exchange) is read on the host, so every rank raises alike
    and none is left waiting."""
    most, which = (int(v) for v in torch.max(rows_per_rank, dim=0))
    if most > num_worst_tokens:
        _fail(f"rank {which} receives {most} tokens, more than num_worst_tokens={num_worst_tokens}")


def _converted(handle, convert):
    try:
        return convert(handle)
    except TypeError as exc:
        raise HandleError(str(exc)) from None


def _handle_field(kind: str, name: str, value, **expected) -> None:
    """One field of a handle, checked as `tensor` checks an argument, refused as a HandleError."""
    try:
        tensor(f"the {kind} handle's {name}", value, contiguous=False, **expected)
    except InvalidInputError as exc:
        raise HandleError(f"{exc} (NOTE [handle contents] in handle.py says what each field holds)") from None


def dispatch_handle(handle, *, num_ranks: int, device):
    """Our handle or DeepEP's 6-tuple (or an internode handle or 10-tuple, NOTE [internode handle]), from any
    Buffer of the group, as DeepEP takes any handle: its fields are tensors of the shapes and dtypes of NOTE
    [handle contents] (checked here, no value read), and its rounds are replayed where they fit the Buffer it
    is given to, else derived again (rounds.plan_for)."""
    handle = _converted(handle, as_normal_handle)
    if isinstance(handle, InternodeHandle):
        return _internode_handle(handle, num_ranks, device)
    ranks_by_one = dict(dtypes=(torch.int32,), dim=2, device=device)
    _handle_field("dispatch", "rank_prefix_matrix", handle.rank_prefix_matrix, dtypes=(torch.int32,),
                  shape=(num_ranks, num_ranks), device=device)
    _handle_field("dispatch", "channel_prefix_matrix", handle.channel_prefix_matrix, **ranks_by_one)
    _handle_field("dispatch", "recv_channel_prefix_matrix", handle.recv_channel_prefix_matrix, **ranks_by_one)
    for name in ("channel_prefix_matrix", "recv_channel_prefix_matrix"):
        if getattr(handle, name).size(0) != num_ranks:
            raise HandleError(f"the dispatch handle's {name} has {getattr(handle, name).size(0)} rows, not one per "
                              f"each of the group's {num_ranks} ranks")
    _handle_field("dispatch", "recv_src_idx", handle.recv_src_idx, dtypes=(torch.int32,), dim=1, device=device)
    _handle_field("dispatch", "is_token_in_rank", handle.is_token_in_rank, dtypes=(torch.bool,),
                  shape=(None, num_ranks), device=device)
    _handle_field("dispatch", "send_head", handle.send_head, dtypes=(torch.int32,),
                  shape=(handle.is_token_in_rank.size(0), num_ranks), device=device)
    return handle


def _internode_handle(handle: InternodeHandle, num_ranks: int, device) -> InternodeHandle:
    """The ten fields' shapes and dtypes (NOTE [internode handle]); N nodes as its fields say."""
    int32 = dict(dtypes=(torch.int32,), device=device)
    _handle_field("internode", "rdma_channel_prefix_matrix", handle.rdma_channel_prefix_matrix, dim=2, **int32)
    num_nodes = handle.rdma_channel_prefix_matrix.size(0)
    if num_nodes < 1 or num_ranks % num_nodes:
        raise HandleError(f"the internode handle names {num_nodes} nodes, which do not divide {num_ranks} ranks")
    _handle_field("internode", "is_token_in_rank", handle.is_token_in_rank, dtypes=(torch.bool,),
                  shape=(None, num_ranks), device=device)
    num_tokens = handle.is_token_in_rank.size(0)
    shapes = {"gbl_channel_prefix_matrix": (num_ranks, 1), "recv_rdma_channel_prefix_matrix": (num_nodes, 1),
              "recv_rdma_rank_prefix_sum": (num_nodes,), "recv_gbl_channel_prefix_matrix": (num_ranks, 1),
              "recv_gbl_rank_prefix_sum": (num_ranks,), "recv_src_meta": (None, 2),
              "send_rdma_head": (num_tokens, num_nodes), "send_nvl_head": (None, num_ranks // num_nodes)}
    for name, shape in shapes.items():
        _handle_field("internode", name, getattr(handle, name), shape=shape, **int32)
    return handle


def low_latency_handle(handle, *, buffer_id: int, num_ranks: int, device) -> LowLatencyHandle:
    """Our handle or DeepEP's 5-tuple, made by this Buffer (the combine reads what the dispatch left in this
    Buffer's memory, so another Buffer's handle is refused); its fields as NOTE [handle contents] says
    (checked here, no value read)."""
    handle = _converted(handle, as_low_latency_handle)
    if handle.buffer_id is not None and handle.buffer_id != buffer_id:
        raise HandleError("this low-latency handle was made by another Buffer, whose memory holds the dispatch's "
                          "state; pass it to the Buffer that dispatched")
    try:
        num_max, hidden = size_int("M", handle[2], positive=True), size_int("hidden", handle[3], positive=True)
        num_experts = size_int("num_experts", handle[4], positive=True)
    except InvalidInputError as exc:
        raise HandleError(f"the low-latency handle's fields 2-4 are num_max_dispatch_tokens_per_rank, hidden and "
                          f"num_experts: {exc}") from None
    if num_experts % num_ranks:
        raise HandleError(f"the low-latency handle names {num_experts} experts, not divisible by {num_ranks} ranks")
    num_local_experts = num_experts // num_ranks
    _handle_field("low-latency", "src_info", handle.src_info, dtypes=(torch.int32,),
                  shape=(num_local_experts, num_ranks * num_max), device=device)
    _handle_field("low-latency", "layout_range", handle.layout_range, dtypes=(torch.int64,),
                  shape=(num_local_experts, num_ranks), device=device)
    if (num_max, hidden, num_experts) != tuple(handle[2:5]):  # numpy sizes, say: ints from here on
        handle = LowLatencyHandle(handle.src_info, handle.layout_range, num_max, hidden, num_experts,
                                  **handle.__dict__)
    return handle


def normal_round_tokens(*, num_ranks: int, num_tokens: int, row_bytes: int, num_nvl_bytes: int,
                        per_round_tokens: Optional[int], what: str, paired_row_bytes: Optional[int] = None) -> int:
    """Tokens per rank per round of a normal-mode call with rows of `row_bytes` (NOTE [rounds] in rounds.py):
    `per_round_tokens` if given, else the capacity, also for rows of `paired_row_bytes` where those fit.

    Raises:
        CapacityError: not even one row fits, or `per_round_tokens` is above the capacity.
    """
    capacity = workspace.normal_token_capacity(num_nvl_bytes, num_ranks, row_bytes)
    if capacity == 0:
        required = workspace.normal_required_bytes(num_ranks, 1, row_bytes)
        one_shot = workspace.normal_required_bytes(num_ranks, max(num_tokens, 1), row_bytes)
        raise CapacityError(
            f"{what} rows of {row_bytes} bytes on {num_ranks} ranks do not fit this Buffer's num_nvl_bytes="
            f"{num_nvl_bytes}, not even one token per round: it needs num_nvl_bytes >= {required} to run in "
            f"rounds, and {one_shot} to run its {num_tokens} tokens in one round; size it with "
            f"Config(num_max_tokens_per_rank=N).get_nvl_buffer_size_hint(hidden_bytes, {num_ranks})",
            required_bytes=required, available_bytes=num_nvl_bytes, which="num_nvl_bytes")
    if per_round_tokens is not None:
        if per_round_tokens > capacity:
            required = workspace.normal_required_bytes(num_ranks, per_round_tokens, row_bytes)
            raise CapacityError(
                f"per_round_tokens={per_round_tokens}: {what} rows of {row_bytes} bytes on {num_ranks} ranks "
                f"need num_nvl_bytes >= {required}, but this Buffer has {num_nvl_bytes} (room for {capacity} "
                f"tokens per round)", required_bytes=required, available_bytes=num_nvl_bytes, which="num_nvl_bytes")
        return per_round_tokens
    if paired_row_bytes is not None:
        paired = workspace.normal_token_capacity(num_nvl_bytes, num_ranks, paired_row_bytes)
        if paired > 0:
            capacity = min(capacity, paired)
    return capacity


def low_latency_capacity(*, num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                         num_experts: int, num_rdma_bytes: int) -> None:
    required = workspace.low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    if required > num_rdma_bytes:
        raise CapacityError(
            f"low-latency mode with {num_max_dispatch_tokens_per_rank} tokens per rank, hidden {hidden}, "
            f"{num_experts} experts on {num_ranks} ranks needs num_rdma_bytes >= {required} "
            f"(Buffer.get_low_latency_rdma_size_hint), but this Buffer has {num_rdma_bytes}",
            required_bytes=required, available_bytes=num_rdma_bytes, which="num_rdma_bytes")
