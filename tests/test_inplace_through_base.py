"""In-place query calls on a view that reshapes its whole base (Megatron-Core's
``linear(x).view(S, B, H, D)``): the base is marked dirty, not the view, so the backward makes
no ``CopySlices`` copies of the gradient (``autograd.rotates_whole_base``). Values, gradients,
version counters and the saved-tensor check as for any other in-place call."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mlarope
from mlarope import autograd
from mlarope.compat import megatron

S, B, H, N, R = 5, 2, 3, 8, 32
COPIES = {"copy_", "clone", "new_zeros", "zeros_like", "new_empty_strided", "_to_copy"}


class FullSizeCopies(TorchDispatchMode):
    """Counts the ops that copy or fill a tensor of ``numel`` elements (the query's gradient)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPIES and isinstance(out, torch.Tensor):
            self.count += out.numel() == self.numel
        return out


def _layer(device, layout: str):
    """``x -> linear -> view -> rotate q in place -> sum of squares``, as Megatron's MLA."""
    gen = torch.Generator().manual_seed(0)
    tokens = (S, B) if layout == "sbhd" else (S * B,)
    x = torch.randn(*tokens, 16, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(H * (N + R), 16, generator=gen).to(device).requires_grad_(True)
    cos, sin = (torch.randn(S * B + 1, R, generator=gen).to(device) for _ in range(2))
    kwargs = {"layout": layout}
    if layout == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, S * B], device=device)
    return x, w, cos, sin, kwargs, tokens


def _step(x, w, cos, sin, kwargs, tokens, view: bool, api: str = "core"):
    q = torch.nn.functional.linear(x, w)
    q = q.view(*tokens, H, N + R) if view else q.reshape(*tokens, H, N + R).clone()
    if api == "compat":  # Megatron-Core's call: query = fused_apply_mla_rope_for_q(q, ...)
        return megatron.fused_apply_mla_rope_for_q(
            q, cos[:, None, None], sin[:, None, None], N, R, kwargs.get("cu_seqlens")
        )  # fmt: skip
    out = mlarope.apply_rope_q(q, cos, sin, inplace=True, **kwargs)
    assert out is q
    return q


# Full-size copies of the gradient a backward makes beyond those of a query that is its own
# tensor. Before: 6 for both (a CopySlices node, then the view's as_strided history). The core
# op returns ``q`` itself, whose history autograd regenerates as an as_strided view of the
# base (a zero fill and a copy); the Megatron function returns a new view of the base.
EXTRA_COPIES = {"core": 2, "compat": 0}


@pytest.mark.parametrize("api", ["core", "compat"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_same_values_and_gradients_without_copies(device, layout, api):
    x, w, cos, sin, kwargs, tokens = _layer(device, layout)
    g = torch.randn(*tokens, H, N + R, generator=torch.Generator().manual_seed(1)).to(device)
    want_q = _step(x, w, cos, sin, kwargs, tokens, view=False, api=api)
    # A query that is its own tensor: no rebasing. What its backward copies (the interpreter's
    # launches copy their arguments) is what the view's may copy.
    with FullSizeCopies(want_q.numel()) as own:
        want = torch.autograd.grad(want_q, (x, w), g)
    for call in range(3):  # the first call records a launch plan, the later ones replay it
        q = _step(x, w, cos, sin, kwargs, tokens, view=True, api=api)
        assert torch.equal(q, want_q), f"call {call}: values"
        with FullSizeCopies(q.numel()) as copies:
            got = torch.autograd.grad(q, (x, w), g)
        assert copies.count == own.count + EXTRA_COPIES[api], (
            f"call {call}: {copies.count} copies of the gradient, {own.count} without the view"
        )
        for a, b, name in zip(got, want, ("x", "w"), strict=True):
            assert torch.equal(a, b), f"call {call}: gradient of {name}"


def test_the_view_takes_the_new_history(device):
    """A later use of the view, or of the base, differentiates through the rotation."""
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    base = torch.nn.functional.linear(x, w)
    q = base.view(*tokens, H, N + R)
    mlarope.apply_rope_q(q, cos, sin, inplace=True, **kwargs)
    (gx_view,) = torch.autograd.grad((q * 3).sum() + base.sum(), (x,))
    copy = torch.nn.functional.linear(x, w).reshape(*tokens, H, N + R).clone()
    mlarope.apply_rope_q(copy, cos, sin, inplace=True, **kwargs)
    (want,) = torch.autograd.grad((copy * 3).sum() + copy.sum(), (x,))
    torch.testing.assert_close(gx_view, want, rtol=1e-5, atol=1e-5)


def test_an_op_that_saved_the_view_raises(device):
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    q = torch.nn.functional.linear(x, w).view(*tokens, H, N + R)
    before = q._version
    y = q * q  # saves q
    mlarope.apply_rope_q(q, cos, sin, inplace=True, **kwargs)
    assert q._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_matches(device):
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    grads = []
    for view in (True, True, False):  # the second call replays the first one's launch plan
        q = _step(x, w, cos, sin, kwargs, tokens, view=view)
        (gx,) = torch.autograd.grad((q**2).sum(), (x,), create_graph=True)
        (gw,) = torch.autograd.grad(gx.sum(), (w,))
        grads.append(gw)
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[2])


def test_only_whole_contiguous_views_of_non_leaves():
    base = torch.randn(4, 6, requires_grad=True) * 1
    assert autograd.rotates_whole_base(base.view(4, 2, 3))
    assert not autograd.rotates_whole_base(base)  # not a view
    assert not autograd.rotates_whole_base(base[:2].view(2, 2, 3))  # part of it
    assert not autograd.rotates_whole_base(base.t().reshape(6, 2, 2)[..., :2])
    leaf = torch.randn(4, 6, requires_grad=True)
    assert not autograd.rotates_whole_base(leaf.view(4, 2, 3))  # the leaf path
    with torch.no_grad():
        assert not autograd.rotates_whole_base(base.view(4, 2, 3))


# ------------------------------------------------------------- found by review (each failed)
def test_a_view_made_inside_a_custom_function_raises_as_pytorch_does(device):
    """Its custom backward (or a module's full backward hook) must not be skipped: PyTorch
    refuses the in-place write, through the compat function too."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view(x.shape)

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x, w, cos, sin, _, tokens = _layer(device, "sbhd")
    q = Twice.apply(torch.nn.functional.linear(x, w)).view(*tokens, H, N + R)
    with pytest.raises(RuntimeError, match="custom Function"):
        megatron.fused_apply_mla_rope_for_q(q, cos[:, None, None], sin[:, None, None], N, R)
    assert not autograd.rotates_whole_base(q)
    parts = torch.nn.functional.linear(x, w).view(*tokens, H, N + R).unbind(0)
    assert not autograd.rotates_whole_base(parts[0])  # one of several outputs


@pytest.mark.parametrize("api", ["core", "compat"])
def test_a_table_changed_before_the_backward_raises(device, api):
    """The record's tensors are saved for the backward, as every other path saves them."""
    x, w, cos, sin, _, tokens = _layer(device, "thd")
    for _ in range(2):  # the first call records a launch plan, the second replays it
        positions, table = torch.arange(S * B, device=device), cos.clone()
        q = torch.nn.functional.linear(x, w).view(*tokens, H, N + R)
        if api == "core":
            mlarope.apply_rope_q(q, table, sin, layout="thd", position_ids=positions, inplace=True)
            changed = positions
        else:
            cu = torch.tensor([0, S * B], device=device)
            q = megatron.fused_apply_mla_rope_for_q(
                q, table[:, None, None], sin[:, None, None], N, R, cu
            )  # fmt: skip
            changed = table
        loss = q.square().sum()
        with torch.no_grad():
            changed.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, (x,))


def test_a_hook_on_the_returned_query(device):
    """Registering a hook on ``q`` right after the call (its history then stale) crashed torch
    (a segmentation fault in torch's own ``register_hook`` on such a view)."""
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    seen = []
    for _ in range(2):
        q = _step(x, w, cos, sin, kwargs, tokens, view=True)
        q.register_hook(lambda g: seen.append(g.shape))
        q.sum().backward()
    assert seen == [q.shape, q.shape]


def test_inplace_backward_does_not_rotate_a_shared_gradient(device):
    """The base's gradient reaches the rotation as it is; where the base also feeds an add,
    that tensor is the other operand's gradient too, so it is rotated out of place."""
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    other = torch.randn(*tokens, H * (N + R), device=device, requires_grad=True)
    base = torch.nn.functional.linear(x, w)
    q = base.view(*tokens, H, N + R)
    mlarope.apply_rope_q(q, cos, sin, inplace=True, inplace_backward=True, **kwargs)
    g = torch.randn(*tokens, H * (N + R), device=device)
    g0 = g.clone()
    _, g_other = torch.autograd.grad(base + other, (x, other), g)
    assert torch.equal(g_other, g0) and torch.equal(g, g0)


def test_transforms_and_compile_take_the_view_path(device):
    """torch.func, forward-mode AD and torch.compile mark the view itself dirty (the path
    before): the same gradients as for a query that is its own tensor."""
    x, w, cos, sin, kwargs, tokens = _layer(device, "sbhd")
    w = w.detach()

    def loss(x, own: bool = False):
        q = torch.nn.functional.linear(x, w).view(*tokens, H, N + R)
        q = q.clone() if own else q
        return mlarope.apply_rope_q(q, cos, sin, inplace=True, **kwargs).square().sum()

    x0 = x.detach()
    want = torch.func.grad(lambda x: loss(x, own=True))(x0)
    assert torch.equal(torch.func.grad(loss)(x0), want)
    tangent = torch.randn_like(x0)
    with torch.autograd.forward_ad.dual_level():
        jvp = torch.autograd.forward_ad.unpack_dual(
            loss(torch.autograd.forward_ad.make_dual(x0, tangent))
        ).tangent
    torch.testing.assert_close(jvp, (want * tangent).sum(), rtol=1e-5, atol=1e-5)
    xc = x0.clone().requires_grad_(True)
    torch.compile(loss, backend="aot_eager", fullgraph=True)(xc).backward()
    assert torch.equal(xc.grad, want)
