"""Every refusal the foundation promises, raised with a clear message before any communication."""

import pytest

from . import scenarios

EXPECTED = {
    "topk id above range": ("InvalidInputError", "outside [-1, 8)"),
    "topk id below -1": ("InvalidInputError", "outside [-1, 8)"),
    "topk id above range, checked on the host": ("InvalidInputError", "expert id 9, outside [-1, 8)"),
    "experts not divisible by ranks": ("InvalidInputError", "not divisible"),
    "combine x not bf16": ("InvalidInputError", "dtype torch.bfloat16"),
    "x not contiguous": ("InvalidInputError", "contiguous"),
    "row not a multiple of 16 bytes": ("InvalidInputError", "multiple of 16 bytes"),
    "x not 16-byte aligned": ("InvalidInputError", "x starts 2 bytes past a 16-byte boundary"),
    "combine x not 16-byte aligned": ("InvalidInputError", "x starts 2 bytes past a 16-byte boundary"),
    "topk_weights wrong shape": ("InvalidInputError", "shape"),
    "topk_weights wrong dtype": ("InvalidInputError", "torch.float32"),
    "layout disagrees with is_token_in_rank": ("InvalidInputError", "disagrees"),
    "layout missing": ("InvalidInputError", "get_dispatch_layout"),
    "buffer too small": ("CapacityError", "needs num_nvl_bytes >="),
    "low-latency handle from another buffer": ("HandleError", "another Buffer"),
    "cached dispatch with topk": ("InvalidInputError", "cached dispatch"),
    "combine rows mismatch": ("InvalidInputError", "shape"),
    "more tokens than num_max_dispatch_tokens_per_rank": ("InvalidInputError", "exceed"),
    "fp8 hidden not a multiple of 128": ("InvalidInputError", "hidden % 128"),
    "low-latency buffer too small": ("CapacityError", "needs num_rdma_bytes >="),
    "wait_recv_cost_stats not [R] int64": ("InvalidInputError", "shape"),
    "top-k above 16 in low-latency mode": ("InvalidInputError", "maximum 16"),
    "mask without enable_shrink": ("InvalidInputError", "enable_shrink"),
    "low-latency bf16 hidden not a multiple of 8": ("InvalidInputError", "hidden % 8"),
    "async_finish with a recv hook": ("InvalidInputError", "cannot be combined"),
    "low-latency combine with more tokens than the dispatch's maximum": ("InvalidInputError",
                                                                       "num_max_dispatch_tokens_per_rank=8"),
    "use after destroy": ("TokenyardError", "destroyed"),
    "num_tokens_per_expert disagrees with topk_idx": ("InvalidInputError", "num_tokens_per_expert disagrees"),
    "is_token_in_rank disagrees with topk_idx": ("InvalidInputError", "is_token_in_rank disagrees"),
    "low-latency combine with half of the dispatch's topk_idx": ("InvalidInputError", "the dispatch had 6 tokens"),
    "handle of Nones": ("HandleError", "rank_prefix_matrix must be a torch.Tensor"),
    "handle with a float send_head": ("HandleError", "send_head must have dtype torch.int32"),
    "handle of another group size": ("HandleError", "rank_prefix_matrix must have shape"),
    "low-latency handle of Nones": ("HandleError", "src_info must be a torch.Tensor"),
    "timeout_s negative": ("InvalidInputError", "positive, finite"),
    "timeout_s not a number": ("InvalidInputError", "positive, finite"),
    "timeout_s a string": ("InvalidInputError", "positive, finite"),
}


def test_every_bad_call_has_an_expectation():
    assert set(EXPECTED) == set(scenarios.BAD_CALLS)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_refused_on_every_rank(ranks, case):
    results = ranks(2).run(scenarios.expect_error, case)
    kind, fragment = EXPECTED[case]
    for rank, (got_kind, message) in enumerate(results):
        assert got_kind == kind, f"rank {rank}: expected {kind}, got {got_kind}: {message}"
        assert fragment in message, f"rank {rank}: {message!r} does not say {fragment!r}"
