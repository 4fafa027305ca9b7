"""The quantization definition (tokenyard.semantics.quant), in one process."""

import torch

from tokenyard.semantics import quant

from .scenarios import decode_deepep_nvfp4


def _x(seed, rows=16, hidden=1024, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * scale
    x[0] = 0.0  # an all-zero row takes the amax floor
    x[1, :128] *= 1e4  # one large group beside small ones
    return x.to(torch.bfloat16)


def _group_max(x):
    return x.float().abs().view(x.size(0), -1, 128).amax(-1).repeat_interleave(128, 1)


def test_fp8_round_trip_error_within_half_step_of_largest_binade(seed):
    x = _x(seed)
    q, scales = quant.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (16, 8) and scales.dtype == torch.float32
    error = (quant.dequantize_fp8(q, scales) - x.float()).abs()
    # e4m3's widest step is 32 (between 256 and 448): rounding errs by at most 16 units of the scale, that is
    # amax / 28, where a value lies halfway between two steps; the float32 scale and product add a few ulps.
    assert bool((error <= _group_max(x) / 28 * (1 + 1e-5) + 1e-6).all())
    assert not torch.isnan(quant.dequantize_fp8(q, scales)).any()


def test_round_scale_gives_powers_of_two_and_bounded_error(seed):
    x = _x(seed)
    q, scales = quant.quantize_fp8(x, round_scale=True)
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())
    error = (quant.dequantize_fp8(q, scales) - x.float()).abs()
    assert bool((error <= _group_max(x) / 14 + 1e-6).all())


def test_ue8m0_packs_four_exponents_per_int_and_unpacks_exactly(seed):
    x = _x(seed, hidden=2048)
    q, packed = quant.quantize_fp8(x, use_ue8m0=True)
    _, rounded = quant.quantize_fp8(x, round_scale=True)
    assert packed.dtype == torch.int32 and packed.shape == (16, 4)
    assert torch.equal(quant.unpack_ue8m0(packed), rounded)
    assert torch.equal(quant.dequantize_fp8(q, packed), quant.dequantize_fp8(q, rounded))
    # byte b of word j is group 4j+b's biased exponent
    assert int(packed[2, 0] & 0xFF) == int((rounded[2, 0].view(torch.int32) >> 23) & 0xFF)


def test_round_up_pow2_is_exact_on_powers_and_rounds_others_up():
    values = torch.tensor([0.25, 0.3, 1.0, 1.5, 3e-7, 448.0])
    want = torch.tensor([0.25, 0.5, 1.0, 2.0, 2.0 ** -21, 512.0])
    assert torch.equal(quant.round_scale_up_pow2(values), want)


def test_int8_round_trip_error_within_half_a_step(seed):
    x = _x(seed)
    q, scales = quant.quantize_int8(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    error = (quant.dequantize_int8(q, scales) - x.float()).abs()
    assert bool((error <= _group_max(x) / 254 * 1.0001 + 1e-7).all())


# -- NVFP4 (NOTE [nvfp4]) --------------------------------------------------------------------------------------

def test_nvfp4_codes_round_to_nearest_even_and_pack_low_nibble_first():
    block = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -6.0, 3.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    x = torch.tensor([block, [0.0] * 16, [7.0] + [1.0] * 15]).to(torch.bfloat16)
    q, sf = quant.quantize_nvfp4(x)  # g = 1: amax 6 gives the scale 1 exactly
    assert q.dtype == torch.uint8 and sf.dtype == torch.float8_e4m3fn and q.shape == (3, 8) and sf.shape == (3, 1)
    assert q[0].tolist() == [0x07, 0x22, 0x44, 0x66, 0xF8, 0x05, 0x21, 0x43]
    assert q[1].tolist() == [0] * 8 and float(sf[1, 0]) == 0.0  # a zero block: scale 0, codes 0
    # amax 7: the scale 7/6 rounds to 1.125 in e4m3, so 7 * (1 / 1.125) = 6.22 saturates at 6
    assert float(sf[2, 0]) == 1.125 and q[2, 0] & 0xF == 7


def test_nvfp4_round_trip_error_within_one_step_of_the_block(seed):
    x = _x(seed, hidden=256)
    g = torch.tensor(448.0 * 6.0) / x.float().abs().max()
    q, sf = quant.quantize_nvfp4(x, g)
    back = quant.dequantize_nvfp4(q, sf, g)
    block_max = x.float().abs().view(x.size(0), -1, 16).amax(-1).repeat_interleave(16, 1)
    # e2m1's widest step is 2 (4 to 6) units of sf / g ~ amax / 6, and e4m3 rounds the scale by 1/16 at most.
    assert bool(((back - x.float()).abs() <= block_max / 6 * (1 + 1 / 16) + 1e-30).all())
    assert torch.equal(quant.quantize_nvfp4(x, None)[0], quant.quantize_nvfp4(x, torch.tensor([1.0]))[0])


def test_nvfp4_scale_tiles_match_deepeps_decoding(seed):
    g = torch.Generator().manual_seed(seed)
    num_experts, rows, hidden = 3, 200, 384  # 2 row tiles (the second partial), 6 word columns
    x = (torch.randn(num_experts * rows, hidden, generator=g) * 5).to(torch.bfloat16)
    gs = torch.tensor(2.5)
    q, sf = quant.quantize_nvfp4(x, gs)
    data = quant.nvfp4_data_view(q.view(num_experts, rows, hidden // 2))
    tiles = quant.swizzle_nvfp4_scales(sf.view(num_experts, rows, hidden // 16))
    assert data.shape == (rows, hidden // 2, num_experts) and tiles.shape == (32, 4, 2, 4, 6, num_experts)
    assert tiles.permute(5, 2, 4, 0, 1, 3).is_contiguous() and data.permute(2, 0, 1).is_contiguous()
    want = quant.dequantize_nvfp4(q, sf, gs).view(num_experts, rows, hidden)
    assert torch.equal(decode_deepep_nvfp4(data, tiles, 2.5, rows, hidden), want)
    assert torch.equal(quant.unswizzle_nvfp4_scales(tiles, rows, hidden // 16).float(),
                       sf.view(num_experts, rows, -1).float())
