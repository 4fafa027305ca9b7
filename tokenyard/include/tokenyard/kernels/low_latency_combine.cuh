// Low-latency combine over NVLink (docs/semantics.md, "Low-latency combine"). No host synchronisation and
// no data-dependent allocation, so it can be captured in a CUDA graph.
#pragma once

#include "../bf16.cuh"
#include "low_latency_common.cuh"

namespace tokenyard::kernels {

// Columns of one reduce item: kReduceVectors 16-byte vectors per lane, 512 bf16 channels per warp.
constexpr int kReduceVectors = 2;
constexpr int kReduceInt4 = kReduceVectors * kWarpSize;
constexpr int kReduceBatch = 4;  // rows whose loads are in flight together
// NOTE [deferred rows]: how long after a hook's send began it waits for weights on their way.
constexpr uint64_t kWeightPatienceNs = 4000;

// Up to kReduceBatch rows of one reduce item, their loads issued together: lane from[u] offered row u.
struct RowBatch {
    int4 v[kReduceBatch][kReduceVectors];
    int from[kReduceBatch];
    int n;
};

// Takes the first kReduceBatch lanes of `rows_from` (clearing them) and loads, of each such lane's `row`,
// this lane's columns first + c * 32 + lane (c < kReduceVectors, below num_int4; zeros elsewhere).
template <bool kFromPeers>
__device__ __forceinline__ void load_rows(RowBatch& batch, uint32_t& rows_from, const int4* row, int first,
                                          int num_int4, int lane) {
    batch.n = 0;
#pragma unroll
    for (int u = 0; u < kReduceBatch; ++u) {
        batch.from[u] = rows_from != 0u ? __ffs(rows_from) - 1 : 0;
        batch.n += rows_from != 0u ? 1 : 0;
        rows_from &= rows_from - 1u;
    }
#pragma unroll
    for (int u = 0; u < kReduceBatch; ++u) {
        const int4* src = reinterpret_cast<const int4*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(row), batch.from[u]));
#pragma unroll
        for (int c = 0; c < kReduceVectors; ++c) {
            const int i = first + c * kWarpSize + lane;
            batch.v[u][c] = make_int4(0, 0, 0, 0);
            if (u < batch.n && i < num_int4)
                batch.v[u][c] = kFromPeers ? ptx::ld_na_v4(src + i) : ptx::ld_nc_v4(src + i);
        }
    }
}

// acc += weight * row over the batch's rows in increasing lane order, each lane offering its `weight`: one
// float32 product, then one float32 sum, as routing.py.
__device__ __forceinline__ void add_rows(float (&acc)[kReduceVectors][8], const RowBatch& batch, float weight) {
#pragma unroll
    for (int u = 0; u < kReduceBatch; ++u) {
        const float w = __shfl_sync(0xffffffffu, weight, batch.from[u]);
        if (u >= batch.n)
            break;
#pragma unroll
        for (int c = 0; c < kReduceVectors; ++c)
            add_weighted_bf16x8(acc[c], batch.v[u][c], w);
    }
}

// acc += weight * row for the lanes set in `rows_from`, each lane offering its `row` and `weight`: a batch
// of rows at a time, so a warp waits for memory once per kReduceBatch rows rather than once per row.
// `batch` may hold the first batch already (`loaded`: its rows are no longer in rows_from).
template <bool kFromPeers>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kReduceVectors][8], RowBatch& batch, bool loaded,
                                                uint32_t rows_from, const int4* row, float weight, int first,
                                                int num_int4, int lane) {
    if (loaded)
        add_rows(acc, batch, weight);
    while (rows_from != 0u) {
        load_rows<kFromPeers>(batch, rows_from, row, first, num_int4, lane);
        add_rows(acc, batch, weight);
    }
}

__device__ __forceinline__ void store_bf16(int4* dst, const float (&acc)[kReduceVectors][8], int first, int num_int4,
                                           int lane) {
#pragma unroll
    for (int c = 0; c < kReduceVectors; ++c) {
        const int i = first + c * kWarpSize + lane;
        if (i >= num_int4)
            continue;
        ptx::st_na_v4(dst + i, to_bf16x8(acc[c]));
    }
}

// NOTE [low-latency combine]
// The expert's rank pre-reduces: a token comes back from each rank as one bf16 row, the weighted sum of
// its experts there, instead of one row per expert (4 ranks, top-8: ~3.6 rows instead of 8, which halves
// the bytes on NVLink). The weights are the combine's, so they travel first.
// Send (do_send): the blocks form one group per rank s, the rank whose messages they send back (NOTE
// [peer-major blocks]). (1) The group writes this rank's topk_weights to s, each token's at the slot of
// its dispatch message to s, each weight a word (tag << 32) | float bits: a word that carries its own
// epoch needs no fence and no flag (with a release and a flag per rank, the items began later and the sends
// ended later).
// (2) The items are (message slot j from s in this half's dispatch, piece of kReduceInt4 columns); a slot
// whose header's tag is of another dispatch (the token did not come here) contributes nothing. The
// message's header names the token's choices on this rank, positions(s, j) the packed row each went to
// (the dispatch wrote it) and weights(s, j) their weights, all read an item ahead; an item a weight of
// which has not come (its tag is an older call's) is left for later (NOTE [deferred rows]); the warp asks for the
// item's rows, sums weight * row over those choices in k order (float32, as routing.py) and writes bf16 into s's
// combine region at (this rank, j). (3) The last block of s's group to finish publishes (tag << 32) | 1 to s
// (unless a hook's send left items of s: NOTE [group release]). Reduce (do_recv): one thread per block
// waits for each rank's flag (NOTE [block waits]); the items are (token t, piece); lane dest finds whether
// the token went to rank dest (NOTE [pair slots], rank rows) and points at dest's row t; the warp sums the
// rows in rank order in float32 and writes bf16. The result is routing.low_latency_combine(...,
// pre_reduce=True) bit for bit: within bf16 rounding of one sum. To a rank of another node (NOTE [internode
// low-latency]) the weights go by one put that sets a flag, and a partial sum's pieces are counted into its arrival
// word, the warp that completes it putting the row.
//
// NOTE [deferred rows]
// A peer's weights come only when that peer's own combine sends them, and with a recv hook (SGLang's two-batch overlap,
// vLLM's DBO) the peers' sends may start a matmul apart: a send that waited for a late peer's weights held its SMs
// until that peer came (issue 51). So a hook's send (a launch that sends only) waits for no late peer: up to
// kWeightPatienceNs after it began it waits for weights, as a launch that also receives does (a peer that began about
// when this rank did is sending them: its weights go out in its first microseconds), and from then on an item of peer s
// whose weights have not all come is left, its word among this rank's deferred words taking the tag, and the warp takes
// its next item. When its items are done the warp takes its left ones again, in order, until one whose weights have
// still not come (s is late): that one and the rest stay left, and s's word takes the tag. The last block of s's group
// then withholds s's flag (NOTE [group release]). The receiving launch first reduces every item left, one
// index over all such peers' items so that they go out together, waiting for their weights (the late peer's send, which
// waits for nothing, is sending them); its last block flags those peers, and then it receives. A late peer lengthens
// this rank's receive by the items it left, never a send, and the rows are the same bytes, written by another launch. A
// launch that sends and receives leaves nothing (it cannot end before every peer's weights came anyway, and waiting in
// place with the rows asked for first is the faster order: benchmarks/results/low_latency.md); nor are items of this
// rank itself (its weights come from this launch's other blocks). A rank of another node's weights came when its
// weights flag did (NOTE [internode low-latency]), so its items are left as that flag says; a row's pieces reduced in
// either launch are counted into the row's arrival word alike, and the warp that completes the row puts it, in
// whichever launch that is; the receiving launch's blocks quiet before its last block flags s.
//
// NOTE [group release]
// Each group releases its own rank's flag: the last of its blocks (a counter per destination, group_counter) stores
// it, as the last block of a launch does with NOTE [cumulative release]. With one release per launch, every peer's
// flag waited for the slowest group, which is the one waiting for a late peer's weights: an on-time rank then missed
// the rows of every other rank too, until their own deadlines ran out, and its timeout named any of them (1 x 4:
// faults_gpus.json). Now a late peer holds back only the rows that need its weights, and the timeout names it. A
// group withholds its flag where this launch recorded a failure (without a mask, or with an overlap's signals: the
// rows may be unwritten) or where a hook's send left items of its rank (NOTE [deferred rows]). The launch's last block
// then stores the epoch alone.
// kHookSend: the launch sends only, the send of a recv hook (NOTE [deferred rows]).
template <bool kHookSend, int kNumTopk, typename TopkT, typename Remote, typename Params>
__device__ __forceinline__ void combine_launch(const Params& p) {
    trace_mark(p.trace, kTraceStart);
    const LowLatencyBuffers b = LowLatencyBuffers::of(p, kNumTopk);
    const WaitContext wait{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int hidden_int4 = p.hidden * 2 / 16;
    const int num_pieces = (hidden_int4 + kReduceInt4 - 1) / kReduceInt4;
    const uint32_t epoch = launch_epoch(b, 1, p.do_send), tag = b.tag(epoch);  // NOTE [call tags]
    const uint64_t patience_end = kHookSend ? ptx::global_timer_ns() + kWeightPatienceNs : 0;  // NOTE [deferred rows]
    const auto masked = [&](int r) { return p.rank_mask != nullptr && p.rank_mask[r] != 0; };
    extern __shared__ uint32_t bits[];  // NOTE [pair slots], a row per rank
    const int words = (p.num_max + 31) / 32;

    // NOTE [combine overlap]: with comp_signal, row `row` of local expert l is read only once
    // comp_signal[l * signal_blocks + row / block_m] reaches signal_threshold (the expert GEMM, on another stream,
    // signals each block of block_m rows it finished); a lane waits for its row's block with acquire at GPU scope,
    // until the deadline, which records a timeout. The sending launch then has few blocks (num_sms, so that the
    // GEMM has the rest of the GPU): fewer blocks than ranks take the ranks in rounds, a block a rank at a time.
    const auto row_ready = [&](int position) -> bool {
        const int num_slots = p.num_ranks * p.num_max;
        const int* signal = p.comp_signal + static_cast<int64_t>(position / num_slots) * p.signal_blocks +
                            (position % num_slots) / p.block_m;
        uint64_t start = 0;
        for (int spin = 0;; ++spin) {
            if (ptx::ld_acquire_gpu(signal) >= p.signal_threshold)
                return true;
            if ((spin & 255) == 0) {
                const uint64_t now = ptx::global_timer_ns();
                if (start == 0) {
                    start = now;
                } else if (now - start > wait.timeout_ns || failed(wait)) {
                    record_error(wait, kErrorTimeout, p.rank, kStageLowLatencyCombineOverlap,
                                 static_cast<uint32_t>(ptx::ld_acquire_gpu(signal)),
                                 static_cast<uint32_t>(p.signal_threshold));
                    return false;
                }
            }
        }
    };
    // Lane k's part of item `item` of rank s: where choice k of message j went on this rank and its weight word,
    // all loaded at once, an item ahead of the sums (a warp waits for memory once per item, for the rows). Items
    // past the last are read too (every slot's words exist) and never used.
    struct Choice {
        uint64_t weight;   // (tag << 32) | float bits once it came
        uint32_t tag;      // the message's: token j of s came here in this half's dispatch if it is its tag
        int local_expert;  // -1: the choice is not on this rank
        int position;      // the packed row it went to
    };
    const auto choice_of = [&](int s, int item) -> Choice {
        Choice choice{0, 0, -1, 0};
        if (item < p.num_max * num_pieces && lane < kNumTopk) {
            const int j = item / num_pieces;
            const uint8_t* message = b.message(p.rank, s, j);
            choice.weight = ptx::ld_relaxed_sys(b.weights(p.rank, s, j) + lane);
            choice.tag = static_cast<uint32_t>(*reinterpret_cast<const uint64_t*>(message) >> 32);
            choice.local_expert = reinterpret_cast<const int16_t*>(message + kHeaderChoices)[lane];
            choice.position = b.positions(s, j)[lane];
        }
        return choice;
    };
    // The items of s in the dispatch of this half: (message slot j, piece), as many slots as s had tokens (a
    // source masked during that dispatch left an older epoch there: nothing from it). One thread reads.
    const auto items_of = [&](int s, uint64_t count_word, uint32_t dispatch_tag) {
        const bool sent = !masked(s) && static_cast<uint32_t>(count_word >> 32) == dispatch_tag;
        return sent ? static_cast<int>(count_word & 0xffffffffu) * num_pieces : 0;
    };
    // The warp's item `item` of rank s: the weighted sum of its rows here, written into s's combine region at
    // (this rank, j). With `may_leave` an item a weight of which has not come is left (NOTE [deferred rows]).
    enum : int { kItemDone = 0, kItemLeft = 1, kItemStop = 2 };  // kItemStop: s masked meanwhile, or recorded
    const auto reduce_item = [&](int s, int item, const Choice& choice, uint32_t dispatch_tag, bool may_leave) {
        const int j = item / num_pieces, piece = item % num_pieces;
        if (p.rank_mask != nullptr && ptx::ld_relaxed_sys(p.rank_mask + s) != 0)
            return kItemStop;  // masked meanwhile: its rows are absent
        const int4* row = choice.tag == dispatch_tag && choice.local_expert >= 0
                                  ? p.x + static_cast<int64_t>(choice.position) * p.x_row_int4
                                  : nullptr;
        uint32_t rows_from = __ballot_sync(0xffffffffu, row != nullptr);
        if (rows_from == 0u)
            return kItemDone;  // token j of s did not come here: nothing to send back
        // A rank of another node puts its weights at once: they came when its flag did (NOTE [internode
        // low-latency]), and are read again after it.
        const bool put_weights = Remote::kEnabled && b.is_remote(s);
        const uint64_t came =
                put_weights && row != nullptr ? ptx::ld_acquire_sys(b.weights_flag(p.rank, s)) : choice.weight;
        bool weighed = row == nullptr || static_cast<uint32_t>(came >> 32) == tag;
        // Past the patience a missing weight leaves the item at once; before it, the rows are asked for first.
        const auto leave = [&] {
            if (lane == 0)
                ptx::st_relaxed_sys(b.deferred_item(s, item, num_pieces), tag);
            return kItemLeft;
        };
        if (may_leave && !__all_sync(0xffffffffu, weighed) && ptx::global_timer_ns() >= patience_end)
            return leave();
        // NOTE [combine overlap]: the rows' blocks are signalled done first, and the rows, which another
        // kernel writes during this one, are not read through the non-coherent cache.
        const bool overlapped = p.comp_signal != nullptr;
        if (overlapped) {
            if (!__all_sync(0xffffffffu, row == nullptr || row_ready(choice.position)))
                return kItemStop;  // recorded: the call fails (withheld signals)
            __syncwarp();  // every lane reads the rows whose signals other lanes acquired
        }
        // The first rows are asked for, then a weight not come yet (its tag is an older call's) is waited
        // for: at the first items the weights are still on their way, and the rows come meanwhile.
        RowBatch batch;
        if (overlapped)
            load_rows<true>(batch, rows_from, row, piece * kReduceInt4, hidden_int4, lane);
        else
            load_rows<false>(batch, rows_from, row, piece * kReduceInt4, hidden_int4, lane);
        uint32_t weight_bits = static_cast<uint32_t>(choice.weight & 0xffffffffu);
        if (may_leave) {
            while (!weighed && ptx::global_timer_ns() < patience_end) {
                if (put_weights) {  // the flag says they came; the words are read after it (below)
                    weighed = static_cast<uint32_t>(ptx::ld_acquire_sys(b.weights_flag(p.rank, s)) >> 32) == tag;
                } else {
                    const uint64_t word = ptx::ld_relaxed_sys(b.weights(p.rank, s, j) + lane);
                    weighed = static_cast<uint32_t>(word >> 32) == tag;
                    weight_bits = static_cast<uint32_t>(word & 0xffffffffu);
                }
            }
            if (!__all_sync(0xffffffffu, weighed))
                return leave();
        }
        bool lost = false;
        if (!weighed && put_weights) {
            lost = !wait_tag_or_mask<true>(wait, b.weights_flag(p.rank, s), tag, s, kStageLowLatencyCombineWeights,
                                           p.rank_mask, weight_bits);
        } else if (!weighed) {
            lost = !wait_tag_or_mask<false>(wait, b.weights(p.rank, s, j) + lane, tag, s,
                                            kStageLowLatencyCombineWeights, p.rank_mask, weight_bits);
        }
        if (put_weights && row != nullptr && !lost)  // after the flag's acquire
            weight_bits = static_cast<uint32_t>(ptx::ld_relaxed_sys(b.weights(p.rank, s, j) + lane) & 0xffffffffu);
        if (__any_sync(0xffffffffu, lost))
            return kItemStop;  // masked: s gets no signal; else the timeout recorded withholds every signal
        const float weight = row != nullptr ? __uint_as_float(weight_bits) : 0.0f;
        float acc[kReduceVectors][8] = {};
        if (overlapped)
            accumulate_rows<true>(acc, batch, true, rows_from, row, weight, piece * kReduceInt4, hidden_int4, lane);
        else
            accumulate_rows<false>(acc, batch, true, rows_from, row, weight, piece * kReduceInt4, hidden_int4, lane);
        if constexpr (Remote::kEnabled) {
            if (b.is_remote(s)) {
                store_bf16(b.staged_row(s, j), acc, piece * kReduceInt4, hidden_int4, lane);
                __syncwarp();
                bool last = false;
                if (lane == 0)
                    last = arrive(b.arrival(s, j), tag, num_pieces);
                if (__shfl_sync(0xffffffffu, last, 0))
                    Remote::put_warp(b.combine_row(s, p.rank, j), b.staged_row(s, j), b.combine_row_bytes, s);
                return kItemDone;
            }
        }
        store_bf16(b.combine_row(s, p.rank, j), acc, piece * kReduceInt4, hidden_int4, lane);
        return kItemDone;
    };
    // Whether the warp's item `item` of s was left (lane 0 reads, every lane learns).
    const auto was_left = [&](int s, int item) {
        const uint32_t mark = lane == 0 ? ptx::ld_relaxed_sys(b.deferred_item(s, item, num_pieces)) : 0u;
        return __shfl_sync(0xffffffffu, mark, 0) == tag;
    };
    // The peers whose items a hook's send left (NOTE [deferred rows]): a bit each, a lane per peer.
    const auto peers_left = [&] {
        return __ballot_sync(0xffffffffu, lane < p.num_ranks && ptx::ld_relaxed_sys(b.deferred_peer(lane)) == tag);
    };
    // Without a mask, a launch that recorded a failure (a lost weight, a receive timeout in another block) left rows
    // unwritten: its peers must time out rather than sum them; so does one whose expert outputs never came (NOTE
    // [combine overlap]), mask or none.
    const auto withhold_all = [&] { return (p.rank_mask == nullptr || p.comp_signal != nullptr) && failed(wait); };
    if (p.do_send) {
        const uint32_t dispatch_tag = ptx::ld_relaxed_sys(b.last_tag(0));
        // Fewer blocks than ranks, or an overlap's few (NOTE [combine overlap]): a block a rank at a time, in
        // rounds; every weight goes out before any block waits for a peer's, which a peer may send in a later round.
        const bool few_blocks = static_cast<int>(gridDim.x) < p.num_ranks || p.comp_signal != nullptr;
        const int num_rounds = few_blocks ? (p.num_ranks + gridDim.x - 1) / gridDim.x : 1;
        // This block's destination in `round`: the rank whose messages it sends back (NOTE [peer-major blocks]).
        const auto group_of = [&](int round) {
            return few_blocks ? PeerBlocks{static_cast<int>(blockIdx.x + round * gridDim.x), 0, 1}
                              : peer_blocks(p.num_ranks, p.local_blocks);
        };
        // (1) This rank's weights to s, a thread per token over the group, each token's to its message slot
        //     (the token index) if it went to s, each tagged with the epoch: no fence and no flag. To a rank of
        //     another node the group's first block assembles every token's (whether or not it went to s: one
        //     contiguous put) and puts them at once, setting s's weights flag (NOTE [internode low-latency]).
        const auto send_weights = [&](const PeerBlocks& group, int s) {
            if constexpr (Remote::kEnabled) {
                if (b.is_remote(s)) {
                    if (group.index != 0 || __syncthreads_or(masked(s)) || p.num_tokens == 0)
                        return;  // uniform over the block
                    for (int i = threadIdx.x; i < p.num_tokens * kNumTopk; i += blockDim.x)
                        b.staged_weights_for(s, 0)[i] = (static_cast<uint64_t>(tag) << 32) |
                                                        __float_as_uint(p.topk_weights[i]);
                    __threadfence();
                    __syncthreads();
                    if (warp == 0)
                        Remote::put_signal_set_warp(b.weights(s, p.rank, 0), b.staged_weights_for(s, 0),
                                                    static_cast<size_t>(p.num_tokens) * kNumTopk * 8,
                                                    b.weights_flag(s, p.rank), (static_cast<uint64_t>(tag) << 32) | 1u,
                                                    s);
                    return;
                }
            }
            for (int t = group.index + group.count * static_cast<int>(threadIdx.x); t < p.num_tokens && !masked(s);
                 t += group.count * static_cast<int>(blockDim.x)) {
                float w[kNumTopk];
                bool here = false;
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) {
                    const int64_t e = static_cast<int64_t>(p.topk_idx[static_cast<int64_t>(t) * kNumTopk + k]);
                    here |= e >= 0 && e < p.num_experts && e / b.num_local_experts == s;
                    w[k] = p.topk_weights[static_cast<int64_t>(t) * kNumTopk + k];
                }
                if (!here)
                    continue;
                uint64_t* to = b.weights(s, p.rank, t);
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k)
                    store_word<Remote>(b, to + k, (static_cast<uint64_t>(tag) << 32) | __float_as_uint(w[k]), s, false);
            }
        };
        for (int round = 0; few_blocks && round < num_rounds; ++round) {
            const PeerBlocks group = group_of(round);
            if (group.turn >= p.num_ranks)
                break;
            send_weights(group, next_peer(p.rank, p.num_ranks, group.turn));
        }
        for (int round = 0; round < num_rounds; ++round) {
            const PeerBlocks group = group_of(round);
            if (group.turn >= p.num_ranks)
                break;  // the same for the whole block
            const int s = next_peer(p.rank, p.num_ranks, group.turn);
            // Items are left (NOTE [deferred rows]) by a hook's send only, and never this rank's own: its weights
            // are on their way from this launch's other blocks.
            const bool may_leave = kHookSend && s != p.rank;
            // The first item's words and s's message count are asked for before the weights go out, so that
            // neither waits for the other.
            const int stride = group.count * num_warps, first = warp * group.count + group.index;
            Choice next = choice_of(s, first);
            const uint64_t count_word = threadIdx.x == 0 ? ptx::ld_relaxed_sys(b.count(p.rank, s)) : 0;
            if (!few_blocks)
                send_weights(group, s);
            // (2) The items of s.
            __shared__ int num_items;
            if (threadIdx.x == 0)
                num_items = items_of(s, count_word, dispatch_tag);
            __syncthreads();
            trace_mark(p.trace, kTracePrologue);
            // The warp's n-th item is first + n * stride; bit n of left_bits: it was left (left_far: one past
            // the 32nd, whose words tell).
            uint32_t left_bits = 0u;
            bool left_far = false, stopped = false;
            for (int item = first, n = 0; item < num_items; item += stride, ++n) {
                const Choice choice = next;
                next = choice_of(s, item + stride);
                const int done = reduce_item(s, item, choice, dispatch_tag, may_leave);
                stopped = done == kItemStop;
                if (stopped)
                    break;
                if (done == kItemLeft && n < kWarpSize)
                    left_bits |= 1u << n;
                left_far |= done == kItemLeft && n >= kWarpSize;
            }
            // The items left, once more, in order, until one whose weights have still not come: s is late, and
            // that item and the rest stay left for the receiving launch, whose flag to s then waits for them.
            bool still_left = false;
            const bool retry = kHookSend && (left_bits != 0u || left_far) && !stopped;
            for (int item = first, n = 0; retry && item < num_items; item += stride, ++n) {
                if (n < kWarpSize ? ((left_bits >> n) & 1u) == 0u : !was_left(s, item))
                    continue;
                const int done = reduce_item(s, item, choice_of(s, item), dispatch_tag, true);
                stopped = done == kItemStop;
                still_left = done == kItemLeft;
                if (done != kItemDone)
                    break;
                if (lane == 0)
                    ptx::st_relaxed_sys(b.deferred_item(s, item, num_pieces), 0u);
                left_bits &= ~(n < kWarpSize ? 1u << n : 0u);
            }
            if (still_left && lane == 0)
                ptx::st_relaxed_sys(b.deferred_peer(s), tag);
            // (3) s's flag from the group's last block (NOTE [group release]); those left wait for the receive.
            trace_mark(p.trace, kTraceSent);
            if constexpr (Remote::kEnabled) {  // the block's puts have landed before it reports done (NOTE [block quiet])
                __syncthreads();
                if (threadIdx.x == 0)
                    Remote::quiet();
            }
            const bool last = last_of(b.group_counter(s), group.count);  // syncs the block: num_items is free again
            trace_mark(p.trace, kTraceCounted);
            if (last && threadIdx.x == 0 && !masked(s) && !withhold_all() &&
                !(kHookSend && ptx::ld_relaxed_sys(b.deferred_peer(s)) == tag)) {
                store_word<Remote>(b, b.combine_flag(s, p.rank), (static_cast<uint64_t>(tag) << 32) | 1u, s, true);
                trace_mark(p.trace, kTracePublished);
            }
        }
        if (last_block_done(b, 1))
            store_epoch(b, 1, epoch);
    }
    if (!p.do_recv) {
        trace_mark(p.trace, kTraceEnd);
        return;
    }

    if (!p.do_send) {
        // NOTE [deferred rows]: the items the sending launch left go first, then their peers' flags.
        const uint32_t left = peers_left();
        if (left != 0u) {
            const uint32_t dispatch_tag = ptx::ld_relaxed_sys(b.last_tag(0));
            // One index over the items of every peer left (in rank order), so that a warp has about one item and
            // the peers' rows go out together; lane r holds peer r's count.
            const int lane_items = lane < p.num_ranks && (left >> lane) & 1u
                                           ? items_of(lane, ptx::ld_relaxed_sys(b.count(p.rank, lane)), dispatch_tag)
                                           : 0;
            const auto locate = [&](int i, int& item) {  // -> the peer of index i and its item there, or -1
                for (int r = 0; r < p.num_ranks; ++r) {
                    const int count = __shfl_sync(0xffffffffu, lane_items, r);
                    if (i < count) {
                        item = i;
                        return r;
                    }
                    i -= count;
                }
                return -1;
            };
            const auto choice_at = [&](int s, int item) { return s >= 0 ? choice_of(s, item) : Choice{0, 0, -1, 0}; };
            const int stride = static_cast<int>(gridDim.x) * num_warps;
            int i = warp * gridDim.x + blockIdx.x, item = 0;
            int s = locate(i, item);
            Choice choice = choice_at(s, item);
            while (s >= 0) {  // the next index's words are asked for before this one's rows
                int next_item = 0;
                const int next_s = locate(i + stride, next_item);
                const Choice next = choice_at(next_s, next_item);
                if (was_left(s, item) && reduce_item(s, item, choice, dispatch_tag, false) == kItemStop)
                    break;
                i += stride;
                s = next_s;
                item = next_item;
                choice = next;
            }
            // The flags of the peers left, from the last block (the send's groups published the others'; the epoch
            // stays as the send set it). (No generic lambda: NVRTC compiles no `auto` parameter without an
            // execution space.)
            publish_when_last<Remote>(b, 1, epoch, p.rank_mask, p.trace,
                                      [&](int r) { return Signal{b.combine_flag(r, p.rank), 1u}; },
                                      [&] { return withhold_all() ? ~0u : ~left; });
        }
    }

    const int64_t recv_start = clock64();  // NOTE [wait costs]
    // Without the mask, which the send's waits may change meanwhile: which ranks' rows count is decided below.
    build_pair_bits<kNumTopk, TopkT, true>(bits, words, p.topk_idx, p.num_tokens, p.num_experts, b.num_local_experts,
                                           nullptr);
    trace_mark(p.trace, kTraceRecvReady);
    // One thread per rank that has rows for this rank waits for them (NOTE [block waits]); a rank masked
    // before or meanwhile is absent. Under a mask block 0 decides for every block (NOTE [one verdict]).
    // This rank's own rows come from this launch's (or the hook's send's) blocks, which in rounds (few blocks) may
    // wait for a late peer's weights first (masking it under a mask): their wait has two deadlines, as a verdict's
    // follower has (NOTE [one verdict]), so that a late peer is the rank a timeout names, and it never masks this
    // rank itself.
    const WaitContext patient = follower_wait(wait);
    __shared__ bool rows_here[kWarpSize];
    bool missed = false;  // recorded (no mask): the host raises it, and the block has nothing more to do
    if (threadIdx.x < p.num_ranks) {
        const int dest = threadIdx.x;
        const bool expected = row_count(bits, words, dest) > 0;
        bool here = false;
        if (expected && p.rank_mask != nullptr && blockIdx.x != 0) {
            here = follow_verdict(b, wait, kVerdictCombine, dest, tag, kStageLowLatencyCombineRecv);
        } else if (expected) {
            if (!masked(dest)) {
                const bool own = dest == p.rank;
                here = wait_or_mask(own ? patient : wait, b.combine_flag(p.rank, dest), tag, dest,
                                    kStageLowLatencyCombineRecv, own ? nullptr : p.rank_mask) >= 0;
                add_wait_cost(p.wait_costs, dest, recv_start);
            }
            if (p.rank_mask != nullptr)
                publish_verdict(b, kVerdictCombine, dest, tag, here);
            missed = !here && p.rank_mask == nullptr;
        }
        rows_here[dest] = here;
    }
    if (__syncthreads_or(missed))
        return;
    trace_mark(p.trace, kTraceRecvMid);
    for (int item = warp * gridDim.x + blockIdx.x; item < p.num_tokens * num_pieces; item += gridDim.x * num_warps) {
        const int t = item / num_pieces, piece = item % num_pieces;
        const int4* row = nullptr;
        if (lane < p.num_ranks && rows_here[lane] && pair_chosen(bits, words, lane, t))
            row = b.combine_row(p.rank, lane, t);  // the message slot is the token index
        float acc[kReduceVectors][8] = {};
        RowBatch batch;
        accumulate_rows<true>(acc, batch, false, __ballot_sync(0xffffffffu, row != nullptr), row, 1.0f,
                              piece * kReduceInt4, hidden_int4, lane);
        store_bf16(p.combined_x + static_cast<int64_t>(t) * hidden_int4, acc, piece * kReduceInt4, hidden_int4, lane);
    }
    trace_mark(p.trace, kTraceEnd);
}

// A hook's send is compiled apart, so that leaving items costs the other launches nothing.
template <int kNumTopk, typename TopkT, typename Remote = NoRemote, typename Params>
__device__ __forceinline__ void low_latency_combine(const Params& p) {
    if (p.do_send && !p.do_recv)
        combine_launch<true, kNumTopk, TopkT, Remote>(p);
    else
        combine_launch<false, kNumTopk, TopkT, Remote>(p);
}

}  // namespace tokenyard::kernels
