"""Faults with real peers, as rank functions for `tokenyard.tools.launch.run_on_ranks` (each scenario in processes of
its own, so that a group left broken reaches nothing else): ranks that make different calls, skip one, make a
Buffer alone, sleep past the deadline or die. Each rank returns what it saw, ``{"error", "detected_s", "recovered"}``: the error
it raised (None for the rank at fault where it raised nothing), how long after its call began, and whether
it then completed a correct call (on the same Buffer where no data moved, else on a new Buffer, on a new
group where the old one holds unfinished work).
On the CUDA backend (GPU ranks, `backend="cuda"`) a kernel records what it found and the host raises it at
the call's CPU wait, or where the call has none (a combine, a num_worst_tokens dispatch, a dispatch whose
receivers wait on the GPU) at the Buffer's next call: the scenarios make one (`_raise_recorded`), and the
failed Buffer is replaced by a new one.
tests/cpu/test_faults.py and tests/gpu/test_faults.py assert on them; benchmarks/faults.py records them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

TIMEOUT_S = 2.0
LIMIT_S = TIMEOUT_S + 2  # every rank but the one at fault raises within this of its call's start
NUM_RANKS = 3
HIDDEN, NUM_EXPERTS, NUM_TOPK, NUM_TOKENS = 128, 12, 2, 16
MISMATCHES = ("hidden", "num_experts", "num_worst_tokens", "low_latency_hidden", "low_latency_num_max",
              "skipped_dispatch")
BUFFER_MISMATCHES = ("buffer_beside_a_dispatch", "buffer_with_other_settings")
# On the CUDA backend a one-node dispatch exchanges nothing on the host, so nothing meets a Buffer's header there.
CUDA_BUFFER_MISMATCHES = ("buffer_with_other_settings",)
# On the CUDA backend, normal-mode calls compare shapes in their kernels (NOTE [call signatures] in
# include/tokenyard/layout.cuh): RankMismatchError. Low-latency calls (NOTE [call tags] in
# include/tokenyard/sync.cuh) and a skipped call wait for signals that never come: CommTimeoutError.
CUDA_TIMEOUTS = ("low_latency_hidden", "low_latency_num_max", "skipped_dispatch")
LATE = ("sleeps_past_the_deadline", "killed", "killed_in_its_call", "late_to_low_latency_combine",
        "killed_before_low_latency_combine")
KILLED = ("killed", "killed_in_its_call", "killed_before_low_latency_combine")  # rank 1 ends by SIGKILL
COMBINES = ("late_to_low_latency_combine", "killed_before_low_latency_combine")  # between a dispatch and its combine
# Not on ranks that share a GPU: under MPS, a client killed while its kernel runs is a fatal fault for every
# client of that GPU (each survivor's next CUDA call fails with an illegal address, and its process must
# end), whatever the library (benchmarks/results/faults.md).
NOT_UNDER_MPS = ("killed_in_its_call",)
# Nor, where the ranks form several (virtual) nodes, so that NVSHMEM holds their memory, a rank killed at all: the
# survivors did not answer, and the next processes found the GPU unavailable (benchmarks/results/faults.md; the
# same for one killed before its low-latency combine, benchmarks/results/shared_gpu.md). Ranks on GPUs of their own
# run it.
NOT_UNDER_MPS_ON_NODES = ("killed", "killed_before_low_latency_combine")


def _device(backend):
    """The scenario's tensors' device: a GPU for the CUDA backend, and for the reference backend over NCCL (which
    moves no CPU tensors); else None (CPU)."""
    import torch.distributed as dist

    on_gpu = backend == "cuda" or (dist.is_initialized() and dist.get_backend() == "nccl")
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else None


def _inputs(seed, num_ranks, hidden=HIDDEN, num_experts=NUM_EXPERTS, backend="reference"):
    from tokenyard.tools.testing import make_rank_inputs

    return make_rank_inputs(seed, num_ranks, NUM_TOKENS, hidden, num_experts, NUM_TOPK, device=_device(backend))


def _raise_recorded(buffer, backend, seed, num_ranks) -> None:
    """On the CUDA backend, raise what the kernels recorded: wait for them, then make a call."""
    if backend == "cuda":
        torch.cuda.synchronize()
        buffer.get_dispatch_layout(_inputs(seed, num_ranks, backend=backend)[0][1], NUM_EXPERTS)


def _dispatch(buffer, x, topk_idx, weights, num_experts=NUM_EXPERTS, num_worst_tokens=0):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           num_worst_tokens=num_worst_tokens)


def _rdma_bytes(num_ranks) -> int:
    """Every scenario's `num_rdma_bytes`: enough for its low-latency calls, and where the group spans (virtual)
    nodes, for the internode kernels' region too, which normal mode needs there (NOTE [internode region])."""
    from tokenyard import Buffer

    return Buffer.get_low_latency_rdma_size_hint(32, 2 * HIDDEN, num_ranks, NUM_EXPERTS)


def warm_kernels(seed, backend, shapes) -> None:
    """On the CUDA backend, every rank loads the kernels of every call in `shapes` before the timed part of a
    scenario, on Buffers of its own: a rank's first call of a shape compiles its kernels (seconds for the NVSHMEM
    units of virtual nodes, NOTE [NVSHMEM units]) unless the cache holds them, and a detection time must not count
    a compile. `shapes`: (kind, settings) with kind "normal" (a dispatch and its combine; settings: hidden,
    num_experts, num_worst_tokens) or "low_latency" (a dispatch and its combine; settings: hidden, num_max)."""
    import torch.distributed as dist

    from tokenyard import Buffer

    if backend != "cuda":
        return
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    for kind, settings in shapes:
        hidden, num_experts = settings.get("hidden", HIDDEN), settings.get("num_experts", NUM_EXPERTS)
        buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=60)
        x, topk_idx, weights = _inputs(seed, num_ranks, hidden=hidden, num_experts=num_experts, backend=backend)[rank]
        if kind == "normal":
            recv_x, _, _, _, handle, _ = _dispatch(buffer, x, topk_idx, weights, num_experts,
                                                   settings.get("num_worst_tokens", 0))
            buffer.combine(recv_x, handle)
        else:
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, settings.get("num_max", 32),
                                                                  num_experts, use_fp8=False)
            buffer.low_latency_combine(recv_x, topk_idx, weights, handle)
        torch.cuda.synchronize()
        buffer.destroy()


# The shapes each scenario's ranks call (warm_kernels).
SHAPES = {"hidden": [("normal", {}), ("normal", {"hidden": 256})],
          "num_experts": [("normal", {}), ("normal", {"num_experts": 2 * NUM_EXPERTS})],
          "num_worst_tokens": [("normal", {"num_worst_tokens": 64})],  # rank 0's 2 holds too few rows to run
          "low_latency_hidden": [("low_latency", {}), ("low_latency", {"hidden": 256})],
          "low_latency_num_max": [("low_latency", {}), ("low_latency", {"num_max": 16})],
          "skipped_dispatch": [("normal", {})],
          **{what: [("low_latency", {})] for what in COMBINES}}


def survivors_group(survivors):
    """The group the ranks alive after a fault make for their next calls. An NCCL default group bound to a device
    (`init_process_group(device_id=...)`, as torchrun programs and tokenyard's launcher make it) makes every new
    group by splitting its communicator, a collective of all of its ranks that a lost rank fails (ncclRemoteError,
    docs/semantics.md "Errors"); there the survivors make a new default group among themselves instead, over the
    old one's store. Elsewhere, a group of the survivors."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if len(survivors) == world.size() or dist.get_backend() != "nccl" or world.bound_device_id is None:
        return dist.new_group(survivors, use_local_synchronization=True)
    store, device = dist.distributed_c10d._get_default_store(), world.bound_device_id
    rank = survivors.index(dist.get_rank())
    dist.destroy_process_group()
    dist.init_process_group("nccl", store=dist.PrefixStore("survivors", store), rank=rank,
                            world_size=len(survivors), device_id=device)
    return dist.group.WORLD


def _dispatches_correctly(buffer, seed, backend="reference") -> bool:
    """A dispatch on `buffer`, against the oracle; raises where it differs."""
    from tokenyard.semantics import routing

    inputs = _inputs(seed, buffer.group_size, backend=backend)
    recv_x = _dispatch(buffer, *inputs[buffer.rank])[0]
    want = routing.dispatch([i[0] for i in inputs], [None] * len(inputs), [i[1] for i in inputs],
                            [i[2] for i in inputs], NUM_EXPERTS)[buffer.rank]["recv_x"]
    assert torch.equal(recv_x, want), "the call after the fault returned wrong rows"
    return True


def correct_call(group, seed, backend="reference") -> bool:
    """A dispatch on a new Buffer of `group`, against the oracle; raises where it differs."""
    from tokenyard import Buffer

    per_node = int(os.environ.get("TOKENYARD_RANKS_PER_NODE", "0"))
    whole_nodes = per_node == 0 or group.size() % per_node == 0  # survivors of virtual nodes may be no whole node
    buffer = Buffer(group, 1 << 22, _rdma_bytes(group.size()), backend=backend, timeout_s=TIMEOUT_S,
                    ranks_per_node=None if whole_nodes else group.size())
    _dispatches_correctly(buffer, seed, backend)
    buffer.destroy()
    return True


def mismatch(seed, what, backend="reference") -> dict:
    """Rank 0 makes another call than the others (`what`, one of MISMATCHES); every rank must raise
    RankMismatchError (on the CUDA backend, a skipped call: CommTimeoutError), after which the same Buffer
    serves a correct call (no data moved; on the CUDA backend, a new Buffer of the same group)."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    odd = rank == 0
    warm_kernels(seed, backend, SHAPES[what])
    buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S)
    start, error = time.monotonic(), None
    try:
        if what == "hidden":
            _dispatch(buffer, *_inputs(seed, num_ranks, hidden=256 if odd else HIDDEN, backend=backend)[rank])
        elif what == "num_experts":
            experts = 2 * NUM_EXPERTS if odd else NUM_EXPERTS
            _dispatch(buffer, *_inputs(seed, num_ranks, num_experts=experts, backend=backend)[rank],
                      num_experts=experts)
        elif what == "num_worst_tokens":
            _dispatch(buffer, *_inputs(seed, num_ranks, backend=backend)[rank], num_worst_tokens=2 if odd else 64)
        elif what in ("low_latency_hidden", "low_latency_num_max"):
            hidden = 256 if odd and what == "low_latency_hidden" else 128
            num_max = 16 if odd and what == "low_latency_num_max" else 32
            x, topk_idx, _ = _inputs(seed, num_ranks, hidden=hidden, backend=backend)[rank]
            buffer.low_latency_dispatch(x, topk_idx, num_max, NUM_EXPERTS, use_fp8=False)
        elif what == "skipped_dispatch":  # rank 0 skips a dispatch and goes on to its combine
            x, topk_idx, weights = _inputs(seed, num_ranks, backend=backend)[rank]
            recv_x, _, _, _, handle, _ = _dispatch(buffer, x, topk_idx, weights)
            if not odd:
                _dispatch(buffer, x, topk_idx, weights)
            buffer.combine(recv_x, handle)
        else:
            raise ValueError(f"unknown mismatch {what!r}")
        _raise_recorded(buffer, backend, seed, num_ranks)
    except TokenyardError as exc:
        error = f"{type(exc).__name__}: {exc}"
    detected_s = time.monotonic() - start
    # After a skipped call the others' calls are one ahead of rank 0's, and a CUDA Buffer that recorded a
    # failure stays failed: those Buffers are done.
    if what != "skipped_dispatch" and backend != "cuda":
        _dispatch(buffer, *_inputs(seed + 1, num_ranks)[rank])
    internode = buffer._internode
    buffer.destroy()
    return {"error": error, "detected_s": detected_s, "internode": internode,
            "recovered": correct_call(dist.group.WORLD, seed + 2, backend)}


def buffer_mismatch(seed, what, backend="reference") -> dict:
    """Rank 0 makes a Buffer while the others make a dispatch on the Buffer every rank made before
    ("buffer_beside_a_dispatch"), or every rank makes one and rank 0's holds fewer bytes
    ("buffer_with_other_settings"), one of BUFFER_MISMATCHES. A Buffer's first exchange is a call's header (NOTE
    [call agreement] in collectives.py), so every rank must raise RankMismatchError naming rank 0's Buffer before
    any data moves, where gloo used to abort rank 0; then the Buffer made before serves a correct call, and so
    does a new one. On the CUDA backend, CUDA_BUFFER_MISMATCHES only."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S)
    start, error = time.monotonic(), None
    try:
        if what == "buffer_beside_a_dispatch":
            if rank == 0:
                Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S)
            else:
                _dispatch(buffer, *_inputs(seed, num_ranks, backend=backend)[rank])
        elif what == "buffer_with_other_settings":
            Buffer(dist.group.WORLD, 1 << (21 if rank == 0 else 22), _rdma_bytes(num_ranks), backend=backend,
                   timeout_s=TIMEOUT_S)
        else:
            raise ValueError(f"unknown mismatch {what!r}")
    except TokenyardError as exc:
        error = f"{type(exc).__name__}: {exc}"
    detected_s = time.monotonic() - start
    recovered = _dispatches_correctly(buffer, seed + 1, backend)
    buffer.destroy()
    return {"error": error, "detected_s": detected_s,
            "recovered": recovered and correct_call(dist.group.WORLD, seed + 2, backend)}


def expect_buffer_mismatch(seen) -> str:
    """Assert what every rank of `buffer_mismatch` must have seen; -> rank 0's error: the same RankMismatchError
    naming rank 0's new Buffer on every rank, within LIMIT_S, and a correct call afterwards."""
    errors = [s["error"] for s in seen.values()]
    assert all(e is not None and e.startswith("RankMismatchError") and "ranks [0] make a new Buffer(" in e
               for e in errors), errors
    assert len(set(errors)) == 1, f"the ranks raised different errors: {errors}"
    assert all(s["detected_s"] < LIMIT_S and s["recovered"] for s in seen.values()), seen
    return errors[0]


def late_peer(seed, what, backend="reference") -> dict:
    """Rank 1 (`what`, one of LATE) sleeps past the deadline or is killed before its dispatch, is killed
    inside its dispatch (which the others begin a second later: its first exchange is under way), or sleeps
    past the deadline or is killed between a low-latency dispatch and its combine. The others must raise within
    timeout_s + 2 s, and the late rank too (it must not sum rows its peers never sent); then the ranks still
    alive make a new group and a correct call on it."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    combine = what in COMBINES
    warm_kernels(seed, backend, SHAPES.get(what, [("normal", {})]))
    buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S)
    x, topk_idx, weights = _inputs(seed, num_ranks, backend=backend)[rank]
    if combine:
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, NUM_EXPERTS, use_fp8=False)
    if rank == 1 and what in KILLED:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if what == "killed_in_its_call":
        time.sleep(0 if rank == 1 else 1.0)
    elif rank == 1:
        time.sleep(TIMEOUT_S + 1.5)
    start, error = time.monotonic(), None
    try:
        if combine:
            buffer.low_latency_combine(recv_x, topk_idx, weights, handle)
        else:
            _dispatch(buffer, x, topk_idx, weights)
        _raise_recorded(buffer, backend, seed, num_ranks)
    except TokenyardError as exc:
        error = f"{type(exc).__name__}: {exc}"
    detected_s = time.monotonic() - start
    # The old group holds unfinished collectives (or a dead rank): the survivors make a new one, which waits
    # for a late rank's call to end, so no rank frees its buffer while a peer's kernels may still write to it.
    survivors = [r for r in range(num_ranks) if not (what in KILLED and r == 1)]
    group = survivors_group(survivors)
    buffer.destroy()
    return {"error": error, "detected_s": detected_s, "recovered": correct_call(group, seed + 1, backend)}


def skewed_buffer(seed, what, backend="reference") -> dict:
    """Every rank makes a Buffer with a deadline of 10 us, as a decoder that masks late peers sets, the last rank
    a whole destroy meeting and a second late ("buffer_late_rank"), as a survivor may come after a meeting that
    a lost peer ended on the others at once: the constructor's agreement waits for it (NOTE [making after a
    meeting] in collectives.py), so does the destroy meeting, and a correct call follows."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError
    from tokenyard.backends.collectives import meeting_wait_s

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if what != "buffer_late_rank":
        raise ValueError(f"unknown scenario {what!r}")
    if rank == num_ranks - 1:
        time.sleep(meeting_wait_s(1e-5) + 1.0)
    error = None
    try:
        buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=1e-5)
        buffer.destroy()
    except TokenyardError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "recovered": correct_call(dist.group.WORLD, seed, backend)}


def failed_buffer(seed, what, backend="reference") -> dict:
    """Rank 1 fails while making its Buffer, after the agreement ("fails_making_its_buffer": its first exchange of
    objects raises before it sends anything, as a rank out of memory raises between two). The others wait for it in
    that exchange, which must end at making_wait_s with CommTimeoutError naming them and stage "Buffer/exchange"
    (NOTE [making waits] in collectives.py), where over NCCL only the group's own timeout ended it. Rank 1 then makes
    its part of the exchange they left (the pickles' sizes: one int64), so that the group is in step again, and
    every rank makes a correct call on it."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError
    from tokenyard.backends.collectives import gather_tensors, making_wait_s
    from tokenyard.plan import devices

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if what != "fails_making_its_buffer":
        raise ValueError(f"unknown scenario {what!r}")
    gather_topology = devices.gather_topology

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("injected: out of memory while making the Buffer")

    if rank == 1:
        devices.gather_topology = out_of_memory
    start, error = time.monotonic(), None
    try:
        Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S).destroy()
    except (TokenyardError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        devices.gather_topology = gather_topology
    detected_s = time.monotonic() - start
    if rank == 1:
        time.sleep(max(0.0, making_wait_s(TIMEOUT_S) + 1.0 - detected_s))  # after the others' deadline
        gather_tensors(dist.group.WORLD, torch.zeros(1, dtype=torch.int64, device="cpu"),
                       _device(backend) or torch.device("cpu"), rank, "test/part", making_wait_s(TIMEOUT_S))
    return {"error": error, "detected_s": detected_s, "recovered": correct_call(dist.group.WORLD, seed, backend)}


def _expect_the_others_timed_out(seen, stage: str, limit_s: float) -> str:
    """Every rank but rank 1 (at fault) raised CommTimeoutError naming itself and `stage`, between `limit_s` (its
    wait's deadline) and 2 s later; every rank recovered. -> rank 0's error."""
    for rank, s in seen.items():
        if rank != 1:
            assert s["error"] is not None and s["error"].startswith(f"CommTimeoutError: rank {rank} timed out") and \
                f"'{stage}'" in s["error"], (rank, s)
            assert limit_s <= s["detected_s"] < limit_s + 2, (rank, s)
        assert s["recovered"], (rank, s)
    return seen[0]["error"]


def expect_failed_buffer(seen) -> str:
    """Assert what every rank of `failed_buffer` must have seen; -> rank 0's error."""
    from tokenyard.backends.collectives import making_wait_s

    assert seen[1]["error"] == "RuntimeError: injected: out of memory while making the Buffer", seen[1]
    return _expect_the_others_timed_out(seen, "Buffer/exchange", making_wait_s(TIMEOUT_S))


def late_over_nccl(seed, what, backend="reference") -> dict:
    """Over an NCCL group (a GPU per rank, CUDA tensors), rank 1 comes to a reference-backend dispatch more than
    meeting_wait_s of the deadline late ("late_to_a_reference_call"). The others' host read of the call's header
    must end there with CommTimeoutError naming them and stage "dispatch/agree" (NOTE [bounded reads] in
    collectives.py), where it waited for the group's own timeout. Rank 1 then makes its part of the header exchange
    they left (HEADER_INTS int64), so that the group is in step again, and every rank makes a correct call on it."""
    import torch.distributed as dist

    from tokenyard import Buffer, TokenyardError
    from tokenyard.backends.collectives import HEADER_INTS, meeting_wait_s

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if what != "late_to_a_reference_call" or dist.get_backend() != "nccl":
        raise ValueError(f"scenario {what!r} runs over an NCCL group")
    buffer = Buffer(dist.group.WORLD, 1 << 22, _rdma_bytes(num_ranks), backend=backend, timeout_s=TIMEOUT_S)
    start, error = time.monotonic(), None
    if rank == 1:
        time.sleep(meeting_wait_s(TIMEOUT_S) + 1.0)
        part = torch.zeros(HEADER_INTS, dtype=torch.int64, device=_device(backend))
        dist.all_gather([torch.empty_like(part) for _ in range(num_ranks)], part)
        torch.cuda.synchronize()
    else:
        try:
            _dispatch(buffer, *_inputs(seed, num_ranks, backend=backend)[rank])
        except TokenyardError as exc:
            error = f"{type(exc).__name__}: {exc}"
    detected_s = time.monotonic() - start
    buffer.destroy()
    return {"error": error, "detected_s": detected_s, "recovered": correct_call(dist.group.WORLD, seed + 1, backend)}


def expect_late_over_nccl(seen) -> str:
    """Assert what every rank of `late_over_nccl` must have seen; -> rank 0's error."""
    from tokenyard.backends.collectives import meeting_wait_s

    assert seen[1]["error"] is None, seen[1]
    return _expect_the_others_timed_out(seen, "dispatch/agree", meeting_wait_s(TIMEOUT_S))


def run(num_ranks, fn, seed, what, backend="reference", group_timeout_s=10, use_cuda=None) -> dict:
    """Every rank's view of scenario `what` of `fn` (`mismatch`, `buffer_mismatch`, `late_peer`, ...), ``{rank:
    dict}``, in processes of its own whose group's own timeout is `group_timeout_s`, on GPUs with the CUDA backend or
    `use_cuda`. In KILLED, rank 1 must end by SIGKILL (noticed by its end, not a deadline) and is left out; any other
    rank that fails raises RanksFailed."""
    from tokenyard.tools.launch import RanksFailed, run_on_ranks

    try:
        seen = run_on_ranks(num_ranks, fn, seed, what, backend, use_cuda=backend == "cuda" if use_cuda is None
                            else use_cuda, timeout_s=120, group_timeout_s=group_timeout_s)
    except RanksFailed as failed:
        if what not in KILLED or set(failed.failures) != {1}:
            raise
        assert failed.failures[1].startswith(f"its process ended with exit code -{int(signal.SIGKILL)}"), \
            failed.failures[1]
        return failed.results
    assert what not in KILLED, "rank 1 was to be killed, yet every rank reported"
    return dict(enumerate(seen))


def expect_mismatch(seen, what, backend="reference") -> str:
    """Assert what every rank of `mismatch` must have seen; -> rank 0's error. Every rank raises within
    LIMIT_S and recovers; shapes that disagree give RankMismatchError naming rank 0, alike on every rank (on
    the CUDA backend, CommTimeoutError where a rank waits for signals that never come: CUDA_TIMEOUTS, but for
    a skipped normal-mode call on nodes, whose calls agree as the reference backend's do)."""
    errors = [s["error"] for s in seen.values()]
    internode = any(s["internode"] for s in seen.values())
    if backend == "cuda" and what in CUDA_TIMEOUTS and not (internode and what == "skipped_dispatch"):
        assert all(e is not None and e.startswith("CommTimeoutError") for e in errors), errors
        if what != "skipped_dispatch":
            assert all("another shape" in e for e in errors), errors
    else:
        assert all(e is not None and e.startswith("RankMismatchError") and "ranks [0]" in e for e in errors), errors
        assert len(set(errors)) == 1, f"the ranks raised different errors: {errors}"
    assert all(s["detected_s"] < LIMIT_S and s["recovered"] for s in seen.values()), seen
    return errors[0]


def expect_late(seen, what, backend="reference") -> None:
    """Assert what each rank (by rank) of `late_peer` must have seen: every rank alive raised (a late one's
    peers and itself: a timeout), the others than rank 1 within LIMIT_S at a stage of the call rank 1 was
    late to, naming themselves (and, on the CUDA backend, whose kernels know whom they waited for, rank 1 as
    the peer), and every one alive recovered."""
    stage = "low_latency_combine/" if what in COMBINES else "dispatch/"
    for rank, s in seen.items():
        assert s["error"] is not None, (rank, s)
        if what not in KILLED:
            assert "timed out" in s["error"], (rank, s)
        if rank != 1:
            assert s["detected_s"] < LIMIT_S and f"rank {rank}" in s["error"] and stage in s["error"], (rank, s)
            assert backend != "cuda" or "peer rank 1 " in s["error"], (rank, s)
        assert s["recovered"], (rank, s)
