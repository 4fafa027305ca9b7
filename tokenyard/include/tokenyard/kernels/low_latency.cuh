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
    int num_topk;                // K: the stride of the per-message top-k arrays
    int64_t dispatch_recv;
    int64_t message_bytes;
    int64_t header_bytes;
    int64_t dispatch_positions;
    int64_t dispatch_counts;
    int64_t combine_weights;
    int64_t combine_weight_flags;
    int64_t combine_recv;
    int64_t combine_row_bytes;
    int64_t combine_flags;
    int64_t state;

    // Message `slot` of `source` in rank `owner`'s receive region: one per (source, token sent to owner).
    __device__ __forceinline__ uint8_t* message(int owner, int source, int slot) const {
        return peer_bases[owner] + dispatch_recv + (static_cast<int64_t>(source) * num_max + slot) * message_bytes;
    }
    // Per top-k choice of this rank's message `slot` from `source`: the packed row it was copied to
    // (l * R * M + row for local expert l), written by the dispatch, read by the combine.
    __device__ __forceinline__ int* positions(int source, int slot) const {
        return reinterpret_cast<int*>(peer_bases[rank] + dispatch_positions) +
               (static_cast<int64_t>(source) * num_max + slot) * num_topk;
    }
    __device__ __forceinline__ uint64_t* count(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + dispatch_counts) + source;
    }
    // Rank `source`'s top-k weights of the token of its message `slot` to rank `owner`, in `owner`'s buffer.
    __device__ __forceinline__ float* weights(int owner, int source, int slot) const {
        return reinterpret_cast<float*>(peer_bases[owner] + combine_weights) +
               (static_cast<int64_t>(source) * num_max + slot) * num_topk;
    }
    __device__ __forceinline__ uint64_t* weight_flag(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + combine_weight_flags) + source;
    }
    // Expert rank `from`'s partial sum for rank `owner`'s message `slot` to it.
    __device__ __forceinline__ int4* combine_row(int owner, int from, int slot) const {
        return reinterpret_cast<int4*>(peer_bases[owner] + combine_recv +
                                       (static_cast<int64_t>(from) * num_max + slot) * combine_row_bytes);
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

// The kernels' shared parameter list (kernels.py, _LOW_LATENCY_BUFFERS) as the struct above.
#define TOKENYARD_LOW_LATENCY_BUFFER_PARAMS                                                                        \
    uint8_t *const *peer_bases, int rank, int num_ranks, int num_max, int64_t dispatch_recv, int64_t message_bytes, \
            int64_t header_bytes, int64_t dispatch_positions, int64_t dispatch_counts,                              \
            int64_t combine_weights, int64_t combine_weight_flags, int64_t combine_recv, int64_t combine_flags,     \
            int64_t state, int do_send, int do_recv

#define TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, num_topk, hidden)                                              \
    LowLatencyBuffers {                                                                                          \
        peer_bases, rank, num_ranks, (num_experts) / num_ranks, num_max, (num_topk), dispatch_recv, message_bytes, \
                header_bytes, dispatch_positions, dispatch_counts, combine_weights,                               \
                combine_weight_flags, combine_recv, static_cast<int64_t>(hidden) * 2, combine_flags, state       \
    }

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

// The end of a sending launch: once the block's sends are issued and it has reported done, the last
// block stores to every unmasked rank r its signal (epoch << 32) | value with release (NOTE
// [cumulative release]), then the launch's epoch for the next launch (NOTE [low-latency epochs]).
struct Signal {
    uint64_t* word;
    uint32_t value;
};

template <typename SignalOf>
__device__ __forceinline__ void publish_when_last(const LowLatencyBuffers& b, int kind, uint32_t epoch,
                                                  const int* rank_mask, uint64_t* trace, SignalOf signal_of) {
    trace_mark(trace, kTraceSent);
    const bool last = last_block_done(b, kind);
    trace_mark(trace, kTraceCounted);
    if (!last)
        return;
    for (int r = threadIdx.x; r < b.num_ranks; r += blockDim.x) {
        if (rank_mask != nullptr && rank_mask[r] != 0)
            continue;
        const Signal signal = signal_of(r);
        ptx::st_release_sys(signal.word, (static_cast<uint64_t>(epoch) << 32) | signal.value);
    }
    if (threadIdx.x == 0)
        ptx::st_relaxed_sys(b.epoch(kind), epoch);
    trace_mark(trace, kTracePublished);
}

// NOTE [rank masking]
// With a rank mask (Buffer(enable_shrink=True)), a rank whose signal misses the deadline is marked in the
// mask instead of failing the call: its pairs count as absent in this call, and later calls neither send
// to it nor wait for it (build_pair_bits drops its experts), so the surviving ranks keep serving. Without a
// mask the timeout is recorded and raised as CommTimeoutError.
//
// Every wait for a peer's signal goes through wait_or_mask: -> the signal's value, or -1 past the deadline.
__device__ __forceinline__ int wait_or_mask(const WaitContext& wait, const uint64_t* word, uint32_t epoch, int peer,
                                            int stage, int* rank_mask) {
    const int value = wait_for_seq(wait, word, epoch, peer, stage, rank_mask == nullptr);
    if (value < 0 && rank_mask != nullptr)
        atomicExch(rank_mask + peer, 1);
    return value;
}

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

// A piece of a row: 16 channels per lane (two 16-byte loads of bf16), 4 FP8 scale groups per warp.
constexpr int kPieceChannels = kWarpSize * 16;

// Which top-k choice of a message is local expert `l` (the header's int16 choices at +16), or -1.
template <int kNumTopk>
__device__ __forceinline__ int choice_of(const uint8_t* message, int l) {
    const int* choices = reinterpret_cast<const int*>(message + 16);
    int choice = -1;
#pragma unroll
    for (int w = 0; w < (kNumTopk + 1) / 2; ++w) {  // two int16 choices per word
        const int word = ptx::ld_na_s32(choices + w);
        if (static_cast<int16_t>(word & 0xffff) == l)
            choice = 2 * w;
        if (2 * w + 1 < kNumTopk && static_cast<int16_t>(word >> 16) == l)
            choice = 2 * w + 1;
    }
    return choice;
}

// This lane's 16 channels of piece `item` (token item / num_pieces), zeros past the row's end or past the
// last item. FP8 needs hidden % 128 == 0 (a scale group is all in or all out); bf16 rows may end after the
// lane's first 8 channels.
__device__ __forceinline__ void load_piece(int4 (&raw)[2], const int4* x, int item, int num_items, int num_pieces,
                                           int hidden, int lane) {
    const int t = item / num_pieces, c = (item % num_pieces) * kPieceChannels + lane * 16;
    const int4* row = x + static_cast<int64_t>(t) * hidden / 8;
    raw[0] = item < num_items && c < hidden ? ptx::ld_nc_v4(row + c / 8) : make_int4(0, 0, 0, 0);
    raw[1] = item < num_items && c + 8 < hidden ? ptx::ld_nc_v4(row + c / 8 + 1) : make_int4(0, 0, 0, 0);
}

// Scale words of a received row that a lane loads with the row's data (hidden up to 16384; wider rows
// load the rest after).
constexpr int kRowScales = 4;
// 16-byte vectors a lane loads per batch when it copies a received row: 14 take a 7168-channel FP8 row in
// one batch (16 would spill registers at 512 threads).
constexpr int kRowBatch = 14;

// NOTE [low-latency dispatch]
// A token crosses to a rank once, whatever number of its experts live there, and the receiver fans it out
// to its local experts (4 ranks, top-8 of 256: ~3.6 messages per token instead of 8 pair copies).
// Send (do_send): the work items are the pieces of kPieceChannels channels of every token, dealt so that
// consecutive items go to different SMs (item i to warp i / gridDim.x of block i % gridDim.x): one token
// keeps 14 warps busy at hidden 7168 instead of one warp walking its row, which cost ~10 us at one token.
// A warp loads its piece, quantizes it once (FP8 per 128 channels, exactly as quant.py: amax floored at
// 1e-4, scale = amax / 448 with an IEEE division, optionally rounded up to a power of two,
// q = e4m3(clamp(x / scale))), each lane 16 channels, and stores it with 16-byte stores into the message
// of every rank d the token goes to (NOTE [pair slots] with rows = ranks): d's region of this rank at
// slot = this rank's tokens before t that go to d. Piece 0 also writes the header (token index; then, per
// top-k choice, its local expert on d or -1). The last block to finish publishes to each rank d
// (epoch << 32) | tokens sent to d (NOTE [cumulative release]).
// Receive (do_recv): the blocks of local expert l (two per expert where the grid has twice as many blocks
// as experts) wait for every source's count; the warps scan the headers, a chunk of 32 messages of one
// source each, all chunks at once: a ballot counts the messages carrying l, a prefix over (source, chunk)
// gives each chunk its first row (NOTE [recv order]), and a second ballot places each message in l's
// rows (a list in shared memory) and records where it went (`positions`, which the combine reads). The
// sources' row ranges give layout_range, and the blocks then copy their share of the rows. With a recv
// hook the two halves run as two launches. Signals carry the epoch of NOTE [low-latency epochs].
template <int kNumTopk, typename TopkT, bool kUseFp8, bool kUseUe8m0>
__device__ __forceinline__ void low_latency_dispatch(
        const int4* x, const TopkT* topk_idx, int num_tokens, int hidden, int num_experts, int round_scale,
        uint8_t* packed_recv_x, uint32_t* packed_recv_scales, int* packed_recv_count, int* src_info,
        int64_t* layout_range, int* cumulative_stats, int* rank_mask, TOKENYARD_LOW_LATENCY_BUFFER_PARAMS,
        int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    trace_mark(trace, kTraceStart);
    const LowLatencyBuffers b = TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, kNumTopk, hidden);
    const int num_local_experts = b.num_local_experts;
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int num_scales = hidden / 128;
    const int data_bytes = kUseFp8 ? hidden : hidden * 2;
    const int num_slots = num_ranks * num_max;
    const uint32_t epoch = launch_epoch(b, 0, do_send);

    extern __shared__ uint32_t shared_words[];
    if (do_send) {
        uint32_t* bits = shared_words;
        const int words = (num_max + 31) / 32;
        const int num_pieces = (hidden + kPieceChannels - 1) / kPieceChannels;
        const int num_items = num_tokens * num_pieces, stride = gridDim.x * num_warps;
        // Loads run one item ahead of the stores, and the first before the pair bits are built.
        int item = warp * gridDim.x + blockIdx.x;
        int4 raw[2];
        load_piece(raw, x, item, num_items, num_pieces, hidden, lane);
        build_pair_bits<kNumTopk, TopkT, true>(bits, words, topk_idx, num_tokens, num_experts, num_local_experts,
                                               rank_mask);
        trace_mark(trace, kTracePrologue);
        for (; item < num_items; item += stride) {
            const int t = item / num_pieces, piece = item % num_pieces;
            const int c = piece * kPieceChannels + lane * 16;  // this lane's 16 channels
            float scale = 0.0f;
            int4 q = raw[0];
            if constexpr (kUseFp8)  // every lane: the cast's shuffles need the whole warp
                q = round_scale ? cast_fp8_16<true>(raw, scale) : cast_fp8_16<false>(raw, scale);
            const int4 piece_raw[2] = {raw[0], raw[1]};
            load_piece(raw, x, item + stride, num_items, num_pieces, hidden, lane);
            for (int d = 0; d < num_ranks; ++d) {
                if (!pair_chosen(bits, words, d, t))
                    continue;  // the same for the whole warp
                uint8_t* to = b.message(d, rank, pair_slot(bits, words, d, t));
                uint8_t* data = to + header_bytes;
                if constexpr (kUseFp8) {
                    if (c < hidden) {
                        ptx::st_na_v4(reinterpret_cast<int4*>(data + c), q);
                        if (lane % 8 == 0)
                            reinterpret_cast<float*>(data + hidden)[c / 128] = scale;
                    }
                } else {
                    if (c < hidden)
                        ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8, piece_raw[0]);
                    if (c + 8 < hidden)
                        ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8 + 1, piece_raw[1]);
                }
                if (piece != 0)
                    continue;
                if (lane == 0)
                    *reinterpret_cast<int*>(to) = t;
                if (lane < kNumTopk) {  // which of the token's choices live on d, as local experts
                    const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(t) * kNumTopk + lane]);
                    const bool here = e >= 0 && e < num_experts && e / num_local_experts == d;
                    reinterpret_cast<int16_t*>(to + 16)[lane] = here ? static_cast<int16_t>(e % num_local_experts) : -1;
                }
            }
        }
        publish_when_last(b, 0, epoch, rank_mask, trace, [&](int d) {  // the tokens sent to d
            return Signal{b.count(d, rank), static_cast<uint32_t>(row_count(bits, words, d))};
        });
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    // Receive: `parts` blocks per local expert where the grid has room (2 of 132 SMs for 64 local experts);
    // each scans all of the expert's messages and copies its share of the rows.
    __shared__ int num_messages[kWarpSize], counts[kWarpSize], begins[kWarpSize];
    const int num_chunks = (num_max + kWarpSize - 1) / kWarpSize;  // of 32 messages, per source
    int* rows = reinterpret_cast<int*>(shared_words);              // [R*M]: the message (s * M + j) of each row
    int* chunk_first = rows + num_slots;                           // [R][num_chunks]: the chunk's first row
    const int parts = max(1, static_cast<int>(gridDim.x) / num_local_experts);
    const int part = blockIdx.x / num_local_experts;  // 0 where the experts outnumber the blocks
    for (int l = blockIdx.x % num_local_experts; part < parts && l < num_local_experts; l += gridDim.x) {
        __syncthreads();  // the shared words are free (the pair bits, or the previous expert's rows)
        if (threadIdx.x < num_ranks) {
            const int s = threadIdx.x;
            int count = 0;
            if (rank_mask == nullptr || rank_mask[s] == 0) {
                count = max(0, wait_or_mask(wait, b.count(rank, s), epoch, s, kStageLowLatencyDispatchRecv,
                                            rank_mask));
            }
            num_messages[s] = count;
        }
        __syncthreads();
        trace_mark(trace, kTraceRecvReady);
        // The rows of l in order: pass 1 counts, per chunk of 32 messages of a source, those that carry l
        // (a chunk per warp, all at once); a prefix gives each chunk its first row; pass 2 places them. A
        // warp keeps the choice it read for its first chunk (its only one where the chunks are no more than
        // the warps: 4 ranks of 128 tokens make 16), so pass 2 reads those headers no second time.
        int first_choice = -1;
        for (int sc = warp; sc < num_ranks * num_chunks; sc += num_warps) {
            const int s = sc / num_chunks, j = sc % num_chunks * kWarpSize + lane;
            const int choice = j < num_messages[s] ? choice_of<kNumTopk>(b.message(rank, s, j), l) : -1;
            if (sc == warp)
                first_choice = choice;
            const uint32_t ballot = __ballot_sync(0xffffffffu, choice >= 0);
            if (lane == 0)
                chunk_first[sc] = __popc(ballot);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) {
                begins[s] = total;
                for (int c = 0; c < num_chunks; ++c) {
                    const int found = chunk_first[s * num_chunks + c];
                    chunk_first[s * num_chunks + c] = total;
                    total += found;
                }
                counts[s] = total - begins[s];
                if (part == 0)
                    layout_range[static_cast<int64_t>(l) * num_ranks + s] =
                            (static_cast<int64_t>(begins[s]) << 32) | static_cast<int64_t>(counts[s]);
            }
            trace_mark(trace, kTraceRecvMid);
            if (part == 0) {
                packed_recv_count[l] = total;
                if (cumulative_stats != nullptr)
                    cumulative_stats[l] += total;
            }
        }
        __syncthreads();
        for (int sc = warp; sc < num_ranks * num_chunks; sc += num_warps) {
            const int s = sc / num_chunks, j = sc % num_chunks * kWarpSize + lane;
            const int choice = sc == warp ? first_choice
                               : j < num_messages[s] ? choice_of<kNumTopk>(b.message(rank, s, j), l) : -1;
            const uint32_t ballot = __ballot_sync(0xffffffffu, choice >= 0);
            if (choice >= 0) {
                const int row = chunk_first[sc] + __popc(ballot & ((1u << lane) - 1u));
                rows[row] = s * num_max + j;
                if (part == 0)
                    b.positions(s, j)[choice] = l * num_slots + row;  // for the combine
            }
        }
        __syncthreads();
        const int total = begins[num_ranks - 1] + counts[num_ranks - 1];
        for (int row = part * num_warps + warp; row < total; row += parts * num_warps) {
            const int s = rows[row] / num_max;
            const uint8_t* msg = b.message(rank, s, rows[row] % num_max);
            const uint8_t* data = msg + header_bytes;
            const int64_t out = static_cast<int64_t>(l) * num_slots + row;
            // The row's scales and source index are loaded with its data, before the first store: issue is in
            // order, so a store waiting for its load holds back every load behind it (three round trips per
            // row instead of one cost microseconds).
            const int* scales = reinterpret_cast<const int*>(data + hidden);
            int scale_bits[kRowScales] = {};
            if constexpr (kUseFp8) {
#pragma unroll
                for (int u = 0; u < kRowScales; ++u) {  // UE8M0: the 4 groups of word `lane`; else groups lane + 32u
                    const int g = kUseUe8m0 ? 4 * lane + u : lane + u * kWarpSize;
                    if (g < num_scales)
                        scale_bits[u] = ptx::ld_na_s32(scales + g);
                }
            }
            const int source_token = lane == 0 ? ptx::ld_na_s32(reinterpret_cast<const int*>(msg)) : 0;
            warp_copy<kRowBatch, true>(reinterpret_cast<int4*>(packed_recv_x + out * data_bytes),
                                reinterpret_cast<const int4*>(data), data_bytes / 16, lane);
            if constexpr (kUseFp8 && kUseUe8m0) {
                // Four groups' biased exponents per int32, little-endian (quant.pack_ue8m0).
                const auto pack = [](const int (&groups)[4]) {
                    uint32_t word = 0;
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        word |= ((static_cast<uint32_t>(groups[i]) >> 23) & 0xffu) << (8 * i);
                    return word;
                };
                uint32_t* to = packed_recv_scales + static_cast<int64_t>(l) * (num_scales / 4) * num_slots + row;
                if (lane < num_scales / 4)
                    to[static_cast<int64_t>(lane) * num_slots] = pack(scale_bits);
                for (int g4 = lane + kWarpSize; g4 < num_scales / 4; g4 += kWarpSize) {  // wider rows
                    int groups[4];
                    for (int i = 0; i < 4; ++i)
                        groups[i] = ptx::ld_na_s32(scales + 4 * g4 + i);
                    to[static_cast<int64_t>(g4) * num_slots] = pack(groups);
                }
            } else if constexpr (kUseFp8) {  // column-major, as DeepEP
                uint32_t* to = packed_recv_scales + static_cast<int64_t>(l) * num_scales * num_slots + row;
#pragma unroll
                for (int u = 0; u < kRowScales; ++u)
                    if (lane + u * kWarpSize < num_scales)
                        to[static_cast<int64_t>(lane + u * kWarpSize) * num_slots] = scale_bits[u];
                for (int g = lane + kRowScales * kWarpSize; g < num_scales; g += kWarpSize)  // wider rows
                    to[static_cast<int64_t>(g) * num_slots] = ptx::ld_na_s32(scales + g);
            }
            if (lane == 0)
                src_info[out] = source_token;
        }
    }
    trace_mark(trace, kTraceEnd);
}

// Columns of one reduce item: kReduceVectors 16-byte vectors per lane, 512 bf16 channels per warp.
constexpr int kReduceVectors = 2;
constexpr int kReduceInt4 = kReduceVectors * kWarpSize;
constexpr int kReduceBatch = 4;  // rows whose loads are in flight together

// For this lane's columns first + u * 32 + lane (u < kReduceVectors, below num_int4): acc += weight * row,
// for the lanes set in `rows_from` in increasing order, each lane offering its `row` and `weight`. One
// float32 product, then one float32 sum, as routing.py; the loads of kReduceBatch rows are issued before
// the first sum, so a warp waits for memory once per batch rather than once per row.
template <bool kFromPeers>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kReduceVectors][8], uint32_t rows_from, const int4* row,
                                                float weight, int first, int num_int4, int lane) {
    while (rows_from != 0u) {
        int from[kReduceBatch];
        int n = 0;
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {
            from[u] = rows_from != 0u ? __ffs(rows_from) - 1 : 0;
            n += rows_from != 0u ? 1 : 0;
            rows_from &= rows_from - 1u;
        }
        int4 v[kReduceBatch][kReduceVectors];
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {
            const int4* src = reinterpret_cast<const int4*>(
                    __shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(row), from[u]));
#pragma unroll
            for (int c = 0; c < kReduceVectors; ++c) {
                const int i = first + c * kWarpSize + lane;
                v[u][c] = make_int4(0, 0, 0, 0);
                if (u < n && i < num_int4)
                    v[u][c] = kFromPeers ? ptx::ld_na_v4(src + i) : ptx::ld_nc_v4(src + i);
            }
        }
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {
            const float w = __shfl_sync(0xffffffffu, weight, from[u]);
            if (u >= n)
                break;
#pragma unroll
            for (int c = 0; c < kReduceVectors; ++c) {
                const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[u][c]);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[c][e] = __fadd_rn(acc[c][e], __fmul_rn(w, __bfloat162float(h[e])));
            }
        }
    }
}

__device__ __forceinline__ void store_bf16(int4* dst, const float (&acc)[kReduceVectors][8], int first, int num_int4,
                                           int lane) {
#pragma unroll
    for (int c = 0; c < kReduceVectors; ++c) {
        const int i = first + c * kWarpSize + lane;
        if (i >= num_int4)
            continue;
        int4 out;
        __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            o[e] = __float2bfloat16_rn(acc[c][e]);
        ptx::st_na_v4(dst + i, out);
    }
}

// NOTE [low-latency combine]
// The expert's rank pre-reduces: a token comes back from each rank as one bf16 row, the weighted sum of
// its experts there, instead of one row per expert (4 ranks, top-8: ~3.6 rows instead of 8, which halves
// the bytes on NVLink). The weights are the combine's, so they travel first.
// Send (do_send): (1) the block d < R writes this rank's topk_weights to rank d, each token's at the slot
// of its dispatch message to d, and releases d's weight flag. (2) The items are (source s, message j from
// s in this half's dispatch, piece of kReduceInt4 columns), and a warp waits for s's weights before its
// first item of s (so the sources' items start as their weights land, not when the last source's do); the
// message's header names the token's choices on this rank, positions(s, j) the packed row each went to
// (the dispatch wrote it) and weights(s, j) their weights; the warp sums weight * row over those choices in
// k order (float32, as routing.py) and writes bf16 into s's combine region at (this rank, j). (3) The last block to finish publishes
// (epoch << 32) | 1 to every source. Reduce (do_recv): the items are (token, piece); lane d finds whether
// the token went to rank d, waits for d's flag and points at d's row (the message slot of NOTE [pair
// slots] with rows = ranks); the warp sums the rows in rank order in float32 and writes bf16. The result
// is routing.low_latency_combine(..., pre_reduce=True) bit for bit: within bf16 rounding of one sum.
template <int kNumTopk, typename TopkT>
__device__ __forceinline__ void low_latency_combine(
        const int4* x, const TopkT* topk_idx, const float* topk_weights, int num_tokens, int hidden, int num_experts, int4* combined_x, int* rank_mask, TOKENYARD_LOW_LATENCY_BUFFER_PARAMS,
        int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    trace_mark(trace, kTraceStart);
    const LowLatencyBuffers b = TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, kNumTopk, hidden);
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int hidden_int4 = hidden * 2 / 16;
    const int num_slots = num_ranks * num_max;
    const int num_pieces = (hidden_int4 + kReduceInt4 - 1) / kReduceInt4;
    const uint32_t epoch = launch_epoch(b, 1, do_send);
    const auto masked = [&](int r) { return rank_mask != nullptr && rank_mask[r] != 0; };
    extern __shared__ uint32_t bits[];  // NOTE [pair slots], a row per rank
    const int words = (num_max + 31) / 32;

    if (do_send) {
        // (1) This rank's weights to every rank: block d serves rank d, a thread per token, each token's
        //     weights to the message slot it had in the dispatch (NOTE [pair slots] with rows = ranks).
        for (int d = blockIdx.x; d < num_ranks; d += gridDim.x) {
            if (masked(d))
                continue;  // the same for the whole block
            build_pair_bits<kNumTopk, TopkT, true>(bits, words, topk_idx, num_tokens, num_experts,
                                                   b.num_local_experts, rank_mask);
            for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
                if (!pair_chosen(bits, words, d, t))
                    continue;
                float w[kNumTopk];
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k)
                    w[k] = topk_weights[static_cast<int64_t>(t) * kNumTopk + k];
                float* to = b.weights(d, rank, pair_slot(bits, words, d, t));
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k)
                    to[k] = w[k];
            }
            __syncthreads();  // the block's stores before thread 0's release (NOTE [cumulative release])
            if (threadIdx.x == 0)
                ptx::st_release_sys(b.weight_flag(d, rank), (static_cast<uint64_t>(epoch) << 32) | 1u);
        }
        // (2) How many messages each source sent in the dispatch of this half (a source masked during that
        //     dispatch left an older epoch there: nothing from it), numbered as items source by source.
        __shared__ int first_item[kWarpSize + 1];
        if (threadIdx.x < num_ranks) {
            const int s = threadIdx.x;
            const uint64_t word = ptx::ld_relaxed_sys(b.count(rank, s));
            const bool sent = !masked(s) && static_cast<uint32_t>(word >> 32) == ptx::ld_relaxed_sys(b.epoch(0));
            first_item[s + 1] = sent ? static_cast<int>(word & 0xffffffffu) * num_pieces : 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            first_item[0] = 0;
            for (int s = 0; s < num_ranks; ++s)
                first_item[s + 1] += first_item[s];
        }
        __syncthreads();
        trace_mark(trace, kTracePrologue);
        // Each item waits for its source's weights only, so the sources' items start as their weights land.
        int s = 0, weights = -1;  // of source s: -1 not yet awaited, 1 here, 0 lost (recorded or masked)
        for (int item = warp * gridDim.x + blockIdx.x; item < first_item[num_ranks]; item += gridDim.x * num_warps) {
            while (first_item[s + 1] <= item) {  // items only grow, so s never moves back
                ++s;
                weights = -1;
            }
            if (weights < 0) {
                bool arrived = true;
                if (lane == 0)
                    arrived = wait_or_mask(wait, b.weight_flag(rank, s), epoch, s, kStageLowLatencyCombineWeights,
                                           rank_mask) >= 0;
                __syncwarp();  // orders lane 0's acquire before every lane's loads of the weights
                weights = __shfl_sync(0xffffffffu, arrived, 0) ? 1 : 0;
            }
            if (weights == 0)
                continue;  // the signals below still go out; the error (if any) is raised on the host
            const int j = (item - first_item[s]) / num_pieces, piece = (item - first_item[s]) % num_pieces;
            const uint8_t* header = b.message(rank, s, j);
            const int4* row = nullptr;
            float weight = 0.0f;
            if (lane < kNumTopk) {  // three independent loads, then the rows: two round trips per item
                const int l = reinterpret_cast<const int16_t*>(header + 16)[lane];
                const int packed_row = b.positions(s, j)[lane];
                const float w = ptx::ld_na_f32(b.weights(rank, s, j) + lane);
                if (l >= 0) {
                    row = x + static_cast<int64_t>(packed_row) * hidden_int4;
                    weight = w;
                }
            }
            float acc[kReduceVectors][8] = {};
            accumulate_rows<false>(acc, __ballot_sync(0xffffffffu, row != nullptr), row, weight, piece * kReduceInt4,
                                   hidden_int4, lane);
            store_bf16(b.combine_row(s, rank, j), acc, piece * kReduceInt4, hidden_int4, lane);
        }
        publish_when_last(b, 1, epoch, rank_mask, trace, [&](int r) { return Signal{b.combine_flag(r, rank), 1u}; });
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    build_pair_bits<kNumTopk, TopkT, true>(bits, words, topk_idx, num_tokens, num_experts, b.num_local_experts,
                                           rank_mask);
    trace_mark(trace, kTraceRecvReady);
    bool traced = false;
    for (int item = warp * gridDim.x + blockIdx.x; item < num_tokens * num_pieces; item += gridDim.x * num_warps) {
        const int t = item / num_pieces, piece = item % num_pieces;
        const int4* row = nullptr;
        bool ok = true;
        // A rank masked during this launch (by another warp's timeout) is absent, not waited for again.
        if (lane < num_ranks && pair_chosen(bits, words, lane, t) &&
            (rank_mask == nullptr || ptx::ld_relaxed_sys(rank_mask + lane) == 0)) {
            const int d = lane;
            if (wait_or_mask(wait, b.combine_flag(rank, d), epoch, d, kStageLowLatencyCombineRecv, rank_mask) >= 0)
                row = b.combine_row(rank, d, pair_slot(bits, words, d, t));
            else if (rank_mask == nullptr)
                ok = false;
        }
        __syncwarp();  // orders each lane's acquire before every lane's loads of that rank's row
        if (!__all_sync(0xffffffffu, ok))
            return;
        if (!traced) {
            trace_mark(trace, kTraceRecvMid);
            traced = true;
        }
        float acc[kReduceVectors][8] = {};
        accumulate_rows<true>(acc, __ballot_sync(0xffffffffu, row != nullptr), row, 1.0f, piece * kReduceInt4,
                              hidden_int4, lane);
        store_bf16(combined_x + static_cast<int64_t>(t) * hidden_int4, acc, piece * kReduceInt4, hidden_int4, lane);
    }
    trace_mark(trace, kTraceEnd);
}

}  // namespace tokenyard::kernels
