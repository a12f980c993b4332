"""The latent op's sums, in a fixed order, in plain PyTorch: the spec its kernels reproduce bit
for bit (a leaf: it imports nothing of the package).

``mlarope.rmsnorm_rope_latent`` sums three things. Each sum's order is fixed by the sizes alone
(``L``, the latent width, and ``T``, the token count), never by a launch configuration or a
thread layout, so the results are bitwise identical across runs, launch configurations and
backends (the kernels in ``kernels/latent.py``, the reference in ``reference.py``):

- per token, over the ``L`` latent channels, ``sum_c a[c] * b[c]`` (``x * x`` for the variance,
  forward and backward; ``dh * h_hat`` in the backward): :func:`row_sum_of_products`. The row is
  padded with zeros to ``P``, the power of two ``>= max(L, 2)``; the first level pairs adjacent
  channels with one multiply-add, ``fma(a[2i], b[2i], a[2i+1] * b[2i+1])``, and every later level
  adds adjacent pairs, ``s[2i] + s[2i+1]``, down to one value;
- over tokens, per channel, ``sum_t g[t] * h[t]`` (the norm weight's gradient):
  :func:`token_sum_of_products`. Tokens in tiles of :data:`TILE_TOKENS` (the last one padded with
  zeros), each tile summed as a row above (a multiply-add across adjacent tokens, then adjacent
  pairs); :data:`TILES_PER_PARTIAL` consecutive tiles added in order,
  ``((t0 + t1) + t2) + t3``, give one partial sum per ``TILE_TOKENS * TILES_PER_PARTIAL`` tokens
  (one kernel program); the partials in chunks of :data:`PARTIALS_PER_CHUNK` (the last padded
  with zeros), each chunk an adjacent pairwise tree, and the chunk sums added in order to 0.

PyTorch has no fused multiply-add: :func:`fma` rounds the product, then the sum, as Triton
3.6's interpreter computes ``tl.fma``. The GPU (and the interpreter from Triton 3.7) rounds once;
the tests substitute an exact fused multiply-add there (``tests/harness.py``), as they do for the
rotation's products (``reference.rotate_products``).
"""

from __future__ import annotations

import torch

TILE_TOKENS = 8  # tokens summed as one tree (a power of two)
TILES_PER_PARTIAL = 4  # tiles added in order into one partial (one kernel program's tokens)
PARTIALS_PER_CHUNK = 64  # partials summed as one tree (a power of two)
TOKENS_PER_PARTIAL = TILE_TOKENS * TILES_PER_PARTIAL


def padded_width(n: int) -> int:
    """``P``: the power of two ``>= max(n, 2)`` a row sum pads to."""
    width = 2
    while width < n:
        width *= 2
    return width


def fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x * y + z``: the kernels' ``tl.fma``, rounded twice here (module docstring)."""
    return x * y + z


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    zeros = t.new_zeros((*t.shape[:-1], width - t.shape[-1]))
    return torch.cat((t, zeros), dim=-1)


def pairwise_sum(s: torch.Tensor) -> torch.Tensor:
    """``s: [..., 2**k]`` -> ``[...]``: adjacent pairs added, level after level."""
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def row_sum_of_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_c a[..., c] * b[..., c]`` over the last dim, in the kernels' order -> ``[...]``."""
    width = padded_width(a.shape[-1])
    a, b = _pad_last(a, width), _pad_last(b, width)
    return pairwise_sum(fma(a[..., 0::2], b[..., 0::2], a[..., 1::2] * b[..., 1::2]))


def token_sum_of_products(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``sum_t g[t, c] * h[t, c]`` of ``g, h: [T, L]`` -> ``[L]``, in the kernels' order."""
    n_tokens, width = g.shape
    n_partials = -(-n_tokens // TOKENS_PER_PARTIAL)
    rows = n_partials * TOKENS_PER_PARTIAL
    # Tokens last: [n_partials, TILES_PER_PARTIAL, L, TILE_TOKENS], zero-padded.
    g = _pad_last(g.t(), rows).reshape(width, n_partials, TILES_PER_PARTIAL, TILE_TOKENS)
    h = _pad_last(h.t(), rows).reshape(width, n_partials, TILES_PER_PARTIAL, TILE_TOKENS)
    tiles = row_sum_of_products(g, h)  # [L, n_partials, TILES_PER_PARTIAL]
    partials = tiles[..., 0]
    for i in range(1, TILES_PER_PARTIAL):
        partials = partials + tiles[..., i]
    n_chunks = -(-n_partials // PARTIALS_PER_CHUNK)
    chunks = _pad_last(partials, n_chunks * PARTIALS_PER_CHUNK)
    chunk_sums = pairwise_sum(chunks.reshape(width, n_chunks, PARTIALS_PER_CHUNK))
    total = g.new_zeros(width)
    for i in range(n_chunks):
        total = total + chunk_sums[:, i]
    return total
