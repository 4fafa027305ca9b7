// Rows moved through shared memory by TMA bulk copies, a warp's lane 0 driving them (issue 50): one thread keeps a
// row's bytes in flight to every destination while the warp's other lanes route, so few SMs write at the NVLink
// rate (benchmarks/results/normal.md).
#pragma once

#include "ptx.cuh"
#include "tma.cuh"

namespace tokenyard {

// NOTE [warp stages]
// Each warp of a block owns kStages stages of kStageBytes of the block's dynamic shared memory (all the warps' stages
// first, then a barrier per stage: kSharedBytesPerWarp each). Lane 0 moves rows through them, a piece of at most
// kStageBytes per stage: piece k goes to stage k % kStages once the stores that last read that stage are done reading
// it (a bulk group per piece stored), is loaded, and is then stored to every destination as one group. Piece numbers
// run on across rows; the barrier phases follow them. A row may be loaded ahead (`prefetch`, where `fits`: its pieces
// and those loaded but not yet stored fit the stages) and stored later (`send`, the oldest loaded row first), so that
// the next row's load is in flight while the warp reads the metadata of the row it is at and waits for its load: a warp
// keeps rows moving instead of waiting a memory round trip per row. `copy` loads and stores a row of any size piece by
// piece. A row may be followed by a tail from elsewhere (the combine's top-k weights after the row's data), loaded into
// the same pieces and stored with it. A row that the stages hold whole may also be copied out of them by the warp's
// lanes (`copy_out`, before lane 0 loads anything more): a sender's own rank's row goes so to the outputs. Before the
// warp publishes what it stored (a release at system scope), lane 0 `drain`s: every store complete, then a proxy fence,
// so that the generic release covers the bytes the async proxy wrote (or `drain_older`s: the same for all but the
// newest pieces, so that it may publish older rows without emptying its stages). Before a warp returns, lane 0
// `retire`s: no bulk copy, load or store, may still use the block's shared memory.
template <int kStages, int kStageBytes>
struct WarpStages {
    static_assert(kStages >= 2 && kStages <= 4, "wait_read_newer's cases");
    static_assert(kStageBytes >= 16 && kStageBytes % 16 == 0, "TMA moves multiples of 16 bytes");
    static constexpr int kSharedBytesPerWarp = kStages * (kStageBytes + 8);

    uint8_t* stages;
    uint64_t* barriers;
    uint32_t loaded = 0, stored = 0;  // pieces loaded into the stages, and stored from them (lane 0's)

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

    __device__ __forceinline__ static uint32_t pieces(uint32_t bytes) { return (bytes + kStageBytes - 1) / kStageBytes; }

    __device__ __forceinline__ bool fits(uint32_t bytes) const { return pieces(bytes) + (loaded - stored) <= kStages; }

    // Load row `src` of `bytes`, followed by `tail_bytes` from `tail` (both multiples of 16; the row's pieces cut
    // across the two as they fall), into the next stages; `fits(bytes + tail_bytes)` must hold.
    __device__ __forceinline__ void prefetch(const void* src, uint32_t bytes, const void* tail = nullptr,
                                             uint32_t tail_bytes = 0) {
        for (uint32_t offset = 0; offset < bytes + tail_bytes; offset += kStageBytes)
            load_piece(src, bytes, tail, tail_bytes, offset);
    }

    // Store the oldest loaded row, of `bytes`, to each non-null `dst[i]` (none: the row is dropped).
    template <int kMaxDsts>
    __device__ __forceinline__ void send(uint32_t bytes, void* const (&dst)[kMaxDsts], uint32_t dst_offset = 0) {
        for (uint32_t offset = 0; offset < bytes; offset += kStageBytes) {
            const uint32_t n = min(bytes - offset, static_cast<uint32_t>(kStageBytes));
            const int s = static_cast<int>(stored % kStages);
            tma::wait_phase(barriers + s, (stored / kStages) & 1u);
#pragma unroll
            for (int i = 0; i < kMaxDsts; ++i)
                if (dst[i] != nullptr)
                    tma::store(static_cast<uint8_t*>(dst[i]) + dst_offset + offset, stages + s * kStageBytes, n);
            tma::commit();
            ++stored;
        }
    }

    // `bytes` from `src`, then `tail_bytes` from `tail`, to each non-null `dst[i]`, piece by piece (a row of any
    // size; nothing loaded ahead).
    template <int kMaxDsts>
    __device__ __forceinline__ void copy(const void* src, uint32_t bytes, void* const (&dst)[kMaxDsts],
                                         const void* tail = nullptr, uint32_t tail_bytes = 0) {
        for (uint32_t offset = 0; offset < bytes + tail_bytes; offset += kStageBytes) {
            const uint32_t n = load_piece(src, bytes, tail, tail_bytes, offset);
            send(n, dst, offset);
        }
    }

    // The whole warp copies a row of `bytes` that lane 0 has sent from the stages (its pieces `first`, first + 1,
    // ...; all resident: a row of at most kStages pieces, and nothing loaded since) to `dst` with 16-byte stores:
    // a local copy through the SM's load/store units, leaving the copy engine to the peers' stores.
    __device__ __forceinline__ void copy_out(int4* dst, uint32_t first, uint32_t bytes, int lane) const {
        for (uint32_t k = 0; k < pieces(bytes); ++k)  // each lane sees the loads complete
            tma::wait_phase(barriers + (first + k) % kStages, ((first + k) / kStages) & 1u);
        for (uint32_t i = lane; i < bytes / 16; i += kWarpSize) {
            const uint32_t k = i * 16 / kStageBytes, at = i * 16 % kStageBytes;
            ptx::st_na_v4(dst + i, *reinterpret_cast<const int4*>(stages + (first + k) % kStages * kStageBytes + at));
        }
    }

    // As `drain`, but for the stores of every piece except the newest kNewer stored: what those older pieces wrote
    // may be published while the newer ones are still on their way.
    template <int kNewer>
    __device__ __forceinline__ void drain_older() {
        tma::wait_written<kNewer>();
        tma::fence_global_proxies();
    }

    __device__ __forceinline__ void drain() { drain_older<0>(); }

    __device__ __forceinline__ void retire() {
        for (uint32_t k = stored; k != loaded; ++k)  // rows loaded ahead and never sent
            tma::wait_phase(barriers + k % kStages, (k / kStages) & 1u);
        drain();
    }

  private:
    // Piece `offset / kStageBytes` of the row `src` (`bytes`) then `tail` (`tail_bytes`) into the next stage, once
    // the stores that last read that stage are done reading it -> the piece's bytes.
    __device__ __forceinline__ uint32_t load_piece(const void* src, uint32_t bytes, const void* tail,
                                                   uint32_t tail_bytes, uint32_t offset) {
        const uint32_t n = min(bytes + tail_bytes - offset, static_cast<uint32_t>(kStageBytes));
        const int s = static_cast<int>(loaded % kStages);
        if (loaded >= kStages)  // the stage's last piece, loaded - kStages, was stored: its group done reading
            wait_read_newer(stored - (loaded - kStages) - 1);
        tma::expect_bytes(barriers + s, n);
        uint8_t* stage = stages + s * kStageBytes;
        if (offset < bytes)
            tma::load(stage, static_cast<const uint8_t*>(src) + offset, min(n, bytes - offset), barriers + s);
        if (offset + n > bytes) {
            const uint32_t from = max(offset, bytes);  // where in the row the tail's part of the piece starts
            tma::load(stage + (from - offset), static_cast<const uint8_t*>(tail) + (from - bytes), offset + n - from,
                      barriers + s);
        }
        ++loaded;
        return n;
    }

    // Until at most `newer` bulk groups (0 <= newer < kStages) may still read their shared memory.
    __device__ __forceinline__ static void wait_read_newer(uint32_t newer) {
        switch (newer) {
            case 0: tma::wait_read<0>(); break;
            case 1: tma::wait_read<1>(); break;
            case 2: tma::wait_read<2>(); break;
            default: tma::wait_read<3>(); break;
        }
    }
};

}  // namespace tokenyard
