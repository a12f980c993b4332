"""The rotation itself, shared by the query and key/value kernels: table rows in, rotated pairs
out, in fp32; the conversions of stored values to fp32 and back (:func:`to_f32`,
:func:`from_f32`: the same bits on every backend); and the rounding of fp32 values to a 16-bit
dtype where a caller must round before the store (``mlarope.compat.megatron``'s rounding
points)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_compat import INTERPRETED

_INTERPRETED = tl.constexpr(INTERPRETED)
# Each dtype's canonical quiet NaN (its bits): every NaN the kernels compute is stored so.
_NAN_BF16 = tl.constexpr(0x7FC0)
_NAN_F16 = tl.constexpr(0x7E00)
_NAN_F32 = tl.constexpr(0x7FC00000)


@triton.jit
def to_f32(x):
    """Loaded fp32, fp16 or bf16 values as fp32, exactly. Triton's interpreter converts bf16
    subnormals wrongly (``1e-40`` to 0, ``1e-38`` to ``8.27e-39``); bf16 is fp32's top half, so
    there the bits are shifted instead."""
    if _INTERPRETED and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def from_f32(x, DTYPE: tl.constexpr):
    """fp32 ``x`` as ``DTYPE`` (fp32, fp16 or bf16), rounded to nearest even, a NaN as
    ``DTYPE``'s canonical quiet NaN (``0x7FC0``, ``0x7E00``, ``0x7FC00000``: the bits of a NaN
    follow its operands and the hardware, so without this the backends would store different
    ones): the same bits on the GPU and under Triton's interpreter, whose own fp32 -> bf16
    conversion truncates (there :func:`round_to_16bit` rounds first, exactly)."""
    if DTYPE.is_fp32():
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(x != x, _NAN_F32, bits).to(tl.float32, bitcast=True)
    elif DTYPE.is_fp16():
        bits = x.to(tl.float16).to(tl.int16, bitcast=True)
        return tl.where(x != x, _NAN_F16, bits).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        if _INTERPRETED:
            bits = (round_to_16bit(x, DTYPE).to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        else:
            bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
        return tl.where(x != x, _NAN_BF16, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_table_halves(cos_ptr, sin_ptr, pos, use_row, stride_table, j, HALF: tl.constexpr):
    """Rows ``cos[pos], sin[pos]`` split in halves, fp32 ``[BLOCK_T, HALF]`` each.

    ``use_row`` masks rows that must not be read (padding, out of range, masked tokens).
    """
    row = tl.where(use_row, pos, 0)[:, None] * stride_table
    m = use_row[:, None]
    c_a = to_f32(tl.load(cos_ptr + row + j[None, :], mask=m, other=1.0))
    c_b = to_f32(tl.load(cos_ptr + row + HALF + j[None, :], mask=m, other=1.0))
    s_a = to_f32(tl.load(sin_ptr + row + j[None, :], mask=m, other=0.0))
    s_b = to_f32(tl.load(sin_ptr + row + HALF + j[None, :], mask=m, other=0.0))
    return c_a, c_b, s_a, s_b


@triton.jit
def negate(x):
    """``-x`` for fp32 ``x`` by its sign bit: Triton's unary minus is ``0 - x``, which makes
    ``-(+0)`` ``+0`` and so loses the sign of a zero result (``-0 * 1 - 1 * (+0)`` is ``-0``)."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def rotate(
    a,
    b,
    c_a,
    c_b,
    s_a,
    s_b,
    is_padding,
    out_of_range,
    INVERSE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """The pair rotation in fp32 (``a, b: [BLOCK_T, BLOCK_H, HALF]``, tables broadcast to them).

    Forward ``out_a = a*c_a - b*s_a``, ``out_b = b*c_b + a*s_b``; ``TRANSPOSE`` is the backward
    (``s_a -> -s_b``, ``s_b -> -s_a``); ``INVERSE`` negates the angle. Padding passes through,
    out-of-range rows become NaN.
    """
    if TRANSPOSE:
        s_a, s_b = negate(s_b), negate(s_a)
    if INVERSE:
        s_a, s_b = negate(s_a), negate(s_b)
    # Explicit fused multiply-adds: the compiler may not contract differently from one launch
    # configuration to another, so results are bitwise identical across configurations.
    out_a = tl.fma(a, c_a, negate(b * s_a))
    out_b = tl.fma(b, c_b, a * s_b)
    out_a = tl.where(is_padding, a, out_a)
    out_b = tl.where(is_padding, b, out_b)
    out_a = tl.where(out_of_range, float("nan"), out_a)
    out_b = tl.where(out_of_range, float("nan"), out_b)
    return out_a, out_b


@triton.jit
def round_to_16bit(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to the nearest ``DTYPE`` value (bf16 or fp16), ties to even, as fp32.

    Integer arithmetic on the bits, not ``x.to(DTYPE).to(tl.float32)``: the compiler folds such
    a conversion and its inverse into nothing (no rounding at all on sm_90), and Triton's
    interpreter truncates fp32 -> bf16. bf16 keeps fp32's exponent, so its rounding is the
    top 16 bits rounded to nearest even, subnormals and overflow to infinity included. fp16:
    the same with 10 mantissa bits in its normal range; below 2^-14 its values are the multiples
    of 2^-24, and ``0.75 + x`` lies in [0.5, 1), where fp32's spacing is 2^-24, so that sum
    rounds ``x`` to the grid (ties to even) and the subtraction is exact (the sign of a zero
    result is ``x``'s); past 65504 the rounded value is infinite. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    if DTYPE.is_bf16():
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
    else:
        rounded = ((bits + (0xFFF + ((bits >> 13) & 1))) & -8192).to(tl.float32, bitcast=True)
        tiny = ((x + 0.75) - 0.75).to(tl.int32, bitcast=True) | (bits & -2147483648)  # x's sign
        rounded = tl.where(tl.abs(x) < 6.103515625e-05, tiny.to(tl.float32, bitcast=True), rounded)
        infinity = tl.where(x < 0, float("-inf"), float("inf"))
        rounded = tl.where(tl.abs(rounded) > 65504.0, infinity, rounded)
    return tl.where(x != x, x, rounded)


@triton.jit
def transpose_rotate_rounded(g_a, g_b, c_a, c_b, s_a, s_b, is_padding, out_of_range,
                             DTYPE: tl.constexpr):  # fmt: skip
    """The backward rotation with Megatron-Core's roundings (``mlarope.compat.megatron``):
    ``da = rnd(rnd(g_a*c_a) + rnd(g_b*s_b))``, ``db = rnd(rnd(g_b*c_b) - rnd(g_a*s_a))``, ``rnd``
    rounding to ``DTYPE`` (the gradient's and the tables' 16-bit dtype: ``round_to_16bit``).
    ``g`` and the tables are ``DTYPE`` values, so each fp32 product is exact and its rounding is
    the one PyTorch's ``DTYPE`` multiply makes, and an fp32 sum of two ``DTYPE`` values rounded
    once is PyTorch's ``DTYPE`` addition. The results are ``DTYPE`` values: the store's
    conversion is exact."""
    p_ac = round_to_16bit(g_a * c_a, DTYPE)
    p_bs = round_to_16bit(g_b * s_b, DTYPE)
    p_bc = round_to_16bit(g_b * c_b, DTYPE)
    p_as = round_to_16bit(g_a * s_a, DTYPE)
    d_a = tl.where(is_padding, g_a, round_to_16bit(p_ac + p_bs, DTYPE))
    d_b = tl.where(is_padding, g_b, round_to_16bit(p_bc - p_as, DTYPE))
    d_a = tl.where(out_of_range, float("nan"), d_a)
    d_b = tl.where(out_of_range, float("nan"), d_b)
    return d_a, d_b
