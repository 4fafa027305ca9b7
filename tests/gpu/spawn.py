"""Start one process per GPU with an NCCL group, run a function on each, collect failures."""

from __future__ import annotations

import traceback

from tokenyard.launch import disable_nvlink_multicast, free_port, init_rank

disable_nvlink_multicast()


def _entry(rank, num_ranks, port, fn, args, queue):
    import torch.distributed as dist

    try:
        init_rank(rank, num_ranks, port, use_cuda=True)
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported by the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(num_ranks: int, fn, *args, timeout_s: float = 600.0):
    """Run fn(*args) on `num_ranks` GPU ranks; raise AssertionError with every failing rank's traceback."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, num_ranks, port, fn, args, queue)) for r in range(num_ranks)]
    for p in procs:
        p.start()
    results, failures = {}, {}
    wait_s = timeout_s
    try:
        for _ in range(num_ranks):
            try:
                rank, ok, value = queue.get(timeout=wait_s)
            except Exception:  # noqa: BLE001 - queue.Empty: the others are stuck behind a failed rank
                missing = sorted(set(range(num_ranks)) - set(results) - set(failures))
                failures.update({r: f"no answer within {wait_s:.0f} s" for r in missing})
                break
            (results if ok else failures)[rank] = value
            if failures:
                wait_s = 20.0  # the others may wait in a collective the failed rank never joins
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
    return [results[r] for r in range(num_ranks)]
