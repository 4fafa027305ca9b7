// TMA bulk copies (sm_90): one thread moves a whole piece between global and shared memory, the copy engine of the
// SM doing the rest, so few threads (and few SMs) keep many bytes in flight (issue 50).
//
// Loads (global -> shared) complete on an mbarrier: the issuing thread announces the bytes (`expect_bytes`), the
// copy counts them down, `wait_phase` sees the phase flip. Stores (shared -> global, a peer's IPC-mapped memory
// included) complete by bulk groups: `commit` closes a group, `wait_read<N>` returns once at most N groups may still
// read their shared source (it may then be overwritten), `wait_written<N>` once at most N may still be writing,
// `wait_all` once every store is done. Sizes and addresses are multiples of 16 bytes. Shared memory written by
// threads must be made visible to the copy engine with `fence_shared_for_async` before a store reads it.
#pragma once

#include "types.cuh"

namespace tokenyard::tma {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void init_barrier(uint64_t* barrier, uint32_t arrivals = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
}

// After `init_barrier`, before the copy engine uses the barrier.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// This thread's arrival, with `bytes` more for the copies that complete on `barrier` in this phase.
__device__ __forceinline__ void expect_bytes(uint64_t* barrier, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
                 : "memory");
}

// Until the phase of parity `parity` has completed (its copies landed). A local copy's completion, no peer's:
// it needs no deadline.
__device__ __forceinline__ void wait_phase(uint64_t* barrier, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(shared_address(barrier)), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ void load(void* dst_shared, const void* src, uint32_t bytes, uint64_t* barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(shared_address(dst_shared)), "l"(src), "r"(bytes), "r"(shared_address(barrier))
                 : "memory");
}

__device__ __forceinline__ void store(void* dst, const void* src_shared, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(shared_address(src_shared)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until at most kPending groups (the newest) may still be writing: the older groups' stores are done.
template <int kPending>
__device__ __forceinline__ void wait_written() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void wait_all() { wait_written<0>(); }

// Between the generic and the async proxy for global memory: after `wait_all`, before the thread publishes the
// stores' bytes with a generic release (NOTE [warp stages] in staging.cuh); after a generic acquire, before a bulk
// load reads what the acquire made visible.
__device__ __forceinline__ void fence_global_proxies() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Threads' writes to shared memory, before a bulk store reads them.
__device__ __forceinline__ void fence_shared_for_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace tokenyard::tma
