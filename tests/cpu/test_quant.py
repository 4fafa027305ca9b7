"""The quantization definition (tokenyard.semantics.quant), in one process."""

import torch

from tokenyard.semantics import quant


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
