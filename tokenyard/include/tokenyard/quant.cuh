// The FP8 cast of the low-latency dispatch, exactly as tokenyard/semantics/quant.py: 128-channel groups, one float32
// scale each (optionally rounded up to a power of two).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "types.cuh"

namespace tokenyard {

// quant.py's scale rounding: up to a power of two, on the bit pattern.
__device__ __forceinline__ float round_scale_up_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    const uint32_t exponent = ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
    return __uint_as_float(exponent << 23);
}

// FP8 cast of 16 consecutive channels held by one lane, exactly as quant.py (NOTE [low-latency dispatch]):
// the 8 lanes of one 128-channel group share its amax, so every lane returns the group's scale too.
template <bool kRoundScale>
__device__ __forceinline__ int4 cast_fp8_16(const int4 (&raw)[2], float& scale) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(raw);
    float v[16], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        v[i] = __bfloat162float(h[i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
    if (kRoundScale)
        scale = round_scale_up_pow2(scale);
    uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float q = fminf(fmaxf(__fdiv_rn(v[i], scale), -448.0f), 448.0f);
        packed[i / 4] |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) << (8 * (i % 4));
    }
    return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                     static_cast<int>(packed[3]));
}

}  // namespace tokenyard
