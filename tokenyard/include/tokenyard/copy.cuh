// Warp-wide copies of 16-byte vectors.
#pragma once

#include "ptx.cuh"

namespace tokenyard {

constexpr int kWarpSize = 32;

// Copy `num_int4` vectors from `src` to `dst`, each lane taking every 32nd; loads are issued
// `kUnroll` at a time before their stores so several are in flight.
template <int kUnroll = 4, bool kSrcFromPeers = false>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int num_int4, int lane) {
    int i = lane;
    for (; i + (kUnroll - 1) * kWarpSize < num_int4; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            v[u] = kSrcFromPeers ? ptx::ld_na_v4(src + i + u * kWarpSize) : ptx::ld_nc_v4(src + i + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            ptx::st_na_v4(dst + i + u * kWarpSize, v[u]);
    }
    for (; i < num_int4; i += kWarpSize)
        ptx::st_na_v4(dst + i, kSrcFromPeers ? ptx::ld_na_v4(src + i) : ptx::ld_nc_v4(src + i));
}

}  // namespace tokenyard
