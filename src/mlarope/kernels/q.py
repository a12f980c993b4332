"""Triton kernel and launcher for the query op (forward and backward, in place and out of place).

One program owns a tile of ``BLOCK_T`` tokens x ``BLOCK_H`` heads: it looks up the tokens'
positions, loads the table rows once, loads the tile's rope channels, rotates them in fp32 and
stores them once, rounded to the output dtype. Out of place it also copies the nope channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..positions import Positions
from ._launch import DirectLauncher
from ._tiles import geometry, next_power_of_2, program_tile, tile_grid
from ._triton_compat import loop_bound
from .lookup import POS_SEARCHED, VARYING_INTS, position_args, tile_positions
from .rotation import from_f32, load_table_halves, rotate, to_f32


@triton.jit
def _load_pairs(x_rope, m_row, jj, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVED_IN: tl.constexpr):  # fmt: skip
    """The tile's rope pairs ``(a, b)``, fp32 ``[BLOCK_T, BLOCK_H, HALF]`` each. Interleaved
    pairs are loaded as one contiguous row (16-byte vectors) and split in registers."""
    if INTERLEAVED_IN:
        k = tl.arange(0, 2 * HALF)[None, None, :]
        x = to_f32(tl.load(x_rope + k, mask=m_row & (k < 2 * HALF), other=0.0))
        a, b = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, HALF, 2)))
    else:
        m_pair = m_row & (jj < HALF)
        a = to_f32(tl.load(x_rope + jj, mask=m_pair, other=0.0))
        b = to_f32(tl.load(x_rope + HALF + jj, mask=m_pair, other=0.0))
    return a, b


@triton.jit(do_not_specialize=VARYING_INTS)
def _rope_q_kernel(
    x_ptr,  # input [D0, D1, H, N + R] (thd: D1 = 1)
    out_ptr,  # output, same shape; the same memory as x_ptr when IN_PLACE
    cos_ptr,  # [P, R]
    sin_ptr,  # [P, R]
    n_tokens,
    D1,
    n_heads,
    n_head_blocks,  # _tiles.tile_grid
    n_nope,
    n_rows,  # P
    stride_x0, stride_x1, stride_xh,
    stride_o0, stride_o1, stride_oh,
    stride_table,
    # where positions come from (lookup.position_args)
    ids_ptr,  # position_ids [D0, D1] with strides, or [T] precomputed positions (thd cu_seqlens)
    stride_id0, stride_id1,
    seq_len,
    cp_rank,
    cp_size,
    POS_MODE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERLEAVED_IN: tl.constexpr,
    INTERLEAVED_OUT: tl.constexpr,
    INVERSE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    IN_PLACE: tl.constexpr,
):  # fmt: skip
    i_t, i_h = program_tile(n_head_blocks)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_t = o_t < n_tokens
    m_h = o_h < n_heads
    i0 = o_t // D1
    i1 = o_t % D1

    # [BLOCK_T, BLOCK_H, 1] row offsets; int64 because token index x stride can pass 2**31.
    h64 = o_h.to(tl.int64)[None, :, None]
    x_row = (i0 * stride_x0 + i1 * stride_x1)[:, None, None] + h64 * stride_xh
    o_row = (i0 * stride_o0 + i1 * stride_o1)[:, None, None] + h64 * stride_oh
    m_row = m_t[:, None, None] & m_h[None, :, None]
    j = tl.arange(0, HALF)
    jj = j[None, None, :]
    m_pair = m_row & (jj < HALF)

    pos, is_padding = tile_positions(
        o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size, POS_MODE,
    )  # fmt: skip
    # Load order, measured on the H200 (docs/perf_log.md, v6): where positions are loaded
    # (thd, position_ids) the tile's loads go out first, while the position is in flight;
    # where they are computed from indices (sbhd, bshd) the table rows go first.
    x_rope = x_ptr + x_row + n_nope
    if POS_MODE >= POS_SEARCHED:  # POS_SEARCHED, POS_IDS: positions are loaded
        a, b = _load_pairs(x_rope, m_row, jj, BLOCK_T, BLOCK_H, HALF, INTERLEAVED_IN)
    in_range = (pos >= 0) & (pos < n_rows)
    c_a, c_b, s_a, s_b = load_table_halves(
        cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
    )
    if POS_MODE < POS_SEARCHED:
        a, b = _load_pairs(x_rope, m_row, jj, BLOCK_T, BLOCK_H, HALF, INTERLEAVED_IN)

    out_a, out_b = rotate(
        a, b, c_a[:, None, :], c_b[:, None, :], s_a[:, None, :], s_b[:, None, :],
        is_padding[:, None, None], (~in_range & ~is_padding)[:, None, None], INVERSE, TRANSPOSE,
    )  # fmt: skip
    out_a = from_f32(out_a, out_ptr.dtype.element_ty)
    out_b = from_f32(out_b, out_ptr.dtype.element_ty)

    if IN_PLACE:
        # Race freedom: the stores below overwrite the very elements loaded above, and with a
        # layout change (interleaved <-> half-split) an element is loaded by one thread and
        # stored by another. This CTA barrier orders every load of the tile before any store of
        # it. Tiles of different programs are disjoint (q's elements do not share memory:
        # _checks.check_inplace_target), so no other program touches them.
        tl.debug_barrier()

    o_rope = out_ptr + o_row + n_nope
    if INTERLEAVED_OUT:
        k = tl.arange(0, 2 * HALF)[None, None, :]
        pairs = tl.reshape(tl.join(out_a, out_b), (BLOCK_T, BLOCK_H, 2 * HALF))
        tl.store(o_rope + k, pairs, mask=m_row & (k < 2 * HALF))
    else:
        tl.store(o_rope + jj, out_a, mask=m_pair)
        tl.store(o_rope + HALF + jj, out_b, mask=m_pair)

    if not IN_PLACE:
        for n0 in range(0, loop_bound(n_nope), BLOCK_N):
            c = n0 + tl.arange(0, BLOCK_N)[None, None, :]
            m = m_row & (c < n_nope)
            tl.store(out_ptr + o_row + c, tl.load(x_ptr + x_row + c, mask=m), mask=m)


@dataclass(frozen=True)
class QLaunchConfig:
    """Tile and warp count of one launch. Any valid config gives bitwise identical results."""

    block_t: int
    block_h: int
    block_n: int
    num_warps: int


# Elements of the rope tile one program moves. Memory-bound: enough bytes per program to keep
# many loads in flight (8192 bf16 = 16 KiB in, 16 KiB out), few enough to avoid register spills.
_TILE_ELEMENTS = 8192
# In place only the rope channels move. Small one-warp programs keep the split of interleaved
# pairs in registers (no shared memory) and many programs in flight, which matters most where
# every token reads its own table row (few long sequences: the rows miss the L2); measured the
# fastest tile in every case on the H200 (docs/perf_log.md, v10).
_INPLACE_TILE_ELEMENTS = 1024


def choose_q_config(
    n_tokens: int, n_heads: int, n_nope: int, rope_dim: int, inplace: bool = False
) -> QLaunchConfig:
    """Heuristic launch configuration (no run-time autotuning; the reason is in the comments).

    Out of place: all heads of a token in one program when they fit the tile (DeepSeek-V3: 128
    heads x 64 = 8192), so the position lookup and the table rows are shared by as many heads
    as possible; then as many tokens as fill the tile, for small head counts (tensor parallel
    shards). In place: 1,024-element one-warp programs (16 heads at R = 64). Both are what the
    launch-configuration measurements found fastest at DeepSeek-V3 shapes on the H200
    (``benchmarks/sweep.py``, ``benchmarks/q_inplace_layouts.py``; docs/perf_log.md, v6 and
    v10).
    """
    tile_elements = _INPLACE_TILE_ELEMENTS if inplace else _TILE_ELEMENTS
    block_h = min(next_power_of_2(n_heads), max(1, tile_elements // rope_dim))
    block_t = min(next_power_of_2(n_tokens), max(1, tile_elements // (block_h * rope_dim)))
    # The nope copy (out of place) in blocks of up to 128 channels, at most twice the tile.
    block_n = min(
        next_power_of_2(max(n_nope, 16)), 128, max(16, 2 * _TILE_ELEMENTS // (block_t * block_h))
    )
    tile = block_t * block_h * rope_dim
    num_warps = 8 if tile >= 8192 else 4 if tile >= 2048 else 2 if tile >= 512 else 1
    if inplace:
        num_warps = max(1, tile // _INPLACE_TILE_ELEMENTS)
    return QLaunchConfig(block_t, block_h, block_n, num_warps)


def rope_q_launch(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    inverse: bool,
    transpose: bool,
    config: QLaunchConfig | None = None,
) -> None:
    """Rotate ``x: [tokens..., H, N + R]`` into ``out`` (the same tensor for in place).

    ``cos, sin: [P, R]``. Out of place, ``out`` gets the nope channels too.
    """
    d0, d1, n_heads, width, stride_x0, stride_x1, stride_xh = geometry(x)
    _, _, _, _, stride_o0, stride_o1, stride_oh = geometry(out)
    rope_dim = cos.shape[-1]
    n_nope = width - rope_dim
    n_tokens = d0 * d1
    if n_tokens == 0 or n_heads == 0:
        return
    inplace = out is x or out.data_ptr() == x.data_ptr()
    config = config or choose_q_config(n_tokens, n_heads, n_nope, rope_dim, inplace)
    grid, n_head_blocks = tile_grid(n_tokens, config.block_t, n_heads, config.block_h)
    pos_mode, pos_args = position_args(positions, x, (d0, d1))
    _launch_q(
        grid, config.num_warps,
        x, out, cos, sin,
        n_tokens, d1, n_heads, n_head_blocks, n_nope, cos.shape[0],
        stride_x0, stride_x1, stride_xh,
        stride_o0, stride_o1, stride_oh,
        cos.stride(0),
        *pos_args,
        pos_mode, rope_dim // 2, config.block_t, config.block_h, config.block_n,
        interleaved_in, interleaved_out, inverse, transpose, inplace,
    )  # fmt: skip


_launch_q = DirectLauncher(_rope_q_kernel)
