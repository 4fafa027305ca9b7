// Low-latency dispatch and combine over NVLink (docs/semantics.md, "Low-latency dispatch/combine").
// No host synchronisation and no data-dependent allocation, so both can be captured in a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../copy.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// One half of every rank's low-latency buffer, with the offsets of workspace.LowLatencyLayout.
struct LowLatencyBuffers {
    uint8_t* const* peer_bases;  // [num_ranks] the active half of each rank's buffer
    int rank;
    int num_ranks;
    int num_local_experts;
    int num_max;                 // M: tokens per rank at most
    int64_t dispatch_recv;
    int64_t message_bytes;
    int64_t header_bytes;
    int64_t dispatch_select;
    int64_t dispatch_counts;
    int64_t combine_recv;
    int64_t combine_row_bytes;
    int64_t combine_flags;
    int64_t state;

    // Message `slot` of `source` in rank `owner`'s receive region: one per (source, token sent to owner).
    __device__ __forceinline__ uint8_t* message(int owner, int source, int slot) const {
        return peer_bases[owner] + dispatch_recv + (static_cast<int64_t>(source) * num_max + slot) * message_bytes;
    }
    // This rank's list of the messages from `source` that carry `local_expert`, in token order.
    __device__ __forceinline__ int* selection(int local_expert, int source) const {
        return reinterpret_cast<int*>(peer_bases[rank] + dispatch_select) +
               (static_cast<int64_t>(local_expert) * num_ranks + source) * num_max;
    }
    __device__ __forceinline__ uint64_t* count(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + dispatch_counts) + source;
    }
    __device__ __forceinline__ uint8_t* combine_row(int owner, int expert, int slot) const {
        return peer_bases[owner] + combine_recv + (static_cast<int64_t>(expert) * num_max + slot) * combine_row_bytes;
    }
    __device__ __forceinline__ uint64_t* combine_flag(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + combine_flags) + source;
    }
    __device__ __forceinline__ uint32_t* done_counter(int kind) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + state) + kind;
    }
    __device__ __forceinline__ uint32_t* epoch(int kind) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + state) + 2 + kind;
    }
};

// NOTE [low-latency trace]
// Given a trace array ([gridDim.x][kNumTracePoints] uint64), thread 0 of every block stamps the GPU's global
// timer as the block passes each point below (benchmarks/ll_phases.py reads them); without one (nullptr,
// every call but a traced one) a stamp is a predictable branch.
enum TracePoint : int {
    kTraceStart = 0,      // the block began
    kTracePrologue = 1,   // pair bits built (dispatch) / rows numbered (combine)
    kTraceSent = 2,       // the block's sends are issued
    kTraceCounted = 3,    // past the done counter
    kTracePublished = 4,  // the last block only: signals stored
    kTraceRecvReady = 5,  // dispatch: every source's count seen; combine: pair bits built
    kTraceRecvMid = 6,    // dispatch: headers scanned; combine: warp 0's first item found its rows
    kTraceEnd = 7,
    kNumTracePoints = 8,
};

__device__ __forceinline__ void trace_mark(uint64_t* trace, int point) {
    if (trace != nullptr && threadIdx.x == 0)
        trace[static_cast<int64_t>(blockIdx.x) * kNumTracePoints + point] = ptx::global_timer_ns();
}

// NOTE [pair slots]
// The slot of pair (t, k) inside expert e's region from this rank is the number of this rank's tokens
// before t that chose e, which gives NOTE [recv order] without atomics. Every block builds, in shared
// memory, one bit per (expert, token): bits[e * words + t / 32] bit t % 32. A slot is then a few popcounts,
// and an expert's pair count the popcount of its row. Pairs whose expert is -1, out of range, or on a
// masked rank set no bit and travel nowhere. With kByRank the rows are ranks instead of experts (a bit per
// (rank, token): the token goes to that rank), which numbers the dispatch messages the same way.
template <int kNumTopk, typename TopkT, bool kByRank = false>
__device__ __forceinline__ void build_pair_bits(uint32_t* bits, int words, const TopkT* topk_idx, int num_tokens,
                                                int num_experts, int num_local_experts, const int* rank_mask) {
    const int num_rows = kByRank ? num_experts / num_local_experts : num_experts;
    for (int i = threadIdx.x; i < num_rows * words; i += blockDim.x)
        bits[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_tokens * kNumTopk; p += blockDim.x) {
        const int64_t e = static_cast<int64_t>(topk_idx[p]);
        if (e < 0 || e >= num_experts || (rank_mask != nullptr && rank_mask[e / num_local_experts] != 0))
            continue;
        const int t = p / kNumTopk;
        const int row = kByRank ? static_cast<int>(e / num_local_experts) : static_cast<int>(e);
        atomicOr(&bits[row * words + t / 32], 1u << (t % 32));
    }
    __syncthreads();
}

__device__ __forceinline__ bool pair_chosen(const uint32_t* bits, int words, int e, int t) {
    return (bits[e * words + t / 32] >> (t % 32)) & 1u;
}

__device__ __forceinline__ int pair_slot(const uint32_t* bits, int words, int e, int t) {
    const uint32_t* row = bits + e * words;
    int slot = 0;
    for (int w = 0; w < t / 32; ++w)
        slot += __popc(row[w]);
    return slot + __popc(row[t / 32] & ((1u << (t % 32)) - 1u));
}

__device__ __forceinline__ int row_count(const uint32_t* bits, int words, int row) {
    int count = 0;
    for (int w = 0; w < words; ++w)
        count += __popc(bits[row * words + w]);
    return count;
}

// quant.py's scale rounding: up to a power of two, on the bit pattern.
__device__ __forceinline__ float round_scale_up_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    const uint32_t exponent = ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
    return __uint_as_float(exponent << 23);
}

// NOTE [low-latency epochs]
// Signals carry an epoch kept on the GPU, not a number from the host, so a call captured in a CUDA graph
// and replayed still signals something new each time. Each half of the buffer keeps, per kind (dispatch 0,
// combine 1), a done counter and an epoch. A launch that sends works with epoch = stored + 1 (read by
// every block before it reports done); a receive-only launch (a hook) with the stored epoch, which its
// send launch has already advanced. Every sending block adds one to the done counter when its writes are
// fenced; the block that brings it to gridDim.x is the last: it resets the counter, publishes the
// signals and stores the new epoch.
__device__ __forceinline__ uint32_t launch_epoch(const LowLatencyBuffers& b, int kind, int do_send) {
    return ptx::ld_relaxed_sys(b.epoch(kind)) + (do_send ? 1u : 0u);
}

//
// NOTE [cumulative release]
// No block fences its peer writes at system scope. The barrier orders the block's writes before thread 0's
// GPU-scope release (the counter's acq_rel add), the last block acquires every such release through the
// counter, and its system-scope release of the signal is cumulative: a peer that acquires the signal sees
// every block's writes (causality order is transitive in the PTX memory model). One system fence per rank
// instead of one per block: the per-block fences cost microseconds of every call.
__device__ __forceinline__ bool last_block_done(const LowLatencyBuffers& b, int kind) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        last = ptx::atomic_add_acq_rel_gpu(b.done_counter(kind), 1) + 1 == gridDim.x;
        if (last)
            ptx::st_relaxed_gpu(b.done_counter(kind), 0u);  // the next launch follows in stream order
    }
    __syncthreads();
    return last;
}

// NOTE [rank masking]
// With a rank mask (Buffer(enable_shrink=True)), a rank whose signal misses the deadline is marked in the
// mask instead of failing the call: its pairs count as absent in this call, and later calls neither send
// to it nor wait for it (build_pair_bits drops its experts), so the surviving ranks keep serving. Without a
// mask the timeout is recorded and raised as CommTimeoutError.

// FP8 cast of 16 consecutive channels held by one lane, exactly as quant.py (NOTE [low-latency dispatch]):
// the 8 lanes of one 128-channel group share its amax, so every lane returns the group's scale too.
template <bool kRoundScale>
__device__ __forceinline__ int4 cast_fp8_16(const int4 (&raw)[2], float& scale) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(raw);
    float v[16], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        v[i] = __bfloat162float(h[i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
    if (kRoundScale)
        scale = round_scale_up_pow2(scale);
    uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float q = fminf(fmaxf(__fdiv_rn(v[i], scale), -448.0f), 448.0f);
        packed[i / 4] |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) << (8 * (i % 4));
    }
    return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                     static_cast<int>(packed[3]));
}

constexpr int kSendUnroll = 4;

// NOTE [low-latency dispatch]
// A token crosses to a rank once, whatever number of its experts live there, and the receiver fans it out
// to its local experts (4 ranks, top-8 of 256: ~3.6 messages per token instead of 8 pair copies).
// Send (do_send): the work items are the pairs (t, d) of a token and a rank it goes to (NOTE [pair slots]
// with rows = ranks); consecutive items go to different SMs (item i to warp i / gridDim.x of block
// i % gridDim.x), so a handful of tokens still spreads over the whole GPU. The message lands in d's region
// of this rank at slot = this rank's tokens before t that go to d. A warp quantizes its token on the fly
// (FP8 per 128 channels, exactly as quant.py: amax floored at 1e-4, scale = amax / 448 with an IEEE
// division, optionally rounded up to a power of two, q = e4m3(clamp(x / scale))), each lane 16 channels,
// and writes the message with 16-byte stores: header (token index; then, per top-k choice, its local
// expert on d or -1), data, float32 scales. The last block to finish publishes to each rank d
// (epoch << 32) | tokens sent to d. Receive (do_recv): a block per local expert l waits for every source's
// count; a warp per source scans that source's headers in order and writes the slots of those carrying l
// to l's selection list (a ballot per 32 messages keeps the order); the sources' lists laid one after the
// other give layout_range, and all warps then copy the selected messages into l's packed rows. With a
// recv hook the two halves run as two launches. Signals carry the epoch of NOTE [low-latency epochs].
template <int kNumTopk, typename TopkT, bool kUseFp8, bool kUseUe8m0>
__device__ __forceinline__ void low_latency_dispatch(
        const int4* x, const TopkT* topk_idx, int num_tokens, int hidden, int num_experts, int round_scale,
        uint8_t* packed_recv_x, uint32_t* packed_recv_scales, int* packed_recv_count, int* src_info,
        int64_t* layout_range, int* cumulative_stats, int* rank_mask, uint8_t* const* peer_bases, int rank,
        int num_ranks, int num_max, int64_t dispatch_recv, int64_t message_bytes, int64_t header_bytes,
        int64_t dispatch_select, int64_t dispatch_counts, int64_t combine_recv, int64_t combine_flags, int64_t state,
        int do_send, int do_recv, int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    trace_mark(trace, kTraceStart);
    const int num_local_experts = num_experts / num_ranks;
    const LowLatencyBuffers b{peer_bases, rank, num_ranks, num_local_experts, num_max, dispatch_recv, message_bytes,
                              header_bytes, dispatch_select, dispatch_counts, combine_recv,
                              static_cast<int64_t>(hidden) * 2, combine_flags, state};
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int num_scales = hidden / 128;
    const int data_bytes = kUseFp8 ? hidden : hidden * 2;
    const int num_slots = num_ranks * num_max;
    const uint32_t epoch = launch_epoch(b, 0, do_send);

    if (do_send) {
        extern __shared__ uint32_t bits[];
        const int words = (num_max + 31) / 32;
        build_pair_bits<kNumTopk, TopkT, true>(bits, words, topk_idx, num_tokens, num_experts, num_local_experts,
                                               rank_mask);
        trace_mark(trace, kTracePrologue);
        const int num_items = num_tokens * num_ranks;
        for (int item = warp * gridDim.x + blockIdx.x; item < num_items; item += gridDim.x * num_warps) {
            const int t = item / num_ranks, d = item % num_ranks;
            if (!pair_chosen(bits, words, d, t))
                continue;  // the same for the whole warp
            uint8_t* to = b.message(d, rank, pair_slot(bits, words, d, t));
            uint8_t* data = to + header_bytes;
            const int4* row = x + static_cast<int64_t>(t) * hidden / 8;
            // kSendUnroll rounds of 512 channels: every load of the batch is issued before the first cast,
            // so a lane waits for memory once per batch. The loop bounds are the same for the whole warp
            // (the cast's shuffles need every lane); lanes past the row's end cast zeros and store nothing.
            for (int base = 0; base < hidden; base += kSendUnroll * kWarpSize * 16) {
                int4 raw[kSendUnroll][2];
#pragma unroll
                for (int u = 0; u < kSendUnroll; ++u) {
                    const int c = base + (u * kWarpSize + lane) * 16;  // this lane's 16 channels
                    // FP8 needs hidden % 128 == 0; bf16 rows may end after the lane's first 8 channels.
                    raw[u][0] = c < hidden ? ptx::ld_nc_v4(row + c / 8) : make_int4(0, 0, 0, 0);
                    raw[u][1] = c + 8 < hidden ? ptx::ld_nc_v4(row + c / 8 + 1) : make_int4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < kSendUnroll; ++u) {
                    const int c = base + (u * kWarpSize + lane) * 16;
                    if constexpr (kUseFp8) {
                        if (base + u * kWarpSize * 16 >= hidden)
                            break;  // the same for the whole warp
                        float scale;
                        const int4 q = round_scale ? cast_fp8_16<true>(raw[u], scale) : cast_fp8_16<false>(raw[u], scale);
                        if (c < hidden) {
                            ptx::st_na_v4(reinterpret_cast<int4*>(data + c), q);
                            if (lane % 8 == 0)
                                reinterpret_cast<float*>(data + hidden)[c / 128] = scale;
                        }
                    } else {
                        if (c < hidden)
                            ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8, raw[u][0]);
                        if (c + 8 < hidden)
                            ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8 + 1, raw[u][1]);
                    }
                }
            }
            if (lane == 0)
                *reinterpret_cast<int*>(to) = t;
            if (lane < kNumTopk) {  // which of the token's choices live on d, as local experts
                const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(t) * kNumTopk + lane]);
                const bool here = e >= 0 && e < num_experts && e / num_local_experts == d;
                reinterpret_cast<int16_t*>(to + 16)[lane] = here ? static_cast<int16_t>(e % num_local_experts) : -1;
            }
        }
        trace_mark(trace, kTraceSent);
        const bool last = last_block_done(b, 0);
        trace_mark(trace, kTraceCounted);
        if (last) {
            for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
                if (rank_mask != nullptr && rank_mask[d] != 0)
                    continue;
                const uint64_t word = (static_cast<uint64_t>(epoch) << 32) | static_cast<uint32_t>(row_count(bits, words, d));
                ptx::st_release_sys(b.count(d, rank), word);
            }
            if (threadIdx.x == 0)
                ptx::st_relaxed_sys(b.epoch(0), epoch);
            trace_mark(trace, kTracePublished);
        }
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    // Receive: one block per local expert at a time.
    __shared__ int num_messages[kWarpSize], counts[kWarpSize], begins[kWarpSize];
    for (int l = blockIdx.x; l < num_local_experts; l += gridDim.x) {
        if (threadIdx.x < num_ranks) {
            const int s = threadIdx.x;
            int count = 0;
            if (rank_mask == nullptr || rank_mask[s] == 0) {
                count = wait_for_seq(wait, b.count(rank, s), epoch, s, kStageLowLatencyDispatchRecv,
                                     rank_mask == nullptr);
                if (count < 0 && rank_mask != nullptr)
                    atomicExch(rank_mask + s, 1);  // NOTE [rank masking]
                count = max(0, count);
            }
            num_messages[s] = count;
        }
        __syncthreads();
        trace_mark(trace, kTraceRecvReady);
        for (int s = warp; s < num_ranks; s += num_warps) {
            int* selected = b.selection(l, s);
            int found = 0;
            for (int first = 0; first < num_messages[s]; first += kWarpSize) {
                const int j = first + lane;
                bool carries = false;
                if (j < num_messages[s]) {
                    const int* choices = reinterpret_cast<const int*>(b.message(rank, s, j) + 16);
#pragma unroll
                    for (int w = 0; w < (kNumTopk + 1) / 2; ++w) {  // two int16 choices per word
                        const int word = ptx::ld_na_s32(choices + w);
                        carries |= static_cast<int16_t>(word & 0xffff) == l ||
                                   (2 * w + 1 < kNumTopk && static_cast<int16_t>(word >> 16) == l);
                    }
                }
                const uint32_t ballot = __ballot_sync(0xffffffffu, carries);
                if (carries)
                    selected[found + __popc(ballot & ((1u << lane) - 1u))] = j;
                found += __popc(ballot);
            }
            if (lane == 0)
                counts[s] = found;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) {
                begins[s] = total;
                layout_range[static_cast<int64_t>(l) * num_ranks + s] =
                        (static_cast<int64_t>(total) << 32) | static_cast<int64_t>(counts[s]);
                total += counts[s];
            }
            trace_mark(trace, kTraceRecvMid);
            packed_recv_count[l] = total;
            if (cumulative_stats != nullptr)
                cumulative_stats[l] += total;
        }
        __syncthreads();
        const int total = begins[num_ranks - 1] + counts[num_ranks - 1];
        for (int row = warp; row < total; row += num_warps) {
            int s = 0;
            while (s + 1 < num_ranks && begins[s + 1] <= row)
                ++s;
            const uint8_t* msg = b.message(rank, s, b.selection(l, s)[row - begins[s]]);
            const uint8_t* data = msg + header_bytes;
            const int64_t out = static_cast<int64_t>(l) * num_slots + row;
            warp_copy<8, true>(reinterpret_cast<int4*>(packed_recv_x + out * data_bytes),
                               reinterpret_cast<const int4*>(data), data_bytes / 16, lane);
            if constexpr (kUseFp8) {
                const int* scales = reinterpret_cast<const int*>(data + hidden);
                if constexpr (kUseUe8m0) {
                    // Four groups' biased exponents per int32, little-endian (quant.pack_ue8m0).
                    for (int g4 = lane; g4 < num_scales / 4; g4 += kWarpSize) {
                        uint32_t word = 0;
                        for (int i = 0; i < 4; ++i)
                            word |= ((static_cast<uint32_t>(ptx::ld_na_s32(scales + 4 * g4 + i)) >> 23) & 0xffu) << (8 * i);
                        packed_recv_scales[(static_cast<int64_t>(l) * (num_scales / 4) + g4) * num_slots + row] = word;
                    }
                } else {
                    for (int g = lane; g < num_scales; g += kWarpSize)  // column-major, as DeepEP
                        packed_recv_scales[(static_cast<int64_t>(l) * num_scales + g) * num_slots + row] =
                                ptx::ld_na_s32(scales + g);
                }
            }
            if (lane == 0)
                src_info[out] = ptx::ld_na_s32(reinterpret_cast<const int*>(msg));
        }
        __syncthreads();
    }
    trace_mark(trace, kTraceEnd);
}

// NOTE [low-latency combine]
// Send (do_send): for each local expert l and source s, the rows begin..begin+count of l that came from s
// (layout_range) go back to s, row j of them into s's combine region at (expert, slot j): the same slot
// numbering as the dispatch (NOTE [pair slots]). The rows of all local experts are numbered one after the
// other (a prefix over experts in shared memory) and dealt to the grid's warps like the dispatch items, so
// every SM sends. The last block to finish publishes (epoch << 32) | 1 to every source. Reduce (do_recv):
// the items are (token, chunk of kCombineChunkInt4 16-byte columns), so 128 tokens of hidden 7168 make
// 128 * 7 items for the whole GPU; a warp takes one; lane k finds pair (t, k)'s expert, slot and owner and
// waits for that owner's flag; the warp then sums its columns, for k in order, weight * row in float32
// (a product, then a sum) and writes bf16.
constexpr int kCombineChunkInt4 = 4 * kWarpSize;  // columns of one reduce item: 4 vectors per lane

template <int kNumTopk, typename TopkT>
__device__ __forceinline__ void low_latency_combine(
        const int4* x, const TopkT* topk_idx, const float* topk_weights, const int64_t* layout_range, int num_tokens,
        int hidden, int num_experts, int4* combined_x, int* rank_mask, uint8_t* const* peer_bases, int rank,
        int num_ranks, int num_max, int64_t dispatch_recv, int64_t message_bytes, int64_t header_bytes,
        int64_t dispatch_select, int64_t dispatch_counts, int64_t combine_recv, int64_t combine_flags, int64_t state,
        int do_send, int do_recv, int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    trace_mark(trace, kTraceStart);
    const int num_local_experts = num_experts / num_ranks;
    const LowLatencyBuffers b{peer_bases, rank, num_ranks, num_local_experts, num_max, dispatch_recv, message_bytes,
                              header_bytes, dispatch_select, dispatch_counts, combine_recv,
                              static_cast<int64_t>(hidden) * 2, combine_flags, state};
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int hidden_int4 = hidden * 2 / 16;
    const int num_slots = num_ranks * num_max;
    const uint32_t epoch = launch_epoch(b, 1, do_send);
    extern __shared__ uint32_t shared_words[];

    if (do_send) {
        // first_row[l]: rows of local experts before l (layout_range: the sources' blocks one after the other).
        int* first_row = reinterpret_cast<int*>(shared_words);
        if (threadIdx.x == 0) {
            int total = 0;
            for (int l = 0; l < num_local_experts; ++l) {
                first_row[l] = total;
                const int64_t last = layout_range[static_cast<int64_t>(l) * num_ranks + num_ranks - 1];
                total += static_cast<int>(last >> 32) + static_cast<int>(last & 0xffffffff);
            }
            first_row[num_local_experts] = total;
        }
        __syncthreads();
        trace_mark(trace, kTracePrologue);
        const int total_rows = first_row[num_local_experts];
        int l = 0;
        for (int item = warp * gridDim.x + blockIdx.x; item < total_rows; item += gridDim.x * num_warps) {
            while (first_row[l + 1] <= item)  // items only grow, so l never moves back
                ++l;
            const int i = item - first_row[l];
            const int64_t* ranges = layout_range + static_cast<int64_t>(l) * num_ranks;
            int s = 0;
            while (s + 1 < num_ranks && static_cast<int>(ranges[s + 1] >> 32) <= i)
                ++s;
            if (rank_mask != nullptr && rank_mask[s] != 0)
                continue;
            const int j = i - static_cast<int>(ranges[s] >> 32);
            const int4* src = x + (static_cast<int64_t>(l) * num_slots + i) * hidden_int4;
            warp_copy<8, false>(reinterpret_cast<int4*>(b.combine_row(s, rank * num_local_experts + l, j)), src,
                                hidden_int4, lane);
        }
        trace_mark(trace, kTraceSent);
        const bool last = last_block_done(b, 1);
        trace_mark(trace, kTraceCounted);
        if (last) {
            for (int s = threadIdx.x; s < num_ranks; s += blockDim.x)
                if (rank_mask == nullptr || rank_mask[s] == 0)
                    ptx::st_release_sys(b.combine_flag(s, rank), (static_cast<uint64_t>(epoch) << 32) | 1u);
            if (threadIdx.x == 0)
                ptx::st_relaxed_sys(b.epoch(1), epoch);
            trace_mark(trace, kTracePublished);
        }
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    uint32_t* bits = shared_words;
    const int words = (num_max + 31) / 32;
    build_pair_bits<kNumTopk, TopkT>(bits, words, topk_idx, num_tokens, num_experts, num_local_experts, rank_mask);
    trace_mark(trace, kTraceRecvReady);
    bool first_item = true;
    const int num_chunks = (hidden_int4 + kCombineChunkInt4 - 1) / kCombineChunkInt4;
    for (int item = warp * gridDim.x + blockIdx.x; item < num_tokens * num_chunks; item += gridDim.x * num_warps) {
        const int t = item / num_chunks, chunk = item % num_chunks;
        const uint8_t* row = nullptr;
        float weight = 0.0f;
        bool ok = true;
        if (lane < kNumTopk) {
            const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(t) * kNumTopk + lane]);
            if (e >= 0 && e < num_experts && pair_chosen(bits, words, static_cast<int>(e), t)) {
                const int owner = static_cast<int>(e / num_local_experts);
                const bool arrived = wait_for_seq(wait, b.combine_flag(rank, owner), epoch, owner,
                                                  kStageLowLatencyCombineRecv, rank_mask == nullptr) >= 0;
                if (arrived) {
                    row = b.combine_row(rank, static_cast<int>(e), pair_slot(bits, words, static_cast<int>(e), t));
                    weight = topk_weights[static_cast<int64_t>(t) * kNumTopk + lane];
                } else if (rank_mask != nullptr) {
                    atomicExch(rank_mask + owner, 1);  // NOTE [rank masking]
                } else {
                    ok = false;
                }
            }
        }
        if (!__all_sync(0xffffffffu, ok))
            return;
        if (first_item) {
            trace_mark(trace, kTraceRecvMid);
            first_item = false;
        }
        const int end = min(hidden_int4, (chunk + 1) * kCombineChunkInt4);
        for (int i = chunk * kCombineChunkInt4 + lane; i < end; i += kWarpSize) {
            float acc[8];
#pragma unroll
            for (int c = 0; c < 8; ++c)
                acc[c] = 0.0f;
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const uint8_t* from = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(row), k));
                const float w = __shfl_sync(0xffffffffu, weight, k);
                if (from == nullptr)
                    continue;
                const int4 v = ptx::ld_na_v4(reinterpret_cast<const int4*>(from) + i);
                const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
                for (int c = 0; c < 8; ++c)
                    acc[c] = __fadd_rn(acc[c], __fmul_rn(w, __bfloat162float(h[c])));
            }
            int4 out;
            __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
            for (int c = 0; c < 8; ++c)
                o[c] = __float2bfloat16_rn(acc[c]);
            ptx::st_na_v4(combined_x + static_cast<int64_t>(t) * hidden_int4 + i, out);
        }
    }
    trace_mark(trace, kTraceEnd);
}

}  // namespace tokenyard::kernels
