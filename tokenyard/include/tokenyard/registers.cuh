// Registers moved between a block's warpgroups (sm_90a's setmaxnreg): the data kernels' sending warps need few, the
// warps that receive or reduce keep more loads in flight with more (NOTE [receiver registers] in
// kernels/dispatch.cuh, NOTE [reducer registers] in kernels/combine.cuh).
#pragma once

#include "ptx.cuh"

namespace tokenyard {

// A block of kNumThreads whose first kGiveWarps warps give registers back and whose others take them, each of those
// threads kTakeRegs (0: none move). A thread starts with its share of the register file (ptxas fixes a kernel with
// setmaxnreg at its launch bound's registers: 128 at 512 threads), so the givers keep what the takers leave:
// kGiveRegs. Each role calls its side where its own code starts, so that ptxas gives the code it reaches that many.
// Elsewhere than sm_90a nothing moves (the takers' code spills, as ptxas says).
template <int kNumThreads, int kGiveWarps, int kTakeRegs>
struct RegisterShift {
    static constexpr int kNumWarps = kNumThreads / kWarpSize;
    static constexpr bool kOn = kTakeRegs > 0;
    static constexpr int kGiveRegs =
        kOn ? (kRegisterFile / kNumThreads * kNumWarps - kTakeRegs * (kNumWarps - kGiveWarps)) / kGiveWarps / 8 * 8 : 0;
    static_assert(!kOn || (kGiveWarps % kWarpGroupSize == 0 && kNumWarps % kWarpGroupSize == 0 &&
                           kTakeRegs % 8 == 0 && kTakeRegs <= 256 && kGiveRegs >= 24),
                  "registers move between whole warpgroups, in steps of 8, 24 to 256 a thread");

    __device__ __forceinline__ static void give() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        if constexpr (kOn)
            ptx::give_back_registers<kGiveRegs>();
#endif
    }

    __device__ __forceinline__ static void take() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        if constexpr (kOn)
            ptx::take_registers<kTakeRegs>();
#endif
    }
};

}  // namespace tokenyard
