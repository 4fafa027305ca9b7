"""Launch configurations of the CUDA backend are pure functions (checked on CPU)."""

import pytest

from tokenyard.backends.cuda import heuristics, kernels


def test_data_blocks_take_one_block_per_allowed_sm_and_at_least_two():
    assert heuristics.data_blocks(24, 132) == 24
    assert heuristics.data_blocks(200, 132) == 132   # never more than the GPU has
    assert heuristics.data_blocks(1, 132) == 2


def test_layout_grid_covers_every_token_with_at_most_one_block_per_sm():
    assert heuristics.layout_grid(4096, 256, 132) == 16
    assert heuristics.layout_grid(1, 256, 132) == 1
    assert heuristics.layout_grid(10**6, 256, 132) == 132


def test_low_latency_blocks_give_every_peer_a_group_and_the_own_rank_half_a_share(tokenyard_env):
    tokenyard_env("TOKENYARD_TUNING", None)
    assert heuristics.low_latency_local_blocks(132, 4) == 19     # 113 blocks left: 38, 38, 37 for the peers
    assert heuristics.low_latency_local_blocks(132, 2) == 44
    assert heuristics.low_latency_local_blocks(132, 8) == 9
    assert heuristics.low_latency_local_blocks(132, 1) == 132    # no peer: every block writes to its own rank
    assert heuristics.low_latency_local_blocks(4, 4) == 1        # one block per peer is enough
    with pytest.raises(ValueError, match="each of 7 peers"):
        heuristics.low_latency_local_blocks(7, 8)
    for num_ranks in (1, 2, 4, 8):  # the fewest SMs the CUDA backend accepts serve both modes' grids
        fewest = heuristics.fewest_sms(num_ranks)
        assert heuristics.data_blocks(24, fewest) == fewest == max(2, num_ranks)
        assert 1 <= heuristics.low_latency_local_blocks(fewest, num_ranks) <= fewest - (num_ranks - 1)
    tokenyard_env("TOKENYARD_TUNING", "low_latency_local_share=0.25")
    assert heuristics.low_latency_local_blocks(132, 4) == 33


def test_launch_choices_come_from_the_heuristics_unless_tokenyard_tuning_overrides_them(tokenyard_env):
    from tokenyard import env

    tokenyard_env("TOKENYARD_TUNING", None)
    assert heuristics.dispatch_send_warps(16) == heuristics.DISPATCH_SEND_WARPS
    assert heuristics.combine_send_warps(16, 2) == heuristics.COMBINE_SEND_WARPS
    assert heuristics.combine_send_warps(16, 8) == heuristics.COMBINE_SEND_WARPS_MANY_RANKS
    assert heuristics.combine_own_rows_direct() is heuristics.COMBINE_OWN_ROWS_DIRECT
    flipped = "off" if heuristics.COMBINE_OWN_ROWS_DIRECT else "on"
    tokenyard_env("TOKENYARD_TUNING", f"dispatch_send_warps=5, combine_send_warps=7,combine_own_rows_direct={flipped}")
    assert (heuristics.dispatch_send_warps(16), heuristics.combine_send_warps(16, 4)) == (5, 7)
    assert heuristics.combine_own_rows_direct() is not heuristics.COMBINE_OWN_ROWS_DIRECT
    assert heuristics.dispatch_own_rows_direct() is heuristics.DISPATCH_OWN_ROWS_DIRECT  # not overridden
    tokenyard_env("TOKENYARD_TUNING", "combine_send_warps=16")  # a block of 16 warps keeps one to reduce
    with pytest.raises(ValueError, match="1 to 15 sending warps"):
        heuristics.combine_send_warps(16, 2)
    assert (heuristics.dispatch_stages(), heuristics.combine_stages()) == (heuristics.DISPATCH_STAGES,
                                                                          heuristics.COMBINE_STAGES)
    tokenyard_env("TOKENYARD_TUNING", "dispatch_stages=2,combine_stages=5")  # WarpStages takes 2 to 4
    assert heuristics.dispatch_stages() == 2
    with pytest.raises(ValueError, match="2 to 4 stages"):
        heuristics.combine_stages()
    tokenyard_env("TOKENYARD_TUNING", None)
    assert [heuristics.dispatch_threads(n) for n in (2, 3, 4, 8)] == [heuristics.DISPATCH_THREADS] * 2 + [
        heuristics.DISPATCH_THREADS_MANY_RANKS] * 2  # NOTE [block shapes by ranks]
    tokenyard_env("TOKENYARD_TUNING", "dispatch_threads=1024")
    assert heuristics.dispatch_threads(2) == heuristics.dispatch_threads(4) == 1024
    tokenyard_env("TOKENYARD_TUNING", "dispatch_threads=640")
    with pytest.raises(ValueError, match="512, 768 or 1024"):
        heuristics.dispatch_threads(4)
    tokenyard_env("TOKENYARD_TUNING", None)  # NOTE [combine block width]
    assert [heuristics.combine_threads(n) for n in (2, 3, 4, 8)] == [heuristics.COMBINE_THREADS] * 2 + [
        heuristics.COMBINE_THREADS_MANY_RANKS] * 2
    tokenyard_env("TOKENYARD_TUNING", "combine_threads=1024")
    assert heuristics.combine_threads(4) == 1024
    tokenyard_env("TOKENYARD_TUNING", "combine_threads=256")
    with pytest.raises(ValueError, match="combine_threads=256: a block has 512, 768 or 1024"):
        heuristics.combine_threads(4)
    tokenyard_env("TOKENYARD_TUNING", None)
    assert [heuristics.combine_reduce_loads(t) for t in (512, 768, 1024)] == [heuristics.COMBINE_REDUCE_LOADS] * 2 + [
        heuristics.COMBINE_REDUCE_LOADS_WIDE]
    tokenyard_env("TOKENYARD_TUNING", "combine_reduce_loads=6")
    assert heuristics.combine_reduce_loads(512) == heuristics.combine_reduce_loads(1024) == 6
    tokenyard_env("TOKENYARD_TUNING", "combine_reduce_loads=65")
    with pytest.raises(ValueError, match="1 to 64 loads"):
        heuristics.combine_reduce_loads(512)
    tokenyard_env("TOKENYARD_TUNING", None)  # NOTE [expanded rows]
    assert heuristics.expand_in_dispatch_min_sms() == heuristics.EXPAND_IN_DISPATCH_MIN_SMS
    cached_ranks = heuristics.EXPAND_CACHED_IN_DISPATCH_MIN_RANKS
    assert heuristics.expands_in_dispatch(heuristics.EXPAND_IN_DISPATCH_MIN_SMS, cached_ranks, fresh=False)
    assert heuristics.expands_in_dispatch(heuristics.EXPAND_IN_DISPATCH_MIN_SMS, 2, fresh=True)
    assert not heuristics.expands_in_dispatch(132, cached_ranks - 1, fresh=False)  # cached at few ranks: the gather
    assert not heuristics.expands_in_dispatch(heuristics.EXPAND_IN_DISPATCH_MIN_SMS - 1, 8, fresh=True)
    tokenyard_env("TOKENYARD_TUNING", "expand_in_dispatch_min_sms=2")
    assert heuristics.expand_in_dispatch_min_sms() == 2
    assert heuristics.expands_in_dispatch(2, 4, fresh=False) and not heuristics.expands_in_dispatch(132, 1, fresh=True)
    for bad in ("dispatch_send_warps=0", "share=0.5", "low_latency_local_share=1.0", "combine_own_rows_direct",
                "combine_own_rows_direct=maybe"):
        tokenyard_env("TOKENYARD_TUNING", bad)
        with pytest.raises(ValueError, match="TOKENYARD_TUNING"):
            env.settings()


def test_the_sm_model_gives_the_fewest_even_sms_that_fill_nvlink():
    for ranks in (2, 4, 8):
        model = heuristics.theoretical_num_sms(ranks)
        sending = heuristics.NVLINK_GBS / heuristics.sending_gbs_per_sm(ranks)  # NOTE [SM model]
        assert model % 2 == 0 and model - 2 < sending <= model, (ranks, model, sending)
    # Fewer ranks write more of their rows into their own memory, through the same SMs: more SMs fill NVLink.
    assert heuristics.sending_gbs_per_sm(2) < heuristics.sending_gbs_per_sm(4) < heuristics.sending_gbs_per_sm(8)
    assert heuristics.sending_gbs_per_sm(8) < heuristics.SM_WRITE_GBS
    assert heuristics.theoretical_num_sms(2) > heuristics.theoretical_num_sms(4) == heuristics.theoretical_num_sms(8)
    assert heuristics.theoretical_num_sms(1) == heuristics.theoretical_num_sms(2)  # one rank: taken as two
    assert heuristics.theoretical_num_sms(4, nvlink_gbs=300, sm_write_gbs=50) == 8  # 300 / (50 / (1 + 0.64 / 3))
    assert heuristics.theoretical_num_sms(4, nvlink_gbs=300, sm_write_gbs=50, sm_read_gbs=10) == 30  # receiving
    assert heuristics.theoretical_num_sms(8, nvlink_gbs=10, sm_write_gbs=50) == 8   # one block per peer at least
    for ranks in (2, 4, 8):
        counts = [heuristics.theoretical_num_sms(ranks, nvlink_gbs=g) for g in (100, 200, 300, 450)]
        assert counts == sorted(counts) and all(c % 2 == 0 and c >= heuristics.fewest_sms(ranks) for c in counts)
    with pytest.raises(ValueError):
        heuristics.theoretical_num_sms(4, sm_write_gbs=0)


@pytest.mark.parametrize("record,key", [("sm_model.json", None), ("normal.json", "sm_sweep_2ranks")])
def test_the_sm_model_sits_at_the_knee_of_the_committed_sweeps(record, key):
    """benchmarks/results/sm_model.json (4 ranks) and normal.json's 2-rank sweep: at the first measured count at or
    above the model's, every kernel has filled NVLink (within 5% of its best bandwidth); at the last below it, some
    kernel had not."""
    import json
    import pathlib

    sweep = json.loads((pathlib.Path(__file__).parents[2] / "benchmarks/results" / record).read_text())
    sweep = sweep if key is None else sweep[key]
    model = heuristics.theoretical_num_sms(sweep["num_ranks"])
    rows = sorted(sweep["compare_sm"]["tokenyard"], key=lambda row: row["num_sms"])
    filled = {}
    for kernel in ("dispatch_kernel", "dispatch_cached_kernel", "combine_kernel"):
        gbps = {row["num_sms"]: row[kernel]["nvlink_gbps"] for row in rows}
        best = max(gbps.values())
        below = [n for n in gbps if n < model]
        at = min(n for n in gbps if n >= model)
        filled[kernel] = gbps[max(below)] >= 0.95 * best
        assert gbps[at] >= 0.95 * best, (kernel, at, gbps)
    assert not all(filled.values()), (max(below), filled)


def test_the_combine_stages_hold_a_deepseek_row_and_its_weights_whole():
    """NOTE [combine weights]: at the default block shapes a BF16 row of hidden 7168 and its 8 weights are one piece
    of a stage (one bulk store a row), within the block's shared memory."""
    for ranks in (2, 4, 8):
        threads = heuristics.combine_threads(ranks)
        send_warps = heuristics.combine_send_warps(threads // 32, ranks)
        spec = kernels.combine(ranks, 7168 * 2 // 16, 8, send_warps, threads=threads)
        assert spec.template_args[7] == 7168 * 2 + 8 * 4, f"{ranks} ranks: stages of {spec.template_args[7]} bytes"
        assert spec.shared_bytes <= kernels.SM90_MAX_SHARED - kernels.SHARED_RESERVE
