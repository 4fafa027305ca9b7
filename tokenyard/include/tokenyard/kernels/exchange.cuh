// NOTE [device exchange]
// The small exchanges of an internode normal-mode call (the call agreement's header, the count exchange, the
// rounds' table: NOTE [call agreement] in backends/collectives.py) go through the transport rather than the
// process group: over an NCCL group a host all-gather waits for a late or lost rank until NCCL's own timeout, where
// this wait has the Buffer's deadline and names the peer. Every rank puts its slot (at most kExchangeSlotBytes)
// with one signal into slot `rank` of every rank, itself included, and waits for every rank's signal; the host
// then copies the slots out. The signal is set to the exchange's tag (1, 2, ... on every rank alike); a wait
// compares with >=, and its timeout goes to an error record of the exchange's own, so that the host names the
// call's stage (dispatch/agree, dispatch/count_exchange, ...) and the rank that did not come. Two sets of slots
// and signals, by the tag's parity: a rank one exchange ahead puts into the set its peers are not reading (it
// cannot be two ahead: its next exchange needs their puts of this one, which they make after reading the last).
// The block quiets before it ends, so the host may write the send slot again. A tensor larger than a slot (a
// rounds' table of some hundred rounds) goes over the process group, as before.
#pragma once

#include "../transport.cuh"

namespace tokenyard::kernels {

constexpr int kExchangeSlotBytes = 32768;

// One block. Symmetric: send [kExchangeSlotBytes], slots [2][num_ranks][kExchangeSlotBytes], signals [2][num_ranks].
template <typename Params>
__device__ __forceinline__ void exchange(const Params& p) {
    const WaitContext ctx{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int warp = static_cast<int>(threadIdx.x) / 32, num_warps = static_cast<int>(blockDim.x) / 32;
    const int set = static_cast<int>(p.tag & 1u);
    auto* slots = static_cast<uint8_t*>(p.slots) + static_cast<int64_t>(set) * p.num_ranks * kExchangeSlotBytes;
    uint64_t* signals = p.signals + static_cast<int64_t>(set) * p.num_ranks;
    for (int peer = warp; peer < p.num_ranks; peer += num_warps)
        transport::put_signal_set_warp(slots + static_cast<int64_t>(p.rank) * kExchangeSlotBytes, p.send, p.bytes,
                                       signals + p.rank, p.tag, peer);
    for (int from = static_cast<int>(threadIdx.x); from < p.num_ranks; from += static_cast<int>(blockDim.x))
        transport::wait_signal(ctx, signals + from, p.tag, from, kStageInternodeBarrier);
    __syncthreads();
    if (threadIdx.x == 0)
        transport::quiet();
}

}  // namespace tokenyard::kernels
