// What both low-latency kernels share: the order of destinations and the blocks of each, the pair bits, and
// the message (docs/semantics.md, "Low-latency dispatch/combine").
#pragma once

#include "../copy.cuh"
#include "../layout.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// NOTE [destination order]
// A sending warp takes the ranks in turn from the next one: rank r writes first to r + 1, then r + 2, ...,
// itself last. Were every rank to start with rank 0, all of them would write into rank 0's NVLink ports at
// once while the other ranks' stood idle, then into rank 1's. In turn, every rank is written by one source
// at a time, and the sends end on every rank at about the same time (benchmarks/results/low_latency.md, "decisions").
__device__ __forceinline__ int next_peer(int rank, int num_ranks, int turn) {
    return (rank + 1 + turn) % num_ranks;
}

// NOTE [peer-major blocks]
// With every SM writing, a GPU sends more to its peers when each block writes to one peer only than when
// every block writes to every peer (benchmarks/results/low_latency.md, "decisions"). So the combine's senders
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

}  // namespace tokenyard::kernels
