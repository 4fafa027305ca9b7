// get_dispatch_layout: which ranks and experts each token goes to (docs/semantics.md, "Layout").
#pragma once

#include "../sync.cuh"

namespace tokenyard::kernels {

// Grid-stride over tokens; counts gather in shared memory (num_experts + kNumRanks ints, dynamic) and
// are added to the zeroed outputs once per block. Ids outside [0, num_experts) count nowhere; one outside
// [-1, num_experts) sets kLayoutBadIds in `verdict` for the next fresh dispatch to judge (NOTE [input
// verdict] in tokenyard/checks.py).
template <int kNumRanks, typename TopkT, typename Params>
__device__ __forceinline__ void dispatch_layout(const Params& p) {
    static_assert(kNumRanks <= 32, "a rank mask is one 32-bit word");
    extern __shared__ int counts[];  // [num_experts] then [kNumRanks]
    for (int i = threadIdx.x; i < p.num_experts + kNumRanks; i += blockDim.x)
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
    for (int i = threadIdx.x; i < p.num_experts + kNumRanks; i += blockDim.x) {
        if (counts[i] != 0)
            atomicAdd(i < p.num_experts ? p.num_tokens_per_expert + i : p.num_tokens_per_rank + (i - p.num_experts),
                      counts[i]);
    }
}

}  // namespace tokenyard::kernels
