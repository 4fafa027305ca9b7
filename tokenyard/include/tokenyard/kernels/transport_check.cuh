// A check of the transport seam (NOTE [transport seam]) between the ranks of a group seen as nodes: every rank
// puts a block of bytes, with a signal, to the rank of its local index on every other node (the path a token
// takes across nodes in internode dispatch), waits for what those ranks put to it, copies it out, and passes a
// barrier of the whole group. tokenyard/backends/cuda/transport_check.py runs it; tests/gpu/test_transport.py
// compares what arrived with what was sent, and checks that a signal that never comes ends in a timeout.
#pragma once

#include "../transport.cuh"

namespace tokenyard::kernels {

// One block; warp w < num_nodes sends to node w. Symmetric: recv [num_nodes][bytes], signals [num_nodes] (word
// m counts node m's puts), arrivals (the barrier's word). `expected`: this call's number, 1, 2, ... (each call
// adds one to every signal word it waits on, and passes barrier `expected`). `do_send` = 0: send nothing, so
// the waits time out (the check of the deadline).
template <typename Params>
__device__ __forceinline__ void transport_check(const Params& p) {
    const WaitContext ctx{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int node = p.rank / p.ranks_per_node, local = p.rank % p.ranks_per_node;
    auto* recv = static_cast<uint8_t*>(p.recv);
    if (p.do_send && warp < p.num_nodes && warp != node)
        transport::put_signal_warp(recv + static_cast<int64_t>(node) * p.bytes, p.send, p.bytes, p.signals + node, 1,
                                   warp * p.ranks_per_node + local);
    const int from = static_cast<int>(threadIdx.x);
    if (from < p.num_nodes && from != node)
        transport::wait_signal(ctx, p.signals + from, p.expected, from * p.ranks_per_node + local,
                               kStageInternodeSignal);
    __syncthreads();  // the waiters' acquires order every thread's reads below (NOTE [warp acquire])
    if (failed(ctx))
        return;
    const int64_t num_vectors = static_cast<int64_t>(p.num_nodes) * p.bytes / 16;
    for (int64_t i = threadIdx.x; i < num_vectors; i += blockDim.x)
        static_cast<int4*>(p.out)[i] = reinterpret_cast<const int4*>(recv)[i];
    __syncthreads();  // nobody's next call puts into `recv` before every rank has copied it out
    if (threadIdx.x == 0)
        transport::barrier(ctx, p.arrivals, p.expected, 0, 1, p.num_ranks);
}

}  // namespace tokenyard::kernels
