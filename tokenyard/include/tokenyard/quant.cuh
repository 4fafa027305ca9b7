// The casts of the low-latency dispatch, exactly as tokenyard/semantics/quant.py: FP8 in 128-channel groups, one
// float32 scale each (optionally rounded up to a power of two); NVFP4 in 16-channel blocks (NOTE [nvfp4]).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "bf16.cuh"
#include "types.cuh"

namespace tokenyard {

// A low-latency dispatch's payload (LowLatencyDispatchRequest.cast): bf16 as given, FP8 or NVFP4.
constexpr int kCastBf16 = 0, kCastFp8 = 1, kCastNvfp4 = 2;

// quant.py's scale rounding: up to a power of two, on the bit pattern.
__device__ __forceinline__ float round_scale_up_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    const uint32_t exponent = ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
    return __uint_as_float(exponent << 23);
}

// The 16 bf16 channels a lane holds, as float32 in `v` (bf16.cuh's unpack_bf16x8); returns their largest magnitude.
__device__ __forceinline__ float unpack_16(const int4 (&raw)[2], float (&v)[16]) {
    float low[8], high[8];
    unpack_bf16x8(raw[0], low);
    unpack_bf16x8(raw[1], high);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = low[i], v[i + 8] = high[i];
        amax = fmaxf(amax, fmaxf(fabsf(low[i]), fabsf(high[i])));
    }
    return amax;
}

// FP8 cast of 16 consecutive channels held by one lane, exactly as quant.py (NOTE [low-latency dispatch]):
// the 8 lanes of one 128-channel group share its amax, so every lane returns the group's scale too.
template <bool kRoundScale>
__device__ __forceinline__ int4 cast_fp8_16(const int4 (&raw)[2], float& scale) {
    float v[16];
    float amax = unpack_16(raw, v);
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

// e2m1 code of v (NOTE [nvfp4]): the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code, saturating;
// the sign of v in bit 3.
__device__ __forceinline__ uint32_t e2m1_code(float v) {
    const float a = fabsf(v);
    const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                          (a > 5.0f);
    return code | ((__float_as_uint(v) >> 31) << 3);
}

// NVFP4 cast of the one 16-channel block a lane holds, exactly as quant.quantize_nvfp4: the block's e4m3 scale
// byte in `scale`, its 16 codes two per byte (even channel low) in the returned 8 bytes. `global_scale` is
// g of NOTE [nvfp4].
__device__ __forceinline__ uint2 cast_nvfp4_16(const int4 (&raw)[2], float global_scale, uint32_t& scale) {
    float v[16];
    const float amax = unpack_16(raw, v);
    const float wanted = fminf(__fdiv_rn(__fmul_rn(amax, global_scale), 6.0f), 448.0f);
    const __nv_fp8_storage_t sf = __nv_cvt_float_to_fp8(wanted, __NV_SATFINITE, __NV_E4M3);
    const float sf_value = __half2float(__half(__nv_cvt_fp8_to_halfraw(sf, __NV_E4M3)));
    const float inv = sf_value > 0.0f ? __fdiv_rn(global_scale, sf_value) : 0.0f;
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i)
        packed[i / 8] |= e2m1_code(__fmul_rn(v[i], inv)) << (4 * (i % 8));
    scale = sf;
    return make_uint2(packed[0], packed[1]);
}

}  // namespace tokenyard
