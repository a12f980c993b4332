"""mlarope.compat.megatron's query functions against the independent fp64 reference
(``tests/compat_megatron_harness.py``): every variant, layout and context-parallel rank, values
and gradients within the error model; ``position_ids``, the inverse, a projection's view, and
mlarope's own fp32 tables.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from mlarope.compat import megatron as mm
from tests.compat_megatron_harness import (
    CASES,
    DTYPES,
    B,
    H,
    N,
    P,
    R,
    S,
    assert_within,
    call_q,
    case_id,
    cu_arg,
    f64,
    make_tables,
    megatron_positions,
    q_reference,
    randn,
    ref_q,
    tables64,
    tokens_shape,
)

# (function, inverse, remove_interleaving); the legacy function has neither argument.
Q_VARIANTS = [
    ("fused_apply_mla_rope_for_q", False, False),
    ("fused_mla_rope_inplace", False, False),
    ("fused_mla_rope_inplace", True, False),
    ("fused_mla_rope_inplace", False, True),
    ("fused_mla_rope_inplace", True, True),
    ("fused_mla_rope_out_of_place", False, False),
    ("fused_mla_rope_out_of_place", True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("variant", Q_VARIANTS, ids=lambda v: f"{v[0]}-inv{v[1]:d}-ril{v[2]:d}")
def test_q_matches_megatron(variant, case, dtype, device):
    name, inverse, ril = variant
    layout, cp_size, cp_rank = case
    inplace = name != "fused_mla_rope_out_of_place"
    cos, sin = make_tables(dtype, device)
    shape = (*tokens_shape(layout, cp_size), H, N + R)
    leaf = randn(*shape, dtype=dtype, seed=1, device=device).requires_grad_()
    g = randn(*shape, dtype=dtype, seed=2, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    want, want_grad, mag, mag_grad = q_reference(leaf, g, pos, cos, sin, inverse, ril)

    t = leaf.clone()  # a non-leaf, as Megatron's q (a view of a projection) is
    before = t.detach().clone()
    out = call_q(name, t, cos, sin, cu_arg(layout, device), cp_rank, cp_size, inverse, ril)

    if inplace:
        assert out.data_ptr() == t.data_ptr()  # Megatron returns t's storage, rotated
        assert torch.equal(t.detach(), out.detach())
    else:
        assert out.data_ptr() != t.data_ptr()
        assert torch.equal(t.detach(), before)  # input untouched
    assert torch.equal(out.detach()[..., :N], before[..., :N])  # nope channels exact
    assert_within(out, want, mag, dtype, 4, "output")

    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")
    assert torch.equal(leaf.grad[..., :N], g[..., :N])


@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_mla_rope_out_of_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_position_ids(name, dtype, device):
    """thd position_ids replace the cu_seqlens/CP mapping (cp_rank/cp_size then play no part)."""
    cos, sin = make_tables(dtype, device, seed=3)
    T = 10
    leaf = randn(T, H, N + R, dtype=dtype, seed=4, device=device).requires_grad_()
    g = randn(T, H, N + R, dtype=dtype, seed=5, device=device)
    ids = [0, 15, 3, 3, 7, 1, 14, 2, 9, 0]
    want, want_grad, mag, mag_grad = q_reference(leaf, g, ids, cos, sin, True, True)
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)  # ignored, as in Megatron
    out = call_q(name, leaf.clone(), cos, sin, cu, 1, 2, True, True, position_ids=ids_t)
    assert_within(out, want, mag, dtype, 4, "output")
    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")


def test_q_inverse_undoes_forward(device):
    """With a real (unit, half-repeated) table, ``inverse`` undoes the rotation.

    ``remove_interleaving=True`` keeps the pairs where they were, so the inverse call reads what
    the forward call wrote; the nope channels pass through both.
    """
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    theta = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq
    theta = torch.cat((theta, theta), -1)
    cos = theta.cos().float().view(P, 1, 1, R).to(device)
    sin = theta.sin().float().view(P, 1, 1, R).to(device)
    x = randn(S, B, H, N + R, dtype=torch.float32, seed=7, device=device)
    y = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R, remove_interleaving=True)
    z = mm.fused_mla_rope_out_of_place(y, cos, sin, N, R, inverse=True, remove_interleaving=True)
    # two fp32 rotations by a table rounded to fp32: a few units of 2^-24 of |x|-sized terms
    pos = megatron_positions("sbhd", 1, 0)
    c64, s64 = tables64(cos, sin)
    absx = f64(x).abs()
    mag = ref_q(ref_q(absx, pos, c64, s64, False, True, True), pos, c64, s64, True, True, True)
    assert_within(z, f64(x), mag, torch.float32, 16, "round trip")


def test_q_in_place_on_a_projection_view(device):
    """As multi_latent_attention.py calls it: ``q`` is a view of a linear layer's output.

    The rotation lands in the projection's storage, and the weight gradient equals the one
    through the out-of-place function (the same backward op, so bitwise).
    """
    cos, sin = make_tables(torch.float32, device, seed=18)
    x = randn(S, B, 5, dtype=torch.float32, seed=19, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=20, device=device)
    grads = []
    for name in ("fused_apply_mla_rope_for_q", "fused_mla_rope_out_of_place"):
        w = randn(5, H * (N + R), dtype=torch.float32, seed=21, device=device).requires_grad_()
        proj = x @ w  # [S, B, H * (N + R)]
        q = proj.view(S, B, H, N + R)
        out = getattr(mm, name)(q, cos, sin, N, R)
        if name == "fused_apply_mla_rope_for_q":
            assert out.data_ptr() == proj.data_ptr()
            assert torch.equal(proj.detach().view_as(out), out.detach())
        out.backward(g)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_accepts_mlarope_fp32_tables(dtype, device):
    """mlarope's own ``[P, R]`` fp32 tables (exact) work for any activation dtype."""
    cfg = mlarope.YarnConfig(
        dim=R, base=10000.0, factor=40.0, original_max_position_embeddings=4,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
    )  # fmt: skip
    cos, sin = cfg.cos_sin(P, device=device)
    assert cos.shape == (P, R) and cos.dtype == torch.float32
    x = randn(S, B, H, N + R, dtype=dtype, seed=22, device=device)
    out = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R)
    pos = megatron_positions("sbhd", 1, 0)
    c64, s64 = tables64(cos, sin)
    want = ref_q(f64(x), pos, c64, s64)
    mag = ref_q(f64(x).abs(), pos, c64, s64, absolute=True)
    assert_within(out, want, mag, dtype, 4, "output")
