"""Triton kernel and launcher of :func:`mlarope.serving.rope_inverse_quant_output`: DeepSeek-V4's
attention output, inverse-rotated and quantized to FP8 for the grouped output projection.

``_rope_inverse_quant_kernel``: one program owns ``BLOCK_T`` tokens x ``BLOCK_H`` heads of
``o: [T, H, D]`` (``D = N + R``, the trailing ``R`` channels rotary). Per head row it

- rotates the rope slice by the inverse angle in fp32 (``a' = a c_a + b s_a``,
  ``b' = b c_b - a s_b``: two rounded products and a rounded sum, never a fused multiply-add,
  so every backend and the PyTorch reference compute the same fp32 values and store the same
  bytes; a position outside the table gives NaN);
- takes the row in blocks of 128 channels (the rope slice lies in the last one), each block's
  maximum magnitude ``amax`` (NaN not counted), and its UE8M0 dequant scale
  ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))``, exactly, from the bits of ``amax``
  (``kernels.serving.pow2_exponent``: at least ``2 ** -22``);
- stores ``e4m3(x / s)`` (``x * (1 / s)``, exact for a power of two; saturating, one
  quantization per element) into ``out[t, g, hh * D + c]`` (``g = h // heads_per_group``,
  ``hh = h % heads_per_group``) and ``s`` into ``scale_out`` at block ``k = hh * D / 128 + j``
  of group ``g``: as fp32, as its exponent byte, or as byte ``k % 4`` of the int32 element
  ``k // 4`` (four UE8M0 scales packed little-endian).

The e4m3 encoder is the serving kernels' (``kernels.serving.e4m3_codes``): the hardware's
saturating conversion in compiled code, integer operations under Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Core import point (the launcher, the grid, the bf16 loads; the serving encoders).
from ._launch import DirectLauncher
from ._tiles import next_power_of_2, program_tile, tile_grid
from ._triton_compat import INTERPRETED
from .rotation import negate, to_f32
from .serving import e4m3_codes, native_casts, pow2_exponent

BLOCK = 128  # channels per scale (DeepSeek's FP8 activation block)
MIN_EXPONENT = 105  # biased exponent of 2**-22: the scale of amax = 1e-4 (fp32), the floor
SCALE_FP32 = 0  # scale_out holds fp32 scales (their bits, stored as int32)
SCALE_E8M0 = 1  # scale_out holds UE8M0 bytes (one a block, or four to an int32 element)

_INTERPRETED = tl.constexpr(INTERPRETED)
_BLOCK = tl.constexpr(BLOCK)
_MIN_EXPONENT = tl.constexpr(MIN_EXPONENT)
_SCALE_FP32 = tl.constexpr(SCALE_FP32)


@triton.jit
def _product(x, y):
    """fp32 ``x * y`` rounded once (IEEE, subnormals kept), never contracted into a fused
    multiply-add with what uses it: PTX ``mul.rn.f32`` in compiled code (an explicit rounding
    modifier forbids contraction; libdevice's ``mul_rn`` would flush subnormals, ``.ftz``),
    numpy's product under the interpreter."""
    if _INTERPRETED:
        return x * y
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _magnitude(x):
    """``|x|`` with NaN counted as 0 (a NaN does not set its block's scale)."""
    return tl.where(x == x, tl.abs(x), 0.0)


@triton.jit
def _store_scale(scale_ptr, row, k, exponent, mask, PACK: tl.constexpr,
                 SCALE_FMT: tl.constexpr, stride_s_k):  # fmt: skip
    """Block ``k``'s scale at ``scale_ptr + row``: fp32 bits (an int32 pointer), the exponent
    byte (a ``uint8`` pointer), or (``PACK`` 4, an int32 pointer, ``row`` and ``stride_s_k`` in
    bytes) the exponent as byte ``k % 4`` of element ``k // 4``, little-endian."""
    if SCALE_FMT == _SCALE_FP32:
        tl.store(scale_ptr + row + k * stride_s_k, exponent << 23, mask=mask)
    elif PACK == 1:
        tl.store(scale_ptr + row + k * stride_s_k, exponent.to(tl.uint8), mask=mask)
    else:
        byte_ptr = scale_ptr.to(tl.pointer_type(tl.uint8))
        where = (k // PACK) * stride_s_k + (k % PACK)
        tl.store(byte_ptr + row + where, exponent.to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _rope_inverse_quant_kernel(
    o_ptr,  # [T, H, D]
    out_ptr,  # uint8 view of [T, G, (H / G) * D]
    scale_ptr,  # the scales: int32 view (fp32 bits, or packed UE8M0) or uint8 (UE8M0 bytes)
    cos_ptr, sin_ptr,  # [P, R], or [P, R / 2] (PAIR_TABLE)
    pos_ptr,  # [T] int32 / int64
    n_tokens, n_heads, n_head_blocks, n_rows,
    stride_o_t, stride_o_h, stride_out_t, stride_out_g, stride_s_t, stride_s_g, stride_s_k,
    stride_pos, stride_table,
    D: tl.constexpr,  # head dim, a multiple of 128
    HALF: tl.constexpr,  # R / 2
    PAIR_TABLE: tl.constexpr,  # cos, sin: [P, HALF], one entry per pair (else [P, 2 * HALF])
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PACK: tl.constexpr,  # scales per scale_out element: 1, or 4 (UE8M0 bytes in an int32)
    SCALE_FMT: tl.constexpr,
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
    NATIVE: tl.constexpr,  # native_casts()
    WHOLE_ROW: tl.constexpr,  # load each head row whole before storing (D a power of two)
):  # fmt: skip
    N: tl.constexpr = D - 2 * HALF  # nope channels
    NB: tl.constexpr = D // _BLOCK
    tl.static_assert(D % 128 == 0)
    tl.static_assert(N >= D - 128)  # the rope slice lies in the last block
    i_t, i_h = program_tile(n_head_blocks)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    head = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # int32: the group split is not a 64-bit division
    m_t = o_t < n_tokens
    m_th = m_t[:, None] & (head < n_heads)[None, :]
    m_row = m_th[:, :, None]
    group = (head // HEADS_PER_GROUP).to(tl.int64)
    within = (head % HEADS_PER_GROUP).to(tl.int64)
    o_h = head.to(tl.int64)

    o_row = (o_t * stride_o_t)[:, None, None] + (o_h * stride_o_h)[None, :, None]
    out_row = (o_t * stride_out_t)[:, None, None] + (group * stride_out_g + within * D)[
        None, :, None
    ]
    s_row = (o_t * stride_s_t)[:, None] + (group * stride_s_g)[None, :]
    k_first = (within * NB)[None, :]  # the head's first block within its group

    pos = tl.load(pos_ptr + o_t * stride_pos, mask=m_t, other=0).to(tl.int64)
    in_range = (pos >= 0) & (pos < n_rows)
    table_row = (tl.where(m_t & in_range, pos, 0) * stride_table)[:, None, None]
    out_of_range = (~in_range)[:, None, None]

    if WHOLE_ROW:
        # Every load of the program is issued before its first store (the compiler cannot
        # move a later block's loads above an earlier block's stores: ``out`` might alias ``o``
        # for all it knows), so a program waits for memory once instead of once a block.
        c = tl.arange(0, D)[None, None, :]
        x = to_f32(tl.load(o_ptr + o_row + c, mask=m_row & (c < N), other=0.0))
        x = tl.reshape(x, (BLOCK_T, BLOCK_H, NB, _BLOCK))
        # The rope slice from the last block's channels only (its gathers over the whole row
        # would be four times the predicated loads), then put in as that block.
        c_last = (NB - 1) * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]
        rotated = _rotated_block(o_ptr, o_row, c_last, tl.zeros_like(c_last).to(tl.float32),
                                 m_row, cos_ptr, sin_ptr, table_row, out_of_range, N, HALF,
                                 PAIR_TABLE, INTERLEAVED_IN, INTERLEAVED_OUT)  # fmt: skip
        last = (tl.arange(0, NB) == NB - 1)[None, None, :, None]
        rope = (tl.arange(0, _BLOCK) >= N - (NB - 1) * _BLOCK)[None, None, None, :]
        x = tl.where(last & rope, rotated[:, :, None, :], x)
        amax = tl.max(_magnitude(x), axis=3)
        exponent = pow2_exponent(amax, _MIN_EXPONENT)
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)[:, :, :, None]
        codes = tl.reshape(e4m3_codes(x * inverse, NATIVE), (BLOCK_T, BLOCK_H, D))
        tl.store(out_ptr + out_row + c, codes, mask=m_row)
        k = tl.arange(0, NB)[None, None, :]
        _store_scale(scale_ptr, s_row[:, :, None], k_first[:, :, None] + k, exponent,
                     m_th[:, :, None], PACK, SCALE_FMT, stride_s_k)  # fmt: skip
    else:
        for k in tl.static_range(NB):
            c = k * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]
            x = to_f32(tl.load(o_ptr + o_row + c, mask=m_row & (c < N), other=0.0))
            if k == NB - 1:
                # The rope slice, channel by channel in the output layout (no split or join of
                # pairs): each output channel is its pair's a or b, from the input's a and b.
                x = _rotated_block(o_ptr, o_row, c, x, m_row, cos_ptr, sin_ptr, table_row,
                                   out_of_range, N, HALF, PAIR_TABLE, INTERLEAVED_IN,
                                   INTERLEAVED_OUT)  # fmt: skip
            amax = tl.max(_magnitude(x), axis=2)
            exponent = pow2_exponent(amax, _MIN_EXPONENT)
            inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)[:, :, None]
            # x * (1 / s) with a power-of-two s is exactly x / s.
            tl.store(out_ptr + out_row + c, e4m3_codes(x * inverse, NATIVE), mask=m_row)
            _store_scale(scale_ptr, s_row, k_first + k, exponent, m_th, PACK, SCALE_FMT, stride_s_k)


@triton.jit
def _rotated_block(o_ptr, o_row, c, x, m_row, cos_ptr, sin_ptr, table_row, out_of_range,
                   N: tl.constexpr, HALF: tl.constexpr, PAIR_TABLE: tl.constexpr,
                   INTERLEAVED_IN: tl.constexpr, INTERLEAVED_OUT: tl.constexpr):  # fmt: skip
    """The last 128-channel block ``x`` (channels ``c``; the nope ones loaded) with its rope
    channels ``c >= N`` replaced by the inverse rotation: output channel ``r = c - N`` is the
    ``a`` (``role`` 0) or ``b`` of pair ``j``, ``a' = a c_a + b s_a``, ``b' = b c_b - a s_b``,
    i.e. ``own * C + partner * S`` with ``(C, S) = (c_a, s_a)`` or ``(c_b, -s_b)``; a pair
    table's entry ``j`` is both ``c_a`` and ``c_b`` (``PAIR_TABLE``)."""
    is_rope = c >= N
    r = tl.where(is_rope, c - N, 0)
    if INTERLEAVED_OUT:
        j, role = r >> 1, r & 1
    else:
        j, role = r % HALF, r // HALF
    if INTERLEAVED_IN:
        own, partner = 2 * j + role, 2 * j + (1 - role)
    else:
        own, partner = j + role * HALF, j + (1 - role) * HALF
    m = m_row & is_rope
    x_own = to_f32(tl.load(o_ptr + o_row + N + own, mask=m, other=0.0))
    x_partner = to_f32(tl.load(o_ptr + o_row + N + partner, mask=m, other=0.0))
    t = table_row + j if PAIR_TABLE else table_row + j + role * HALF
    cos = to_f32(tl.load(cos_ptr + t, mask=m, other=1.0))
    sin = to_f32(tl.load(sin_ptr + t, mask=m, other=0.0))
    rotated = _product(x_own, cos) + _product(x_partner, tl.where(role == 0, sin, negate(sin)))
    rotated = tl.where(out_of_range, float("nan"), rotated)
    return tl.where(is_rope, rotated, x)


# ---------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class OutputConfig:
    """Tokens and heads per program, and warps; any valid one gives the same bytes.
    ``whole_row``: each head row loaded whole before any store (head dims that are a power of
    two), where the default walks its 128-channel blocks, a load and a store each, in turn; a
    variant for the benchmark's sweep, measured slower than the default tile (950 against 843
    us at its best, docs/perf_log.md v15)."""

    block_t: int
    block_h: int
    num_warps: int
    whole_row: bool = False


# Head rows a program takes: 4 rows of one 128-channel block are 512 elements a step, 16 a
# thread with one warp (two 16-byte loads of bf16), the fastest of the serving benchmark's
# sweep at 16,384 tokens of 128 heads (842.9 us, 91 % of the copy, where 16 rows and 4 warps
# took 1,014 us, 76 %; docs/perf_log.md v15); below _MIN_PROGRAMS programs (decode batches:
# four programs for each of the H200's 132 multiprocessors) fewer rows a program, down to one.
# Not under Triton's interpreter, which runs programs one after another at about the same cost
# whatever their size (150 ms each here).
_ROWS = 4
_MIN_PROGRAMS = 528


def choose_output_config(n_tokens: int, n_heads: int) -> OutputConfig:
    """Heuristic configuration of the kernel (no autotuning)."""
    block_h = min(next_power_of_2(n_heads), _ROWS)
    block_t = min(next_power_of_2(n_tokens), max(1, _ROWS // block_h))

    def programs(bt: int, bh: int) -> int:
        return -(-n_tokens // bt) * -(-n_heads // bh)

    while not INTERPRETED and block_t * block_h > 1 and programs(block_t, block_h) < _MIN_PROGRAMS:
        if block_t > 1:
            block_t //= 2
        else:
            block_h //= 2
    num_warps = min(8, next_power_of_2(max(1, block_t * block_h * BLOCK // 512)))
    return OutputConfig(block_t, block_h, num_warps)


def rope_inverse_quant_launch(
    o: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    out_codes: torch.Tensor,
    scale_bits: torch.Tensor,
    *,
    heads_per_group: int,
    pack: int,
    scale_fmt: int,
    interleaved_in: bool,
    interleaved_out: bool,
    pair_tables: bool = False,
    config: OutputConfig | None = None,
) -> None:
    """``o: [T, H, D]``, ``cos, sin: [P, R]`` or with ``pair_tables`` ``[P, R / 2]`` (equal
    strides), ``positions: [T]``;
    ``out_codes``: the ``uint8`` view of ``[T, G, (H / G) * D]``; ``scale_bits``: the int32 view
    of fp32 scales ``[T, G, (H / G) * D / 128]`` (``scale_fmt`` 0), the ``uint8`` view of UE8M0
    bytes ``[T, G, K]`` (``scale_fmt`` 1, ``pack`` 1), or int32 elements ``[T, G, K / 4]`` that
    hold four UE8M0 bytes each (``scale_fmt`` 1, ``pack`` 4)."""
    n_tokens, n_heads, head_dim = o.shape
    if n_tokens == 0 or n_heads == 0:
        return
    config = config or choose_output_config(n_tokens, n_heads)
    if config.whole_row and head_dim & (head_dim - 1):
        raise ValueError(f"whole_row needs a head dim that is a power of two, got {head_dim}")
    grid, n_head_blocks = tile_grid(n_tokens, config.block_t, n_heads, config.block_h)
    s_t, s_g, s_k = scale_bits.stride()
    if pack == 4:
        s_t, s_g, s_k = 4 * s_t, 4 * s_g, 4 * s_k
    _launch(
        grid, config.num_warps,
        o, out_codes, scale_bits, cos, sin, positions,
        n_tokens, n_heads, n_head_blocks, cos.shape[0],
        o.stride(0), o.stride(1), out_codes.stride(0), out_codes.stride(1), s_t, s_g, s_k,
        positions.stride(0), cos.stride(0),
        head_dim, cos.shape[1] if pair_tables else cos.shape[1] // 2, pair_tables,
        heads_per_group, config.block_t, config.block_h, pack,
        scale_fmt, interleaved_in, interleaved_out, native_casts(), config.whole_row,
    )  # fmt: skip


_launch = DirectLauncher(_rope_inverse_quant_kernel)
