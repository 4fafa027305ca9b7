// combine: return each received row to its source rank and sum the rows of each token there
// (docs/semantics.md, "Normal combine").
#pragma once

#include "../bf16.cuh"
#include "../phases.cuh"
#include "../signatures.cuh"
#include "../staging.cuh"

namespace tokenyard::kernels {

// Every rank adds one to slot `rank` of every rank's barrier counter, then waits until all of its own
// slots reached `expected`. Only block 0 signals, after sending the call's `signature` (combine table
// 2 + expected % 2); every block waits on its own (local) counters and compares every rank's signature
// with its own (NOTE [call signatures] in layout.cuh): -> whether every rank came with the same call.
template <int kNumRanks, int kSignatureInts>
__device__ __forceinline__ bool normal_barrier(const NormalBuffers& buffers, const WaitContext& wait,
                                               uint32_t expected, const int* signature) {
    __shared__ bool ok;
    if (threadIdx.x == 0)
        ok = true;
    const int table = 2 + expected % 2;
    if (blockIdx.x == 0)
        send_signature<kNumRanks, kSignatureInts>(buffers, table, signature);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < kNumRanks)
        ptx::atomic_add_release_sys(buffers.barrier(threadIdx.x) + buffers.rank, 1);
    if (threadIdx.x < kNumRanks &&
        !wait_at_least(wait, buffers.barrier(buffers.rank) + threadIdx.x, expected, threadIdx.x, kStageBarrier))
        ok = false;
    __syncthreads();
    return ok && signatures_agree<kNumRanks, kSignatureInts>(buffers, wait, table, signature, kStageBarrier);
}

// NOTE [combine roles]
// After a barrier (the previous dispatch's receivers must be done reading before rows land in their
// buffers), warps [0, kSendWarps) of every block send (the SM's copy engine) and its other warps reduce (its
// load/store units). The rows from source s are cut into chunks of kChunkRows,
// taken chunk-major over sources (as in NOTE [dispatch roles]); row j goes to row j of this rank's region
// in rank s's buffer (its data by TMA bulk copies through the warp's stages, NOTE [warp stages] in
// staging.cuh), and each finished chunk is published in its slot (NOTE [rolling publish]); each sender warp takes its
// own (chunk, source) items, as dispatch's senders do. The reducing warps: a warp
// takes one token at a time in increasing order; lane q finds the token's row at rank q from send_head,
// waits for the chunk that holds it, and the warp then sums bias_0, bias_1 and the rows of ranks
// 0, 1, ... in float32, as the semantics fix the order. With `local_direct`, the rows this rank returns to
// itself never enter the buffer: the senders skip that source and the reducers read those rows, and their
// weights, from `x` and `topk_weights`.
// In a placed round (NOTE [placed rounds] in tokenyard/rounds.py), `x` and `topk_weights` are the whole call's and
// the round's rows from source s start at row recv_first[s] of them (else rank_prefix_matrix gives it);
// send_head and rank_prefix_matrix are the round's, `combined_x` the round's tokens of the whole output.
//
// NOTE [combine weights]
// A row's top-k weights follow its data in the peer's buffer. Where TMA can move them (kNumTopk * 4 a multiple of 16
// bytes and `topk_weights` 16-byte aligned: DeepSeek-V3's top-8 is one 32-byte run a row), lane 0 loads them into the
// row's last stage behind its data and they go out in the row's bulk store; else the lanes store them, a load's round
// trip a row that holds the warp (and lane 0's next bulk copy) back, and a generic store that the publish's release
// then waits for behind the link's queue: on 4 GPUs at 8 SMs a large share of the senders' time
// (benchmarks/results/normal_tuning.md, "The senders' shapes as TMA writers").
//
// NOTE [rolling publish]
// A chunk is published once its rows' stores are done. Rather than wait for that round trip to the peer at the
// chunk's end, emptying its stages, a sending warp goes on with its next chunk and publishes the finished one once
// kPublishLag more pieces are stored (`drain_older`: it waits for stores issued that many pieces before, not for the
// newest), or before a chunk too short to get there ends, or at its end (`retire`). A chunk's rows reach the
// reducers a few rows later. On one GPU shared by 4 ranks the senders then waited as long in that wait as they had
// in the drain, their time being that GPU's memory throughput; the dispatch's senders publishing so were no faster
// there and drain a piece (benchmarks/results/normal_tuning.md, "Weights in the bulk store, ...").
template <int kNumRanks, int kNumThreads, int kHiddenInt4, int kNumTopk, int kChunkRows, int kSignatureInts,
          int kStages, int kStageBytes, int kSendWarps, int kReduceLoads, typename Params>
__device__ __forceinline__ void combine(const Params& p) {
    static_assert(kSendWarps >= 1 && kSendWarps < kNumThreads / kWarpSize, "every block sends and reduces");
    static_assert(kNumRanks <= kWarpSize, "one lane per rank");
    constexpr int kNumWarps = kNumThreads / kWarpSize;
    constexpr int kWeightsOffset = kHiddenInt4 * 16;
    constexpr int kWeightsBytes = kNumTopk * static_cast<int>(sizeof(float));
    constexpr int kPublishLag = 2 * kStages;  // NOTE [rolling publish]
    const NormalBuffers buffers{p.peer_bases, p.rank, p.control_bytes, p.region_bytes,
                                p.slots_offset, p.max_chunks, p.row_bytes};
    const WaitContext wait{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    PhaseClock phase_clock(p.phases, warp, kNumWarps);  // NOTE [normal-mode phases]
    // The first row from `source` in this round's part of the receive order, and in `x`.
    auto round_first = [&](int source) { return first_row_in_order(p.rank_prefix_matrix, kNumRanks, p.rank, source); };
    auto x_first = [&](int source) {
        return first_row_placed(p.recv_first, p.rank_prefix_matrix, kNumRanks, p.rank, source);
    };
    // NOTE [normal-mode call numbers] in sync.cuh: the slots' sequence number, then the barrier's count.
    static_assert(kCountBarrier == kCountSeq + 1, "read together");
    uint32_t numbers[2];
    launch_numbers<2>(p.call_counts + kCountSeq, numbers);
    const uint32_t seq = numbers[0];
    if (!normal_barrier<kNumRanks, kSignatureInts>(buffers, wait, numbers[1], p.signature))
        return;

    if (warp < kSendWarps) {
        int most_chunks = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            const int rows = p.rank_prefix_matrix[s * kNumRanks + p.rank] - round_first(s);
            most_chunks = max(most_chunks, (rows + kChunkRows - 1) / kChunkRows);
        }
        const int num_send_warps = gridDim.x * kSendWarps;
        extern __shared__ __align__(128) uint8_t shared[];
        WarpStages<kStages, kStageBytes> stages(shared, warp, kSendWarps);
        if (lane == 0)
            stages.init();
        // With local_direct the items cover the other sources only (as the dispatch's receivers do).
        const int num_sources = p.local_direct ? kNumRanks - 1 : kNumRanks;
        // NOTE [combine weights]: a row's weights follow its data through the stages where TMA can move them.
        const bool weights_in_stages = kWeightsBytes > 0 && kWeightsBytes % 16 == 0 &&
                                       reinterpret_cast<uint64_t>(p.topk_weights) % 16 == 0;
        const uint32_t tail_bytes = weights_in_stages ? kWeightsBytes : 0;
        // NOTE [rolling publish]: the chunk stored but not yet published (source -1: none), and its last piece.
        int pending_source = -1, pending_chunk = 0;
        uint32_t pending_last = 0;
        auto publish = [&](int source, int chunk) {  // lane 0, its rows' stores done
            ptx::st_release_sys(&buffers.slot(source, p.rank, chunk)->seq, seq);
        };
        phase_clock.mark(kPhaseStart, lane);
        for (int item = blockIdx.x * kSendWarps + warp; item < most_chunks * num_sources; item += num_send_warps) {
            const int chunk = item / num_sources, other = item % num_sources;
            const int source = p.local_direct && other >= p.rank ? other + 1 : other;
            const int first = x_first(source);
            const int rows = p.rank_prefix_matrix[source * kNumRanks + p.rank] - round_first(source);
            if (chunk * kChunkRows >= rows)
                continue;
            const int j1 = min(rows, (chunk + 1) * kChunkRows);
            bool ahead = false;  // lane 0's: row j loaded ahead with the one before it (NOTE [warp stages])
            for (int j = chunk * kChunkRows; j < j1; ++j) {
                uint8_t* dst = buffers.row(source, p.rank, j);
                const int64_t from = first + j;
                if (lane == 0) {
                    void* to[1] = {dst};
                    if (ahead)
                        stages.send(kHiddenInt4 * 16 + tail_bytes, to);
                    else
                        stages.copy(p.x + from * kHiddenInt4, kHiddenInt4 * 16, to, p.topk_weights + from * kNumTopk,
                                    tail_bytes);
                    ahead = j + 1 < j1 && stages.fits(kHiddenInt4 * 16 + tail_bytes);
                    if (ahead)
                        stages.prefetch(p.x + (from + 1) * kHiddenInt4, kHiddenInt4 * 16,
                                        p.topk_weights + (from + 1) * kNumTopk, tail_bytes);
                }
                phase_clock.mark(kPhaseData, lane);
                if (!weights_in_stages && lane < kNumTopk) {
                    reinterpret_cast<float*>(dst + kWeightsOffset)[lane] = p.topk_weights[from * kNumTopk + lane];
                    phase_clock.mark(kPhaseTail, lane);
                }
                // NOTE [warp acquire] in sync.cuh: the lanes' weights ordered before lane 0's release
                __syncwarp();
                if (lane == 0 && pending_source >= 0 && stages.stored - 1 - pending_last >= kPublishLag) {
                    stages.template drain_older<kPublishLag>();
                    publish(pending_source, pending_chunk);
                    pending_source = -1;
                }
                phase_clock.mark(kPhasePublish, lane);
            }
            if (lane == 0) {
                if (pending_source >= 0) {  // a short chunk came between: the older one's stores may still be out
                    stages.drain();
                    publish(pending_source, pending_chunk);
                }
                pending_source = source;
                pending_chunk = chunk;
                pending_last = stages.stored - 1;
            }
            phase_clock.mark(kPhasePublish, lane);
        }
        if (lane == 0) {
            stages.retire();
            if (pending_source >= 0)
                publish(pending_source, pending_chunk);
        }
        phase_clock.end(lane);
        return;
    }

    // Reducers.
    const int reducer_warp = blockIdx.x * (kNumWarps - kSendWarps) + warp - kSendWarps;
    const int num_reducer_warps = gridDim.x * (kNumWarps - kSendWarps);
    phase_clock.mark(kPhaseStart, lane);
    for (int t = reducer_warp; t < p.num_tokens; t += num_reducer_warps) {
        const int64_t token = t;
        int index = -1;
        bool ready = true;
        if (lane < kNumRanks) {
            const int head = p.send_head[token * kNumRanks + lane];
            if (head >= 0)  // the token's row among this rank's rows at rank `lane`
                index = head - first_row_in_order(p.rank_prefix_matrix, kNumRanks, lane, p.rank);
            if (head >= 0 && !(p.local_direct && lane == p.rank))
                ready = wait_at_least(wait, &buffers.slot(p.rank, lane, index / kChunkRows)->seq, seq, lane,
                                      kStageCombineRecv);
        }
        __syncwarp();  // NOTE [warp acquire] in sync.cuh: each lane's acquire covers every lane's reads of the rows
        if (!__all_sync(0xffffffffu, ready))
            return;
        phase_clock.mark(kPhaseWait, lane);
        int indices[kNumRanks];
        const int4* rows_in[kNumRanks];  // where each rank's row of this token is read
        const int64_t own_row = x_first(p.rank) + __shfl_sync(0xffffffffu, index, p.rank);  // in x, local_direct
#pragma unroll
        for (int q = 0; q < kNumRanks; ++q) {
            indices[q] = __shfl_sync(0xffffffffu, index, q);
            rows_in[q] = indices[q] < 0 ? nullptr
                         : p.local_direct && q == p.rank ? p.x + own_row * kHiddenInt4
                         : reinterpret_cast<const int4*>(buffers.row(p.rank, q, indices[q]));
        }
        // kUnroll vectors per lane, each with its kNumRanks loads issued before any is summed (kReduceLoads
        // loads in flight per lane); the sum of every element still runs bias_0, bias_1, rank 0, rank 1, ... as
        // the semantics fix.
        constexpr int kUnroll = kNumRanks >= kReduceLoads ? 1 : kReduceLoads / kNumRanks;
        const int4* biases[2] = {p.bias_0, p.bias_1};
        for (int base = 0; base < kHiddenInt4; base += kUnroll * kWarpSize) {
            int4 rows[kUnroll][kNumRanks];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kWarpSize + lane;
#pragma unroll
                for (int q = 0; q < kNumRanks; ++q)
                    if (i < kHiddenInt4 && indices[q] >= 0)
                        rows[u][q] = ptx::ld_na_v4(rows_in[q] + i);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kWarpSize + lane;
                if (i >= kHiddenInt4)
                    continue;
                float acc[8];
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[e] = 0.0f;
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    if (biases[b] == nullptr)
                        continue;
                    add_bf16x8(acc, ptx::ld_nc_v4(biases[b] + token * kHiddenInt4 + i));
                }
#pragma unroll
                for (int q = 0; q < kNumRanks; ++q) {
                    if (indices[q] < 0)
                        continue;
                    add_bf16x8(acc, rows[u][q]);
                }
                ptx::st_na_v4(p.combined_x + token * kHiddenInt4 + i, to_bf16x8(acc));
            }
        }
        if (lane < kNumTopk) {
            float acc = 0.0f;
#pragma unroll
            for (int q = 0; q < kNumRanks; ++q) {
                if (indices[q] < 0)
                    continue;
                const float* w = p.local_direct && q == p.rank
                    ? p.topk_weights + own_row * kNumTopk
                    : reinterpret_cast<const float*>(buffers.row(p.rank, q, indices[q]) + kWeightsOffset);
                acc = __fadd_rn(acc, __int_as_float(ptx::ld_na_s32(reinterpret_cast<const int*>(w) + lane)));
            }
            p.combined_topk_weights[token * kNumTopk + lane] = acc;
        }
        phase_clock.mark(kPhaseCopy, lane);
    }
    phase_clock.end(lane);
}

}  // namespace tokenyard::kernels
