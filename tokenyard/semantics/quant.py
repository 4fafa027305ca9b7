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
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-4
UE8M0_PER_INT = 4

__all__ = [
    "GROUP_SIZE", "FP8_MAX", "INT8_MAX", "AMAX_FLOOR",
    "group_amax", "round_scale_up_pow2", "quantize_fp8", "dequantize_fp8", "quantize_int8",
    "dequantize_int8", "pack_ue8m0", "unpack_ue8m0",
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
