// DeepEP V2's expanded layout on the CUDA backend (docs/semantics.md, "ElasticBuffer";
// tokenyard/semantics/expand.py is the same in PyTorch, the reference backend's and the oracle).
#pragma once

#include "../bf16.cuh"
#include "../copy.cuh"

namespace tokenyard::kernels {

// The expanded layout of one dispatch, in two launches (tokenyard/semantics/expand.py says what it is).
// expand_count, a thread per received row: each local expert's pairs (counts, zeroed by the caller), the
// row's source metadata (its global token index and first local slot; the expanded columns -1), and -1 in
// every row_of entry. expand_place, a block per local expert e: its group starts at the sum of the aligned
// counts before it; the block scans every pair in (row, slot) order, a warp ballot and the warps' running
// totals numbering e's pairs, and writes each one's expanded row to row_of and the metadata, and its
// received row to source_row (-1 elsewhere, filled by the caller); ends[e] is where the pairs end.
template <int kNumTopk, typename TopkT, typename Params>
__device__ __forceinline__ void expand_count(const Params& p) {
    extern __shared__ int block_counts[];  // [num_local]
    for (int i = threadIdx.x; i < p.num_local; i += blockDim.x)
        block_counts[i] = 0;
    __syncthreads();
    constexpr int kStride = kNumTopk + 2;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < p.num_rows;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        int source = 0;
        for (int r = 0; r < p.num_ranks; ++r)
            source += p.psum_per_rank[static_cast<int64_t>(r) * p.psum_stride] <= j;
        const int token = p.recv_src_idx[j];
        int first = kNumTopk;
#pragma unroll
        for (int k = kNumTopk - 1; k >= 0; --k) {
            const int64_t e = static_cast<int64_t>(p.recv_topk_idx[j * kNumTopk + k]);
            if (e >= 0) {
                atomicAdd(&block_counts[e], 1);
                first = k;
            }
            p.row_of[j * kNumTopk + k] = -1;
            p.metadata[j * kStride + 2 + k] = -1;
        }
        p.metadata[j * kStride] = token >= 0 ? source * p.num_max + token : -1;
        p.metadata[j * kStride + 1] = token >= 0 && first < kNumTopk ? source * kNumTopk + first : -1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.num_local; i += blockDim.x) {
        if (block_counts[i] != 0)
            atomicAdd(p.counts + i, block_counts[i]);
    }
}

template <int kNumTopk, typename TopkT, typename Params>
__device__ __forceinline__ void expand_place(const Params& p) {
    __shared__ int warp_totals[32];
    __shared__ int base;
    const int e = blockIdx.x, lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int warps = blockDim.x / kWarpSize;
    if (threadIdx.x == 0) {
        int start = 0;
        for (int i = 0; i < e; ++i)
            start += (p.counts[i] + p.alignment - 1) / p.alignment * p.alignment;
        base = start;
        p.ends[e] = start + p.counts[e];
    }
    __syncthreads();
    constexpr int kStride = kNumTopk + 2;
    const int64_t num_pairs = static_cast<int64_t>(p.num_rows) * kNumTopk;
    for (int64_t chunk = 0; chunk < num_pairs; chunk += blockDim.x) {
        const int64_t f = chunk + threadIdx.x;
        const bool mine = f < num_pairs && static_cast<int64_t>(p.recv_topk_idx[f]) == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0)
            warp_totals[warp] = __popc(ballot);
        __syncthreads();
        int before = base;
        for (int w = 0; w < warp; ++w)
            before += warp_totals[w];
        if (mine) {
            const int row = before + __popc(ballot & ((1u << lane) - 1u));
            const int64_t j = f / kNumTopk;
            p.row_of[f] = row;
            p.metadata[j * kStride + 2 + f % kNumTopk] = row;
            p.source_row[row] = static_cast<int>(j);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < warps; ++w)
                base += warp_totals[w];
        }
        __syncthreads();
    }
}

// expand_psum, in place of expand_place where the dispatch is not expanded: psum[e], the sum of the aligned
// counts of local experts 0..e (the handle's psum_num_recv_tokens_per_expert). One block: each thread sums a run
// of experts, thread 0 turns the runs' totals into their starts, then each thread writes its run's sums.
template <typename Params>
__device__ __forceinline__ void expand_psum(const Params& p) {
    __shared__ int run_starts[1024];  // a thread's each (blockDim.x <= 1024)
    const int per_thread = (p.num_local + blockDim.x - 1) / blockDim.x;
    const int first = threadIdx.x * per_thread, end = min(first + per_thread, p.num_local);
    const auto aligned = [&](int e) { return (p.counts[e] + p.alignment - 1) / p.alignment * p.alignment; };
    int total = 0;
    for (int e = first; e < end; ++e)
        total += aligned(e);
    run_starts[threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        int start = 0;
        for (int t = 0; t < blockDim.x; ++t) {
            const int run = run_starts[t];
            run_starts[t] = start;
            start += run;
        }
    }
    __syncthreads();
    int sum = run_starts[threadIdx.x];
    for (int e = first; e < end; ++e) {
        sum += aligned(e);
        p.psum[e] = sum;
    }
}

// source_ranks (tokenyard/semantics/expand.py): slot k's rank among this rank's tokens whose top-k names the same
// expert, in token order (-1 where it names none), a thread per token. Each block counts each expert's pairs in the
// tokens before its own (shared-memory atomics: a count's order does not matter), each warp its own tokens' pairs;
// a thread per expert turns the warps' counts into where each warp's pairs of the expert begin; then a warp's lanes
// take turns in token order, each numbering its slots' pairs from the warp's running counts (a token names an expert
// once, so a lane's slots never share one). Dynamic shared memory: (warps + 1) * num_experts ints.
template <int kNumTopk, typename TopkT, typename Params>
__device__ __forceinline__ void source_ranks(const Params& p) {
    extern __shared__ int expert_counts[];  // [num_experts]: before the block's tokens; then [warps][num_experts]
    const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    int* before = expert_counts;
    int* running = expert_counts + p.num_experts + warp * p.num_experts;  // this warp's
    for (int i = threadIdx.x; i < (warps + 1) * p.num_experts; i += blockDim.x)
        expert_counts[i] = 0;
    __syncthreads();
    const auto expert = [&](int64_t f) {  // pair f's expert, -1 where it names none
        const int64_t e = static_cast<int64_t>(p.topk_idx[f]);
        return e >= 0 && e < p.num_experts ? static_cast<int>(e) : -1;
    };
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x, t = first + threadIdx.x;
    for (int64_t f = threadIdx.x; f < first * kNumTopk; f += blockDim.x) {
        const int e = expert(f);
        if (e >= 0)
            atomicAdd(&before[e], 1);
    }
    int experts[kNumTopk];
#pragma unroll
    for (int k = 0; k < kNumTopk; ++k) {
        experts[k] = t < p.num_tokens ? expert(t * kNumTopk + k) : -1;
        if (experts[k] >= 0)
            atomicAdd(&running[experts[k]], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
        int start = before[e];
        for (int w = 0; w < warps; ++w) {
            int* count = expert_counts + p.num_experts + w * p.num_experts + e;
            const int pairs = *count;
            *count = start;
            start += pairs;
        }
    }
    __syncthreads();
    for (int turn = 0; turn < kWarpSize; ++turn) {
        if (lane == turn && t < p.num_tokens) {
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k)
                p.ranks[t * kNumTopk + k] = experts[k] >= 0 ? running[experts[k]]++ : -1;
        }
        __syncwarp();
    }
}

// A combine's weights where the dispatch is not expanded (every slot's weight arrived): a pair's weight where its
// expert is local, 0 elsewhere, so that each token's slot comes back from the one rank that owns its expert. A
// thread per pair.
template <typename TopkT, typename Params>
__device__ __forceinline__ void local_weights(const Params& p) {
    for (int64_t f = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < p.num_pairs;
         f += static_cast<int64_t>(gridDim.x) * blockDim.x)
        p.out[f] = static_cast<int64_t>(p.recv_topk_idx[f]) >= 0 ? p.weights[f] : 0.0f;
}

// Pair weights between the received layout ([N, K], pair f = j * K + k) and the expanded one ([M]), a thread
// per pair: to_expanded, the pair's weight goes to its expanded row row_of[f] (the caller zeroes or leaves the
// padding rows); else the pair's weight comes from its expanded row, 0 where the pair has no local expert.
template <typename Params>
__device__ __forceinline__ void move_weights(const Params& p) {
    for (int64_t f = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < p.num_pairs;
         f += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int row = p.row_of[f];
        if (p.to_expanded) {
            if (row >= 0)
                p.expanded[row] = p.pairs[f];
        } else {
            p.pairs[f] = row >= 0 ? p.expanded[row] : 0.0f;
        }
    }
}

// Expanded row m holds received row source_row[m], or is padding (-1): a warp per row copies its
// kRowInt4 16-byte vectors, or writes zeros where zero_fill (padding is left as it is otherwise).
template <int kRowInt4, typename Params>
__device__ __forceinline__ void expand_rows(const Params& p) {
    constexpr int kBatch = 4;
    const int lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
    for (int64_t m = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / kWarpSize; m < p.num_expanded;
         m += static_cast<int64_t>(gridDim.x) * warps) {
        const int source = p.source_row[m];
        int4* dst = p.out + m * kRowInt4;
        if (source >= 0) {
            warp_copy<kBatch, false>(dst, p.rows + static_cast<int64_t>(source) * kRowInt4, kRowInt4, lane);
        } else if (p.zero_fill) {
            for (int i = lane; i < kRowInt4; i += kWarpSize)
                ptx::st_na_v4(dst + i, make_int4(0, 0, 0, 0));
        }
    }
}

// A combine's per-token sums: received row j is the bf16 rounding of the float32 sum, in slot order, of
// the expanded rows row_of[j][k] >= 0 (zeros where there is none). A warp per row, 8 bf16 a lane at a time.
template <int kHiddenInt4, int kNumTopk, typename Params>
__device__ __forceinline__ void reduce_expanded(const Params& p) {
    const int lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / kWarpSize; j < p.num_rows;
         j += static_cast<int64_t>(gridDim.x) * warps) {
        int rows[kNumTopk];
#pragma unroll
        for (int k = 0; k < kNumTopk; ++k)
            rows[k] = p.row_of[j * kNumTopk + k];
        for (int i = lane; i < kHiddenInt4; i += kWarpSize) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                if (rows[k] < 0)
                    continue;
                add_bf16x8(acc, ptx::ld_nc_v4(p.x + static_cast<int64_t>(rows[k]) * kHiddenInt4 + i));
            }
            ptx::st_na_v4(p.out + j * kHiddenInt4 + i, to_bf16x8(acc));
        }
    }
}

}  // namespace tokenyard::kernels
