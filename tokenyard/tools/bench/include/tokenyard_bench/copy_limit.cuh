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
//   kCopyTma (5): lane 0 of kTmaWarps warps a block, no register copy at all: pieces of kTmaStageBytes go global ->
//       shared by TMA bulk loads, kTmaStages of them in flight per warp, and from shared to every peer by TMA bulk
//       stores (issue 50 reports such a writer, one a block, faster than any SM-store one, with 8 SMs as with all).
//       More warps of smaller stages are the normal-mode senders' shape (copy_patterns.py --tma_shapes senders).
//   kCopyTmaAdd (6): kCopyTma with bulk reduce-adds of bf16 to the peers (cp.reduce.async.bulk .add.noftz.bf16)
//       instead of bulk stores: how fast a combine that sums its rows in the peers' memory could send them
//       (issue 50); not a copy, so never the copy limit (PROBE_PATTERNS in tools/bench/copy_limit.py).
//   kCopyTmaSelf (7): kCopyTma storing every piece into the own rank's memory as well: whether an SM's local writes
//       (the dispatch's own rows, the combine's sums) share the rate of its writes to the peers; its egress is the
//       peers' bytes alone, so never the copy limit either.
//   kCopyTmaLoad (8): kCopyTma's loads alone, nothing stored: the rate an SM reads at, beside the rates it writes at
//       (its figure is the bytes it would have sent over the time; never the copy limit).
#pragma once

#include <tokenyard/copy.cuh>
#include <tokenyard/tma.cuh>

namespace tokenyard::bench {

enum CopyPattern : int {
    kCopyInterleaved = 0,
    kCopyPeerMajor = 1,
    kCopyBulk = 2,
    kCopyPull = 3,
    kCopyPullPeerMajor = 4,
    kCopyTma = 5,
    kCopyTmaAdd = 6,
    kCopyTmaSelf = 7,
    kCopyTmaLoad = 8,
};

// kCopyTmaAdd's peer write: `bytes` of bf16 from shared memory added into global memory (bulk group, as tma::store).
__device__ __forceinline__ void bulk_add_bf16(void* dst, const void* src_shared, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(dst),
                 "r"(tma::shared_address(src_shared)), "r"(bytes)
                 : "memory");
}

constexpr int kCopyUnroll = 8;                              // 16-byte vectors per thread per batch
constexpr int kBulkPieceInt4 = kCopyUnroll * kWarpSize;     // 4 KB per warp and stage

// kCopyTma: writer `writer` of `num_writers` (lane 0 of a warp) takes every num_writers-th piece from `writer`,
// through kTmaStages stages of shared memory at `stages` and as many barriers at `barriers`.
template <int kNumRanks, int kTmaStages, int kTmaStageBytes, int kPattern, typename Params>
__device__ __forceinline__ void copy_to_peers_tma(const Params& p, int4* const (&dst)[kNumRanks], int4* stages,
                                                  uint64_t* barriers, int64_t writer, int64_t num_writers) {
    constexpr int kStageInt4 = kTmaStageBytes / 16;
    const int64_t num_pieces = (p.num_int4 + kStageInt4 - 1) / kStageInt4, step = num_writers;
    const int64_t mine = writer < num_pieces ? (num_pieces - writer + step - 1) / step : 0;
    for (int s = 0; s < kTmaStages; ++s)
        tma::init_barrier(barriers + s);
    tma::fence_barrier_init();
    const auto first_of = [&](int64_t j) { return (writer + j * step) * kStageInt4; };  // the j-th piece's
    const auto bytes_of = [&](int64_t j) {
        return static_cast<uint32_t>(min(static_cast<int64_t>(kStageInt4), p.num_int4 - first_of(j))) * 16u;
    };
    const auto load = [&](int64_t j) {  // the j-th piece into stage j % kTmaStages
        uint64_t* barrier = barriers + j % kTmaStages;
        tma::expect_bytes(barrier, bytes_of(j));
        tma::load(stages + (j % kTmaStages) * kStageInt4, p.src + first_of(j), bytes_of(j), barrier);
    };
    for (int64_t j = 0; j < min(static_cast<int64_t>(kTmaStages), mine); ++j)
        load(j);
    for (int64_t j = 0; j < mine; ++j) {
        tma::wait_phase(barriers + j % kTmaStages, static_cast<uint32_t>(j / kTmaStages) & 1u);
#pragma unroll
        for (int q = 0; q < kNumRanks; ++q)
            if ((q != p.rank || kPattern == kCopyTmaSelf) && kPattern != kCopyTmaLoad) {
                if constexpr (kPattern == kCopyTmaAdd)
                    bulk_add_bf16(dst[q] + first_of(j), stages + (j % kTmaStages) * kStageInt4, bytes_of(j));
                else
                    tma::store(dst[q] + first_of(j), stages + (j % kTmaStages) * kStageInt4, bytes_of(j));
            }
        tma::commit();
        // The previous piece's stores have read its stage (at most this piece's group may still read): the
        // piece kTmaStages after it goes there. Loads stay kTmaStages - 1 pieces ahead of the stores.
        if (j >= 1 && j - 1 + kTmaStages < mine) {
            tma::wait_read<1>();
            load(j - 1 + kTmaStages);
        }
    }
    tma::wait_all();
}

template <int kNumRanks, int kNumThreads, int kPattern, int kTmaWarps, int kTmaStages, int kTmaStageBytes,
          typename Params>
__device__ __forceinline__ void copy_to_peers(const Params& p) {
    int4* dst[kNumRanks];
#pragma unroll
    for (int q = 0; q < kNumRanks; ++q)
        dst[q] = reinterpret_cast<int4*>(p.peer_bases[q] + p.offset_bytes + p.rank * p.stride_bytes);

    if constexpr (kPattern >= kCopyTma) {  // the TMA writers: kCopyTma and the probes after it
        static_assert(kTmaWarps >= 1 && kTmaWarps <= kNumThreads / kWarpSize, "a writer is a warp's lane 0");
        extern __shared__ int4 tma_stages[];  // every writer's stages, then every writer's barriers
        const int warp = threadIdx.x / kWarpSize;
        constexpr int kWriterInt4 = kTmaStages * (kTmaStageBytes / 16);
        uint64_t* barriers = reinterpret_cast<uint64_t*>(tma_stages + kTmaWarps * kWriterInt4) + warp * kTmaStages;
        if (warp < kTmaWarps && threadIdx.x % kWarpSize == 0)
            copy_to_peers_tma<kNumRanks, kTmaStages, kTmaStageBytes, kPattern>(
                p, dst, tma_stages + warp * kWriterInt4, barriers, static_cast<int64_t>(blockIdx.x) * kTmaWarps + warp,
                static_cast<int64_t>(gridDim.x) * kTmaWarps);
        return;
    }

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
                tma::wait_read<1>();
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
            tma::fence_shared_for_async();  // generic writes before async reads
            __syncwarp();
            if (lane == 0) {
#pragma unroll
                for (int q = 0; q < kNumRanks; ++q)
                    if (q != p.rank)
                        tma::store(dst[q] + first, staged, static_cast<uint32_t>(n) * 16u);
                tma::commit();
            }
        }
        if (lane == 0)
            tma::wait_all();
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
