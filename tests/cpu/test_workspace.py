"""Buffer sizing (tokenyard.plan.workspace) and the CUDA kernels' launch descriptions, on CPU."""

import pytest

from tokenyard.config import Config
from tokenyard.plan import workspace


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden,scale_bytes", [(7168, 224), (7168 * 2, 0), (4096 * 2, 0)])
def test_hint_has_room_for_its_tokens_at_any_topk_up_to_16(num_ranks, hidden, scale_bytes):
    hint = Config(num_max_tokens_per_rank=4096).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
    for num_topk in (1, 8, 16):
        row = workspace.normal_dispatch_row_bytes(hidden, scale_bytes, num_topk)
        assert workspace.normal_token_capacity(hint, num_ranks, row) >= 4096
    assert workspace.normal_token_capacity(hint, num_ranks, workspace.normal_combine_row_bytes(7168, 16)) >= 4096


def test_required_bytes_and_capacity_agree():
    row = workspace.normal_dispatch_row_bytes(7168, 224, 8)
    assert row == 7552  # 7168 + 224 + 80, padded to a whole number of 128-byte lines
    assert workspace.normal_combine_row_bytes(7168, 8) == 14464  # 14336 + 32, padded
    need = workspace.normal_required_bytes(4, 4096, row)
    assert workspace.normal_token_capacity(need, 4, row) == 4096
    assert workspace.normal_token_capacity(need - 1, 4, row) == 4095


def test_low_latency_hint_grows_with_every_argument():
    base = workspace.low_latency_size_hint(128, 7168, 8, 256)
    assert workspace.low_latency_size_hint(256, 7168, 8, 256) > base
    assert workspace.low_latency_size_hint(128, 8192, 8, 256) > base
    assert workspace.low_latency_size_hint(128, 7168, 8, 288) > base


def test_every_cuda_kernel_description_generates_one_include_and_one_instantiation_and_packs_its_arguments():
    from tokenyard.backends.cuda import kernels

    specs = list(kernels.every_kernel())
    assert specs
    for spec in specs:
        source = spec.source()
        namespace, function = spec.name.rsplit("::", 1)  # NOTE [kernel names]
        assert source.count("#include") == 1 and f"namespace {namespace} {{" in source
        assert f"\n{function}(const __grid_constant__ Params p)" in source
        values = {p.name: i for i, p in enumerate(spec.params, 1)}
        packed = spec.pack(dict(reversed(values.items())))  # by name, whatever the order given
        assert [getattr(packed, p.name) for p in spec.params] == list(range(1, len(spec.params) + 1))
        with pytest.raises(ValueError, match="no value for"):
            spec.pack({name: 0 for name in list(values)[:-1]})


@pytest.mark.parametrize("args", [(128, 7168, 4, 256), (1, 128, 2, 2), (1024, 2048, 8, 64), (256, 7168, 8, 288),
                                  (128, 16, 8, 8), (128, 64, 32, 32)])
def test_low_latency_layout_fits_in_half_the_hint_without_overlaps(args):
    layout = workspace.low_latency_layout(*args)
    num_max, hidden, num_ranks, num_experts = args
    num_messages = num_ranks * num_max
    regions = sorted([(layout.dispatch_recv, num_messages * layout.dispatch_message_bytes),
                      (layout.dispatch_positions, num_messages * workspace.LOW_LATENCY_MAX_TOPK * 4),
                      (layout.dispatch_counts, num_ranks * 8),
                      (layout.dispatch_expert_counts, num_experts * 8),
                      (layout.combine_weights, num_messages * workspace.LOW_LATENCY_MAX_TOPK * 8),
                      (layout.combine_recv, num_messages * hidden * 2),
                      (layout.combine_flags, num_ranks * 8), (layout.state, workspace.LOW_LATENCY_STATE_BYTES),
                      (layout.staged_messages, num_messages * layout.dispatch_message_bytes),
                      (layout.staged_rows, num_messages * hidden * 2),
                      (layout.arrivals, (num_ranks + 1) * num_max * 8),
                      (layout.combine_deferred, (num_ranks + num_messages * -(-hidden // 512)) * 4),
                      (layout.weights_flags, num_ranks * 8),
                      (layout.staged_weights, num_messages * workspace.LOW_LATENCY_MAX_TOPK * 8)])
    for (begin, size), (next_begin, _) in zip(regions, regions[1:]):
        assert begin + size <= next_begin
    assert regions[-1][0] + regions[-1][1] <= layout.half_bytes
    assert 2 * layout.half_bytes == workspace.low_latency_size_hint(*args)
    assert layout.state == 0, "state sits at a fixed offset whatever the sizes"


def test_dispatch_slots_never_outnumber_the_buffer_slots():
    # NOTE [sender ranges]: W sender warps publish ceil(ceil(T / W) / 8) pieces each in whole chunks, the
    # backend's fallback where tail pieces need more slots than the buffer has; every call the buffer allows
    # (T up to MAX_NORMAL_TOKENS_PER_RANK) must fit MAX_CHUNKS so for any W up to 4096 (256 SMs).
    chunk = workspace.CHUNK_ROWS
    worst = max(workspace.normal_dispatch_slots(tokens, warps, chunk, chunk)
                for warps in range(1, 4097) for tokens in (workspace.MAX_NORMAL_TOKENS_PER_RANK, 65000, 4096, 257, 1))
    assert worst <= workspace.MAX_CHUNKS
    assert workspace.normal_dispatch_slots(4096, 192, 8, 8) == 192 * 3  # 21 or 22 tokens per warp: 3 pieces
    assert workspace.normal_dispatch_slots(0, 192, 8, 2) == 0
    # NOTE [tail pieces]: the last 8 tokens of a range go 2 at a time.
    assert [workspace.dispatch_pieces(n, 8, 2) for n in (1, 2, 3, 8, 9, 16, 17, 28)] == [1, 1, 2, 4, 5, 5, 6, 7]
    assert workspace.normal_dispatch_slots(4096, 192, 8, 2) == 192 * 6  # 21 or 22: 8 5 | 2 2 2 2 (or 8 6 | ...)
    # The DeepSeek-V3 benchmark's call (4096 tokens, 9 of 24 SMs sending) fits with tail pieces, and so does
    # the largest call at 132 SMs.
    assert workspace.normal_dispatch_slots(4096, 9 * 16, 8, 2) <= workspace.MAX_CHUNKS
    assert workspace.normal_dispatch_slots(workspace.MAX_NORMAL_TOKENS_PER_RANK, 49 * 16, 8, 2) <= workspace.MAX_CHUNKS
