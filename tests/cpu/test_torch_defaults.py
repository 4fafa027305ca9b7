"""DeepEP programs that set torch's default device and dtype (DeepEP's tests, many training scripts) run unchanged:
every tensor tokenyard makes names its device and dtype (tests/cpu/api_scenarios.py; the GPU variant is
tests/gpu/test_torch_defaults_cuda.py)."""

from . import api_scenarios


def test_every_call_gives_the_same_outputs_under_a_meta_default_device_and_bf16_default_dtype(ranks, seed):
    """Normal mode (cached, worst case, one-column UE8M0 scales), low-latency mode (hooks, zero-copy), ElasticBuffer
    (expanded, without the CPU sync, cached) and internode normal mode on 2 virtual nodes of 2; the reference backend
    has no fast paths (they are the CUDA backend's)."""
    ranks(4).run(api_scenarios.same_outputs_under_torch_defaults, seed, "meta", "reference", "reference")
