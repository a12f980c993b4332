"""Triton kernels and launchers for the latent op (``mlarope.rmsnorm_rope_latent``): RMSNorm of
the latent and the rotation of ``k_pe``, both read from ``kv_a_proj_with_mqa``'s output once.

Forward: one program owns ``BLOCK_T`` tokens with their whole latent row in registers
(``BLOCK_L``, the power of two ``>= L``, masked). It sums the squares exactly
(``_latent_sums``: integers in any order, so the same bits for every ``BLOCK_T`` and warp
count), normalizes, rounds the normalized value to ``ckv``'s dtype, multiplies by the weight in
fp32 and stores the latent rounded once; it rotates the tokens' ``k_pe`` as the query op does.

Backward, two launches: the first owns ``TOKENS_PER_PARTIAL`` tokens per program, in tiles of
``TILE_TOKENS``. Per tile it recomputes ``r = 1 / sqrt(var + eps)`` from ``x`` (the same bits
as the forward: nothing is saved but ``ckv`` itself), writes ``d_ckv``'s latent part
``r * (dh - h_hat * m)`` and its rope part (the transpose rotation) into one buffer, and adds
the tile's exact ``sum_t g * h_r`` to the program's float64 partial of the weight's gradient;
the partials go to a ``[programs, L]`` fp32 buffer. The second launch sums the partials per
channel exactly and rounds once to the weight's dtype. No atomics, and the result depends on
``L`` and the token count only, never on a launch configuration.

The subtraction of the backward is an explicit ``tl.fma``: the compiler may not contract a
multiply and an add differently from one thread layout to another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._latent_sums import MIN_EXPONENT as _MIN_EXPONENT
from .._latent_sums import TILE_TOKENS, TILES_PER_PARTIAL, headroom_bits
from ..positions import Positions
from ._launch import DirectLauncher
from ._tiles import cdiv, next_power_of_2, tile_grid
from ._triton_compat import loop_bound
from .lookup import VARYING_INTS, position_args, tile_positions
from .rotation import from_f32, load_table_halves, negate, rotate, round_to_16bit, to_f32

_VARYING = VARYING_INTS
MIN_EXPONENT = tl.constexpr(_MIN_EXPONENT)


@triton.jit
def _power_of_two(exponent):
    """``2.0 ** exponent`` (int64, in float64's normal range) as float64, exactly."""
    return ((exponent + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _special(flags, value):
    """``value`` where the terms were finite (``flags`` 0); NaN for a NaN term (4 and over) or
    infinities of both signs (3), +inf (2) or -inf (1) alone."""
    value = tl.where(flags == 1, float("-inf"), value)
    value = tl.where(flags == 2, float("inf"), value)
    return tl.where(flags >= 3, float("nan"), value)


@triton.jit
def _kinds(t, AXIS: tl.constexpr):
    """What non-finite float64 terms ``t`` hold along ``AXIS``, as ``_special`` takes it: 4 for
    a NaN, 2 for +inf, 1 for -inf, ORed (two max reductions: an OR reduction's combine function
    is slow under Triton's interpreter)."""
    nan = t != t
    up = tl.max(tl.where(nan, 4, tl.where(t == float("inf"), 2, 0)), axis=AXIS)
    down = tl.max(tl.where(nan, 4, tl.where(t == float("-inf"), 1, 0)), axis=AXIS)
    return up | down


@triton.jit
def _exact_sum(t, AXIS: tl.constexpr, K: tl.constexpr):
    """float64 ``t`` summed over ``AXIS`` exactly up to a quantum (``_latent_sums.exact_sum``):
    every finite term as an int64 number of quanta ``2**(e - K)``, ``e`` from the largest
    magnitude, added in int64 (in any order: the same bits for every thread layout)."""
    finite = (t - t) == 0.0
    magnitude = tl.max(tl.where(finite, tl.abs(t), 0.0), axis=AXIS)
    exponent = tl.maximum((magnitude.to(tl.int64, bitcast=True) >> 52) - 1022, MIN_EXPONENT)
    shift = K - exponent
    quanta = tl.where(finite, t * tl.expand_dims(_power_of_two(shift), AXIS), 0.0)
    total = tl.sum(quanta.to(tl.int64), axis=AXIS).to(tl.float64) * _power_of_two(-shift)
    return _special(_kinds(t, AXIS), total)


@triton.jit
def _normalize(x, n_latent, eps, ROWS: tl.constexpr, K_ROW: tl.constexpr,
               IN_DTYPE: tl.constexpr):  # fmt: skip
    """RMSNorm's pieces of fp32 ``x: [ROWS, BLOCK_L]`` (zero past ``L``): ``r: [ROWS]``,
    ``h_hat = x * r`` and ``h_r``, ``h_hat`` rounded to ``IN_DTYPE`` (as fp32). The variance's
    sum is exact, divided by ``L`` in float64 and rounded once; then a correctly rounded square
    root and division (``sqrt_rn``, ``div_rn``: the reference's, where ``rsqrt`` is
    approximate)."""
    x64 = x.to(tl.float64)
    var = (_exact_sum(x64 * x64, 1, K_ROW) / n_latent).to(tl.float32)
    one = tl.full((ROWS,), 1.0, tl.float32)
    r = tl.math.div_rn(one, tl.math.sqrt_rn(var + eps))
    h_hat = x * r[:, None]
    if IN_DTYPE.is_fp32():  # noqa: SIM108 (a compile-time branch: fp32 needs no rounding)
        h_r = h_hat
    else:
        h_r = round_to_16bit(h_hat, IN_DTYPE)
    return r, h_hat, h_r


@triton.jit
def _load_pairs(ptr, row, m_t, HALF: tl.constexpr, ROWS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The pairs ``(a, b)`` of ``R`` channels at ``ptr + row``, fp32 ``[ROWS, HALF]`` each."""
    j = tl.arange(0, HALF)[None, :]
    if INTERLEAVED:
        k = tl.arange(0, 2 * HALF)[None, :]
        x = to_f32(tl.load(ptr + row[:, None] + k, mask=m_t[:, None] & (k < 2 * HALF), other=0.0))
        a, b = tl.split(tl.reshape(x, (ROWS, HALF, 2)))
    else:
        m = m_t[:, None] & (j < HALF)
        a = to_f32(tl.load(ptr + row[:, None] + j, mask=m, other=0.0))
        b = to_f32(tl.load(ptr + row[:, None] + HALF + j, mask=m, other=0.0))
    return a, b


@triton.jit
def _store_pairs(ptr, row, m_t, a, b, HALF: tl.constexpr, ROWS: tl.constexpr,
                 INTERLEAVED: tl.constexpr):  # fmt: skip
    """Store the pairs ``(a, b)`` (already the stored dtype) at ``ptr + row``."""
    if INTERLEAVED:
        k = tl.arange(0, 2 * HALF)[None, :]
        pairs = tl.reshape(tl.join(a, b), (ROWS, 2 * HALF))
        tl.store(ptr + row[:, None] + k, pairs, mask=m_t[:, None] & (k < 2 * HALF))
    else:
        j = tl.arange(0, HALF)[None, :]
        m = m_t[:, None] & (j < HALF)
        tl.store(ptr + row[:, None] + j, a, mask=m)
        tl.store(ptr + row[:, None] + HALF + j, b, mask=m)


@triton.jit
def _rotated_rows(src_ptr, src_row, o_t, i0, i1, m_t, cos_ptr, sin_ptr, n_rows, stride_table,
                  ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,
                  POS_MODE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                  INTERLEAVED_IN: tl.constexpr, TRANSPOSE: tl.constexpr):  # fmt: skip
    """The rotation (``TRANSPOSE``: its transpose) of the ``R`` channels at ``src_ptr + src_row``
    by each token's table row, fp32 pairs ``[ROWS, HALF]``: padding passes through, an
    out-of-range position gives NaN (``rotation.rotate``)."""
    pos, is_padding = tile_positions(
        o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size, POS_MODE,
    )  # fmt: skip
    in_range = (pos >= 0) & (pos < n_rows)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = load_table_halves(
        cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
    )
    a, b = _load_pairs(src_ptr, src_row, m_t, HALF, ROWS, INTERLEAVED_IN)
    return rotate(
        a, b, c_a, c_b, s_a, s_b, is_padding[:, None], (~in_range & ~is_padding)[:, None],
        False, TRANSPOSE,
    )  # fmt: skip


@triton.jit(do_not_specialize=_VARYING)
def _latent_fwd_kernel(
    ckv_ptr,  # [D0, D1, L + R] (thd: D1 = 1), last dim contiguous
    w_ptr,  # [L], contiguous
    latent_ptr,  # [T, L], contiguous
    kpe_ptr,  # [T, R], contiguous
    cos_ptr, sin_ptr,  # [P, R]
    n_tokens, D1, n_latent, n_rows, eps,
    stride_c0, stride_c1,
    stride_table,
    ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,  # lookup.position_args
    POS_MODE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    K_ROW: tl.constexpr,  # _latent_sums.headroom_bits(L)
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
):  # fmt: skip
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    m_t = o_t < n_tokens
    i0 = o_t // D1
    i1 = o_t % D1
    row = i0 * stride_c0 + i1 * stride_c1  # int64: token index x stride can pass 2**31
    c = tl.arange(0, BLOCK_L)
    m_c = c < n_latent
    m = m_t[:, None] & m_c[None, :]
    x = to_f32(tl.load(ckv_ptr + row[:, None] + c[None, :], mask=m, other=0.0))
    w = to_f32(tl.load(w_ptr + c, mask=m_c, other=0.0))
    _, _, h_r = _normalize(x, n_latent, eps, BLOCK_T, K_ROW, ckv_ptr.dtype.element_ty)
    latent = from_f32(w[None, :] * h_r, latent_ptr.dtype.element_ty)
    tl.store(latent_ptr + o_t[:, None] * n_latent + c[None, :], latent, mask=m)

    out_a, out_b = _rotated_rows(
        ckv_ptr + n_latent, row, o_t, i0, i1, m_t, cos_ptr, sin_ptr, n_rows, stride_table,
        ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size, POS_MODE, HALF, BLOCK_T,
        INTERLEAVED_IN, False,
    )  # fmt: skip
    out_a = from_f32(out_a, kpe_ptr.dtype.element_ty)
    out_b = from_f32(out_b, kpe_ptr.dtype.element_ty)
    _store_pairs(kpe_ptr, o_t * (2 * HALF), m_t, out_a, out_b, HALF, BLOCK_T, INTERLEAVED_OUT)


@triton.jit(do_not_specialize=_VARYING)
def _latent_bwd_kernel(
    gl_ptr,  # g_latent [D0, D1, L], last dim contiguous
    gp_ptr,  # g_pe [D0, D1, R], last dim contiguous
    ckv_ptr,  # [D0, D1, L + R], last dim contiguous
    w_ptr,  # [L], contiguous
    dckv_ptr,  # [T, L + R], contiguous
    partial_ptr,  # [programs, L] fp32 (WEIGHT_GRAD)
    cos_ptr, sin_ptr,  # [P, R]
    n_tokens, D1, n_latent, n_rows, eps,
    stride_c0, stride_c1,
    stride_gl0, stride_gl1,
    stride_gp0, stride_gp1,
    stride_table,
    ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,  # lookup.position_args
    POS_MODE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    K_ROW: tl.constexpr,  # _latent_sums.headroom_bits(L)
    TILE: tl.constexpr,  # _latent_sums.TILE_TOKENS
    K_TILE: tl.constexpr,  # _latent_sums.headroom_bits(TILE)
    TILES: tl.constexpr,  # _latent_sums.TILES_PER_PARTIAL
    INTERLEAVED_IN: tl.constexpr,  # ckv's pair layout (d_ckv's rope part is written in it)
    INTERLEAVED_OUT: tl.constexpr,  # k_pe's pair layout (g_pe is read in it)
    WEIGHT_GRAD: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_L)
    m_c = c < n_latent
    w = to_f32(tl.load(w_ptr + c, mask=m_c, other=0.0))
    width = n_latent + 2 * HALF
    partial = tl.zeros((BLOCK_L,), dtype=tl.float64)
    for s in range(TILES):
        o_t = (i_p * TILES + s) * TILE + tl.arange(0, TILE).to(tl.int64)
        m_t = o_t < n_tokens
        i0 = o_t // D1
        i1 = o_t % D1
        m = m_t[:, None] & m_c[None, :]
        x_row = i0 * stride_c0 + i1 * stride_c1
        x = to_f32(tl.load(ckv_ptr + x_row[:, None] + c[None, :], mask=m, other=0.0))
        g_row = i0 * stride_gl0 + i1 * stride_gl1
        g = to_f32(tl.load(gl_ptr + g_row[:, None] + c[None, :], mask=m, other=0.0))
        r, h_hat, h_r = _normalize(x, n_latent, eps, TILE, K_ROW, ckv_ptr.dtype.element_ty)
        dh = g * w[None, :]
        dot = _exact_sum(dh.to(tl.float64) * h_hat.to(tl.float64), 1, K_ROW)
        mean = (dot / n_latent).to(tl.float32)
        dx = r[:, None] * tl.fma(negate(h_hat), mean[:, None], dh)
        d_row = o_t * width
        tl.store(
            dckv_ptr + d_row[:, None] + c[None, :], from_f32(dx, dckv_ptr.dtype.element_ty), mask=m
        )
        if WEIGHT_GRAD:
            # Masked tokens hold g = 0 and x = 0 (so h_r = 0): zero terms, as the padding of
            # _latent_sums' tiles.
            partial = partial + _exact_sum(g.to(tl.float64) * h_r.to(tl.float64), 0, K_TILE)

        d_a, d_b = _rotated_rows(
            gp_ptr, i0 * stride_gp0 + i1 * stride_gp1, o_t, i0, i1, m_t, cos_ptr, sin_ptr,
            n_rows, stride_table, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,
            POS_MODE, HALF, TILE, INTERLEAVED_OUT, True,
        )  # fmt: skip
        d_a = from_f32(d_a, dckv_ptr.dtype.element_ty)
        d_b = from_f32(d_b, dckv_ptr.dtype.element_ty)
        _store_pairs(dckv_ptr + n_latent, d_row, m_t, d_a, d_b, HALF, TILE, INTERLEAVED_IN)
    if WEIGHT_GRAD:
        tl.store(partial_ptr + i_p * n_latent + c, partial.to(tl.float32), mask=m_c)


@triton.jit(do_not_specialize=["n_partials", "k_sum"])
def _weight_grad_kernel(
    partial_ptr,  # [n_partials, L] fp32
    dw_ptr,  # [L]
    n_partials,
    n_latent,
    k_sum,  # _latent_sums.headroom_bits(n_partials)
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """``dw[c] = sum_p partial[p, c]``, exactly (``_latent_sums.exact_sum``) in two passes over
    the partials, ``BLOCK_P`` rows a step: their largest magnitude, then the int64 sum of their
    quanta; rounded once to fp32, then to ``dw``'s dtype."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = c < n_latent
    magnitude = tl.zeros((BLOCK_C,), dtype=tl.float64)
    flags = tl.zeros((BLOCK_C,), dtype=tl.int32)
    for p0 in range(0, loop_bound(n_partials), BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        m = (p < n_partials)[:, None] & m_c[None, :]
        t = tl.load(partial_ptr + p[:, None] * n_latent + c[None, :], mask=m, other=0.0)
        t = t.to(tl.float64)
        finite = (t - t) == 0.0
        magnitude = tl.maximum(magnitude, tl.max(tl.where(finite, tl.abs(t), 0.0), axis=0))
        flags = flags | _kinds(t, 0)
    exponent = tl.maximum((magnitude.to(tl.int64, bitcast=True) >> 52) - 1022, MIN_EXPONENT)
    shift = k_sum - exponent
    total = tl.zeros((BLOCK_C,), dtype=tl.int64)
    for p0 in range(0, loop_bound(n_partials), BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        m = (p < n_partials)[:, None] & m_c[None, :]
        t = tl.load(partial_ptr + p[:, None] * n_latent + c[None, :], mask=m, other=0.0)
        t = t.to(tl.float64)
        quanta = tl.where((t - t) == 0.0, t * _power_of_two(shift)[None, :], 0.0)
        total = total + tl.sum(quanta.to(tl.int64), axis=0)
    value = _special(flags, total.to(tl.float64) * _power_of_two(-shift))
    tl.store(dw_ptr + c, from_f32(value.to(tl.float32), dw_ptr.dtype.element_ty), mask=m_c)


@dataclass(frozen=True)
class LatentLaunchConfig:
    """Tiles and warps of the latent op's launches. Any valid config gives bitwise identical
    results: the sums are exact (``_latent_sums``), whatever order the threads add in."""

    block_t: int  # forward: tokens per program
    num_warps: int  # forward
    backward_warps: int
    block_c: int  # the weight-gradient sum: channels per program
    block_p: int  # ... and partials a step
    sum_warps: int


# A whole row per token in registers: about 4,096 fp32 elements per program tile (8 tokens at
# L = 512) and one warp per 512 of them, 16 a thread per live tile. The sums convert their
# terms to float64 and int64 (two registers each), and the backward keeps several tiles live
# (x, g, h_hat, h_r, dh), so a thread's share must stay small: compiled for sm_90a, the forward
# tile at 8 warps needs about 100 registers and no spills. Heuristics, not yet measured on the
# H200 (no autotuning).
_TILE_ELEMENTS = 4096
_ELEMENTS_PER_WARP = 512
# The weight-gradient sum: 32 channels x 32 partials a step, one warp per 512 elements; L / 32
# programs (16 at L = 512), each reading the [programs, L] fp32 partials twice (1 MiB at 16,384
# tokens and L = 512: in L2).
_SUM_CHANNELS = 32
_SUM_ROWS = 32


def _warps(elements: int) -> int:
    return min(8, next_power_of_2(max(1, elements // _ELEMENTS_PER_WARP)))


def choose_latent_config(n_tokens: int, n_latent: int) -> LatentLaunchConfig:
    """Heuristic launch configuration (the reasons are in the comments above)."""
    block_l = next_power_of_2(n_latent)
    block_t = min(next_power_of_2(n_tokens), max(1, _TILE_ELEMENTS // block_l))
    block_c = min(_SUM_CHANNELS, block_l)
    return LatentLaunchConfig(
        block_t=block_t,
        num_warps=_warps(block_t * block_l),
        backward_warps=_warps(TILE_TOKENS * block_l),
        block_c=block_c,
        block_p=_SUM_ROWS,
        sum_warps=_warps(block_c * _SUM_ROWS),
    )


def _token_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """``(D0, D1, stride0, stride1)`` of ``[D0, D1, C]`` or ``[T, C]`` (as ``[T, 1, C]``)."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def latent_launch(
    ckv: torch.Tensor,
    weight: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    eps: float,
    interleaved_in: bool,
    interleaved_out: bool,
    config: LatentLaunchConfig | None = None,
) -> None:
    """Forward: ``ckv: [tokens..., L + R]``, ``weight: [L]`` into contiguous
    ``latent: [tokens..., L]`` and ``k_pe: [tokens..., R]``; ``cos, sin: [P, R]``."""
    d0, d1, stride_c0, stride_c1 = _token_strides(ckv)
    n_tokens, n_latent, rope_dim = d0 * d1, weight.shape[0], cos.shape[-1]
    if n_tokens == 0:
        return
    config = config or choose_latent_config(n_tokens, n_latent)
    grid, _ = tile_grid(n_tokens, config.block_t, 1, 1)
    pos_mode, pos_args = position_args(positions, ckv, (d0, d1))
    _launch_fwd(
        grid, config.num_warps,
        ckv, weight, latent, k_pe, cos, sin,
        n_tokens, d1, n_latent, cos.shape[0], eps,
        stride_c0, stride_c1,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, config.block_t, next_power_of_2(n_latent),
        headroom_bits(n_latent), interleaved_in, interleaved_out,
    )  # fmt: skip


def latent_backward_launch(
    g_latent: torch.Tensor,
    g_pe: torch.Tensor,
    ckv: torch.Tensor,
    weight: torch.Tensor,
    d_ckv: torch.Tensor,
    d_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    eps: float,
    interleaved_in: bool,
    interleaved_out: bool,
    config: LatentLaunchConfig | None = None,
) -> None:
    """Backward: ``g_latent: [tokens..., L]``, ``g_pe: [tokens..., R]`` (and the forward's
    ``ckv``, ``weight``) into contiguous ``d_ckv: [tokens..., L + R]`` and, unless None,
    ``d_weight: [L]``; two launches (one without ``d_weight``)."""
    d0, d1, stride_c0, stride_c1 = _token_strides(ckv)
    _, _, stride_gl0, stride_gl1 = _token_strides(g_latent)
    _, _, stride_gp0, stride_gp1 = _token_strides(g_pe)
    n_tokens, n_latent, rope_dim = d0 * d1, weight.shape[0], cos.shape[-1]
    config = config or choose_latent_config(n_tokens, n_latent)
    weight_grad = d_weight is not None
    if n_tokens == 0:
        if weight_grad:
            d_weight.zero_()
        return
    grid, _ = tile_grid(n_tokens, TILE_TOKENS * TILES_PER_PARTIAL, 1, 1)
    n_partials = grid[0]
    partials = d_ckv  # a placeholder pointer without WEIGHT_GRAD
    if weight_grad:
        partials = torch.empty((n_partials, n_latent), dtype=torch.float32, device=ckv.device)
    pos_mode, pos_args = position_args(positions, ckv, (d0, d1))
    _launch_bwd(
        grid, config.backward_warps,
        g_latent, g_pe, ckv, weight, d_ckv, partials, cos, sin,
        n_tokens, d1, n_latent, cos.shape[0], eps,
        stride_c0, stride_c1,
        stride_gl0, stride_gl1,
        stride_gp0, stride_gp1,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, next_power_of_2(n_latent), headroom_bits(n_latent),
        TILE_TOKENS, headroom_bits(TILE_TOKENS), TILES_PER_PARTIAL, interleaved_in,
        interleaved_out, weight_grad,
    )  # fmt: skip
    if weight_grad:
        _launch_sum(
            (cdiv(n_latent, config.block_c),), config.sum_warps,
            partials, d_weight, n_partials, n_latent, headroom_bits(n_partials),
            config.block_c, config.block_p,
        )  # fmt: skip


_launch_fwd = DirectLauncher(_latent_fwd_kernel)
_launch_bwd = DirectLauncher(_latent_bwd_kernel)
_launch_sum = DirectLauncher(_weight_grad_kernel)
