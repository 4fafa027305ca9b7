"""Bounded buffers: normal-mode calls in rounds equal the one-shot calls bit for bit (NOTE [rounds])."""

import json
import pathlib
import subprocess
import sys

import pytest

from tokenyard.plan import workspace

from . import bounded_scenarios

# 4 ranks with very different token counts, one with none: rounds of 1 token, a prime number, an uneven
# last round (23 = 10 + 10 + 3) and exactly the largest count (one round).
TOKEN_COUNTS = [23, 3, 0, 17]


@pytest.mark.parametrize("per_round_tokens", [1, 7, 10, 23])
def test_rounds_of_any_size_match_one_shot_dispatch_cached_dispatch_and_combine(ranks, seed, per_round_tokens):
    results = ranks(4).run(bounded_scenarios.rounds_match_one_shot, seed, TOKEN_COUNTS, 128, 16, 4, "bf16",
                           per_round_tokens)
    assert results == [-(-23 // per_round_tokens)] * 4


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_budget_alone_sets_the_round_size_for_fp8_tuples_and_bf16(ranks, seed, dtype):
    # Room for 5 combine rows (hidden 256 bf16 + 16 weights: 640 bytes) per rank. FP8 dispatch rows are
    # narrower (512), so rounds of 5 (the combine replays them); bf16 dispatch rows with top-16 are wider
    # (768): rounds of 4.
    combine_row = workspace.normal_combine_row_bytes(256, 16)
    budget = workspace.normal_required_bytes(2, 5, combine_row)
    fp8 = dtype == "fp8"
    dispatch_row = workspace.normal_dispatch_row_bytes(256 if fp8 else 512, 8 if fp8 else 0, 16)
    assert (combine_row, dispatch_row) == (640, 512 if fp8 else 768)
    round_tokens = min(workspace.normal_token_capacity(budget, 2, row) for row in (dispatch_row, combine_row))
    assert round_tokens == (5 if dtype == "fp8" else 4)
    results = ranks(2).run(bounded_scenarios.rounds_match_one_shot, seed, [12, 29], 256, 32, 16, dtype,
                           num_nvl_bytes=budget, expert_alignment=4)
    assert results == [-(-29 // round_tokens)] * 2


@pytest.mark.parametrize("per_round_tokens", [4, 7])
def test_num_worst_tokens_fixes_the_rounds_without_a_host_sync(ranks, seed, per_round_tokens):
    num_worst_tokens = 4 * 23 + 3  # rounds cover ceil(95 / 4) = 24 tokens per rank
    results = ranks(4).run(bounded_scenarios.rounds_match_one_shot, seed, TOKEN_COUNTS, 128, 16, 4, "bf16",
                           per_round_tokens, num_worst_tokens=num_worst_tokens)
    assert results == [-(-24 // per_round_tokens)] * 4


def test_env_cap_bounds_a_huge_buffer_and_the_calls_run_in_rounds(ranks, seed):
    assert ranks(2).run(bounded_scenarios.env_cap_bounds_the_buffer, seed, [10, 4], 128, 8, 2) == [4, 4]


def test_requests_that_cannot_run_say_what_they_need(ranks):
    for messages in ranks(2).run(bounded_scenarios.refusals, 9, 128, 16, 16):
        assert set(messages) == {"never fits", "per_round_tokens", "num_worst_tokens", "past num_worst_tokens"}


def test_bounded_benchmark_runs_on_gloo_ranks_and_writes_its_json(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[2]
    path = tmp_path / "bounded.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bounded.py"), "--json", str(path), "--iters", "2",
                           "--warmup", "0"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "| rounds |" in done.stdout
    doc = json.loads(path.read_text())
    assert {"commit", "device", "date", "budget_bytes", "runs", "unbounded_4096"} <= set(doc)
    figures = {"num_tokens", "num_rounds", "dispatch_us", "combine_us", "dispatch_nvlink_gbps", "combine_nvlink_gbps",
               "peak_bytes"}
    for entry in doc["runs"] + [doc["unbounded_4096"]]:
        assert figures <= set(entry), sorted(entry)
        assert entry["dispatch_us"] > 0 and entry["combine_nvlink_gbps"] > 0
    assert [(e["num_tokens"], e["num_rounds"]) for e in doc["runs"]] == [(24, 1), (96, 2)]
    assert doc["unbounded_4096"]["num_rounds"] == 1


def test_a_fresh_dispatch_agrees_on_rounds_only_after_its_count_exchange():
    """NOTE [agree after the count exchange]: when round 0's backend call fails (a peer skipped the call and
    the bounded count exchange timed out), no host collective has been started that the peer never joins."""
    import torch

    from tokenyard.backends.requests import DispatchRequest
    from tokenyard.config import Config
    from tokenyard.errors import CommTimeoutError
    from tokenyard import rounds

    num_tokens, num_ranks = 6, 2
    topk_idx = torch.randint(0, 4, (num_tokens, 2))
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool).scatter_(1, topk_idx // 2, True)
    request = DispatchRequest(torch.randn(num_tokens, 8), None, topk_idx, torch.rand(num_tokens, 2),
                              in_rank.sum(0, dtype=torch.int32), in_rank, torch.bincount(topk_idx.flatten(), minlength=4),
                              None, 1, 0, Config())
    calls = []

    class SkippedPeer:
        def dispatch(self, round_request):
            calls.append(("dispatch", round_request.x.size(0)))
            raise CommTimeoutError(0, 1, "dispatch/notify", "the peer never arrived")

    class Exchange:
        num_ranks, rank = 2, 0

        def max_int(self, value):
            calls.append(("max_int", value))
            return value

    with pytest.raises(CommTimeoutError):
        rounds.dispatch(SkippedPeer(), request, round_tokens=4, exchange=Exchange(), check_values=False)
    assert calls == [("dispatch", 4)], calls
