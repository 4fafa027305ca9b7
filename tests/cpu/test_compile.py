"""NOTE [custom ops] on the reference backend over CPU ranks: the function the CUDA backend's GPU test runs
(tests/gpu/test_compile.py)."""

import pytest

from tests.gpu.test_compile import compiled_calls, compiled_low_latency


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_compiled_step_matches_eager(ranks, num_ranks, seed):
    for message in ranks(num_ranks).run(compiled_calls, seed, "reference"):
        assert "matched" in message


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_compiled_low_latency_step_matches_eager(ranks, num_ranks, seed):
    for message in ranks(num_ranks).run(compiled_low_latency, seed, "reference"):
        assert "matched" in message
