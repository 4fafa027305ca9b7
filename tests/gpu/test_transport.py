"""The transport seam between nodes (NOTE [transport seam] in include/tokenyard/transport.cuh), device machine
only, on virtual nodes (4 ranks as 2 x 2, 8 as 2 x 4 and 4 x 2; on one GPU under MPS): NVSHMEM started from
the group's unique id, then the check kernel (kernels/transport_check.cuh) three calls in a row, each rank
putting fresh random bytes with a signal to the rank of its local index on every other node; what arrived
(its output poisoned first) must be what those ranks sent. Signals count across the calls. Then every rank
waits for signals that never come: the wait must end at its deadline with a timeout record naming the rank,
a peer it waited for and the stage, not hang."""

from __future__ import annotations

import time

import pytest
import torch

from tokenyard.jit import nvshmem

from . import spawn

pytestmark = [spawn.needs_ranks(),
              pytest.mark.skipif(nvshmem.find() is None, reason="needs NVSHMEM (pip install tokenyard[internode])")]

NUM_BYTES = 96 * 1024 + 16  # per node slot; not a power of two
POISON = 0x5A5A5A5A
CALLS = 3


def _all_gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank(ranks_per_node: int, shares_gpu: bool) -> dict:
    import torch.distributed as dist

    from tokenyard.backends.cuda import kernels, runtime
    from tokenyard.backends.cuda.transport import Transport
    from tokenyard.plan import headers

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_nodes, node, local = num_ranks // ranks_per_node, rank // ranks_per_node, rank % ranks_per_node
    device = torch.cuda.current_device()
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.time()
    transport = Transport.start(rank, num_ranks, _all_gather, tuple(range(num_ranks)),
                                heap_bytes=num_nodes * NUM_BYTES + (1 << 20), shares_gpu=shares_gpu)
    report = {"rank": rank, "start_s": round(time.time() - start, 2)}
    recv, signals, arrivals = (transport.alloc(n) for n in (num_nodes * NUM_BYTES, 8 * num_nodes, 8))
    kernel = transport.load(kernels.transport_check(), device)
    report["gpu_memory_taken_mib"] = round((free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)
    error_flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    record_ptr = runtime.host_alloc_mapped(64)
    record = runtime.int32_view(record_ptr, 16)
    stream = torch.cuda.current_stream().cuda_stream
    common = dict(recv=recv, signals=signals, arrivals=arrivals, bytes=NUM_BYTES, num_nodes=num_nodes,
                  ranks_per_node=ranks_per_node, num_ranks=num_ranks, rank=rank, error_flag=error_flag.data_ptr(),
                  host_record=record_ptr)
    stages = headers.enum("sync.cuh", "Stage")
    times = []
    try:
        for call in range(1, CALLS + 1):
            send = torch.randint(-2**31, 2**31 - 1, (NUM_BYTES // 4,), dtype=torch.int32, device="cuda")
            out = torch.full((num_nodes, NUM_BYTES // 4), POISON, dtype=torch.int32, device="cuda")
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            kernel(1, stream, send=send.data_ptr(), out=out.data_ptr(), expected=call, do_send=1,
                   timeout_ns=20 * 10**9, **common)
            end.record()
            torch.cuda.synchronize()
            times.append(round(begin.elapsed_time(end) * 1000, 1))
            assert record[0] == 0, f"rank {rank} call {call}: error record {list(record[:6])}"
            sent = _all_gather(send.cpu())
            got = out.cpu()
            for m in range(num_nodes):
                if m != node:
                    peer = m * ranks_per_node + local
                    assert torch.equal(got[m], sent[peer]), f"rank {rank} call {call}: node {m}'s bytes differ"
        report["call_us"] = times

        # Nobody sends: every wait must end at its deadline, recorded.
        began = time.time()
        out = torch.full((num_nodes, NUM_BYTES // 4), POISON, dtype=torch.int32, device="cuda")
        kernel(1, stream, send=0, out=out.data_ptr(), expected=CALLS + 1, do_send=0, timeout_ns=50 * 10**6, **common)
        torch.cuda.synchronize()
        report["timeout_s"] = round(time.time() - began, 3)
        kind, who, peer, stage = (record[i] for i in range(4))
        rails = {m * ranks_per_node + local for m in range(num_nodes) if m != node}
        assert (kind, who, stage) == (1, rank, stages["kStageInternodeSignal"]) and peer in rails, \
            f"rank {rank}: expected a timeout record at internode/signal, got {list(record[:6])}"
        assert (out == POISON).all(), f"rank {rank}: a call that timed out wrote its output"
        _all_gather(None)  # every rank is past its waits before symmetric memory goes
    finally:
        for ptr in (recv, signals, arrivals):
            transport.free(ptr)
        transport.close()
        runtime.host_free(record_ptr)
    return report


@pytest.mark.parametrize("num_ranks,ranks_per_node", spawn.virtual_node_layouts())
def test_puts_with_signals_reach_the_other_nodes_and_a_missing_signal_times_out(num_ranks, ranks_per_node):
    reports = spawn.run(num_ranks, _rank, ranks_per_node, spawn.shares_gpu(num_ranks), timeout_s=300.0,
                        fresh=True)
    print(f"transport check, {num_ranks // ranks_per_node} nodes x {ranks_per_node} on {spawn.describe(num_ranks)}: "
          f"{reports}")
