"""Operation counts per internode call (NOTE [operation counts] in tokenyard/tools/bench/model/operations.py):
hand-computed small cases, and the expectations against an exhaustive enumeration of top-k routings."""

from __future__ import annotations

import itertools

import pytest

from tokenyard.tools.bench.model import operations as ops

# 2 nodes x 2 GPUs, 4 tokens, top-2 of 8 experts (2 per rank), hidden 128.
SMALL = dict(tokens=4, topk=2, num_experts=8, nodes=2, gpus_per_node=2, hidden=128)
P_RANK = 1 - 15 / 28  # 1 - C(6, 2) / C(8, 2): a rank holds one of a token's two experts
P_NODE = 1 - 6 / 28   # 1 - C(4, 2) / C(8, 2)


def _mean_over_routings(fn, num_experts=8, topk=2):
    """The mean of fn(experts) over every set of `topk` distinct experts (uniform routing, exactly)."""
    sets = list(itertools.combinations(range(num_experts), topk))
    return sum(fn(s) for s in sets) / len(sets)


def test_deepep_low_latency_small_rdma():
    c = ops.deepep_low_latency("dispatch", fp8=False, **SMALL)
    assert (c["puts_self"], c["puts_node"], c["puts_remote"]) == (2, 2, 4)  # T k / R per rank
    assert c["put_bytes_remote"] == 4 * (16 + 256)
    assert (c["signals_self"], c["atomics_node"], c["atomics_remote"]) == (2, 2, 4)  # E / R counts per rank
    assert (c["nic_puts"], c["nic_atomics"]) == (6, 6)
    assert c["quiets"] == c["fences"] == 0 and c["staged_rows"] == 4
    m = ops.deepep_low_latency("combine", **SMALL)
    assert m["nic_puts"] == 6 and m["put_bytes_remote"] == 4 * 256 and m["staged_rows"] == 6
    assert ops.deepep_low_latency("combine", zero_copy=True, **SMALL)["staged_rows"] == 0


def test_deepep_low_latency_nvlink_route():
    c = ops.deepep_low_latency("dispatch", route="nvlink", **SMALL)
    assert (c["nic_puts"], c["nic_atomics"]) == (4, 4)
    assert c["signals_node"] == 2 and c["atomics_node"] == 0
    with pytest.raises(ValueError):
        ops.deepep_low_latency("dispatch", route="ib", **SMALL)


def test_deepep_rdma_puts_are_pairs_on_other_ranks():
    """In the "rdma" route every (token, expert) pair on another rank is a NIC put, over an enumeration."""
    per_rank = 2
    pairs = _mean_over_routings(lambda s: sum(e // per_rank != 0 for e in s))  # this rank is rank 0
    c = ops.deepep_low_latency("dispatch", **SMALL)
    assert c["nic_puts"] == pytest.approx(SMALL["tokens"] * pairs)


def test_tokenyard_low_latency_puts_are_remote_token_rank_messages():
    """Our dispatch puts one message per (token, rank of another node), over an enumeration."""
    per_rank, gpus = 2, 2  # rank 0 is on node 0: ranks 2 and 3 are the other node's
    remote = _mean_over_routings(lambda s: len({e // per_rank for e in s if e // per_rank >= gpus}))
    node = _mean_over_routings(lambda s: len({e // per_rank for e in s if e // per_rank == 1}))
    c = ops.tokenyard_low_latency("dispatch", **SMALL)
    assert c["nic_puts"] == c["puts_remote"] == pytest.approx(SMALL["tokens"] * remote)
    assert c["puts_node"] == pytest.approx(SMALL["tokens"] * node)
    assert c["puts_remote"] == pytest.approx(4 * P_RANK * 2)
    assert c["signals_remote"] == 2 * (2 + 1)  # per remote rank: its 2 experts' counts and the token count
    assert c["quiets"] == 132 and c["staged_rows"] == c["puts_remote"]  # a quiet per block
    assert ops.tokenyard_low_latency("dispatch", **{**SMALL, "nodes": 1, "num_experts": 4})["quiets"] == 0


def test_tokenyard_low_latency_combine_puts_its_weights_at_once_to_another_node():
    c = ops.tokenyard_low_latency("combine", **SMALL)
    assert c["put_signals_remote"] == 2 and c["signals_remote"] == 2  # per remote rank: the weights' put, the flag
    assert c["put_bytes_remote"] == pytest.approx(c["puts_remote"] * 256 + 2 * 4 * 2 * 8)  # rows, T k words
    assert c["signals_node"] == pytest.approx(4 * P_RANK * 2 + 1)  # within the node a word per weight, the flag
    v3 = dict(tokens=128, topk=8, num_experts=256, nodes=2, gpus_per_node=2, hidden=7168)  # issue 53's item 4:
    assert ops.work_requests(ops.tokenyard_low_latency("combine", **v3)) < \
        ops.work_requests(ops.deepep_low_latency("combine", route="nvlink", **v3))  # no more than DeepEP's


def test_deepep_normal_small():
    c = ops.deepep_normal("dispatch", channels=1, chunk=2, qps=3, **SMALL)
    rows = 4 * P_NODE  # 3.43 rows per (channel, node): 2 chunks, at most 1 head update
    assert c["puts_remote"] == 1 + 1 + 2  # the counts, the channel prefixes, the chunks
    assert c["atomics_remote"] == 2 + 1 and c["atomics_self"] == 3
    assert c["quiets"] == 3 * 1 + 1 and c["barriers"] == 3
    assert c["put_bytes_remote"] == pytest.approx((8 + 4 + 1) * 4 + 72 + rows * 288)  # align16(256 + 8 + 16)
    m = ops.deepep_normal("combine", channels=1, chunk=2, qps=3, **SMALL)
    assert (m["puts_remote"], m["quiets"], m["barriers"]) == (2, 3, 2)
    assert m["put_bytes_remote"] == pytest.approx(rows * 272)  # align16(256 + 8 + 8)


def test_tokenyard_normal_small():
    c = ops.tokenyard_normal("dispatch", blocks=2, **SMALL)
    assert c["puts_remote"] == 1 and c["puts_self"] == pytest.approx(1 + 2 * 4 * P_RANK)  # ceil(3.43 / 4) chunks
    assert c["quiets"] == 2 * 2  # a quiet per block, twice
    # the barrier's one signal to each rank, then both blocks' stage signals
    assert (c["signals_self"], c["signals_node"], c["signals_remote"]) == (1 + 4, 1 + 2, 2 + 2)
    m = ops.tokenyard_normal("combine", blocks=2, **SMALL)
    # ceil(4 P_NODE / 4) chunks of the partial rows, 272 bytes a row
    assert m["puts_remote"] == 1 and m["put_bytes_remote"] == pytest.approx(4 * P_NODE * 272)


@pytest.mark.parametrize("fn", [ops.deepep_low_latency, ops.tokenyard_low_latency, ops.deepep_normal,
                                ops.tokenyard_normal])
def test_relations(fn):
    for call in ops.CALLS:
        small, big = fn(call, **SMALL), fn(call, **{**SMALL, "tokens": 64})
        assert set(small) == set(ops.zero())
        assert all(v >= 0 for v in small.values())
        assert big["put_bytes_remote"] > small["put_bytes_remote"] and big["puts_remote"] >= small["puts_remote"]
        one_node = fn(call, **{**SMALL, "nodes": 1, "num_experts": 4})
        assert one_node["puts_remote"] == 0 and one_node["atomics_remote"] == 0
    with pytest.raises(ValueError):
        fn("gather", **SMALL)
    with pytest.raises(ValueError):
        fn("dispatch", **{**SMALL, "num_experts": 6})


def test_compare_has_both():
    table = ops.compare(**SMALL)
    assert set(table) == {"low_latency", "normal"}
    assert table["low_latency"]["dispatch"]["deepep"]["nic_puts"] == 6
