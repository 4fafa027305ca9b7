// Bounded waits. A wait that passes its deadline records who waited, for whom and at which stage in
// host-visible memory (the first record wins), and returns false; the kernel then winds down without
// __trap(), so the CUDA context stays usable and Python can raise CommTimeoutError.
#pragma once

#include "ptx.cuh"

namespace tokenyard {

// NOTE [error record]: int32 words in pinned host memory, read by check_failures in backends/cuda/backend.py,
// which takes the numbers below from this header (tokenyard/headers.py).
//   [0] 0 = no error, 1 = timeout, 2 = more rows than the output holds (value seen > expected), 3 = a peer
//   sent with another launch shape (value seen: its sending warps, expected: ours), 4 = a dispatch that
//   does not wait for the CPU was given bad values (seen: the Verdict bits, expected: the mask of the ranks
//   that gave them), 5 = a low-latency dispatch was given an expert id out of range (seen: the id,
//   expected: num_experts), 6 = the ranks made calls of different signatures (expected: the mask of the
//   ranks whose signature differs from this rank's; NOTE [call signatures] in layout.cuh);  [1] rank;
//   [2] peer;  [3] stage (Stage below);  [4] value seen;  [5] value expected;  [6, 8) unused;  from
//   kRecordSignaturesAt, for kind 6, every rank's signature (a row of kMaxSignatureInts each).
// The first failing wait wins a compare-and-swap on `error_flag` in device memory (atomics on host memory
// need PCIe atomics, which a VM may lack) and then writes the host record with plain stores.
enum Stage : int {
    kStageBarrier = 1,
    kStageNotify = 2,
    kStageDispatchRecv = 3,
    kStageCombineRecv = 4,
    kStageLowLatencyDispatchRecv = 5,
    kStageLowLatencyCombineRecv = 6,
    kStageLowLatencyCombineWeights = 7,
    kStageLowLatencyDispatchCounts = 8,
    kStageLowLatencyDispatchSend = 9,
};

enum ErrorKind : int {
    kErrorTimeout = 1,
    kErrorOverflow = 2,
    kErrorMismatch = 3,
    kErrorBadValues = 4,
    kErrorBadLowLatencyIds = 5,
    kErrorCallMismatch = 6,
};

constexpr int kRecordSignaturesAt = 8;

// NOTE [input verdict] in tokenyard/checks.py: what a rank's dispatch inputs got wrong, one bit each.
enum Verdict : int {
    kBadExpertId = 1,
    kPerRankDisagrees = 2,
    kPerExpertDisagrees = 4,
    kInRankDisagrees = 8,
    kLayoutBadIds = 16,
};

struct WaitContext {
    int* error_flag;          // device memory, 0 until a wait fails
    int* host_record;         // pinned, host-mapped
    int rank;
    uint64_t timeout_ns;
};

__device__ __forceinline__ void record_error(const WaitContext& ctx, int kind, int peer, int stage, uint32_t seen,
                                             uint32_t expected) {
    if (ptx::atomic_cas_relaxed_sys(ctx.error_flag, 0, 1) == 0) {
        ptx::st_relaxed_sys(ctx.host_record + 1, ctx.rank);
        ptx::st_relaxed_sys(ctx.host_record + 2, peer);
        ptx::st_relaxed_sys(ctx.host_record + 3, stage);
        ptx::st_relaxed_sys(ctx.host_record + 4, static_cast<int>(seen));
        ptx::st_relaxed_sys(ctx.host_record + 5, static_cast<int>(expected));
        ptx::fence_acq_rel_sys();
        ptx::st_relaxed_sys(ctx.host_record, kind);
    }
}

// Has a wait of this launch (or an earlier one not yet reported) already failed?
__device__ __forceinline__ bool failed(const WaitContext& ctx) {
    return ptx::ld_relaxed_sys(ctx.error_flag) != 0;
}

// NOTE [warp acquire]
// An acquire load orders the later reads of the thread that made it, not of its warp's other lanes, and a
// shuffle or vote is no memory-ordering operation. Where one lane waits for a flag and the whole warp then
// reads what the flag guards, the warp passes __syncwarp() (a memory barrier among its lanes) between the
// wait and the reads, so the acquire's order reaches every lane.

// Spin until *flag >= expected (wrap-safe comparison of sequence numbers) with acquire order.
__device__ __forceinline__ bool wait_at_least(const WaitContext& ctx, const uint32_t* flag, uint32_t expected,
                                              int peer, int stage) {
    uint64_t start = 0;
    for (int spin = 0;; ++spin) {
        uint32_t seen = ptx::ld_acquire_sys(flag);
        if (static_cast<int32_t>(seen - expected) >= 0)
            return true;
        if ((spin & 255) == 0) {
            uint64_t now = ptx::global_timer_ns();
            if (start == 0) {
                start = now;
            } else if (now - start > ctx.timeout_ns || failed(ctx)) {
                record_error(ctx, kErrorTimeout, peer, stage, seen, expected);
                return false;
            }
        }
    }
}

// Spin until the high half of *word equals `seq` (a word the peer stores as (tag << 32) | value, the tag
// being a call's epoch): -> true with the low half in `value`, or false at the deadline, having recorded a
// timeout unless `record` is false (the caller masks the peer instead). kAcquire: the word was stored with
// release and guards other data; without it the word is its own data, and a relaxed read is enough.
template <bool kAcquire = true>
__device__ __forceinline__ bool wait_for_tag(const WaitContext& ctx, const uint64_t* word, uint32_t seq, int peer,
                                             int stage, bool record, uint32_t& value) {
    uint64_t start = 0;
    for (int spin = 0;; ++spin) {
        const uint64_t seen = kAcquire ? ptx::ld_acquire_sys(word) : ptx::ld_relaxed_sys(word);
        if (static_cast<uint32_t>(seen >> 32) == seq) {
            value = static_cast<uint32_t>(seen & 0xffffffffu);
            return true;
        }
        if ((spin & 255) == 0) {
            const uint64_t now = ptx::global_timer_ns();
            if (start == 0) {
                start = now;
            } else if (now - start > ctx.timeout_ns || (record && failed(ctx))) {
                if (record)
                    record_error(ctx, kErrorTimeout, peer, stage, static_cast<uint32_t>(seen >> 32), seq);
                return false;
            }
        }
    }
}

}  // namespace tokenyard
