"""DeepEP programs that set torch's default device and dtype run unchanged on the CUDA backend (device machine only;
issue 47): DeepEP's tests call `torch.set_default_device("cuda")` and `torch.set_default_dtype(torch.bfloat16)`, as
many training scripts do. tests/cpu/api_scenarios.py's calls (normal mode, low-latency mode with and without hooks,
ElasticBuffer, internode normal mode on 2 virtual nodes), their Buffers made under those defaults, run twice there
(the second through the fast paths, NOTE [fast paths]) and once without: the same outputs bit for bit. The CPU
variant (a meta default device) is tests/cpu/test_torch_defaults.py."""

from __future__ import annotations

import pytest

from ..cpu import api_scenarios
from . import spawn

pytestmark = spawn.needs_ranks()


@pytest.mark.parametrize("num_ranks", spawn.rank_counts())
def test_every_call_gives_the_same_outputs_under_a_cuda_default_device_and_bf16_default_dtype(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    # Internode normal mode on "auto": the CUDA backend's internode kernels where NVSHMEM is installed, else the
    # reference backend's hierarchical path (NOTE [internode normal mode]).
    # Ranks of its own: the internode Buffer starts NVSHMEM, once per process (tests/gpu/spawn.py).
    spawn.run(num_ranks, api_scenarios.same_outputs_under_torch_defaults, seed, "cuda", "cuda", "auto", "cuda",
              fresh=True)


@pytest.mark.parametrize("num_ranks", spawn.rank_counts(largest_only=True))
def test_every_tensor_of_every_return_and_handle_is_contiguous_where_deepeps_is(num_ranks, seed):
    spawn.skip_on_virtual_nodes(num_ranks, spawn.ONE_NODE_BUFFER)
    spawn.run(num_ranks, api_scenarios.handles_and_returns_are_contiguous, seed, "cuda", "auto", "cuda", fresh=True)
