"""The latent op's sums, in plain PyTorch: the spec its kernels reproduce bit for bit (a leaf: it
imports nothing of the package).

``mlarope.rmsnorm_rope_latent`` sums three things: per token over the ``L`` latent channels,
``x * x`` (the variance, forward and backward) and ``dh * h_hat`` (the backward), and per channel
over tokens, ``g * h_r`` (the weight's gradient). A floating-point sum depends on its order, and
a GPU reduction's order on the thread layout, which changes with the launch configuration. So
each sum here is *exact up to a fixed quantum*, and integer addition does not depend on order:

:func:`exact_sum` of ``n`` terms (each an fp32 x fp32 product, exact in float64) takes the
largest finite magnitude ``M < 2**e`` (``e`` from ``M``'s float64 exponent, at least -300), turns
every finite term into an integer number of quanta ``2**(e - K)`` (truncated toward zero; ``K =
62 - ceil(log2 n)``, so the ``n`` integers add up in int64 without overflow), adds them exactly,
and converts the int64 total to float64 and back to the term's scale. Each term loses less than
one quantum, ``2**(1 - K) * M``, so the sum is within ``n * 2**(1 - K)`` (``2**-42`` for
``n = 512``) of the exact value relative to the largest term, then rounded (twice: to float64,
then by the caller to fp32). A NaN term, or infinities of both signs, make the sum NaN; +inf or
-inf alone make it that infinity (the exact sum's sign). The kernels compute the same integers
with ``tl.max``, ``tl.sum`` and an OR reduction, in whatever order the compiler picks.

The weight's gradient sums over all tokens: tokens in tiles of :data:`TILE_TOKENS` (the last
padded with zeros), each tile's exact sum (float64); :data:`TILES_PER_PARTIAL` tiles added in
order in float64 (starting from 0) give one partial per ``TILE_TOKENS * TILES_PER_PARTIAL``
tokens (one kernel program), rounded to fp32; the exact sum of all partials, rounded to fp32.
The result depends on the token count, never on a launch configuration.

PyTorch has no fused multiply-add: :func:`fma` rounds the product, then the sum, as Triton
3.6's interpreter computes ``tl.fma``. The GPU (and the interpreter from Triton 3.7) rounds once;
the tests substitute an exact fused multiply-add there (``tests/harness.py``), as they do for the
rotation's products (``reference.rotate_products``).
"""

from __future__ import annotations

import torch

TILE_TOKENS = 8  # tokens whose products one exact sum adds (one kernel tile)
TILES_PER_PARTIAL = 4  # tiles added in turn into one partial (one kernel program's tokens)
TOKENS_PER_PARTIAL = TILE_TOKENS * TILES_PER_PARTIAL
MIN_EXPONENT = -300  # below any nonzero product of two fp32 values (2**-298)


def headroom_bits(n_terms: int) -> int:
    """``K``: a term is at most ``2**K`` quanta, so ``n_terms`` of them fit in an int64."""
    return 62 - max(n_terms - 1, 0).bit_length()


def fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x * y + z``: the kernels' ``tl.fma``, rounded twice here (module docstring)."""
    return x * y + z


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int64, in float64's normal range) as float64, exactly."""
    return ((exponent + 1023) << 52).view(torch.float64)


def exact_sum(terms: torch.Tensor, dim: int, n_terms: int) -> torch.Tensor:
    """The sum of float64 ``terms`` over ``dim`` (``n_terms`` of them, zero padding aside),
    exact up to the quantum of the module docstring -> float64, ``dim`` removed."""
    finite = (terms - terms) == 0
    magnitude = torch.where(finite, terms.abs(), 0.0).amax(dim, keepdim=True)
    exponent = ((magnitude.view(torch.int64) >> 52) - 1022).clamp(min=MIN_EXPONENT)
    shift = headroom_bits(n_terms) - exponent
    quanta = torch.where(finite, terms * _power_of_two(shift), 0.0).to(torch.int64)
    total = quanta.sum(dim).to(torch.float64) * _power_of_two(-shift).squeeze(dim)
    nan = terms.isnan().any(dim)
    up = (terms == float("inf")).any(dim)
    down = (terms == float("-inf")).any(dim)
    total = torch.where(down, float("-inf"), torch.where(up, float("inf"), total))
    return torch.where(nan | (up & down), float("nan"), total)


def row_sum_of_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_c a[..., c] * b[..., c]`` of fp32 ``a, b`` over the last dim, exactly (float64)."""
    return exact_sum(a.double() * b.double(), -1, a.shape[-1])


def token_sum_of_products(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``sum_t g[t, c] * h[t, c]`` of fp32 ``g, h: [T, L]`` -> fp32 ``[L]``, as the kernels
    (module docstring)."""
    n_tokens, width = g.shape
    if n_tokens == 0:
        return g.new_zeros(width, dtype=torch.float32)
    n_partials = -(-n_tokens // TOKENS_PER_PARTIAL)
    padding = n_partials * TOKENS_PER_PARTIAL - n_tokens
    products = torch.cat(
        (g.double() * h.double(), g.new_zeros(padding, width, dtype=torch.float64))
    )
    tiles = exact_sum(
        products.view(n_partials, TILES_PER_PARTIAL, TILE_TOKENS, width), 2, TILE_TOKENS
    )
    partials = torch.zeros(n_partials, width, dtype=torch.float64, device=g.device)
    for i in range(TILES_PER_PARTIAL):
        partials = partials + tiles[:, i]
    partials = partials.float().double()
    return exact_sum(partials, 0, n_partials).float()
