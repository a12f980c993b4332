"""Each token's rotary position, in plain PyTorch: the spec that the kernels' lookup matches.

Position sources (DESIGN.md, "Positions"):

- ``sbhd`` / ``bshd`` / ``thd`` without ``cu_seqlens``: the index along the sequence dim;
- ``thd`` with ``cu_seqlens`` ``[n + 1]``: ``p = t - cu_local[i]`` for token ``t`` of sequence
  ``i``, where ``cu_local = cu_seqlens // cp_size``; tokens at or past ``cu_local[-1]`` are padding;
- context parallel: a rank's local sequence holds global chunks ``cp_rank`` and
  ``2 * cp_size - 1 - cp_rank`` (each ``L / (2 * cp_size)`` long), one after the other;
- explicit ``position_ids``: taken as they are.

The kernels (``kernels/_lookup.py``) compute the same numbers per token in O(log n).
"""

from __future__ import annotations

import torch

from ._checks import Positions


def global_position(local: torch.Tensor, local_len: torch.Tensor | int, positions: Positions):
    """Map an offset inside a rank's local sequence to the global position (load-balanced CP).

    With ``cp_size == 1`` this is the identity for any length: the "two chunks" are the first
    and second half of the sequence, placed back to back.
    """
    chunk = local_len // 2
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
        cu = positions.cu_seqlens.to(torch.int64) // positions.cp_size
        t = torch.arange(n_tokens, device=device, dtype=torch.int64)
        seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, max(cu.shape[0] - 2, 0))
        is_padding = t >= cu[-1]
        if cu.shape[0] < 2:
            return torch.zeros_like(t), torch.ones_like(is_padding)
        start = cu[seq]
        length = cu[seq + 1] - start
        return global_position(t - start, length, positions), is_padding

    seq_dim = 1 if positions.layout == "bshd" else 0
    seq_len = token_shape[seq_dim]
    s = torch.arange(seq_len, dtype=torch.int64, device=device)
    pos = global_position(s, seq_len, positions)
    pos = pos[:, None] if (len(token_shape) == 2 and seq_dim == 0) else pos
    pos = pos.expand(token_shape)
    return pos, torch.zeros(token_shape, dtype=torch.bool, device=device)
