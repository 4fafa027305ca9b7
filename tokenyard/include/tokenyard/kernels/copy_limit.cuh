// copy_to_peers: the physical limit the benchmark compares against (NOTE [copy limit] in bench/runner.py).
// Every block copies its slice of `src` into the buffer of every other rank at once (one read, one write
// per peer), with the same 16-byte accesses and unrolling as the dispatch sender.
#pragma once

#include "../ptx.cuh"

namespace tokenyard::kernels {

template <int kNumRanks, int kNumThreads>
__device__ __forceinline__ void copy_to_peers(const int4* src, int64_t num_int4, uint8_t* const* peer_bases, int rank,
                                              int64_t offset_bytes, int64_t stride_bytes) {
    constexpr int kUnroll = 8;
    const int64_t per_block = (num_int4 + gridDim.x - 1) / gridDim.x;
    const int64_t begin = blockIdx.x * per_block, end = min(num_int4, begin + per_block);
    int4* dst[kNumRanks];
#pragma unroll
    for (int q = 0; q < kNumRanks; ++q)
        dst[q] = reinterpret_cast<int4*>(peer_bases[q] + offset_bytes + rank * stride_bytes);
    for (int64_t base = begin + threadIdx.x; base < end; base += kUnroll * kNumThreads) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + u * kNumThreads;
            if (i < end)
                v[u] = ptx::ld_nc_v4(src + i);
        }
#pragma unroll
        for (int q = 0; q < kNumRanks; ++q) {
            if (q == rank)
                continue;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = base + u * kNumThreads;
                if (i < end)
                    ptx::st_na_v4(dst[q] + i, v[u]);
            }
        }
    }
}

}  // namespace tokenyard::kernels
