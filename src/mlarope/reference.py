"""The executable spec, in plain PyTorch: the semantics (docs/design.md) of the query and
key/value ops, and of the latent op (``rmsnorm_rope_latent``: docs/semantics.md).

It is the CPU backend of :func:`mlarope.apply_rope_q` / :func:`mlarope.apply_rope_kv` and the
oracle of the tests. Math runs in float32 (float64 for float64 inputs) and is rounded once to
the input dtype. Everything here is differentiable by autograd, so ``torch.autograd.gradcheck``
in float64 checks that the hand-written backward (``transpose=True``) is the exact transpose.

Notation: ``N`` nope channels, ``R`` rope channels, ``half = R // 2``, ``H`` heads, ``P`` table
rows; token dims are ``[S, B]`` (sbhd), ``[B, S]`` (bshd) or ``[T]`` (thd).
"""

from __future__ import annotations

import torch

from . import _checks, _latent_sums
from .positions import Positions, token_positions


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_tables(
    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``cos, sin: [P, R]`` at ``pos: [tokens...]`` -> ``[tokens..., R]`` x2, in-range."""
    rows = cos.shape[0]
    in_range = (pos >= 0) & (pos < rows)
    index = pos.clamp(0, rows - 1)
    return cos.to(dtype)[index], sin.to(dtype)[index], in_range


def rotate_products(
    a: torch.Tensor,
    b: torch.Tensor,
    c_a: torch.Tensor,
    c_b: torch.Tensor,
    s_a: torch.Tensor,
    s_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a*c_a - b*s_a`` and ``b*c_b + a*s_b`` in PyTorch's order: each product rounded to the
    compute dtype, then the sum. The kernels compute ``fma(a, c_a, -(b*s_a))`` and
    ``fma(b, c_b, a*s_b)`` (one product rounded, then one rounding of the fused rest), so in fp32
    the two differ by at most one unit of a product; one function, so that the tests can give the
    reference the kernels' arithmetic (``tests/harness.py``, ``fused_reference``)."""
    return a * c_a - b * s_a, b * c_b + a * s_b


def rotate_pairs(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_padding: torch.Tensor,
    in_range: torch.Tensor,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    inverse: bool,
    transpose: bool,
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate ``x: [tokens..., H, R]`` by ``cos, sin: [tokens..., R]`` (compute dtype in and out).

    Forward: ``out_a = a*c[j] - b*s[j]``, ``out_b = b*c[half+j] + a*s[half+j]``.
    ``transpose=True`` is the backward, the exact transpose of that map:
    ``da = g_a*c[j] + g_b*s[half+j]``, ``db = g_b*c[half+j] - g_a*s[j]``.
    ``inverse`` negates ``s``. Padding tokens pass through (re-laid out, not rotated); tokens whose
    position is outside the table come out as NaN. ``round_to`` (a 16-bit dtype) rounds each
    product and the sum to it, as PyTorch's own arithmetic in that dtype does (Megatron-Core's
    rounding, :func:`rope_kv_backward`); None (default) computes exactly in the compute dtype.
    """
    half = x.shape[-1] // 2
    if interleaved_in:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    c = cos.unsqueeze(-2)
    s = sin.unsqueeze(-2)
    c_a, c_b = c[..., :half], c[..., half:]
    s_a, s_b = (-s[..., half:], -s[..., :half]) if transpose else (s[..., :half], s[..., half:])
    if inverse:
        s_a, s_b = -s_a, -s_b
    if round_to is None:
        out_a, out_b = rotate_products(a, b, c_a, c_b, s_a, s_b)
    else:

        def rnd(t: torch.Tensor) -> torch.Tensor:
            return t.to(round_to).to(x.dtype)

        out_a = rnd(rnd(a * c_a) - rnd(b * s_a))
        out_b = rnd(rnd(b * c_b) + rnd(a * s_b))
    pad = is_padding[..., None, None]
    out_a = torch.where(pad, a, out_a)
    out_b = torch.where(pad, b, out_b)
    bad = (~in_range & ~is_padding)[..., None, None]
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    out_a = torch.where(bad, nan, out_a)
    out_b = torch.where(bad, nan, out_b)
    if interleaved_out:
        # reshape, not flatten: autograd's batched gradients (legacy vmap) have no flatten rule
        return torch.stack((out_a, out_b), dim=-1).reshape(*out_a.shape[:-1], 2 * half)
    return torch.cat((out_a, out_b), dim=-1)


# Each dtype's canonical quiet NaN, as its bits: every NaN a rotation writes is stored so, on
# every backend (the kernels' ``rotation.from_f32``); the bits of a computed NaN otherwise
# follow its operands and the hardware (PyTorch's vectorized CPU conversion stores 0xFFFF).
_CANONICAL_NAN = {
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float16: (torch.int16, 0x7E00),
    torch.float32: (torch.int32, 0x7FC00000),
    torch.float64: (torch.int64, 0x7FF8000000000000),
}


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN replaced by its dtype's canonical quiet NaN (the same bits)."""
    int_dtype, bits = _CANONICAL_NAN[t.dtype]
    # torch.full, not torch.tensor: no host-to-device copy (a sync, and not capturable)
    nan = torch.full((), bits, dtype=int_dtype, device=t.device).view(t.dtype)
    return torch.where(t.isnan(), nan, t)


def _tables_for(positions: Positions, token_shape, cos, sin, dtype, device):
    pos, is_padding = token_positions(positions, token_shape, device)
    cos_rows, sin_rows, in_range = gather_tables(cos, sin, pos, dtype)
    return cos_rows, sin_rows, is_padding, in_range


def rope_q(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    inverse: bool,
    transpose: bool = False,
) -> torch.Tensor:
    """Query op on checked inputs: ``q: [tokens..., H, N + R]``, ``cos, sin: [P, R]`` -> same shape.

    Returns a new tensor: nope channels copied, rope channels rotated and re-laid out.
    """
    rope_dim = cos.shape[-1]
    nope = q.shape[-1] - rope_dim
    dtype = compute_dtype(q.dtype)
    cos_rows, sin_rows, is_padding, in_range = _tables_for(
        positions, q.shape[:-2], cos, sin, dtype, q.device
    )
    rotated = rotate_pairs(
        q[..., nope:].to(dtype),
        cos_rows,
        sin_rows,
        is_padding,
        in_range,
        interleaved_in=interleaved_in,
        interleaved_out=interleaved_out,
        inverse=inverse,
        transpose=transpose,
    )
    return torch.cat((q[..., :nope], canonical_nan(rotated.to(q.dtype))), dim=-1)


def rope_kv(
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    k_dim: int,
    interleaved_in: bool,
    interleaved_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value op on checked inputs.

    ``kv: [tokens..., H, K + V]``, ``k_pe: [tokens..., R]`` ->
    ``k: [tokens..., H, K + R]`` (``kv[..., :K]`` then the rotated ``k_pe``, the same for every
    head) and ``v: [tokens..., H, V]`` (a view of ``kv``; the caller copies it if asked).
    """
    dtype = compute_dtype(kv.dtype)
    cos_rows, sin_rows, is_padding, in_range = _tables_for(
        positions, kv.shape[:-2], cos, sin, dtype, kv.device
    )
    rotated = rotate_pairs(
        k_pe.unsqueeze(-2).to(dtype),
        cos_rows,
        sin_rows,
        is_padding,
        in_range,
        interleaved_in=interleaved_in,
        interleaved_out=interleaved_out,
        inverse=False,
        transpose=False,
    )
    rotated = canonical_nan(rotated.to(kv.dtype))
    k_rope = rotated.expand(*kv.shape[:-1], rotated.shape[-1])
    k = torch.cat((kv[..., :k_dim], k_rope), dim=-1)
    return k, kv[..., k_dim:]


def rope_kv_backward(
    dk: torch.Tensor,
    dv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    k_dim: int,
    interleaved_in: bool,
    interleaved_out: bool,
    megatron_rounding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key/value op's backward: ``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]`` ->
    ``dkv: [tokens..., H, K + V]``, ``dk_pe: [tokens..., R]``.

    ``dk_pe`` is the transpose rotation of the sum over heads of ``dk[..., K:]``, accumulated in
    the compute dtype head after head (``((g_0 + g_1) + g_2) + ...``) and rounded once. The
    kernels add the heads in another fixed order (pairwise within chunks of 16 heads:
    ``kernels/kv.py``, ``_sum_heads``), so for three or more heads the two can differ in the
    last bits, each within the fp32 summation bound.

    With no heads (``H == 0``) ``k_pe`` reaches no output, and its gradient is zero in every row,
    whatever the position (an out-of-range one included), as the kernels write it.

    ``megatron_rounding`` (only ``mlarope.compat.megatron`` sets it) rounds where Megatron-Core's
    kernel and its unfused PyTorch path round: the head sum to ``dk``'s dtype, then, when the
    tables share ``dk``'s 16-bit dtype, each product and the sum of the rotation to that dtype
    (:func:`megatron_product_dtype`).
    """
    dtype = compute_dtype(dk.dtype)
    dkv = torch.cat((dk[..., :k_dim], dv), dim=-1)
    if dk.shape[-2] == 0:
        return dkv, dk.new_zeros((*dk.shape[:-2], dk.shape[-1] - k_dim))
    total = dk[..., 0, k_dim:].to(dtype)
    for head in range(1, dk.shape[-2]):
        total = total + dk[..., head, k_dim:].to(dtype)
    round_to = None
    if megatron_rounding:
        total = total.to(dk.dtype).to(dtype)
        round_to = megatron_product_dtype(dk.dtype, cos.dtype)
    cos_rows, sin_rows, is_padding, in_range = _tables_for(
        positions, dk.shape[:-2], cos, sin, dtype, dk.device
    )
    dk_pe = rotate_pairs(
        total.unsqueeze(-2),
        cos_rows,
        sin_rows,
        is_padding,
        in_range,
        interleaved_in=interleaved_out,
        interleaved_out=interleaved_in,
        inverse=False,
        transpose=True,
        round_to=round_to,
    )
    return dkv, canonical_nan(dk_pe.squeeze(-2).to(dk.dtype))


def megatron_product_dtype(grad_dtype: torch.dtype, table_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype Megatron-Core's key/value backward rounds each product of its rotation to: the
    promoted dtype of the gradient and the tables, when that is a 16-bit dtype (bf16 or fp16
    gradients with tables of the same dtype, as Megatron passes them); None when products are
    computed in fp32 or wider (no rounding beyond the compute dtype's)."""
    promoted = torch.promote_types(grad_dtype, table_dtype)
    return promoted if promoted in (torch.bfloat16, torch.float16) else None


def apply_rope_q(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str = "sbhd",
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
    inverse: bool = False,
) -> torch.Tensor:
    """The query op in plain PyTorch (out of place), with the public API's checks.

    ``q: [S, B, H, N + R]`` | ``[B, S, H, N + R]`` | ``[T, H, N + R]``; ``cos, sin: [P, R]``.
    """
    q, cos2d, sin2d, positions = _checks.check_q_call(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out, inverse,
    )  # fmt: skip
    return rope_q(
        q, cos2d, sin2d, positions,
        interleaved_in=interleaved, interleaved_out=interleaved_out, inverse=inverse,
    )  # fmt: skip


def apply_rope_kv(
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    k_dim: int,
    layout: str = "sbhd",
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key/value op in plain PyTorch, with the public API's checks.

    ``kv: [..., H, K + V]``, ``k_pe: [..., 1, R]`` or ``[..., R]`` ->
    ``k: [..., H, K + R]``, ``v: [..., H, V]`` (a view of ``kv``).
    """
    kv, k_pe, k_dim, cos2d, sin2d, positions = _checks.check_kv_call(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out,
    )  # fmt: skip
    return rope_kv(
        kv, k_pe, cos2d, sin2d, positions,
        k_dim=k_dim, interleaved_in=interleaved, interleaved_out=interleaved_out,
    )  # fmt: skip


# --------------------------------------------------------------------------- the latent op
def _mean_of_products(a: torch.Tensor, b: torch.Tensor, exact: bool) -> torch.Tensor:
    """``sum_c a * b / L`` over the last dim: fp32 ``a, b`` with ``exact``, the kernels' exact
    sum (``_latent_sums``), divided in float64 and rounded once to fp32; otherwise (float64, or
    the differentiable formulas) PyTorch's own sum in the compute dtype."""
    if exact and a.dtype == torch.float32:
        return (_latent_sums.row_sum_of_products(a, b) / a.shape[-1]).float()
    return (a * b).sum(-1) / a.shape[-1]


def _reciprocal_sqrt(v: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(v)`` as two correctly rounded steps in ``v``'s dtype (the kernels' ``sqrt_rn``
    and ``div_rn``). For fp32 each step runs in float64 and is rounded once to fp32, which is
    the correctly rounded fp32 result (float64 has more than twice fp32's precision): PyTorch's
    own fp32 ``sqrt`` on the CPU is not correctly rounded (it differed from the exact rounding
    in a fifth of random inputs, by one unit)."""
    if v.dtype == torch.float64:
        return 1.0 / torch.sqrt(v)
    root = torch.sqrt(v.double()).to(v.dtype)
    return (1.0 / root.double()).to(v.dtype)


def _normalized(
    x: torch.Tensor, eps: float, input_dtype: torch.dtype, exact: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm's pieces of ``x: [tokens..., L]`` (compute dtype): ``r = 1 / sqrt(var + eps)``
    ``[tokens...]`` with ``var = sum(x * x) / L``, ``h_hat = x * r`` and ``h_r``, ``h_hat``
    rounded to ``input_dtype`` (back in the compute dtype)."""
    r = _reciprocal_sqrt(_mean_of_products(x, x, exact) + eps)
    h_hat = x * r[..., None]
    return r, h_hat, h_hat.to(input_dtype).to(x.dtype)


def latent_dtype(ckv_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The latent's dtype: PyTorch's promotion of ``weight * h.to(ckv.dtype)``."""
    return torch.promote_types(weight_dtype, ckv_dtype)


def _rotate_k_pe(x, cos, sin, positions, interleaved_in, interleaved_out, transpose):
    """``x: [tokens..., R]`` rotated (or transpose-rotated), rounded once to its dtype."""
    dtype = compute_dtype(x.dtype)
    cos_rows, sin_rows, is_padding, in_range = _tables_for(
        positions, x.shape[:-1], cos, sin, dtype, x.device
    )
    rotated = rotate_pairs(
        x.unsqueeze(-2).to(dtype), cos_rows, sin_rows, is_padding, in_range,
        interleaved_in=interleaved_in, interleaved_out=interleaved_out, inverse=False,
        transpose=transpose,
    )  # fmt: skip
    return canonical_nan(rotated.squeeze(-2).to(x.dtype))


def rmsnorm_rope_latent(
    ckv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    eps: float,
    interleaved_in: bool,
    interleaved_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent op on checked inputs: ``ckv: [tokens..., L + R]`` (``kv_a_proj_with_mqa``'s
    output), ``weight: [L]``, ``cos, sin: [P, R]`` -> ``latent: [tokens..., L]`` and
    ``k_pe: [tokens..., R]``.

    ``latent`` is transformers' ``DeepseekV3RMSNorm`` of ``x = ckv[..., :L]``, rounded where that
    module rounds: in fp32, ``var = sum(x * x) / L`` (the sum exact, ``_latent_sums``; the
    division in float64, rounded once to fp32), ``h = x * (1 / sqrt(var + eps))`` (each step
    correctly rounded) rounded once to ``ckv.dtype``, then ``weight * h`` in PyTorch's promotion
    (an fp32 product rounded once to ``promote(weight.dtype, ckv.dtype)``). ``k_pe`` is
    ``ckv[..., L:]`` rotated as the query op rotates (fp32, one rounding to ``ckv.dtype``).
    float64 inputs compute in float64 with PyTorch's sums."""
    n_latent = weight.shape[0]
    dtype = compute_dtype(ckv.dtype)
    _, _, h_r = _normalized(ckv[..., :n_latent].to(dtype), eps, ckv.dtype, True)
    out_dtype = latent_dtype(ckv.dtype, weight.dtype)
    latent = canonical_nan((weight.to(dtype) * h_r).to(out_dtype))
    return latent, _rotate_k_pe(
        ckv[..., n_latent:], cos, sin, positions, interleaved_in, interleaved_out, False
    )


def rmsnorm_rope_latent_backward(
    g_latent: torch.Tensor,
    g_pe: torch.Tensor,
    ckv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    eps: float,
    interleaved_in: bool,
    interleaved_out: bool,
    weight_grad: bool = True,
    exact: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The latent op's backward: ``g_latent: [tokens..., L]``, ``g_pe: [tokens..., R]`` (and the
    forward's ``ckv``, ``weight``) -> ``d_ckv: [tokens..., L + R]`` (``ckv.dtype``) and
    ``d_weight: [L]`` (``weight.dtype``; None unless ``weight_grad``).

    In the compute dtype, with ``r``, ``h_hat = x * r`` and ``h_r`` recomputed from ``x`` as the
    forward computes them: ``dh = g * weight``, ``dx = r * (dh - h_hat * m)`` with
    ``m = sum(dh * h_hat) / L`` (the sum exact, as the variance's) and the subtraction one
    ``fma``, rounded once to ``ckv.dtype``; ``d_weight = sum_t g * h_r`` in
    ``_latent_sums.token_sum_of_products``'s way, rounded once to ``weight.dtype``; the rope part
    is the transpose rotation of ``g_pe``, written in ``ckv``'s pair layout. The rounding of
    ``h`` to ``ckv.dtype`` passes the gradient through, as autograd's cast does.

    ``exact=False``: PyTorch's own sums instead of the exact ones, differentiable by autograd
    (the op's double backward differentiates this); float64 always computes so."""
    n_latent = weight.shape[0]
    dtype = compute_dtype(ckv.dtype)
    r, h_hat, h_r = _normalized(ckv[..., :n_latent].to(dtype), eps, ckv.dtype, exact)
    g = g_latent.to(dtype)
    dh = g * weight.to(dtype)
    m = _mean_of_products(dh, h_hat, exact)
    dx = r[..., None] * _latent_sums.fma(-h_hat, m[..., None], dh)
    d_pe = _rotate_k_pe(g_pe, cos, sin, positions, interleaved_out, interleaved_in, True)
    d_ckv = torch.cat((canonical_nan(dx.to(ckv.dtype)), d_pe.to(ckv.dtype)), dim=-1)
    if not weight_grad:
        return d_ckv, None
    g2d, h2d = g.reshape(-1, n_latent), h_r.reshape(-1, n_latent)
    if exact and dtype == torch.float32:
        d_weight = _latent_sums.token_sum_of_products(g2d, h2d)
    else:
        d_weight = (g2d * h2d).sum(0)
    return d_ckv, canonical_nan(d_weight.to(weight.dtype))


def rmsnorm_rope_latent_jvp(
    t_ckv: torch.Tensor,
    t_weight: torch.Tensor,
    ckv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Positions,
    *,
    eps: float,
    interleaved_in: bool,
    interleaved_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent op's tangents (forward-mode AD) for tangents ``t_ckv`` of ``ckv`` and
    ``t_weight`` of ``weight``: ``t_latent = weight * t_h + t_weight * h_r`` with
    ``t_h = r * (t_x - h_hat * sum(t_x * h_hat) / L)`` (RMSNorm's Jacobian is symmetric: the
    backward's formula), and ``t_pe``, the rotation of ``t_ckv[..., L:]``. Plain differentiable
    PyTorch (its own sums), in the compute dtype, rounded once to the outputs' dtypes."""
    n_latent = weight.shape[0]
    dtype = compute_dtype(ckv.dtype)
    r, h_hat, h_r = _normalized(ckv[..., :n_latent].to(dtype), eps, ckv.dtype, False)
    t_x = t_ckv[..., :n_latent].to(dtype)
    m = _mean_of_products(t_x, h_hat, False)
    t_h = r[..., None] * _latent_sums.fma(-h_hat, m[..., None], t_x)
    t_latent = weight.to(dtype) * t_h + t_weight.to(dtype) * h_r
    out_dtype = latent_dtype(ckv.dtype, weight.dtype)
    t_pe = _rotate_k_pe(
        t_ckv[..., n_latent:], cos, sin, positions, interleaved_in, interleaved_out, False
    )
    return canonical_nan(t_latent.to(out_dtype)), t_pe
