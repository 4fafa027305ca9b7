"""Faults on the reference backend, with real peers (gloo ranks, each test in processes of its own so that a
group left broken never reaches another test): ranks that disagree on a call, skip one, sleep past the
deadline or die. Every other rank must raise a TokenyardError within timeout_s + 2 s, no process may die of a
signal, and the survivors must then complete a correct call (NOTE [call agreement] in collectives.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tokenyard.launch import run_on_ranks

TIMEOUT_S = 2.0
HIDDEN, NUM_EXPERTS, NUM_TOPK, NUM_TOKENS = 128, 12, 2, 16


def _inputs(seed, hidden=HIDDEN, num_experts=NUM_EXPERTS):
    import torch.distributed as dist

    from tokenyard.testing import make_rank_inputs

    return make_rank_inputs(seed, dist.get_world_size(), NUM_TOKENS, hidden, num_experts, NUM_TOPK)


def _dispatch(buffer, x, topk_idx, weights, num_experts=NUM_EXPERTS, num_worst_tokens=0):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           num_worst_tokens=num_worst_tokens)


def _correct_call(group, seed) -> None:
    """A dispatch on a new Buffer of `group`, against the oracle."""
    import torch.distributed as dist

    from tokenyard import Buffer, routing

    inputs = _inputs(seed)
    buffer = Buffer(group, 1 << 22, 0, backend="reference", timeout_s=TIMEOUT_S)
    recv_x = _dispatch(buffer, *inputs[dist.get_rank()])[0]
    want = routing.dispatch([i[0] for i in inputs], [None] * len(inputs), [i[1] for i in inputs],
                            [i[2] for i in inputs], NUM_EXPERTS)[dist.get_rank()]["recv_x"]
    assert torch.equal(recv_x, want), "the call after the fault returned wrong rows"
    buffer.destroy()


def _mismatch(seed, what):
    """Rank 0 makes another call than the others; every rank must raise RankMismatchError, then the same
    Buffer serves a correct call (no data moved, the group is intact)."""
    import torch.distributed as dist

    from tokenyard import Buffer, RankMismatchError

    rank = dist.get_rank()
    odd = rank == 0
    buffer = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(32, 256, dist.get_world_size(),
                                                                                         NUM_EXPERTS), backend="reference",
                    timeout_s=TIMEOUT_S)
    start = time.monotonic()
    try:
        if what == "hidden":
            x, topk_idx, weights = _inputs(seed, hidden=256 if odd else HIDDEN)[rank]
            _dispatch(buffer, x, topk_idx, weights)
        elif what == "num_experts":
            x, topk_idx, weights = _inputs(seed, num_experts=24 if odd else NUM_EXPERTS)[rank]
            _dispatch(buffer, x, topk_idx, weights, num_experts=24 if odd else NUM_EXPERTS)
        elif what == "num_worst_tokens":
            _dispatch(buffer, *_inputs(seed)[rank], num_worst_tokens=2 if odd else 64)
        elif what in ("low_latency_hidden", "low_latency_num_max"):
            hidden = 256 if odd and what == "low_latency_hidden" else 128
            num_max = 16 if odd and what == "low_latency_num_max" else 32
            x, topk_idx, _ = _inputs(seed, hidden=hidden)[rank]
            buffer.low_latency_dispatch(x, topk_idx, num_max, NUM_EXPERTS, use_fp8=False)
        elif what == "skipped_dispatch":  # rank 0 skips a dispatch and goes on to its combine
            x, topk_idx, weights = _inputs(seed)[rank]
            recv_x, _, _, _, handle, _ = _dispatch(buffer, x, topk_idx, weights)
            if not odd:
                _dispatch(buffer, x, topk_idx, weights)
            buffer.combine(recv_x, handle)
        raise AssertionError(f"{what}: the call returned on rank {rank}")
    except RankMismatchError as exc:
        message = str(exc)
    took = time.monotonic() - start
    assert took < TIMEOUT_S + 2, f"{what}: raised after {took:.1f} s"
    assert "ranks [0]" in message, message
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    assert all(m == message for m in gathered), "the ranks raised different errors"
    if what != "skipped_dispatch":  # the others' calls are one ahead of rank 0's there: the Buffer is done
        _dispatch(buffer, *_inputs(seed + 1)[rank])
    buffer.destroy()
    _correct_call(dist.group.WORLD, seed + 2)
    return message


@pytest.mark.parametrize("what", ["hidden", "num_experts", "num_worst_tokens", "low_latency_hidden",
                                  "low_latency_num_max", "skipped_dispatch"])
def test_ranks_that_make_different_calls_all_raise_before_any_data_moves(what, seed):
    messages = run_on_ranks(3, _mismatch, seed, what, use_cuda=False, timeout_s=120)
    print(messages[0])


def _late_peer(seed, kill):
    """Rank 1 sleeps past the deadline (or dies) before its dispatch. The others must raise within
    timeout_s + 2 s; then every rank still alive makes a new group and a correct call on it."""
    import torch.distributed as dist

    from tokenyard import Buffer, CommTimeoutError, PeerLostError

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(dist.group.WORLD, 1 << 22, 0, backend="reference", timeout_s=TIMEOUT_S)
    args = _inputs(seed)[rank]
    if rank == 1:
        if kill:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        time.sleep(TIMEOUT_S + 1.5)
    start = time.monotonic()
    try:
        _dispatch(buffer, *args)
        raise AssertionError(f"rank {rank}: the dispatch returned with a peer late")
    except (CommTimeoutError, PeerLostError) as exc:
        message, took = str(exc), time.monotonic() - start
    if rank != 1:
        assert took < TIMEOUT_S + 2, f"raised after {took:.1f} s: {message}"
        assert f"rank {rank}" in message and "dispatch/" in message, message
    if kill:
        return message  # the group lost a rank: no collective can include it any more
    group = dist.new_group(list(range(num_ranks)))  # the old one holds unfinished collectives
    _correct_call(group, seed + 1)
    return message


def test_a_rank_that_sleeps_past_the_deadline_makes_the_others_raise_then_a_new_group_works(seed):
    messages = run_on_ranks(3, _late_peer, seed, False, use_cuda=False, timeout_s=120, group_timeout_s=10)
    assert all("timed out" in m for m in messages), messages
    print(messages[0])


def test_a_rank_killed_before_its_call_makes_the_others_raise_not_hang(seed):
    with pytest.raises(RuntimeError) as failed:
        run_on_ranks(3, _late_peer, seed, True, use_cuda=False, timeout_s=120, group_timeout_s=10)
    report = str(failed.value)
    # Only the killed rank is missing, noticed by its end (SIGKILL); the others returned (they raised in time,
    # asserted inside).
    assert "--- rank 0 ---" not in report and "--- rank 2 ---" not in report, report
    assert f"--- rank 1 ---\nits process ended with exit code -{int(signal.SIGKILL)}" in report, report
