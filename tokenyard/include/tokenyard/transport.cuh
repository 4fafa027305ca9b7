// The transport seam: what the internode kernels ask of the engine that carries bytes between nodes.
//
// NOTE [transport seam]
// Internode kernels move data to other nodes only through the functions below: a warp's put of bytes, the
// same followed by a signal, a signal alone, fence and quiet, our bounded wait for a signal, and a barrier
// built from signals. They are thin calls of NVSHMEM's device API (issue 25), the engine DeepEP V1 uses; an
// NCCL device API (GIN) build would rewrite this file's bodies and nothing else. The normal-mode signals only
// add: a signal word counts what arrived across calls, so a wait compares with the count a call expects (the
// calls' numbers, NOTE [normal-mode call numbers] in sync.cuh) and needs no reset between calls. The low-latency
// kernels' words carry their call's tag and are set (NOTE [internode low-latency] in sync.cuh). No wait is
// NVSHMEM's own (nvshmem_signal_wait_until spins forever): we poll the word with acquire loads under the
// deadline of a WaitContext, which records a timeout for Python to raise (NOTE [error record] in sync.cuh).
// Units that include this header link NVSHMEM's device library (NOTE [NVSHMEM units] in jit/nvshmem.py). Under
// TOKENYARD_COUNT_OPERATIONS each function tallies what it posts (NOTE [operation counters] in operation_counts.cuh).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "operation_counts.cuh"
#include "sync.cuh"

namespace tokenyard::transport {

__device__ __forceinline__ int rank() { return nvshmem_my_pe(); }

__device__ __forceinline__ int num_ranks() { return nvshmem_n_pes(); }

// Copy `bytes` from `src` (any memory of this GPU) to the symmetric address `dst` of `peer`, without waiting for
// it to land. Every lane of the warp calls it with the same arguments.
__device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes, int peer) {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, peer);
    count_put_warp(peer, bytes, false);
}

// put_warp, then `value` is added to the symmetric word `signal` of `peer` once the bytes have landed there.
__device__ __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* signal,
                                                uint64_t value, int peer) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value, NVSHMEM_SIGNAL_ADD, peer);
    count_put_warp(peer, bytes, true);
}

// put_warp, then the symmetric word `signal` of `peer` is set to `value` once the bytes have landed there.
__device__ __forceinline__ void put_signal_set_warp(void* dst, const void* src, size_t bytes, uint64_t* signal,
                                                    uint64_t value, int peer) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value, NVSHMEM_SIGNAL_SET, peer);
    count_put_warp(peer, bytes, true);
}

// Add `value` to the symmetric word `signal` of `peer` (one thread), ordered after this thread's earlier puts
// to `peer` only where a fence() separates them.
__device__ __forceinline__ void signal_add(uint64_t* signal, uint64_t value, int peer) {
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_ADD, peer);
    count_signal(peer);
}

// Set the symmetric word `signal` of `peer` to `value` (one thread, one 64-bit write), as signal_add orders it.
__device__ __forceinline__ void signal_set(uint64_t* signal, uint64_t value, int peer) {
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, peer);
    count_signal(peer);
}

// This thread's puts and signals to each peer before the fence land before those after it.
__device__ __forceinline__ void fence() {
    nvshmem_fence();
    count_fence();
}

// NOTE [block quiet]
// Every put and signal this PE issued has landed, where one thread calls it after its block's barrier: the
// kernels quiet once per block, not per thread. NVSHMEM's device quiet (nvshmemi_quiet, as of 3.8) completes
// every QP of the PE under IBGDA (all its DCIs and RCs, whichever thread posted to them) and the proxy's queue
// under the proxy transport; over P2P, where puts are the threads' stores, it is the caller's system fence,
// which the barrier before it makes cumulative over the block's stores (PTX memory model). A quiet per thread
// was one quiet of every QP per thread, tens of thousands a call (benchmarks/results/internode_ops.md).
__device__ __forceinline__ void quiet() {
    nvshmem_quiet();
    count_quiet();
}

// Spin until this rank's signal word reaches `expected`, with acquire order (what was put before the signal is
// then visible to this thread); false at the deadline, having recorded a timeout for (`peer`, `stage`).
__device__ __forceinline__ bool wait_signal(const WaitContext& ctx, const uint64_t* signal, uint64_t expected,
                                            int peer, int stage) {
    uint64_t start = 0;
    for (int spin = 0;; ++spin) {
        const uint64_t seen = ptx::ld_acquire_sys(signal);
        if (seen >= expected)
            return true;
        if ((spin & 255) == 0) {
            const uint64_t now = ptx::global_timer_ns();
            if (start == 0) {
                start = now;
            } else if (now - start > ctx.timeout_ns || failed(ctx)) {
                record_error(ctx, kErrorTimeout, peer, stage, static_cast<uint32_t>(seen),
                             static_cast<uint32_t>(expected));
                return false;
            }
        }
    }
}

// The `number`-th barrier (1, 2, ...) among ranks `first, first + stride, ...` (`count` of them, this rank one
// of them), on the symmetric word `arrivals`, which only barriers of this set of ranks use. One thread calls it.
// Each rank adds one to every member's word, after its own earlier puts have landed (quiet), and waits until
// its word counts `count` arrivals per barrier so far. False at the deadline (the timeout recorded).
__device__ __forceinline__ bool barrier(const WaitContext& ctx, uint64_t* arrivals, uint64_t number, int first,
                                        int stride, int count) {
    quiet();
    for (int i = 0; i < count; ++i)
        signal_add(arrivals, 1, first + i * stride);
    quiet();
    return wait_signal(ctx, arrivals, number * static_cast<uint64_t>(count), -1, kStageInternodeBarrier);
}

// The transport as the low-latency kernels take it, their template parameter Remote (NOTE [internode
// low-latency] in sync.cuh; within a node they take NoRemote).
struct Remote {
    static constexpr bool kEnabled = true;
    static __device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes, int peer) {
        transport::put_warp(dst, src, bytes, peer);
    }
    static __device__ __forceinline__ void put_signal_set_warp(void* dst, const void* src, size_t bytes,
                                                               uint64_t* signal, uint64_t value, int peer) {
        transport::put_signal_set_warp(dst, src, bytes, signal, value, peer);
    }
    static __device__ __forceinline__ void signal_set(uint64_t* signal, uint64_t value, int peer) {
        transport::signal_set(signal, value, peer);
    }
    static __device__ __forceinline__ void quiet() { transport::quiet(); }
};

}  // namespace tokenyard::transport
