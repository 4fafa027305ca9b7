// Where the warps of a normal-mode data kernel spend their time: a diagnostic, never on in production.
#pragma once

#include "ptx.cuh"

namespace tokenyard {

// NOTE [normal-mode phases]
// Given `phases` (not nullptr: benchmarks/normal_phases.py), lane 0 of each warp of a normal-mode dispatch or combine
// adds the SM cycles (clock64) since its previous mark to the slot of the phase that just ended, in
// phases[block][warp][kNumPhaseSlots]; at its end it stores its span in GPU-timer nanoseconds and in cycles, whose
// ratio turns the cycles into time. Off (nullptr), a mark is one branch. Marks only split a warp's time, so the
// slots of a warp add up to its span.
enum NormalPhase : int {
    kPhaseStart = 0,    // the launch to the warp's own work: call numbers, barrier, stages set up
    kPhaseMeta = 1,     // sender: the token's scales, top-k and routing loaded
    kPhaseData = 2,     // sender: lane 0's stores of the row issued (the row loaded first where it was not ahead)
    kPhaseOwnRow = 3,   // sender: the own rank's row copied out of the stages
    kPhaseAhead = 4,    // sender: the next row's load issued (a stage freed first)
    kPhaseTail = 5,     // sender: the rows' tails (scales, metadata, weights) stored
    kPhasePublish = 6,  // sender: stores drained and the piece published
    kPhaseWait = 7,     // receiver or reducer: waiting for a slot's sequence number
    kPhaseCopy = 8,     // receiver or reducer: the rows copied out, or summed
    kPhaseEnd = 9,      // the rest, to the warp's end
    kNumPhases = 10,
    kPhaseSpanNs = 10,      // the warp's span, GPU timer
    kPhaseSpanCycles = 11,  // the same in SM cycles
    kNumPhaseSlots = 12,
};

struct PhaseClock {
    uint64_t* slots;
    long long first, last;
    uint64_t first_ns;

    __device__ __forceinline__ PhaseClock(uint64_t* phases, int warp, int num_warps)
        : slots(phases == nullptr ? nullptr
                                  : phases + (static_cast<int64_t>(blockIdx.x) * num_warps + warp) * kNumPhaseSlots),
          first(clock64()), last(first), first_ns(phases == nullptr ? 0 : ptx::global_timer_ns()) {}

    __device__ __forceinline__ void mark(int phase, int lane) {
        if (slots != nullptr && lane == 0) {
            const long long now = clock64();
            slots[phase] += static_cast<uint64_t>(now - last);
            last = now;
        }
    }

    __device__ __forceinline__ void end(int lane) {
        mark(kPhaseEnd, lane);
        if (slots != nullptr && lane == 0) {
            slots[kPhaseSpanNs] += ptx::global_timer_ns() - first_ns;
            slots[kPhaseSpanCycles] += static_cast<uint64_t>(last - first);
        }
    }
};

}  // namespace tokenyard
