// Warp-wide moves of 16-byte vectors: a batch of loads is issued before its stores, so each lane keeps
// kBatch loads in flight instead of one.
#pragma once

#include "ptx.cuh"

namespace tokenyard {

// v[u] = src[base + u * 32 + lane] for the indices below num_int4. kFromPeers: the data was written by
// other GPUs during this kernel, so it is read through L2 (ld_na) rather than the non-coherent path.
template <int kBatch, bool kFromPeers>
__device__ __forceinline__ void load_batch(int4 (&v)[kBatch], const int4* src, int base, int num_int4, int lane) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kWarpSize + lane;
        if (i < num_int4)
            v[u] = kFromPeers ? ptx::ld_na_v4(src + i) : ptx::ld_nc_v4(src + i);
    }
}

template <int kBatch>
__device__ __forceinline__ void store_batch(int4* dst, const int4 (&v)[kBatch], int base, int num_int4, int lane) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kWarpSize + lane;
        if (i < num_int4)
            ptx::st_na_v4(dst + i, v[u]);
    }
}

// Copy `num_int4` vectors from `src` to `dst` with the whole warp.
template <int kBatch, bool kFromPeers>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int num_int4, int lane) {
    for (int base = 0; base < num_int4; base += kBatch * kWarpSize) {
        int4 v[kBatch];
        load_batch<kBatch, kFromPeers>(v, src, base, num_int4, lane);
        store_batch<kBatch>(dst, v, base, num_int4, lane);
    }
}

}  // namespace tokenyard
