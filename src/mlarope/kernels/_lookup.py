"""In-kernel position lookup and table rows, shared by the query and key/value kernels.

Computes, for a block of token indices, the same ``(pos, is_padding)`` as
:func:`mlarope.positions.token_positions`, in O(1) per token (sequence index, explicit ids) or
O(log n) (a 16-ary search in ``cu_seqlens``), never a scan over all sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Position sources (constexpr POS_MODE).
SEQ_DIM0 = 0  # sbhd, or thd without cu_seqlens: position = index along token dim 0
SEQ_DIM1 = 1  # bshd: position = index along token dim 1
CU_SEQLENS = 2  # thd with cu_seqlens: a 16-ary search
POSITION_IDS = 3  # explicit ids, read with their strides

# Kernel integers that change from call to call but feed only masks and index arithmetic. They
# are not specialized (Triton would compile a variant per value class, == 1 and % 16), so a new
# token or sequence count, or another rank, reuses the compiled kernel.
VARYING_INTS = [
    "n_tokens",
    "n_seqs",
    "steps",
    "cp_rank",
    "cp_size",
    "n_rows",
    "stride_id0",
    "stride_id1",
]


@triton.jit
def _global_position(local, local_len, cp_rank, cp_size):
    """Offset in a rank's local sequence -> global position (load-balanced context parallel)."""
    chunk = local_len // 2
    first = cp_rank * chunk + local
    second = (2 * cp_size - 1 - cp_rank) * chunk + (local - chunk)
    return tl.where(local < chunk, first, second)


@triton.jit
def token_positions(
    t,  # [BLOCK_T] int64 flat token indices (i0 * D1 + i1)
    i0,  # [BLOCK_T] int64 index along token dim 0
    i1,  # [BLOCK_T] int64 index along token dim 1 (0 for thd)
    t_mask,
    cu_ptr,  # cu_seqlens [n + 1] (CU_SEQLENS only)
    ids_ptr,  # position_ids (POSITION_IDS only)
    stride_id0,
    stride_id1,
    n_seqs,  # n (CU_SEQLENS), or the local sequence length (SEQ_DIM0 / SEQ_DIM1)
    search_steps,  # ceil(log_FANOUT(n)) (CU_SEQLENS)
    cp_rank,
    cp_size,
    POS_MODE: tl.constexpr,
    SEARCH_FANOUT: tl.constexpr = 16,
    SEARCH_FANOUT_LOG2: tl.constexpr = 4,
):
    """Return ``(pos, is_padding)`` for a block of tokens; ``pos`` is int64, maybe out of range."""
    is_padding = t < 0  # all False, right shape
    if POS_MODE == 0:
        pos = _global_position(i0, n_seqs, cp_rank, cp_size)
    elif POS_MODE == 1:
        pos = _global_position(i1, n_seqs, cp_rank, cp_size)
    elif POS_MODE == 2:
        # A SEARCH_FANOUT-ary search in cu_local = cu_seqlens // cp_size, keeping
        # cu_local[lo] <= t < cu_local[hi]: each step loads FANOUT evenly spaced entries at once
        # and narrows [lo, hi) to the gap holding t, so 4,096 sequences take 3 dependent loads
        # (a binary search would take 12).
        # cu_local[i] <= t  <=>  cu_seqlens[i] <= (t + 1) * cp_size - 1: no division in the loop
        # (64-bit integer division is emulated on GPUs and was the loop's main cost).
        total = tl.load(cu_ptr + n_seqs).to(tl.int64) // cp_size
        is_padding = t >= total
        t_scaled = (t + 1) * cp_size - 1
        lo = tl.zeros_like(t)
        hi = tl.zeros_like(t) + n_seqs
        k = tl.arange(0, SEARCH_FANOUT).to(tl.int64)[None, :]
        for _ in range(search_steps):
            stride = (hi - lo + (SEARCH_FANOUT - 1)) >> SEARCH_FANOUT_LOG2
            index = lo[:, None] + k * stride[:, None]
            sampled = (index < hi[:, None]) & t_mask[:, None]
            start = tl.load(cu_ptr + index, mask=sampled, other=0).to(tl.int64)
            below = tl.sum((sampled & (start <= t_scaled[:, None])).to(tl.int32), axis=1)
            lo = lo + (tl.maximum(below, 1) - 1).to(tl.int64) * stride
            hi = tl.minimum(lo + stride, hi)
        start = tl.load(cu_ptr + lo, mask=t_mask, other=0).to(tl.int64) // cp_size
        end = tl.load(cu_ptr + lo + 1, mask=t_mask & (n_seqs > 0), other=0).to(tl.int64)
        pos = _global_position(t - start, end // cp_size - start, cp_rank, cp_size)
    else:
        pos = tl.load(ids_ptr + i0 * stride_id0 + i1 * stride_id1, mask=t_mask, other=0)
        pos = pos.to(tl.int64)
    return pos, is_padding


@triton.jit
def load_table_halves(cos_ptr, sin_ptr, pos, use_row, stride_table, j, HALF: tl.constexpr):
    """Rows ``cos[pos], sin[pos]`` split in halves, fp32 ``[BLOCK_T, HALF]`` each.

    ``use_row`` masks rows that must not be read (padding, out of range, masked tokens).
    """
    row = tl.where(use_row, pos, 0)[:, None] * stride_table
    m = use_row[:, None]
    c_a = tl.load(cos_ptr + row + j[None, :], mask=m, other=1.0).to(tl.float32)
    c_b = tl.load(cos_ptr + row + HALF + j[None, :], mask=m, other=1.0).to(tl.float32)
    s_a = tl.load(sin_ptr + row + j[None, :], mask=m, other=0.0).to(tl.float32)
    s_b = tl.load(sin_ptr + row + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    return c_a, c_b, s_a, s_b


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
        s_a, s_b = -s_b, -s_a
    if INVERSE:
        s_a, s_b = -s_a, -s_b
    # Explicit fused multiply-adds: the compiler may not contract differently from one launch
    # configuration to another, so results are bitwise identical across configurations.
    out_a = tl.fma(a, c_a, -(b * s_a))
    out_b = tl.fma(b, c_b, a * s_b)
    out_a = tl.where(is_padding, a, out_a)
    out_b = tl.where(is_padding, b, out_b)
    out_a = tl.where(out_of_range, float("nan"), out_a)
    out_b = tl.where(out_of_range, float("nan"), out_b)
    return out_a, out_b


def search_steps(n_seqs: int, fanout: int = 16) -> int:
    """Steps of the ``fanout``-ary search over ``n_seqs`` sequences: ceil(log_fanout(n))."""
    steps, reach = 0, 1
    while reach < n_seqs:
        steps, reach = steps + 1, reach * fanout
    return steps


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
