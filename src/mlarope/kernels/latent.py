"""Triton kernels and launchers for the latent op (``mlarope.rmsnorm_rope_latent``): RMSNorm of
the latent and the rotation of ``k_pe``, both read from ``kv_a_proj_with_mqa``'s output once.

Forward: one program owns ``BLOCK_T`` tokens with their whole latent row in registers
(``BLOCK_L``, the power of two ``>= L``, masked). It sums the squares in the fixed order of
``_latent_order`` (the same bits for every ``BLOCK_T`` and warp count), normalizes, rounds the
normalized value to ``ckv``'s dtype, multiplies by the weight in fp32 and stores the latent
rounded once; it rotates the tokens' ``k_pe`` as the query op does.

Backward, two launches: the first owns ``TOKENS_PER_PARTIAL`` tokens per program, in tiles of
``TILE_TOKENS``. Per tile it recomputes ``r = 1 / sqrt(var + eps)`` from ``x`` (the same bits
as the forward: nothing is saved but ``ckv`` itself), writes ``d_ckv``'s latent part
``r * (dh - h_hat * m)`` and its rope part (the transpose rotation) into one buffer, and adds
the tile's ``sum_t g * h_r`` to the program's fp32 partial of the weight's gradient; the
partials go to a ``[programs, L]`` fp32 buffer. The second launch sums the partials per channel
in chunks (``_latent_order``) and rounds once to the weight's dtype. No atomics: the order is
a function of ``L`` and the token count only, never of a launch configuration.

Every product that feeds a sum is an explicit ``tl.fma`` (the first level of each tree, the
subtraction of the backward): the compiler may not contract a multiply and an add differently
from one thread layout to another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._latent_order import PARTIALS_PER_CHUNK, TILE_TOKENS, TILES_PER_PARTIAL, padded_width
from ..positions import Positions
from ._launch import DirectLauncher
from ._tiles import cdiv, next_power_of_2, tile_grid
from ._triton_compat import loop_bound
from .lookup import VARYING_INTS, position_args, tile_positions
from .rotation import from_f32, load_table_halves, negate, rotate, round_to_16bit, to_f32

_VARYING = [*VARYING_INTS, "n_latent"]


@triton.jit
def _row_sums(a, b, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr):
    """``[ROWS, N]`` x2 -> ``[ROWS]``: ``sum_c a * b`` in ``_latent_order``'s order (adjacent
    channels: one ``fma``, then adjacent pairs added level after level)."""
    a0, a1 = tl.split(tl.reshape(a, (ROWS, N // 2, 2)))
    b0, b1 = tl.split(tl.reshape(b, (ROWS, N // 2, 2)))
    s = tl.fma(a0, b0, a1 * b1)
    for i in tl.static_range(1, LOG2_N):
        p, q = tl.split(tl.reshape(s, (ROWS, N >> (i + 1), 2)))
        s = p + q
    return tl.reshape(s, (ROWS,))


@triton.jit
def _halve_rows(s, ROWS: tl.constexpr, N: tl.constexpr):
    """``[ROWS, N] -> [ROWS / 2, N]``: row ``2i`` plus row ``2i + 1``."""
    p, q = tl.split(tl.permute(tl.reshape(s, (ROWS // 2, 2, N)), (0, 2, 1)))
    return p + q


@triton.jit
def _token_sums(g, h, ROWS: tl.constexpr, LOG2_ROWS: tl.constexpr, N: tl.constexpr):
    """``[ROWS, N]`` x2 -> ``[N]``: ``sum_t g * h`` over the rows (tokens), in
    ``_latent_order``'s order (adjacent tokens: one ``fma``, then adjacent pairs)."""
    g0, g1 = tl.split(tl.permute(tl.reshape(g, (ROWS // 2, 2, N)), (0, 2, 1)))
    h0, h1 = tl.split(tl.permute(tl.reshape(h, (ROWS // 2, 2, N)), (0, 2, 1)))
    s = tl.fma(g0, h0, g1 * h1)
    for i in tl.static_range(1, LOG2_ROWS):
        s = _halve_rows(s, ROWS >> i, N)
    return tl.reshape(s, (N,))


@triton.jit
def _normalize(x, n_latent, eps, ROWS: tl.constexpr, BLOCK_L: tl.constexpr,
               LOG2_L: tl.constexpr, IN_DTYPE: tl.constexpr):  # fmt: skip
    """RMSNorm's pieces of fp32 ``x: [ROWS, BLOCK_L]`` (zero past ``L``): ``r: [ROWS]``,
    ``h_hat = x * r`` and ``h_r``, ``h_hat`` rounded to ``IN_DTYPE`` (as fp32). Correctly
    rounded division and square root (``div_rn``, ``sqrt_rn``: the reference's
    ``reciprocal(sqrt(var + eps))`` on every backend, where ``rsqrt`` would be approximate)."""
    var = tl.math.div_rn(_row_sums(x, x, ROWS, BLOCK_L, LOG2_L), n_latent.to(tl.float32))
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
    LOG2_L: tl.constexpr,
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
    _, _, h_r = _normalize(x, n_latent, eps, BLOCK_T, BLOCK_L, LOG2_L, ckv_ptr.dtype.element_ty)
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
    LOG2_L: tl.constexpr,
    TILE: tl.constexpr,  # _latent_order.TILE_TOKENS
    LOG2_TILE: tl.constexpr,
    TILES: tl.constexpr,  # _latent_order.TILES_PER_PARTIAL
    INTERLEAVED_IN: tl.constexpr,  # ckv's pair layout (d_ckv's rope part is written in it)
    INTERLEAVED_OUT: tl.constexpr,  # k_pe's pair layout (g_pe is read in it)
    WEIGHT_GRAD: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    c = tl.arange(0, BLOCK_L)
    m_c = c < n_latent
    w = to_f32(tl.load(w_ptr + c, mask=m_c, other=0.0))
    width = n_latent + 2 * HALF
    partial = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for s in tl.static_range(TILES):
        o_t = (i_p.to(tl.int64) * TILES + s) * TILE + tl.arange(0, TILE).to(tl.int64)
        m_t = o_t < n_tokens
        i0 = o_t // D1
        i1 = o_t % D1
        m = m_t[:, None] & m_c[None, :]
        x_row = i0 * stride_c0 + i1 * stride_c1
        x = to_f32(tl.load(ckv_ptr + x_row[:, None] + c[None, :], mask=m, other=0.0))
        g_row = i0 * stride_gl0 + i1 * stride_gl1
        g = to_f32(tl.load(gl_ptr + g_row[:, None] + c[None, :], mask=m, other=0.0))
        r, h_hat, h_r = _normalize(
            x, n_latent, eps, TILE, BLOCK_L, LOG2_L, ckv_ptr.dtype.element_ty
        )
        dh = g * w[None, :]
        mean = tl.math.div_rn(_row_sums(dh, h_hat, TILE, BLOCK_L, LOG2_L), n_latent.to(tl.float32))
        dx = r[:, None] * tl.fma(negate(h_hat), mean[:, None], dh)
        d_row = o_t * width
        tl.store(
            dckv_ptr + d_row[:, None] + c[None, :], from_f32(dx, dckv_ptr.dtype.element_ty), mask=m
        )
        if WEIGHT_GRAD:
            # Masked tokens hold g = 0, h_r = 0: the zero padding of _latent_order's tiles.
            tile = _token_sums(g, h_r, TILE, LOG2_TILE, BLOCK_L)
            if s == 0:  # noqa: SIM108 (s is a compile-time constant: no select is emitted)
                partial = tile
            else:
                partial = partial + tile

        d_a, d_b = _rotated_rows(
            gp_ptr, i0 * stride_gp0 + i1 * stride_gp1, o_t, i0, i1, m_t, cos_ptr, sin_ptr,
            n_rows, stride_table, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,
            POS_MODE, HALF, TILE, INTERLEAVED_OUT, True,
        )  # fmt: skip
        d_a = from_f32(d_a, dckv_ptr.dtype.element_ty)
        d_b = from_f32(d_b, dckv_ptr.dtype.element_ty)
        _store_pairs(dckv_ptr + n_latent, d_row, m_t, d_a, d_b, HALF, TILE, INTERLEAVED_IN)
    if WEIGHT_GRAD:
        tl.store(partial_ptr + i_p.to(tl.int64) * n_latent + c, partial, mask=m_c)


@triton.jit(do_not_specialize=["n_partials"])
def _weight_grad_kernel(
    partial_ptr,  # [n_partials, L] fp32
    dw_ptr,  # [L]
    n_partials,
    n_latent,
    BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,  # _latent_order.PARTIALS_PER_CHUNK
    LOG2_CHUNK: tl.constexpr,
):  # fmt: skip
    """``dw[c] = sum_p partial[p, c]``: chunks of ``CHUNK`` partials summed as trees (zero
    padded), the chunk sums added in order to 0; rounded once to ``dw``'s dtype."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = c < n_latent
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(0, loop_bound(n_partials), CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        m = (p < n_partials)[:, None] & m_c[None, :]
        s = tl.load(
            partial_ptr + p.to(tl.int64)[:, None] * n_latent + c[None, :], mask=m, other=0.0
        )
        for i in tl.static_range(LOG2_CHUNK):
            s = _halve_rows(s, CHUNK >> i, BLOCK_C)
        total = total + tl.reshape(s, (BLOCK_C,))
    tl.store(dw_ptr + c, from_f32(total, dw_ptr.dtype.element_ty), mask=m_c)


@dataclass(frozen=True)
class LatentLaunchConfig:
    """Tiles and warps of the latent op's launches. Any valid config gives bitwise identical
    results: the sums' order does not depend on it (``_latent_order``)."""

    block_t: int  # forward: tokens per program
    num_warps: int  # forward
    backward_warps: int
    block_c: int  # the weight-gradient sum: channels per program
    sum_warps: int


# A whole row per token in registers: about 4,096 fp32 elements per program tile (8 tokens at
# L = 512) and one warp per 512 of them, 16 a thread per live tile. The backward keeps about six
# such tiles live (x, g, h_hat, h_r, dh and a product), so a thread's share must stay small to
# avoid spills. Not yet measured on the H200: heuristics, no autotuning (docs/perf_log.md).
_TILE_ELEMENTS = 4096
_ELEMENTS_PER_WARP = 512
# The weight-gradient sum: 32 channels x 64 partials (2,048 elements) per step, 2 warps; L / 32
# programs (16 at L = 512), each looping over the partials.
_SUM_CHANNELS = 32


def _warps(elements: int) -> int:
    return min(8, next_power_of_2(max(1, elements // _ELEMENTS_PER_WARP)))


def choose_latent_config(n_tokens: int, n_latent: int) -> LatentLaunchConfig:
    """Heuristic launch configuration (the reasons are in the comments above)."""
    block_l = padded_width(n_latent)
    block_t = min(next_power_of_2(n_tokens), max(1, _TILE_ELEMENTS // block_l))
    block_c = min(_SUM_CHANNELS, block_l)
    return LatentLaunchConfig(
        block_t=block_t,
        num_warps=_warps(block_t * block_l),
        backward_warps=_warps(TILE_TOKENS * block_l),
        block_c=block_c,
        sum_warps=_warps(block_c * PARTIALS_PER_CHUNK),
    )


def _log2(n: int) -> int:
    return n.bit_length() - 1


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
    block_l = padded_width(n_latent)
    grid, _ = tile_grid(n_tokens, config.block_t, 1, 1)
    pos_mode, pos_args = position_args(positions, ckv, (d0, d1))
    _launch_fwd(
        grid, config.num_warps,
        ckv, weight, latent, k_pe, cos, sin,
        n_tokens, d1, n_latent, cos.shape[0], eps,
        stride_c0, stride_c1,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, config.block_t, block_l, _log2(block_l),
        interleaved_in, interleaved_out,
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
    block_l = padded_width(n_latent)
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
        pos_mode, rope_dim // 2, block_l, _log2(block_l), TILE_TOKENS, _log2(TILE_TOKENS),
        TILES_PER_PARTIAL, interleaved_in, interleaved_out, weight_grad,
    )  # fmt: skip
    if weight_grad:
        _launch_sum(
            (cdiv(n_latent, config.block_c),), config.sum_warps,
            partials, d_weight, n_partials, n_latent,
            config.block_c, PARTIALS_PER_CHUNK, _log2(PARTIALS_PER_CHUNK),
        )  # fmt: skip


_launch_fwd = DirectLauncher(_latent_fwd_kernel)
_launch_bwd = DirectLauncher(_latent_bwd_kernel)
_launch_sum = DirectLauncher(_weight_grad_kernel)
