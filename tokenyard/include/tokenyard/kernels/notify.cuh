// dispatch_notify: the count exchange before a normal-mode dispatch (NOTE [notify]).
#pragma once

#include "../signatures.cuh"

namespace tokenyard::kernels {

// Block dest's Verdict bits for column dest of the whole call's inputs (NOTE [input verdict]), kJudgeWindow tokens
// at a time; `shared`: dynamic shared memory of num_local_experts ints, then a byte per token of the window
// (whether one of its ids names rank dest's experts). The ids are read flat in 16-byte vectors (where the
// window starts 16-byte aligned, else one by one), kBatch vectors in flight per thread: one block reads every
// id, so its time is the ids' bytes over the loads it keeps in flight.
template <int kNumRanks, int kNumThreads, int kJudgeWindow, typename TopkT>
__device__ __forceinline__ int judge_column(int dest, const TopkT* topk_idx, int num_topk, int num_tokens,
                                            const bool* is_token_in_rank, const int* num_tokens_per_rank,
                                            const int* num_tokens_per_expert, int num_experts, int* shared) {
    constexpr int kBatch = 8, kPerVector = 16 / sizeof(TopkT);
    __shared__ int column, bits;
    const int num_local_experts = num_experts / kNumRanks;
    const int first = dest * num_local_experts;
    int* expert_pairs = shared;
    uint8_t* hits = reinterpret_cast<uint8_t*>(shared + num_local_experts);
    for (int l = threadIdx.x; l < num_local_experts; l += kNumThreads)
        expert_pairs[l] = 0;
    if (threadIdx.x == 0)
        column = bits = 0;
    int mine = 0, bad = 0;
    for (int w0 = 0; w0 < num_tokens; w0 += kJudgeWindow) {
        const int w1 = min(num_tokens, w0 + kJudgeWindow);
        for (int t = w0 + threadIdx.x; t < w1; t += kNumThreads)
            hits[t - w0] = 0;
        __syncthreads();
        const auto judge = [&](int p, int64_t e) {
            if (e < -1 || e >= num_experts) {
                bad |= kBadExpertId;
            } else if (e >= first && e < first + num_local_experts) {
                atomicAdd(&expert_pairs[e - first], 1);
                hits[p / num_topk - w0] = 1;
            }
        };
        if (topk_idx != nullptr) {
            const int p0 = w0 * num_topk, p1 = w1 * num_topk;
            const bool aligned = reinterpret_cast<unsigned long long>(topk_idx + p0) % 16 == 0;
            const int num_vectors = aligned ? (p1 - p0) / kPerVector : 0;
            const auto* vectors = reinterpret_cast<const int4*>(topk_idx + p0);
            for (int v0 = threadIdx.x; v0 < num_vectors; v0 += kBatch * kNumThreads) {
                int4 loaded[kBatch];
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int v = v0 + u * kNumThreads;
                    if (v < num_vectors)
                        loaded[u] = ptx::ld_nc_v4(vectors + v);
                }
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int v = v0 + u * kNumThreads;
                    if (v < num_vectors) {
                        const auto* ids = reinterpret_cast<const TopkT*>(&loaded[u]);
#pragma unroll
                        for (int k = 0; k < kPerVector; ++k)
                            judge(p0 + v * kPerVector + k, static_cast<int64_t>(ids[k]));
                    }
                }
            }
            for (int p = p0 + num_vectors * kPerVector + threadIdx.x; p < p1; p += kNumThreads)
                judge(p, static_cast<int64_t>(topk_idx[p]));
        }
        __syncthreads();
        for (int base = w0 + threadIdx.x; base < w1; base += kBatch * kNumThreads) {
            bool in[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int t = base + u * kNumThreads;
                in[u] = t < w1 && is_token_in_rank[static_cast<int64_t>(t) * kNumRanks + dest];
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int t = base + u * kNumThreads;
                mine += in[u];
                if (topk_idx != nullptr && t < w1 && (hits[t - w0] != 0) != in[u])
                    bad |= kInRankDisagrees;
            }
        }
        __syncthreads();
    }
    atomicAdd(&column, mine);
    if (bad != 0)
        atomicOr(&bits, bad);
    __syncthreads();
    if (topk_idx != nullptr) {
        for (int l = threadIdx.x; l < num_local_experts; l += kNumThreads)
            if (expert_pairs[l] != num_tokens_per_expert[first + l])
                atomicOr(&bits, kPerExpertDisagrees);
    }
    if (threadIdx.x == 0 && column != num_tokens_per_rank[dest])
        atomicOr(&bits, kPerRankDisagrees);
    __syncthreads();
    return bits;
}

// NOTE [notify]
// Grid of kNumRanks + 1 blocks. Block dest (< kNumRanks) scans column dest of is_token_in_rank into
// prefix_excl[t][dest] = tokens before t that go to rank dest (row num_tokens holds the total), then writes
// that total to every rank's notify data (row = this rank), with the same for the whole call this
// request is round 0 of (`call_tokens_per_rank[dest]`; NOTE [rounds] in rounds.py), and block 0 the token
// counts (this request's, the whole call's); rank dest's expert counts go to rank dest. Last it adds 1 to every
// rank's notify counter for this source. One-shot, the whole call is this request (null
// call_tokens_per_rank, call_num_tokens = num_tokens). Block kNumRanks waits until every source's counter
// reached this launch's number (NOTE [normal-mode call numbers] in sync.cuh) times kNumRanks, then builds
// rank_prefix_matrix, the received total, the whole call's rank_prefix_matrix (`call_prefix_matrix`, where
// given) and received total, the largest call token count of any rank and the per-expert counts, and
// publishes them to the host: host_counts = [ticket (last: the host's number of the call, which its CPU
// wait looks for), received rows, most call tokens, whole call's received rows, mask of the sources whose
// inputs were judged bad, their Verdict bits, per-local-expert counts...].
// A fresh dispatch's handle also gets, where given, `counts[dest]` = the tokens this rank sends to rank dest and
// `source_first[s]` = the first received row from source s (both [kNumRanks], written here rather than by
// kernels of their own). A fresh expanded one (NOTE [expanded rows] in dispatch.cuh) gets `expand_bases[s][l]` =
// where source s's pairs of local expert l begin in the expanded layout (semantics.expand.expanded_bases), and its
// handle's `expand_counts[l]` (the pairs of expert l) and `expand_ends[l]` (where they end).
// A round of a fresh dispatch in rounds (NOTE [placed rounds] in rounds.py) also gets `recv_first` and
// `cursor` (both or neither): recv_first[s] = where the round's rows from source s start in the whole
// call's receive order, computed from the whole call's counts in round 0 (given call_tokens_per_rank) and
// read from cursor in later rounds; then cursor[s] = recv_first[s] + the round's rows from s, for the next
// round. So no round waits for the host to place it.
// NOTE [input verdict] in tokenyard/checks.py: where given `check_in_rank` (a fresh dispatch's one-shot
// request, or round 0 of its rounds), block dest also judges column dest of the whole call's inputs (ids in
// range, is_token_in_rank[:, dest] against the ids, the column's total against num_tokens_per_rank[dest], the
// pairs of rank dest's experts against num_tokens_per_expert) and sends its Verdict bits with the counts; the
// receiving block ORs every source's, publishes the mask of bad sources and their bits to the host, and
// leaves the mask in verdict[1], which the data kernels of the call read to move nothing. Without
// check_topk_idx, the ids get_dispatch_layout saw out of range (verdict[0], cleared here) stand for them.
// `record_verdict`: no CPU wait follows (num_worst_tokens), so a bad verdict is also recorded as an error.
// Notify data row of source s: kNumRanks counts, token count, call token count, kNumRanks call counts,
// kNumRanks verdicts, then the counts of the destination's experts. Since a rank only enters this kernel
// after its previous normal-mode kernels finished, a completed notify also means every rank is done with
// the buffer's previous contents: it is the barrier before the data kernel.
// Block 0 also sends the call's `signature` (dispatch table: the dispatch number % 2), and the receiving block compares
// every rank's before it reads any count (NOTE [call signatures] in layout.cuh).
template <int kNumRanks, int kNumThreads, typename TopkT, int kJudgeWindow, int kSignatureInts, typename Params>
__device__ __forceinline__ void dispatch_notify(const Params& p) {
    const NormalBuffers buffers{p.peer_bases, p.rank, 0, 0, 0, 0, 0};
    const WaitContext wait{p.error_flag, p.host_record, p.rank, p.timeout_ns};
    const int num_local_experts = p.num_experts / kNumRanks;
    constexpr int kCallCountsAt = kNumRanks + 2, kVerdictAt = 2 * kNumRanks + 2, kExpertsAt = 3 * kNumRanks + 2;
    constexpr int kHostExpertsAt = 6;
    const int stride = kExpertsAt + num_local_experts;
    static_assert(kNumThreads % 32 == 0 && kNumThreads <= 1024, "a warp's total per scan slot");
    __shared__ int scan[kNumThreads / 32];
    __shared__ bool ok;
    __shared__ int bad_sources, bad_bits;
    extern __shared__ int judge_shared[];  // where judging: judge_column's
    uint32_t call[1];
    launch_numbers<1>(p.call_counts + kCountNotify, call);

    if (blockIdx.x < kNumRanks) {
        const int dest = blockIdx.x;
        int judged = 0;
        if (p.check_in_rank != nullptr) {
            judged = judge_column<kNumRanks, kNumThreads, kJudgeWindow>(
                    dest, p.check_topk_idx, p.num_topk, p.check_num_tokens, p.check_in_rank, p.check_per_rank,
                    p.check_per_expert, p.num_experts, judge_shared);
            if (dest == 0 && p.check_topk_idx == nullptr)
                judged |= p.verdict[0];
            __syncthreads();
            if (dest == 0 && threadIdx.x == 0)
                p.verdict[0] = 0;
        }
        // Thread i counts tokens [i * per_thread, (i + 1) * per_thread) of the column, its flags held in
        // registers (loaded together) wherever they fit, then an exclusive scan over the threads.
        constexpr int kHeld = 16;
        const int per_thread = (p.num_tokens + kNumThreads - 1) / kNumThreads;
        const int begin = min(p.num_tokens, static_cast<int>(threadIdx.x) * per_thread);
        const int end = min(p.num_tokens, begin + per_thread);
        const bool* column_dest = p.is_token_in_rank + dest;
        bool held[kHeld];
        int mine = 0;
        if (per_thread <= kHeld) {
#pragma unroll
            for (int i = 0; i < kHeld; ++i)
                held[i] = begin + i < end && column_dest[static_cast<int64_t>(begin + i) * kNumRanks];
#pragma unroll
            for (int i = 0; i < kHeld; ++i)
                mine += held[i];
        } else {
            for (int t = begin; t < end; ++t)
                mine += column_dest[static_cast<int64_t>(t) * kNumRanks];
        }
        // Inclusive scan: within each warp by shuffles, then over the warps' totals.
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        int inclusive = mine;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int add = __shfl_up_sync(0xffffffffu, inclusive, offset);
            if (lane >= offset)
                inclusive += add;
        }
        if (lane == 31)
            scan[warp] = inclusive;
        __syncthreads();
        if (warp == 0) {
            int warp_total = lane < kNumThreads / 32 ? scan[lane] : 0;
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const int add = __shfl_up_sync(0xffffffffu, warp_total, offset);
                if (lane >= offset)
                    warp_total += add;
            }
            if (lane < kNumThreads / 32)
                scan[lane] = warp_total;  // inclusive over warps
        }
        __syncthreads();
        int running = inclusive - mine + (warp > 0 ? scan[warp - 1] : 0);
        const int total = scan[kNumThreads / 32 - 1];
        if (per_thread <= kHeld) {
#pragma unroll
            for (int i = 0; i < kHeld; ++i) {
                if (begin + i < end) {
                    p.prefix_excl[static_cast<int64_t>(begin + i) * kNumRanks + dest] = running;
                    running += held[i];
                }
            }
        } else {
            for (int t = begin; t < end; ++t) {
                p.prefix_excl[static_cast<int64_t>(t) * kNumRanks + dest] = running;
                running += column_dest[static_cast<int64_t>(t) * kNumRanks];
            }
        }
        if (threadIdx.x == 0) {
            p.prefix_excl[static_cast<int64_t>(p.num_tokens) * kNumRanks + dest] = total;
            if (p.counts != nullptr)
                p.counts[dest] = total;
        }
        if (threadIdx.x < kNumRanks) {
            int* data = buffers.notify_data(threadIdx.x) + p.rank * stride;
            ptx::st_relaxed_sys(data + dest, total);
            ptx::st_relaxed_sys(data + kCallCountsAt + dest,
                                p.call_tokens_per_rank != nullptr ? p.call_tokens_per_rank[dest] : total);
            ptx::st_relaxed_sys(data + kVerdictAt + dest, judged);
            if (dest == 0) {
                ptx::st_relaxed_sys(data + kNumRanks, p.num_tokens);
                ptx::st_relaxed_sys(data + kNumRanks + 1, p.call_num_tokens);
            }
        }
        for (int l = threadIdx.x; l < num_local_experts; l += kNumThreads) {
            const int count =
                    p.num_tokens_per_expert != nullptr ? p.num_tokens_per_expert[dest * num_local_experts + l] : 0;
            ptx::st_relaxed_sys(buffers.notify_data(dest) + p.rank * stride + kExpertsAt + l, count);
        }
        if (dest == 0)
            send_signature<kNumRanks, kSignatureInts>(buffers, call[0] % 2, p.signature);
        __syncthreads();
        if (threadIdx.x < kNumRanks) {
            ptx::fence_acq_rel_sys();
            ptx::atomic_add_release_sys(buffers.notify_flag(threadIdx.x) + p.rank, 1);
        }
        return;
    }

    // The receiving block.
    if (threadIdx.x == 0) {
        ok = true;
        bad_sources = bad_bits = 0;
    }
    __syncthreads();
    if (threadIdx.x < kNumRanks &&
        !wait_at_least(wait, buffers.notify_flag(p.rank) + threadIdx.x, call[0] * kNumRanks, threadIdx.x,
                       kStageNotify))
        ok = false;
    __syncthreads();
    if (!ok || !signatures_agree<kNumRanks, kSignatureInts>(buffers, wait, call[0] % 2, p.signature, kStageNotify))
        return;
    const int* data = buffers.notify_data(p.rank);
    if (threadIdx.x < kNumRanks) {
        const int s = threadIdx.x;
        int bits = 0;
        for (int dest = 0; dest < kNumRanks; ++dest)
            bits |= ptx::ld_na_s32(data + s * stride + kVerdictAt + dest);
        if (bits != 0) {
            atomicOr(&bad_sources, 1 << s);
            atomicOr(&bad_bits, bits);
        }
    }
    if (threadIdx.x < kNumRanks) {
        const int dest = threadIdx.x;
        int running = 0, call_running = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            if (dest == p.rank && p.source_first != nullptr)
                p.source_first[s] = running;
            running += ptx::ld_na_s32(data + s * stride + dest);
            p.rank_prefix_matrix[s * kNumRanks + dest] = running;
            call_running += ptx::ld_na_s32(data + s * stride + kCallCountsAt + dest);
            if (p.call_prefix_matrix != nullptr)
                p.call_prefix_matrix[s * kNumRanks + dest] = call_running;
        }
        p.source_num_tokens[dest] = ptx::ld_na_s32(data + dest * stride + kNumRanks);
        if (dest == p.rank) {
            p.host_counts[1] = running;
            p.host_counts[3] = call_running;
            if (p.recv_first != nullptr) {
                int call_first = 0;
                for (int s = 0; s < kNumRanks; ++s) {
                    const int first = p.call_tokens_per_rank != nullptr ? call_first : p.cursor[s];
                    p.recv_first[s] = first;
                    if (p.cursor != nullptr)
                        p.cursor[s] = first + ptx::ld_na_s32(data + s * stride + p.rank);
                    call_first += ptx::ld_na_s32(data + s * stride + kCallCountsAt + p.rank);
                }
            }
        }
        if (dest == 0) {
            int most = 0;
            for (int s = 0; s < kNumRanks; ++s)
                most = max(most, ptx::ld_na_s32(data + s * stride + kNumRanks + 1));
            p.host_counts[2] = most;
        }
    }
    for (int l = threadIdx.x; l < num_local_experts; l += kNumThreads) {
        int count = 0;
        for (int s = 0; s < kNumRanks; ++s)
            count += ptx::ld_na_s32(data + s * stride + kExpertsAt + l);
        p.host_counts[kHostExpertsAt + l] = (count + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
    }
    if (p.expand_bases != nullptr && threadIdx.x == 0) {  // one thread: a few hundred counts, in expert order
        int start = 0;
        for (int l = 0; l < num_local_experts; ++l) {
            int base = start;
            for (int s = 0; s < kNumRanks; ++s) {
                p.expand_bases[s * num_local_experts + l] = base;
                base += ptx::ld_na_s32(data + s * stride + kExpertsAt + l);
            }
            p.expand_counts[l] = base - start;
            p.expand_ends[l] = base;
            start += (base - start + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        p.host_counts[4] = bad_sources;
        p.host_counts[5] = bad_bits;
        if (p.check_in_rank != nullptr)
            p.verdict[1] = bad_sources;
        if (p.record_verdict && bad_sources != 0)
            record_error(wait, kErrorBadValues, __ffs(bad_sources) - 1, kStageNotify, bad_bits, bad_sources);
        ptx::fence_acq_rel_sys();
        ptx::st_relaxed_sys(reinterpret_cast<uint32_t*>(p.host_counts), p.ticket);
    }
}

}  // namespace tokenyard::kernels
