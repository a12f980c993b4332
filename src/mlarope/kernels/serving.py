"""Triton kernels and launchers of :mod:`mlarope.serving`.

- ``_rope_append_kernel``: one program owns ``BLOCK_T`` tokens. It loads each token's slot,
  position and inputs at once (no load waits on another, except the table rows on the
  position), writes nothing for a token whose slot is not in the cache (``-1`` padding, or out
  of range), rotates ``k_pe`` in fp32 at the token's position, and writes the cache entry:
  the latent ``kv_c`` (copied, or quantized to FP8 with a per-tensor scale or with FlashMLA's
  per-tile power-of-two scales, which the program computes: fp32 scales of 128-channel tiles
  for ``fp8_656``, UE8M0 exponent bytes of 64-channel tiles for ``fp8_584``) and the rotated
  rope values (rounded once to the cache's dtype, or quantized).
- ``_rope_decode_query_kernel``: one program owns ``BLOCK_T`` tokens x ``BLOCK_H`` heads of
  ``[T, H, L + R]``: the absorbed nope channels copied (or quantized), the rope channels
  rotated in fp32 and rounded (or quantized) once.

Every destination is written through an integer view of its memory (``uint8`` FP8 codes,
``int16`` 16-bit floats, ``int32`` fp32 bits), and every rounding gives torch's bits on both
backends:

- bf16: round to nearest even (``bf16_bits``);
- FP8 e4m3: round to nearest even, saturating to +-448 (``inf`` too), NaN to a NaN code
  (``e4m3_codes``), what CUDA's ``__NV_SATFINITE`` conversion gives, and torch's
  ``.to(torch.float8_e4m3fn)`` of the clamped value;
- per-tensor scales divide with IEEE rounding, as ``x / scale`` in PyTorch (``quotient``: a
  reciprocal and Markstein's correction in compiled code, ``tl.math.div_rn`` otherwise;
  Triton's ``/`` is an approximate division on the GPU);
- FlashMLA's per-tile scale ``2 ** ceil(log2(amax / 448))``, at least ``2 ** -13``, from the
  bits of ``amax`` (``pow2_tile_scales``): exact, so both backends store the same scale bits.

Compiled kernels use the hardware's conversions for the first two (``native_casts``); under
Triton's interpreter, whose own fp32 -> bf16 cast truncates and whose fp32 -> fp8 cast loses
the carry into the exponent (docs/serving.md), integer operations do them.

Core pieces used here (one import block below): the table rows, the rotation and the 16-bit
rounding of ``kernels/rotation.py``, the launcher of ``kernels/_launch.py`` and the head-major
grid of ``kernels/_tiles.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Core import point (the rotation, its table rows, the launcher and the grid).
from ._launch import DirectLauncher
from ._tiles import next_power_of_2, program_tile, tile_grid
from ._triton_compat import INTERPRETED
from .rotation import load_table_halves, rotate, round_to_16bit, to_f32

# How a part of an entry is stored (constexpr NOPE_MODE / ROPE_MODE).
COPY = tl.constexpr(0)  # nope: the input's bits, copied
E4M3 = tl.constexpr(1)  # FP8 e4m3 codes of x / scale (per-tensor dequant scale)
E4M3_TILES = tl.constexpr(2)  # nope: e4m3 codes of x / s_j, s_j per 128-channel tile (fp8_656)
FP32 = tl.constexpr(3)  # rope: fp32 bits
FP16 = tl.constexpr(4)  # rope: fp16 bits, rounded to nearest even
BF16 = tl.constexpr(5)  # rope: bf16 bits, rounded to nearest even
E8M0_TILES = tl.constexpr(6)  # nope: e4m3 codes of x / s_j, s_j per 64-channel tile (fp8_584),
# stored as its UE8M0 exponent byte

# Where a per-tensor scale comes from (constexpr SCALE_MODE).
SCALE_NONE = tl.constexpr(0)
SCALE_VALUE = tl.constexpr(1)  # an fp32 kernel argument (a Python float)
SCALE_TENSOR = tl.constexpr(2)  # a 1-element fp32 tensor, read by the kernel

TILE = 128  # FlashMLA's quantization tile of the 512 latent channels (fp8_656)
TILE_584 = 64  # and of DeepSeek-V4's 448 (fp8_584)
MIN_TILE_EXPONENT = 114  # biased exponent of 2**-13, the smallest tile scale


# ---------------------------------------------------------------------------------- encoders
@triton.jit
def e4m3_codes(x, NATIVE: tl.constexpr):
    """fp32 -> uint8 FP8 e4m3fn codes: round to nearest even, magnitudes saturated to 448
    (infinities included), NaN to a NaN code (``0x7F``, or ``0xFF`` by integer operations for a
    negative NaN). ``NATIVE``: the hardware conversion (compiled code: ``cvt.rn.satfinite``),
    else integer operations (the interpreter, whose own conversion is wrong)."""
    if NATIVE:
        x = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(mag, 0x43E00000)  # 448.0: the largest finite e4m3 value
    # Normal codes (|x| >= 2**-6): drop 20 mantissa bits with round to nearest even and rebias
    # the exponent from 127 to 7; a carry out of the mantissa moves into the exponent.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal codes (|x| < 2**-6): |x| / 2**-9 rounded to the nearest even integer.
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (mag >> 23), 25)
    q = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0x3C800000, q, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def bf16_bits(x, NATIVE: tl.constexpr):
    """fp32 -> int16 bits of the bf16 nearest to ``x`` (ties to even), a NaN as bf16's
    canonical quiet NaN ``0x7FC0`` on every backend (as the core kernels store it:
    ``rotation.from_f32``). ``NATIVE``: the hardware conversion, else integer operations (the
    interpreter truncates)."""
    if NATIVE:
        bits = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    else:
        bits = (round_to_16bit(x, tl.bfloat16).to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    return tl.where(x != x, 0x7FC0, bits).to(tl.int16)


@triton.jit
def pow2_exponent(amax, MIN_EXPONENT: tl.constexpr):
    """The biased exponent of ``2 ** ceil(log2(amax / 448))``, at least ``MIN_EXPONENT``, from
    the bits of ``amax >= 0`` (fp32, no NaN; int32 out): with ``amax = m * 2**e``
    (``1 <= m < 2``), ``amax / 448 = (m / 1.75) * 2**(e - 8)``, whose power-of-two ceiling is
    ``2**(e - 8)`` for ``m <= 1.75`` and ``2**(e - 7)`` above; fp32 division by 448 (or
    multiplication by its fp32 reciprocal) rounds across no power of two, so this is the
    ceiling of the rounded quotient too. An infinite ``amax`` gives 247 (``2 ** 120``)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(exponent, MIN_EXPONENT)


@triton.jit
def pow2_tile_scales(amax):
    """FlashMLA's dequant scale of a tile, ``2 ** ceil(log2(max(amax / 448, 1e-4)))``, exactly.

    ``amax >= 0`` (fp32, no NaN) -> ``(scale bits as int32, 1 / scale as fp32)``. With
    ``amax = m * 2**e`` (``1 <= m < 2``), ``amax / 448 = (m / 1.75) * 2**(e - 8)``, whose
    power-of-two ceiling is ``2**(e - 8)`` for ``m <= 1.75`` and ``2**(e - 7)`` above; fp32
    division by 448 rounds across no power of two, so this equals the ceiling of the rounded
    quotient. The floor ``1e-4`` becomes ``2**-13``.
    """
    exponent = pow2_exponent(amax, 114)  # MIN_TILE_EXPONENT
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    return exponent << 23, inverse


@triton.jit
def quotient(x, scale, FAST: tl.constexpr):
    """fp32 ``x / scale`` as IEEE division rounds it, for the e4m3 encoder; ``scale`` a scalar.

    ``FAST`` (compiled code, whose ``tl.fma`` rounds once): one reciprocal per program and
    Markstein's correction per element, ``q = x * (1/s)``, ``r = fma(-q, s, x)`` (exact),
    ``fma(r, 1/s, q)``: the correctly rounded quotient when ``1/s`` is, ``q`` is within an ulp
    and ``r`` does not underflow. For ``2**-90 <= s <= 2**90`` that holds wherever the e4m3 code
    depends on the quotient (``|q| >= 2**-10``); below, the low bits may differ and the code is
    the same signed zero. A quotient that overflows stays infinite (the correction would make it
    NaN) and a zero keeps its sign; other scales divide per element. Three floating-point
    operations where ``div.rn.f32`` is a subroutine of about ten and a branch, which made the
    FP8 decode query issue-bound (docs/perf_log.md). Otherwise the division (Triton 3.6's
    interpreter rounds an fma twice)."""
    if FAST == 2:  # RECIPROCAL_QUOTIENT: measurement only
        q = x * tl.math.div_rn(1.0, scale)
    elif FAST:
        if (scale >= 8.077935669463161e-28) & (scale <= 1.2379400392853803e27):
            inverse = tl.math.div_rn(1.0, scale)
            q = x * inverse
            fixed = tl.fma(tl.fma(-q, scale, x), inverse, q)
            # A zero keeps its sign (the correction's sum would make -0 positive).
            q = tl.where((fixed == fixed) & (q != 0.0), fixed, q)
        else:
            q = tl.math.div_rn(x, scale)
    else:
        q = tl.math.div_rn(x, scale)
    return q


@triton.jit
def _per_tensor_scale(scale_ptr, scale_value, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == SCALE_TENSOR:
        return tl.load(scale_ptr).to(tl.float32)
    else:
        return scale_value


@triton.jit
def _encode(x, scale, MODE: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 rope values -> the bits the destination stores."""
    if MODE == FP32:
        return tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))
    elif MODE == FP16:
        return tl.where(x != x, 0x7E00, x.to(tl.float16).to(tl.int16, bitcast=True)).to(tl.int16)
    elif MODE == BF16:
        return bf16_bits(x, NATIVE)
    else:
        return e4m3_codes(quotient(x, scale, NATIVE), NATIVE)


@triton.jit
def _table_rows(cos_ptr, sin_ptr, pos, use_row, stride_table, j, HALF: tl.constexpr,
                PAIR_TABLE: tl.constexpr):  # fmt: skip
    """``(c_a, c_b, s_a, s_b)``, fp32 ``[BLOCK_T, HALF]`` each, of the rows ``cos[pos],
    sin[pos]``: tables ``[P, R]`` split in halves, or pair tables ``[P, R / 2]`` (``PAIR_TABLE``),
    whose one entry per pair serves both halves (half the bytes)."""
    if PAIR_TABLE:
        row = tl.where(use_row, pos, 0)[:, None] * stride_table
        m = use_row[:, None]
        c = to_f32(tl.load(cos_ptr + row + j[None, :], mask=m, other=1.0))
        s = to_f32(tl.load(sin_ptr + row + j[None, :], mask=m, other=0.0))
        return c, c, s, s
    else:
        return load_table_halves(cos_ptr, sin_ptr, pos, use_row, stride_table, j, HALF)


@triton.jit
def _load_pairs(ptr, row, m_row, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVED_IN: tl.constexpr):  # fmt: skip
    """fp32 pairs ``(a, b)``, ``[BLOCK_T, BLOCK_H, HALF]`` each, of the rows ``[..., R]`` at
    ``ptr + row`` (``row``, ``m_row``: ``[BLOCK_T, BLOCK_H, 1]``)."""
    if INTERLEAVED_IN:
        k = tl.arange(0, 2 * HALF)[None, None, :]
        x = to_f32(tl.load(ptr + row + k, mask=m_row & (k < 2 * HALF), other=0.0))
        a, b = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, HALF, 2)))
    else:
        j = tl.arange(0, HALF)[None, None, :]
        a = to_f32(tl.load(ptr + row + j, mask=m_row & (j < HALF), other=0.0))
        b = to_f32(tl.load(ptr + row + HALF + j, mask=m_row & (j < HALF), other=0.0))
    return a, b


@triton.jit
def _store_pairs(ptr, row, m_row, a, b, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                 HALF: tl.constexpr, INTERLEAVED_OUT: tl.constexpr):  # fmt: skip
    """Store encoded pairs ``a, b: [BLOCK_T, BLOCK_H, HALF]`` into the rows ``[..., R]`` at
    ``ptr + row``, interleaved or half-split."""
    if INTERLEAVED_OUT:
        k = tl.arange(0, 2 * HALF)[None, None, :]
        pairs = tl.reshape(tl.join(a, b), (BLOCK_T, BLOCK_H, 2 * HALF))
        tl.store(ptr + row + k, pairs, mask=m_row & (k < 2 * HALF))
    else:
        j = tl.arange(0, HALF)[None, None, :]
        tl.store(ptr + row + j, a, mask=m_row & (j < HALF))
        tl.store(ptr + row + HALF + j, b, mask=m_row & (j < HALF))


# ------------------------------------------------------------------------------ cache append
@triton.jit(do_not_specialize=["n_tokens", "scale_value"])
def _rope_append_kernel(
    kvc_ptr,  # [T, L]: its bits (COPY) or its values (quantized)
    kpe_ptr,  # [T, R]
    cos_ptr, sin_ptr,  # [P, R], or [P, R / 2] (PAIR_TABLE)
    pos_ptr,  # [T] int32 / int64
    slot_ptr,  # [T] int32 / int64: block * block_size + offset; outside the cache: skipped
    nope_ptr,  # bits of the latent's destination (concat: the cache; split: ckv)
    rope_ptr,  # bits of the rope values' destination (concat: the cache; split: kpe)
    tile_ptr,  # the tile scales: int32 view of fp8_656 records, uint8 of fp8_584; else unused
    scale_ptr,  # [1] fp32 dequant scale (SCALE_TENSOR); unused otherwise
    scale_value,  # fp32 dequant scale (SCALE_VALUE)
    n_tokens, n_rows, n_slots, block_size,
    stride_kvc, stride_kpe, stride_pos, stride_slot, stride_table,
    stride_nope_b, stride_nope_s, stride_rope_b, stride_rope_s, stride_tile_b, stride_tile_s,
    ROPE_OFFSET: tl.constexpr,  # first rope element within the rope row (concat: L)
    TILE_OFFSET: tl.constexpr,  # first scale within the row (fp8_656: 512 / 4; fp8_584: 576 bs)
    BLOCK_SHIFT: tl.constexpr,  # log2(block_size) for a power of two, else -1
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HALF: tl.constexpr,
    PAIR_TABLE: tl.constexpr,  # cos, sin: [P, HALF], one entry per pair (else [P, 2 * HALF])
    BLOCK_T: tl.constexpr,
    NOPE_MODE: tl.constexpr,
    ROPE_MODE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
    NATIVE: tl.constexpr,  # native_casts()
):  # fmt: skip
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    m_t = o_t < n_tokens
    # Every load of the inputs is masked by the token count alone, so all of them go out at
    # once: none waits on the slot (a token outside the cache reads its own rows of the inputs
    # and writes nothing). Only the table's rows wait, on the position.
    slot = tl.load(slot_ptr + o_t * stride_slot, mask=m_t, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + o_t * stride_pos, mask=m_t, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_L)[None, :]
    x = tl.load(kvc_ptr + o_t[:, None] * stride_kvc + c, mask=m_t[:, None] & (c < L), other=0)
    a, b = _load_pairs(
        kpe_ptr, (o_t * stride_kpe)[:, None, None], m_t[:, None, None], BLOCK_T, 1, HALF,
        INTERLEAVED_IN,
    )  # fmt: skip
    in_range = (pos >= 0) & (pos < n_rows)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = _table_rows(
        cos_ptr, sin_ptr, pos, m_t & in_range, stride_table, j, HALF, PAIR_TABLE
    )
    # A token whose slot is not in the cache (-1: padding) writes nothing.
    m_w = m_t & (slot >= 0) & (slot < n_slots)
    slot = tl.where(m_w, slot, 0)
    # A shift where the page size is a power of two (a 64-bit division is a long emulated
    # sequence on the GPU); BLOCK_SHIFT is a compile-time constant: no select is emitted.
    if BLOCK_SHIFT >= 0:  # noqa: SIM108
        block = slot >> BLOCK_SHIFT
    else:
        block = slot // block_size
    entry = slot - block * block_size
    scale = _per_tensor_scale(scale_ptr, scale_value, SCALE_MODE)

    # The latent part.
    m_c = m_w[:, None] & (c < L)
    nope_row = (block * stride_nope_b + entry * stride_nope_s)[:, None]
    if NOPE_MODE == COPY:
        tl.store(nope_ptr + nope_row + c, x, mask=m_c)
    elif NOPE_MODE == E4M3:
        codes = e4m3_codes(quotient(to_f32(x), scale, NATIVE), NATIVE)
        tl.store(nope_ptr + nope_row + c, codes, mask=m_c)
    elif NOPE_MODE == E8M0_TILES:
        # fp8_584: tiles of 64 (L = 448: seven, the eighth of BLOCK_L is masked and not stored),
        # the scale's biased exponent as one byte each.
        tl.static_assert(L % 64 == 0)
        x = tl.reshape(to_f32(x), (BLOCK_T, BLOCK_L // 64, 64))
        amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=2)
        scale_bits, inverse = pow2_tile_scales(amax)
        codes = tl.reshape(e4m3_codes(x * inverse[:, :, None], NATIVE), (BLOCK_T, BLOCK_L))
        tl.store(nope_ptr + nope_row + c, codes, mask=m_c)
        i = tl.arange(0, BLOCK_L // 64)[None, :]
        tile_row = (block * stride_tile_b + entry * stride_tile_s)[:, None] + TILE_OFFSET
        exponent = (scale_bits >> 23).to(tl.uint8)
        tl.store(tile_ptr + tile_row + i, exponent, mask=m_w[:, None] & (i < L // 64))
    else:
        tl.static_assert(L % 128 == 0)
        tl.static_assert(BLOCK_L == L)
        x = tl.reshape(to_f32(x), (BLOCK_T, L // 128, 128))
        # NaN does not count towards a tile's maximum (the same on every backend); it is still
        # stored as a NaN code.
        amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=2)
        scale_bits, inverse = pow2_tile_scales(amax)
        # x * (1 / s) with a power-of-two s is exactly x / s.
        codes = tl.reshape(e4m3_codes(x * inverse[:, :, None], NATIVE), (BLOCK_T, L))
        tl.store(nope_ptr + nope_row + c, codes, mask=m_c)
        i = tl.arange(0, L // 128)[None, :]
        tile_row = (block * stride_tile_b + entry * stride_tile_s)[:, None] + TILE_OFFSET
        tl.store(tile_ptr + tile_row + i, scale_bits, mask=m_w[:, None] & (i < L // 128))

    # The rope part: k_pe rotated at the token's position (NaN for a position outside the table).
    m_pe = m_w[:, None, None]
    out_a, out_b = rotate(
        a, b, c_a[:, None, :], c_b[:, None, :], s_a[:, None, :], s_b[:, None, :],
        (o_t < 0)[:, None, None], (~in_range)[:, None, None], False, False,
    )  # fmt: skip
    rope_row = (block * stride_rope_b + entry * stride_rope_s)[:, None, None] + ROPE_OFFSET
    _store_pairs(
        rope_ptr, rope_row, m_pe, _encode(out_a, scale, ROPE_MODE, NATIVE),
        _encode(out_b, scale, ROPE_MODE, NATIVE), BLOCK_T, 1, HALF, INTERLEAVED_OUT,
    )  # fmt: skip


# ------------------------------------------------------------------------------ decode query
@triton.jit(do_not_specialize=["n_tokens", "scale_value"])
def _rope_decode_query_kernel(
    qn_ptr,  # [T, H, L]: its bits (COPY) or its values (E4M3)
    qp_ptr,  # [T, H, R]
    out_ptr,  # bits of [T, H, L + R]
    cos_ptr, sin_ptr,  # [P, R], or [P, R / 2] (PAIR_TABLE)
    pos_ptr,  # [T] int32 / int64
    scale_ptr,  # [1] fp32 dequant scale (SCALE_TENSOR); unused otherwise
    scale_value,  # fp32 dequant scale (SCALE_VALUE)
    n_tokens, n_heads, n_head_blocks, n_rows,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_o_t, stride_o_h,
    stride_pos, stride_table,
    L: tl.constexpr,
    HALF: tl.constexpr,
    PAIR_TABLE: tl.constexpr,  # cos, sin: [P, HALF], one entry per pair (else [P, 2 * HALF])
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NOPE_MODE: tl.constexpr,
    ROPE_MODE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
    NATIVE: tl.constexpr,  # native_casts()
):  # fmt: skip
    i_t, i_h = program_tile(n_head_blocks)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = (i_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_t = o_t < n_tokens
    m_row = m_t[:, None, None] & (o_h < n_heads)[None, :, None]
    scale = _per_tensor_scale(scale_ptr, scale_value, SCALE_MODE)

    # The rope part's loads go out first; the nope copy runs while they are in flight.
    pos = tl.load(pos_ptr + o_t * stride_pos, mask=m_t, other=0).to(tl.int64)
    in_range = (pos >= 0) & (pos < n_rows)
    qp_row = (o_t * stride_qp_t)[:, None, None] + (o_h * stride_qp_h)[None, :, None]
    a, b = _load_pairs(qp_ptr, qp_row, m_row, BLOCK_T, BLOCK_H, HALF, INTERLEAVED_IN)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = _table_rows(
        cos_ptr, sin_ptr, pos, m_t & in_range, stride_table, j, HALF, PAIR_TABLE
    )

    qn_row = (o_t * stride_qn_t)[:, None, None] + (o_h * stride_qn_h)[None, :, None]
    o_row = (o_t * stride_o_t)[:, None, None] + (o_h * stride_o_h)[None, :, None]
    for c0 in range(0, L, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        m = m_row & (c < L)
        x = tl.load(qn_ptr + qn_row + c, mask=m)
        if NOPE_MODE == E4M3:
            x = e4m3_codes(quotient(to_f32(x), scale, NATIVE), NATIVE)
        tl.store(out_ptr + o_row + c, x, mask=m)

    out_a, out_b = rotate(
        a, b, c_a[:, None, :], c_b[:, None, :], s_a[:, None, :], s_b[:, None, :],
        (o_t < 0)[:, None, None], (~in_range)[:, None, None], False, False,
    )  # fmt: skip
    _store_pairs(
        out_ptr, o_row + L, m_row, _encode(out_a, scale, ROPE_MODE, NATIVE),
        _encode(out_b, scale, ROPE_MODE, NATIVE), BLOCK_T, BLOCK_H, HALF, INTERLEAVED_OUT,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- launchers
# Compiled kernels round and quantize with the hardware's conversions (``cvt.rn.bf16.f32``,
# ``cvt.rn.satfinite.e4m3x2.f32``: one instruction, where the integer encoder takes about 30
# integer operations an element, which would make FP8 outputs compute-bound at prefill
# sizes); the interpreter with integer operations. Both give torch's bits (the numerics
# tests check each path on its lane, and both on the GPU). The serving benchmark's --sweep
# sets this to False to time the integer path on the GPU.
NATIVE_CASTS = True
# Measurement only, never on in a call of the library: the benchmark's decode sweep sets it to
# time the per-tensor quantization as ``x * (1 / s)`` (one multiply an element, FlashInfer's
# form, which can differ from ``x / s`` by an fp32 ulp near a tie) instead of the correctly
# rounded quotient (``quotient``: three operations and a select), to measure what exactness
# costs where FP8 outputs are compute-bound.
RECIPROCAL_QUOTIENT = False


def native_casts() -> int:
    """The kernels' ``NATIVE``: 0 under the interpreter or with ``NATIVE_CASTS`` off, else 1
    (2 with ``RECIPROCAL_QUOTIENT``)."""
    if not NATIVE_CASTS or INTERPRETED:
        return 0
    return 2 if RECIPROCAL_QUOTIENT else 1


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_ROPE_MODES = {torch.float32: 3, torch.float16: 4, torch.bfloat16: 5}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integers of its element size (FP8 codes, 16-bit or 32-bit floats)."""
    return t.view(_BITS[t.element_size()])


def rope_mode(dtype: torch.dtype) -> int:
    """ROPE_MODE of a destination dtype (FP8 caches store codes: E4M3)."""
    return _ROPE_MODES.get(dtype, 1)


@dataclass(frozen=True)
class AppendConfig:
    """Tokens per program and warps of the append kernel; any valid one gives the same bits."""

    block_t: int
    num_warps: int


@dataclass(frozen=True)
class QueryConfig:
    """Tile and warps of the decode-query kernel; any valid one gives the same bits."""

    block_t: int
    block_h: int
    block_c: int
    num_warps: int


# Latent elements one append program moves: 4 tokens of DeepSeek-V3's 512, 16 per thread with
# 4 warps; decode batches of one token take one program (not measured yet: the serving
# benchmark's --sweep times the alternatives on the GPU lane).
_APPEND_TILE_ELEMENTS = 2048


def choose_append_config(n_tokens: int, latent: int) -> AppendConfig:
    """Heuristic configuration of the append kernel (no autotuning)."""
    block_l = next_power_of_2(latent)
    block_t = min(next_power_of_2(n_tokens), max(1, _APPEND_TILE_ELEMENTS // block_l))
    num_warps = min(8, next_power_of_2(max(1, block_t * block_l // 512)))
    return AppendConfig(block_t, num_warps)


# Programs below which a decode-query grid leaves the H200's 132 multiprocessors short of
# bytes in flight (four programs each).
_QUERY_MIN_PROGRAMS = 528
# Elements a prefill program moves a step (one warp's worth, 32 a thread).
_QUERY_PREFILL_ELEMENTS = 1024
# Head rows up to which a batch takes the decode tiles even with enough programs for the
# prefill tile: 256 tokens of 128 heads took 17.8 us with the decode tile (4 heads x 512
# channels, 2 warps) against 19.7 with the prefill tile (docs/perf_log.md v15). Timed at 128
# heads only: fewer heads and more tokens (16 x 2,048) take the decode tiles by the same count,
# untimed.
_QUERY_WHOLE_ROW_ROWS = 32768


def choose_query_config(n_tokens: int, n_heads: int, latent: int) -> QueryConfig:
    """Heuristic configuration of the decode-query kernel (no autotuning).

    Prefill batches: 8 heads x 128 channels a step and one warp (32 elements a thread), the
    fastest of the serving benchmark's sweep at 16,384 tokens of 128 heads (858.7 us, 99 % of
    the copy, where the key/value forward's tile of 16 heads and two warps took 976.3 us,
    87 %; docs/perf_log.md v15). Decode batches, where the 16-head tile gives fewer than
    ``_QUERY_MIN_PROGRAMS`` programs (64 tokens of 128 heads and fewer: one token was 8
    programs, 5.1 us against FlashInfer's 2.4, docs/perf_log.md v13), and batches of up to
    ``_QUERY_WHOLE_ROW_ROWS`` head rows (256 tokens of 128 heads): the whole latent row in one
    step (no loop, so each program's loads are all in flight at once), and fewer heads per
    program, down to one, until the grid has that many programs or each program holds one
    head."""
    block_c = min(next_power_of_2(latent), 128)
    decode_h = min(next_power_of_2(n_heads), max(1, 2048 // block_c))
    decode_t = min(next_power_of_2(n_tokens), max(1, 2048 // (decode_h * block_c)))
    small = n_tokens * n_heads <= _QUERY_WHOLE_ROW_ROWS
    if small or -(-n_tokens // decode_t) * -(-n_heads // decode_h) < _QUERY_MIN_PROGRAMS:
        block_t, block_c = 1, next_power_of_2(latent)
        block_h = min(next_power_of_2(n_heads), max(1, 2048 // block_c))
        while block_h > 1 and n_tokens * -(-n_heads // block_h) < _QUERY_MIN_PROGRAMS:
            block_h //= 2
    else:
        block_h = min(next_power_of_2(n_heads), max(1, _QUERY_PREFILL_ELEMENTS // block_c))
        block_t = min(
            next_power_of_2(n_tokens), max(1, _QUERY_PREFILL_ELEMENTS // (block_h * block_c))
        )
    num_warps = min(8, next_power_of_2(max(1, block_t * block_h * block_c // 1024)))
    return QueryConfig(block_t, block_h, block_c, num_warps)


def _scale_args(scale: torch.Tensor | None, scale_value: float, quantized: bool, dummy):
    """``(SCALE_MODE, scale_ptr, scale_value)``."""
    if not quantized:
        return 0, dummy, 1.0
    if scale is not None:
        return 2, scale, 1.0
    return 1, dummy, float(scale_value)


def rope_append_launch(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    nope_dst: torch.Tensor,
    rope_dst: torch.Tensor,
    tiles: torch.Tensor | None,
    *,
    rope_offset: int,
    nope_mode: int,
    rope_mode: int,
    scale: torch.Tensor | None,
    scale_value: float,
    interleaved_in: bool,
    interleaved_out: bool,
    config: AppendConfig | None = None,
    tile_offset: int | None = None,
) -> None:
    """Rotate and write ``T`` tokens into a paged cache.

    ``kv_c: [T, L]`` (its bits for ``nope_mode`` COPY), ``k_pe: [T, R]``, ``cos, sin: [P, R]``
    or pair tables ``[P, R / 2]`` (equal strides), ``positions, slot_mapping: [T]``;
    ``nope_dst: [blocks, block_size, >= L]`` and ``rope_dst: [blocks, block_size, >=
    rope_offset + R]`` integer views of the cache (the same tensor for a concatenated layout;
    only their address, dtype and first two strides are used); ``tiles``: the int32 view
    ``[blocks, block_size, 164]`` of fp8_656 records, or a ``uint8`` view whose entry
    ``(b, e)`` is ``tile_offset`` bytes before the token's fp8_584 scale row, else None.
    ``tile_offset``: the first scale's offset in ``tiles``' elements (default ``L / 4``:
    fp8_656's).
    """
    n_tokens, latent = kv_c.shape
    if n_tokens == 0:
        return
    config = config or choose_append_config(n_tokens, latent)
    quantized = nope_mode == 1 or rope_mode == 1  # a per-tensor scale (E4M3)
    scale_mode, scale_ptr, value = _scale_args(scale, scale_value, quantized, kv_c)
    if tiles is None:
        tiles, stride_tile_b, stride_tile_s, tile_offset = nope_dst, 0, 0, 0
    else:
        stride_tile_b, stride_tile_s = tiles.stride(0), tiles.stride(1)
        tile_offset = latent // 4 if tile_offset is None else tile_offset
    _launch_append(
        (-(-n_tokens // config.block_t),), config.num_warps,
        kv_c, k_pe, cos, sin, positions, slot_mapping, nope_dst, rope_dst, tiles, scale_ptr,
        value,
        n_tokens, cos.shape[0], nope_dst.shape[0] * nope_dst.shape[1], nope_dst.shape[1],
        kv_c.stride(0), k_pe.stride(0), positions.stride(0), slot_mapping.stride(0),
        cos.stride(0),
        nope_dst.stride(0), nope_dst.stride(1), rope_dst.stride(0), rope_dst.stride(1),
        stride_tile_b, stride_tile_s,
        rope_offset, tile_offset, _shift(nope_dst.shape[1]), latent, next_power_of_2(latent),
        k_pe.shape[1] // 2, cos.shape[1] * 2 == k_pe.shape[1],
        config.block_t, nope_mode, rope_mode, scale_mode, interleaved_in, interleaved_out,
        native_casts(),
    )  # fmt: skip


def _shift(block_size: int) -> int:
    """log2(block_size) for a power of two (every engine's page size), else -1."""
    return (
        block_size.bit_length() - 1 if block_size > 0 and block_size & (block_size - 1) == 0 else -1
    )


def rope_decode_query_launch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    out_bits: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    nope_mode: int,
    rope_mode: int,
    scale: torch.Tensor | None,
    scale_value: float,
    interleaved_in: bool,
    interleaved_out: bool,
    config: QueryConfig | None = None,
) -> None:
    """``q_nope: [T, H, L]`` (its bits for ``nope_mode`` COPY), ``q_pe: [T, H, R]``, ``cos,
    sin: [P, R]`` or pair tables ``[P, R / 2]`` -> ``out_bits``, the integer view of
    ``[T, H, L + R]``."""
    n_tokens, n_heads, latent = q_nope.shape
    if n_tokens == 0 or n_heads == 0:
        return
    config = config or choose_query_config(n_tokens, n_heads, latent)
    quantized = rope_mode == 1
    scale_mode, scale_ptr, value = _scale_args(scale, scale_value, quantized, q_nope)
    grid, n_head_blocks = tile_grid(n_tokens, config.block_t, n_heads, config.block_h)
    _launch_query(
        grid, config.num_warps,
        q_nope, q_pe, out_bits, cos, sin, positions, scale_ptr, value,
        n_tokens, n_heads, n_head_blocks, cos.shape[0],
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        out_bits.stride(0), out_bits.stride(1), positions.stride(0), cos.stride(0),
        latent, q_pe.shape[2] // 2, cos.shape[1] * 2 == q_pe.shape[2], config.block_t,
        config.block_h, config.block_c,
        nope_mode, rope_mode, scale_mode, interleaved_in, interleaved_out, native_casts(),
    )  # fmt: skip


_launch_append = DirectLauncher(_rope_append_kernel)
_launch_query = DirectLauncher(_rope_decode_query_kernel)
