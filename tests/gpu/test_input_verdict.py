"""Bad values in one rank's dispatch inputs, with no host check (NOTE [input verdict] in tokenyard/checks.py):
every rank raises the same InvalidInputError naming that rank, none hangs, and the Buffer goes on serving
good calls, which match the oracle bit for bit, also where the refused dispatch took a fast path. A dispatch with num_worst_tokens does not wait for the counts:
on the CUDA backend every rank raises at its next call. A low-latency dispatch has no count exchange: on the
reference backend its call header carries the verdict, so every rank raises (-5 as well as an id past the end);
on the CUDA backend the rank with bad ids raises at its next call. A layout of bad ids raises nothing and counts
them nowhere; the next fresh dispatch refuses. The same function runs on the reference backend over CPU ranks
(tests/cpu/test_input_verdict.py).
"""

from __future__ import annotations

import pytest
import torch

from . import spawn

NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 96, 512, 32, 4


def _raises(fn, *fragments):
    """fn() raises InvalidInputError whose message holds every fragment; returns the message."""
    from tokenyard import InvalidInputError

    try:
        fn()
    except InvalidInputError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"no error; expected one saying {fragments}")
    for fragment in fragments:
        assert fragment in message, f"{message!r} does not say {fragment!r}"
    return message


def judge_inputs(seed: int, backend: str = "cuda"):
    import torch.distributed as dist

    from tokenyard import Buffer, Config
    from tokenyard.semantics import routing
    from tokenyard.tools.testing import make_rank_inputs

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    nvl_bytes = Config(num_max_tokens_per_rank=NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)

    def new_buffer():
        buffer = Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend=backend, timeout_s=30)
        assert not buffer.check_inputs, "the default must be the device-side judgement"
        if backend == "cuda":
            buffer.runtime.poison_outputs = True
        return buffer

    buffer = new_buffer()
    bad_rank = num_ranks - 1 - seed % num_ranks  # a different rank from run to run
    every = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, "uniform", "bf16", device)
    x, topk_idx, weights = every[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)
    gen = torch.Generator().manual_seed(seed)
    token = int(torch.randint(NUM_TOKENS, (1,), generator=gen))
    named = f"rank {bad_rank} gave bad values"

    def mine_or(bad, fine):
        return bad if rank == bad_rank else fine

    # 1. An expert id past the end, and one below -1.
    for value in (NUM_EXPERTS, -2):
        ids = topk_idx.clone()
        ids[token, 1] = value
        _raises(lambda: buffer.dispatch(x, topk_idx=mine_or(ids, topk_idx), topk_weights=weights, **layout),
                named, f"outside [-1, {NUM_EXPERTS})")
    # 2. Layout tensors that disagree with topk_idx: one token's rank moved, one expert's count moved.
    flipped = in_rank.clone()
    flipped[token, 0] = not bool(flipped[token, 0])
    moved = dict(layout, is_token_in_rank=flipped, num_tokens_per_rank=flipped.sum(0, dtype=torch.int32))
    _raises(lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **mine_or(moved, layout)),
            named, "is_token_in_rank disagrees with topk_idx")
    shifted = per_expert.clone()
    shifted[0], shifted[1] = shifted[0] + 1, shifted[1] - 1
    recounted = dict(layout, num_tokens_per_expert=shifted)
    _raises(lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **mine_or(recounted, layout)),
            named, "num_tokens_per_expert disagrees with topk_idx")
    plus_one = dict(layout, num_tokens_per_rank=per_rank + 1)
    _raises(lambda: buffer.dispatch(x, **mine_or(plus_one, layout)), named,
            "num_tokens_per_rank disagrees with is_token_in_rank")
    # 3. A layout of bad ids, dispatched without topk_idx: the layout raises nothing and counts the id nowhere
    # (as -1), and the next fresh dispatch refuses on every rank.
    ids = topk_idx.clone()
    ids[token, 0] = NUM_EXPERTS + 5
    bad_layout = buffer.get_dispatch_layout(mine_or(ids, topk_idx), NUM_EXPERTS)
    counted = routing.dispatch_layout(torch.where(ids == NUM_EXPERTS + 5, -1, ids) if rank == bad_rank else topk_idx,
                                      NUM_EXPERTS, num_ranks)
    assert all(torch.equal(got, want.to(got.device)) for got, want in zip(
        (bad_layout[0], bad_layout[2], bad_layout[3]), counted)), "the layout counted the bad id somewhere"
    _raises(lambda: buffer.dispatch(x, num_tokens_per_rank=bad_layout[0], num_tokens_per_expert=bad_layout[2],
                                    is_token_in_rank=bad_layout[3]), named, "get_dispatch_layout was given")

    # 4. The same Buffer still serves a good dispatch and a combine, as the oracle says.
    want = routing.dispatch([e[0] for e in every], [None] * num_ranks, [e[1] for e in every],
                            [e[2] for e in every], NUM_EXPERTS)[rank]
    recv_x, recv_topk_idx, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, **layout)
    assert torch.equal(recv_x, want["recv_x"]), "recv_x differs after the refusals"
    assert torch.equal(recv_topk_idx, want["recv_topk_idx"]) and torch.equal(recv_weights, want["recv_topk_weights"])
    assert per_expert_list == want["num_recv_tokens_per_expert_list"]
    combined, _, _ = buffer.combine(recv_x, handle)
    assert combined.shape == x.shape and bool(torch.isfinite(combined.float()).all())
    # 4b. The same refusal once the good call recorded its shape: on the CUDA backend it takes the fast path,
    # whose host wait in C++ finds the verdict and leaves the raising to the Python wait (NOTE [counted finish]);
    # the Buffer then serves the next call there too.
    fast = buffer._fast
    hits = 0 if fast is None else fast.hits
    ids = topk_idx.clone()
    ids[token, 1] = NUM_EXPERTS
    _raises(lambda: buffer.dispatch(x, topk_idx=mine_or(ids, topk_idx), topk_weights=weights, **layout),
            named, f"outside [-1, {NUM_EXPERTS})")
    assert fast is None or buffer.topology.num_nodes > 1 or fast.hits > hits, \
        "the refused dispatch did not take the fast path"  # the fast paths serve one node's calls
    again = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    assert torch.equal(again[0], want["recv_x"]) and again[3] == want["num_recv_tokens_per_expert_list"], \
        "the fast dispatch after the refusal differs"

    # 5. Low latency, an id past the end and one below -1. The reference backend judges the ids with the call's
    # header (NOTE [call agreement]): every rank raises before any data moves, and the Buffer serves the next
    # call. The CUDA backend has no exchange before rows move: the rank with a bad id raises at its next call.
    if backend == "reference":
        for value in (NUM_EXPERTS, -5):
            ll_ids = topk_idx.clone()
            ll_ids[token, 2] = value
            _raises(lambda: buffer.low_latency_dispatch(x, mine_or(ll_ids, topk_idx), NUM_TOKENS, NUM_EXPERTS,
                                                        use_fp8=False),
                    f"low_latency_dispatch refused on every rank: {named}", f"outside [-1, {NUM_EXPERTS})")
        _, count, _, _, _ = buffer.low_latency_dispatch(x, topk_idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
        want = routing.low_latency_dispatch([e[0] for e in every], [e[1] for e in every], NUM_TOKENS, NUM_EXPERTS,
                                            use_fp8=False)[rank]
        assert torch.equal(count, want["packed_recv_count"]), "the low-latency call after the refusals differs"
    else:
        ll_ids = topk_idx.clone()
        ll_ids[token, 2] = NUM_EXPERTS
        low = f"rank {bad_rank}: the topk_idx of low_latency_dispatch holds expert ids outside [-1, {NUM_EXPERTS})"
        try:
            buffer.low_latency_dispatch(x, mine_or(ll_ids, topk_idx), NUM_TOKENS, NUM_EXPERTS, use_fp8=False)
            raised = None
        except Exception as exc:  # noqa: BLE001 - checked below
            raised = exc
        torch.cuda.synchronize()
        dist.barrier()
        if raised is None and rank == bad_rank:
            _raises(lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS), low)
        elif rank == bad_rank:
            assert low in str(raised), str(raised)
        else:
            assert raised is None, f"rank {rank} raised for rank {bad_rank}'s ids: {raised}"
    dist.barrier()
    buffer.destroy()

    # 6. num_worst_tokens: no CPU wait; the error comes no later than the next call, on every rank.
    buffer = new_buffer()
    ids = topk_idx.clone()
    ids[token, 3] = NUM_EXPERTS
    worst = NUM_TOKENS * num_ranks
    try:
        buffer.dispatch(x, topk_idx=mine_or(ids, topk_idx), topk_weights=weights, num_worst_tokens=worst, **layout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        _raises(lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS), named, "num_worst_tokens")
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reference backend refuses at once
        assert named in str(exc), str(exc)
    dist.barrier()
    buffer.destroy()
    return f"bad rank {bad_rank}: every case refused as promised"


pytestmark = spawn.needs_ranks()


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_bad_values_are_refused_on_every_rank(num_ranks, seed):
    print(spawn.run(num_ranks, judge_inputs, seed)[0])
