"""Triton kernels and launchers for the key/value op.

Both run on the head-major 1-D grid of ``_tiles``: a token's head blocks are adjacent programs.

Forward: one program owns ``BLOCK_T`` tokens x ``BLOCK_H`` heads. It rotates the tokens' shared
``k_pe`` (fp32, one rounding; every head block of a token computes the same bits), writes it
into each of its heads' ``k[..., K:]``, and copies ``kv[..., :K]`` into ``k`` and
(``COPY_V``) ``kv[..., K:]`` into ``v``.

Backward: the same tiling copies ``dk[..., :K]`` and ``dv`` into ``dkv``. The programs of the
first head block also own their tokens' ``dk_pe``: the sum over *all* heads of ``dk[..., K:]``
(fp32, in a fixed order that depends on the head count only: ``_sum_heads``), transpose-rotated
and rounded once. The sum never leaves one program: no atomics, bitwise deterministic, and the
same bits for every launch configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..positions import Positions
from ._launch import DirectLauncher
from ._tiles import cdiv, geometry, next_power_of_2, program_tile, tile_grid
from ._triton_compat import loop_bound
from .lookup import VARYING_INTS, position_args, tile_positions
from .rotation import (
    from_f32,
    load_table_halves,
    rotate,
    round_to_16bit,
    to_f32,
    transpose_rotate_rounded,
)


@triton.jit
def _copy_channels(src_ptr, dst_ptr, src_row, dst_row, m_row, first, n_channels,
                   BLOCK_C: tl.constexpr):  # fmt: skip
    """Copy channels ``first`` to ``n_channels`` of a ``[BLOCK_T, BLOCK_H]`` block of rows."""
    for c0 in range(first, loop_bound(n_channels), BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        m = m_row & (c < n_channels)
        tl.store(dst_ptr + dst_row + c, tl.load(src_ptr + src_row + c, mask=m), mask=m)


@triton.jit(do_not_specialize=VARYING_INTS)
def _rope_kv_fwd_kernel(
    kv_ptr,  # [D0, D1, H, K + V]
    kpe_ptr,  # [D0, D1, R]
    k_ptr,  # [D0, D1, H, K + R]
    v_ptr,  # [D0, D1, H, V] (COPY_V)
    cos_ptr, sin_ptr,
    n_tokens, D1, n_heads, n_head_blocks, k_dim, v_dim, n_rows,
    stride_kv0, stride_kv1, stride_kvh,
    stride_pe0, stride_pe1,
    stride_k0, stride_k1, stride_kh,
    stride_v0, stride_v1, stride_vh,
    stride_table,
    ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,  # lookup.position_args
    POS_MODE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
    COPY_V: tl.constexpr,
):  # fmt: skip
    i_t, i_h = program_tile(n_head_blocks)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = (i_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_t = o_t < n_tokens
    m_h = o_h < n_heads
    i0 = o_t // D1
    i1 = o_t % D1
    kv_row = (i0 * stride_kv0 + i1 * stride_kv1)[:, None, None] + (o_h * stride_kvh)[None, :, None]
    k_row = (i0 * stride_k0 + i1 * stride_k1)[:, None, None] + (o_h * stride_kh)[None, :, None]
    m_row = m_t[:, None, None] & m_h[None, :, None]
    if not COPY_V:
        # The first channel block of the k copy is loaded before the position / table /
        # rotation chain, so its latency overlaps that chain (measured on the H200: 88-92 % ->
        # 94 % of copy; with COPY_V, holding both blocks that long measured slower: perf_log v8).
        c = tl.arange(0, BLOCK_C)[None, None, :]
        m_first = m_row & (c < k_dim)
        k_first = tl.load(kv_ptr + kv_row + c, mask=m_first)
    pos, is_padding = tile_positions(
        o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size, POS_MODE,
    )  # fmt: skip
    in_range = (pos >= 0) & (pos < n_rows)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = load_table_halves(
        cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
    )

    pe_row = (i0 * stride_pe0 + i1 * stride_pe1)[:, None]
    if INTERLEAVED_IN:
        k2 = tl.arange(0, 2 * HALF)[None, :]
        x = tl.load(kpe_ptr + pe_row + k2, mask=m_t[:, None] & (k2 < 2 * HALF), other=0.0)
        a, b = tl.split(tl.reshape(to_f32(x), (BLOCK_T, HALF, 2)))
    else:
        m_pe = m_t[:, None] & (j[None, :] < HALF)
        a = to_f32(tl.load(kpe_ptr + pe_row + j[None, :], mask=m_pe, other=0.0))
        b = to_f32(tl.load(kpe_ptr + pe_row + HALF + j[None, :], mask=m_pe, other=0.0))
    out_a, out_b = rotate(
        a, b, c_a, c_b, s_a, s_b, is_padding[:, None], (~in_range & ~is_padding)[:, None],
        False, False,
    )  # fmt: skip
    out_a = from_f32(out_a, k_ptr.dtype.element_ty)
    out_b = from_f32(out_b, k_ptr.dtype.element_ty)

    if INTERLEAVED_OUT:
        k2 = tl.arange(0, 2 * HALF)[None, None, :]
        pairs = tl.reshape(tl.join(out_a, out_b), (BLOCK_T, 1, 2 * HALF))
        pairs = tl.broadcast_to(pairs, (BLOCK_T, BLOCK_H, 2 * HALF))
        tl.store(k_ptr + k_row + k_dim + k2, pairs, mask=m_row & (k2 < 2 * HALF))
    else:
        jj = j[None, None, :]
        m_pair = m_row & (jj < HALF)
        k_a = tl.broadcast_to(out_a[:, None, :], (BLOCK_T, BLOCK_H, HALF))
        k_b = tl.broadcast_to(out_b[:, None, :], (BLOCK_T, BLOCK_H, HALF))
        tl.store(k_ptr + k_row + k_dim + jj, k_a, mask=m_pair)
        tl.store(k_ptr + k_row + k_dim + HALF + jj, k_b, mask=m_pair)

    if COPY_V:
        _copy_channels(kv_ptr, k_ptr, kv_row, k_row, m_row, 0, k_dim, BLOCK_C)
        v_row = (i0 * stride_v0 + i1 * stride_v1)[:, None, None] + (o_h * stride_vh)[None, :, None]
        _copy_channels(kv_ptr + k_dim, v_ptr, kv_row, v_row, m_row, 0, v_dim, BLOCK_C)
    else:
        tl.store(k_ptr + k_row + c, k_first, mask=m_first)
        _copy_channels(kv_ptr, k_ptr, kv_row, k_row, m_row, BLOCK_C, k_dim, BLOCK_C)


@triton.jit
def _halve_heads(g, BLOCK_T: tl.constexpr, S: tl.constexpr, R: tl.constexpr):
    """``[BLOCK_T, S, R] -> [BLOCK_T, S / 2, R]``: head ``h`` plus head ``h + S / 2``."""
    pairs = tl.permute(tl.reshape(g, (BLOCK_T, 2, S // 2, R)), (0, 2, 3, 1))
    first, second = tl.split(pairs)
    return first + second


@triton.jit
def _sum_heads(dk_ptr, dk_tok, m_t, stride_dkh, n_heads, k_dim, BLOCK_T: tl.constexpr,
               HEADS_PADDED: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """fp32 ``[BLOCK_T, R]``: the sum over heads of ``dk[..., K:]`` in a fixed order.

    Heads come in chunks of 16, each summed by a fixed pairwise tree (``h + (h + 8)``, then
    ``+ 4``, ``+ 2``, ``+ 1``), the chunks added in head order. The order depends on the head
    count alone, never on the launch configuration or the thread layout, so every
    configuration gives the same bits. Missing heads load as -0.0, the exact additive identity
    (an all -0.0 gradient sums to -0.0, as in exact arithmetic)."""
    r = tl.arange(0, R)[None, None, :]
    total = tl.zeros((BLOCK_T, R), dtype=tl.float32)
    # -0.0 made from its bits: Triton folds a float literal equal to zero (even -0.0) into +0.0.
    negative_zero = tl.full((BLOCK_T, 16, R), -(2**31), tl.int32).to(tl.float32, bitcast=True)
    for h0 in tl.static_range(0, HEADS_PADDED, 16):
        h = h0 + tl.arange(0, 16)
        rows = dk_tok[:, None, None] + (h.to(tl.int64) * stride_dkh)[None, :, None] + k_dim
        m = m_t[:, None, None] & (h < n_heads)[None, :, None] & (r < R)
        g = to_f32(tl.load(dk_ptr + rows + r, mask=m, other=0.0))
        g = tl.where(m, g, negative_zero)
        g = _halve_heads(g, BLOCK_T, 16, R)
        g = _halve_heads(g, BLOCK_T, 8, R)
        g = _halve_heads(g, BLOCK_T, 4, R)
        g = tl.reshape(_halve_heads(g, BLOCK_T, 2, R), (BLOCK_T, R))
        if h0 == 0:  # noqa: SIM108 (h0 is a compile-time constant: no select is emitted)
            total = g
        else:
            total = total + g
    return total


@triton.jit(do_not_specialize=VARYING_INTS)
def _rope_kv_bwd_kernel(
    dk_ptr,  # [D0, D1, H, K + R]
    dv_ptr,  # [D0, D1, H, V]
    dkv_ptr,  # [D0, D1, H, K + V]
    dpe_ptr,  # [D0, D1, R] (contiguous)
    cos_ptr, sin_ptr,
    n_tokens, D1, n_heads, n_head_blocks, k_dim, v_dim, n_rows,
    stride_dk0, stride_dk1, stride_dkh,
    stride_dv0, stride_dv1, stride_dvh,
    stride_dkv0, stride_dkv1, stride_dkvh,
    stride_table,
    ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,  # lookup.position_args
    POS_MODE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HEADS_PADDED: tl.constexpr,  # n_heads rounded up to a multiple of 16
    INTERLEAVED_IN: tl.constexpr,  # k_pe's layout (the gradient is written in it)
    INTERLEAVED_OUT: tl.constexpr,  # k's rope layout (dk is read in it)
    ROUND_SUM: tl.constexpr,  # Megatron-Core's rounding: the head sum to dk_pe's dtype
    ROUND_PRODUCTS: tl.constexpr,  # ... and each product and the sum of the rotation
):  # fmt: skip
    i_t, i_h = program_tile(n_head_blocks)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = (i_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_t = o_t < n_tokens
    m_h = o_h < n_heads
    i0 = o_t // D1
    i1 = o_t % D1
    dk_tok = i0 * stride_dk0 + i1 * stride_dk1
    dk_row = dk_tok[:, None, None] + (o_h * stride_dkh)[None, :, None]
    dv_row = (i0 * stride_dv0 + i1 * stride_dv1)[:, None, None] + (o_h * stride_dvh)[None, :, None]
    dkv_row = (i0 * stride_dkv0 + i1 * stride_dkv1)[:, None, None] + (o_h * stride_dkvh)[
        None, :, None
    ]
    m_row = m_t[:, None, None] & m_h[None, :, None]

    # dkv = [dk[..., :K], dv] for this program's heads: every load before any store.
    n_copy = tl.maximum(k_dim, v_dim)
    for c0 in range(0, loop_bound(n_copy), BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        m_k = m_row & (c < k_dim)
        m_v = m_row & (c < v_dim)
        k_blk = tl.load(dk_ptr + dk_row + c, mask=m_k)
        v_blk = tl.load(dv_ptr + dv_row + c, mask=m_v)
        tl.store(dkv_ptr + dkv_row + c, k_blk, mask=m_k)
        tl.store(dkv_ptr + dkv_row + k_dim + c, v_blk, mask=m_v)

    # dk_pe: the programs of the first head block also own their tokens' sum over all heads,
    # so it never leaves one program: no atomics, bitwise deterministic.
    if i_h == 0:
        total = _sum_heads(
            dk_ptr, dk_tok, m_t, stride_dkh, n_heads, k_dim, BLOCK_T, HEADS_PADDED, 2 * HALF
        )
        if ROUND_SUM:
            total = round_to_16bit(total, dpe_ptr.dtype.element_ty)
        pos, is_padding = tile_positions(
            o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size,
            POS_MODE,
        )  # fmt: skip
        in_range = (pos >= 0) & (pos < n_rows)
        j = tl.arange(0, HALF)
        c_a, c_b, s_a, s_b = load_table_halves(
            cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
        )
        if INTERLEAVED_OUT:
            g_a, g_b = tl.split(tl.reshape(total, (BLOCK_T, HALF, 2)))
        else:
            g_a, g_b = tl.split(tl.permute(tl.reshape(total, (BLOCK_T, 2, HALF)), (0, 2, 1)))
        if ROUND_PRODUCTS:
            d_a, d_b = transpose_rotate_rounded(
                g_a, g_b, c_a, c_b, s_a, s_b, is_padding[:, None],
                (~in_range & ~is_padding)[:, None], dpe_ptr.dtype.element_ty,
            )  # fmt: skip
        else:
            d_a, d_b = rotate(
                g_a, g_b, c_a, c_b, s_a, s_b, is_padding[:, None],
                (~in_range & ~is_padding)[:, None], False, True,
            )  # fmt: skip
        d_a = from_f32(d_a, dpe_ptr.dtype.element_ty)
        d_b = from_f32(d_b, dpe_ptr.dtype.element_ty)
        r = tl.arange(0, 2 * HALF)[None, :]
        pe_row = o_t[:, None] * (2 * HALF)
        if INTERLEAVED_IN:
            pairs = tl.reshape(tl.join(d_a, d_b), (BLOCK_T, 2 * HALF))
            tl.store(dpe_ptr + pe_row + r, pairs, mask=m_t[:, None] & (r < 2 * HALF))
        else:
            m_pe = m_t[:, None] & (j[None, :] < HALF)
            tl.store(dpe_ptr + pe_row + j[None, :], d_a, mask=m_pe)
            tl.store(dpe_ptr + pe_row + HALF + j[None, :], d_b, mask=m_pe)


@dataclass(frozen=True)
class KVLaunchConfig:
    """Tiles and warps of one launch. Any valid config gives bitwise identical results."""

    block_t: int
    block_h: int
    block_c: int
    num_warps: int


_TILE_ELEMENTS = 8192
# The forward's copy tile: 16 heads x 128 channels, 2 warps (32 elements a thread).
_FORWARD_TILE_ELEMENTS = 2048


def choose_kv_config(n_tokens: int, n_heads: int, channels: int) -> KVLaunchConfig:
    """Heuristic launch configuration of the forward (no autotuning).

    Small programs: 2048 elements per copy step (16 heads x 128 channels at DeepSeek-V3
    shapes), then as many tokens as fill that, one warp per 1024 elements. With the head-major
    grid (``_tiles``), the launch-configuration sweep on the H200 measured this at 92.3-95.5 %
    of copy without ``copy_v`` and 92.6-95.3 % with it, against 88.2-93.8 % and 92.7-95.2 %
    for all 128 heads in one 8-warp program, the best tile before that grid
    (docs/perf_log.md, v8): many small programs hide the position / table chain of the thd
    cases behind each other. ``channels`` is the widest of K, V and R.
    """
    block_c = min(next_power_of_2(channels), 128)
    block_h = min(next_power_of_2(n_heads), max(1, _FORWARD_TILE_ELEMENTS // block_c))
    block_t = min(next_power_of_2(n_tokens), max(1, _FORWARD_TILE_ELEMENTS // (block_h * block_c)))
    num_warps = min(8, next_power_of_2(max(1, block_t * block_h * block_c // 1024)))
    return KVLaunchConfig(block_t, block_h, block_c, num_warps)


def choose_kv_backward_config(
    n_tokens: int, n_heads: int, channels: int, rope_dim: int
) -> KVLaunchConfig:
    """Heuristic launch configuration of the backward (no autotuning).

    Small programs: 8 heads x 128 channels of copies, one warp. The programs of the first head
    block also sum their tokens' rope gradients over all heads; with the head-major grid they
    run beside the same token's other programs, and many small programs let those longer ones
    overlap with the rest. The sweep measured 96.5-98.7 % of copy at DeepSeek-V3 shapes on the
    H200 (8 or 16 heads at 1-4 warps and 32 heads at 4 warps within a point of each other;
    32 heads at 2 warps 92.4-94.8 %, 64 heads at 8 warps 73-75 %; docs/perf_log.md, v8).
    ``block_t`` is also capped so that the sum's chunk (16 heads x ``rope_dim`` per token)
    stays near 8192 elements.
    """
    block_c = min(next_power_of_2(channels), 128)
    block_h = min(next_power_of_2(n_heads), max(1, 1024 // block_c))
    block_t = min(next_power_of_2(n_tokens), max(1, 1024 // (block_h * block_c)))
    block_t = min(block_t, max(1, _TILE_ELEMENTS // (16 * rope_dim)))
    # Enough warps for the larger of the copy tile and the head sum's 16-head chunk, at most
    # 1024 elements a warp (32 a thread): one warp at DeepSeek-V3 shapes, more for R = 128 or
    # many tokens per program, where one warp would spill.
    work = max(block_t * block_h * block_c, block_t * 16 * rope_dim)
    num_warps = min(8, next_power_of_2(max(1, work // 1024)))
    return KVLaunchConfig(block_t, block_h, block_c, num_warps)


def rope_kv_launch(
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    k_dim: int,
    interleaved_in: bool,
    interleaved_out: bool,
    config: KVLaunchConfig | None = None,
) -> None:
    """Forward: ``kv: [tokens..., H, K + V]``, ``k_pe: [tokens..., R]`` into ``k`` and ``v``."""
    d0, d1, n_heads, width, stride_kv0, stride_kv1, stride_kvh = geometry(kv)
    _, _, _, _, stride_k0, stride_k1, stride_kh = geometry(k)
    pe_stride = k_pe.stride()
    stride_pe0, stride_pe1 = (pe_stride[0], 0) if k_pe.dim() == 2 else pe_stride[:2]
    rope_dim = cos.shape[-1]
    v_dim = width - k_dim
    n_tokens = d0 * d1
    if n_tokens == 0 or n_heads == 0:
        return
    config = config or choose_kv_config(n_tokens, n_heads, max(k_dim, v_dim, rope_dim))
    if v is None:
        v, stride_v0, stride_v1, stride_vh = k, 0, 0, 0
    else:
        _, _, _, _, stride_v0, stride_v1, stride_vh = geometry(v)
    grid, n_head_blocks = tile_grid(n_tokens, config.block_t, n_heads, config.block_h)
    pos_mode, pos_args = position_args(positions, kv, (d0, d1))
    _launch_kv_fwd(
        grid, config.num_warps,
        kv, k_pe, k, v, cos, sin,
        n_tokens, d1, n_heads, n_head_blocks, k_dim, v_dim, cos.shape[0],
        stride_kv0, stride_kv1, stride_kvh,
        stride_pe0, stride_pe1,
        stride_k0, stride_k1, stride_kh,
        stride_v0, stride_v1, stride_vh,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, config.block_t, config.block_h, config.block_c,
        interleaved_in, interleaved_out, v is not k,
    )  # fmt: skip


def rope_kv_backward_launch(
    dk: torch.Tensor,
    dv: torch.Tensor,
    dkv: torch.Tensor,
    dk_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    k_dim: int,
    interleaved_in: bool,
    interleaved_out: bool,
    config: KVLaunchConfig | None = None,
    megatron_rounding: bool = False,
) -> None:
    """Backward: ``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]`` into
    ``dkv: [tokens..., H, K + V]`` and contiguous ``dk_pe: [tokens..., R]``, one launch.

    ``megatron_rounding``: ``dk_pe`` rounded where Megatron-Core rounds (as
    ``reference.rope_kv_backward``): the head sum to ``dk_pe``'s dtype, and, for 16-bit
    gradients with tables of the same dtype, each product and sum of the rotation."""
    d0, d1, n_heads, _, stride_dk0, stride_dk1, stride_dkh = geometry(dk)
    _, _, _, v_dim, stride_dv0, stride_dv1, stride_dvh = geometry(dv)
    _, _, _, _, stride_dkv0, stride_dkv1, stride_dkvh = geometry(dkv)
    rope_dim = cos.shape[-1]
    n_tokens = d0 * d1
    if n_tokens == 0:
        return
    if n_heads == 0:
        dk_pe.zero_()
        return
    config = config or choose_kv_backward_config(n_tokens, n_heads, max(k_dim, v_dim), rope_dim)
    sixteen_bit = dk_pe.dtype in (torch.bfloat16, torch.float16)
    round_sum = megatron_rounding and sixteen_bit
    # reference.megatron_product_dtype: the products' promoted dtype is 16-bit only then.
    round_products = round_sum and cos.dtype == dk_pe.dtype
    grid, n_head_blocks = tile_grid(n_tokens, config.block_t, n_heads, config.block_h)
    pos_mode, pos_args = position_args(positions, dk, (d0, d1))
    _launch_kv_bwd(
        grid, config.num_warps,
        dk, dv, dkv, dk_pe, cos, sin,
        n_tokens, d1, n_heads, n_head_blocks, k_dim, v_dim, cos.shape[0],
        stride_dk0, stride_dk1, stride_dkh,
        stride_dv0, stride_dv1, stride_dvh,
        stride_dkv0, stride_dkv1, stride_dkvh,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, config.block_t, config.block_h, config.block_c,
        16 * max(1, cdiv(n_heads, 16)), interleaved_in, interleaved_out, round_sum,
        round_products,
    )  # fmt: skip


_launch_kv_fwd = DirectLauncher(_rope_kv_fwd_kernel)
_launch_kv_bwd = DirectLauncher(_rope_kv_bwd_kernel)
