// Rows moved through shared memory by TMA bulk copies, a warp's lane 0 driving them (issue 50): one thread keeps a
// row's bytes in flight to every destination while the warp's other lanes route, so few SMs write at the NVLink
// rate (benchmarks/results/normal.md).
#pragma once

#include "tma.cuh"

namespace tokenyard {

// NOTE [warp stages]
// Each warp of a block owns kStages stages of kStageBytes of the block's dynamic shared memory (all the warps'
// stages first, then a barrier per stage: kSharedBytesPerWarp each). Lane 0 moves a row piece by piece, a piece
// being at most kStageBytes: piece k goes to stage k % kStages once the stores that last read that stage are done
// reading it (a bulk group per piece, so at most kStages - 1 newer groups may still read), is loaded, and is then
// stored to every destination as one group. The stores of piece k - 1 are thus in flight while piece k loads, and
// the block's warps together keep many pieces in flight. Piece numbers run on across rows: the barrier phases
// follow them. Before the warp publishes what it stored (a release at system scope), lane 0 `drain`s: every store
// complete, then a proxy fence, so the generic release covers the bytes the async proxy wrote. Before a warp
// returns, lane 0 drains too: no bulk copy may still read the block's shared memory.
template <int kStages, int kStageBytes>
struct WarpStages {
    static_assert(kStages >= 2 && kStageBytes >= 16 && kStageBytes % 16 == 0, "TMA moves multiples of 16 bytes");
    static constexpr int kSharedBytesPerWarp = kStages * (kStageBytes + 8);

    uint8_t* stages;
    uint64_t* barriers;
    uint32_t count = 0;  // pieces moved so far (lane 0's)

    // Warp `warp` of `num_warps`, in the block's dynamic shared memory `shared` (128-byte aligned). Every lane
    // may build it; lane 0 alone initializes and uses it.
    __device__ __forceinline__ WarpStages(uint8_t* shared, int warp, int num_warps)
        : stages(shared + static_cast<int64_t>(warp) * kStages * kStageBytes),
          barriers(reinterpret_cast<uint64_t*>(shared + static_cast<int64_t>(num_warps) * kStages * kStageBytes) +
                   warp * kStages) {}

    __device__ __forceinline__ void init() {
        for (int s = 0; s < kStages; ++s)
            tma::init_barrier(barriers + s);
        tma::fence_barrier_init();
    }

    // `bytes` (a multiple of 16) from `src` to each non-null `dst[i]`; the caller passes at least one.
    template <int kMaxDsts>
    __device__ __forceinline__ void copy(const void* src, uint32_t bytes, void* const (&dst)[kMaxDsts]) {
        const uint8_t* from = static_cast<const uint8_t*>(src);
        for (uint32_t offset = 0; offset < bytes; offset += kStageBytes) {
            const uint32_t n = min(bytes - offset, static_cast<uint32_t>(kStageBytes));
            const int s = static_cast<int>(count % kStages);
            uint8_t* stage = stages + s * kStageBytes;
            tma::wait_read<kStages - 1>();
            tma::expect_bytes(barriers + s, n);
            tma::load(stage, from + offset, n, barriers + s);
            tma::wait_phase(barriers + s, (count / kStages) & 1u);
#pragma unroll
            for (int i = 0; i < kMaxDsts; ++i)
                if (dst[i] != nullptr)
                    tma::store(static_cast<uint8_t*>(dst[i]) + offset, stage, n);
            tma::commit();
            ++count;
        }
    }

    __device__ __forceinline__ void drain() {
        tma::wait_all();
        tma::fence_global_proxies();
    }
};

}  // namespace tokenyard
