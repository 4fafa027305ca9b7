"""The call-plan runner (csrc/call_plan.cpp, NOTE [call plans]) on the CPU: built as on a GPU machine, run with
CPU tensors and a recording stand-in for the CUDA driver, so what it would launch is checked byte by byte."""

from __future__ import annotations

import ctypes
import glob
import os
import random
import types
import weakref

import pytest
import torch

from tokenyard.backends.cuda import plans
from tokenyard import env
from tokenyard.jit import KernelSpec, Param
from tokenyard.jit.host import build_key, call_plans

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_MEMSET8 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p)
_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class FakeDriver:
    """Records what the runner asks of the driver; memsets really fill the (CPU) memory."""

    def __init__(self, fail_launch: int = 0):
        self.calls = []
        self.fail_launch = fail_launch
        self.capturing = False

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            words = (ctypes.c_void_p * 5).from_address(extra)
            size = ctypes.c_size_t.from_address(words[3]).value
            self.calls.append(("launch", function, gx, bx, shared, stream, ctypes.string_at(words[1], size)))
            return self.fail_launch

        def record(event, stream):
            self.calls.append(("record", event, stream))
            return 0

        def wait(stream, event, flags):
            self.calls.append(("wait", stream, event))
            return 0

        def memset8(ptr, value, count, stream):
            ctypes.memset(ptr, value, count)
            self.calls.append(("memset", value, count, stream))
            return 0

        def capturing(stream, status):
            status[0] = int(self.capturing)
            return 0

        self._keep = (_LAUNCH(launch), _RECORD(record), _WAIT(wait), _MEMSET8(memset8), _CAPTURING(capturing))
        self.addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in self._keep]


class FakeKernel:
    def __init__(self, spec: KernelSpec, handle: int):
        self.spec, self.handle, self.prepared = spec, handle, []

    def prepare(self, shared_bytes: int) -> int:  # as driver.Kernel.prepare: at least the spec's, every launch's
        self.prepared.append(shared_bytes)
        return max(shared_bytes, self.spec.shared_bytes)


SPEC = KernelSpec("h.cuh", "ns::kernel", (), (
    Param("const int*", "src"), Param("int", "n"), Param("int64_t*", "dst"), Param("uint32_t", "seq"),
    Param("float*", "maybe"), Param("uint64_t", "timeout"), Param("int", "rows")), 128)


def _args(b):
    """SPEC's arguments, by name (null pointers, n 1, rows 2)."""
    return dict(src=b.inp("src"), n=1, dst=0, seq=b.scalar("seq"), maybe=0, timeout=0, rows=2)


@pytest.fixture(scope="module")
def extension(request):
    folder = os.path.join(env.settings().cache_dir, "host", build_key())
    if not glob.glob(os.path.join(folder, "*.so")):  # a first build takes tens of seconds: say so as it starts
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\nbuilding the C++ host extension once, into {folder} (about half a minute on 2 cores)",
                  flush=True)
    return call_plans()


@pytest.fixture
def driver(extension, monkeypatch):
    fake = FakeDriver()
    extension.set_driver(*fake.addresses)
    monkeypatch.setattr(plans, "module", lambda: extension)
    return fake


def test_run_fills_slots_allocates_and_orders_streams(driver):
    rng = random.Random()
    n, seq, rows, handle = rng.randrange(1, 1000), rng.randrange(1 << 32), rng.randrange(1, 9), rng.randrange(1, 1 << 40)
    timeout = rng.randrange(1 << 63)
    kernel = FakeKernel(SPEC, handle)
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"), poison_outputs=True)
    b.output("counts", (4,), torch.int32, zero=True)  # the first output, zeroed; read back below
    dst = b.output("dst", (b.scalar("rows"), 3), torch.int64)
    # Given out of order: the names place them.
    b.launch(kernel, 7, dict(rows=b.scalar("rows"), timeout=timeout, maybe=b.inp("maybe"), seq=b.scalar("seq"), dst=dst,
                             n=n, src=b.inp("src")), shared_bytes=96)
    plan = b.build()
    assert plan.output_names == ("counts", "dst") and kernel.prepared == [96]
    src = torch.randint(0, 100, (5,), dtype=torch.int32)
    outputs = plan.native.run((src, None), [seq, rows], 11, 22, 0, 33, 44, True, False, 0)

    assert outputs[0].tolist() == [0, 0, 0, 0]
    assert tuple(outputs[1].shape) == (rows, 3) and outputs[1].dtype == torch.int64
    assert outputs[1].view(torch.uint8).eq(plans.POISON).all()  # poisoned before the launch
    launches = [c for c in driver.calls if c[0] == "launch"]
    assert len(launches) == 1
    _, function, grid, block, shared, stream, packed = launches[0]
    assert (function, grid, block, shared, stream) == (handle, 7, 128, 96, 22)
    want = SPEC.args_type(src.data_ptr(), n, outputs[1].data_ptr(), seq, 0, timeout, rows)
    assert packed == bytes(want)
    # The comm stream waits for the compute stream before anything, the compute stream for it after.
    order = [c for c in driver.calls if c[0] != "memset"]
    assert order[0] == ("record", 33, 11) and order[1] == ("wait", 22, 33)
    assert order[-2:] == [("record", 44, 22), ("wait", 11, 44)]
    assert all(c[3] == 22 for c in driver.calls if c[0] == "memset")


def test_run_on_the_compute_stream_and_after_the_callers_event(driver):
    kernel = FakeKernel(SPEC, 5)
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    b.launch(kernel, 1, _args(b))
    plan = b.build()
    plan.run_here(11, (None, None), [3, 0])
    assert [c[0] for c in driver.calls] == ["launch"] and driver.calls[0][5] == 11
    driver.calls.clear()
    plan.native.run((None, None), [3, 0], 11, 22, 99, 33, 44, False, False, 0)  # async: no join
    assert [c[:3] for c in driver.calls] == [("wait", 22, 99), ("launch", 5, 1)]


def test_a_failed_launch_raises(extension, monkeypatch):
    fake = FakeDriver(fail_launch=719)
    extension.set_driver(*fake.addresses)
    monkeypatch.setattr(plans, "module", lambda: extension)
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    b.launch(FakeKernel(SPEC, 5), 1, _args(b))
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA driver error 719"):
        b.build().run_here(11, (None, None), [3, 0])


def test_a_launch_that_misses_or_invents_a_parameter_is_refused_naming_it(driver):
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    with pytest.raises(ValueError, match=r"no value for \['dst', 'seq', 'maybe', 'timeout', 'rows'\]"):
        b.launch(FakeKernel(SPEC, 5), 1, dict(src=b.inp("src"), n=1))
    misspelt = _args(b)
    misspelt["row"] = misspelt.pop("rows")
    with pytest.raises(ValueError, match=r"no value for \['rows'\], no parameter for \['row'\]"):
        b.launch(FakeKernel(SPEC, 5), 1, misspelt)


def test_outputs_in_one_allocation_are_aligned_parts_filled_once(driver):
    rng = random.Random()
    rows, extra = rng.randrange(1, 50), rng.randrange(1, 9)
    kernel = FakeKernel(SPEC, 9)
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    alone = b.output("alone", (b.scalar("rows"), 2), torch.int64)
    counts, matrix, empty = b.outputs_in_one((("counts", (rows,), torch.int32),
                                              ("matrix", (3, b.scalar("rows")), torch.float32),
                                              ("empty", (0, 4), torch.int64)), zero=True)
    b.launch(kernel, 1, dict(_args(b), dst=alone, rows=b.scalar("rows")))
    b.launch(kernel, 1, dict(_args(b), src=counts, dst=matrix, maybe=empty, rows=b.scalar("rows")))
    plan = b.build()
    assert plan.output_names == ("alone", "counts", "matrix", "empty") and plan.native.num_outputs() == 4
    outputs = plan.native.run((None, None), [1, rows + extra], 11, 0, 0, 0, 0, False, False, 0)
    alone_t, counts_t, matrix_t, empty_t = outputs
    assert tuple(alone_t.shape) == (rows + extra, 2)
    assert (tuple(counts_t.shape), counts_t.dtype) == ((rows,), torch.int32)
    assert (tuple(matrix_t.shape), matrix_t.dtype) == ((3, rows + extra), torch.float32)
    assert (tuple(empty_t.shape), empty_t.dtype) == ((0, 4), torch.int64)
    assert counts_t.untyped_storage().data_ptr() == matrix_t.untyped_storage().data_ptr()
    assert alone_t.untyped_storage().data_ptr() != counts_t.untyped_storage().data_ptr()
    assert counts_t.data_ptr() % 16 == 0 and matrix_t.data_ptr() % 16 == 0  # each part 16-byte aligned
    assert counts_t.data_ptr() + rows * 4 <= matrix_t.data_ptr()  # no overlap
    assert counts_t.eq(0).all() and matrix_t.eq(0).all()
    memsets = [c for c in driver.calls if c[0] == "memset"]
    assert len(memsets) == 1 and memsets[0][2] >= (rows + 3 * (rows + extra)) * 4  # the whole, once
    launches = [c for c in driver.calls if c[0] == "launch"]
    assert launches[1][6] == bytes(SPEC.args_type(counts_t.data_ptr(), 1, matrix_t.data_ptr(), 1, empty_t.data_ptr(),
                                                  0, rows + extra))
    counts_t.fill_(7)
    assert matrix_t.eq(0).all(), "parts overlap"


def test_ordered_parts_are_handed_back_permuted_and_orders_must_be_permutations(driver):
    rng = random.Random()
    dims = [rng.randrange(1, 6) for _ in range(4)]
    order = list(range(4))
    rng.shuffle(order)
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    whole = b.whole()
    plain = b.part(whole, "plain", (3,), torch.int32)
    ordered = b.part(whole, "ordered", dims, torch.float32, order)
    b.launch(FakeKernel(SPEC, 3), 1, dict(_args(b), src=plain, maybe=ordered))
    plain_t, ordered_t = b.build().native.run((None, None), [0, 0], 11, 0, 0, 0, 0, False, False, 0)
    want = torch.empty(dims).permute(*order)
    assert (ordered_t.shape, ordered_t.stride()) == (want.shape, want.stride())
    assert ordered_t.permute(*(order.index(d) for d in range(4))).is_contiguous()
    launch = [c for c in driver.calls if c[0] == "launch"][0]
    assert launch[6] == bytes(SPEC.args_type(plain_t.data_ptr(), 1, 0, 0, ordered_t.data_ptr(), 0, 2))
    for bad in ([0, 0, 1, 2], [0, 1, 2], [1, 2, 3, 4]):
        with pytest.raises(ValueError, match="no permutation"):
            b.build().native.add_output(dims, torch.float32, -1, 0, True, bad, False)


def test_arena_outputs_take_free_blocks_name_their_offset_and_give_them_back(driver, extension):
    """NOTE [output arena]: an arena output is a block of the arena (its offset in the launch's slot) while one is
    free, else an ordinary allocation with offset -1; a block comes back, merged with its free neighbours, when its
    last tensor dies, and none is taken while the launch stream is capturing a graph."""
    rng = random.Random()
    memory = torch.empty(1 << 16, dtype=torch.uint8)  # the arena's memory: the test keeps it alive
    arena = extension.OutputArena(torch.device("cpu"), memory.data_ptr(), memory.numel(), 0)
    spec = KernelSpec("h.cuh", "ns::kernel", (), (Param("int64_t*", "dst"), Param("int64_t", "at")), 32)
    b = plans.PlanBuilder(torch.device("cpu"), (), ("rows",), arena=arena)
    dst = b.output("dst", (b.scalar("rows"), 16), torch.int64, in_arena=True)
    b.launch(FakeKernel(spec, 5), 1, dict(dst=dst, at=b.arena_offset(dst)))
    plan = b.build()

    def run(rows):
        driver.calls.clear()
        (out,) = plan.native.run((), [rows], 11, 0, 0, 0, 0, False, False, 0)
        packed = [c for c in driver.calls if c[0] == "launch"][0][6]
        ptr, at = spec.args_type.from_buffer_copy(packed).dst, spec.args_type.from_buffer_copy(packed).at
        assert ptr == out.data_ptr() and tuple(out.shape) == (rows, 16) and out.is_contiguous()
        inside = memory.data_ptr() <= out.data_ptr() < memory.data_ptr() + memory.numel()
        assert inside == (at >= 0) and (at < 0 or out.data_ptr() == memory.data_ptr() + at)
        out.copy_(torch.randint(-9, 9, out.shape))  # the block is memory to write
        return out, at

    total = arena.free_bytes()
    rows = [rng.randrange(1, 40) for _ in range(3)]
    held = [run(r) for r in rows]
    assert all(at >= 0 for _, at in held) and len({at for _, at in held}) == 3
    assert arena.free_bytes() == total - sum(-(-r * 128 // 512) * 512 for r in rows)  # 512-byte blocks
    _, too_big = run(memory.numel() // 128)  # no block that large is free: allocated elsewhere
    assert too_big == -1
    middle = held.pop(1)[1]
    held.append(run(rows[1]))  # the freed block, first fit
    assert held[-1][1] == middle
    driver.capturing = True
    assert run(1)[1] == -1  # under capture: no block
    driver.capturing = False
    held.clear()
    assert arena.free_bytes() == total and run(memory.numel() // 128)[1] == 0  # merged back into one


def test_signatures_tell_apart_what_the_checks_read(extension):
    """NOTE [call signatures]: equal exactly where dtype, device, sizes, strides, the data's offset past a 16-byte
    boundary and the plain values are."""
    sign = extension.signature
    rows, cols = random.randrange(2, 9), random.randrange(2, 9)
    x = torch.randn(rows, cols)
    assert sign((1, x, None, True, 7)) == sign((1, torch.randn(rows, cols), None, True, 7))  # values not read
    others = [(1, x.double(), None, True, 7), (1, x[:-1], None, True, 7), (1, x.t(), None, True, 7),
              (1, torch.randn(rows, cols + 1)[:, :cols], None, True, 7), (1, x, x, True, 7), (1, x, None, 1, 7),
              (1, x, None, False, 7), (1, x, None, True, 8), (2, x, None, True, 7), (1, (x, None), None, True, 7),
              (1, (x,), None, True, 7), (1, torch.randn(rows * cols + 1)[1:].view(rows, cols), None, True, 7)]
    signatures = {sign(args) for args in others} | {sign((1, x, None, True, 7))}
    assert None not in signatures and len(signatures) == len(others) + 1
    for unsigned in ([x], 1.5, "x", 1 << 70, object()):  # the full path decides what these mean
        assert sign((1, x, unsigned)) is None


def test_the_profile_counts_runs_only_while_on(extension, driver):
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    b.output("o", (4,), torch.int32, zero=True)
    b.launch(FakeKernel(SPEC, 3), 1, _args(b))
    plan = b.build()
    extension.set_profiling(True)
    try:
        extension.take_profile()
        for _ in range(3):
            plan.run_here(11, (None, None), [0, 0])
        steps = extension.take_profile()
    finally:
        extension.set_profiling(False)
    assert steps["runs"] == 3 and set(steps) == {"runs", "inputs", "outputs", "streams", "fills", "launches", "result"}
    assert all(v >= 0 for v in steps.values()) and steps["launches"] > 0
    plan.run_here(11, (None, None), [0, 0])
    assert extension.take_profile()["runs"] == 0


class _Recorder:
    """A backend stand-in whose check_failures raises what the record says (NOTE [fast calls])."""

    def __init__(self):
        self.record = (ctypes.c_int32 * 8)()

    def check_failures(self):
        if self.record[0]:
            raise RuntimeError(f"kernel failure {self.record[0]}")


class _Event:
    """EventOverlap -> EventHandle -> torch.cuda.Event, as `previous_event` nests them."""

    def __init__(self, raw):
        self.event = None if raw is None else types.SimpleNamespace(event=types.SimpleNamespace(cuda_event=raw))


def _calls(extension, recorder, comm=22, comm_id=5, enter=33, exit=44):
    calls = extension.Calls(torch.device("cpu"), ctypes.addressof(recorder.record),
                            weakref.WeakMethod(recorder.check_failures))
    calls.set_streams(comm, comm_id, enter, exit)
    return calls


def _seq_plan(kernel):
    b = plans.PlanBuilder(torch.device("cpu"), ("src", "maybe"), ("seq", "rows"))
    b.launch(kernel, 1, _args(b))
    return b.build()


def test_fast_calls_run_what_they_recorded_with_new_tickets_and_ordered_streams(driver, extension):
    rng = random.Random()
    recorder = _Recorder()
    calls = _calls(extension, recorder)
    handle = rng.randrange(1, 1 << 40)
    plan = _seq_plan(FakeKernel(SPEC, handle))
    src = torch.randint(0, 100, (rng.randrange(2, 50),), dtype=torch.int32)
    extra = object()
    rows = rng.randrange(1, 9)
    assert calls.learn((0, src, rows), plan.native, extra, [-1, rows], True, 64, [])
    assert not calls.learn((0, [src]), plan.native, extra, [], False, 0, [])  # a list has no signature

    def seqs():
        return [int.from_bytes(c[6][SPEC.args_type.seq.offset:SPEC.args_type.seq.offset + 4], "little")
                for c in driver.calls if c[0] == "launch"]

    # Another shape, rounds that do not fit, an unreadable event: nothing recorded runs, nothing is launched.
    assert calls.run((0, src[1:], rows), (src, None), 11, None, False, 0) is None
    assert calls.run((0, src, rows), (src, None), 11, None, False, 65) is None
    assert calls.run((0, src, rows), (src, None), 11, _Event(None), False, 0) is None
    assert driver.calls == [] and calls.hits == 0

    first = calls.next_ticket()  # the full path's ticket: the recorded call's runs take the next ones
    got_extra, outputs, half = calls.run((0, src, rows), (src, None), 11, None, False, 64)
    assert got_extra is extra and outputs == () and half == 0 and calls.hits == 1
    assert [c[:3] for c in driver.calls] == [("record", 33, 11), ("wait", 22, 33), ("launch", handle, 1),
                                              ("record", 44, 22), ("wait", 11, 44)]
    assert driver.calls[2][5] == 22  # on the comm stream, the compute stream joined after it
    driver.calls.clear()
    calls.run((0, src, rows), (src, None), 11, None, False, 0)  # the joined stream: straight there
    assert [c[0] for c in driver.calls] == ["launch"] and driver.calls[0][5] == 11 and calls.ran_on == 11
    driver.calls.clear()
    # Another stream, after an event, asynchronous: the comm stream first catches up with the stream that ran
    # straight, and nothing is joined after.
    calls.run((0, src, rows), (None, None), 12, _Event(77), True, 0)
    assert [c[:3] for c in driver.calls] == [("record", 33, 11), ("wait", 22, 33), ("wait", 22, 77),
                                              ("launch", handle, 1)]
    assert calls.ran_on == -1 and not calls.runs_straight(12, False, False)
    assert seqs() == [first + 3]
    assert calls.next_ticket() == first + 4

    recorder.record[0] = 7  # a kernel recorded a failure: the run raises it
    with pytest.raises(RuntimeError, match="kernel failure 7"):
        calls.run((0, src, rows), (src, None), 11, None, False, 0)


def test_fresh_calls_run_both_plans_on_one_stream_and_join_after_the_second(driver, extension):
    """NOTE [fresh calls]: the first plan goes where `run` would send a call and the call stays open there; the
    second follows it with no wait of its own, then the streams are left as after `run`; `abandon` only joins."""
    rng = random.Random()
    calls = _calls(extension, _Recorder())
    first, second = rng.sample(range(1, 1 << 40), 2)
    plan_1, plan_2 = _seq_plan(FakeKernel(SPEC, first)), _seq_plan(FakeKernel(SPEC, second))
    src = torch.randint(0, 100, (rng.randrange(2, 50),), dtype=torch.int32)
    ticket = rng.randrange(1, 1 << 31)

    def launched_seqs():
        return [int.from_bytes(c[6][SPEC.args_type.seq.offset:SPEC.args_type.seq.offset + 4], "little")
                for c in driver.calls if c[0] == "launch"]

    assert calls.run_first(plan_1.native, (src, None), [ticket, 1], 11, _Event(None), False) is None
    assert driver.calls == []  # an unreadable event: nothing launched, the full path runs
    assert calls.run_first(plan_1.native, (src, None), [ticket, 1], 11, None, False) == ()
    assert [c[:3] for c in driver.calls] == [("record", 33, 11), ("wait", 22, 33), ("launch", first, 1)]
    assert driver.calls[2][5] == 22 and not calls.runs_straight(11, False, False)  # open: nothing joined yet
    driver.calls.clear()
    assert calls.finish(plan_2.native, (src, None), [ticket, 2], False) == ()
    assert [c[:3] for c in driver.calls] == [("launch", second, 1), ("record", 44, 22), ("wait", 11, 44)]
    assert driver.calls[0][5] == 22 and launched_seqs() == [ticket]
    driver.calls.clear()
    calls.run_first(plan_1.native, (src, None), [ticket + 1, 1], 11, None, False)  # the joined stream: straight
    calls.finish(plan_2.native, (src, None), [ticket + 1, 2], False)
    assert [(c[0], c[5]) for c in driver.calls] == [("launch", 11), ("launch", 11)] and calls.ran_on == 11
    driver.calls.clear()
    # Another stream, after an event, asynchronous: the comm stream catches up with the stream that ran straight
    # and waits for the event, never for the caller's stream; nothing is joined at the end.
    calls.run_first(plan_1.native, (None, None), [ticket, 1], 12, _Event(77), True)
    calls.finish(plan_2.native, (None, None), [ticket, 2], True)
    assert [c[:3] for c in driver.calls] == [("record", 33, 11), ("wait", 22, 33), ("wait", 22, 77),
                                              ("launch", first, 1), ("launch", second, 1)]
    assert not calls.runs_straight(12, False, False)
    driver.calls.clear()
    # The host's wait raised between the plans: the caller's stream waits for the comm stream, as after a call.
    calls.run_first(plan_1.native, (None, None), [ticket, 1], 12, None, False)
    calls.abandon()
    assert [c[:3] for c in driver.calls] == [("wait", 22, 33), ("launch", first, 1), ("record", 44, 22),
                                              ("wait", 12, 44)] or \
        [c[:3] for c in driver.calls] == [("record", 33, 12), ("wait", 22, 33), ("launch", first, 1),
                                          ("record", 44, 22), ("wait", 12, 44)]
    assert calls.runs_straight(12, False, False)
    driver.calls.clear()
    calls.abandon()  # nothing open: nothing to join
    assert driver.calls == []


def test_a_counted_finish_launches_once_its_counts_came_clean_and_else_leaves_the_call_open(driver, extension):
    """NOTE [counted finish]: the second plan runs once host_counts[0] holds the ticket, its scalars set from the
    counts as `reads` say; a recorded failure, the input verdict or the deadline return None with nothing launched
    and the call still open (so `abandon` joins the streams)."""
    rng = random.Random()
    recorder = _Recorder()
    calls = _calls(extension, recorder)
    counts = (ctypes.c_int32 * 8)()
    verdict_at = rng.randrange(5, 8)
    calls.set_host_counts(ctypes.addressof(counts), verdict_at, 1e-3, 1e-5)
    first, second = rng.sample(range(1, 1 << 40), 2)
    plan_1, plan_2 = _seq_plan(FakeKernel(SPEC, first)), _seq_plan(FakeKernel(SPEC, second))
    src = torch.randint(0, 100, (rng.randrange(2, 50),), dtype=torch.int32)
    ticket, rows = rng.randrange(1, 1 << 31), rng.randrange(1, 1 << 20)

    def launched_seqs():
        return [int.from_bytes(c[6][SPEC.args_type.seq.offset:SPEC.args_type.seq.offset + 4], "little")
                for c in driver.calls if c[0] == "launch"]

    def open_call(ticket_now, stream=12):  # a stream other than the joined one: the call is open on the comm stream
        driver.calls.clear()
        calls.run_first(plan_1.native, (src, None), [ticket, 1], stream, None, False)
        counts[0] = ticket_now
        driver.calls.clear()

    # The counts came: the second plan's `seq` slot takes counts[3], the streams are left as after `finish`.
    open_call(ticket)
    counts[3] = rows
    assert calls.finish_counted(plan_2.native, (src, None), [ticket, 2], False, ticket, 5.0, [(0, 3)]) == ()
    assert [c[:3] for c in driver.calls] == [("launch", second, 1), ("record", 44, 22), ("wait", 12, 44)]
    assert launched_seqs() == [rows]
    # Another call's counts until the deadline, the verdict, a recorded failure: nothing launched, the call open.
    for stream, (ticket_now, verdict, failure) in enumerate(((ticket - 1, 0, 0), (ticket, 1, 0), (ticket - 1, 0, 3)),
                                                            13):
        open_call(ticket_now, stream)
        counts[verdict_at], recorder.record[0] = verdict, failure
        assert calls.finish_counted(plan_2.native, (src, None), [ticket, 2], False, ticket, 0.01, [(0, 3)]) is None
        assert driver.calls == []
        calls.abandon()
        assert [c[:3] for c in driver.calls] == [("record", 44, 22), ("wait", stream, 44)]
        counts[verdict_at] = recorder.record[0] = 0
    # Without host counts (a destroyed backend), nothing is waited for.
    calls.set_host_counts(0, 0, 0, 0.0)
    open_call(ticket)
    assert calls.finish_counted(plan_2.native, (src, None), [ticket, 2], False, ticket, 5.0, [(0, 3)]) is None
    calls.abandon()


def test_fast_calls_stream_order_is_the_full_paths_too(extension):
    recorder = _Recorder()
    calls = _calls(extension, recorder)
    assert not calls.runs_straight(0, False, False)  # nothing joined yet (0 is the legacy default stream)
    calls.set_joined(0)
    assert not calls.runs_straight(0, True, False) and not calls.runs_straight(0, False, True)
    assert calls.runs_straight(0, False, False) and calls.ran_on == 0
    assert calls.catch_up(0, True) == -1  # waits for that very stream anyway
    calls.set_joined(0)
    assert calls.runs_straight(0, False, False)
    assert calls.catch_up(9, True) == 0 and calls.catch_up(9, True) == -1  # once


def test_fast_calls_without_a_backend_fall_back(driver, extension):
    recorder = _Recorder()
    calls = _calls(extension, recorder)
    plan = _seq_plan(FakeKernel(SPEC, 5))
    calls.learn((1,), plan.native, "extra", [0, 0], False, 0, [])
    assert calls.take((1,)) == "extra" and calls.take((2,)) is None
    recorder.record[0] = 3
    with pytest.raises(RuntimeError, match="kernel failure 3"):
        calls.take((1,))
    record = recorder.record
    del recorder  # the backend is gone: a recorded failure sends the call to the full path, which raises
    assert calls.take((1,)) is None and calls.run((1,), (None, None), 11, None, False, 0) is None
    assert record[0] == 3 and driver.calls == []


def test_fast_low_latency_dispatches_alternate_halves_with_the_full_path(driver, extension):
    """A recorded low-latency dispatch takes the next half of the buffer, counted with the full path's, on the
    caller's stream, outside the Buffer's stream order (NOTE [fast calls])."""
    rng = random.Random()
    recorder = _Recorder()  # kept alive: the calls read its record
    calls = _calls(extension, recorder)
    plan = _seq_plan(FakeKernel(SPEC, 5))
    bases = [rng.randrange(1, 1 << 32), rng.randrange(1, 1 << 32)]
    with pytest.raises(ValueError, match="two halves"):
        calls.learn((2,), plan.native, None, [], False, 0, [[bases[0], 0]])
    assert calls.learn((2,), plan.native, "ll", [], False, 0, [[bases[0], 0], [bases[1], 0]])
    calls.set_joined(11)
    seen = []
    for expected_half in (1, 0, 1):
        extra, _, half = calls.run((2,), (None, None), 11, None, False, 0)
        seen.append(int.from_bytes(driver.calls[-1][6][SPEC.args_type.seq.offset:][:4], "little"))
        assert (extra, half) == ("ll", expected_half)
    assert seen == [bases[1], bases[0], bases[1]]
    assert all(c[0] == "launch" and c[5] == 11 for c in driver.calls) and calls.ran_on == -1
    assert calls.next_low_latency_half() == 0 and calls.latest_low_latency_half() == 0  # the full path's turn
    calls.reset_low_latency_halves()
    assert calls.latest_low_latency_half() == 0 and calls.run((2,), (None, None), 11, None, False, 0)[2] == 1
    calls.forget()
    assert calls.run((2,), (None, None), 11, None, False, 0) is None
