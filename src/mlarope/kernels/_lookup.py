"""Position lookup and table rows, shared by the query and key/value kernels.

Computes, for a block of token indices, the same ``(pos, is_padding)`` as
:func:`mlarope.positions.token_positions`, in O(1) per token (sequence index, explicit ids) or
O(log n) (a 16-ary search in ``cu_seqlens``), never a scan over all sequences.

With ``cu_seqlens`` the search runs once per call in a small kernel of its own
(``_cu_seqlens_positions_kernel``: T int64 positions, ``PADDING_POSITION`` for padding; an
autograd forward's result is kept for its backward, ``ops.search_for_backward``), and the
rotation kernels then read one position per token. Searching inside the rotation kernels
put three dependent L2 round trips in front of every tile's loads and cost 20-35 % of the
in-place query op's bandwidth (docs/perf_log.md, v6); the extra launch costs a few
microseconds of GPU time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..positions import PADDING_POSITION, search_steps  # noqa: F401 (PADDING_POSITION: re-exported)
from ._launch import DirectLauncher
from ._triton_compat import loop_bound

# Position sources (constexpr POS_MODE).
SEQ_DIM0 = 0  # sbhd, or thd without cu_seqlens: position = index along token dim 0
SEQ_DIM1 = 1  # bshd: position = index along token dim 1
CU_SEQLENS = 2  # thd with cu_seqlens: positions precomputed by _cu_seqlens_positions_kernel
POSITION_IDS = 3  # explicit ids, read with their strides

# What the position kernel writes for a padding token: the int64 minimum, which no search in
# int32 cu_seqlens, nor in int64 ones of less than 2**53 in magnitude, can produce (malformed
# cu_seqlens can give other negative positions; those must become NaN). A position that wraps
# around to it counts as padding, in mlarope.positions too.

# Kernel integers that change from call to call but feed only masks and index arithmetic. They
# are not specialized (Triton would compile a variant per value class, == 1 and % 16), so a new
# token or sequence count, or another rank, reuses the compiled kernel.
VARYING_INTS = [
    "n_tokens",
    "n_seqs",
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
    ids_ptr,  # position_ids (POSITION_IDS), or the precomputed [T] positions (CU_SEQLENS)
    stride_id0,
    stride_id1,
    n_seqs,  # the local sequence length (SEQ_DIM0 / SEQ_DIM1)
    cp_rank,
    cp_size,
    POS_MODE: tl.constexpr,
):
    """Return ``(pos, is_padding)`` for a block of tokens; ``pos`` is int64, maybe out of range."""
    is_padding = t < 0  # all False, right shape
    if POS_MODE == 0:
        pos = _global_position(i0, n_seqs, cp_rank, cp_size)
    elif POS_MODE == 1:
        pos = _global_position(i1, n_seqs, cp_rank, cp_size)
    elif POS_MODE == 2:
        pos = tl.load(ids_ptr + t, mask=t_mask, other=0)
        # Only the marker is padding: a negative position searched from malformed cu_seqlens
        # stays out of range and comes out as NaN, as in the reference.
        is_padding = pos == -9223372036854775807 - 1  # PADDING_POSITION
    else:
        pos = tl.load(ids_ptr + i0 * stride_id0 + i1 * stride_id1, mask=t_mask, other=0)
        pos = pos.to(tl.int64)
    return pos, is_padding


@triton.jit
def search_cu_seqlens(
    t,  # [BLOCK_T] int64 flat token indices
    t_mask,
    cu_ptr,  # cu_seqlens [n + 1] (global lengths under context parallelism)
    n_seqs,
    search_steps,  # ceil(log_FANOUT(n))
    cp_rank,
    cp_size,
    SEARCH_FANOUT: tl.constexpr = 16,
    SEARCH_FANOUT_LOG2: tl.constexpr = 4,
):
    """``(pos, is_padding)`` of thd tokens from ``cu_seqlens``: O(log n) per token."""
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
    for _ in range(loop_bound(search_steps)):
        stride = (hi - lo + (SEARCH_FANOUT - 1)) >> SEARCH_FANOUT_LOG2
        index = lo[:, None] + k * stride[:, None]
        sampled = (index < hi[:, None]) & t_mask[:, None]
        start = tl.load(cu_ptr + index, mask=sampled, other=0).to(tl.int64)
        below = tl.sum((sampled & (start <= t_scaled[:, None])).to(tl.int32), axis=1)
        lo = lo + (tl.maximum(below, 1) - 1).to(tl.int64) * stride
        hi = tl.minimum(lo + stride, hi)
    start = tl.load(cu_ptr + lo, mask=t_mask, other=0).to(tl.int64) // cp_size
    # "!= 0" on the mask: the compiler folds it away (the same PTX), and Triton 3.9's interpreter
    # needs it: there a scalar comparison broadcast to a block keeps int32 data, which its
    # masked load rejects ("mask has unsupported dtype").
    end_mask = (t_mask & (n_seqs > 0)) != 0
    end = tl.load(cu_ptr + lo + 1, mask=end_mask, other=0).to(tl.int64)
    pos = _global_position(t - start, end // cp_size - start, cp_rank, cp_size)
    return pos, is_padding


@triton.jit(do_not_specialize=["n_tokens", "n_seqs", "search_steps", "cp_rank", "cp_size"])
def _cu_seqlens_positions_kernel(
    cu_ptr, out_ptr, n_tokens, n_seqs, search_steps, cp_rank, cp_size, BLOCK: tl.constexpr
):
    """``out[t]``: token ``t``'s position, or ``PADDING_POSITION`` for a padding token
    (``[T]`` int64)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = t < n_tokens
    pos, is_padding = search_cu_seqlens(t, m, cu_ptr, n_seqs, search_steps, cp_rank, cp_size)
    tl.store(out_ptr + t, tl.where(is_padding, -9223372036854775807 - 1, pos), mask=m)


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


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# Tokens per program of the position kernel, and its warps: many small programs. Each search
# step gathers 16 entries per token; 256-token, 4-warp programs (64 for 16,384 tokens) left
# most multiprocessors idle and took 17.3 µs at 4,096 sequences, 32-token one-warp programs
# 9.3 µs (the sweep, run U on the H200; docs/perf_log.md, v8).
_SEARCH_BLOCK = 32
_SEARCH_WARPS = 1


_positions_launcher = DirectLauncher(_cu_seqlens_positions_kernel)


def search_positions(
    cu: torch.Tensor, found: torch.Tensor, cp_rank: int, cp_size: int,
    block: int = _SEARCH_BLOCK, warps: int = _SEARCH_WARPS,
) -> None:  # fmt: skip
    """Launch the search: ``cu: [n + 1]`` cu_seqlens -> ``found: [T]`` int64 positions
    (``PADDING_POSITION`` past the last sequence), ``block`` tokens per program."""
    n_tokens, n_seqs = found.shape[0], cu.shape[0] - 1
    _positions_launcher(
        (-(-n_tokens // block),), warps,
        cu, found, n_tokens, n_seqs, search_steps(n_seqs), cp_rank, cp_size, block,
    )  # fmt: skip


def searched_positions(cu: torch.Tensor, n_tokens: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """``[n_tokens]`` int64: every thd token's position from ``cu: [n + 1]`` (one launch of the
    search on ``cu``'s device and the current stream; no host sync)."""
    found = torch.empty(n_tokens, dtype=torch.int64, device=cu.device)
    search_positions(cu, found, cp_rank, cp_size)
    return found


def position_args(
    positions, x: torch.Tensor, token_shape: tuple[int, int]
) -> tuple[int, tuple[object, ...]]:
    """``(POS_MODE, (ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size))``: where the
    kernels' positions come from (see ``token_positions``), as the kernels' consecutive
    position arguments.

    With ``cu_seqlens`` this launches ``_cu_seqlens_positions_kernel`` first (no host sync) and
    hands the kernels its ``[T]`` output, unless ``positions.searched`` already holds it.
    """
    cp_rank, cp_size = positions.cp_rank, positions.cp_size
    if positions.position_ids is not None:
        ids = positions.position_ids
        strides = ids.stride() if ids.dim() == 2 else (ids.stride(0), 0)
        return POSITION_IDS, (ids, strides[0], strides[1], 0, cp_rank, cp_size)
    if positions.cu_seqlens is not None:
        cu = positions.cu_seqlens
        found = positions.searched
        if found is None:
            found = searched_positions(cu, token_shape[0] * token_shape[1], cp_rank, cp_size)
        return CU_SEQLENS, (found, 0, 0, cu.shape[0] - 1, cp_rank, cp_size)
    if positions.layout == "bshd":
        return SEQ_DIM1, (x, 0, 0, token_shape[1], cp_rank, cp_size)
    return SEQ_DIM0, (x, 0, 0, token_shape[0], cp_rank, cp_size)
