"""mlarope.compat.megatron around autograd and aliasing: the in-place functions on a leaf
that requires grad (as Megatron's tests call them), on views, on tensors saved for backward,
under ``torch.compile``, ``torch.func`` and forward-mode AD; the out-of-place function's bits.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from mlarope.compat import megatron as mm
from tests.compat_megatron_harness import (
    DTYPES,
    B,
    H,
    N,
    R,
    S,
    assert_within,
    call_q,
    case_id,
    cu_arg,
    make_tables,
    megatron_positions,
    q_reference,
    randn,
    tokens_shape,
)

LEAF_CASES = [("sbhd", 1, 0), ("thd", 2, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LEAF_CASES, ids=case_id)
@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_apply_mla_rope_for_q"])
def test_inplace_on_grad_leaf_as_megatron(name, case, dtype, device):
    """Megatron's tests pass a leaf that requires grad (``x.detach().requires_grad_(True)``)
    straight to the in-place function: it is rotated in place, the returned tensor is on its
    storage, and the leaf's gradient is the rotated-back upstream gradient."""
    layout, cp_size, cp_rank = case
    cos, sin = make_tables(dtype, device, seed=23)
    shape = (*tokens_shape(layout, cp_size), H, N + R)
    leaf = randn(*shape, dtype=dtype, seed=24, device=device).requires_grad_()
    g = randn(*shape, dtype=dtype, seed=25, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    want, want_grad, mag, mag_grad = q_reference(leaf, g, pos, cos, sin, False, False)
    before = leaf.detach().clone()
    version = leaf._version

    out = call_q(name, leaf, cos, sin, cu_arg(layout, device), cp_rank, cp_size, False, False)
    assert out.data_ptr() == leaf.data_ptr() and out.grad_fn is not None
    assert leaf._version > version  # other ops that saved the leaf will notice
    assert torch.equal(leaf.detach(), out.detach())  # the leaf itself holds the rotation
    assert torch.equal(out.detach()[..., :N], before[..., :N])
    assert_within(out, want, mag, dtype, 4, "output")

    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")
    assert torch.equal(leaf.grad[..., :N], g[..., :N])


def test_inplace_on_view_of_grad_leaf(device):
    """A view of a leaf that requires grad is refused by autograd too; Megatron rotates it."""
    cos, sin = make_tables(torch.float32, device, seed=26)
    base = randn(S, B, H, N + R + 3, dtype=torch.float32, seed=27, device=device)
    base.requires_grad_()
    t = base[..., 3:]
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=28, device=device)
    pos = megatron_positions("sbhd", 1, 0)
    want, want_grad, mag, mag_grad = q_reference(t.detach(), g, pos, cos, sin, True, True)
    out = mm.fused_mla_rope_inplace(t, cos, sin, N, R, inverse=True, remove_interleaving=True)
    assert out.data_ptr() == t.data_ptr()
    assert torch.equal(base.detach()[..., 3:], out.detach())
    assert_within(out, want, mag, torch.float32, 4, "output")
    out.backward(g)
    assert torch.equal(base.grad[..., :3], torch.zeros_like(base.grad[..., :3]))
    assert_within(base.grad[..., 3:], want_grad, mag_grad, torch.float32, 4, "grad t")


def test_inplace_on_grad_leaf_saved_by_another_op_raises_at_backward(device):
    """The leaf's version counter moves, so an op that saved it for its backward still raises
    (Megatron's kernel left it unchanged: that op's gradient was silently wrong)."""
    cos, sin = make_tables(torch.float32, device, seed=29)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=30, device=device).requires_grad_()
    saved = leaf * leaf  # mul saves the leaf for its backward
    out = mm.fused_mla_rope_inplace(leaf, cos, sin, N, R)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved.sum() + out.sum()).backward()


def test_inplace_on_grad_leaf_inference_paths(device):
    """Without autograd (no_grad, or a leaf that does not require grad) the leaf is rotated in
    place and returned itself; the native API keeps autograd's rule and refuses a leaf that
    requires grad."""
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=13, device=device).requires_grad_()
    with torch.no_grad():
        out = mm.fused_mla_rope_inplace(leaf, cos, sin, N, R)
    assert out is leaf
    plain = randn(S, B, H, N + R, dtype=torch.float32, seed=13, device=device)
    assert mm.fused_apply_mla_rope_for_q(plain, cos, sin, N, R) is plain
    assert torch.equal(plain, leaf.detach())
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        mlarope.apply_rope_q(leaf, cos, sin, inplace=True)


def test_inplace_on_grad_leaf_compiled(device):
    """Under ``torch.compile(fullgraph=True)`` the leaf case gives the eager values (written
    into the leaf, its version moved) and the eager gradient; the returned tensor has its own
    storage there (Dynamo cannot keep the alias's autograd edge)."""
    cos, sin = make_tables(torch.float32, device, seed=44)
    x0 = randn(S, B, H, N + R, dtype=torch.float32, seed=45, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=46, device=device)

    def rotate(t):
        return mm.fused_mla_rope_inplace(t, cos, sin, N, R, inverse=True)

    results = []
    for fn in (rotate, torch.compile(rotate, fullgraph=True)):
        leaf = x0.clone().requires_grad_()
        version = leaf._version
        out = fn(leaf)
        out.backward(g)
        assert leaf._version > version
        results.append((leaf.detach(), out.detach(), leaf.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inplace_on_a_non_leaf_compiled(backend, device):
    """The usual Megatron case, an activation (not a leaf) that requires grad, rotated in place
    inside ``torch.compile(fullgraph=True)``, and a view of a leaf: the eager values and
    gradient (the check for a view of a leaf called ``_is_view()``, which Dynamo cannot trace,
    and a view of a leaf then went to the native in-place op; found by review)."""
    torch._dynamo.reset()
    cos, sin = make_tables(torch.float32, device, seed=44)
    x0 = randn(S, B, H, N + R, dtype=torch.float32, seed=45, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=46, device=device)

    def rotate(t):
        return mm.fused_mla_rope_inplace(t * 1, cos, sin, N, R)

    def rotate_a_view_of_the_leaf(t):
        return mm.fused_mla_rope_inplace(t[:, :], cos, sin, N, R)

    for fn in (rotate, rotate_a_view_of_the_leaf):
        results = []
        for run in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
            x = x0.clone().requires_grad_()
            out = run(x)
            out.backward(g)
            results.append((out.detach(), x.detach(), x.grad))
        for eager, compiled in zip(*results, strict=True):
            assert torch.equal(eager, compiled), fn.__name__


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_out_of_place_equals_in_place_bitwise(layout, device):
    """Megatron's test_out_of_place_inverse_rope_preserves_upstream_saved_output compares the
    two with ``atol=0``: the same bits, and the out-of-place input left as it was."""
    cos, sin = make_tables(torch.bfloat16, device, seed=31)
    x = randn(*tokens_shape(layout, 1), H, N + R, dtype=torch.bfloat16, seed=32, device=device)
    before = x.clone()
    cu = cu_arg(layout, device)
    kwargs = dict(cu_seqlens_q=cu, inverse=True, remove_interleaving=True)
    out = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R, **kwargs)
    ref = mm.fused_mla_rope_inplace(x.clone(), cos, sin, N, R, **kwargs)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_inplace_on_tensor_saved_for_backward_raises_at_backward(device):
    """Megatron's kernel silently corrupted the saved tensor; mlarope declares the mutation."""
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=14, device=device).requires_grad_()
    t = leaf * 2.0
    saved = t * t  # mul saves t for its backward
    mm.fused_mla_rope_inplace(t, cos, sin, N, R)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_out_of_place_on_tensor_saved_for_backward_is_safe(device):
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=15, device=device).requires_grad_()
    t = leaf * 2.0
    saved = t * t
    out = mm.fused_mla_rope_out_of_place(t, cos, sin, N, R, inverse=True)
    (saved.sum() + out.sum()).backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def test_inplace_on_a_leaf_under_torch_func_and_forward_ad(device):
    """The in-place functions on a leaf (``_LeafAlias``) under ``torch.func.grad`` and
    forward-mode AD: the out-of-place function's gradient and tangent (torch.func refused a
    Function without ``setup_context``, forward AD one without ``jvp``; found by review)."""
    from torch.autograd import forward_ad as fwad

    cos, sin = make_tables(torch.float32, device, seed=47)
    x = randn(S, B, H, N + R, dtype=torch.float32, seed=48, device=device)
    w = randn(S, B, H, N + R, dtype=torch.float32, seed=49, device=device)
    tangent = randn(S, B, H, N + R, dtype=torch.float32, seed=50, device=device)

    def in_place(t):
        return mm.fused_mla_rope_inplace(t, cos, sin, N, R)

    def out_of_place(t):
        return mm.fused_mla_rope_out_of_place(t, cos, sin, N, R)

    want = torch.func.grad(lambda t: (out_of_place(t) * w).sum())(x)
    got = torch.func.grad(lambda t: (in_place(t) * w).sum())(x.clone())
    assert torch.equal(got, want)
    with fwad.dual_level():
        want = fwad.unpack_dual(out_of_place(fwad.make_dual(x, tangent))).tangent
        leaf = x.clone().requires_grad_()
        got = fwad.unpack_dual(in_place(fwad.make_dual(leaf, tangent))).tangent
    assert torch.equal(got, want)
