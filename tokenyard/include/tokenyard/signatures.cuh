// The call signatures of a normal-mode call's first exchange (NOTE [call signatures] in layout.cuh).
#pragma once

#include "layout.cuh"
#include "sync.cuh"

namespace tokenyard {

// Thread r < kNumRanks stores this rank's signature in row `rank` of table `table` at rank r; the caller's
// release that signals its arrival at r (by the same thread) follows.
template <int kNumRanks, int kSignatureInts>
__device__ __forceinline__ void send_signature(const NormalBuffers& buffers, int table, const int* signature) {
    static_assert(kNumRanks <= kMaxRanks && kSignatureInts <= kMaxSignatureInts, "the table's row holds it");
    if (threadIdx.x < kNumRanks) {
        int* row = buffers.signatures(threadIdx.x, table) + buffers.rank * kMaxSignatureInts;
#pragma unroll
        for (int i = 0; i < kSignatureInts; ++i)
            ptx::st_relaxed_sys(row + i, signature[i]);
    }
}

// Whole block, once every rank's arrival was acquired: -> whether every row of table `table` here equals
// `signature`. If not, the table goes to the host record and the mismatch is recorded (kErrorCallMismatch).
template <int kNumRanks, int kSignatureInts>
__device__ __forceinline__ bool signatures_agree(const NormalBuffers& buffers, const WaitContext& wait, int table,
                                                 const int* signature, int stage) {
    __shared__ int differ;
    if (threadIdx.x == 0)
        differ = 0;
    __syncthreads();
    const int* rows = buffers.signatures(buffers.rank, table);
    if (threadIdx.x < kNumRanks) {
        bool same = true;
#pragma unroll
        for (int i = 0; i < kSignatureInts; ++i)
            same &= ptx::ld_relaxed_sys(rows + threadIdx.x * kMaxSignatureInts + i) == signature[i];
        if (!same)
            atomicOr(&differ, 1 << threadIdx.x);
    }
    __syncthreads();
    const int mask = differ;
    if (mask == 0)
        return true;
    for (int i = threadIdx.x; i < kNumRanks * kMaxSignatureInts; i += blockDim.x)
        ptx::st_relaxed_sys(wait.host_record + kRecordSignaturesAt + i, ptx::ld_relaxed_sys(rows + i));
    __syncthreads();
    if (threadIdx.x == 0)
        record_error(wait, kErrorCallMismatch, __ffs(mask) - 1, stage, 0, static_cast<uint32_t>(mask));
    return false;
}

}  // namespace tokenyard
