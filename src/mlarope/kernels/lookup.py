"""Where each token's position comes from, for the query and key/value kernels.

The kernels compute, per tile of tokens, the same ``(pos, is_padding)`` as the spec,
:func:`mlarope.positions.token_positions`: in O(1) per token from the token's index (sbhd, bshd,
thd without ``cu_seqlens``) or from explicit ``position_ids``, and with ``cu_seqlens`` from a
16-ary search, O(log n) per token, never a scan over all sequences.

The search runs once per call, in a small kernel of its own (``_cu_seqlens_search_kernel``:
``[T]`` int64 positions, ``PADDING_POSITION`` for padding), and the rotation kernels then read
one position per token (``POS_SEARCHED``); an autograd forward keeps that result for its
backward (``ops.search_for_backward``). Searching inside the rotation kernels put three
dependent L2 round trips in front of every tile's loads and cost a fifth to a third of the
in-place query op's bandwidth; the extra launch costs a few microseconds of GPU time
(docs/perf_log.md, v6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._recording import note_scratch
from ..positions import PADDING_POSITION, SEARCH_FANOUT, search_steps
from ._launch import DirectLauncher
from ._triton_compat import loop_bound

# Position sources: the rotation kernels' constexpr POS_MODE (the modes from POS_SEARCHED on
# load each token's position from memory; the others compute it from the token's index).
POS_DIM0 = tl.constexpr(0)  # sbhd, or thd without cu_seqlens: the index along token dim 0
POS_DIM1 = tl.constexpr(1)  # bshd: the index along token dim 1
POS_SEARCHED = tl.constexpr(2)  # thd with cu_seqlens: read from the search kernel's output
POS_IDS = tl.constexpr(3)  # explicit position_ids, read with their strides

# The search kernel's padding marker, for the jit code: PADDING_POSITION (mlarope.positions),
# the int64 minimum, which no search in int32 cu_seqlens, nor in int64 ones of less than 2**53
# in magnitude, can produce (malformed cu_seqlens can give other negative positions; those
# must become NaN). A position that wraps around to it counts as padding, in the spec too.
_PADDING = tl.constexpr(PADDING_POSITION)
_FANOUT = tl.constexpr(SEARCH_FANOUT)
_FANOUT_LOG2 = tl.constexpr(SEARCH_FANOUT.bit_length() - 1)

# Kernel integers that change from call to call but feed only masks and index arithmetic. They
# are not specialized (Triton would compile a variant per value class, == 1 and % 16), so a new
# token count, sequence length, or another rank reuses the compiled kernel.
VARYING_INTS = [
    "n_tokens",
    "seq_len",
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
def tile_positions(
    t,  # [BLOCK_T] int64 flat token indices (i0 * D1 + i1)
    i0,  # [BLOCK_T] int64 index along token dim 0
    i1,  # [BLOCK_T] int64 index along token dim 1 (0 for thd)
    t_mask,
    ids_ptr,  # position_ids (POS_IDS), or the searched [T] positions (POS_SEARCHED)
    stride_id0,
    stride_id1,
    seq_len,  # the local sequence length (POS_DIM0 / POS_DIM1)
    cp_rank,
    cp_size,
    POS_MODE: tl.constexpr,
):
    """``(pos, is_padding)`` of a tile's tokens; ``pos`` is int64, maybe out of the table."""
    is_padding = t < 0  # all False, right shape
    if POS_MODE == POS_DIM0:
        pos = _global_position(i0, seq_len, cp_rank, cp_size)
    elif POS_MODE == POS_DIM1:
        pos = _global_position(i1, seq_len, cp_rank, cp_size)
    elif POS_MODE == POS_SEARCHED:
        pos = tl.load(ids_ptr + t, mask=t_mask, other=0)
        # Only the marker is padding: a negative position searched from malformed cu_seqlens
        # stays out of range and comes out as NaN, as in the reference.
        is_padding = pos == _PADDING
    else:
        pos = tl.load(ids_ptr + i0 * stride_id0 + i1 * stride_id1, mask=t_mask, other=0)
        pos = pos.to(tl.int64)
    return pos, is_padding


@triton.jit
def _search_tile(
    t,  # [BLOCK] int64 flat token indices
    t_mask,
    cu_ptr,  # cu_seqlens [n + 1] (global lengths under context parallelism)
    n_seqs,
    search_steps,  # ceil(log_FANOUT(n))
    cp_rank,
    cp_size,
):
    """``(pos, is_padding)`` of thd tokens from ``cu_seqlens``: O(log n) per token."""
    # A _FANOUT-ary search in cu_local = cu_seqlens // cp_size, keeping
    # cu_local[lo] <= t < cu_local[hi]: each step loads _FANOUT evenly spaced entries at once
    # and narrows [lo, hi) to the gap holding t, so 4,096 sequences take 3 dependent loads
    # (a binary search would take 12).
    # cu_local[i] <= t  <=>  cu_seqlens[i] <= (t + 1) * cp_size - 1: no division in the loop
    # (64-bit integer division is emulated on GPUs and was the loop's main cost).
    total = tl.load(cu_ptr + n_seqs).to(tl.int64) // cp_size
    is_padding = t >= total
    t_scaled = (t + 1) * cp_size - 1
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + n_seqs
    k = tl.arange(0, _FANOUT).to(tl.int64)[None, :]
    for _ in range(loop_bound(search_steps)):
        stride = (hi - lo + (_FANOUT - 1)) >> _FANOUT_LOG2
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
def _cu_seqlens_search_kernel(
    cu_ptr, out_ptr, n_tokens, n_seqs, search_steps, cp_rank, cp_size, BLOCK: tl.constexpr
):
    """``out[t]``: token ``t``'s position, or ``PADDING_POSITION`` for a padding token
    (``[T]`` int64)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = t < n_tokens
    pos, is_padding = _search_tile(t, m, cu_ptr, n_seqs, search_steps, cp_rank, cp_size)
    tl.store(out_ptr + t, tl.where(is_padding, _PADDING, pos), mask=m)


# Tokens per program of the search kernel, and its warps: many small programs. Each search step
# gathers 16 entries per token, and few large programs (256 tokens, 4 warps: 64 programs for
# 16,384 tokens) left most multiprocessors idle: 32-token one-warp programs took half the time
# at 4,096 sequences (docs/perf_log.md, v8).
SEARCH_BLOCK = 32
SEARCH_WARPS = 1

_launch_search = DirectLauncher(_cu_seqlens_search_kernel)


def launch_cu_seqlens_search(
    cu: torch.Tensor, out: torch.Tensor, cp_rank: int, cp_size: int,
    block: int = SEARCH_BLOCK, warps: int = SEARCH_WARPS,
) -> None:  # fmt: skip
    """Launch the search: ``cu: [n + 1]`` cu_seqlens -> ``out: [T]`` int64 positions
    (``PADDING_POSITION`` for padding), ``block`` tokens per program."""
    n_tokens, n_seqs = out.shape[0], cu.shape[0] - 1
    _launch_search(
        (-(-n_tokens // block),), warps,
        cu, out, n_tokens, n_seqs, search_steps(n_seqs), cp_rank, cp_size, block,
    )  # fmt: skip


def search_cu_seqlens(cu: torch.Tensor, n_tokens: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """``[n_tokens]`` int64: every thd token's position from ``cu: [n + 1]`` (one launch of the
    search on ``cu``'s device and the current stream; no host sync)."""
    out = torch.empty(n_tokens, dtype=torch.int64, device=cu.device)
    note_scratch(out)  # written whole by the search: a recorded plan allocates its own
    launch_cu_seqlens_search(cu, out, cp_rank, cp_size)
    return out


def position_args(
    positions, x: torch.Tensor, token_shape: tuple[int, int]
) -> tuple[int, tuple[object, ...]]:
    """``(POS_MODE, (ids_ptr, stride_id0, stride_id1, seq_len, cp_rank, cp_size))``: where the
    rotation kernels' positions come from (``tile_positions``), as their consecutive position
    arguments. ``positions``: a checked :class:`mlarope.positions.Positions`; ``x``: the
    activation (a placeholder pointer where no ids are read); ``token_shape``: ``(D0, D1)``.

    With ``cu_seqlens`` this launches the search first (no host sync) and hands the kernels its
    ``[T]`` output, unless ``positions.searched`` already holds it.
    """
    cp_rank, cp_size = positions.cp_rank, positions.cp_size
    if positions.position_ids is not None:
        ids = positions.position_ids
        strides = ids.stride() if ids.dim() == 2 else (ids.stride(0), 0)
        return POS_IDS.value, (ids, strides[0], strides[1], 0, cp_rank, cp_size)
    if positions.cu_seqlens is not None:
        found = positions.searched
        if found is None:
            n_tokens = token_shape[0] * token_shape[1]
            found = search_cu_seqlens(positions.cu_seqlens, n_tokens, cp_rank, cp_size)
        return POS_SEARCHED.value, (found, 0, 0, 0, cp_rank, cp_size)
    if positions.layout == "bshd":
        return POS_DIM1.value, (x, 0, 0, token_shape[1], cp_rank, cp_size)
    return POS_DIM0.value, (x, 0, 0, token_shape[0], cp_rank, cp_size)
