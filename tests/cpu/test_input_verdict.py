"""NOTE [input verdict] on the reference backend over CPU ranks: the function the CUDA backend's GPU test runs
(tests/gpu/test_input_verdict.py)."""

import types

import pytest
import torch

from tests.gpu.test_input_verdict import judge_inputs


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_bad_values_are_refused_on_every_rank(ranks, num_ranks, seed):
    for message in ranks(num_ranks).run(judge_inputs, seed, "reference"):
        assert message.startswith("bad rank")


@pytest.mark.parametrize("call", ["fresh", "cached", "later_round"])
def test_an_internode_dispatch_hands_the_layout_kernels_bad_ids_to_its_count_exchange(call, monkeypatch):
    """On the CUDA backend the layout kernel leaves bad ids in `verdict[0]`; a fresh internode dispatch, whose count
    exchange is the reference backend's, hands them over and clears them (a cached call or a later round judges
    nothing and leaves them). Its GPU test is tests/gpu/test_input_verdict.py at virtual nodes."""
    from tokenyard import checks
    from tokenyard.backends import internode
    from tokenyard.backends.cuda.internode import InternodeCalls

    noted = []

    class Reference:
        def note_layout_bad_ids(self, seen):
            noted.append(bool(seen))

    class Backend(InternodeCalls):
        verdict = torch.tensor([checks.LAYOUT_BAD_IDS, 0], dtype=torch.int32)
        _low_latency = Reference()

        def _internode_kernels(self):
            return None

    monkeypatch.setattr(internode, "dispatch", lambda reference, request, kernels: "dispatched")
    request = types.SimpleNamespace(handle=object() if call == "cached" else None,
                                    check=None if call == "later_round" else object())
    backend = Backend()
    assert backend.internode_dispatch(request) == "dispatched"
    judged = call == "fresh"
    assert noted == ([True] if judged else [])
    assert int(backend.verdict[0]) == (0 if judged else checks.LAYOUT_BAD_IDS)
