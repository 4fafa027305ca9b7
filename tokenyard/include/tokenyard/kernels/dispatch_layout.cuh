// get_dispatch_layout: which ranks and experts each token goes to (docs/semantics.md, "Layout").
#pragma once

#include "../ptx.cuh"
#include "../sync.cuh"

namespace tokenyard::kernels {

// NOTE [layout without a fill]: grid-stride over tokens; each block gathers its counts in shared memory
// (num_experts + kNumRanks ints, dynamic) and adds them to the Buffer's `totals`, then takes a number from
// `ticket`; the block that takes the last one copies the totals to the outputs and zeroes them. So the
// outputs need no fill before the launch (a fill is a driver call of its own on the host:
// benchmarks/results/host_cost.md), and `ticket` (which wraps back to 0 as the last block takes its number) and
// `totals` are ready for the next launch. They belong to the Buffer (CudaBackend.layout_scratch), whose calls
// run one at a time on the GPU (NOTE [joined stream] in buffer.py). One block writes its counts straight to
// the outputs.
// Ids outside [0, num_experts) count nowhere; one outside [-1, num_experts) sets kLayoutBadIds in `verdict`
// for the next fresh dispatch to judge (NOTE [input verdict] in tokenyard/checks.py).
template <int kNumRanks, typename TopkT, typename Params>
__device__ __forceinline__ void dispatch_layout(const Params& p) {
    static_assert(kNumRanks <= 32, "a rank mask is one 32-bit word");
    extern __shared__ int counts[];  // [num_experts] then [kNumRanks]
    __shared__ bool takes_totals;
    const int num_counts = p.num_experts + kNumRanks;
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x)
        counts[i] = 0;
    __syncthreads();
    const int num_local_experts = p.num_experts / kNumRanks;
    bool bad = false;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens; t += gridDim.x * blockDim.x) {
        uint32_t mask = 0;
        for (int k = 0; k < p.num_topk; ++k) {
            const int64_t e = static_cast<int64_t>(p.topk_idx[static_cast<int64_t>(t) * p.num_topk + k]);
            if (e >= 0 && e < p.num_experts) {
                atomicAdd(&counts[e], 1);
                mask |= 1u << (e / num_local_experts);
            }
            bad |= e < -1 || e >= p.num_experts;
        }
#pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const bool hit = (mask >> r) & 1u;
            p.is_token_in_rank[static_cast<int64_t>(t) * kNumRanks + r] = hit;
            if (hit)
                atomicAdd(&counts[p.num_experts + r], 1);
        }
    }
    if (bad)
        atomicOr(p.verdict, kLayoutBadIds);
    __syncthreads();
    const auto write = [&](int i, int total) {
        if (i < p.num_experts)
            p.num_tokens_per_expert[i] = total;
        else
            p.num_tokens_per_rank[i - p.num_experts] = total;
    };
    if (gridDim.x == 1) {
        for (int i = threadIdx.x; i < num_counts; i += blockDim.x)
            write(i, counts[i]);
        return;
    }
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
        if (counts[i] != 0)
            atomicAdd(p.totals + i, counts[i]);
    }
    __syncthreads();  // the block's additions before its number (the release below covers them)
    if (threadIdx.x == 0)
        takes_totals = ptx::atomic_inc_acq_rel_gpu(p.ticket, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!takes_totals)
        return;
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
        write(i, ptx::ld_relaxed_gpu(p.totals + i));
        p.totals[i] = 0;
    }
}

}  // namespace tokenyard::kernels
