// The transport seam's operation counters (issue 53): what the kernels asked of the engine, per destination rank.
//
// NOTE [operation counters]
// Only where the unit defines TOKENYARD_COUNT_OPERATIONS (the setting of that name: Transport.load in
// backends/cuda/transport.py then loads every NVSHMEM unit with the define written before its include, so its source
// and cache key are its own) does each function of the seam (NOTE [transport seam]) tally what it asks into the
// module's global `tokenyard_operation_counts`, which the host reads and zeroes (Transport.operation_counts). Without
// the define the functions below are empty: the default kernels are the same instructions. Row 1 + peer holds what
// went to rank `peer`: puts, their bytes (those of puts with signal too), puts with signal, signals (set or add);
// row 0 what names no rank: quiets and fences. A warp's put is one operation, counted by its lane 0; a signal, a
// quiet or a fence is one per calling thread, as NVSHMEM posts it. The seam has no atomic of its own (a signal_add
// is NVSHMEM's signal op), so none is counted. Each count is a 64-bit atomicAdd to global memory: a debug setting,
// never one to time calls with.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tokenyard::transport {

enum CountedOperation : int {
    kCountedPuts = 0,
    kCountedPutBytes = 1,
    kCountedPutSignals = 2,
    kCountedSignals = 3,
    kCountedQuiets = 4,
    kCountedFences = 5,
    kNumCountedOperations = 6,
};

constexpr int kCountedPeers = 1024;  // rows of destinations; Transport refuses to count for a larger group

}  // namespace tokenyard::transport

#ifdef TOKENYARD_COUNT_OPERATIONS
extern "C" {  // a name the host looks up unmangled (cuModuleGetGlobal); zero when the module loads
__device__ unsigned long long tokenyard_operation_counts[(1 + tokenyard::transport::kCountedPeers) *
                                                         tokenyard::transport::kNumCountedOperations];
}
#endif

namespace tokenyard::transport {

#ifdef TOKENYARD_COUNT_OPERATIONS
__device__ __forceinline__ void count_operation(int row, CountedOperation operation, uint64_t amount) {
    atomicAdd(tokenyard_operation_counts + row * kNumCountedOperations + operation,
              static_cast<unsigned long long>(amount));
}
#endif

// A warp's put of `bytes` to `peer` (with its signal where `with_signal`); every lane calls it, lane 0 counts.
__device__ __forceinline__ void count_put_warp(int peer, size_t bytes, bool with_signal) {
#ifdef TOKENYARD_COUNT_OPERATIONS
    if (threadIdx.x % 32 == 0) {  // the kernels' blocks are one-dimensional
        count_operation(1 + peer, with_signal ? kCountedPutSignals : kCountedPuts, 1);
        count_operation(1 + peer, kCountedPutBytes, bytes);
    }
#endif
}

__device__ __forceinline__ void count_signal(int peer) {
#ifdef TOKENYARD_COUNT_OPERATIONS
    count_operation(1 + peer, kCountedSignals, 1);
#endif
}

__device__ __forceinline__ void count_quiet() {
#ifdef TOKENYARD_COUNT_OPERATIONS
    count_operation(0, kCountedQuiets, 1);
#endif
}

__device__ __forceinline__ void count_fence() {
#ifdef TOKENYARD_COUNT_OPERATIONS
    count_operation(0, kCountedFences, 1);
#endif
}

}  // namespace tokenyard::transport
