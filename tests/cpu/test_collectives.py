"""Bounded collectives over gloo (tokenyard/backends/collectives.py): a wait given up on leaves its collective posted,
so ranks that post the same collectives stay in step (NOTE [symmetric lifetime] in backends/cuda/backend.py)."""

from __future__ import annotations

import time

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
