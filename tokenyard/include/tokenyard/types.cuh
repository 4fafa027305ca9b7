// Fixed-width integer types under nvcc and NVRTC (which has no C++ standard library headers).
#pragma once

#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif

namespace tokenyard {

constexpr int kWarpSize = 32;

}  // namespace tokenyard
