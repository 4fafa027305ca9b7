"""Bounded collectives over gloo (tokenyard/backends/collectives.py): a wait given up on leaves its collective posted,
so ranks that post the same collectives stay in step (NOTE [symmetric lifetime] in backends/cuda/memory.py); a
collective that fails says whether a peer was lost or gloo refused this rank's part, naming rank, peer and stage."""

from __future__ import annotations

import pickle
import time

import pytest

from tokenyard.tools import launch


def _late_meeting_then_more():
    import torch
    import torch.distributed as dist

    from tokenyard.backends.collectives import Collectives
    from tokenyard.errors import CommTimeoutError

    rank, num_ranks = dist.get_rank(), dist.get_world_size()

    def gather(obj):
        out = [None] * num_ranks
        dist.all_gather_object(out, obj)
        return out

    exchange = Collectives(dist.group.WORLD, torch.device("cpu"), "host", rank, num_ranks, gather, timeout_s=30.0)
    exchange.op = "destroy"
    if rank == 1:
        time.sleep(1.5)
    gave_up = None
    try:
        exchange.barrier("meeting", timeout_s=0.3)
    except CommTimeoutError as exc:
        gave_up = str(exc)
    exchange.barrier("meeting")  # both ranks post it, whatever the first one's end
    value = 10 * rank + int(torch.randint(0, 9, (1,)))
    return gave_up, value, exchange.max_int(value)


def test_a_meeting_given_up_on_stays_posted_so_later_collectives_pair_up():
    (gave_up_0, value_0, max_0), (gave_up_1, value_1, max_1) = launch.run_on_ranks(
        2, _late_meeting_then_more, use_cuda=False, timeout_s=120)
    assert gave_up_0 is not None and "destroy/meeting" in gave_up_0 and "0.3 s" in gave_up_0, gave_up_0
    assert gave_up_1 is None, gave_up_1  # the late rank found its peer waiting
    assert max_0 == max_1 == max(value_0, value_1)


class _FailedWork:
    """A gloo work handle that finished with `text` as its error."""

    def __init__(self, text):
        self.text = text

    @staticmethod
    def is_completed():
        return True

    def wait(self):
        raise RuntimeError(self.text)


def test_gloo_errors_say_whether_a_peer_was_lost():
    from tokenyard.backends.collectives import finish
    from tokenyard.errors import CollectiveRefusedError, PeerLostError

    lost = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4501. "
            "This is typically caused by a remote worker hanging",
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:31365: Connection reset by peer")
    for text in lost:
        with pytest.raises(PeerLostError, match="cannot be used any more") as caught:
            finish(_FailedWork(text), 1, "dispatch/all_gather", 1.0)
        assert (caught.value.rank, caught.value.peer, caught.value.stage) == (1, -1, "dispatch/all_gather")
        assert "[127.0.0.1]" in str(caught.value) and "pair.cc" not in str(caught.value)
    refused = ("Split sizes doesn't match total dim 0 size",
               "[enforce fail at ../third_party/gloo/gloo/alltoallv.cc:138] inLengthPerRank[myRank] == "
               "outLengthPerRank[myRank]. ")
    for text in refused:
        with pytest.raises(CollectiveRefusedError) as caught:
            finish(_FailedWork(text), 0, "combine/all_to_all", 1.0)
        message = str(caught.value)
        assert "cannot be used any more" not in message and "No peer was lost" in message, message
        assert "enforce fail" not in message and (caught.value.rank, caught.value.peer) == (0, -1)


def test_every_comm_error_names_rank_peer_and_stage_and_pickles():
    from tokenyard import (CollectiveRefusedError, CommError, CommTimeoutError, PeerLostError, RankMismatchError,
                           TokenyardError)

    errors = [CommTimeoutError(1, 2, "dispatch/notify", "late"), PeerLostError(0, "combine/all_to_all", "gone"),
              PeerLostError(0, "combine/all_to_all", "gone", peer=3),
              RankMismatchError("differ", [[0], [1]], rank=1, stage="dispatch/agree"),
              CollectiveRefusedError(1, "dispatch/all_to_all", "Split sizes doesn't match total dim 0 size")]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert isinstance(copy, CommError) and isinstance(copy, TokenyardError) and type(copy) is type(error)
        assert (copy.rank, copy.peer, copy.stage, str(copy)) == (error.rank, error.peer, error.stage, str(error))
    assert errors[2].peer == 3 and "peer rank 3" in str(errors[2]) and errors[1].peer == -1
    assert errors[3].ranks == [[0], [1]]


def _refused_split_then_more():
    import torch
    import torch.distributed as dist

    from tokenyard import Buffer, CollectiveRefusedError

    rank = dist.get_rank()
    buffer = Buffer(dist.group.WORLD, 1 << 20, backend="reference", timeout_s=10.0)
    exchange = buffer._exchange
    exchange.op = "dispatch"
    try:  # splits that do not add up to the tensor, on every rank: torch refuses before anything is sent
        exchange.all_to_all_single(torch.zeros(4), torch.zeros(4), [2, 2], [3, 2])
        refused = None
    except CollectiveRefusedError as exc:
        refused = (str(exc), exc.rank, exc.peer, exc.stage, exc.__cause__ is not None)
    after = exchange.max_int(rank)  # the group is still fine, as the message says
    buffer.destroy()
    return refused, exchange.peer_lost, after


def test_a_collective_gloo_refuses_on_every_rank_leaves_the_group_usable_and_says_so():
    for rank, (refused, peer_lost, after) in enumerate(launch.run_on_ranks(
            2, _refused_split_then_more, use_cuda=False, timeout_s=120)):
        assert refused is not None, f"rank {rank} raised no CollectiveRefusedError"
        message, error_rank, peer, stage, chained = refused
        assert "Split sizes doesn't match" in message and "cannot be used any more" not in message, message
        assert (error_rank, peer, stage, chained) == (rank, -1, "dispatch/all_to_all", True)
        assert not peer_lost and after == 1


def test_a_read_over_nccl_waits_for_its_event_with_a_deadline_naming_rank_and_stage(monkeypatch):
    """NOTE [bounded reads]: where the host reads an NCCL collective's result next, it polls an event recorded after
    it until meeting_wait_s of the Buffer's deadline, and raises CommTimeoutError naming rank and stage; an event
    that completes returns at once. (The event and stream of a CUDA build, faked: the polling is the host's.)"""
    import torch

    from tokenyard.backends import collectives
    from tokenyard.errors import CommTimeoutError

    done = {"now": False}

    class Event:
        def record(self, stream=None):
            self.stream = stream

        def query(self):
            return done["now"]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(collectives, "HOST_SKEW_FLOOR_S", 0.2)  # meeting_wait_s(1e-5): 0.2 s
    exchange = collectives.Collectives(None, torch.device("cuda", 0), "direct", 1, 2, None, timeout_s=1e-5)
    exchange.op = "dispatch"
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as raised:
        exchange._wait_to_read("count_exchange")
    took = time.monotonic() - start
    assert 0.2 <= took < 1.0, took
    assert raised.value.rank == 1 and raised.value.stage == "dispatch/count_exchange", raised.value
    assert "within 0.2 s" in str(raised.value), raised.value
    done["now"] = True
    start = time.monotonic()
    exchange._wait_to_read("count_exchange")
    assert time.monotonic() - start < 0.1
