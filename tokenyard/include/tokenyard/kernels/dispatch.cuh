// dispatch: move token rows into their destination ranks' buffers and out into the receive tensors
// (docs/semantics.md, "Normal dispatch"). Runs after dispatch_notify.
#pragma once

#include "../copy.cuh"
#include "../layout.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// NOTE [dispatch roles]
// Blocks [0, num_send_blocks) send; the rest receive. The sender cuts this rank's tokens into chunks of
// kChunkTokens and takes chunk b, b + num_send_blocks, ...; a warp copies one token to every rank it goes
// to (one read of x, up to kNumRanks writes), into row prefix_excl[t][q] of this rank's region in rank
// q's buffer. When a chunk is written the block publishes, in the chunk's slot at each destination, the
// row range it filled and then the call's sequence number (release). Example: 3 send blocks, 10 chunks:
// block 0 sends chunks 0, 3, 6, 9. Receivers take (chunk, source) items chunk-major, so they follow the
// senders' progress: item i is chunk i / kNumRanks of source i % kNumRanks. A receiver waits for the
// slot, then copies its rows to the output rows that follow the rows of lower source ranks
// (rank_prefix_matrix), turning the metadata into recv_topk_idx / recv_topk_weights / recv_src_idx.
//
// Row layout (workspace.normal_dispatch_row_bytes): data (kDataInt4 vectors), then kNumScales 4-byte
// scales padded to 16 bytes, then kNumTopk int32 local expert ids, kNumTopk float32 weights and the int32
// source index, padded to 16 bytes.
template <int kNumRanks, int kNumThreads, int kDataInt4, int kNumScales, int kNumTopk, typename TopkT,
          int kChunkTokens>
__device__ __forceinline__ void dispatch(
        const int4* x, const uint32_t* x_scales, int64_t scale_token_stride, int64_t scale_hidden_stride,
        const TopkT* topk_idx, const float* topk_weights, const bool* is_token_in_rank, const int* prefix_excl,
        const int* rank_prefix_matrix, const int* source_num_tokens, int num_tokens, int num_local_experts,
        int num_send_blocks, int4* recv_x, uint32_t* recv_scales, TopkT* recv_topk_idx, float* recv_topk_weights,
        int* recv_src_idx, int* send_head, int num_worst_tokens, uint8_t* const* peer_bases, int rank,
        int64_t control_bytes, int64_t region_bytes, int64_t slots_bytes, int64_t row_bytes, uint32_t seq,
        int* error_flag, int* host_record, uint64_t timeout_ns) {
    static_assert(kNumRanks <= kWarpSize, "one lane per rank");
    constexpr int kNumWarps = kNumThreads / kWarpSize;
    constexpr int kScaleInts = (kNumScales + 3) / 4 * 4;
    constexpr int kMetaOffset = kDataInt4 * 16 + kScaleInts * 4;
    const NormalBuffers buffers{peer_bases, rank, control_bytes, region_bytes, slots_bytes, row_bytes};
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

    if (static_cast<int>(blockIdx.x) < num_send_blocks) {
        const int num_chunks = (num_tokens + kChunkTokens - 1) / kChunkTokens;
        for (int chunk = blockIdx.x; chunk < num_chunks; chunk += num_send_blocks) {
            const int t0 = chunk * kChunkTokens, t1 = min(num_tokens, t0 + kChunkTokens);
            for (int t = t0 + warp; t < t1; t += kNumWarps) {
                const int64_t token = t;
                const bool hit = lane < kNumRanks && is_token_in_rank[token * kNumRanks + lane];
                const uint32_t mask = __ballot_sync(0xffffffffu, hit);
                const int index = hit ? prefix_excl[token * kNumRanks + lane] : -1;
                if (send_head != nullptr && lane < kNumRanks) {
                    const int before = rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + lane] : 0;
                    send_head[token * kNumRanks + lane] = hit ? before + index : -1;
                }
                uint8_t* dst[kNumRanks];
#pragma unroll
                for (int q = 0; q < kNumRanks; ++q)
                    dst[q] = ((mask >> q) & 1u) ? buffers.row(q, rank, __shfl_sync(0xffffffffu, index, q)) : nullptr;
                // Data: each vector read once, written to every destination.
                const int4* src = x + token * kDataInt4;
                for (int i = lane; i < kDataInt4; i += kWarpSize) {
                    const int4 v = ptx::ld_nc_v4(src + i);
#pragma unroll
                    for (int q = 0; q < kNumRanks; ++q)
                        if (dst[q] != nullptr)
                            ptx::st_na_v4(reinterpret_cast<int4*>(dst[q]) + i, v);
                }
                for (int j = lane; j < kNumScales; j += kWarpSize) {
                    const uint32_t s = x_scales[token * scale_token_stride + j * scale_hidden_stride];
#pragma unroll
                    for (int q = 0; q < kNumRanks; ++q)
                        if (dst[q] != nullptr)
                            reinterpret_cast<uint32_t*>(dst[q] + kDataInt4 * 16)[j] = s;
                }
                if (lane < kNumTopk) {
                    const int64_t e = static_cast<int64_t>(topk_idx[token * kNumTopk + lane]);
                    const float w = topk_weights != nullptr ? topk_weights[token * kNumTopk + lane] : 0.0f;
#pragma unroll
                    for (int q = 0; q < kNumRanks; ++q) {
                        if (dst[q] == nullptr)
                            continue;
                        const int64_t first = static_cast<int64_t>(q) * num_local_experts;
                        const bool local = e >= first && e < first + num_local_experts;
                        int* meta = reinterpret_cast<int*>(dst[q] + kMetaOffset);
                        meta[lane] = local ? static_cast<int>(e - first) : -1;
                        reinterpret_cast<float*>(meta + kNumTopk)[lane] = local ? w : 0.0f;
                    }
                }
                if (lane == 0) {
#pragma unroll
                    for (int q = 0; q < kNumRanks; ++q)
                        if (dst[q] != nullptr)
                            reinterpret_cast<int*>(dst[q] + kMetaOffset)[2 * kNumTopk] = t;
                }
            }
            __syncthreads();
            if (threadIdx.x < kNumRanks) {
                const int q = threadIdx.x;
                ChunkSlot* slot = buffers.slot(q, rank, chunk);
                ptx::fence_acq_rel_sys();
                ptx::st_relaxed_sys(reinterpret_cast<int*>(&slot->begin), prefix_excl[static_cast<int64_t>(t0) * kNumRanks + q]);
                ptx::st_relaxed_sys(reinterpret_cast<int*>(&slot->end), prefix_excl[static_cast<int64_t>(t1) * kNumRanks + q]);
                ptx::st_release_sys(&slot->seq, seq);
            }
        }
        return;
    }

    // Receivers.
    __shared__ bool ok;
    __shared__ int range[2];
    const int receiver = blockIdx.x - num_send_blocks, num_receivers = gridDim.x - num_send_blocks;
    int most_chunks = 0;
    for (int s = 0; s < kNumRanks; ++s)
        most_chunks = max(most_chunks, (source_num_tokens[s] + kChunkTokens - 1) / kChunkTokens);
    const int num_recv = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + rank];
    if (num_worst_tokens > 0 && num_recv > num_worst_tokens && receiver == 0 && threadIdx.x == 0)
        record_error(wait, kErrorOverflow, -1, kStageDispatchRecv, num_recv, num_worst_tokens);
    for (int item = receiver; item < most_chunks * kNumRanks; item += num_receivers) {
        const int chunk = item / kNumRanks, source = item % kNumRanks;
        if (chunk * kChunkTokens >= source_num_tokens[source])
            continue;
        if (threadIdx.x == 0) {
            ChunkSlot* slot = buffers.slot(rank, source, chunk);
            ok = wait_at_least(wait, &slot->seq, seq, source, kStageDispatchRecv);
            range[0] = ptx::ld_na_s32(&slot->begin);
            range[1] = ptx::ld_na_s32(&slot->end);
        }
        __syncthreads();
        if (!ok)
            return;
        const int first = source > 0 ? rank_prefix_matrix[(source - 1) * kNumRanks + rank] : 0;
        for (int j = range[0] + warp; j < range[1]; j += kNumWarps) {
            const int64_t out = first + j;
            const uint8_t* src = buffers.row(rank, source, j);
            if (num_worst_tokens > 0 && out >= num_worst_tokens)
                continue;  // recorded above as an overflow error
            warp_copy<4, true>(recv_x + out * kDataInt4, reinterpret_cast<const int4*>(src), kDataInt4, lane);
            for (int s = lane; s < kNumScales; s += kWarpSize)
                recv_scales[out * kNumScales + s] = ptx::ld_na_s32(reinterpret_cast<const int*>(src + kDataInt4 * 16) + s);
            const int* meta = reinterpret_cast<const int*>(src + kMetaOffset);
            if (lane < kNumTopk) {
                recv_topk_idx[out * kNumTopk + lane] = static_cast<TopkT>(ptx::ld_na_s32(meta + lane));
                recv_topk_weights[out * kNumTopk + lane] = __int_as_float(ptx::ld_na_s32(meta + kNumTopk + lane));
            }
            if (lane == 0)
                recv_src_idx[out] = ptx::ld_na_s32(meta + 2 * kNumTopk);
        }
        __syncthreads();
    }
    // Padding rows of a worst-case-sized output (docs/semantics.md).
    if (num_worst_tokens > 0) {
        const int stride = num_receivers * kNumThreads;
        for (int64_t r = num_recv + receiver * kNumThreads + threadIdx.x; r < num_worst_tokens; r += stride) {
            recv_src_idx[r] = -1;
            for (int k = 0; k < kNumTopk; ++k) {
                recv_topk_idx[r * kNumTopk + k] = static_cast<TopkT>(-1);
                recv_topk_weights[r * kNumTopk + k] = 0.0f;
            }
        }
    }
}

}  // namespace tokenyard::kernels
