"""Rank functions for the bounded-buffer tests (tests/cpu/test_bounded.py): a call in rounds against the
same call in one round, bit for bit (NOTE [rounds] in tokenyard/rounds.py).

Every function builds all ranks' inputs from one seed, with a token count of its own per rank, runs the
calls on a Buffer sized for one round (`one_shot`) and on one that must use rounds (`bounded`), and
compares every output and every handle field.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tokenyard import Buffer, CapacityError, Config, InvalidInputError, env
from tokenyard import rounds
from tokenyard.plan import workspace
from tokenyard.tools.testing import make_topk_idx, make_topk_weights, make_x

from .scenarios import assert_same

HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")


def _world():
    return dist.get_rank(), dist.get_world_size()


def make_inputs(seed, token_counts, hidden, num_experts, num_topk, dtype):
    """This rank's ``(x, topk_idx, topk_weights)``, with ``token_counts[r]`` tokens on rank r."""
    rank, num_ranks = _world()
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    topk_idx = make_topk_idx(token_counts[rank], num_experts, num_topk, num_ranks, "uniform", generator, rank)
    return make_x(token_counts[rank], hidden, dtype, generator), topk_idx, make_topk_weights(topk_idx, generator)


def _split(x):
    return x if isinstance(x, tuple) else (x, None)


def _hidden_bytes(x):
    data = _split(x)[0]
    return data.size(1) * max(data.element_size(), 2)


def one_shot_buffer(max_tokens, x):
    _, num_ranks = _world()
    size = Config(num_max_tokens_per_rank=max(max_tokens, 1)).get_nvl_buffer_size_hint(_hidden_bytes(x), num_ranks)
    return Buffer(dist.group.WORLD, size, 0, backend="reference")


def assert_same_handle(name, got, want, num_rows=None):
    for field in HANDLE_FIELDS:
        g, w = getattr(got, field), getattr(want, field)
        if field == "recv_src_idx" and num_rows is not None:
            g, w = g[:num_rows], w[:num_rows]
        assert_same(f"{name}.{field}", g, w)


def _layout(buffer, topk_idx, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def rounds_match_one_shot(seed, token_counts, hidden, num_experts, num_topk, dtype, per_round_tokens=None,
                          num_nvl_bytes=None, num_worst_tokens=0, expert_alignment=1):
    """Dispatch, cached dispatch (our handle and a plain tuple) and combine (weights and two biases) in
    rounds equal the one-shot calls bit for bit; returns this rank's round count."""
    rank, num_ranks = _world()
    x, topk_idx, topk_weights = make_inputs(seed, token_counts, hidden, num_experts, num_topk, dtype)
    max_tokens = max(token_counts)
    one_shot = one_shot_buffer(max_tokens, x)
    bounded = Buffer(dist.group.WORLD, num_nvl_bytes if num_nvl_bytes is not None else one_shot.num_nvl_bytes, 0,
                     backend="reference", per_round_tokens=per_round_tokens)
    layout = _layout(one_shot, topk_idx, num_experts)
    kwargs = dict(topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment,
                  num_worst_tokens=num_worst_tokens, **layout)

    # Dispatch: every output and every handle field.
    want = one_shot.dispatch(x, **kwargs)
    backend, asked = bounded.runtime, []  # per backend call the rounds make: (outputs exist, placed by cursor)
    backend_dispatch = backend.dispatch

    def spy(request):
        placement = request.placement
        asked.append((placement is not None and placement.outputs is not None,
                      placement is not None and placement.cursor is not None))
        return backend_dispatch(request)

    backend.dispatch = spy
    collectives = []  # the rounds' own collectives (NOTE [agree after the count exchange], [placed rounds])
    exchange = bounded._exchange  # the backend's collectives are the same object, reached through its context

    class Spy:
        def __getattr__(self, name):
            return getattr(exchange, name)

        def max_int(self, value):
            collectives.append("max_int")
            return exchange.max_int(value)

        def all_gather(self, t):
            collectives.append("all_gather")
            return exchange.all_gather(t)

    bounded._exchange = Spy()
    try:
        got = bounded.dispatch(x, **kwargs)
    finally:
        backend.dispatch = backend_dispatch
        bounded._exchange = exchange
    assert not collectives, f"the count exchanges carry the counts: no collective of the rounds' own, ran {collectives}"
    want_handle, handle = want[4], got[4]
    assert want_handle.rounds.num_rounds == 1
    plan = bounded.normal_round_plan(max_tokens, hidden, num_topk, _split(x)[0].dtype)
    round_tokens = per_round_tokens or plan.round_tokens
    num_rounds = handle.rounds.num_rounds
    assert handle.rounds.round_tokens == round_tokens
    if num_worst_tokens:
        expected_rounds = -(-(-(-num_worst_tokens // num_ranks)) // round_tokens)
    else:
        expected_rounds = -(-max_tokens // round_tokens)
        assert num_rounds == plan.num_rounds
    assert num_rounds == max(1, expected_rounds), (num_rounds, expected_rounds)
    want_data, want_scales = _split(want[0])
    got_data, got_scales = _split(got[0])
    assert isinstance(got[0], tuple) == isinstance(x, tuple)
    num_recv = int(want_handle.rank_prefix_matrix[-1, rank])
    valid = slice(0, num_recv)
    if num_worst_tokens:
        assert got_data.size(0) == num_worst_tokens and handle.num_recv_tokens is None
        assert_same("padding recv_topk_idx", got[1][num_recv:], want[1][num_recv:])
        assert_same("padding recv_topk_weights", got[2][num_recv:], want[2][num_recv:])
        assert_same("padding recv_src_idx", handle.recv_src_idx, want_handle.recv_src_idx)
    else:
        assert handle.num_recv_tokens == want_handle.num_recv_tokens == num_recv
    assert_same("recv_x", got_data[valid], want_data[valid])
    assert_same("recv_x_scales", None if got_scales is None else got_scales[valid],
                None if want_scales is None else want_scales[valid])
    assert_same("recv_topk_idx", got[1], want[1])
    assert_same("recv_topk_weights", got[2], want[2])
    assert got[3] == want[3], f"num_recv_tokens_per_expert_list {got[3]} != {want[3]}"
    assert_same_handle("handle", handle, want_handle, num_recv)

    # NOTE [placed rounds]: every round but a fresh dispatch's round 0 writes into the whole call's tensors,
    # and every round's count exchange places it.
    if num_rounds > 1:
        assert asked == [(bool(num_worst_tokens), True)] + [(True, True)] * (num_rounds - 1), asked
        assert len(handle.rounds.recv_first) == num_rounds
        assert all(t.is_contiguous() for t in handle.rounds.recv_first)  # the CUDA kernels read plain arrays

    # The rounds derived from the six fields alone are the rounds the dispatch ran.
    if num_rounds > 1 and not num_worst_tokens:
        derived = rounds.derive(handle, round_tokens, bounded._exchange)
        assert derived.num_rounds == num_rounds
        assert_same("derived recv_first", torch.stack(derived.recv_first), torch.stack(handle.rounds.recv_first))
        for r, (a, b) in enumerate(zip(derived.handles, handle.rounds.handles)):
            assert_same_handle(f"derived round {r}", a, b)

    # Cached dispatch, with our handle and with a plain DeepEP 6-tuple (rounds derived from its fields).
    for name, h in (("handle", handle), ("tuple", tuple(handle))):
        again = _split(bounded.dispatch(x, handle=h)[0])
        assert_same(f"cached recv_x ({name})", again[0][valid], want_data[valid])
        assert_same(f"cached recv_x_scales ({name})", None if again[1] is None else again[1][valid],
                    None if want_scales is None else want_scales[valid])

    # Rows wider than the dispatch's need smaller rounds than the handle's: derived from its fields, with the
    # largest rank's token count from the handle's rounds (no host sync for it).
    if per_round_tokens is None and not num_worst_tokens:
        data = _split(x)[0].view(torch.uint8)
        synced, max_int = [], bounded._exchange.max_int
        bounded._exchange.max_int = lambda value: synced.append(value) or max_int(value)
        try:
            wide = bounded.dispatch(torch.cat([data, data], dim=1), handle=handle)[0]
        finally:
            bounded._exchange.max_int = max_int
        received = want_data.view(torch.uint8)
        assert_same("cached recv_x of wider rows", wide, torch.cat([received, received], dim=1))
        assert synced == [], f"the cached dispatch of wider rows synced token counts {synced}"

    # Combine of random expert outputs with weights and two biases; also through the one-shot handle's
    # fields as a plain tuple (the bounded Buffer derives its own rounds from them).
    generator = torch.Generator().manual_seed(seed + 7 * rank + 1)
    rows = want_data.size(0)
    y = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16)
    y[num_recv:] = float("nan")  # padding rows are never read
    y_weights = torch.rand(rows, num_topk, generator=generator)
    bias = tuple(torch.randn(token_counts[rank], hidden, generator=generator).to(torch.bfloat16) for _ in range(2))
    want_x, want_w, _ = one_shot.combine(y, want_handle, topk_weights=y_weights, bias=bias)
    for name, h in (("handle", handle), ("one-shot tuple", tuple(want_handle))):
        got_x, got_w, _ = bounded.combine(y, h, topk_weights=y_weights, bias=bias)
        assert_same(f"combined_x ({name})", got_x, want_x)
        assert_same(f"combined_topk_weights ({name})", got_w, want_w)
    got_x, got_w, _ = bounded.combine(y, handle)
    assert got_w is None
    assert_same("combined_x without weights and bias", got_x, one_shot.combine(y, want_handle)[0])
    one_shot.destroy()
    bounded.destroy()
    return num_rounds


def env_cap_bounds_the_buffer(seed, token_counts, hidden, num_experts, num_topk):
    """TOKENYARD_NVL_BUFFER_BYTES caps a huge num_nvl_bytes; the calls then run in rounds, unchanged."""
    _, num_ranks = _world()
    x, topk_idx, topk_weights = make_inputs(seed, token_counts, hidden, num_experts, num_topk, "bf16")
    row = max(workspace.normal_combine_row_bytes(hidden, num_topk),
              workspace.normal_dispatch_row_bytes(hidden * 2, 0, num_topk))
    cap = workspace.normal_required_bytes(num_ranks, 3, row)
    before = os.environ.get("TOKENYARD_NVL_BUFFER_BYTES")
    os.environ["TOKENYARD_NVL_BUFFER_BYTES"] = str(cap)
    env.settings.cache_clear()
    try:
        capped = Buffer(dist.group.WORLD, 1 << 40, 0, backend="reference")
    finally:
        if before is None:
            del os.environ["TOKENYARD_NVL_BUFFER_BYTES"]
        else:
            os.environ["TOKENYARD_NVL_BUFFER_BYTES"] = before
        env.settings.cache_clear()
    assert capped.num_nvl_bytes == 1 << 40 and capped.nvl_bytes_held == cap  # NOTE [requested and held bytes]
    plan = capped.normal_round_plan(max(token_counts), hidden, num_topk)
    assert plan.buffer_bytes == cap and plan.round_tokens == 3
    one_shot = one_shot_buffer(max(token_counts), x)
    layout = _layout(one_shot, topk_idx, num_experts)
    want = one_shot.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    got = capped.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    assert got[4].rounds.num_rounds == plan.num_rounds == -(-max(token_counts) // 3)
    assert_same("recv_x", got[0], want[0])
    assert_same_handle("handle", got[4], want[4])
    assert_same("combined_x", capped.combine(got[0], got[4])[0], one_shot.combine(want[0], want[4])[0])
    return plan.num_rounds


def refusals(num_tokens, hidden, num_experts, num_topk):
    """What cannot run raises before any communication, on every rank alike, naming the bytes it needs."""
    _, num_ranks = _world()
    x, topk_idx, topk_weights = make_inputs(3, [num_tokens] * num_ranks, hidden, num_experts, num_topk, "bf16")
    dispatch_row = workspace.normal_dispatch_row_bytes(hidden * 2, 0, num_topk)
    combine_row = workspace.normal_combine_row_bytes(hidden, num_topk)
    one_row = max(workspace.normal_required_bytes(num_ranks, 1, row) for row in (dispatch_row, combine_row))
    messages = {}

    # Not one row fits (the dispatch row, with its top-k, is the wider): the error names the bytes of
    # rounds of one token.
    assert dispatch_row > combine_row
    tiny = Buffer(dist.group.WORLD, one_row - 1, 0, backend="reference")
    plan = tiny.normal_round_plan(num_tokens, hidden, num_topk)
    assert (plan.round_tokens, plan.num_rounds, plan.min_bytes) == (0, 0, one_row)
    assert plan.one_shot_bytes == workspace.normal_required_bytes(num_ranks, num_tokens, dispatch_row)
    layout = _layout(tiny, topk_idx, num_experts)
    try:
        tiny.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    except CapacityError as exc:
        assert exc.required_bytes == one_row and exc.available_bytes == one_row - 1, str(exc)
        assert f"needs num_nvl_bytes >= {one_row}" in str(exc), str(exc)
        messages["never fits"] = str(exc)
    else:
        raise AssertionError("a Buffer without room for one row ran a call")

    # per_round_tokens above what the budget holds.
    budget = workspace.normal_required_bytes(num_ranks, 4, max(dispatch_row, combine_row))
    wide = Buffer(dist.group.WORLD, budget, 0, backend="reference", per_round_tokens=5)
    assert wide.normal_round_plan(num_tokens, hidden, num_topk).round_tokens == 0
    try:
        wide.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    except CapacityError as exc:
        assert "per_round_tokens=5" in str(exc) and "need num_nvl_bytes >=" in str(exc), str(exc)
        messages["per_round_tokens"] = str(exc)
    else:
        raise AssertionError("per_round_tokens above the capacity ran")

    # num_worst_tokens fixes the rounds: more tokens than they carry is refused.
    fitting = Buffer(dist.group.WORLD, budget, 0, backend="reference")
    try:
        fitting.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_ranks, **layout)
    except InvalidInputError as exc:
        assert "num_worst_tokens" in str(exc) and f">= {num_tokens * num_ranks}" in str(exc), str(exc)
        messages["num_worst_tokens"] = str(exc)
    else:
        raise AssertionError("num_worst_tokens below the tokens ran")
    # More received rows than num_worst_tokens, found by round 0's count exchange: every rank raises alike.
    # Every token goes to rank 0 alone (its experts, then -1), so rank 0 receives them all.
    only_rank0 = torch.arange(num_topk).remainder(num_experts // num_ranks).view(1, -1).repeat(num_tokens, 1)
    only_rank0[:, num_experts // num_ranks:] = -1
    worst = num_tokens * num_ranks - 1  # rounds of 4 carry ceil(worst / num_ranks) >= num_tokens tokens
    try:
        fitting.dispatch(x, topk_idx=only_rank0, topk_weights=topk_weights, num_worst_tokens=worst,
                         **_layout(fitting, only_rank0, num_experts))
    except InvalidInputError as exc:
        assert f"rank 0 receives {num_tokens * num_ranks} tokens, more than num_worst_tokens={worst}" in str(exc), \
            str(exc)
        messages["past num_worst_tokens"] = str(exc)
    else:
        raise AssertionError("more received rows than num_worst_tokens ran")
    try:
        Buffer(dist.group.WORLD, budget, 0, backend="reference", per_round_tokens=0)
    except InvalidInputError:
        pass
    else:
        raise AssertionError("per_round_tokens=0 was accepted")
    return messages
