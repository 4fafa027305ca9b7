// Low-latency dispatch and combine over NVLink (docs/semantics.md, "Low-latency dispatch/combine").
// No host synchronisation and no data-dependent allocation, so both can be captured in a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../copy.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// The receive stages whose peers block 0 judges under a rank mask (NOTE [one verdict]), and where their
// verdict words sit in the state (workspace.LOW_LATENCY_STATE_BYTES): after the 8 uint32 of counters, epochs
// and tags, [kNumVerdictStages][kWarpSize] uint64 (a low-latency group has at most a warp's ranks).
enum VerdictStage : int { kVerdictCounts = 0, kVerdictData = 1, kVerdictCombine = 2, kNumVerdictStages = 3 };
constexpr int64_t kVerdictsAt = 32;

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
    int64_t dispatch_expert_counts;
    int64_t combine_weights;
    int64_t combine_recv;
    int64_t combine_row_bytes;
    int64_t combine_flags;
    int64_t state;
    uint32_t tag_factor;         // NOTE [call tags]: odd, from the call's signature

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
    // How many of `source`'s tokens chose each of rank `owner`'s local experts, in `owner`'s buffer: [L]
    // words (tag << 32) | count (NOTE [low-latency dispatch]).
    __device__ __forceinline__ uint64_t* expert_counts(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + dispatch_expert_counts) +
               static_cast<int64_t>(source) * num_local_experts;
    }
    // Rank `source`'s top-k weights of the token of its message `slot` to rank `owner`, in `owner`'s buffer:
    // words (tag << 32) | float bits (NOTE [low-latency combine]).
    __device__ __forceinline__ uint64_t* weights(int owner, int source, int slot) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + combine_weights) +
               (static_cast<int64_t>(source) * num_max + slot) * num_topk;
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
    // The tag the latest launch of `kind` in this half signalled with (NOTE [call tags]).
    __device__ __forceinline__ uint32_t* last_tag(int kind) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + state) + 4 + kind;
    }
    __device__ __forceinline__ uint32_t tag(uint32_t epoch) const { return epoch * tag_factor; }
    // Block 0's verdict on `peer` at receive stage `which` of the latest launch: (tag << 32) | came.
    __device__ __forceinline__ uint64_t* verdict(int which, int peer) const {
        return reinterpret_cast<uint64_t*>(peer_bases[rank] + state + kVerdictsAt) + which * kWarpSize + peer;
    }
};

// The kernels' shared parameter list (kernels.py, _LOW_LATENCY_BUFFERS): the struct above, which half does
// what, and the combine's `local_blocks` (NOTE [peer-major blocks]; the dispatch ignores it).
#define TOKENYARD_LOW_LATENCY_BUFFER_PARAMS                                                                        \
    uint8_t *const *peer_bases, int rank, int num_ranks, int num_max, int64_t dispatch_recv, int64_t message_bytes, \
            int64_t header_bytes, int64_t dispatch_positions, int64_t dispatch_counts,                              \
            int64_t dispatch_expert_counts, int64_t combine_weights, int64_t combine_recv, int64_t combine_flags,   \
            int64_t state, uint32_t tag_factor, int do_send, int do_recv, int local_blocks

#define TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, num_topk, hidden)                                              \
    LowLatencyBuffers {                                                                                          \
        peer_bases, rank, num_ranks, (num_experts) / num_ranks, num_max, (num_topk), dispatch_recv, message_bytes, \
                header_bytes, dispatch_positions, dispatch_counts, dispatch_expert_counts, combine_weights,        \
                combine_recv, static_cast<int64_t>(hidden) * 2, combine_flags, state, tag_factor                 \
    }

// NOTE [destination order]
// A sending warp takes the ranks in turn from the next one: rank r writes first to r + 1, then r + 2, ...,
// itself last. Were every rank to start with rank 0, all of them would write into rank 0's NVLink ports at
// once while the other ranks' stood idle, then into rank 1's. In turn, every rank is written by one source
// at a time, and the sends end on every rank at about the same time (benchmarks/results/low_latency_decisions.md).
__device__ __forceinline__ int next_peer(int rank, int num_ranks, int turn) {
    return (rank + 1 + turn) % num_ranks;
}

// NOTE [peer-major blocks]
// With every SM writing, a GPU sends more to its peers when each block writes to one peer only than when
// every block writes to every peer (benchmarks/results/low_latency_decisions.md). So the combine's senders
// split the grid into one group of blocks per destination: the last `local_blocks` blocks write to this
// rank itself (the last turn of NOTE [destination order]), the others to the peers in turn, block b to turn
// b % (R - 1). The host picks `local_blocks` (heuristics.low_latency_local_blocks: local writes need no
// NVLink, so fewer blocks) and sees that every peer gets a block. The dispatch's senders do not: there a
// warp reads and casts its piece once and writes it to every rank its token goes to, and with a group per
// destination (the piece read and cast once per rank) the dispatch was slower.
struct PeerBlocks {
    int turn;   // the destination is next_peer(rank, num_ranks, turn)
    int index;  // this block's place in its group
    int count;  // blocks in the group
};

__device__ __forceinline__ PeerBlocks peer_blocks(int num_ranks, int local_blocks) {
    const int remote = static_cast<int>(gridDim.x) - local_blocks, peers = num_ranks - 1;
    const int b = static_cast<int>(blockIdx.x);
    if (b >= remote)
        return {num_ranks - 1, b - remote, local_blocks};
    return {b % peers, b / peers, (remote - b % peers + peers - 1) / peers};
}

// NOTE [low-latency trace]
// Given a trace array ([gridDim.x][kNumTracePoints] uint64), thread 0 of every block stamps the GPU's global
// timer as the block passes each point below (benchmarks/ll_phases.py reads them); without one (nullptr,
// every call but a traced one) a stamp is a predictable branch.
enum TracePoint : int {
    kTraceStart = 0,      // the block began
    kTracePrologue = 1,   // dispatch: first piece asked for (block 0: books kept); combine: weights sent, items counted
    kTraceSent = 2,       // the block's sends are issued
    kTraceCounted = 3,    // past the done counter
    kTracePublished = 4,  // the last block only: signals stored
    kTraceRecvReady = 5,  // dispatch: rows numbered from the expert counts; combine: pair bits built
    kTraceRecvMid = 6,    // dispatch: every source's data signal seen; combine: every rank's rows signalled
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
// (rank, token): the token goes to that rank). An expert a token names twice sets its bit once, so the
// token takes one slot there and both choices' header slots name it (NOTE [repeated experts] in routing.py):
// the receive writes the row once per choice, the same bytes, and the combine reads it for each choice.
// Whether a pair with expert `e` travels: an expert in range, on an unmasked rank.
__device__ __forceinline__ bool routed(int64_t e, int num_experts, int num_local_experts, const int* rank_mask) {
    return e >= 0 && e < num_experts && (rank_mask == nullptr || rank_mask[e / num_local_experts] == 0);
}

template <int kNumTopk, typename TopkT, bool kByRank>
__device__ __forceinline__ void build_pair_bits(uint32_t* bits, int words, const TopkT* topk_idx, int num_tokens,
                                                int num_experts, int num_local_experts, const int* rank_mask) {
    const int num_rows = kByRank ? num_experts / num_local_experts : num_experts;
    for (int i = threadIdx.x; i < num_rows * words; i += blockDim.x)
        bits[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_tokens * kNumTopk; p += blockDim.x) {
        const int64_t e = static_cast<int64_t>(topk_idx[p]);
        if (!routed(e, num_experts, num_local_experts, rank_mask))
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

// NOTE [call tags]
// A word's tag is not the epoch itself but epoch * tag_factor (mod 2^32), the factor an odd number the host
// derives from the call's shape signature (collectives.signature: hidden, top-k, experts, M and, for the
// dispatch, the FP8 flags). Ranks whose calls differ in shape (and so in where their words land and what
// they hold) never match each other's tags: the waits run out, or mask the rank under enable_shrink, instead
// of reading rows laid out for another shape. Multiplying by an odd factor is a bijection that keeps 0 at
// 0, so a word zeroed by clean_low_latency_buffer matches no epoch from 1 to 2^32 - 1, as with raw epochs.

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
// block stores to every unmasked rank r its signal (tag << 32) | value with release (NOTE
// [cumulative release]), then the launch's epoch for the next launch (NOTE [low-latency epochs]).
// `withhold` (read by the last block, after every block's done): send no signal, so that the peers time out
// rather than read what this launch left unwritten; the epoch still advances.
struct Signal {
    uint64_t* word;
    uint32_t value;
};

template <typename SignalOf, typename Withhold>
__device__ __forceinline__ void publish_when_last(const LowLatencyBuffers& b, int kind, uint32_t epoch,
                                                  const int* rank_mask, uint64_t* trace, SignalOf signal_of,
                                                  Withhold withhold) {
    trace_mark(trace, kTraceSent);
    const bool last = last_block_done(b, kind);
    trace_mark(trace, kTraceCounted);
    if (!last)
        return;
    const bool silent = withhold();
    for (int r = threadIdx.x; r < b.num_ranks && !silent; r += blockDim.x) {
        if (rank_mask != nullptr && rank_mask[r] != 0)
            continue;
        const Signal signal = signal_of(r);
        ptx::st_release_sys(signal.word, (static_cast<uint64_t>(b.tag(epoch)) << 32) | signal.value);
    }
    if (threadIdx.x == 0) {
        ptx::st_relaxed_sys(b.epoch(kind), epoch);
        ptx::st_relaxed_sys(b.last_tag(kind), b.tag(epoch));
    }
    trace_mark(trace, kTracePublished);
}

// NOTE [rank masking]
// With a rank mask (Buffer(enable_shrink=True)), a rank whose signal misses the deadline is marked in the
// mask instead of failing the call: its pairs count as absent in this call, and later calls neither send
// to it nor wait for it (build_pair_bits drops its experts), so the surviving ranks keep serving. Without a
// mask the timeout is recorded and raised as CommTimeoutError.
//
// Every wait for a peer's word goes through wait_tag_or_mask: -> whether it came (its low half in `value`);
// past the deadline the peer is masked, or without a mask the timeout recorded (kAcquire as wait_for_tag).
// wait_or_mask: the same for a signal stored with release whose value is a count: -> the count, or -1.
//
// NOTE [block waits]
// One thread per block polls each signal word, and the block's other threads learn from shared memory.
// When every warp polled the words it needed (thousands of pollers on four words of one L2 sector), the
// combine saw its rows' signals microseconds later than with one poller per block
// (benchmarks/results/low_latency_decisions.md).
template <bool kAcquire>
__device__ __forceinline__ bool wait_tag_or_mask(const WaitContext& wait, const uint64_t* word, uint32_t tag,
                                                 int peer, int stage, int* rank_mask, uint32_t& value) {
    const bool came = wait_for_tag<kAcquire>(wait, word, tag, peer, stage, rank_mask == nullptr, value);
    if (!came && rank_mask != nullptr)
        atomicExch(rank_mask + peer, 1);
    return came;
}

__device__ __forceinline__ int wait_or_mask(const WaitContext& wait, const uint64_t* word, uint32_t tag, int peer,
                                            int stage, int* rank_mask) {
    uint32_t value = 0;
    return wait_tag_or_mask<true>(wait, word, tag, peer, stage, rank_mask, value) ? static_cast<int>(value) : -1;
}

// NOTE [one verdict]
// Under a rank mask, whether a peer's words came in time is decided once per launch and receive stage, by
// block 0: it waits (masking the peer at its deadline) and stores (tag << 32) | came with release in the
// verdict word of (stage, peer); the other blocks wait for that word instead of the peer's and follow it.
// Were each block to decide alone, a word landing at the deadline could be seen by one block and missed by
// another, and the two would number or sum the rows of different sets of ranks. A follower told "came"
// then reads the peer's words: block 0 acquired them before its release, the follower acquires that
// release, so what the peer released is visible to it too. Block 0 gives its verdict within a deadline of
// beginning to wait, which may be later than a follower began; a follower waits two deadlines and
// kVerdictSlackNs, then records a timeout, never a mask. Without a mask every block waits for itself: one
// that misses a word records the timeout, and the call fails as a whole.
constexpr uint64_t kVerdictSlackNs = 10'000'000;

__device__ __forceinline__ void publish_verdict(const LowLatencyBuffers& b, int which, int peer, uint32_t tag,
                                                bool came) {
    ptx::st_release_sys(b.verdict(which, peer), (static_cast<uint64_t>(tag) << 32) | (came ? 1u : 0u));
}

__device__ __forceinline__ bool follow_verdict(const LowLatencyBuffers& b, const WaitContext& wait, int which,
                                               int peer, uint32_t tag, int stage) {
    const WaitContext patient{wait.error_flag, wait.host_record, wait.rank, 2 * wait.timeout_ns + kVerdictSlackNs};
    uint32_t came = 0;
    if (wait_for_tag<true>(patient, b.verdict(which, peer), tag, peer, stage, false, came))
        return came != 0;
    record_error(wait, kErrorTimeout, peer, stage, 0, tag);
    return false;
}

// NOTE [wait costs] (checks.py): DeepEP's wait_recv_cost_stats. Block 0's thread for `peer` adds the SM
// clock cycles from the start of the receive until it saw `peer`'s signal (or gave up on it); every block
// waits alike, so one block's count stands for all of them.
__device__ __forceinline__ void add_wait_cost(int64_t* wait_costs, int peer, int64_t recv_start) {
    if (wait_costs != nullptr && blockIdx.x == 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(wait_costs + peer),
                  static_cast<unsigned long long>(clock64() - recv_start));
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

// The dispatch message's header (workspace.LOW_LATENCY_MESSAGE_HEADER_BYTES): (tag << 32) | source token
// index (uint64) at 0; per top-k choice, as int16, its local expert on the receiving rank (-1 where
// elsewhere) at kHeaderChoices and its pair slot (NOTE [pair slots]: the sender's tokens before it that
// chose that expert) at kHeaderSlots.
constexpr int kHeaderMaxTopk = 16;
constexpr int kHeaderChoices = 16;
constexpr int kHeaderSlots = kHeaderChoices + 2 * kHeaderMaxTopk;

// Lane `lane`'s int16 of the header array at `offset` (a lane per top-k choice), read through L2.
__device__ __forceinline__ int header_int16(const uint8_t* message, int offset, int lane) {
    const int word = ptx::ld_na_s32(reinterpret_cast<const int*>(message + offset) + lane / 2);
    return static_cast<int16_t>(lane % 2 == 0 ? word & 0xffff : (word >> 16) & 0xffff);
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

// 16-byte vectors a lane moves per receive item: an item is a piece of 2048 bytes of a message's data (FP8:
// 2048 channels, 16 scale groups; bf16: 1024 channels).
constexpr int kRecvVectors = 4;
constexpr int kRecvPieceVectors = kRecvVectors * kWarpSize;

// NOTE [low-latency dispatch]
// A token crosses to a rank once, whatever number of its experts live there, and the receiver fans it out
// to its local experts (4 ranks, top-8 of 256: ~3.6 messages per token instead of 8 pair copies).
// Send (do_send): the work items are the pieces of kPieceChannels channels of every token, dealt over
// blocks 1, 2, ... so that consecutive items go to different SMs (item i to warp i / (G - 1) of block
// 1 + i % (G - 1) on a grid of G): one token keeps 14 warps busy at hidden 7168 instead of one warp walking
// its row. A warp loads its piece and its token's top-k choices, quantizes
// the piece once (FP8 per 128 channels, exactly as quant.py: amax floored at 1e-4, scale = amax / 448 with
// an IEEE division, optionally rounded up to a power of two, q = e4m3(clamp(x / scale))), each lane 16
// channels, and stores it with 16-byte stores into the message of every rank d the token goes to: d's
// region of this rank at slot t, the token index. Piece 0 also writes the header: its tag (tag << 32) | t,
// and for each choice on d its local expert. Nothing of that waits for the pair bits, so the data leaves
// sooner than when the slot was the rank's tokens before t going to d (a receiver learns from the tag which
// slots hold this call's messages). Block 0 sends no data: meanwhile it builds the pair bits
// (expert rows), sends each rank d how many of this rank's tokens chose each of d's experts, each count a
// word (tag << 32) | count that needs no fence (a release of their own waited behind the data), and writes,
// a thread per pair, the pair's slot among this rank's rows of its expert into the header. So the counts
// travel while the data is still going out, and the data blocks go from their last store straight to the
// done counter (benchmarks/results/low_latency_decisions.md). The last block to finish publishes to each rank d
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
// the two halves run as two launches. Signals carry the epoch of NOTE [low-latency epochs].
template <int kNumTopk, typename TopkT, bool kUseFp8, bool kUseUe8m0>
__device__ __forceinline__ void low_latency_dispatch(
        const int4* x, const TopkT* topk_idx, int num_tokens, int hidden, int num_experts, int round_scale,
        uint8_t* packed_recv_x, uint32_t* packed_recv_scales, int* packed_recv_count, int* src_info,
        int64_t* layout_range, int* cumulative_stats, int* rank_mask, int64_t* wait_costs,
        TOKENYARD_LOW_LATENCY_BUFFER_PARAMS,
        int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    static_assert(kNumTopk <= kHeaderMaxTopk, "the message header has room for 16 top-k choices");
    trace_mark(trace, kTraceStart);
    const LowLatencyBuffers b = TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, kNumTopk, hidden);
    const int num_local_experts = b.num_local_experts;
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int num_scales = hidden / 128;
    const int data_bytes = kUseFp8 ? hidden : hidden * 2;
    const int num_slots = num_ranks * num_max;
    const uint32_t epoch = launch_epoch(b, 0, do_send), tag = b.tag(epoch);  // NOTE [call tags]

    extern __shared__ uint32_t shared_words[];
    if (do_send) {
        // Block 0's books: the pair bits (expert rows), every unmasked rank's expert counts, each word tagged
        // with the epoch, and every pair's slot in its message's header.
        if (blockIdx.x == 0) {
            uint32_t* bits = shared_words;  // a row per expert (NOTE [pair slots])
            const int words = (num_max + 31) / 32;
            build_pair_bits<kNumTopk, TopkT, false>(bits, words, topk_idx, num_tokens, num_experts,
                                                    num_local_experts, rank_mask);
            for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
                const int d = e / num_local_experts;
                if (rank_mask == nullptr || rank_mask[d] == 0)
                    ptx::st_relaxed_sys(b.expert_counts(d, rank) + e % num_local_experts,
                                        (static_cast<uint64_t>(tag) << 32) | row_count(bits, words, e));
            }
            for (int p = threadIdx.x; p < num_tokens * kNumTopk; p += blockDim.x) {
                const int64_t e = static_cast<int64_t>(topk_idx[p]);
                const int t = p / kNumTopk;
                if (e < -1 || e >= num_experts)  // sent nowhere; this rank raises at its next call
                    record_error(wait, kErrorBadLowLatencyIds, rank, kStageLowLatencyDispatchSend,
                                 static_cast<uint32_t>(e), num_experts);
                if (routed(e, num_experts, num_local_experts, rank_mask))
                    reinterpret_cast<int16_t*>(b.message(static_cast<int>(e / num_local_experts), rank, t) +
                                               kHeaderSlots)[p % kNumTopk] =
                            static_cast<int16_t>(pair_slot(bits, words, static_cast<int>(e), t));
            }
        }
        // The data: blocks 1, 2, ... (block 0 too on a one-block grid).
        const int data_blocks = max(1, static_cast<int>(gridDim.x) - 1);
        const int data_block = static_cast<int>(blockIdx.x) - (gridDim.x > 1 ? 1 : 0);
        const int num_pieces = (hidden + kPieceChannels - 1) / kPieceChannels;
        const int num_items = num_tokens * num_pieces, stride = data_blocks * num_warps;
        // Lane k: the expert of top-k choice k of the item's token, or -1 (none, out of range, masked rank).
        const auto expert_of = [&](int item) -> int64_t {
            if (item >= num_items || lane >= kNumTopk)
                return -1;
            const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(item / num_pieces) * kNumTopk +
                                                            lane]);
            return routed(e, num_experts, num_local_experts, rank_mask) ? e : -1;
        };
        // Loads (the piece and its token's choices) run one item ahead of the stores.
        int item = data_block < 0 ? num_items : warp * data_blocks + data_block;
        int4 raw[2];
        load_piece(raw, x, item, num_items, num_pieces, hidden, lane);
        int64_t next_e = expert_of(item);
        trace_mark(trace, kTracePrologue);
        for (; item < num_items; item += stride) {
            const int t = item / num_pieces, piece = item % num_pieces;
            const int c = piece * kPieceChannels + lane * 16;  // this lane's 16 channels
            float scale = 0.0f;
            int4 q = raw[0];
            if constexpr (kUseFp8)  // every lane: the cast's shuffles need the whole warp
                q = round_scale ? cast_fp8_16<true>(raw, scale) : cast_fp8_16<false>(raw, scale);
            const int4 piece_raw[2] = {raw[0], raw[1]};
            const int64_t e = next_e;
            const uint32_t ranks = __reduce_or_sync(0xffffffffu, e >= 0 ? 1u << (e / num_local_experts) : 0u);
            load_piece(raw, x, item + stride, num_items, num_pieces, hidden, lane);
            next_e = expert_of(item + stride);
            for (int turn = 0; turn < num_ranks; ++turn) {
                const int d = next_peer(rank, num_ranks, turn);
                if (((ranks >> d) & 1u) == 0u)
                    continue;  // the same for the whole warp
                uint8_t* to = b.message(d, rank, t);
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
                if (lane == 0)  // the message is this call's
                    *reinterpret_cast<uint64_t*>(to) = (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(t);
                if (lane < kNumTopk) {  // which of the token's choices live on d, as local experts
                    reinterpret_cast<int16_t*>(to + kHeaderChoices)[lane] =
                            e >= 0 && e / num_local_experts == d ? static_cast<int16_t>(e % num_local_experts) : -1;
                }
            }
        }
        publish_when_last(b, 0, epoch, rank_mask, trace, [&](int d) {  // the message slots: this rank's tokens
            return Signal{b.count(d, rank), static_cast<uint32_t>(num_tokens)};
        }, [] { return false; });  // a bad id's token goes nowhere; the other tokens still arrive
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    // Receive: the rows of every (local expert, source) are numbered from the expert counts, which travel
    // without a fence and come while the data is still in flight; then the data signals.
    const int64_t recv_start = clock64();  // NOTE [wait costs]
    __shared__ int num_messages[kWarpSize], first_item[kWarpSize + 1];
    __shared__ bool present[kWarpSize];  // every count of the source (then also its data) is here
    int* counts = reinterpret_cast<int*>(shared_words);  // [L][R]
    int* begins = counts + num_experts;                   // [L][R]: the first row of (l, s)
    // From the present sources; `record` (block 0, once the data is here): the outputs that say so too.
    const auto number_rows = [&](bool record) {
        for (int l = threadIdx.x; l < num_local_experts; l += blockDim.x) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) {
                const int count = present[s] ? counts[l * num_ranks + s] : 0;
                begins[l * num_ranks + s] = total;
                if (record)
                    layout_range[static_cast<int64_t>(l) * num_ranks + s] =
                            (static_cast<int64_t>(total) << 32) | static_cast<int64_t>(count);
                total += count;
            }
            if (record) {
                packed_recv_count[l] = total;
                if (cumulative_stats != nullptr)
                    cumulative_stats[l] += total;
            }
        }
    };
    // NOTE [one verdict]: without a mask every block decides for itself; with one, block 0 for all of them.
    const bool decides = rank_mask == nullptr || blockIdx.x == 0;
    int* const decider_mask = decides ? rank_mask : nullptr;  // a follower never masks
    const bool judges = rank_mask != nullptr && blockIdx.x == 0;
    __syncthreads();  // the shared words are free (the pair bits)
    if (threadIdx.x < num_ranks) {
        const int s = threadIdx.x;
        present[s] = decides ? rank_mask == nullptr || rank_mask[s] == 0
                             : follow_verdict(b, wait, kVerdictCounts, s, tag, kStageLowLatencyDispatchCounts);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {  // a thread per (source, local expert)
        const int s = i / num_local_experts, l = i % num_local_experts;
        int count = -1;
        if (present[s]) {
            count = wait_or_mask(wait, b.expert_counts(rank, s) + l, tag, s, kStageLowLatencyDispatchCounts,
                                 decider_mask);
        }
        if (count < 0)
            present[s] = false;  // every writer writes false
        counts[l * num_ranks + s] = max(0, count);
    }
    __syncthreads();
    if (judges && threadIdx.x < num_ranks)
        publish_verdict(b, kVerdictCounts, threadIdx.x, tag, present[threadIdx.x]);
    number_rows(false);
    trace_mark(trace, kTraceRecvReady);
    bool lost = false;  // a source whose counts came but whose data did not (masked meanwhile)
    if (threadIdx.x < num_ranks) {
        const int s = threadIdx.x;
        int count = -1;
        const bool sent = present[s] && (decides ? rank_mask == nullptr || ptx::ld_relaxed_sys(rank_mask + s) == 0
                                                 : follow_verdict(b, wait, kVerdictData, s, tag,
                                                                  kStageLowLatencyDispatchRecv));
        if (sent) {
            count = wait_or_mask(wait, b.count(rank, s), tag, s, kStageLowLatencyDispatchRecv, decider_mask);
            add_wait_cost(wait_costs, s, recv_start);
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
        for (int s = 0; s < num_ranks; ++s)
            first_item[s + 1] = first_item[s] + num_messages[s] * num_pieces;
    }
    __syncthreads();
    trace_mark(trace, kTraceRecvMid);

    int s = 0;
    for (int item = warp * gridDim.x + blockIdx.x; item < first_item[num_ranks]; item += gridDim.x * num_warps) {
        while (first_item[s + 1] <= item)  // items only grow, so s never moves back
            ++s;
        const int j = (item - first_item[s]) / num_pieces, piece = (item - first_item[s]) % num_pieces;
        const uint8_t* msg = b.message(rank, s, j);
        const int4* data = reinterpret_cast<const int4*>(msg + header_bytes);
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
        const int* scales = reinterpret_cast<const int*>(msg + header_bytes + hidden);
        // FP8: lane g < 16 has scale group g of the piece; UE8M0: lane w < 4 has word w (groups 4w..4w+3).
        constexpr int kPieceGroups = kRecvPieceVectors / 8;  // 128 channels = 8 vectors of FP8
        int scale_bits[4] = {};
        int group = 0;
        if constexpr (kUseFp8) {
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
        const int row = l >= 0 ? begins[l * num_ranks + s] + slot : -1;
        if (piece == 0 && row >= 0) {  // lane k: where choice k went
            b.positions(s, j)[lane] = l * num_slots + row;
            src_info[static_cast<int64_t>(l) * num_slots + row] = j;  // the message slot is the token index
        }
        for (uint32_t targets = __ballot_sync(0xffffffffu, row >= 0); targets != 0u; targets &= targets - 1u) {
            const int k = __ffs(targets) - 1;
            const int to_l = __shfl_sync(0xffffffffu, l, k), to_row = __shfl_sync(0xffffffffu, row, k);
            const int64_t out = static_cast<int64_t>(to_l) * num_slots + to_row;
            store_batch<kRecvVectors>(reinterpret_cast<int4*>(packed_recv_x + out * data_bytes), v,
                                      piece * kRecvPieceVectors, num_vectors, lane);
            if constexpr (kUseFp8 && kUseUe8m0) {  // four groups' biased exponents per int32 (quant.pack_ue8m0)
                if (lane < kPieceGroups / 4 && group < num_scales) {
                    uint32_t word = 0;
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        word |= ((static_cast<uint32_t>(scale_bits[i]) >> 23) & 0xffu) << (8 * i);
                    packed_recv_scales[(static_cast<int64_t>(to_l) * (num_scales / 4) + group / 4) * num_slots +
                                       to_row] = word;
                }
            } else if constexpr (kUseFp8) {  // column-major, as DeepEP
                if (lane < kPieceGroups && group < num_scales)
                    packed_recv_scales[(static_cast<int64_t>(to_l) * num_scales + group) * num_slots + to_row] =
                            scale_bits[0];
            }
        }
    }
    trace_mark(trace, kTraceEnd);
}

// Columns of one reduce item: kReduceVectors 16-byte vectors per lane, 512 bf16 channels per warp.
constexpr int kReduceVectors = 2;
constexpr int kReduceInt4 = kReduceVectors * kWarpSize;
constexpr int kReduceBatch = 4;  // rows whose loads are in flight together

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
        for (int c = 0; c < kReduceVectors; ++c) {
            const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&batch.v[u][c]);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                acc[c][e] = __fadd_rn(acc[c][e], __fmul_rn(w, __bfloat162float(h[e])));
        }
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
// Send (do_send): the blocks form one group per rank s, the rank whose messages they send back (NOTE
// [peer-major blocks]). (1) The group writes this rank's topk_weights to s, each token's at the slot of
// its dispatch message to s, each weight a word (tag << 32) | float bits: a word that carries its own
// epoch needs no fence and no flag (with a release and a flag per rank, the items began later and the sends
// ended later).
// (2) The items are (message slot j from s in this half's dispatch, piece of kReduceInt4 columns); a slot
// whose header's tag is of another dispatch (the token did not come here) contributes nothing. The
// message's header names the token's choices on this rank, positions(s, j) the packed row each went to
// (the dispatch wrote it) and weights(s, j) their weights, all read an item ahead; the warp asks for the
// item's first rows, then waits for a weight only while its tag is older (the first items' weights are
// still on their way, and loading the rows meanwhile made the combine faster:
// benchmarks/results/low_latency_decisions.md), sums weight * row over those choices in k order (float32, as
// routing.py) and writes bf16 into s's combine region at (this rank, j). (3) The last
// block to finish publishes (tag << 32) | 1 to every source. Reduce (do_recv): one thread per block
// waits for each rank's flag (NOTE [block waits]); the items are (token t, piece); lane d finds whether
// the token went to rank d (NOTE [pair slots], rank rows) and points at d's row t; the warp sums the rows
// in rank order in float32 and writes bf16. The result is routing.low_latency_combine(..., pre_reduce=True)
// bit for bit: within bf16 rounding of one sum.
template <int kNumTopk, typename TopkT>
__device__ __forceinline__ void low_latency_combine(
        const int4* x, const TopkT* topk_idx, const float* topk_weights, int num_tokens, int hidden, int num_experts,
        int4* combined_x, int* rank_mask, int64_t* wait_costs, TOKENYARD_LOW_LATENCY_BUFFER_PARAMS,
        int* error_flag, int* host_record, uint64_t timeout_ns, uint64_t* trace) {
    trace_mark(trace, kTraceStart);
    const LowLatencyBuffers b = TOKENYARD_LOW_LATENCY_BUFFERS(num_experts, kNumTopk, hidden);
    const WaitContext wait{error_flag, host_record, rank, timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    const int hidden_int4 = hidden * 2 / 16;
    const int num_pieces = (hidden_int4 + kReduceInt4 - 1) / kReduceInt4;
    const uint32_t epoch = launch_epoch(b, 1, do_send), tag = b.tag(epoch);  // NOTE [call tags]
    const auto masked = [&](int r) { return rank_mask != nullptr && rank_mask[r] != 0; };
    extern __shared__ uint32_t bits[];  // NOTE [pair slots], a row per rank
    const int words = (num_max + 31) / 32;

    if (do_send) {
        // This block's destination: the rank whose messages it sends back (NOTE [peer-major blocks]).
        const PeerBlocks group = peer_blocks(num_ranks, local_blocks);
        const int s = next_peer(rank, num_ranks, group.turn);
        const uint32_t dispatch_tag = ptx::ld_relaxed_sys(b.last_tag(0));
        // Lane k's part of item `item`: where choice k of message j went on this rank and its weight word, all
        // loaded at once, an item ahead of the sums (a warp waits for memory once per item, for the rows).
        // Items past the last are read too (every slot's words exist) and never used.
        struct Choice {
            uint64_t weight;   // (tag << 32) | float bits once it came
            uint32_t tag;      // the message's: token j of s came here in this half's dispatch if it is its tag
            int local_expert;  // -1: the choice is not on this rank
            int position;      // the packed row it went to
        };
        const auto choice_of = [&](int item) -> Choice {
            Choice choice{0, 0, -1, 0};
            if (item < num_max * num_pieces && lane < kNumTopk) {
                const int j = item / num_pieces;
                const uint8_t* message = b.message(rank, s, j);
                choice.weight = ptx::ld_relaxed_sys(b.weights(rank, s, j) + lane);
                choice.tag = static_cast<uint32_t>(*reinterpret_cast<const uint64_t*>(message) >> 32);
                choice.local_expert = reinterpret_cast<const int16_t*>(message + kHeaderChoices)[lane];
                choice.position = b.positions(s, j)[lane];
            }
            return choice;
        };
        // The first item's words and s's message count are asked for before the weights go out, so that
        // neither waits for the other.
        const int stride = group.count * num_warps;
        int item = warp * group.count + group.index;
        Choice next = choice_of(item);
        const uint64_t count_word = threadIdx.x == 0 ? ptx::ld_relaxed_sys(b.count(rank, s)) : 0;
        // (1) This rank's weights to s, a thread per token over the group, each token's to its message slot
        //     (the token index) if it went to s, each tagged with the epoch: no fence and no flag.
        for (int t = group.index + group.count * static_cast<int>(threadIdx.x); t < num_tokens && !masked(s);
             t += group.count * static_cast<int>(blockDim.x)) {
            float w[kNumTopk];
            bool here = false;
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(t) * kNumTopk + k]);
                here |= e >= 0 && e < num_experts && e / b.num_local_experts == s;
                w[k] = topk_weights[static_cast<int64_t>(t) * kNumTopk + k];
            }
            if (!here)
                continue;
            uint64_t* to = b.weights(s, rank, t);
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k)
                ptx::st_relaxed_sys(to + k, (static_cast<uint64_t>(tag) << 32) | __float_as_uint(w[k]));
        }
        // (2) The items: (message slot j, piece) of s in the dispatch of this half, as many slots as s had
        //     tokens (a source masked during that dispatch left an older epoch there: nothing from it).
        __shared__ int num_items;
        if (threadIdx.x == 0) {
            const bool sent = !masked(s) && static_cast<uint32_t>(count_word >> 32) == dispatch_tag;
            num_items = sent ? static_cast<int>(count_word & 0xffffffffu) * num_pieces : 0;
        }
        __syncthreads();
        trace_mark(trace, kTracePrologue);
        for (; item < num_items; item += stride) {
            const int j = item / num_pieces, piece = item % num_pieces;
            const Choice choice = next;
            next = choice_of(item + stride);
            if (rank_mask != nullptr && ptx::ld_relaxed_sys(rank_mask + s) != 0)
                break;  // masked meanwhile: its rows are absent
            const int4* row = choice.tag == dispatch_tag && choice.local_expert >= 0
                                      ? x + static_cast<int64_t>(choice.position) * hidden_int4
                                      : nullptr;
            uint32_t rows_from = __ballot_sync(0xffffffffu, row != nullptr);
            if (rows_from == 0u)
                continue;  // token j of s did not come here: nothing to send back
            // The first rows are asked for, then a weight not come yet (its tag is an older call's) is waited
            // for: at the first items the weights are still on their way, and the rows come meanwhile.
            RowBatch batch;
            load_rows<false>(batch, rows_from, row, piece * kReduceInt4, hidden_int4, lane);
            uint32_t weight_bits = static_cast<uint32_t>(choice.weight & 0xffffffffu);
            bool lost = false;
            if (row != nullptr && static_cast<uint32_t>(choice.weight >> 32) != tag) {
                lost = !wait_tag_or_mask<false>(wait, b.weights(rank, s, j) + lane, tag, s,
                                                kStageLowLatencyCombineWeights, rank_mask, weight_bits);
            }
            if (__any_sync(0xffffffffu, lost))
                break;  // masked: s gets no signal below; else the timeout recorded withholds every signal
            const float weight = row != nullptr ? __uint_as_float(weight_bits) : 0.0f;
            float acc[kReduceVectors][8] = {};
            accumulate_rows<false>(acc, batch, true, rows_from, row, weight, piece * kReduceInt4, hidden_int4, lane);
            store_bf16(b.combine_row(s, rank, j), acc, piece * kReduceInt4, hidden_int4, lane);
        }
        // Without a mask, a launch that recorded a failure (a lost weight, a receive timeout in another
        // block) left rows unwritten: its peers must time out rather than sum them.
        publish_when_last(b, 1, epoch, rank_mask, trace, [&](int r) { return Signal{b.combine_flag(r, rank), 1u}; },
                          [&] { return rank_mask == nullptr && failed(wait); });
    }
    if (!do_recv) {
        trace_mark(trace, kTraceEnd);
        return;
    }

    const int64_t recv_start = clock64();  // NOTE [wait costs]
    // Without the mask, which the send's waits may change meanwhile: which ranks' rows count is decided below.
    build_pair_bits<kNumTopk, TopkT, true>(bits, words, topk_idx, num_tokens, num_experts, b.num_local_experts,
                                           nullptr);
    trace_mark(trace, kTraceRecvReady);
    // One thread per rank that has rows for this rank waits for them (NOTE [block waits]); a rank masked
    // before or meanwhile is absent. Under a mask block 0 decides for every block (NOTE [one verdict]).
    __shared__ bool rows_here[kWarpSize];
    bool missed = false;  // recorded (no mask): the host raises it, and the block has nothing more to do
    if (threadIdx.x < num_ranks) {
        const int d = threadIdx.x;
        const bool expected = row_count(bits, words, d) > 0;
        bool here = false;
        if (expected && rank_mask != nullptr && blockIdx.x != 0) {
            here = follow_verdict(b, wait, kVerdictCombine, d, tag, kStageLowLatencyCombineRecv);
        } else if (expected) {
            if (!masked(d)) {
                here = wait_or_mask(wait, b.combine_flag(rank, d), tag, d, kStageLowLatencyCombineRecv, rank_mask) >= 0;
                add_wait_cost(wait_costs, d, recv_start);
            }
            if (rank_mask != nullptr)
                publish_verdict(b, kVerdictCombine, d, tag, here);
            missed = !here && rank_mask == nullptr;
        }
        rows_here[d] = here;
    }
    if (__syncthreads_or(missed))
        return;
    trace_mark(trace, kTraceRecvMid);
    for (int item = warp * gridDim.x + blockIdx.x; item < num_tokens * num_pieces; item += gridDim.x * num_warps) {
        const int t = item / num_pieces, piece = item % num_pieces;
        const int4* row = nullptr;
        if (lane < num_ranks && rows_here[lane] && pair_chosen(bits, words, lane, t))
            row = b.combine_row(rank, lane, t);  // the message slot is the token index
        float acc[kReduceVectors][8] = {};
        RowBatch batch;
        accumulate_rows<true>(acc, batch, false, __ballot_sync(0xffffffffu, row != nullptr), row, 1.0f,
                              piece * kReduceInt4, hidden_int4, lane);
        store_bf16(combined_x + static_cast<int64_t>(t) * hidden_int4, acc, piece * kReduceInt4, hidden_int4, lane);
    }
    trace_mark(trace, kTraceEnd);
}

}  // namespace tokenyard::kernels
