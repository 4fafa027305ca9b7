"""Launch configurations of the CUDA backend are pure functions (checked on CPU)."""

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
