"""Per-token, per-128-channel quantization: the one definition both backends follow bit for bit.

NOTE [quantization]
For a token row ``x[t, :]`` cut into groups of ``GROUP_SIZE`` (128) channels:

    amax  = max(max_i |x[t, g*128 + i]|, AMAX_FLOOR)            (float32)
    scale = amax / 448        (FP8 e4m3)  or  amax / 127 (INT8)  (float32, one IEEE division)
    FP8:  q = e4m3(clamp(x / scale, -448, 448))    rounding to nearest even
    INT8: q = int8(clamp(round_half_even(x / scale), -127, 127))

and ``dequantize(q) = q * scale``. With ``round_scale`` the FP8 scale is rounded *up* to the next power
of two (exactly, on the bit pattern: a scale that already is a power of two stays), so ``x / scale`` never
exceeds 448 by more than rounding. ``use_ue8m0`` (which implies ``round_scale``) stores each power-of-two
scale as its biased 8-bit exponent, four per int32 little-endian (group ``4j+b`` in byte ``b`` of word
``j``): the scales tensor is ``[T, H/512]`` int32.

The CUDA kernels perform the same float32 operations in the same order with round-to-nearest intrinsics
(no fused multiply-add), so their output equals these functions bit for bit.

NOTE [nvfp4]
NVFP4 (the low-latency dispatch's ``use_nvfp4``, from DeepEP's NVFP4 branch that SGLang and vLLM call) cuts a
row into blocks of ``NVFP4_BLOCK`` (16) channels and takes one float32 global scale ``g`` for the call
(the first value of ``x_global_scale``, which vLLM gives once per expert, all the same; 1 when not given;
callers pick ``448 * 6 / max|x|`` so that block scales fit e4m3):

    amax  = max_i |x[t, 16*b + i]|                                   (float32, no floor)
    sf    = e4m3(min((amax * g) / 6, 448))                          rounding to nearest even
    inv   = g / float(sf), or 0 where sf is 0                        (one IEEE division)
    q     = e2m1(x * inv)                                            rounding to nearest even, saturating at 6

e2m1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 in bits 0-2 and the sign in bit 3 (the sign of ``x * inv``, so a
negative value that rounds to zero keeps it); two channels share a byte, the even channel in the low nibble.
``dequantize(q) = q * float(sf) / g``. The dispatch returns DeepEP's layouts: data ``uint8 [R*M, H/2, L]`` and
scales ``float8_e4m3fn [32, 4, ceil(R*M/128), 4, ceil(H/64), L]``, each a permuted view of an expert-major
tensor (`nvfp4_data_view`, `swizzle_nvfp4_scales`: the 128 x 4 tiles a block-scaled GEMM reads, row
``r*128 + b*32 + a`` and scale column ``4*k + c`` at ``[a, b, r, c, k]``).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-4
UE8M0_PER_INT = 4
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
# e2m1 magnitudes by code (bits 0-2); q rounds to the nearest, ties to the even code, at these midpoints.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

__all__ = [
    "GROUP_SIZE", "FP8_MAX", "INT8_MAX", "AMAX_FLOOR",
    "group_amax", "round_scale_up_pow2", "quantize_fp8", "dequantize_fp8", "quantize_int8",
    "dequantize_int8", "pack_ue8m0", "unpack_ue8m0", "NVFP4_BLOCK", "quantize_nvfp4", "dequantize_nvfp4",
    "swizzle_nvfp4_scales", "unswizzle_nvfp4_scales", "nvfp4_data_view",
]


def _check_groups(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected a [num_tokens, hidden] tensor, got shape {tuple(x.shape)}")
    if x.size(1) % GROUP_SIZE != 0:
        raise ValueError(f"hidden size {x.size(1)} is not a multiple of {GROUP_SIZE}")


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` -> ``[T, H/128]`` float32: the floored absolute maximum of each 128-channel group."""
    _check_groups(x)
    grouped = x.float().abs().view(x.size(0), x.size(1) // GROUP_SIZE, GROUP_SIZE)
    return grouped.amax(dim=-1).clamp_min(AMAX_FLOOR)


def _divide(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """``values / divisor`` with one IEEE division per element on every device.

    NOTE [exact scale division]: PyTorch's CUDA division by a Python scalar multiplies by the float32
    reciprocal instead (``x * (1/448)``), which differs from ``x / 448`` in the last bit for some x, so the
    reference would quantize differently on CPU and GPU and the kernels could not match it bit for bit.
    Dividing by a tensor keeps the true division everywhere."""
    return values / torch.full_like(values, divisor)


def round_scale_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive normal float32 values up to a power of two, exactly, on the bit pattern."""
    bits = scale.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _expand(scales: torch.Tensor) -> torch.Tensor:
    """``[T, S]`` -> ``[T, S * 128]``, each scale repeated over its group (no device sync, unlike
    ``repeat_interleave``, so CUDA graphs can capture it)."""
    num_tokens, num_groups = scales.shape
    return scales.unsqueeze(-1).expand(num_tokens, num_groups, GROUP_SIZE).reshape(num_tokens, num_groups * GROUP_SIZE)


def quantize_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """Quantize ``[T, H]`` bf16/float to ``(e4m3 [T, H], scales)``.

    Naive equivalent: ``scale = amax(x[t, group]) / 448; q = (x / scale).to(float8_e4m3fn)``.

    Returns:
        ``(q, scales)``: ``scales`` is ``[T, H/128]`` float32, or ``[T, H/512]`` int32 packed UE8M0 when
        ``use_ue8m0`` (which requires ``H % 512 == 0`` and implies ``round_scale``).

    Raises:
        ValueError: ``x`` is not 2-D, ``H`` is not a multiple of 128 (512 with ``use_ue8m0``).
    """
    _check_groups(x)
    scales = _divide(group_amax(x), FP8_MAX)
    if round_scale or use_ue8m0:
        scales = round_scale_up_pow2(scales)
    q = (x.float() / _expand(scales)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if use_ue8m0:
        return q, pack_ue8m0(scales)
    return q, scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(e4m3 [T, H], scales)`` -> float32 ``[T, H]``; ``scales`` float32 ``[T, H/128]`` or packed UE8M0."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    return q.float() * _expand(scales.float())


def quantize_int8(x: torch.Tensor):
    """Quantize ``[T, H]`` to ``(int8 [T, H], float32 scales [T, H/128])``, symmetric, ``scale = amax/127``."""
    _check_groups(x)
    scales = _divide(group_amax(x), INT8_MAX)
    q = torch.round(x.float() / _expand(scales)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(int8 [T, H], float32 [T, H/128])`` -> float32 ``[T, H]``."""
    return q.float() * _expand(scales)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 ``[T, S]`` (``S % 4 == 0``) -> int32 ``[T, S/4]`` of biased exponents."""
    if scales.size(-1) % UE8M0_PER_INT != 0:
        raise ValueError(f"UE8M0 packing needs a multiple of 4 scale groups (hidden % 512 == 0), got {scales.size(-1)}")
    exponents = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exponents.contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, S/4]`` -> float32 ``[T, S]`` powers of two."""
    exponents = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (exponents << 23).view(torch.float32)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 e2m1 codes (NOTE [nvfp4]): nearest magnitude, ties to the even code, saturating; sign bit 3."""
    a = v.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
            + (a >= 3.5).int() + (a > 5.0).int())
    return (code | (torch.signbit(v).int() << 3)).to(torch.uint8)


def _global_scale(global_scale, device) -> torch.Tensor:
    """g of NOTE [nvfp4]: the first value of `global_scale` (callers may pass one per expert, all the same), or 1."""
    if global_scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return global_scale.reshape(-1)[0].to(device=device, dtype=torch.float32)


def quantize_nvfp4(x: torch.Tensor, global_scale=None):
    """Quantize ``[T, H]`` (H % 16 == 0) to ``(uint8 [T, H/2], float8_e4m3fn [T, H/16])`` as NOTE [nvfp4].

    Naive equivalent: ``sf = e4m3(amax(block) * g / 6)``; ``q = e2m1(x * g / sf)``, two per byte.
    `global_scale`: a float32 tensor whose first value is g, or None for 1.
    """
    if x.dim() != 2 or x.size(1) % NVFP4_BLOCK != 0:
        raise ValueError(f"expected a [num_tokens, hidden] tensor with hidden % 16 == 0, got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    g = _global_scale(global_scale, x.device)
    blocks = x.float().view(num_tokens, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    sf = _divide(amax * g, E2M1_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    sf_value = sf.float()
    inv = torch.where(sf_value > 0, g / sf_value, torch.zeros_like(sf_value))
    codes = _e2m1_codes(blocks * inv.unsqueeze(-1)).view(num_tokens, hidden)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sf


def dequantize_nvfp4(q: torch.Tensor, scales: torch.Tensor, global_scale=None) -> torch.Tensor:
    """``(uint8 [T, H/2], float8_e4m3fn [T, H/16])`` -> float32 ``[T, H]``: ``e2m1 * float(sf) / g``."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=q.device)
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).view(q.size(0), -1).long()
    g = _global_scale(global_scale, q.device)
    per_channel = scales.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return table[codes] * per_channel / g


def swizzle_nvfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[L, S, G]`` block scales -> DeepEP's ``[32, 4, ceil(S/128), 4, ceil(G/4), L]`` view (NOTE [nvfp4]) of an
    expert-major ``[L, rm, rk, 32, 4, 4]`` tensor; the padding rows and columns hold zeros."""
    num_experts, rows, cols = scales.shape
    rm, rk = -(-rows // 128), -(-cols // 4)
    padded = scales.new_zeros(num_experts, rm * 128, rk * 4)
    padded[:, :rows, :cols] = scales
    # row = r*128 + b*32 + a, column = 4*k + c  ->  [L, r, k, a, b, c]
    tiles = padded.view(num_experts, rm, 4, 32, rk, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return tiles.permute(3, 4, 1, 5, 2, 0)


def unswizzle_nvfp4_scales(view: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """DeepEP's ``[32, 4, rm, 4, rk, L]`` scales -> ``[L, rows, cols]`` (the inverse of `swizzle_nvfp4_scales`)."""
    a, b, rm, c, rk, num_experts = view.shape
    linear = view.permute(5, 2, 1, 0, 4, 3).reshape(num_experts, rm * b * a, rk * c)
    return linear[:, :rows, :cols]


def nvfp4_data_view(data: torch.Tensor) -> torch.Tensor:
    """Expert-major ``[L, S, H/2]`` packed values -> DeepEP's ``[S, H/2, L]`` view of them."""
    return data.permute(1, 2, 0)
