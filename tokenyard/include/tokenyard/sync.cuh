// Bounded waits. A wait that passes its deadline records who waited, for whom and at which stage in
// host-visible memory (the first record wins), and returns false; the kernel then winds down without
// __trap(), so the CUDA context stays usable and Python can raise CommTimeoutError.
#pragma once

#include "layout.cuh"
#include "ptx.cuh"

namespace tokenyard {

// NOTE [error record]: int32 words in pinned host memory, read by check_failures in backends/cuda/backend.py,
// which takes the numbers below from this header (tokenyard/plan/headers.py).
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
    kStageInternodeSignal = 10,
    kStageInternodeBarrier = 11,
    kStageLowLatencyCombineOverlap = 12,
    kStageDispatchPlace = 13,  // a dispatch sender waits for where a peer takes its rows (NOTE [placed rows])
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

    // The same record with a deadline `slack_ns` later: a wait behind another's deadline, whose own timeout is to be
    // the one recorded (NOTE [one verdict]; NOTE [placed rows] in kernels/dispatch.cuh).
    __device__ __forceinline__ WaitContext later_by(uint64_t slack_ns) const {
        return {error_flag, host_record, rank, timeout_ns + slack_ns};
    }
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

// NOTE [normal-mode call numbers]
// The numbers that normal-mode calls signal with (a chunk slot's sequence number, the notify and barrier
// counts each rank waits for) are counted on the GPU, not passed by the host, so a call captured in a CUDA
// graph signals new ones at every replay, as an eager call does. Each counter (CallCounter) is a 64-bit word
// of the rank's own device memory: its high half counts the launches that read it, its low half the blocks
// of the current launch that have arrived. Every block arrives once, before anything else (a block that
// returns early arrives all the same), and reads the count; the block that arrives last moves the count on
// and clears the arrivals in one add. So every block of a launch reads the same number (the launches before
// it, plus one), and the next launch, which begins after this one ends in stream order, the next. Every
// rank makes the same launches (the calls are collective), so the numbers agree across ranks.
// kRecvClaims and kRecvClaimsLaunch are no counters of launches but the dispatch's receive claims (NOTE [receive
// claims] in kernels/dispatch.cuh): the items claimed so far, and the launch they count for.
enum CallCounter : int {
    kCountNotify = 0,
    kCountSeq = 1,
    kCountBarrier = 2,
    kRecvClaims = 3,
    kRecvClaimsLaunch = 4,
    kNumCallCounters = 5
};

// -> numbers[i]: this launch's number on counters[i] for i < kCount (a thread per counter; the whole block
// must call it).
template <int kCount>
__device__ __forceinline__ void launch_numbers(unsigned long long* counters, uint32_t (&numbers)[kCount]) {
    __shared__ uint32_t shared_numbers[kCount];
    if (threadIdx.x < kCount) {
        const unsigned long long before = atomicAdd(counters + threadIdx.x, 1ull);
        if (static_cast<uint32_t>(before) == gridDim.x - 1)
            atomicAdd(counters + threadIdx.x, (1ull << 32) - gridDim.x);
        shared_numbers[threadIdx.x] = static_cast<uint32_t>(before >> 32) + 1u;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kCount; ++i)
        numbers[i] = shared_numbers[i];
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

// ---- Low-latency mode: trace points, then the kernels' signals (epochs, call tags, the last block's
// release, masks, verdicts) ----

// NOTE [low-latency trace]
// Given a trace array ([gridDim.x][kNumTracePoints] uint64), thread 0 of every block stamps the GPU's global
// timer as the block passes each point below (benchmarks/ll_phases.py reads them); without one (nullptr,
// every call but a traced one) a stamp is a predictable branch.
enum TracePoint : int {
    kTraceStart = 0,      // the block began
    kTracePrologue = 1,   // dispatch: first piece asked for (block 0: books kept); combine: weights sent, items counted
    kTraceSent = 2,       // the block's sends are issued
    kTraceCounted = 3,    // past the done counter
    kTracePublished = 4,  // the last block (a combine send: a group's last, NOTE [group release]): signals stored
    kTraceRecvReady = 5,  // dispatch: rows numbered from the expert counts; combine: pair bits built
    kTraceRecvMid = 6,    // dispatch: every source's data signal seen; combine: every rank's rows signalled
    kTraceEnd = 7,
    kNumTracePoints = 8,
};

__device__ __forceinline__ void trace_mark(uint64_t* trace, int point) {
    if (trace != nullptr && threadIdx.x == 0)
        trace[static_cast<int64_t>(blockIdx.x) * kNumTracePoints + point] = ptx::global_timer_ns();
}

// NOTE [low-latency epochs]
// Signals carry an epoch kept on the GPU, not a number from the host, so a call captured in a CUDA graph
// and replayed still signals something new each time. Each half of the buffer keeps, per kind (dispatch 0,
// combine 1), a done counter and an epoch. A launch that sends works with epoch = stored + 1 (read by
// every block before it reports done); a receive-only launch (a hook) with the stored epoch, which its
// send launch has already advanced. Every sending block adds one to the done counter when its writes are
// fenced; the block that brings it to gridDim.x is the last: it resets the counter, publishes the
// signals and stores the new epoch.
__device__ __forceinline__ uint32_t launch_epoch(const LowLatencyBuffers& b, int kind, int do_send) {
    return ptx::ld_relaxed_sys(b.epoch(kind)) + (do_send ? 1u : 0u);
}

// NOTE [call tags]
// A word's tag is not the epoch itself but epoch * tag_factor (mod 2^32), the factor an odd number the host
// derives from the call's shape signature (collectives.signature: hidden, top-k, experts, M and, for the
// dispatch, the FP8 flags). Ranks whose calls differ in shape (and so in where their words land and what
// they hold) never match each other's tags: the waits run out, or mask the rank under enable_shrink, instead
// of reading rows laid out for another shape. Multiplying by an odd factor is a bijection that keeps 0 at
// 0, so a word zeroed by clean_low_latency_buffer matches no epoch from 1 to 2^32 - 1, as with raw epochs.

//
// NOTE [cumulative release]
// No block fences its peer writes at system scope. The barrier orders the block's writes before thread 0's
// GPU-scope release (the counter's acq_rel add), the last block acquires every such release through the
// counter, and its system-scope release of the signal is cumulative: a peer that acquires the signal sees
// every block's writes (causality order is transitive in the PTX memory model). One system fence per rank
// instead of one per block: the per-block fences cost microseconds of every call.
// Whether this block is the last of `count` to count itself on `counter`, which the last resets.
__device__ __forceinline__ bool last_of(uint32_t* counter, uint32_t count) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        last = ptx::atomic_add_acq_rel_gpu(counter, 1) + 1 == count;
        if (last)
            ptx::st_relaxed_gpu(counter, 0u);  // the next launch follows in stream order
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ bool last_block_done(const LowLatencyBuffers& b, int kind) {
    return last_of(b.done_counter(kind), gridDim.x);
}

// The last block's end of a launch: the epoch it worked with, for the next launch (NOTE [low-latency epochs]).
__device__ __forceinline__ void store_epoch(const LowLatencyBuffers& b, int kind, uint32_t epoch) {
    if (threadIdx.x == 0) {
        ptx::st_relaxed_sys(b.epoch(kind), epoch);
        ptx::st_relaxed_sys(b.last_tag(kind), b.tag(epoch));
    }
}

// The end of a sending launch: once the block's sends are issued and it has reported done, the last
// block stores to every unmasked rank r its signal (tag << 32) | value with release (NOTE
// [cumulative release]), then the launch's epoch for the next launch (NOTE [low-latency epochs]).
// `withhold` (called by every thread of the last block, after every block's done): the mask of the ranks that get
// no signal: every rank (~0u) so that the peers time out rather than read what this launch left unwritten, or
// those whose signal a later launch sends (NOTE [deferred rows] in kernels/low_latency_combine.cuh); the epoch
// still advances.
struct Signal {
    uint64_t* word;
    uint32_t value;
};

// NOTE [internode low-latency]
// The low-latency kernels reach a rank of another node through the transport (NOTE [transport seam]), passed as
// their template parameter Remote: tokenyard::transport::Remote in the NVSHMEM units
// (kernels/low_latency_internode.cuh), NoRemote within a node. Every word a peer waits for (a count, a weight, a
// flag) carries its tag, so to a rank of another node it goes alone, as one 64-bit signal (store_word), but the
// combine's weights: a rank's for a rank of another node are assembled in its staging (staged_weights_for) and go by
// one put that sets that rank's weights flag once they landed (put_signal_set_warp), and the receiver trusts the
// words only after that flag (a put's words need not land whole). A message or a partial sum is written by several
// warps, a piece each; for a rank of another node they write their pieces into this rank's staging
// (LowLatencyBuffers::staged_message, staged_row) and count them in its arrival word (arrive), and the warp that
// brings in the last piece puts the whole of it: one put per (token, rank), as a NIC wants, however the pieces were
// dealt. Before reporting done each block waits for its puts to land (one thread's Remote::quiet, NOTE [block
// quiet] in transport.cuh), so the last block's signals, sent after every block's done, follow every put. The
// receiving halves read only this rank's memory, as within a node.
struct NoRemote {
    static constexpr bool kEnabled = false;
    static __device__ __forceinline__ void put_warp(void*, const void*, size_t, int) {}
    static __device__ __forceinline__ void put_signal_set_warp(void*, const void*, size_t, uint64_t*, uint64_t, int) {}
    static __device__ __forceinline__ void signal_set(uint64_t*, uint64_t, int) {}
    static __device__ __forceinline__ void quiet() {}
};

// `value` into rank `owner`'s `word`: a store (with release where `release`) within the node, a signal to another.
template <typename Remote>
__device__ __forceinline__ void store_word(const LowLatencyBuffers& b, uint64_t* word, uint64_t value, int owner,
                                           bool release) {
    if (Remote::kEnabled && b.is_remote(owner))
        Remote::signal_set(word, value, owner);
    else if (release)
        ptx::st_release_sys(word, value);
    else
        ptx::st_relaxed_sys(word, value);
}

// One thread: counts a piece into `word` ((tag << 32) | pieces; a word of another tag counts from zero), the
// calling warp's stores ordered before (the caller's __syncwarp, then this release); true for the piece that
// makes `pieces`, whose caller then sees every counted piece's stores (acquire).
__device__ __forceinline__ bool arrive(uint64_t* word, uint32_t tag, uint32_t pieces) {
    auto* counter = reinterpret_cast<unsigned long long*>(word);
    __threadfence();
    unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(counter);
    for (;;) {
        const unsigned long long next = static_cast<uint32_t>(seen >> 32) == tag
                                                ? seen + 1
                                                : (static_cast<unsigned long long>(tag) << 32) | 1ull;
        const unsigned long long before = atomicCAS(counter, seen, next);
        if (before == seen) {
            __threadfence();
            return static_cast<uint32_t>(next) == pieces;
        }
        seen = before;
    }
}

template <typename Remote, typename SignalOf, typename Withhold>
__device__ __forceinline__ void publish_when_last(const LowLatencyBuffers& b, int kind, uint32_t epoch,
                                                  const int* rank_mask, uint64_t* trace, SignalOf signal_of,
                                                  Withhold withhold) {
    trace_mark(trace, kTraceSent);
    if constexpr (Remote::kEnabled) {  // the block's puts have landed before it reports done (NOTE [block quiet])
        __syncthreads();
        if (threadIdx.x == 0)
            Remote::quiet();
    }
    const bool last = last_block_done(b, kind);
    trace_mark(trace, kTraceCounted);
    if (!last)
        return;
    const uint32_t held = withhold();
    for (int r = threadIdx.x; r < b.num_ranks; r += blockDim.x) {
        if ((held >> r) & 1u || (rank_mask != nullptr && rank_mask[r] != 0))
            continue;
        const Signal signal = signal_of(r);
        store_word<Remote>(b, signal.word, (static_cast<uint64_t>(b.tag(epoch)) << 32) | signal.value, r, true);
    }
    store_epoch(b, kind, epoch);
    trace_mark(trace, kTracePublished);
}

// NOTE [rank masking]
// With a rank mask (Buffer(enable_shrink=True)), a rank whose signal misses the deadline is marked in the
// mask instead of failing the call: its pairs count as absent in this call, and later calls neither send
// to it nor wait for it (build_pair_bits drops its experts), so the surviving ranks keep serving. Without a
// mask the timeout is recorded and raised as CommTimeoutError.
//
// Every wait for a peer's word goes through wait_tag_or_mask: -> whether it came (its low half in `value`);
// past the deadline the peer is masked, or without a mask the timeout recorded (kAcquire as wait_for_tag).
// wait_or_mask: the same for a signal stored with release whose value is a count: -> the count, or -1.
//
// NOTE [block waits]
// One thread per block polls each signal word, and the block's other threads learn from shared memory.
// When every warp polled the words it needed (thousands of pollers on four words of one L2 sector), the
// combine saw its rows' signals microseconds later than with one poller per block
// (benchmarks/results/low_latency.md, "decisions").
template <bool kAcquire>
__device__ __forceinline__ bool wait_tag_or_mask(const WaitContext& wait, const uint64_t* word, uint32_t tag,
                                                 int peer, int stage, int* rank_mask, uint32_t& value) {
    const bool came = wait_for_tag<kAcquire>(wait, word, tag, peer, stage, rank_mask == nullptr, value);
    if (!came && rank_mask != nullptr)
        atomicExch(rank_mask + peer, 1);
    return came;
}

__device__ __forceinline__ int wait_or_mask(const WaitContext& wait, const uint64_t* word, uint32_t tag, int peer,
                                            int stage, int* rank_mask) {
    uint32_t value = 0;
    return wait_tag_or_mask<true>(wait, word, tag, peer, stage, rank_mask, value) ? static_cast<int>(value) : -1;
}

// NOTE [one verdict]
// Under a rank mask, whether a peer's words came in time is decided once per launch and receive stage, by
// block 0: it waits (masking the peer at its deadline) and stores (tag << 32) | came with release in the
// verdict word of (stage, peer); the other blocks wait for that word instead of the peer's and follow it.
// Were each block to decide alone, a word landing at the deadline could be seen by one block and missed by
// another, and the two would number or sum the rows of different sets of ranks. A follower told "came"
// then reads the peer's words: block 0 acquired them before its release, the follower acquires that
// release, so what the peer released is visible to it too. Block 0 gives its verdict within a deadline of
// beginning to wait, which may be later than a follower began; a follower waits two deadlines and
// kVerdictSlackNs, then records a timeout, never a mask. Without a mask every block waits for itself: one
// that misses a word records the timeout, and the call fails as a whole.
constexpr uint64_t kVerdictSlackNs = 10'000'000;

// A verdict's follower's wait: two deadlines and kVerdictSlackNs.
__device__ __forceinline__ WaitContext follower_wait(const WaitContext& wait) {
    return wait.later_by(wait.timeout_ns + kVerdictSlackNs);
}

__device__ __forceinline__ void publish_verdict(const LowLatencyBuffers& b, int which, int peer, uint32_t tag,
                                                bool came) {
    ptx::st_release_sys(b.verdict(which, peer), (static_cast<uint64_t>(tag) << 32) | (came ? 1u : 0u));
}

__device__ __forceinline__ bool follow_verdict(const LowLatencyBuffers& b, const WaitContext& wait, int which,
                                               int peer, uint32_t tag, int stage) {
    const WaitContext patient = follower_wait(wait);
    uint32_t came = 0;
    if (wait_for_tag<true>(patient, b.verdict(which, peer), tag, peer, stage, false, came))
        return came != 0;
    record_error(wait, kErrorTimeout, peer, stage, 0, tag);
    return false;
}

// NOTE [wait costs] (checks.py): DeepEP's wait_recv_cost_stats. Block 0's thread for `peer` adds the SM
// clock cycles from the start of the receive until it saw `peer`'s signal (or gave up on it); every block
// waits alike, so one block's count stands for all of them.
__device__ __forceinline__ void add_wait_cost(int64_t* wait_costs, int peer, int64_t recv_start) {
    if (wait_costs != nullptr && blockIdx.x == 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(wait_costs + peer),
                  static_cast<unsigned long long>(clock64() - recv_start));
}

}  // namespace tokenyard
