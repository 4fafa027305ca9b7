// Low-latency dispatch over NVLink (docs/semantics.md, "Low-latency dispatch"). No host synchronisation
// and no data-dependent allocation, so it can be captured in a CUDA graph.
#pragma once

#include "../quant.cuh"
#include "low_latency_common.cuh"

namespace tokenyard::kernels {

// NOTE [low-latency dispatch]
// A token crosses to a rank once, whatever number of its experts live there, and the receiver fans it out
// to its local experts (4 ranks, top-8 of 256: ~3.6 messages per token instead of 8 pair copies).
// Send (do_send): the work items are the pieces of kPieceChannels channels of every token, dealt over
// blocks 1, 2, ... so that consecutive items go to different SMs (item i to warp i / (G - 1) of block
// 1 + i % (G - 1) on a grid of G): one token keeps 14 warps busy at hidden 7168 instead of one warp walking
// its row. A warp loads its piece and its token's top-k choices, quantizes
// the piece once (FP8 per 128 channels, exactly as quant.py: amax floored at 1e-4, scale = amax / 448 with
// an IEEE division, optionally rounded up to a power of two, q = e4m3(clamp(x / scale)); NVFP4 per 16 channels,
// NOTE [nvfp4], a lane's channels being one block), each lane 16 channels, and stores it with 16-byte stores
// (NVFP4: an even lane's and its neighbour's codes; 8 lanes' scale bytes in one 8-byte store) into the message
// of every rank dest the token goes to: dest's region of this rank at slot t, the token index. Piece 0 also writes the header: its tag (tag << 32) | t,
// and for each choice on dest its local expert. Nothing of that waits for the pair bits, so the data leaves
// sooner than when the slot was the rank's tokens before t going to dest (a receiver learns from the tag which
// slots hold this call's messages). Block 0 sends no data: meanwhile it builds the pair bits
// (expert rows), sends each rank dest how many of this rank's tokens chose each of dest's experts, each count a
// word (tag << 32) | count that needs no fence (a release of their own waited behind the data), and writes,
// a thread per pair, the pair's slot among this rank's rows of its expert into the header. So the counts
// travel while the data is still going out, and the data blocks go from their last store straight to the
// done counter (benchmarks/results/low_latency.md, "decisions"). The last block to finish publishes to each rank dest
// (tag << 32) | this rank's number of tokens (NOTE [cumulative release]).
// Receive (do_recv): every block waits for every source's expert counts (under a rank mask block 0 waits
// and the others follow its verdicts: NOTE [one verdict]) and numbers the packed rows
// (NOTE [recv order]: the rows of local expert l from source s begin after those of the sources before
// s) while the data is still in flight; then it waits for the data signals, and block 0 writes
// packed_recv_count, layout_range and the stats. The items are then (source s, slot j < its tokens, piece
// of kRecvPieceVectors), dealt over every block as the sends are over theirs: a warp loads the header's
// tag, choices and slots and the piece's data and scales at once (one round trip); a tag of another call
// means token j of s did not come here. Otherwise it stores the piece into the row of every choice (row =
// first row of (l, s) + slot) with the piece's scales; piece 0 records src_info and, in `positions`, where
// each choice went (which the combine reads). No scan of the headers and no wait for another block: every
// message is read once, and all of them at once (a block per expert scanning the headers and copying its
// rows took several times longer after the signals).
// A source masked between its counts and its data is left out and the rows renumbered. With a recv hook
// the two halves run as two launches. Signals carry the epoch of NOTE [low-latency epochs]. To a rank of another
// node everything goes as NOTE [internode low-latency] says: a message's pieces and its header's slots are counted
// into the token's arrival word, and whoever completes it puts the message to each of those ranks.
template <int kNumTopk, typename TopkT, int kCast, bool kUseUe8m0, typename Remote = NoRemote, typename Params>
__device__ __forceinline__ void low_latency_dispatch(const Params& p) {
    static_assert(kNumTopk <= kHeaderMaxTopk, "the message header has room for 16 top-k choices");
    static_assert(kCast == kCastFp8 || !kUseUe8m0, "UE8M0 packs FP8 scales");
    constexpr bool kUseFp8 = kCast == kCastFp8, kUseNvfp4 = kCast == kCastNvfp4;
    trace_mark(p.trace, kTraceStart);
    const LowLatencyBuffers b = LowLatencyBuffers::of(p, kNumTopk);
    const int num_local_experts = b.num_local_experts;
    const WaitContext wait{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int num_scales = p.hidden / 128;
    // A message's data, then its scales: FP8 a float32 per 128 channels, NVFP4 an e4m3 byte per 16.
    const int data_bytes = kUseNvfp4 ? p.hidden / 2 : kUseFp8 ? p.hidden : p.hidden * 2;
    const int scale_bytes = kUseNvfp4 ? p.hidden / 16 : kUseFp8 ? num_scales * 4 : 0;
    const int num_slots = p.num_ranks * p.num_max;
    const uint32_t epoch = launch_epoch(b, 0, p.do_send), tag = b.tag(epoch);  // NOTE [call tags]
    const int send_pieces = (p.hidden + kPieceChannels - 1) / kPieceChannels;
    // NOTE [internode low-latency]: the bytes of a message that a put carries, and the warp that puts them for
    // token t to every rank of `far` (ranks of other nodes), once its pieces and its slots have all arrived.
    const size_t put_bytes = p.header_bytes + data_bytes + scale_bytes;
    const auto arrive_and_put = [&](int t, uint32_t far) {
        __syncwarp();
        bool last = false;
        if (lane == 0)
            last = arrive(b.arrival(p.num_ranks, t), tag, send_pieces + 1);
        if (!__shfl_sync(0xffffffffu, last, 0))
            return;
        for (; far != 0u; far &= far - 1u) {
            const int dest = __ffs(far) - 1;
            Remote::put_warp(b.message(dest, p.rank, t), b.staged_message(dest, t), put_bytes, dest);
        }
    };

    extern __shared__ uint32_t shared_words[];
    if (p.do_send) {
        // Block 0's books: the pair bits (expert rows), every unmasked rank's expert counts, each word tagged
        // with the epoch, and every pair's slot in its message's header.
        if (blockIdx.x == 0) {
            uint32_t* bits = shared_words;  // a row per expert (NOTE [pair slots])
            const int words = (p.num_max + 31) / 32;
            build_pair_bits<kNumTopk, TopkT, false>(bits, words, p.topk_idx, p.num_tokens, p.num_experts,
                                                    num_local_experts, p.rank_mask);
            for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
                const int dest = e / num_local_experts;
                if (p.rank_mask == nullptr || p.rank_mask[dest] == 0)
                    store_word<Remote>(b, b.expert_counts(dest, p.rank) + e % num_local_experts,
                                       (static_cast<uint64_t>(tag) << 32) | row_count(bits, words, e), dest, false);
            }
            for (int pair = threadIdx.x; pair < p.num_tokens * kNumTopk; pair += blockDim.x) {
                const int64_t e = static_cast<int64_t>(p.topk_idx[pair]);
                const int t = pair / kNumTopk;
                if (e < -1 || e >= p.num_experts)  // sent nowhere; this rank raises at its next call
                    record_error(wait, kErrorBadLowLatencyIds, p.rank, kStageLowLatencyDispatchSend,
                                 static_cast<uint32_t>(e), p.num_experts);
                if (!routed(e, p.num_experts, num_local_experts, p.rank_mask))
                    continue;
                const int dest = static_cast<int>(e / num_local_experts);
                uint8_t* header = Remote::kEnabled && b.is_remote(dest) ? b.staged_message(dest, t)
                                                                        : b.message(dest, p.rank, t);
                reinterpret_cast<int16_t*>(header + kHeaderSlots)[pair % kNumTopk] =
                        static_cast<int16_t>(pair_slot(bits, words, static_cast<int>(e), t));
            }
            if constexpr (Remote::kEnabled) {  // the slots are one arrival of each token bound for another node
                __syncthreads();
                for (int t = warp; t < p.num_tokens; t += num_warps) {
                    int64_t e = -1;
                    if (lane < kNumTopk) {
                        e = static_cast<int64_t>(p.topk_idx[static_cast<int64_t>(t) * kNumTopk + lane]);
                        e = routed(e, p.num_experts, num_local_experts, p.rank_mask) ? e : -1;
                    }
                    const uint32_t far = b.remote &
                            __reduce_or_sync(0xffffffffu, e >= 0 ? 1u << (e / num_local_experts) : 0u);
                    if (far != 0u)
                        arrive_and_put(t, far);
                }
            }
        }
        // The data: blocks 1, 2, ... (block 0 too on a one-block grid).
        const int data_blocks = max(1, static_cast<int>(gridDim.x) - 1);
        const int data_block = static_cast<int>(blockIdx.x) - (gridDim.x > 1 ? 1 : 0);
        const int num_items = p.num_tokens * send_pieces, stride = data_blocks * num_warps;
        // Lane k: the expert of top-k choice k of the item's token, or -1 (none, out of range, masked rank).
        const auto expert_of = [&](int item) -> int64_t {
            if (item >= num_items || lane >= kNumTopk)
                return -1;
            const int64_t e = static_cast<int64_t>(p.topk_idx[static_cast<int64_t>(item / send_pieces) * kNumTopk +
                                                            lane]);
            return routed(e, p.num_experts, num_local_experts, p.rank_mask) ? e : -1;
        };
        // Loads (the piece and its token's choices) run one item ahead of the stores.
        int item = data_block < 0 ? num_items : warp * data_blocks + data_block;
        const float global_scale = kUseNvfp4 && p.x_global_scale != nullptr ? *p.x_global_scale : 1.0f;
        int4 raw[2];
        load_piece(raw, p.x, item, num_items, send_pieces, p.hidden, lane);
        int64_t next_e = expert_of(item);
        trace_mark(p.trace, kTracePrologue);
        for (; item < num_items; item += stride) {
            const int t = item / send_pieces, piece = item % send_pieces;
            const int c = piece * kPieceChannels + lane * 16;  // this lane's 16 channels
            float scale = 0.0f;
            int4 q = raw[0];
            if constexpr (kUseFp8)  // every lane: the cast's shuffles need the whole warp
                q = p.round_scale ? cast_fp8_16<true>(raw, scale) : cast_fp8_16<false>(raw, scale);
            uint2 scales8 = {};  // NVFP4: lane 8g holds the scale bytes of lanes 8g .. 8g+7 (128 channels)
            if constexpr (kUseNvfp4) {  // an even lane stores its own 8 bytes of codes and its odd neighbour's
                uint32_t sf = 0u;
                const uint2 codes = cast_nvfp4_16(raw, global_scale, sf);
                q = make_int4(static_cast<int>(codes.x), static_cast<int>(codes.y),
                              static_cast<int>(__shfl_down_sync(0xffffffffu, codes.x, 1)),
                              static_cast<int>(__shfl_down_sync(0xffffffffu, codes.y, 1)));
                uint32_t word = sf;
#pragma unroll
                for (int i = 1; i < 4; ++i)
                    word |= __shfl_down_sync(0xffffffffu, sf, i) << (8 * i);
                scales8 = make_uint2(word, __shfl_down_sync(0xffffffffu, word, 4));
            }
            const int4 piece_raw[2] = {raw[0], raw[1]};
            const int64_t e = next_e;
            const uint32_t ranks = __reduce_or_sync(0xffffffffu, e >= 0 ? 1u << (e / num_local_experts) : 0u);
            load_piece(raw, p.x, item + stride, num_items, send_pieces, p.hidden, lane);
            next_e = expert_of(item + stride);
            for (int turn = 0; turn < p.num_ranks; ++turn) {
                const int dest = next_peer(p.rank, p.num_ranks, turn);
                if (((ranks >> dest) & 1u) == 0u)
                    continue;  // the same for the whole warp
                uint8_t* to = Remote::kEnabled && b.is_remote(dest) ? b.staged_message(dest, t)
                                                                    : b.message(dest, p.rank, t);
                uint8_t* data = to + p.header_bytes;
                if constexpr (kUseFp8) {
                    if (c < p.hidden) {
                        ptx::st_na_v4(reinterpret_cast<int4*>(data + c), q);
                        if (lane % 8 == 0)
                            reinterpret_cast<float*>(data + p.hidden)[c / 128] = scale;
                    }
                } else if constexpr (kUseNvfp4) {
                    if (c < p.hidden) {
                        if (lane % 2 == 0)
                            ptx::st_na_v4(reinterpret_cast<int4*>(data + c / 2), q);
                        if (lane % 8 == 0)
                            *reinterpret_cast<uint2*>(data + data_bytes + c / 16) = scales8;
                    }
                } else {
                    if (c < p.hidden)
                        ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8, piece_raw[0]);
                    if (c + 8 < p.hidden)
                        ptx::st_na_v4(reinterpret_cast<int4*>(data) + c / 8 + 1, piece_raw[1]);
                }
                if (piece != 0)
                    continue;
                if (lane == 0)  // the message is this call's
                    *reinterpret_cast<uint64_t*>(to) = (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(t);
                if (lane < kNumTopk) {  // which of the token's choices live on dest, as local experts
                    reinterpret_cast<int16_t*>(to + kHeaderChoices)[lane] =
                            e >= 0 && e / num_local_experts == dest ? static_cast<int16_t>(e % num_local_experts) : -1;
                }
            }
            if constexpr (Remote::kEnabled) {
                if ((ranks & b.remote) != 0u)
                    arrive_and_put(t, ranks & b.remote);
            }
        }
        // The message slots: this rank's tokens.
        publish_when_last<Remote>(b, 0, epoch, p.rank_mask, p.trace, [&](int dest) {
            return Signal{b.count(dest, p.rank), static_cast<uint32_t>(p.num_tokens)};
        }, [] { return 0u; });  // a bad id's token goes nowhere; the other tokens still arrive
    }
    if (!p.do_recv) {
        trace_mark(p.trace, kTraceEnd);
        return;
    }

    // Receive: the rows of every (local expert, source) are numbered from the expert counts, which travel
    // without a fence and come while the data is still in flight; then the data signals.
    const int64_t recv_start = clock64();  // NOTE [wait costs]
    __shared__ int num_messages[kWarpSize], first_item[kWarpSize + 1];
    __shared__ bool present[kWarpSize];  // every count of the source (then also its data) is here
    int* counts = reinterpret_cast<int*>(shared_words);  // [L][R]
    int* begins = counts + p.num_experts;                   // [L][R]: the first row of (l, s)
    // From the present sources; `record` (block 0, once the data is here): the outputs that say so too.
    const auto number_rows = [&](bool record) {
        for (int l = threadIdx.x; l < num_local_experts; l += blockDim.x) {
            int total = 0;
            for (int s = 0; s < p.num_ranks; ++s) {
                const int count = present[s] ? counts[l * p.num_ranks + s] : 0;
                begins[l * p.num_ranks + s] = total;
                if (record)
                    p.layout_range[static_cast<int64_t>(l) * p.num_ranks + s] =
                            (static_cast<int64_t>(total) << 32) | static_cast<int64_t>(count);
                total += count;
            }
            if (record) {
                p.packed_recv_count[l] = total;
                if (p.cumulative_stats != nullptr)
                    p.cumulative_stats[l] += total;
            }
        }
    };
    // NOTE [one verdict]: without a mask every block decides for itself; with one, block 0 for all of them.
    const bool decides = p.rank_mask == nullptr || blockIdx.x == 0;
    int* const decider_mask = decides ? p.rank_mask : nullptr;  // a follower never masks
    const bool judges = p.rank_mask != nullptr && blockIdx.x == 0;
    __syncthreads();  // the shared words are free (the pair bits)
    if (threadIdx.x < p.num_ranks) {
        const int s = threadIdx.x;
        present[s] = decides ? p.rank_mask == nullptr || p.rank_mask[s] == 0
                             : follow_verdict(b, wait, kVerdictCounts, s, tag, kStageLowLatencyDispatchCounts);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {  // a thread per (source, local expert)
        const int s = i / num_local_experts, l = i % num_local_experts;
        int count = -1;
        if (present[s]) {
            count = wait_or_mask(wait, b.expert_counts(p.rank, s) + l, tag, s, kStageLowLatencyDispatchCounts,
                                 decider_mask);
        }
        if (count < 0)
            present[s] = false;  // every writer writes false
        counts[l * p.num_ranks + s] = max(0, count);
    }
    __syncthreads();
    if (judges && threadIdx.x < p.num_ranks)
        publish_verdict(b, kVerdictCounts, threadIdx.x, tag, present[threadIdx.x]);
    number_rows(false);
    trace_mark(p.trace, kTraceRecvReady);
    bool lost = false;  // a source whose counts came but whose data did not (masked meanwhile)
    if (threadIdx.x < p.num_ranks) {
        const int s = threadIdx.x;
        int count = -1;
        const bool sent = present[s] && (decides ? p.rank_mask == nullptr || ptx::ld_relaxed_sys(p.rank_mask + s) == 0
                                                 : follow_verdict(b, wait, kVerdictData, s, tag,
                                                                  kStageLowLatencyDispatchRecv));
        if (sent) {
            count = wait_or_mask(wait, b.count(p.rank, s), tag, s, kStageLowLatencyDispatchRecv, decider_mask);
            add_wait_cost(p.wait_costs, s, recv_start);
        }
        if (judges)
            publish_verdict(b, kVerdictData, s, tag, count >= 0);
        lost = present[s] && count < 0;
        present[s] = count >= 0;
        num_messages[s] = max(0, count);
    }
    if (__syncthreads_or(lost) || blockIdx.x == 0) {
        number_rows(blockIdx.x == 0);  // block 0 writes the outputs; every block renumbers without a lost source
        __syncthreads();
    }
    const int num_vectors = data_bytes / 16;
    const int num_pieces = (num_vectors + kRecvPieceVectors - 1) / kRecvPieceVectors;
    if (threadIdx.x == 0) {
        first_item[0] = 0;
        for (int s = 0; s < p.num_ranks; ++s)
            first_item[s + 1] = first_item[s] + num_messages[s] * num_pieces;
    }
    __syncthreads();
    trace_mark(p.trace, kTraceRecvMid);

    int s = 0;
    for (int item = warp * gridDim.x + blockIdx.x; item < first_item[p.num_ranks]; item += gridDim.x * num_warps) {
        while (first_item[s + 1] <= item)  // items only grow, so s never moves back
            ++s;
        const int j = (item - first_item[s]) / num_pieces, piece = (item - first_item[s]) % num_pieces;
        const uint8_t* msg = b.message(p.rank, s, j);
        const int4* data = reinterpret_cast<const int4*>(msg + p.header_bytes);
        // Every load of the item before its first store (issue is in order: a store waiting for its load
        // holds back every load behind it): the message's tag, lane k's choice and slot, the piece's vectors,
        // its scales. A tag of another call: token j of s did not come to this rank.
        const uint64_t header = lane == 0 ? ptx::ld_relaxed_sys(reinterpret_cast<const uint64_t*>(msg)) : 0;
        int l = -1, slot = 0;
        if (lane < kNumTopk) {
            l = header_int16(msg, kHeaderChoices, lane);
            slot = header_int16(msg, kHeaderSlots, lane);
        }
        int4 v[kRecvVectors];
        load_batch<kRecvVectors, true>(v, data, piece * kRecvPieceVectors, num_vectors, lane);
        const int* scales = reinterpret_cast<const int*>(msg + p.header_bytes + data_bytes);
        // FP8: lane g < 16 has scale group g of the piece; UE8M0: lane w < 4 has word w (groups 4w..4w+3);
        // NVFP4: lane w has the piece's scale words w and w + 32 (a word: 4 blocks, 64 channels).
        constexpr int kPieceGroups = kRecvPieceVectors / 8;  // 128 channels = 8 vectors of FP8
        constexpr int kPieceWords = kRecvPieceVectors / 2;   // 64 channels = 2 vectors of NVFP4
        int scale_bits[4] = {};
        int group = 0;
        if constexpr (kUseNvfp4) {
            group = piece * kPieceWords + lane;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (group + 32 * i < p.hidden / 64)
                    scale_bits[i] = ptx::ld_na_s32(scales + group + 32 * i);
            }
        } else if constexpr (kUseFp8) {
            if constexpr (kUseUe8m0) {
                group = piece * kPieceGroups + 4 * lane;
                if (lane < kPieceGroups / 4 && group < num_scales) {
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        scale_bits[i] = ptx::ld_na_s32(scales + group + i);
                }
            } else {
                group = piece * kPieceGroups + lane;
                if (lane < kPieceGroups && group < num_scales)
                    scale_bits[0] = ptx::ld_na_s32(scales + group);
            }
        }
        if (static_cast<uint32_t>(__shfl_sync(0xffffffffu, header, 0) >> 32) != tag)
            continue;
        const int row = l >= 0 ? begins[l * p.num_ranks + s] + slot : -1;
        if (piece == 0 && row >= 0) {  // lane k: where choice k went
            b.positions(s, j)[lane] = l * num_slots + row;
            p.src_info[static_cast<int64_t>(l) * num_slots + row] = j;  // the message slot is the token index
        }
        for (uint32_t targets = __ballot_sync(0xffffffffu, row >= 0); targets != 0u; targets &= targets - 1u) {
            const int k = __ffs(targets) - 1;
            const int to_l = __shfl_sync(0xffffffffu, l, k), to_row = __shfl_sync(0xffffffffu, row, k);
            const int64_t out = static_cast<int64_t>(to_l) * num_slots + to_row;
            store_batch<kRecvVectors>(reinterpret_cast<int4*>(p.packed_recv_x + out * data_bytes), v,
                                      piece * kRecvPieceVectors, num_vectors, lane);
            if constexpr (kUseFp8 && kUseUe8m0) {  // four groups' biased exponents per int32 (quant.pack_ue8m0)
                if (lane < kPieceGroups / 4 && group < num_scales) {
                    uint32_t word = 0;
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        word |= ((static_cast<uint32_t>(scale_bits[i]) >> 23) & 0xffu) << (8 * i);
                    p.packed_recv_scales[(static_cast<int64_t>(to_l) * (num_scales / 4) + group / 4) * num_slots +
                                       to_row] = word;
                }
            } else if constexpr (kUseFp8) {  // column-major, as DeepEP
                if (lane < kPieceGroups && group < num_scales)
                    p.packed_recv_scales[(static_cast<int64_t>(to_l) * num_scales + group) * num_slots + to_row] =
                            scale_bits[0];
            } else if constexpr (kUseNvfp4) {  // the 128 x 4 tiles of NOTE [nvfp4]: [l, row / 128, word, a, b]
                const int words = p.hidden / 64, tile_rows = (num_slots + 127) / 128;
                const int64_t tile = static_cast<int64_t>(to_l) * tile_rows + to_row / 128;
                const int within = (to_row % 32) * 4 + (to_row % 128) / 32;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (group + 32 * i < words)
                        p.packed_recv_scales[(tile * words + group + 32 * i) * 128 + within] = scale_bits[i];
                }
            }
        }
    }
    trace_mark(p.trace, kTraceEnd);
}

}  // namespace tokenyard::kernels
