// dispatch: move token rows into their destination ranks' buffers and out into the receive tensors
// (docs/semantics.md, "Normal dispatch"). Runs after dispatch_notify.
#pragma once

#include "../copy.cuh"
#include "../layout.cuh"
#include "../phases.cuh"
#include "../staging.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// NOTE [dispatch roles]
// Warps [0, kSendWarps) of every block send, then receive; the block's other warps receive from the start, so that
// every SM's copy engine stores to the peers (the senders' TMA copies) while its load/store units copy rows out (the
// receivers'). Work is split per warp, never per block, so no warp waits for another: a sender warp takes a
// contiguous range of tokens (NOTE [sender ranges]) and, piece by piece of at most kChunkTokens tokens, copies each
// token to every rank it goes to (one read of x, up to kNumRanks writes) into row prefix_excl[t][dest] of this
// rank's region in rank dest's buffer, then publishes, in the piece's slot at each destination, the row range it
// filled and the call's sequence number (release, after a system fence). A row's data moves by TMA bulk copies,
// global -> shared -> every destination, lane 0 driving the warp's stages (NOTE [warp stages] in staging.cuh),
// while the lanes write its tail. Receiving warps claim (piece, sender warp, source) items piece-major, following
// the senders' progress (NOTE [receive claims]). A receiver waits for the item's slot, then copies its rows to the
// output rows that follow the rows of lower source ranks (rank_prefix_matrix; only their tails where the senders
// placed the data there: NOTE [placed rows]),
// turning the metadata into recv_topk_idx / recv_topk_weights / recv_src_idx (the data by its load/store units, a
// batch of loads before their stores).
// A token's row for this rank itself skips the buffer when `local_direct` is set: the sender writes it
// straight into the outputs (row rank_prefix_matrix[rank - 1][rank] + prefix_excl[t][rank], metadata in
// its final form) and the receivers skip their own source, a quarter of their rows
// (heuristics.DISPATCH_OWN_ROWS_DIRECT, measured faster).
//
// A round of a call in rounds writes straight into the whole call's receive tensors (NOTE [placed rounds] in
// tokenyard/rounds.py): `recv_first[s]` is the output row of the round's first row from source s (else
// rank_prefix_matrix gives it, one-shot), `src_idx_base` the round's first token (added to recv_src_idx),
// and `num_worst_tokens` the rows the whole call's tensors hold. The caller has filled the padding rows, so
// the kernel writes none; a row past the tensors is dropped and recorded as an overflow error, as one-shot.
//
// A fresh dispatch's launches get `verdict`, where the count exchange left the mask of the ranks whose
// inputs it judged bad (NOTE [input verdict] in tokenyard/checks.py): if any, every rank's launch moves
// nothing.
//
// Outputs the caller does not want are null: recv_topk_weights without input weights, the metadata of a
// cached dispatch.
// Row layout (workspace.normal_dispatch_row_bytes): data (kDataInt4 vectors), then kNumScales 4-byte
// scales padded to 16 bytes, then kNumTopk int32 local expert ids, kNumTopk float32 weights and the int32
// source index, padded to 16 bytes (NOTE [row tail]); the whole row is padded to a multiple of 128 bytes.
//
// NOTE [sender ranges]
// Sender warp w of the W = num_send_warps warps of the sending launch owns the tokens
// [T * w / W, T * (w + 1) / W) of its rank's T tokens; ranges differ by at most one token, so no warp
// carries more than ceil(T / W). (Dealing chunks of 8 round robin gave the busiest of 192 warps 24 of
// 4096 tokens, against 21.3 on average, and the slowest warp sets the kernel's time.) Example: 10 tokens,
// 4 warps: [0, 2) [2, 5) [5, 7) [7, 10). A warp publishes its range piece by piece (NOTE [tail pieces]),
// piece p in slot w * P + p, with P the pieces of a range of ceil(T / W) tokens; at most
// T / kChunkTokens + W * (kChunkTokens / kTailTokens + 1) slots (workspace.normal_dispatch_slots, checked
// against the buffer's before any kernel runs). Receivers compute each source's ranges from its token
// count and W, so every rank launches the same number of sending warps (the same num_sms, as DeepEP also
// requires); every slot carries its sender's W, and a receiver that finds another records a mismatch
// error instead of copying rows it would misplace or miss.
//
// NOTE [receive claims]
// The receiving warps take the items in order from a counter of the rank's (CallCounter kRecvClaims), an atomic add
// each, the next claimed while the current one's rows are copied; a sender warp joins them once its range is sent.
// Dealt in turn among the receiving warps only, the rows that landed after the last senders had finished waited
// for the few receivers (4 warps a block), whose copying set the time of the 4-rank dispatch at 8 SMs
// (benchmarks/results/normal_tuning.md, "The senders' shapes as TMA writers"). Block 0 clears the counter at the
// launch's start and then stores the launch's number beside it (release, kRecvClaimsLaunch); a warp claims once it has
// read that number (acquire, bounded): the previous launch's claims all ended before this launch began (stream order).
//
// NOTE [tail pieces]
// Every sender warp moves its range at about the same pace, so the pieces with one index land on the
// receivers at about the same time, in waves, and the rows of the last wave are copied out after the
// last sender is done: that copy is the dispatch's tail. So a range goes in pieces of kChunkTokens but
// its last kChunkTokens tokens (or fewer) in pieces of kTailTokens: a small last wave, for a few more
// slots. Example, 28 tokens, pieces of 8 and tail pieces of 2: 8 8 4 | 2 2 2 2.
//
// NOTE [placed rows]
// A row that went into its destination's buffer had to be copied out again by the destination's receivers, with
// their own loads and stores: at 8 SMs that copy set the dispatch's time (benchmarks/results/normal_tuning.md,
// "Placed rows"). So where the destination's recv_x lies in its output arena (NOTE [output arena] in
// csrc/call_plan.cpp; `place_offset` >= 0), the senders' bulk copies write each row's data straight into its recv_x
// row, and the receivers only scatter the rows' tails, which still come through the buffer with the slots that say
// the rows have landed. Each rank's data kernel first writes, in its buffer's PlaceSlot, its recv_x's offset in the
// arena (-1: its rows come through the buffer, as for the rounds after a call's first, under graph capture, or where
// the arena had no free block), its rows and the output row of each source's first row, then the launch's number;
// a sender's lane d waits for rank d's (bounded, kStageDispatchPlace) before its first token. A row past the
// destination's rows is dropped, and its receivers record the overflow from the tails, as they do for rows through
// the buffer.
// Rank d's slot of one call cannot be overwritten while a peer still reads it: its next call's data kernel starts
// after that call's count exchange, which every rank reaches only after its own data kernel of this call ended.
// A rank whose data kernel never starts (killed after its count exchange) stalls every peer's senders at their wait
// for its slot, so the receivers of a third rank wait for rows that those senders never send. With place waits, a
// receiver's deadline is kVerdictSlackNs later than theirs: the rank's own wait for the missing slot records first,
// and the error names the rank that never came, not a peer held up by it (at 4 ranks on 4 GPUs the two deadlines
// raced: benchmarks/results/gpu_suite.md, "Every test at 4 and at 2 ranks").
//
// NOTE [expanded rows]
// ElasticBuffer's cached expanded dispatch (kExpand; tokenyard/elastic.py) writes each received row straight to the
// rows of its (row, local expert) pairs in the expanded outputs, where a separate pass copied them out of recv_x
// (`expand_rows`): the handle's row_of[out][k] is slot k's expanded row (-1: no local expert), recv_x / recv_scales
// are the expanded data and scales, and recv_topk_weights holds one weight an expanded row (the slot's, which the
// tail carries). The rows come through the buffer (no placed rows, no own row written by the senders): a receiver's
// lane 0 loads a row into its warp's stages by TMA once (every warp of this kernel has stages, half the size of the
// sending warps' in the plain kernel) and stores it to each of its pairs' rows, the lanes its scales and weights; the
// outputs the handle holds are not written. Then the padding rows (source_row < 0) are zeroed where the caller asks.
// A fresh expanded dispatch (kExpandFresh) makes that layout as the rows land, with no pass after: each slot's
// source rank (semantics.expand.source_ranks; kernels/expand.cuh source_ranks) rides in the row's tail, the count
// exchange gives where each source's pairs of each local expert begin (expand_bases, NOTE [notify]), and a pair's
// row is its base plus its rank; the receivers also write the handle's fields (local ids, source indices, row_of,
// source_row, recv_src_metadata), and the padding rows lie between an expert's end and the next one's start.
// The backend takes these paths from heuristics.EXPAND_IN_DISPATCH_MIN_SMS SMs, a fresh one with peers and a cached
// one from EXPAND_CACHED_IN_DISPATCH_MIN_RANKS ranks (expands_in_dispatch): on fewer SMs, at one rank, and for a
// cached one at 2 ranks on 2 GPUs the gather after a plain dispatch was faster (benchmarks/results/elastic.md).
template <int kChunkTokens, int kTailTokens>
struct SenderRanges {
    static_assert(kTailTokens >= 1 && kTailTokens <= kChunkTokens, "tail pieces are at most a chunk");
    int num_tokens, num_warps, num_pieces;
    __device__ __forceinline__ SenderRanges(int tokens, int warps)
        : num_tokens(tokens), num_warps(warps), num_pieces(pieces((tokens + warps - 1) / warps)) {}
    // Pieces of a range of n tokens (never fewer for a longer range).
    __device__ __forceinline__ static int pieces(int n) {
        const int tail = min(n, kChunkTokens);
        return (n - tail + kChunkTokens - 1) / kChunkTokens + (tail + kTailTokens - 1) / kTailTokens;
    }
    __device__ __forceinline__ int begin(int w) const {
        return static_cast<int>(static_cast<int64_t>(num_tokens) * w / num_warps);
    }
    __device__ __forceinline__ int pieces_of(int w) const { return pieces(begin(w + 1) - begin(w)); }
    // Tokens [t0, t1) of warp w's piece p (p < pieces_of(w)).
    __device__ __forceinline__ void piece(int w, int p, int& t0, int& t1) const {
        const int first = begin(w), n = begin(w + 1) - first;
        const int head = n - min(n, kChunkTokens), head_pieces = (head + kChunkTokens - 1) / kChunkTokens;
        if (p < head_pieces) {
            t0 = first + p * kChunkTokens;
            t1 = first + min(head, (p + 1) * kChunkTokens);
        } else {
            t0 = first + head + (p - head_pieces) * kTailTokens;
            t1 = min(first + n, t0 + kTailTokens);
        }
    }
    __device__ __forceinline__ int slot(int w, int piece) const { return w * num_pieces + piece; }
};

template <int kNumRanks, int kNumThreads, int kDataInt4, int kNumScales, int kNumTopk, typename TopkT,
          int kChunkTokens, int kTailTokens, bool kAllWeights, int kStages, int kStageBytes, int kSendWarps,
          bool kExpand, bool kExpandFresh, typename Params>
__device__ __forceinline__ void dispatch(const Params& p) {
    static_assert(kNumRanks <= kWarpSize, "one lane per rank");
    const WaitContext wait{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    uint32_t seq[1];  // NOTE [normal-mode call numbers] in sync.cuh: before any block may return
    launch_numbers<1>(p.call_counts + kCountSeq, seq);
    // Values judged bad, or ranks whose count exchange found other calls (NOTE [call signatures]): no rows.
    if ((p.verdict != nullptr && p.verdict[1] != 0) || failed(wait))
        return;
    uint32_t* claims_launch = reinterpret_cast<uint32_t*>(p.call_counts + kRecvClaimsLaunch);
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // NOTE [receive claims]
        atomicExch(p.call_counts + kRecvClaims, 0ull);
        ptx::st_release_sys(claims_launch, seq[0]);
    }
    constexpr int kNumWarps = kNumThreads / kWarpSize;
    using Ranges = SenderRanges<kChunkTokens, kTailTokens>;
    // The row's tail (scales, then metadata) moves as whole 16-byte vectors, one per lane (NOTE [row tail]).
    constexpr int kScaleInt4 = (kNumScales + 3) / 4;
    static_assert(kExpand || !kExpandFresh, "a fresh expanded dispatch is an expanded one");
    constexpr int kMetaWords = 2 * kNumTopk + 1 + (kExpandFresh ? kNumTopk : 0);  // NOTE [row tail]
    constexpr int kTailInt4 = kScaleInt4 + (kMetaWords + 3) / 4;
    constexpr int kTailPerLane = (kTailInt4 + kWarpSize - 1) / kWarpSize;
    const NormalBuffers buffers{p.peer_bases, p.rank, p.control_bytes, p.region_bytes,
                                p.slots_offset, p.max_chunks, p.row_bytes};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    PhaseClock phase_clock(p.phases, warp, kNumWarps);  // NOTE [normal-mode phases]
    extern __shared__ __align__(128) uint8_t shared[];
    static_assert(kSendWarps >= 1 && kSendWarps < kNumWarps, "every block sends and receives");
    // The sending warps', and with kExpand every warp's (the receivers' bulk copies: NOTE [expanded rows]).
    constexpr int kStagedWarps = kExpand ? kNumWarps : kSendWarps;
    WarpStages<kStages, kStageBytes> stages(shared, warp, kStagedWarps);
    if (warp < kStagedWarps && lane == 0)
        stages.init();
    // The output row of the first row from `source` (NOTE [placed rounds]).
    auto out_first = [&](int source) {
        return first_row_placed(p.recv_first, p.rank_prefix_matrix, kNumRanks, p.rank, source);
    };
    // NOTE [placed rows]: where this call's rows go in this rank's recv_x, for the peers' senders (the fields, then
    // the launch's number with release).
    const bool placed = p.place_offset >= 0;
    if (p.place_bases != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        PlaceSlot* mine = buffers.place(p.rank);
        mine->offset = p.place_offset;
        mine->rows = p.recv_rows;
        for (int source = 0; source < kNumRanks; ++source)
            mine->first[source] = out_first(source);
        ptx::st_release_sys(&mine->seq, seq[0]);  // the fields before the number
    }

    // NOTE [row tail]
    // After its data, a row holds its scales (padded to 16 bytes) and its metadata: kNumTopk int32 local
    // expert ids (-1 where the expert lives elsewhere), kNumTopk float32 weights (0 there, unless kAllWeights:
    // DeepEP V2 delivers every slot's weight), the int32 source index and, in a fresh expanded dispatch (NOTE [expanded
    // rows]), kNumTopk int32 source ranks (semantics.expand.source_ranks, -1 where a slot names no expert), padded to
    // 16 bytes. Lane i of a warp owns the tail's 16-byte vector i: the scales
    // 4i..4i+3, or metadata words 4m..4m+3 with m = i - kScaleInt4. The sender builds the vectors in
    // registers (the metadata per destination, from the top-k slots its lanes gather once a token) and each destination
    // gets the tail in one store instruction, where scalar stores would have sent many small NVLink writes;
    // the receiver loads it with the data, one vector per lane, and scatters the words to the outputs.

    // Metadata word w of destination `dest`, from the expert and weight bits of the top-k slot the word holds (word w
    // < kNumTopk: slot w's local id; < 2 * kNumTopk: slot w - kNumTopk's weight; past the source index: slot w - 2 *
    // kNumTopk - 1's source rank). The lanes gather their words' slots once a token (`slot_expert`, `slot_bits`,
    // `slot_rank`: a shuffle each a word), not once a destination.
    auto meta_word = [&](int w, int dest, int slot_expert, int slot_bits, int slot_rank, int t) {
        const int first = dest * p.num_local_experts;
        const bool local = slot_expert >= first && slot_expert < first + p.num_local_experts;
        return w < kNumTopk ? (local ? slot_expert - first : -1)
               : w < 2 * kNumTopk ? (kAllWeights || local ? slot_bits : 0)
               : w == 2 * kNumTopk ? t
               : w < kMetaWords ? slot_rank : 0;
    };

    // One warp sends token t to every rank it goes to: one read of x (into the warp's stages), up to kNumRanks
    // writes. The lanes load the token's scales and top-k and where it goes, then write its tail to every
    // destination while lane 0 stores its data, loaded ahead with the previous token where it fits, and loads
    // the next token of the warp's range (`next`, or -1) ahead (NOTE [warp stages]).
    bool ahead = false;  // lane 0's: whether the token it is at was loaded ahead
    // Lane d's (NOTE [placed rows]): rank d's recv_x where it placed this call (else null), its rows, and the row in
    // it of this rank's first row.
    uint8_t* place_base = nullptr;
    int place_rows = 0, place_first = 0;
    // Where rank `lane`'s rows from this rank begin in its receive order, and this rank's own rows in its outputs.
    const int first_at_lane =
        lane < kNumRanks ? first_row_in_order(p.rank_prefix_matrix, kNumRanks, lane, p.rank) : 0;
    const int64_t own_first = out_first(p.rank);
    // NOTE [routes ahead]
    // A sending warp's lanes load the next token's routing (its scales, top-k, ranks and rows there) before they
    // send the token they are at, and hold it in registers: those loads' round trip, which each token waited for
    // before its row could go (on 4 GPUs at 8 SMs a fifth of the senders' time: benchmarks/results/normal_tuning.md,
    // "The senders' shapes as TMA writers"), now passes while the previous row is stored. On one GPU shared by 4
    // ranks the time moved into the wait for the next row's bulk load ("Routes ahead, ..."). The routing is held as
    // loaded, the rank's byte of is_token_in_rank as an int: held as a bool, it was made 0 or 1 right after its load,
    // so every token's warp waited there for the load's round trip (the kernel's SASS; "Routes held as loaded").
    // A token's routing, as the lanes hold it.
    struct Route {
        int4 tail[kTailPerLane];  // the scale vectors; metadata vectors are filled per destination
        int64_t expert;           // lane k < kNumTopk: top-k slot k's expert (-1 elsewhere)
        float weight;             // and its weight
        int hit;                  // lane d < kNumRanks: whether the token goes to rank d (the byte as loaded)
        int slot_index;           // and its row among this rank's rows there
        int rank;                 // kExpandFresh, lane k < kNumTopk: slot k's source rank
    };
    auto load_route = [&](int t) {
        const int64_t token = t;
        Route r;
#pragma unroll
        for (int u = 0; u < kTailPerLane; ++u) {
            int words[4] = {0, 0, 0, 0};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = (u * kWarpSize + lane) * 4 + c;
                if (u * kWarpSize + lane < kScaleInt4 && j < kNumScales)
                    words[c] = static_cast<int>(p.x_scales[token * p.scale_token_stride + j * p.scale_hidden_stride]);
            }
            r.tail[u] = make_int4(words[0], words[1], words[2], words[3]);
        }
        r.expert = -1;
        r.weight = 0.0f;
        if (lane < kNumTopk) {
            r.expert = static_cast<int64_t>(p.topk_idx[token * kNumTopk + lane]);
            r.weight = p.topk_weights != nullptr ? p.topk_weights[token * kNumTopk + lane] : 0.0f;
        }
        r.hit = lane < kNumRanks ? static_cast<int>(p.is_token_in_rank[token * kNumRanks + lane]) : 0;
        r.slot_index = lane < kNumRanks ? p.prefix_excl[token * kNumRanks + lane] : 0;
        r.rank = kExpandFresh && lane < kNumTopk ? p.source_ranks[token * kNumTopk + lane] : -1;
        return r;
    };
    auto send_token = [&](int t, int next, const Route& route) {
        const int64_t token = t;
        const int4* tail = route.tail;
        const int64_t expert = route.expert;
        const float weight = route.weight;
        const bool hit = route.hit != 0;
        const int slot_index = route.slot_index;
        const uint32_t mask = __ballot_sync(0xffffffffu, hit);
        const int index = hit ? slot_index : -1;
        if (p.send_head != nullptr && lane < kNumRanks)
            p.send_head[token * kNumRanks + lane] = hit ? first_at_lane + index : -1;
        // Lane d: where rank d takes the token's data: its recv_x row where it placed this call (NOTE [placed
        // rows]; dropped past its rows, which its receivers record), else the row in its buffer, whose tail it takes.
        uint8_t* const row_at_lane = hit ? buffers.row(lane, p.rank, index) : nullptr;
        uint8_t* data_at_lane = row_at_lane;
        if (hit && place_base != nullptr) {
            const int row = place_first + index;
            data_at_lane = row < place_rows ? place_base + static_cast<int64_t>(row) * (kDataInt4 * 16) : nullptr;
        }
        uint8_t* dst[kNumRanks];
        uint8_t* data_to[kNumRanks];
#pragma unroll
        for (int dest = 0; dest < kNumRanks; ++dest) {
            dst[dest] = reinterpret_cast<uint8_t*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_at_lane), dest));
            data_to[dest] = reinterpret_cast<uint8_t*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(data_at_lane), dest));
        }
        phase_clock.mark(kPhaseMeta, lane);
        // This rank's own row, written straight into the outputs (NOTE [dispatch roles]).
        int64_t direct_row = -1;
        if (p.local_direct && ((mask >> p.rank) & 1u) != 0) {
#pragma unroll
            for (int dest = 0; dest < kNumRanks; ++dest)  // a constant index: dst stays in registers
                if (dest == p.rank)
                    dst[dest] = nullptr;
            direct_row = own_first + __shfl_sync(0xffffffffu, index, p.rank);
            if (p.num_worst_tokens > 0 && direct_row >= p.num_worst_tokens) {
                if (lane == 0)
                    record_error(wait, kErrorOverflow, -1, kStageDispatchRecv, direct_row + 1, p.num_worst_tokens);
                direct_row = -1;
            }
        }
        int4* direct = direct_row >= 0 ? p.recv_x + direct_row * kDataInt4 : nullptr;
        // The own row is copied out of the stages by the lanes where they hold it whole (NOTE [warp stages]): the
        // copy engine then stores to the peers only; a row the stages do not hold whole, the copy engine stores
        // too. Its store of every own row was no faster (benchmarks/results/normal_tuning.md, issue 50's sweep).
        constexpr bool kDirectFromStages = kDataInt4 * 16 <= kStages * kStageBytes;
        uint32_t first_piece = 0;
        if (lane == 0) {
            void* to[kNumRanks + 1];
            bool any = direct != nullptr;
#pragma unroll
            for (int dest = 0; dest < kNumRanks; ++dest) {
                // this rank's own row goes by `direct` alone, never by the copy engine too
                to[dest] = p.local_direct && dest == p.rank ? nullptr : data_to[dest];
                any |= to[dest] != nullptr;
            }
            to[kNumRanks] = kDirectFromStages ? nullptr : direct;
            first_piece = stages.stored;
            if (ahead)
                stages.send(kDataInt4 * 16, to);  // to nowhere: the row's stage is freed
            else if (any)
                stages.copy(p.x + token * kDataInt4, kDataInt4 * 16, to);
        }
        phase_clock.mark(kPhaseData, lane);
        if (kDirectFromStages && direct != nullptr) {
            __syncwarp();
            stages.copy_out(direct, __shfl_sync(0xffffffffu, first_piece, 0), kDataInt4 * 16, lane);
            __syncwarp();  // every lane's reads of the stages before lane 0 loads into them
        }
        phase_clock.mark(kPhaseOwnRow, lane);
        if (lane == 0) {
            ahead = next >= 0 && stages.fits(kDataInt4 * 16);
            if (ahead) {
                tma::fence_shared_for_async();
                stages.prefetch(p.x + static_cast<int64_t>(next) * kDataInt4, kDataInt4 * 16);
            }
        }
        phase_clock.mark(kPhaseAhead, lane);
        if (direct != nullptr) {
#pragma unroll
            for (int u = 0; u < kTailPerLane; ++u) {
                const int* words = reinterpret_cast<const int*>(&tail[u]);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = (u * kWarpSize + lane) * 4 + c;
                    if (u * kWarpSize + lane < kScaleInt4 && j < kNumScales)
                        p.recv_scales[direct_row * kNumScales + j] = static_cast<uint32_t>(words[c]);
                }
            }
            if (lane < kNumTopk) {
                const int64_t first = static_cast<int64_t>(p.rank) * p.num_local_experts;
                const bool local = expert >= first && expert < first + p.num_local_experts;
                p.recv_topk_idx[direct_row * kNumTopk + lane] = static_cast<TopkT>(local ? expert - first : -1);
                if (p.recv_topk_weights != nullptr)
                    p.recv_topk_weights[direct_row * kNumTopk + lane] = kAllWeights || local ? weight : 0.0f;
            }
            if (lane == 0 && p.recv_src_idx != nullptr)
                p.recv_src_idx[direct_row] = p.src_idx_base + t;
        }
        int slot_expert[kTailPerLane][4], slot_bits[kTailPerLane][4], slot_rank[kTailPerLane][4];
#pragma unroll
        for (int u = 0; u < kTailPerLane; ++u) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int w = 4 * (u * kWarpSize + lane - kScaleInt4) + c;
                const int k = (w < kNumTopk ? w : w - kNumTopk) & (kWarpSize - 1);
                slot_expert[u][c] = __shfl_sync(0xffffffffu, static_cast<int>(expert), k);
                slot_bits[u][c] = __shfl_sync(0xffffffffu, __float_as_int(weight), k);
                slot_rank[u][c] = kExpandFresh ? __shfl_sync(0xffffffffu, route.rank, (w - 2 * kNumTopk - 1) &
                                                                                      (kWarpSize - 1)) : 0;
            }
        }
#pragma unroll
        for (int dest = 0; dest < kNumRanks; ++dest) {
            if (((mask >> dest) & 1u) == 0)
                continue;
#pragma unroll
            for (int u = 0; u < kTailPerLane; ++u) {
                const int i = u * kWarpSize + lane;
                int4 vec = tail[u];
                if (u * kWarpSize + kWarpSize > kScaleInt4) {  // this slot holds metadata for some lanes
                    const int m = i - kScaleInt4;
                    int words[4];
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        words[c] = meta_word(4 * m + c, dest, slot_expert[u][c], slot_bits[u][c], slot_rank[u][c], t);
                    if (m >= 0)
                        vec = make_int4(words[0], words[1], words[2], words[3]);
                }
                if (dst[dest] != nullptr && i < kTailInt4)
                    ptx::st_na_v4(reinterpret_cast<int4*>(dst[dest] + kDataInt4 * 16) + i, vec);
            }
        }
        phase_clock.mark(kPhaseTail, lane);
    };

    // One warp copies row `src` of this rank's buffer to output row `out` with its load/store units (the copy
    // engine stays with the sending warps). Every load of a batch (up to kBatch data vectors per lane, plus the
    // row's tail with the first batch) is issued before any store, so a row costs about one memory round trip
    // rather than one per field. A batch holds at most what the block's registers hold (16 vectors at 512 threads,
    // 8 at 768, 4 at 1024; NOTE [dispatch block width]), and a row goes in as few batches as that allows, of equal
    // size: a 7168-byte FP8 row (14 vectors a lane) as 7 + 7 at 768 threads, the round trips of 8 + 6.
    auto receive_row = [&](const uint8_t* src, int64_t out, int source) {
        constexpr int kMostBatch = kNumThreads <= 512 ? 16 : kNumThreads <= 768 ? 8 : 4;
        constexpr int kLaneInt4 = (kDataInt4 + kWarpSize - 1) / kWarpSize;
        constexpr int kBatches = (kLaneInt4 + kMostBatch - 1) / kMostBatch;
        constexpr int kBatch = (kLaneInt4 + kBatches - 1) / kBatches;
        const int4* data_in = reinterpret_cast<const int4*>(src);
        const int4* tail_in = data_in + kDataInt4;
        int4* data_out = p.recv_x + out * kDataInt4;
        int4 tail[kTailPerLane];
        auto load_tail = [&]() {
#pragma unroll
            for (int u = 0; u < kTailPerLane; ++u)
                if (u * kWarpSize + lane < kTailInt4)
                    tail[u] = ptx::ld_na_v4(tail_in + u * kWarpSize + lane);
        };
        // NOTE [placed rows]: the senders wrote the data in place, or (kExpand) lane 0 moves it by TMA: the lanes
        // load the tail alone.
        // NOTE [expanded rows]: as many of the row's pieces as the stages hold loaded (lane 0) before the tail and the
        // pairs' rows are read, so that those loads' round trips pass together.
        constexpr uint32_t kRowBytes = kDataInt4 * 16, kHeld = kStages * kStageBytes;
        if (kExpand && lane == 0)
            stages.prefetch(src, min(kRowBytes, kHeld));
        if (placed || kExpand)
            load_tail();
        // Metadata word w of the tail, to every lane (lane kScaleInt4 + w / 4 holds it; w a constant once unrolled).
        auto tail_word = [&](int w) {
            const int i = kScaleInt4 + w / 4;
            return __shfl_sync(0xffffffffu, reinterpret_cast<const int*>(&tail[i / kWarpSize])[w % 4], i % kWarpSize);
        };
        // NOTE [expanded rows]: lane k < kNumTopk holds slot k's row in the expanded outputs (-1: no local expert),
        // which the warp reads by shuffles where it stores (held by every lane, they spilled at 768 threads): the
        // handle's (cached), or where the pair's source rank puts it past its source's base (fresh), which the
        // lanes write to the handle's fields.
        int of_lane = -1;
        if constexpr (kExpandFresh) {
            int local_id = -1, rank = 0;
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int id = tail_word(k), pair_rank = tail_word(2 * kNumTopk + 1 + k);
                if (lane == k) {
                    local_id = id;
                    rank = pair_rank;
                }
            }
            const int token = p.src_idx_base + tail_word(2 * kNumTopk);
            if (lane < kNumTopk && local_id >= 0)
                of_lane = p.expand_bases[source * p.num_local_experts + local_id] + rank;
            const unsigned local_slots = __ballot_sync(0xffffffffu, lane < kNumTopk && local_id >= 0);
            int* metadata = p.expand_metadata + out * (kNumTopk + 2);
            if (lane < kNumTopk) {
                p.recv_topk_idx[out * kNumTopk + lane] = static_cast<TopkT>(local_id);
                p.expand_row_of[out * kNumTopk + lane] = of_lane;
                metadata[2 + lane] = of_lane;
                if (of_lane >= 0)
                    p.expand_source_row[of_lane] = static_cast<int>(out);
            }
            if (lane == 0) {
                p.recv_src_idx[out] = token;
                metadata[0] = source * p.expand_num_max + token;
                metadata[1] = local_slots != 0 ? source * kNumTopk + __ffs(local_slots) - 1 : -1;
            }
        } else if constexpr (kExpand) {
            of_lane = lane < kNumTopk ? p.expand_row_of[out * kNumTopk + lane] : -1;
        }
        auto expanded = [&](int k) { return __shfl_sync(0xffffffffu, of_lane, k); };
        if constexpr (kExpand) {  // NOTE [expanded rows]: the data by lane 0's bulk copies, to each pair's row
            void* to[kNumTopk];
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int row = expanded(k);
                to[k] = row >= 0 ? p.recv_x + static_cast<int64_t>(row) * kDataInt4 : nullptr;
            }
            // As many pieces' loads in flight at once as the stages hold, then their stores: a round trip a row
            // rather than a piece (in the proxy no faster, elastic.md: the copies are bound elsewhere there).
            for (uint32_t at = 0; lane == 0 && at < kRowBytes; at += kHeld) {
                const uint32_t n = min(kRowBytes - at, kHeld);
                if (at > 0)  // the first pieces went out before the metadata
                    stages.prefetch(src + at, n);
                stages.send(n, to, at);
            }
        }
        for (int base = 0; !placed && !kExpand && base < kDataInt4; base += kBatch * kWarpSize) {
            int4 v[kBatch];
            load_batch<kBatch, true>(v, data_in, base, kDataInt4, lane);
            if (base == 0)
                load_tail();
            store_batch<kBatch>(data_out, v, base, kDataInt4, lane);
        }
        if constexpr (kExpand) {  // the scales to each pair's row, a slot's weight to its pair's
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int row = expanded(k);
                if (row < 0)
                    continue;
#pragma unroll
                for (int u = 0; u < kTailPerLane; ++u) {
                    const int i = u * kWarpSize + lane;
                    const int* words = reinterpret_cast<const int*>(&tail[u]);
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int j = i * 4 + c;
                        if (i < kScaleInt4 && j < kNumScales)
                            p.recv_scales[static_cast<int64_t>(row) * kNumScales + j] = static_cast<uint32_t>(words[c]);
                        else if (i >= kScaleInt4 && i < kTailInt4 && (i - kScaleInt4) * 4 + c == kNumTopk + k &&
                                 p.recv_topk_weights != nullptr)
                            p.recv_topk_weights[row] = __int_as_float(words[c]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kTailPerLane; ++u) {
            const int i = u * kWarpSize + lane;
            if (kExpand || i >= kTailInt4)
                continue;
            const int* words = reinterpret_cast<const int*>(&tail[u]);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = i * 4 + c, w = (i - kScaleInt4) * 4 + c;
                if (i < kScaleInt4) {
                    if (j < kNumScales)
                        p.recv_scales[out * kNumScales + j] = static_cast<uint32_t>(words[c]);
                } else if (w < kNumTopk) {
                    p.recv_topk_idx[out * kNumTopk + w] = static_cast<TopkT>(words[c]);
                } else if (w < 2 * kNumTopk) {
                    if (p.recv_topk_weights != nullptr)
                        p.recv_topk_weights[out * kNumTopk + w - kNumTopk] = __int_as_float(words[c]);
                } else if (w == 2 * kNumTopk && p.recv_src_idx != nullptr) {
                    p.recv_src_idx[out] = p.src_idx_base + words[c];
                }
            }
        }
    };

    // Publish tokens [t0, t1) of a sender's piece in slot `index` at destination dest (one lane): its bounds and the
    // sender's launch width (for the receiver to check), then the sequence number, whose release orders the rows and
    // those fields before it (the receiver reads them after its acquire).
    auto publish = [&](int dest, int index, int t0, int t1) {
        ChunkSlot* slot = buffers.slot(dest, p.rank, index);
        ptx::st_relaxed_sys(&slot->begin, p.prefix_excl[static_cast<int64_t>(t0) * kNumRanks + dest]);
        ptx::st_relaxed_sys(&slot->end, p.prefix_excl[static_cast<int64_t>(t1) * kNumRanks + dest]);
        ptx::st_relaxed_sys(&slot->send_warps, p.num_send_warps);  // the receiver checks it is its own W
        ptx::st_release_sys(&slot->seq, seq[0]);
    };

    if (warp < kSendWarps) {
        // NOTE [placed rows]: lane d reads where rank d takes this rank's rows, once rank d's kernel has said.
        bool told = true;
        if (p.place_bases != nullptr && lane < kNumRanks) {
            const PlaceSlot* slot = buffers.place(lane);
            told = wait_at_least(wait, &slot->seq, seq[0], lane, kStageDispatchPlace);
            const int64_t offset = slot->offset;
            place_base = told && offset >= 0 ? p.place_bases[lane] + offset : nullptr;
            place_rows = slot->rows;
            place_first = slot->first[p.rank];
        }
        if (!__all_sync(0xffffffffu, told))  // recorded: the kernel moves nothing more
            return;
        const int send_warp = blockIdx.x * kSendWarps + warp;
        const Ranges ranges(p.num_tokens, p.num_send_warps);
        const int num_pieces = ranges.pieces_of(send_warp), range_end = ranges.begin(send_warp + 1);
        phase_clock.mark(kPhaseStart, lane);
        Route route{};
        if (num_pieces > 0)
            route = load_route(ranges.begin(send_warp));
        for (int piece = 0; piece < num_pieces; ++piece) {
            int t0, t1;
            ranges.piece(send_warp, piece, t0, t1);
            for (int t = t0; t < t1; ++t) {
                const int next = t + 1 < range_end ? t + 1 : -1;
                const Route next_route = load_route(next >= 0 ? next : t);  // NOTE [routes ahead]
                send_token(t, next, route);
                route = next_route;
            }
            if (lane == 0)  // NOTE [warp stages]: the rows' data written before they are published
                stages.drain();
            __syncwarp();
            if (lane < kNumRanks)  // the piece at every destination
                publish(lane, ranges.slot(send_warp, piece), t0, t1);
            phase_clock.mark(kPhasePublish, lane);
        }
        if (lane == 0)
            stages.retire();
    }

    // Receiving, every warp (a sender once its range is sent): each claims (piece, sender warp, source) items
    // piece-major (NOTE [receive claims]), waits for the slot, copies the rows.
    int most_pieces = 0;
    for (int s = 0; s < kNumRanks; ++s)
        most_pieces = max(most_pieces, Ranges(p.source_num_tokens[s], p.num_send_warps).num_pieces);
    const int num_recv = p.rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + p.rank];
    if (p.num_worst_tokens > 0 && p.recv_first == nullptr && num_recv > p.num_worst_tokens && blockIdx.x == 0 &&
        threadIdx.x == 0)
        record_error(wait, kErrorOverflow, -1, kStageDispatchRecv, num_recv, p.num_worst_tokens);
    // With local_direct the items cover the other sources only: had this rank's own source kept its item
    // numbers, a warp count that is a multiple of kNumRanks would leave every warp landing on it idle.
    const int num_sources = p.local_direct ? kNumRanks - 1 : kNumRanks;
    const int items_per_piece = p.num_send_warps * num_sources, num_items = most_pieces * items_per_piece;
    // NOTE [placed rows]: behind the place waits, a source's rows are waited for kVerdictSlackNs longer.
    const WaitContext rows_wait = wait.later_by(p.place_bases != nullptr ? kVerdictSlackNs : 0);
    // Item `item`'s rows copied out; false: the wait for its slot failed (recorded).
    auto receive_item = [&](int item) {
        const int piece = item / items_per_piece, sender = item % items_per_piece / num_sources;
        const int other = item % num_sources;
        const int source = p.local_direct && other >= p.rank ? other + 1 : other;
        const Ranges ranges(p.source_num_tokens[source], p.num_send_warps);
        if (piece >= ranges.pieces_of(sender))
            return true;
        int begin = 0, end = 0;
        bool ok = true;
        if (lane == 0) {
            ChunkSlot* slot = buffers.slot(p.rank, source, ranges.slot(sender, piece));
            ok = wait_at_least(rows_wait, &slot->seq, seq[0], source, kStageDispatchRecv);
            begin = ptx::ld_na_s32(&slot->begin);
            end = ptx::ld_na_s32(&slot->end);
            const int sender_warps = ptx::ld_na_s32(&slot->send_warps);
            if (ok && sender_warps != p.num_send_warps) {  // NOTE [sender ranges]: not the same num_sms
                record_error(wait, kErrorMismatch, source, kStageDispatchRecv, sender_warps, p.num_send_warps);
                ok = false;
            }
        }
        if (kExpand && lane == 0)  // the rows' bulk loads (async proxy) after the acquire (generic)
            tma::fence_global_proxies();
        __syncwarp();  // NOTE [warp acquire] in sync.cuh: lane 0's acquire covers every lane's reads of the rows
        if (!__shfl_sync(0xffffffffu, ok, 0))
            return false;
        phase_clock.mark(kPhaseWait, lane);
        begin = __shfl_sync(0xffffffffu, begin, 0);
        end = __shfl_sync(0xffffffffu, end, 0);
        const int first = out_first(source);
        if (p.num_worst_tokens > 0 && first + end > p.num_worst_tokens) {
            if (lane == 0)  // one-shot, also recorded above with the whole count
                record_error(wait, kErrorOverflow, -1, kStageDispatchRecv, first + end, p.num_worst_tokens);
            end = max(begin, p.num_worst_tokens - first);
        }
        for (int j = begin; j < end; ++j)
            receive_row(buffers.row(p.rank, source, j), first + j, source);
        phase_clock.mark(kPhaseCopy, lane);
        return true;
    };
    unsigned long long* claims = p.call_counts + kRecvClaims;
    phase_clock.mark(warp < kSendWarps ? kPhaseEnd : kPhaseStart, lane);
    int item = 0;  // lane 0's claim, once the counter is this launch's
    if (lane == 0 && wait_at_least(wait, claims_launch, seq[0], p.rank, kStageDispatchRecv))
        item = static_cast<int>(atomicAdd(claims, 1ull));
    else if (lane == 0)
        item = num_items;  // the counter never became this launch's: recorded, nothing claimed
    item = __shfl_sync(0xffffffffu, item, 0);
    while (item < num_items) {
        // The next item's claim goes out before this one's rows are copied.
        const int next = lane == 0 ? static_cast<int>(atomicAdd(claims, 1ull)) : 0;
        if (!receive_item(item)) {
            if (kExpand && lane == 0)  // no bulk store may outlive the block's shared memory
                stages.retire();
            return;
        }
        item = __shfl_sync(0xffffffffu, next, 0);
    }
    if (kExpand && lane == 0)  // NOTE [expanded rows]: the receivers' bulk stores done
        stages.retire();
    // NOTE [expanded rows]: the padding rows, zero where asked: those the handle's source_row marks (cached), or
    // between an expert's end and the next one's start, and past the last (fresh: each one's source_row -1 too).
    const int64_t first_warp = blockIdx.x * kNumWarps + warp, num_warps = gridDim.x * kNumWarps;
    auto pad = [&](int64_t r) {
        if (p.expand_zero_fill) {
            for (int i = lane; i < kDataInt4; i += kWarpSize)
                p.recv_x[r * kDataInt4 + i] = make_int4(0, 0, 0, 0);
            for (int i = lane; i < kNumScales; i += kWarpSize)
                p.recv_scales[r * kNumScales + i] = 0;
            if (lane == 0 && p.recv_topk_weights != nullptr)
                p.recv_topk_weights[r] = 0.0f;
        }
        if (kExpandFresh && lane == 0)
            p.expand_source_row[r] = -1;
    };
    if (kExpandFresh) {
        for (int l = 0; l < p.num_local_experts; ++l) {
            const int64_t end = l + 1 < p.num_local_experts ? p.expand_bases[l + 1] : p.expand_rows;  // source 0's
            for (int64_t r = p.expand_ends[l] + first_warp; r < end; r += num_warps)
                pad(r);
        }
    } else if (kExpand && p.expand_zero_fill) {
        for (int64_t r = first_warp; r < p.expand_rows; r += num_warps)
            if (p.expand_source_row[r] < 0)
                pad(r);
    }
    // Padding rows of a worst-case-sized output (docs/semantics.md); a placed round's caller wrote them.
    if (p.num_worst_tokens > 0 && p.recv_first == nullptr) {
        const int stride = gridDim.x * kNumThreads;
        for (int64_t r = num_recv + blockIdx.x * kNumThreads + threadIdx.x; r < p.num_worst_tokens; r += stride) {
            p.recv_src_idx[r] = -1;
            for (int k = 0; k < kNumTopk; ++k) {
                p.recv_topk_idx[r * kNumTopk + k] = static_cast<TopkT>(-1);
                if (!kExpand && p.recv_topk_weights != nullptr)  // expanded: one a pair, written above
                    p.recv_topk_weights[r * kNumTopk + k] = 0.0f;
                if (kExpandFresh)
                    p.expand_row_of[r * kNumTopk + k] = -1;
            }
            for (int c = 0; kExpandFresh && c < kNumTopk + 2; ++c)
                p.expand_metadata[r * (kNumTopk + 2) + c] = -1;
        }
    }
    phase_clock.end(lane);
}

}  // namespace tokenyard::kernels
