// get_dispatch_layout: which ranks and experts each token goes to (docs/semantics.md, "Layout").
#pragma once

#include "../sync.cuh"

namespace tokenyard::kernels {

// Grid-stride over tokens; counts gather in shared memory (num_experts + kNumRanks ints, dynamic) and
// are added to the zeroed outputs once per block. Ids outside [0, num_experts) count nowhere; one outside
// [-1, num_experts) sets kLayoutBadIds in `verdict` for the next fresh dispatch to judge (NOTE [input
// verdict] in tokenyard/checks.py).
template <int kNumRanks, typename TopkT>
__device__ __forceinline__ void dispatch_layout(const TopkT* topk_idx, int num_tokens, int num_topk, int num_experts,
                                                int* num_tokens_per_rank, int* num_tokens_per_expert,
                                                bool* is_token_in_rank, int* verdict) {
    static_assert(kNumRanks <= 32, "a rank mask is one 32-bit word");
    extern __shared__ int counts[];  // [num_experts] then [kNumRanks]
    for (int i = threadIdx.x; i < num_experts + kNumRanks; i += blockDim.x)
        counts[i] = 0;
    __syncthreads();
    const int num_local_experts = num_experts / kNumRanks;
    bool bad = false;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        uint32_t mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = static_cast<int64_t>(topk_idx[static_cast<int64_t>(t) * num_topk + k]);
            if (e >= 0 && e < num_experts) {
                atomicAdd(&counts[e], 1);
                mask |= 1u << (e / num_local_experts);
            }
            bad |= e < -1 || e >= num_experts;
        }
#pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const bool hit = (mask >> r) & 1u;
            is_token_in_rank[static_cast<int64_t>(t) * kNumRanks + r] = hit;
            if (hit)
                atomicAdd(&counts[num_experts + r], 1);
        }
    }
    if (bad)
        atomicOr(verdict, kLayoutBadIds);
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts + kNumRanks; i += blockDim.x) {
        if (counts[i] != 0)
            atomicAdd(i < num_experts ? num_tokens_per_expert + i : num_tokens_per_rank + (i - num_experts), counts[i]);
    }
}

}  // namespace tokenyard::kernels
