"""Launch configurations of the CUDA backend are pure functions (checked on CPU)."""

import pytest

from tokenyard.backends.cuda import heuristics


def test_data_grid_splits_the_allowed_sms_and_keeps_one_block_of_each_role():
    assert heuristics.data_grid(24, 132, 0.5) == heuristics.DataGrid(24, 12)
    assert heuristics.data_grid(24, 132, 2 / 3) == heuristics.DataGrid(24, 16)
    assert heuristics.data_grid(200, 132, 0.5) == heuristics.DataGrid(132, 66)   # never more than the GPU has
    assert heuristics.data_grid(1, 132, 0.5) == heuristics.DataGrid(2, 1)        # one sender, one receiver
    assert heuristics.data_grid(4, 132, 0.99) == heuristics.DataGrid(4, 3)


def test_layout_grid_covers_every_token_with_at_most_one_block_per_sm():
    assert heuristics.layout_grid(4096, 256, 132) == 16
    assert heuristics.layout_grid(1, 256, 132) == 1
    assert heuristics.layout_grid(10**6, 256, 132) == 132


def test_low_latency_blocks_give_every_peer_a_group_and_the_own_rank_half_a_share(monkeypatch):
    from tokenyard import env

    monkeypatch.delenv("TOKENYARD_TUNING", raising=False)
    env.settings.cache_clear()
    assert heuristics.low_latency_local_blocks(132, 4) == 19     # 113 blocks left: 38, 38, 37 for the peers
    assert heuristics.low_latency_local_blocks(132, 2) == 44
    assert heuristics.low_latency_local_blocks(132, 8) == 9
    assert heuristics.low_latency_local_blocks(132, 1) == 132    # no peer: every block writes to its own rank
    assert heuristics.low_latency_local_blocks(4, 4) == 1        # one block per peer is enough
    with pytest.raises(ValueError, match="each of 7 peers"):
        heuristics.low_latency_local_blocks(7, 8)
    for num_ranks in (1, 2, 4, 8):  # the fewest SMs the CUDA backend accepts serve both modes' grids
        fewest = heuristics.fewest_sms(num_ranks)
        assert heuristics.data_grid(24, fewest, 0.5).num_blocks == fewest == max(2, num_ranks)
        assert 1 <= heuristics.low_latency_local_blocks(fewest, num_ranks) <= fewest - (num_ranks - 1)
    try:
        monkeypatch.setenv("TOKENYARD_TUNING", "low_latency_local_share=0.25")
        env.settings.cache_clear()
        assert heuristics.low_latency_local_blocks(132, 4) == 33
    finally:
        monkeypatch.delenv("TOKENYARD_TUNING", raising=False)
        env.settings.cache_clear()


def test_launch_choices_come_from_the_heuristics_unless_tokenyard_tuning_overrides_them(monkeypatch):
    from tokenyard import env

    monkeypatch.delenv("TOKENYARD_TUNING", raising=False)
    env.settings.cache_clear()
    try:
        assert heuristics.dispatch_send_share(2) == heuristics.DISPATCH_SEND_SHARE_BY_RANKS[2]
        assert heuristics.dispatch_send_share(5) == heuristics.DISPATCH_SEND_SHARE
        assert heuristics.combine_send_share(2) == heuristics.COMBINE_SEND_SHARE_BY_RANKS[2]
        assert heuristics.combine_send_share(4) == heuristics.COMBINE_SEND_SHARE
        assert heuristics.data_grid(24, 132, heuristics.combine_send_share(4)).num_send_blocks == 9
        assert heuristics.combine_send_share(8) == heuristics.COMBINE_SEND_SHARE_BY_RANKS[8]
        assert heuristics.data_grid(24, 132, heuristics.combine_send_share(8)).num_send_blocks == 12
        assert heuristics.combine_own_rows_direct() is heuristics.COMBINE_OWN_ROWS_DIRECT
        flipped = "off" if heuristics.COMBINE_OWN_ROWS_DIRECT else "on"
        monkeypatch.setenv("TOKENYARD_TUNING",
                           f"dispatch_share=0.625, combine_share=0.25,combine_own_rows_direct={flipped}")
        env.settings.cache_clear()
        assert (heuristics.dispatch_send_share(2), heuristics.combine_send_share(4)) == (0.625, 0.25)
        assert heuristics.combine_own_rows_direct() is not heuristics.COMBINE_OWN_ROWS_DIRECT
        assert heuristics.dispatch_own_rows_direct() is heuristics.DISPATCH_OWN_ROWS_DIRECT  # not overridden
        for bad in ("dispatch_share=1.0", "share=0.5", "combine_own_rows_direct", "combine_own_rows_direct=maybe"):
            monkeypatch.setenv("TOKENYARD_TUNING", bad)
            env.settings.cache_clear()
            with pytest.raises(ValueError, match="TOKENYARD_TUNING"):
                env.settings()
    finally:
        monkeypatch.delenv("TOKENYARD_TUNING", raising=False)
        env.settings.cache_clear()
