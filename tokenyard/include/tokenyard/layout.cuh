// Byte layout of the normal-mode buffer and of a half of the low-latency buffer, as tokenyard/plan/workspace.py
// computes them (NOTE [normal-mode buffer]). The host passes the sizes; these helpers only turn them into pointers.
#pragma once

#include "types.cuh"

namespace tokenyard {

// NOTE [control block]: words at the start of every rank's buffer (offsets in bytes).
constexpr int64_t kBarrierOffset = 0;        // uint32 [num_ranks]: slot s counts rank s's barrier arrivals
constexpr int64_t kNotifyFlagOffset = 256;   // uint32 [num_ranks]: slot s counts rank s's notify pieces
constexpr int64_t kSignaturesOffset = 1024;  // int32 [4][kMaxRanks][kMaxSignatureInts] (NOTE [call signatures])
constexpr int64_t kPlaceOffset = 6144;       // PlaceSlot: where this rank takes a dispatch's rows (NOTE [placed rows])
constexpr int64_t kNotifyDataOffset = 8192;  // int32 [num_ranks][3 * num_ranks + 2 + num_local_experts] (NOTE [notify])
constexpr int kMaxRanks = 32;
constexpr int kMaxSignatureInts = 9;
static_assert(kSignaturesOffset + 4 * kMaxRanks * kMaxSignatureInts * 4 <= kPlaceOffset, "the tables fit");

// NOTE [placed rows] (kernels/dispatch.cuh): where a rank's recv_x of the current dispatch lies in its output arena,
// which its data kernel writes at its start for the peers' senders: `offset` (bytes from the arena's base; -1: this
// call's rows go through the buffer), the rows recv_x holds, and the output row of the first row from each source;
// `seq` (the launch's number, stored last with release) says which call they are for.
struct alignas(16) PlaceSlot {
    uint32_t seq;
    int rows;
    int64_t offset;
    int first[kMaxRanks];
};
static_assert(kPlaceOffset + static_cast<int64_t>(sizeof(PlaceSlot)) <= kNotifyDataOffset, "the place slot fits");

// NOTE [call signatures]
// Ranks that disagree on a call's shape would read each other's rows at the wrong offsets, so each normal-mode
// call's first exchange carries its shape signature (collectives.signature: the operation, then the fields
// of CALL_FIELDS, as the reference backend's header without the call number): the notify kernel of a
// dispatch, the barrier of a combine. Each sends it to row `rank` of a table in every rank's buffer before
// the release that signals its arrival, and compares every row with its own once every rank has arrived.
// Where a row differs, every rank finds one (if two rows differ, every row differs from one of them): it
// copies the table to the host record, records kErrorCallMismatch and moves no data, so every rank raises
// RankMismatchError alike, naming the ranks by the call each made. Tables: dispatch and combine, each two
// used by alternate calls of its kind, so a rank one call ahead cannot overwrite a row a slower rank has
// yet to read (it can only be ahead by one: each call waits for every rank's arrival at it).
// The signature's ints come from the host (one owner: collectives.SIGNATURE_INTS, a template argument).

// A chunk slot: the sender's sequence number (stored last, with release) and the row range it filled; a
// dispatch's also holds its launch's number of sending warps, which the receivers check (NOTE [sender
// ranges]). A combine leaves `send_warps` unused.
struct alignas(16) ChunkSlot {
    uint32_t seq;
    int begin;
    int end;
    int send_warps;
};

// One rank's view of the normal-mode buffers of every rank of the group (offsets from workspace.py).
struct NormalBuffers {
    uint8_t* const* peer_bases;  // [num_ranks] base of each rank's buffer, mapped into this process
    int rank;
    int64_t control_bytes;       // the control block before the regions
    int64_t region_bytes;        // one source rank's rows
    int64_t slots_offset;        // [num_ranks][max_chunks] chunk slots, at fixed addresses
    int max_chunks;
    int64_t row_bytes;           // one row (dispatch or combine; set per call)

    __device__ __forceinline__ uint32_t* barrier(int owner) const {
        return reinterpret_cast<uint32_t*>(peer_bases[owner] + kBarrierOffset);
    }
    __device__ __forceinline__ uint32_t* notify_flag(int owner) const {
        return reinterpret_cast<uint32_t*>(peer_bases[owner] + kNotifyFlagOffset);
    }
    __device__ __forceinline__ int* notify_data(int owner) const {
        return reinterpret_cast<int*>(peer_bases[owner] + kNotifyDataOffset);
    }
    __device__ __forceinline__ PlaceSlot* place(int owner) const {
        return reinterpret_cast<PlaceSlot*>(peer_bases[owner] + kPlaceOffset);
    }
    // Table `table` of call signatures in the buffer of `owner`: a row of kMaxSignatureInts per source rank.
    __device__ __forceinline__ int* signatures(int owner, int table) const {
        return reinterpret_cast<int*>(peer_bases[owner] + kSignaturesOffset) + table * kMaxRanks * kMaxSignatureInts;
    }
    // Chunk slot `chunk` of `source` inside the buffer of `owner`.
    __device__ __forceinline__ ChunkSlot* slot(int owner, int source, int chunk) const {
        return reinterpret_cast<ChunkSlot*>(peer_bases[owner] + slots_offset) + source * max_chunks + chunk;
    }
    // Row `index` of the region of `source` inside the buffer of `owner`.
    __device__ __forceinline__ uint8_t* row(int owner, int source, int index) const {
        return peer_bases[owner] + control_bytes + source * region_bytes + static_cast<int64_t>(index) * row_bytes;
    }
};

// Where the rows that `source` sends to `owner` begin in `owner`'s receive order of one call or round:
// after the rows of the sources before it (rank_prefix_matrix [source][owner] counts them, inclusive).
__device__ __forceinline__ int first_row_in_order(const int* rank_prefix_matrix, int num_ranks, int owner,
                                                  int source) {
    return source > 0 ? rank_prefix_matrix[(source - 1) * num_ranks + owner] : 0;
}

// The same in this rank's outputs: where the host placed the round (NOTE [placed rounds]), else as above.
__device__ __forceinline__ int first_row_placed(const int* recv_first, const int* rank_prefix_matrix, int num_ranks,
                                                int rank, int source) {
    return recv_first != nullptr ? recv_first[source]
                                 : first_row_in_order(rank_prefix_matrix, num_ranks, rank, source);
}

// ---- Low-latency mode ----

// The receive stages whose peers block 0 judges under a rank mask (NOTE [one verdict]), and where their
// verdict words sit in the state (workspace.LOW_LATENCY_STATE_BYTES): after the 8 uint32 of counters, epochs
// and tags, [kNumVerdictStages][kWarpSize] uint64 (a low-latency group has at most a warp's ranks).
enum VerdictStage : int { kVerdictCounts = 0, kVerdictData = 1, kVerdictCombine = 2, kNumVerdictStages = 3 };
constexpr int64_t kVerdictsAt = 32;
// Then [kWarpSize] uint32: per destination rank, the combine's sending blocks done with it (NOTE [group release] in
// kernels/low_latency_combine.cuh).
constexpr int64_t kGroupCountersAt = 800;
static_assert(kGroupCountersAt == kVerdictsAt + kNumVerdictStages * kWarpSize * 8, "the counters follow the verdicts");

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
    // NOTE [internode low-latency]: bit r set where rank r is on another node; peer_bases[r] is then this rank's
    // own half, whose addresses are the symmetric ones that a put to r names.
    uint32_t remote;
    int64_t staged_messages;
    int64_t staged_rows;
    int64_t arrivals;
    int64_t combine_deferred;
    int64_t weights_flags;
    int64_t staged_weights;

    // The view a low-latency kernel's parameters describe (kernels.py, _LOW_LATENCY_BUFFERS).
    template <typename Params>
    static __device__ __forceinline__ LowLatencyBuffers of(const Params& p, int num_topk) {
        return {p.peer_bases, p.rank, p.num_ranks, p.num_experts / p.num_ranks, p.num_max, num_topk,
                p.dispatch_recv, p.message_bytes, p.header_bytes, p.dispatch_positions, p.dispatch_counts,
                p.dispatch_expert_counts, p.combine_weights, p.combine_recv, static_cast<int64_t>(p.hidden) * 2,
                p.combine_flags, p.state, p.tag_factor, p.remote_ranks, p.staged_messages, p.staged_rows,
                p.arrivals, p.combine_deferred, p.weights_flags, p.staged_weights};
    }

    __device__ __forceinline__ bool is_remote(int r) const { return (remote >> r) & 1u; }
    // This rank's message to rank `dest` (another node's) for its token `slot`, assembled here before the put.
    __device__ __forceinline__ uint8_t* staged_message(int dest, int slot) const {
        return peer_bases[rank] + staged_messages + (static_cast<int64_t>(dest) * num_max + slot) * message_bytes;
    }
    // This rank's partial sum for message `slot` of rank `owner` (another node's), assembled here before the put.
    __device__ __forceinline__ int4* staged_row(int owner, int slot) const {
        return reinterpret_cast<int4*>(peer_bases[rank] + staged_rows +
                                       (static_cast<int64_t>(owner) * num_max + slot) * combine_row_bytes);
    }
    // The pieces of staged row (owner, slot) written so far, or with owner == num_ranks of staged messages `slot`.
    __device__ __forceinline__ uint64_t* arrival(int owner, int slot) const {
        return reinterpret_cast<uint64_t*>(peer_bases[rank] + arrivals) + static_cast<int64_t>(owner) * num_max + slot;
    }

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
    // NOTE [deferred rows] (kernels/low_latency_combine.cuh), this rank's own words: the tag of the latest combine
    // whose sending launch left rows for rank `owner` to its receiving launch, then one word per item (message
    // slot j, piece) of `owner`'s: the tag while that item is left.
    __device__ __forceinline__ uint32_t* deferred_peer(int owner) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + combine_deferred) + owner;
    }
    __device__ __forceinline__ uint32_t* deferred_item(int owner, int item, int num_pieces) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + combine_deferred) + num_ranks +
               static_cast<int64_t>(owner) * num_max * num_pieces + item;
    }
    // Whether rank `source`'s weights (it being of another node) came, in `owner`'s buffer: (tag << 32) | 1, set by
    // the put that carries them (NOTE [internode low-latency]).
    __device__ __forceinline__ uint64_t* weights_flag(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + weights_flags) + source;
    }
    // This rank's weights words for rank `dest` (of another node), token `slot` first, as weights() lays them out.
    __device__ __forceinline__ uint64_t* staged_weights_for(int dest, int slot) const {
        return reinterpret_cast<uint64_t*>(peer_bases[rank] + staged_weights) +
               (static_cast<int64_t>(dest) * num_max + slot) * num_topk;
    }
    __device__ __forceinline__ uint64_t* combine_flag(int owner, int source) const {
        return reinterpret_cast<uint64_t*>(peer_bases[owner] + combine_flags) + source;
    }
    __device__ __forceinline__ uint32_t* done_counter(int kind) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + state) + kind;
    }
    // The combine's sending blocks done with rank `dest` in this launch (NOTE [group release]).
    __device__ __forceinline__ uint32_t* group_counter(int dest) const {
        return reinterpret_cast<uint32_t*>(peer_bases[rank] + state + kGroupCountersAt) + dest;
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

}  // namespace tokenyard
