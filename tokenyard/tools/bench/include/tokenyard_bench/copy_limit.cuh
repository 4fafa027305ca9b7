// copy_to_peers: the physical limit the benchmark compares against (NOTE [copy limit] in bench/runner.py).
// Every rank writes the same `num_int4` vectors of `src` into the buffer of every other rank at once.
//
// NOTE [copy patterns]
// Our kernels wrote to peers below what the machine is said to allow, so the way the writes are issued is under
// test (benchmarks/copy_patterns.py; the figures: benchmarks/results/low_latency.md, NOTE [peer-major blocks]):
//   kCopyInterleaved (0): every block copies a slice of `src` to every peer, a batch of 16-byte stores
//       per peer in turn, as the dispatch senders do;
//   kCopyPeerMajor (1): the blocks are split between the peers, each block writing only to its peer, so
//       one SM's stores all travel to one destination;
//   kCopyBulk (2): each warp stages a 4 KB piece in shared memory and one lane sends it to every peer with
//       TMA bulk copies (cp.async.bulk, sm_90), two stages per warp so loads overlap the sends.
//   kCopyPull (3), kCopyPullPeerMajor (4): the other way round, as kCopyInterleaved and kCopyPeerMajor:
//       every rank reads from each peer's buffer the slice that peer would have written to it (loads over
//       NVLink) and stores it into its own buffer; the figure is then ingress per GPU. Pulling moved the bytes
//       no faster than pushing, so the kernels push (benchmarks/results/low_latency.md).
#pragma once

#include <tokenyard/copy.cuh>

namespace tokenyard::bench {

enum CopyPattern : int {
    kCopyInterleaved = 0,
    kCopyPeerMajor = 1,
    kCopyBulk = 2,
    kCopyPull = 3,
    kCopyPullPeerMajor = 4,
};

constexpr int kCopyUnroll = 8;                              // 16-byte vectors per thread per batch
constexpr int kBulkPieceInt4 = kCopyUnroll * kWarpSize;     // 4 KB per warp and stage

__device__ __forceinline__ void bulk_store_to_global(void* dst, const void* src_shared, uint32_t num_bytes) {
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(src_shared));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(num_bytes) : "memory");
}

template <int kNumRanks, int kNumThreads, int kPattern = kCopyInterleaved, typename Params>
__device__ __forceinline__ void copy_to_peers(const Params& p) {
    int4* dst[kNumRanks];
#pragma unroll
    for (int q = 0; q < kNumRanks; ++q)
        dst[q] = reinterpret_cast<int4*>(p.peer_bases[q] + p.offset_bytes + p.rank * p.stride_bytes);

    if constexpr (kPattern == kCopyBulk) {
        extern __shared__ int4 stages[];  // [warps][2][kBulkPieceInt4]
        const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
        const int num_warps = kNumThreads / kWarpSize;
        const int64_t num_pieces = (p.num_int4 + kBulkPieceInt4 - 1) / kBulkPieceInt4;
        int stage = 0;
        for (int64_t piece = static_cast<int64_t>(blockIdx.x) * num_warps + warp; piece < num_pieces;
             piece += static_cast<int64_t>(gridDim.x) * num_warps, stage ^= 1) {
            int4* staged = stages + (warp * 2 + stage) * kBulkPieceInt4;
            const int64_t first = piece * kBulkPieceInt4;
            const int n = static_cast<int>(min(static_cast<int64_t>(kBulkPieceInt4), p.num_int4 - first));
            if (lane == 0)  // the stage's previous sends have read it
                asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            __syncwarp();
            int4 v[kCopyUnroll];
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u)
                if (u * kWarpSize + lane < n)
                    v[u] = ptx::ld_nc_v4(p.src + first + u * kWarpSize + lane);
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u)
                if (u * kWarpSize + lane < n)
                    staged[u * kWarpSize + lane] = v[u];
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes before async reads
            __syncwarp();
            if (lane == 0) {
#pragma unroll
                for (int q = 0; q < kNumRanks; ++q)
                    if (q != p.rank)
                        bulk_store_to_global(dst[q] + first, staged, static_cast<uint32_t>(n) * 16u);
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
        }
        if (lane == 0)
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        return;
    }

    // kCopyInterleaved: every block, every peer. kCopyPeerMajor: block b writes only to peer b % (R - 1).
    // The pull patterns likewise, reading.
    constexpr bool kPull = kPattern == kCopyPull || kPattern == kCopyPullPeerMajor;
    constexpr bool kOnePeer = kPattern == kCopyPeerMajor || kPattern == kCopyPullPeerMajor;
    const int num_targets = kOnePeer ? max(1, kNumRanks - 1) : 1;
    const int num_slices = kOnePeer ? max(1, static_cast<int>(gridDim.x) / num_targets)
                                    : static_cast<int>(gridDim.x);
    const int slice = kOnePeer ? static_cast<int>(blockIdx.x) / num_targets : blockIdx.x;
    if (slice >= num_slices)
        return;  // peer-major with a grid that is not a multiple of R - 1: the spare blocks idle
    const int only = kOnePeer ? (static_cast<int>(blockIdx.x) % num_targets + p.rank + 1) % kNumRanks : -1;
    const int64_t per_block = (p.num_int4 + num_slices - 1) / num_slices;
    const int64_t begin = slice * per_block, end = min(p.num_int4, begin + per_block);
    if constexpr (kPull) {  // from peer q's slice for this rank into this rank's slice of q
        int4* own = reinterpret_cast<int4*>(p.peer_bases[p.rank] + p.offset_bytes);
        for (int64_t base = begin + threadIdx.x; base < end; base += kCopyUnroll * kNumThreads) {
#pragma unroll
            for (int q = 0; q < kNumRanks; ++q) {
                if (q == p.rank || (only >= 0 && q != only))
                    continue;
                int4 v[kCopyUnroll];
#pragma unroll
                for (int u = 0; u < kCopyUnroll; ++u) {
                    const int64_t i = base + u * kNumThreads;
                    if (i < end)
                        v[u] = ptx::ld_na_v4(dst[q] + i);
                }
#pragma unroll
                for (int u = 0; u < kCopyUnroll; ++u) {
                    const int64_t i = base + u * kNumThreads;
                    if (i < end)
                        ptx::st_na_v4(own + q * (p.stride_bytes / 16) + i, v[u]);
                }
            }
        }
        return;
    }
    for (int64_t base = begin + threadIdx.x; base < end; base += kCopyUnroll * kNumThreads) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int64_t i = base + u * kNumThreads;
            if (i < end)
                v[u] = ptx::ld_nc_v4(p.src + i);
        }
#pragma unroll
        for (int q = 0; q < kNumRanks; ++q) {
            if (q == p.rank || (only >= 0 && q != only))
                continue;
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int64_t i = base + u * kNumThreads;
                if (i < end)
                    ptx::st_na_v4(dst[q] + i, v[u]);
            }
        }
    }
}

}  // namespace tokenyard::kernels
