// Internode normal mode: dispatch and combine over nodes (docs/semantics.md "Internode normal mode"), every byte
// that crosses a node through the transport seam (NOTE [transport seam]).
//
// NOTE [internode kernels]
// N nodes of P ranks; this rank is local rank l of node n. A dispatch row is packed on the host side: the bytes
// the receiver gets (the token's data, scales, top-k ids and weights, source index: `out_row_bytes`), then, for
// the node m it goes to, the row it takes on each rank j of m among the rows this rank sends j (P int32, -1
// where j holds none of its experts). The rows are grouped by destination node, in token order within each.
//   dispatch, one launch:
//   0. a barrier of the group: no rank writes into another's buffers before every rank has finished its
//      previous call, outputs read out included (they are read on the rank's stream after the kernel); block 0
//      of each rank signals every rank once;
//   1. stage 1: this rank's rows for node m go, a chunk per put, to forwarder (m, l), into its slot for node n
//      (`fwd_recv` [N][fwd_capacity][row_bytes]); each block then signals every forwarder once;
//   2. stage 2: as forwarder, once node k's blocks have all signalled, each row from node k is put to the ranks
//      j of this node it goes to, at `dest_first[k][j]` (where rank (k, l)'s rows start on j) plus its row among
//      them; each block then signals every rank of the node once;
//   3. block 0 waits until every forwarder of this node has signalled: when the kernel ends, `recv` holds
//      every row this rank receives, in order of source rank, then token.
//   combine, one launch, the reverse with DeepEP's reduction (a sum per node, one row per node back):
//   0. the barrier; 1. this rank's rows (and weights) into its symmetric `comb_in`, then a signal to every rank
//   of its node; 2. as forwarder, for each row it forwarded at dispatch, the rows its node's ranks return for it
//   (read through their `comb_in`, `send_nvl_head` saying where) summed in float32 in order of local rank and
//   rounded to bf16 once, put to the source rank into its `comb_out` slot for this node at the token's row among
//   those it sent this node (a put per chunk of up to kInternodeChunkRows consecutive rows of a source), then a
//   signal to every source; 3. as source, each token's bias plus its nodes' partial rows in order of node, rounded
//   to bf16.
// Signals only add (NOTE [transport seam]): each kind of launch counts its calls on the GPU (`call_counter`,
// NOTE [normal-mode call numbers] in sync.cuh), and a stage's wait expects call x blocks signals, so every rank
// must launch the same grid (a rank that launches another waits for signals that never come, and times out).
#pragma once

#include "../bf16.cuh"
#include "../copy.cuh"
#include "../transport.cuh"

namespace tokenyard::kernels {

constexpr int kInternodeChunkRows = 4;  // rows per put: the dispatch's stage 1, the combine's partial sums
constexpr int kMaxRanksPerNode = 8;     // a node's ranks: a lane each in the row's positions
// Node m's chunks start at warp m * kNodeStagger of the grid, so that where a node has fewer chunks than the grid
// has warps the nodes' first chunks go to different warps (and SMs), not all to the first ones.
constexpr int kNodeStagger = 7;

// Signal words, per kind of launch: [0, N) arrivals from each node (dispatch: its stage-1 rows; combine: its
// partial rows), [N, N + P) arrivals from each rank of this node, [N + P] the start barrier.
// Block 0 alone signals every rank: a rank's launch has begun only once its previous call's work on its stream is done,
// so one signal per (rank, call) says so (issue 53: R signals a call, not one per block and rank).
__device__ __forceinline__ bool internode_start_barrier(const WaitContext& ctx, uint64_t* signals, int num_nodes,
                                                        int ranks_per_node, uint64_t call) {
    uint64_t* arrivals = signals + num_nodes + ranks_per_node;
    const int num_ranks = num_nodes * ranks_per_node;
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) {
            for (int q = 0; q < num_ranks; ++q)
                transport::signal_add(arrivals, 1, q);
        }
        transport::wait_signal(ctx, arrivals, call * num_ranks, -1, kStageInternodeBarrier);
    }
    __syncthreads();
    return !failed(ctx);
}

// Every thread's puts have landed (NOTE [block quiet]), then thread t < count adds one to `signal` of rank
// first + t * stride.
__device__ __forceinline__ void internode_signal_after_puts(uint64_t* signal, int count, int first, int stride) {
    __syncthreads();
    if (threadIdx.x == 0)
        transport::quiet();
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < count)
        transport::signal_add(signal, 1, first + static_cast<int>(threadIdx.x) * stride);
}

// Thread t < count waits for `signals[t]` to reach `expected` (rank first + t * stride sends it); then the block.
__device__ __forceinline__ bool internode_wait_all(const WaitContext& ctx, const uint64_t* signals, int count,
                                                   uint64_t expected, int first, int stride) {
    const int t = static_cast<int>(threadIdx.x);
    if (t < count)
        transport::wait_signal(ctx, signals + t, expected, first + t * stride, kStageInternodeSignal);
    __syncthreads();  // the waiters' acquires order the block's later reads (NOTE [warp acquire])
    return !failed(ctx);
}

// What both kernels know of their launch: the call's number, this rank's place, the grid's warps, the signal
// words (arrivals from each node, then from each rank of this node).
struct InternodeLaunch {
    WaitContext ctx;
    uint64_t call;
    int num_nodes, per_node, node, local, lane, warp_id, total_warps;
    uint64_t* from_nodes;
    uint64_t* from_locals;
};

template <typename Params>
__device__ __forceinline__ InternodeLaunch internode_launch(const Params& p) {
    uint32_t numbers[1];
    launch_numbers<1>(p.call_counter, numbers);
    const int num_warps = static_cast<int>(blockDim.x) / 32;
    return {{p.error_flag, p.host_record, p.rank, p.timeout_ns}, numbers[0], p.num_nodes, p.ranks_per_node,
            p.rank / p.ranks_per_node, p.rank % p.ranks_per_node, static_cast<int>(threadIdx.x) % 32,
            static_cast<int>(blockIdx.x) * num_warps + static_cast<int>(threadIdx.x) / 32,
            static_cast<int>(gridDim.x) * num_warps, p.signals, p.signals + p.num_nodes};
}

template <typename Params>
__device__ __forceinline__ void internode_dispatch(const Params& p) {
    const auto [ctx, call, num_nodes, per_node, node, local, lane, warp_id, total_warps, from_nodes, from_locals] =
        internode_launch(p);
    if (!internode_start_barrier(ctx, p.signals, num_nodes, per_node, call))
        return;

    // 1. Stage 1: chunks of this rank's rows for each node, spread over every warp of the grid.
    for (int m = 0; m < num_nodes; ++m) {
        const int begin = p.node_row_begin[m], rows = p.node_row_begin[m + 1] - begin;
        const int num_chunks = (rows + kInternodeChunkRows - 1) / kInternodeChunkRows;
        for (int c = (warp_id + m * kNodeStagger) % total_warps; c < num_chunks; c += total_warps) {
            const int first = c * kInternodeChunkRows, count = min(kInternodeChunkRows, rows - first);
            transport::put_warp(p.fwd_recv + (static_cast<int64_t>(node) * p.fwd_capacity + first) * p.row_bytes,
                                p.send_rows + static_cast<int64_t>(begin + first) * p.row_bytes,
                                static_cast<size_t>(count) * p.row_bytes, m * per_node + local);
        }
    }
    internode_signal_after_puts(from_nodes + node, num_nodes, local, per_node);

    // 2. Stage 2: the rows from each node, once all its blocks have signalled, to the ranks of this node.
    for (int k = 0; k < num_nodes; ++k) {
        const int rows = p.fwd_rows[k];
        if (rows == 0)
            continue;
        if (threadIdx.x == 0)
            transport::wait_signal(ctx, from_nodes + k, call * gridDim.x, k * per_node + local,
                                   kStageInternodeSignal);
        __syncthreads();
        if (failed(ctx))
            return;
        for (int row = warp_id; row < rows; row += total_warps) {
            const uint8_t* src = p.fwd_recv + (static_cast<int64_t>(k) * p.fwd_capacity + row) * p.row_bytes;
            const int mine = lane < per_node ? ptx::ld_na_s32(reinterpret_cast<const int*>(src + p.out_row_bytes)
                                                              + lane) : -1;
            for (int j = 0; j < per_node; ++j) {
                const int at = __shfl_sync(0xffffffffu, mine, j);
                if (at >= 0)
                    transport::put_warp(p.recv + static_cast<int64_t>(p.dest_first[k * per_node + j] + at) *
                                        p.out_row_bytes, src, p.out_row_bytes, node * per_node + j);
            }
        }
    }
    internode_signal_after_puts(from_locals + local, per_node, node * per_node, 1);

    // 3. Every forwarder of this node has put this rank's rows.
    if (blockIdx.x == 0)
        internode_wait_all(ctx, from_locals, per_node, call * gridDim.x, node * per_node, 1);
}

// Rows of the combine: kHiddenInt4 vectors of bf16, then the kNumTopk float32 weights, padded to 16 bytes.
template <int kHiddenInt4, int kNumTopk>
struct CombineRow {
    static constexpr int kWeightInt4 = (kNumTopk * 4 + 15) / 16;
    static constexpr int kInt4 = kHiddenInt4 + kWeightInt4;
};

template <int kHiddenInt4, int kNumTopk, typename Params>
__device__ __forceinline__ void internode_combine(const Params& p) {
    using Row = CombineRow<kHiddenInt4, kNumTopk>;
    const auto [ctx, call, num_nodes, per_node, node, local, lane, warp_id, total_warps, from_nodes, from_locals] =
        internode_launch(p);
    constexpr bool weights = kNumTopk > 0;  // not the pointer: a rank that received no rows passes a null one
    if (!internode_start_barrier(ctx, p.signals, num_nodes, per_node, call))
        return;

    // 1. This rank's rows into its comb_in, where the forwarders of its node read them.
    for (int row = warp_id; row < p.num_recv; row += total_warps) {
        int4* dst = p.comb_in + static_cast<int64_t>(row) * Row::kInt4;
        warp_copy<4, false>(dst, p.x + static_cast<int64_t>(row) * kHiddenInt4, kHiddenInt4, lane);
        if (weights && lane < kNumTopk)
            reinterpret_cast<float*>(dst + kHiddenInt4)[lane] = p.topk_weights[static_cast<int64_t>(row) * kNumTopk
                                                                                + lane];
    }
    internode_signal_after_puts(from_locals + local, per_node, node * per_node, 1);

    // 2. As forwarder: each forwarded row's sum over the ranks of this node, to its source.
    if (!internode_wait_all(ctx, from_locals, per_node, call * gridDim.x, node * per_node, 1))
        return;
    // A warp sums a chunk of up to kInternodeChunkRows consecutive rows of one source into comb_stage, then puts them
    // at once: they are consecutive at the source too (issue 53: a work request per chunk, not per row).
    for (int k = 0; k < num_nodes; ++k) {
        const int begin = p.fwd_row_begin[k], rows = p.fwd_row_begin[k + 1] - begin;
        const int num_chunks = (rows + kInternodeChunkRows - 1) / kInternodeChunkRows;
        for (int c = (warp_id + k * kNodeStagger) % total_warps; c < num_chunks; c += total_warps) {
            const int first = begin + c * kInternodeChunkRows;
            const int count = min(kInternodeChunkRows, begin + rows - first);
            for (int row = first; row < first + count; ++row) {
                int4* stage = p.comb_stage + static_cast<int64_t>(row) * Row::kInt4;
                const int mine = lane < per_node ? p.send_nvl_head[static_cast<int64_t>(row) * per_node + lane] : -1;
                int at[kMaxRanksPerNode];  // where each rank of the node holds the row, or -1 (whole warp)
#pragma unroll
                for (int j = 0; j < kMaxRanksPerNode; ++j)
                    at[j] = __shfl_sync(0xffffffffu, mine, j);
                for (int i = lane; i < kHiddenInt4; i += 32) {
                    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                    for (int j = 0; j < kMaxRanksPerNode; ++j)  // at[j] = -1 past the node's ranks
                        if (at[j] >= 0)
                            add_bf16x8(acc, ptx::ld_na_v4(p.peer_comb_in[j] + static_cast<int64_t>(at[j]) * Row::kInt4 +
                                                          i));
                    stage[i] = to_bf16x8(acc);
                }
                if (weights && lane < kNumTopk) {
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < kMaxRanksPerNode; ++j)
                        if (at[j] >= 0)
                            sum = __fadd_rn(sum, ptx::ld_na_f32(reinterpret_cast<const float*>(
                                p.peer_comb_in[j] + static_cast<int64_t>(at[j]) * Row::kInt4 + kHiddenInt4) + lane));
                    reinterpret_cast<float*>(stage + kHiddenInt4)[lane] = sum;
                }
            }
            __syncwarp();
            transport::put_warp(p.comb_out + (static_cast<int64_t>(node) * p.fwd_capacity + first - begin) * Row::kInt4,
                                p.comb_stage + static_cast<int64_t>(first) * Row::kInt4,
                                static_cast<size_t>(count) * Row::kInt4 * sizeof(int4), k * per_node + local);
        }
    }
    internode_signal_after_puts(from_nodes + node, num_nodes, local, per_node);

    // 3. As source: each token's bias and its nodes' rows, in order of node.
    if (!internode_wait_all(ctx, from_nodes, num_nodes, call * gridDim.x, local, per_node))
        return;
    for (int t = warp_id; t < p.num_tokens; t += total_warps) {
        for (int i = lane; i < kHiddenInt4; i += 32) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (p.bias_0 != nullptr)
                add_bf16x8(acc, p.bias_0[static_cast<int64_t>(t) * kHiddenInt4 + i]);
            if (p.bias_1 != nullptr)
                add_bf16x8(acc, p.bias_1[static_cast<int64_t>(t) * kHiddenInt4 + i]);
            for (int m = 0; m < num_nodes; ++m) {
                const int at = p.send_rdma_pos[static_cast<int64_t>(t) * num_nodes + m];
                if (at >= 0)
                    add_bf16x8(acc, ptx::ld_na_v4(p.comb_out + (static_cast<int64_t>(m) * p.fwd_capacity + at) *
                                                  Row::kInt4 + i));
            }
            p.out[static_cast<int64_t>(t) * kHiddenInt4 + i] = to_bf16x8(acc);
        }
        if (weights && lane < kNumTopk) {
            float sum = 0.0f;
            for (int m = 0; m < num_nodes; ++m) {
                const int at = p.send_rdma_pos[static_cast<int64_t>(t) * num_nodes + m];
                if (at >= 0)
                    sum = __fadd_rn(sum, ptx::ld_na_f32(reinterpret_cast<const float*>(p.comb_out + (
                        static_cast<int64_t>(m) * p.fwd_capacity + at) * Row::kInt4 + kHiddenInt4) + lane));
            }
            p.out_weights[static_cast<int64_t>(t) * kNumTopk + lane] = sum;
        }
    }
}

}  // namespace tokenyard::kernels
