"""Each token's rotary position, in plain PyTorch: the spec that the kernels' lookup matches.

Position sources (docs/design.md, "Positions"):

- ``sbhd`` / ``bshd`` / ``thd`` without ``cu_seqlens``: the index along the sequence dim;
- ``thd`` with ``cu_seqlens`` ``[n + 1]``: ``p = t - cu_local[i]`` for token ``t`` of sequence
  ``i``, where ``cu_local = cu_seqlens // cp_size``; tokens at or past ``cu_local[-1]`` are padding;
- context parallel: a rank's local sequence holds global chunks ``cp_rank`` and
  ``2 * cp_size - 1 - cp_rank`` (each ``L / (2 * cp_size)`` long), one after the other;
- explicit ``position_ids``: taken as they are.

The kernels (``kernels/lookup.py``) compute the same numbers per token in O(log n). For
``cu_seqlens`` that are not well formed (not starting at 0, decreasing, negative, a single entry;
``validate=True`` rejects them) the result is whatever the kernels' search gives, so
:func:`cu_seqlens_positions` runs that very search, step by step, with the kernels' integer
arithmetic (division rounds toward zero, int64 wraps): every backend then writes the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Positions:
    """Where each token's position comes from, checked and normalised (``_checks``) for the
    kernels and the reference.

    ``layout``: ``"sbhd"``, ``"bshd"`` or ``"thd"``. Exactly one source: ``cu_seqlens`` ``[n + 1]``
    (thd), ``position_ids`` (already broadcast to the token dims: a view, possibly stride 0), or
    neither (the index along the sequence dim). ``cp_rank``, ``cp_size``: the load-balanced
    context-parallel split. ``searched``: ``[T]`` int64, what the ``cu_seqlens`` search already
    produced for exactly these ``cu_seqlens``, ``cp_rank`` and ``cp_size`` (an eager forward's,
    kept for its backward: ``ops.search_for_backward``); the kernels then read it instead of
    searching again.
    """

    layout: str
    cu_seqlens: torch.Tensor | None
    position_ids: torch.Tensor | None
    cp_rank: int
    cp_size: int
    searched: torch.Tensor | None = None


# The kernels' marker of a padding token in the searched positions: the int64 minimum.
PADDING_POSITION = -(2**63)
SEARCH_FANOUT = 16  # entries of cu_seqlens sampled per search step (kernels/lookup.py)


def search_steps(n_seqs: int, fanout: int = SEARCH_FANOUT) -> int:
    """Steps of the ``fanout``-ary search over ``n_seqs`` sequences: ceil(log_fanout(n))."""
    steps, reach = 0, 1
    while reach < n_seqs:
        steps, reach = steps + 1, reach * fanout
    return steps


def trunc_div(x: torch.Tensor | int, d: int) -> torch.Tensor | int:
    """Integer division rounding toward zero, as the kernels' ``//`` (Triton's, like C's)."""
    if isinstance(x, torch.Tensor):
        return torch.div(x, d, rounding_mode="trunc")
    return x // d if x >= 0 else -(-x // d)


def global_position(local: torch.Tensor, local_len: torch.Tensor | int, positions: Positions):
    """Map an offset inside a rank's local sequence to the global position (load-balanced CP).

    With ``cp_size == 1`` this is the identity for any length: the "two chunks" are the first
    and second half of the sequence, placed back to back.
    """
    chunk = trunc_div(local_len, 2)
    first = positions.cp_rank * chunk + local
    second = (2 * positions.cp_size - 1 - positions.cp_rank) * chunk + (local - chunk)
    return torch.where(local < chunk, first, second)


def token_positions(
    positions: Positions, token_shape: tuple[int, ...] | torch.Size, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(pos, is_padding)``, both of ``token_shape`` (``[S, B]``, ``[B, S]`` or ``[T]``).

    ``pos`` is int64 and may be out of the table's range (the caller writes such rows as NaN);
    ``is_padding`` marks thd tokens at or past ``cu_seqlens[-1]``, which pass through unrotated.
    """
    token_shape = tuple(token_shape)
    if positions.position_ids is not None:
        pos = positions.position_ids.to(torch.int64).expand(token_shape)
        return pos, torch.zeros(token_shape, dtype=torch.bool, device=device)

    if positions.cu_seqlens is not None:
        (n_tokens,) = token_shape
        return cu_seqlens_positions(positions, n_tokens, device)

    seq_dim = 1 if positions.layout == "bshd" else 0
    seq_len = token_shape[seq_dim]
    s = torch.arange(seq_len, dtype=torch.int64, device=device)
    pos = global_position(s, seq_len, positions)
    pos = pos[:, None] if (len(token_shape) == 2 and seq_dim == 0) else pos
    pos = pos.expand(token_shape)
    return pos, torch.zeros(token_shape, dtype=torch.bool, device=device)


def cu_seqlens_positions(
    positions: Positions, n_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, is_padding)`` of ``n_tokens`` thd tokens from ``positions.cu_seqlens`` ``[n + 1]``:
    the kernels' search (``kernels/lookup.py``: ``_search_tile``), vectorized over tokens.

    For well-formed ``cu_seqlens`` (non-decreasing, from 0) this is ``p = t - cu_local[i]`` with
    ``cu_local[i] <= t < cu_local[i + 1]``, mapped by :func:`global_position`, and padding at or
    past ``cu_local[-1]``. For any other int values it is what the kernels compute:

    - ``total = cu[n] / cp_size`` (toward zero); token ``t >= total`` is padding;
    - a 16-ary search keeps ``[lo, hi)``, from ``[0, n)``, for ``ceil(log16 n)`` steps: each step
      samples ``cu[lo + k * stride]`` (``k < 16``, ``stride = ceil((hi - lo) / 16)``, samples
      ``< hi``), counts those ``<= (t + 1) * cp_size - 1`` as ``c``, and moves to
      ``lo += (max(c, 1) - 1) * stride``, ``hi = min(lo + stride, hi)``;
    - ``start = cu[lo] / cp_size``, ``end = cu[lo + 1] / cp_size`` (0 when ``n == 0``), and the
      position is ``global_position(t - start, end - start)``;
    - a padding token gets ``PADDING_POSITION``, and so would any token whose position wraps to
      it, which then counts as padding too (the kernels cannot tell them apart).

    Positions outside the table (negative ones included) are the caller's to write as NaN.
    """
    cp_size = positions.cp_size
    cu = positions.cu_seqlens.to(device=device, dtype=torch.int64)
    n_seqs = cu.shape[0] - 1
    t = torch.arange(n_tokens, device=device, dtype=torch.int64)
    is_padding = t >= trunc_div(cu[n_seqs], cp_size)
    t_scaled = (t + 1) * cp_size - 1  # cu[i] // cp_size <= t, without a division
    lo = torch.zeros_like(t)
    hi = torch.full_like(t, n_seqs)
    k = torch.arange(SEARCH_FANOUT, device=device, dtype=torch.int64)
    for _ in range(search_steps(n_seqs)):
        stride = (hi - lo + (SEARCH_FANOUT - 1)) // SEARCH_FANOUT  # both >= 0
        index = lo[:, None] + k * stride[:, None]
        sampled = index < hi[:, None]
        start = torch.where(sampled, cu[index.clamp(max=n_seqs)], 0)
        below = (sampled & (start <= t_scaled[:, None])).sum(1)
        lo = lo + (below.clamp(min=1) - 1) * stride
        hi = torch.minimum(lo + stride, hi)
    start = trunc_div(cu[lo], cp_size)
    end = cu[lo + 1] if n_seqs > 0 else torch.zeros_like(t)
    pos = global_position(t - start, trunc_div(end, cp_size) - start, positions)
    pos = torch.where(is_padding, PADDING_POSITION, pos)
    return pos, pos == PADDING_POSITION
