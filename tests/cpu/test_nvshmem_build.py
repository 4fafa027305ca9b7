"""What NVSHMEM's pieces need to build, without a GPU (NOTE [NVSHMEM units], NOTE [NVSHMEM host shim] in
tokenyard/jit/nvshmem.py): where the internode extra is installed, the host shim builds with g++ and exports the
calls Transport makes, and the transport check kernel compiles and links into a cubin that holds its entry symbol.
CI installs the extra where its package index has it (.ci/run)."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from tokenyard.backends.cuda import kernels
from tokenyard.jit import compiler as compilers
from tokenyard.jit import nvshmem

pytestmark = pytest.mark.skipif(nvshmem.find() is None, reason="the internode extra (NVSHMEM) is not installed")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_host_shim_builds_once_and_exports_every_call(tmp_path):
    path = nvshmem.shim_path(str(tmp_path))
    assert nvshmem.shim_path(str(tmp_path)) == path  # built once, found the second time
    shim = ctypes.CDLL(path)
    for name in ("uid_bytes", "uid", "init", "my_pe", "n_pes", "version", "calloc", "free", "ptr", "barrier_all",
                 "cumodule_init", "cumodule_finalize", "finalize"):
        assert hasattr(shim, f"tokenyard_nvshmem_{name}"), name
    assert shim.tokenyard_nvshmem_uid_bytes() > 0


@pytest.mark.skipif(compilers.nvcc_path() is None, reason="no nvcc")
def test_an_nvshmem_unit_links_into_a_cubin_with_its_entry():
    spec = kernels.transport_check()
    cubin = nvshmem.linker().compile(spec.source(), "sm_90", compilers.include_dirs(spec))
    assert cubin.startswith(b"\x7fELF") and spec.entry.encode() + b"\0" in cubin
    assert "nvshmem " + nvshmem.find().version in nvshmem.linker().identity  # in the kernel cache's key


@pytest.mark.skipif(compilers.nvcc_path() is None, reason="no nvcc")
def test_only_a_counting_unit_holds_the_operation_counters():
    """NOTE [operation counters]: the counters exist in the counting variant, by the unmangled name the host looks
    up, and not in the default unit (ci_compile checks every NVSHMEM unit so)."""
    from tokenyard.backends.cuda import transport

    spec = kernels.internode_dispatch()
    for unit, counts in ((spec, False), (transport.counting(spec), True)):
        cubin = nvshmem.linker().compile(unit.source(), "sm_90", compilers.include_dirs(unit))
        assert unit.entry.encode() + b"\0" in cubin
        assert (transport.COUNTERS_SYMBOL.encode() + b"\0" in cubin) is counts


def test_a_process_whose_nvshmem_serves_one_group_refuses_another_before_any_collective(monkeypatch):
    """NOTE [NVSHMEM start]: one world per process. `Transport.refusal` says so without starting anything, so that
    every rank of a second group can agree to take the path without NVSHMEM (the CUDA backend's low-latency
    buffer, NOTE [internode low-latency])."""
    from tokenyard.backends.cuda import transport

    assert transport.Transport.refusal((0, 1, 2, 3)) is None  # nothing started here
    started = transport.Transport.__new__(transport.Transport)
    started.ranks = (0, 1, 2, 3)
    monkeypatch.setattr(transport, "_started", started)
    assert transport.Transport.refusal((0, 1, 2, 3)) is None
    assert "one world per process" in transport.Transport.refusal((4, 5, 6, 7))


def test_a_process_that_abandoned_nvshmem_refuses_to_start_it_again_before_any_collective(monkeypatch):
    """NOTE [NVSHMEM stop]: after a lost peer, NVSHMEM's world in this process still counts it, so a Buffer of the same
    group (or another) is refused at once, without waiting for a collective that the lost rank cannot join."""
    from tokenyard.backends.cuda import transport
    from tokenyard.errors import BackendUnavailableError

    started = transport.Transport.__new__(transport.Transport)
    started.ranks, started.users = (0, 1, 2, 3), 1
    monkeypatch.setattr(transport, "_started", started)
    started.abandon()

    def no_collective(_):
        raise AssertionError("a refused start made a collective")

    for ranks in ((0, 1, 2, 3), (0, 2, 3)):
        assert "cannot start again" in transport.Transport.refusal(ranks)
        with pytest.raises(BackendUnavailableError, match="cannot start again"):
            transport.Transport.start(0, len(ranks), no_collective, ranks, 1 << 20, False)
    assert started.users == 1


def test_a_rank_held_in_an_nvshmem_collective_says_so_until_it_returns(monkeypatch, capfd):
    """NOTE [NVSHMEM waits]: NVSHMEM's collectives wait without a deadline and cannot be interrupted; while a rank
    waits in one, its process prints which rank waits in which, again and again, and stops once the call returns."""
    import time

    from tokenyard.backends.cuda import transport

    class HeldShim:
        def tokenyard_nvshmem_free(self, _):
            time.sleep(0.5)

    monkeypatch.setattr(transport, "STUCK_REPORT_S", 0.1)
    held = transport.Transport.__new__(transport.Transport)
    held.shim, held.rank = HeldShim(), 2
    held.free(0x1000)
    reports = [line for line in capfd.readouterr().err.splitlines() if line]
    assert len(reports) >= 2, reports
    assert all("rank 2 has waited" in line and "NVSHMEM's free" in line for line in reports), reports
    time.sleep(0.3)
    assert capfd.readouterr().err == "", "the reports went on after the call returned"
