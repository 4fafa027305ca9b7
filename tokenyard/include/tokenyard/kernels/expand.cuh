// DeepEP V2's expanded layout on the CUDA backend (docs/semantics.md, "ElasticBuffer";
// tokenyard/semantics/expand.py is the same in PyTorch, the reference backend's and the oracle).
#pragma once

#include <cuda_bf16.h>

#include "../copy.cuh"

namespace tokenyard::kernels {

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
                const int4 v = ptx::ld_nc_v4(p.x + static_cast<int64_t>(rows[k]) * kHiddenInt4 + i);
                const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[e] = __fadd_rn(acc[e], __bfloat162float(h[e]));
            }
            int4 out;
            __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                o[e] = __float2bfloat16_rn(acc[e]);
            ptx::st_na_v4(p.out + j * kHiddenInt4 + i, out);
        }
    }
}

}  // namespace tokenyard::kernels
