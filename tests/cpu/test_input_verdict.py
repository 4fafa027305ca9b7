"""NOTE [input verdict] on the reference backend over CPU ranks: the function the CUDA backend's GPU test runs
(tests/gpu/test_input_verdict.py)."""

import pytest

from tests.gpu.test_input_verdict import judge_inputs


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_bad_values_are_refused_on_every_rank(ranks, num_ranks, seed):
    for message in ranks(num_ranks).run(judge_inputs, seed, "reference"):
        assert message.startswith("bad rank")
