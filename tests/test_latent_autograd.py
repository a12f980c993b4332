"""The latent op under every autograd mode (float64 checked numerically: backward,
forward-mode, double backward; ``torch.func``; the kernels' double backward and forward-mode
against the reference's bits; ``vmap``) and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import mlarope
from tests.harness import bitwise_equal, random_tables, reference_backend
from tests.latent_harness import Case, checked, make_grads

FP64_CASES = [
    dict(layout="bshd", tokens=(2, 3)),
    dict(layout="thd", tokens=(7,), cu_seqlens=torch.tensor([0, 2, 6])),
    dict(layout="sbhd", tokens=(3, 2), interleaved=False, interleaved_out=True),
]
CHECK = dict(eps=1e-6, atol=1e-9, rtol=1e-7, fast_mode=True)


def _fp64_fn(spec, weight_dtype=torch.float64):
    spec = dict(spec)
    tokens = spec.pop("tokens")
    cos, sin = random_tables(8, 32, torch.float64, "cpu")
    kw = dict(kv_lora_rank=6, eps=1e-3, **spec)

    def fn(ckv, weight):
        return mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kw)

    ckv = torch.randn(*tokens, 6 + 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, dtype=weight_dtype, requires_grad=True)
    return fn, ckv, weight


@pytest.mark.parametrize("spec", FP64_CASES, ids=["bshd", "thd-cu", "sbhd-layouts"])
def test_every_derivative_fp64(spec):
    """float64 (the reference backend): backward, forward-mode AD, double backward and forward
    over reverse, checked numerically."""
    fn, ckv, weight = _fp64_fn(spec)
    assert gradcheck(fn, (ckv, weight), check_forward_ad=True, **CHECK)
    assert gradgradcheck(fn, (ckv, weight), check_fwd_over_rev=True, check_rev_over_rev=True,
                         **CHECK)  # fmt: skip


def _loss(fn):
    def loss(ckv, weight):
        latent, k_pe = fn(ckv, weight)
        return (latent.sin() * latent).sum() + (k_pe.cos() * k_pe).sum()

    return loss


def test_torch_func_fp64():
    """``torch.func``: grad, vjp, jvp and a Hessian-vector product against autograd's own."""
    fn, ckv, weight = _fp64_fn(FP64_CASES[0])
    ckv, weight = ckv.detach(), weight.detach()
    close = dict(rtol=1e-12, atol=1e-12)
    grads = torch.func.grad(_loss(fn), argnums=(0, 1))(ckv, weight)
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = torch.autograd.grad(_loss(fn)(x, w), (x, w))
    torch.testing.assert_close(grads, want, **close)
    t = (torch.randn_like(ckv), torch.randn_like(weight))
    _, tangents = torch.func.jvp(fn, (ckv, weight), t)
    with torch.autograd.forward_ad.dual_level():
        duals = [
            torch.autograd.forward_ad.make_dual(p, d) for p, d in zip((ckv, weight), t, strict=True)
        ]
        want = [torch.autograd.forward_ad.unpack_dual(o).tangent for o in fn(*duals)]
    torch.testing.assert_close(tangents, tuple(want), **close)
    out, vjp = torch.func.vjp(fn, ckv, weight)
    cot = (torch.randn_like(out[0]), torch.randn_like(out[1]))
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = torch.autograd.grad(fn(x, w), (x, w), cot)
    torch.testing.assert_close(vjp(cot), want, **close)
    _, hvp = torch.func.jvp(torch.func.grad(_loss(fn), argnums=(0, 1)), (ckv, weight), t)
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    g = torch.autograd.grad(_loss(fn)(x, w), (x, w), create_graph=True)
    want = torch.autograd.grad(g, (x, w), t)
    torch.testing.assert_close(hvp, want, **close)


def test_double_backward_and_forward_ad_on_the_kernels(device, monkeypatch):
    """fp32 on the kernels: the gradient with ``create_graph=True`` (it has a graph) and its
    derivative, and the forward-mode tangents, are the reference backend's bits (plain PyTorch
    formulas on both, differentiable to any order; float64 checks them numerically)."""
    case = Case(layout="thd", tokens=(9,), source="ids", dtype=torch.float32, latent=32)
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    v = torch.randn_like(ckv)
    t = (torch.randn_like(ckv), torch.randn_like(weight))

    def derivatives():
        x = ckv.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        outs = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
        dx, dw = torch.autograd.grad(outs, (x, w), (g_latent, g_pe), create_graph=True)
        assert dx.requires_grad and dw.requires_grad
        second = torch.autograd.grad((dx * v).sum() + dw.sum(), (x, w))
        with torch.autograd.forward_ad.dual_level():
            duals = [
                torch.autograd.forward_ad.make_dual(p, d)
                for p, d in zip((ckv, weight), t, strict=True)
            ]
            tangents = [
                torch.autograd.forward_ad.unpack_dual(o).tangent
                for o in mlarope.rmsnorm_rope_latent(*duals, cos, sin, **kwargs)
            ]
        return (dx, dw, *second, *tangents)

    kernels = derivatives()
    reference_backend(monkeypatch, device)
    for got, want in zip(kernels, derivatives(), strict=True):
        assert bitwise_equal(got.detach(), want.detach())


def test_vmap_on_the_kernels_is_a_clear_error(device):
    case = Case(layout="thd", tokens=(4,))
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
    fn = lambda c: mlarope.rmsnorm_rope_latent(c, weight, cos, sin, **kwargs)
    stacked = torch.stack((ckv, ckv))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the reference backend runs vmap")
    with pytest.raises(NotImplementedError, match="cannot run on batched tensors"):
        torch.func.vmap(fn)(stacked)


def test_vmap_on_the_reference(monkeypatch):
    """``torch.func.vmap`` without autograd runs the PyTorch reference on the batched tensors:
    the same bits as one call per sample."""
    reference_backend(monkeypatch, "cpu")
    case = Case(layout="thd", tokens=(4,), dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = checked(case, torch.device("cpu"))
    fn = lambda c: mlarope.rmsnorm_rope_latent(c, weight, cos, sin, **kwargs)
    stacked = torch.stack((ckv, 2 * ckv, -ckv))
    latent, k_pe = torch.func.vmap(fn)(stacked)
    for i, sample in enumerate(stacked):
        want_latent, want_pe = fn(sample)
        assert bitwise_equal(latent[i], want_latent) and bitwise_equal(k_pe[i], want_pe)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_compile_fullgraph(grad, device):
    """``torch.compile(fullgraph=True)`` (``aot_eager`` in the CPU lane, Inductor on the GPU):
    the custom ops, the same bits as eager, forward and backward."""
    case = Case(layout="bshd", tokens=(2, 5), source="ids", dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    def f(x, w, cos, sin, ids):
        return mlarope.rmsnorm_rope_latent(x, w, cos, sin, **{**kwargs, "position_ids": ids})

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    results = []
    for fn in (f, compiled):
        x = ckv.detach().requires_grad_(grad)
        w = weight.detach().requires_grad_(grad)
        outs = fn(x, w, cos, sin, kwargs["position_ids"])
        if grad:
            torch.autograd.backward(outs, (g_latent, g_pe))
            outs = (*outs, x.grad, w.grad)
        results.append(outs)
    for got, want in zip(results[1], results[0], strict=True):
        assert bitwise_equal(got.detach(), want.detach())
