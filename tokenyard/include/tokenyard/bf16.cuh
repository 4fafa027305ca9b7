// Sums of bf16 rows in float32, 8 channels (one 16-byte vector) at a time: every add rounded to float32 in the
// order the caller adds, the sum rounded to bf16 once (docs/semantics.md, "Normal combine").
#pragma once

#include <cuda_bf16.h>

#include "types.cuh"

namespace tokenyard {

// acc[e] += v[e] for the 8 bf16 values held in `v`.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        acc[e] = __fadd_rn(acc[e], __bfloat162float(h[e]));
}

// acc[e] += weight * v[e]: one float32 product, then one float32 sum.
__device__ __forceinline__ void add_weighted_bf16x8(float (&acc)[8], const int4& v, float weight) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, __bfloat162float(h[e])));
}

// The 8 sums rounded to the nearest bf16, as one vector.
__device__ __forceinline__ int4 to_bf16x8(const float (&acc)[8]) {
    int4 out;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        o[e] = __float2bfloat16_rn(acc[e]);
    return out;
}

}  // namespace tokenyard
