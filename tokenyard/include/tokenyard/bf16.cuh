// Sums of bf16 rows in float32, 8 channels (one 16-byte vector) at a time: every add rounded to float32 in the
// order the caller adds, the sum rounded to bf16 once (docs/semantics.md, "Normal combine").
#pragma once

#include <cuda_bf16.h>

#include "types.cuh"

namespace tokenyard {

// The 8 bf16 values of `v` as float32 (exact: a bf16 is the high half of a float32), taken from its four 32-bit
// words. Reading its bytes through its address instead let the compiler split a shared-memory vector load into 8
// 2-byte loads, each 4-way bank-conflicted (benchmarks/results/elastic.md, "The expanded combine's sums staged by
// TMA").
__device__ __forceinline__ void unpack_bf16x8(const int4 v, float (&f)[8]) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                               static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// acc[e] += v[e] for the 8 bf16 values held in `v`.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4 v) {
    float f[8];
    unpack_bf16x8(v, f);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        acc[e] = __fadd_rn(acc[e], f[e]);
}

// acc[e] += weight * v[e]: one float32 product, then one float32 sum.
__device__ __forceinline__ void add_weighted_bf16x8(float (&acc)[8], const int4 v, float weight) {
    float f[8];
    unpack_bf16x8(v, f);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, f[e]));
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
