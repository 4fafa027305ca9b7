"""The constants Python reads from the CUDA headers (tokenyard/plan/headers.py): found, and used whole."""

from __future__ import annotations

import pytest

from tokenyard.backends.cuda import failures
from tokenyard.plan import headers, workspace


def test_every_stage_a_kernel_can_record_has_a_name_in_errors():
    stages = headers.enum("sync.cuh", "Stage")
    assert set(stages) == set(failures.STAGE_NAMES), "a Stage of sync.cuh without a name here, or a name too many"
    assert len(set(stages.values())) == len(stages) and len(set(failures.STAGE_NAMES.values())) == len(stages)


def test_the_buffers_python_lays_out_leave_room_for_what_the_kernels_write_there():
    signatures_end = (headers.constant("layout.cuh", "kSignaturesOffset")
                      + 4 * failures.MAX_RANKS * failures.MAX_SIGNATURE_INTS * 4)
    assert signatures_end <= workspace.NOTIFY_DATA_OFFSET < workspace.NORMAL_HEADER_BYTES
    counters_end = 8 * 4  # done counters, epochs and tags: LowLatencyBuffers in layout.cuh
    assert headers.constant("layout.cuh", "kVerdictsAt") >= counters_end
    verdicts_end = headers.constant("layout.cuh", "kVerdictsAt") + 3 * 32 * 8  # [3 stages][32 peers] uint64
    assert headers.constant("layout.cuh", "kGroupCountersAt") >= verdicts_end
    assert workspace.LOW_LATENCY_STATE_BYTES == verdicts_end + 32 * 4  # then [32 destinations] uint32


def test_a_name_the_header_lacks_is_an_error_not_a_guess():
    with pytest.raises(LookupError):
        headers.enum("sync.cuh", "NoSuchEnum")
    with pytest.raises(LookupError):
        headers.constant("layout.cuh", "kNoSuchConstant")
