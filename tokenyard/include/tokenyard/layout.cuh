// Byte layout of the normal-mode buffer, as tokenyard/workspace.py computes it (NOTE [normal-mode
// buffer]). The host passes the sizes; these helpers only turn them into pointers.
#pragma once

#include "types.cuh"

namespace tokenyard {

// NOTE [control block]: words at the start of every rank's buffer (offsets in bytes).
constexpr int64_t kBarrierOffset = 0;        // uint32 [num_ranks]: slot s counts rank s's barrier arrivals
constexpr int64_t kNotifyFlagOffset = 256;   // uint32 [num_ranks]: slot s counts rank s's notify pieces
constexpr int64_t kSignaturesOffset = 1024;  // int32 [4][kMaxRanks][kMaxSignatureInts] (NOTE [call signatures])
constexpr int64_t kNotifyDataOffset = 8192;  // int32 [num_ranks][3 * num_ranks + 2 + num_local_experts] (NOTE [notify])
constexpr int kMaxRanks = 32;
constexpr int kMaxSignatureInts = 8;
static_assert(kSignaturesOffset + 4 * kMaxRanks * kMaxSignatureInts * 4 <= kNotifyDataOffset, "the tables fit");

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
// dispatch also stores its number of sending warps in `pad` (NOTE [sender ranges]).
struct alignas(16) ChunkSlot {
    uint32_t seq;
    int begin;
    int end;
    int pad;
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

}  // namespace tokenyard
