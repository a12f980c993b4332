"""Every autograd mode, compile mode and backend gives the same right answer.

Both ops are linear in their activations, so every derivative is one of the ops again: the
backward of the query op ``R`` is its transpose ``R^T`` (the same kernel, ``transpose=True``),
whose backward is ``R`` again; a tangent goes through ``R`` itself. The key/value op
``F: (kv, k_pe) -> (k, v)`` has the backward ``B: (dk, dv) -> (dkv, dk_pe)``, whose backward is
``F`` on ``(g_dkv, g_dk_pe)``. So:

- in float64 (the PyTorch reference backend) ``gradcheck`` / ``gradgradcheck`` check first and
  second derivatives, forward-mode AD and forward-over-reverse numerically, and the
  ``torch.func`` transforms are compared with autograd through ``mlarope.reference``;
- in fp32 on the kernels (the ``device`` fixture: Triton's interpreter in the CPU lane, CUDA in
  the GPU lane) each derivative of any order is the forward or backward kernel on the incoming
  tensor, bit for bit, and within the error model of the fp64 reference (``tests/errmodel.py``);
- ``torch.compile(fullgraph=True)`` runs in place and out of place, under ``no_grad``,
  ``inference_mode``, grad mode with and without an input that requires grad, on the kernels and
  on the reference backend, with eager's bits and gradients.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
import torch
from torch.autograd import forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck

import mlarope
from mlarope import reference
from tests import kv_harness, q_harness
from tests.errmodel import assert_close_elementwise
from tests.harness import bitwise_equal, random_tables

R = 32
P = 24

# ---------------------------------------------------------------------------------------------
# float64, the reference backend: numerical checks of every derivative
# ---------------------------------------------------------------------------------------------

FP64_CASES = [
    # (layout, token dims, position kwargs, interleaved, interleaved_out, inverse)
    ("thd", (9,), lambda: {"cu_seqlens": torch.tensor([0, 2, 2, 3, 7])}, True, False, False),
    ("sbhd", (4, 2), lambda: {"cp_size": 2, "cp_rank": 1}, False, True, True),
    ("bshd", (2, 4), lambda: {"position_ids": torch.tensor([[3, 0, 1, 7], [5, 5, 2, 0]])},
     True, True, False),
]  # fmt: skip
FP64_IDS = ["thd-cu-pad", "sbhd-cp2-layouts-inverse", "bshd-ids"]


def fp64_tables(rows: int = P) -> tuple[torch.Tensor, torch.Tensor]:
    """General tables: the halves differ and the magnitudes are not 1."""
    gen = torch.Generator().manual_seed(5)
    theta = 6.3 * torch.rand(rows, R, generator=gen, dtype=torch.float64)
    scale = 1.0 + 0.5 * torch.rand(rows, R, generator=gen, dtype=torch.float64)
    return theta.cos() * scale, theta.sin() * scale


def _q_fn(case, inplace: bool):
    layout, _, kwargs, interleaved, interleaved_out, inverse = case
    cos, sin = fp64_tables()
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out,
              inverse=inverse, **kwargs())  # fmt: skip

    def fn(x):
        return mlarope.apply_rope_q(x.clone() if inplace else x, cos, sin, inplace=inplace, **kw)

    def ref(x):
        return reference.apply_rope_q(x, cos, sin, **kw)

    return fn, ref


def _kv_fn(case, copy_v: bool):
    layout, _, kwargs, interleaved, interleaved_out, _ = case
    cos, sin = fp64_tables()
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out, **kwargs())

    def fn(kv, k_pe):
        return mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=2, copy_v=copy_v, **kw)

    def ref(kv, k_pe):
        return reference.apply_rope_kv(kv, k_pe, cos, sin, k_dim=2, **kw)

    return fn, ref


# gradcheck's fast mode projects the Jacobian on random vectors (a wrong derivative fails with
# probability 1); the full Jacobians would cost seconds per case.
CHECK = dict(eps=1e-6, atol=1e-9, rtol=1e-7, fast_mode=True)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("case", FP64_CASES, ids=FP64_IDS)
def test_q_every_derivative_fp64(case, inplace):
    """Backward, forward-mode AD, double backward (reverse over reverse) and forward over
    reverse, checked numerically, in place and out of place. (Before: the backward was not
    differentiable and there was no forward-mode AD.)"""
    fn, _ = _q_fn(case, inplace)
    q = torch.randn(*case[1], 2, 3 + R, dtype=torch.float64, requires_grad=True)
    assert gradcheck(fn, (q,), check_forward_ad=True, **CHECK)
    assert gradgradcheck(fn, (q,), check_fwd_over_rev=True, check_rev_over_rev=True, **CHECK)


@pytest.mark.parametrize("copy_v", [True, False], ids=["copy_v", "view_v"])
@pytest.mark.parametrize("case", FP64_CASES, ids=FP64_IDS)
def test_kv_every_derivative_fp64(case, copy_v):
    fn, _ = _kv_fn(case, copy_v)
    kv = torch.randn(*case[1], 3, 2 + 3, dtype=torch.float64, requires_grad=True)
    k_pe = torch.randn(*case[1], 1, R, dtype=torch.float64, requires_grad=True)
    assert gradcheck(fn, (kv, k_pe), check_forward_ad=True, **CHECK)
    assert gradgradcheck(fn, (kv, k_pe), check_fwd_over_rev=True, check_rev_over_rev=True, **CHECK)


def _loss(f):
    """A non-linear scalar of the op's output(s), so the Hessian is not zero."""

    def loss(*args):
        out = f(*args)
        out = torch.cat(out, dim=-1) if isinstance(out, tuple) else out
        return (out.sin() * out).sum()

    return loss


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_q_torch_func_fp64(inplace):
    """``torch.func``: jvp, grad, vjp and the forward-over-reverse Hessian-vector product, against
    the same transforms of ``mlarope.reference`` (plain PyTorch ops)."""
    fn, ref = _q_fn(FP64_CASES[0], inplace)
    q = torch.randn(9, 2, 3 + R, dtype=torch.float64)
    t = torch.randn_like(q)
    close = dict(rtol=1e-12, atol=1e-12)
    out, tangent = torch.func.jvp(fn, (q,), (t,))
    torch.testing.assert_close(tangent, ref(t), **close)
    torch.testing.assert_close(out, ref(q), **close)
    grad = torch.func.grad(_loss(fn))(q)
    torch.testing.assert_close(grad, torch.func.grad(_loss(ref))(q), **close)
    out, vjp = torch.func.vjp(fn, q)
    (back,) = vjp(t)
    torch.testing.assert_close(back, torch.func.vjp(ref, q)[1](t)[0], **close)
    _, hvp = torch.func.jvp(torch.func.grad(_loss(fn)), (q,), (t,))
    _, hvp_ref = torch.func.jvp(torch.func.grad(_loss(ref)), (q,), (t,))
    torch.testing.assert_close(hvp, hvp_ref, **close)


@pytest.mark.parametrize("copy_v", [True, False], ids=["copy_v", "view_v"])
def test_kv_torch_func_fp64(copy_v):
    fn, ref = _kv_fn(FP64_CASES[0], copy_v)
    kv = torch.randn(9, 3, 5, dtype=torch.float64)
    k_pe = torch.randn(9, 1, R, dtype=torch.float64)
    tangents = (torch.randn_like(kv), torch.randn_like(k_pe))
    close = dict(rtol=1e-12, atol=1e-12)
    _, tangent = torch.func.jvp(fn, (kv, k_pe), tangents)
    torch.testing.assert_close(tangent, ref(*tangents), **close)
    grads = torch.func.grad(_loss(fn), argnums=(0, 1))(kv, k_pe)
    torch.testing.assert_close(grads, torch.func.grad(_loss(ref), argnums=(0, 1))(kv, k_pe))
    _, hvp = torch.func.jvp(torch.func.grad(_loss(fn), argnums=(0, 1)), (kv, k_pe), tangents)
    _, hvp_ref = torch.func.jvp(torch.func.grad(_loss(ref), argnums=(0, 1)), (kv, k_pe), tangents)
    torch.testing.assert_close(hvp, hvp_ref, **close)


# ---------------------------------------------------------------------------------------------
# fp32 on the kernels: each derivative is a kernel, bit for bit, and right against fp64
# ---------------------------------------------------------------------------------------------

Q_CASE = q_harness.Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
Q_IDS_CASE = q_harness.Case(layout="bshd", tokens=(2, 5), source="ids", dtype=torch.float32,
                            interleaved=False, interleaved_out=True, inverse=True)  # fmt: skip


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except NaN payloads: a NaN row (an out-of-range position) that went through
    an arithmetic op on the GPU (the ``leaf * 1`` in front of an in-place call) comes back as
    the canonical NaN, not the kernel's."""
    a, b = a.detach(), b.detach()
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return bitwise_equal(a.masked_fill(nan, 0.0), b.masked_fill(nan, 0.0))


def q_check(x, out, cos2d, sin2d, positions, case, *, transpose: bool, what: str) -> None:
    """``out`` is the kernel's ``R(x)`` (or ``R^T(x)``) bit for bit, and within the error model
    of the fp64 reference."""
    kernel = q_harness.launch(x.detach(), cos2d, sin2d, positions, case, transpose=transpose)
    assert same_bits(out, kernel), f"{what}: not the kernel's bits"
    truth, tol = q_harness.truth_and_tolerance(x.detach(), cos2d, sin2d, positions, case, transpose)
    assert_close_elementwise(out.detach(), truth, tol, what)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("case", [Q_CASE, Q_IDS_CASE], ids=["thd-cu", "bshd-ids-layouts"])
def test_q_double_backward_on_the_kernels(case, inplace, device):
    """``create_graph=True``: the gradient has a graph (before: ``requires_grad`` False), and its
    derivatives to the third order are the forward and backward kernels."""
    q0, cos, sin, kwargs = q_harness.make_inputs(case, device)
    _, cos2d, sin2d, positions = q_harness.host_checked(q0, cos, sin, case, kwargs)
    flags = dict(interleaved=case.interleaved, interleaved_out=case.interleaved_out,
                 inverse=case.inverse, inplace=inplace, **kwargs)  # fmt: skip
    leaf = q0.clone().requires_grad_(True)
    out = mlarope.apply_rope_q(leaf * 1 if inplace else leaf, cos, sin, **flags)
    v = torch.randn(q0.shape, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(out, leaf, v, create_graph=True)
    assert g.requires_grad, "the gradient must carry a graph"
    q_check(v, g, cos2d, sin2d, positions, case, transpose=True, what="R^T v")
    u = torch.randn(q0.shape, device=device, requires_grad=True)
    (h,) = torch.autograd.grad(g, v, u, create_graph=True)
    q_check(u, h, cos2d, sin2d, positions, case, transpose=False, what="d(R^T v)/dv . u")
    w = torch.randn(q0.shape, device=device)
    (h3,) = torch.autograd.grad(h, u, w)
    q_check(w, h3, cos2d, sin2d, positions, case, transpose=True, what="third order")

    # The form: a non-linear loss; its Hessian-vector product is R^T (2 R u).
    leaf = q0.clone().requires_grad_(True)
    out = mlarope.apply_rope_q(leaf * 1 if inplace else leaf, cos, sin, **flags)
    (g,) = torch.autograd.grad((out * out).sum(), leaf, create_graph=True)
    assert g.requires_grad
    u = torch.randn(q0.shape, device=device)
    (hvp,) = torch.autograd.grad(g, leaf, u)
    r_u = q_harness.launch(u, cos2d, sin2d, positions, case, transpose=False)
    expected = q_harness.launch(2 * r_u, cos2d, sin2d, positions, case, transpose=True)
    assert same_bits(hvp, expected), "the Hessian-vector product is R^T (2 R u)"


@pytest.mark.parametrize("api", ["forward_ad", "torch.func.jvp"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("case", [Q_CASE, Q_IDS_CASE], ids=["thd-cu", "bshd-ids-layouts"])
def test_q_forward_ad_on_the_kernels(case, inplace, api, device):
    """The tangent is rotated like the primal (before: ``None``). In place, the tangent is
    rotated in place too, as PyTorch's in-place ops do."""
    q0, cos, sin, kwargs = q_harness.make_inputs(case, device)
    _, cos2d, sin2d, positions = q_harness.host_checked(q0, cos, sin, case, kwargs)
    flags = dict(interleaved=case.interleaved, interleaved_out=case.interleaved_out,
                 inverse=case.inverse, inplace=inplace, **kwargs)  # fmt: skip
    t = torch.randn(q0.shape, device=device)

    def f(x):
        return mlarope.apply_rope_q(x.clone() if inplace else x, cos, sin, **flags)

    if api == "forward_ad":
        with fwAD.dual_level():
            out = f(fwAD.make_dual(q0, t))
            primal, tangent = fwAD.unpack_dual(out)
    else:
        primal, tangent = torch.func.jvp(f, (q0,), (t,))
    assert tangent is not None
    q_check(q0, primal, cos2d, sin2d, positions, case, transpose=False, what="primal")
    q_check(t, tangent, cos2d, sin2d, positions, case, transpose=False, what="tangent")


KV_CASE = kv_harness.Case(layout="thd", tokens=(16,), source="cu", cu=kv_harness.CU_EDGES,
                          k_dim=16, v_dim=8, rope=R, dtype=torch.float32, table_rows=P)  # fmt: skip
KV_IDS_CASE = kv_harness.Case(layout="sbhd", tokens=(3, 2), source="ids", k_dim=16, v_dim=8,
                              rope=R, dtype=torch.float32, interleaved=False,
                              interleaved_out=True, table_rows=P)  # fmt: skip


def kv_call(inp: kv_harness.Inputs, case: kv_harness.Case, kv, k_pe, copy_v: bool):
    return mlarope.apply_rope_kv(
        kv, k_pe, inp.cos, inp.sin, k_dim=case.k_dim, interleaved=case.interleaved,
        interleaved_out=case.interleaved_out, copy_v=copy_v, **inp.kwargs,
    )  # fmt: skip


def kv_check_forward(kv, k_pe, k, v, checked, case, what):
    """``(k, v)`` is the forward kernel on ``(kv, k_pe)``, bit for bit, and within the error
    model of the fp64 reference."""
    _, _, cos2d, sin2d, positions = checked
    k_pe = k_pe.detach().reshape(*kv.shape[:-2], case.rope)
    want_k, want_v = kv_harness.launch_forward(
        kv.detach(), k_pe, cos2d, sin2d, positions, replace(case, copy_v=True)
    )
    assert same_bits(k, want_k) and same_bits(v, want_v), f"{what}: not the kernel's bits"
    kv_harness.check_forward(
        kv.detach(), k_pe, k.detach(), v.detach(), cos2d, sin2d, positions, case
    )


@pytest.mark.parametrize("copy_v", [True, False], ids=["copy_v", "view_v"])
@pytest.mark.parametrize("case", [KV_CASE, KV_IDS_CASE], ids=["thd-cu", "sbhd-ids-layouts"])
def test_kv_double_backward_on_the_kernels(case, copy_v, device):
    """The backward ``B`` has a graph; its derivative is the forward kernel on the incoming
    ``(g_dkv, g_dk_pe)`` (before: "does not require grad")."""
    inp = kv_harness.make_inputs(case, device)
    checked = kv_harness.host_checked(inp, case)
    _, _, cos2d, sin2d, positions = checked
    kv = inp.kv.detach().clone().requires_grad_(True)
    k_pe = inp.k_pe.detach().clone().requires_grad_(True)
    k, v = kv_call(inp, case, kv, k_pe, copy_v)
    gk = torch.randn(k.shape, device=device, requires_grad=True)
    gv = torch.randn(v.shape, device=device, requires_grad=True)
    dkv, dk_pe = torch.autograd.grad((k, v), (kv, k_pe), (gk, gv), create_graph=True)
    assert dkv.requires_grad and dk_pe.requires_grad, "the gradients must carry a graph"
    want_dkv, want_pe = kv_harness.launch_backward(
        gk.detach(), gv.detach(), cos2d, sin2d, positions, case
    )
    assert same_bits(dkv, want_dkv) and same_bits(dk_pe.reshape(want_pe.shape), want_pe)
    kv_harness.check_backward(gk.detach(), gv.detach(), dkv.detach(), dk_pe.detach().reshape(
        want_pe.shape), cos2d, sin2d, positions, case)  # fmt: skip
    u_kv = torch.randn(kv.shape, device=device)
    u_pe = torch.randn(k_pe.shape, device=device)
    hk, hv = torch.autograd.grad((dkv, dk_pe), (gk, gv), (u_kv, u_pe))
    kv_check_forward(u_kv, u_pe, hk, hv, checked, case, "d(dkv, dk_pe)/d(dk, dv)")


@pytest.mark.parametrize("tangents", ["both", "k_pe", "kv"])
@pytest.mark.parametrize("api", ["forward_ad", "torch.func.jvp"])
@pytest.mark.parametrize("copy_v", [True, False], ids=["copy_v", "view_v"])
def test_kv_forward_ad_on_the_kernels(copy_v, api, tangents, device):
    """The tangent of ``(k, v)`` is the forward op on the tangents of ``(kv, k_pe)`` (zero where
    an input has none); a ``v`` that is a view of a ``kv`` without a tangent has none either,
    and ``kv`` is given none."""
    case = KV_CASE
    inp = kv_harness.make_inputs(case, device)
    checked = kv_harness.host_checked(inp, case)
    t_kv = torch.randn(inp.kv.shape, device=device) if tangents != "k_pe" else None
    t_pe = torch.randn(inp.k_pe.shape, device=device) if tangents != "kv" else None
    kv0, k_pe0 = inp.kv.detach(), inp.k_pe.detach()
    if api == "forward_ad":
        with fwAD.dual_level():
            kv = kv0 if t_kv is None else fwAD.make_dual(kv0, t_kv)
            k_pe = k_pe0 if t_pe is None else fwAD.make_dual(k_pe0, t_pe)
            k, v = kv_call(inp, case, kv, k_pe, copy_v)
            (k, tk), (v, tv) = fwAD.unpack_dual(k), fwAD.unpack_dual(v)
            if t_kv is None:
                assert fwAD.unpack_dual(kv0).tangent is None, "kv was given a tangent"
    else:
        primals = tuple(x for x, t in ((kv0, t_kv), (k_pe0, t_pe)) if t is not None)
        given = tuple(t for t in (t_kv, t_pe) if t is not None)

        def f(*xs):
            xs = list(xs)
            kv = xs.pop(0) if t_kv is not None else kv0
            k_pe = xs.pop(0) if t_pe is not None else k_pe0
            return kv_call(inp, case, kv, k_pe, copy_v)

        (k, v), (tk, tv) = torch.func.jvp(f, primals, given)
    kv_check_forward(kv0, k_pe0, k, v, checked, case, "primal")
    t_kv = torch.zeros_like(kv0) if t_kv is None else t_kv
    t_pe = torch.zeros_like(k_pe0) if t_pe is None else t_pe
    if tv is None:
        assert api == "forward_ad" and tangents == "k_pe" and not copy_v
        tv = torch.zeros_like(v)
    kv_check_forward(t_kv, t_pe, tk, tv, checked, case, "tangent")


# ---------------------------------------------------------------------------------------------
# torch.compile: the matrix
# ---------------------------------------------------------------------------------------------

GRAD_MODES = ["no_grad", "inference_mode", "grad_mode_input_without_grad", "grad"]


def _mode(mode: str):
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("op", ["q", "q_inplace", "kv"])
def test_compile_matrix(op, mode, backend, device, monkeypatch):
    """``torch.compile(fullgraph=True)``: the same bits as eager, and the same gradients. In
    place without autograd the compiled call mutates its input as eager does. (Before: an
    in-place call that needs no gradient raised ``Unsupported: ... mark_dirty`` on the CPU.)
    The CPU lane compiles with ``aot_eager`` (Dynamo and AOTAutograd, no C++ toolchain), the GPU
    lane with Inductor; ``test_compile_inductor_on_the_cpu`` covers Inductor on the CPU."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # fp32 CPU tensors: the PyTorch reference
        device = torch.device("cpu")
    run_compiled(op, mode, device, "inductor" if device.type == "cuda" else "aot_eager")


@pytest.mark.parametrize(("op", "mode"), [("q_inplace", "no_grad"), ("q_inplace", "grad")])
def test_compile_inductor_on_the_cpu(op, mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    run_compiled(op, mode, torch.device("cpu"), "inductor")


def run_compiled(op: str, mode: str, device: torch.device, compile_backend: str) -> None:
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=device)
    cos, sin = random_tables(16, R, torch.float32, device)
    where = dict(layout="thd", cu_seqlens=cu)
    n_tokens, heads = 9, 3
    needs_grad = mode == "grad"

    def f(x, k_pe):
        if op == "q":
            return (mlarope.apply_rope_q(x, cos, sin, **where),)
        if op == "q_inplace":
            y = x * 1 if needs_grad else x  # without autograd: the input itself, mutated
            mlarope.apply_rope_q(y, cos, sin, inplace=True, **where)
            return (y,)
        return mlarope.apply_rope_kv(x, k_pe, cos, sin, k_dim=8, **where)

    width = 8 + (R if op != "kv" else 5)
    x0 = torch.randn(n_tokens, heads, width, device=device)
    k_pe0 = torch.randn(n_tokens, 1, R, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)
    results = []
    for fn in (f, compiled):
        with _mode(mode):
            x, k_pe = x0.clone(), k_pe0.clone()  # inference tensors under inference_mode
            if needs_grad:
                x.requires_grad_(True)
                k_pe.requires_grad_(True)
            outs = fn(x, k_pe)
            grads = ()
            if needs_grad:
                gen = torch.Generator(device=device).manual_seed(1)
                upstream = [torch.randn(o.shape, device=device, generator=gen) for o in outs]
                inputs = (x, k_pe) if op == "kv" else (x,)
                grads = torch.autograd.grad(outs, inputs, upstream)
        results.append((outs, grads, x))
    (eager, eager_grads, x_eager), (got, got_grads, x_got) = results
    assert all(same_bits(a, b) for a, b in zip(eager, got, strict=True)), "outputs"
    assert all(same_bits(a, b) for a, b in zip(eager_grads, got_grads, strict=True)), "grads"
    assert same_bits(x_eager, x_got), "the input after the call"
    if op == "q_inplace" and not needs_grad:
        assert not same_bits(x_got, x0), "the compiled in-place call rotated its input"


def test_vmap_on_the_kernels_is_a_clear_error(device):
    """``torch.func.vmap`` (and ``jacrev``, which vmaps the backward) cannot run the kernels,
    whose batched tensors have no memory: a ``NotImplementedError`` that says so (before: "Cannot
    access data pointer of Tensor that doesn't have storage"). The reference backend runs them
    (``tests/test_plans.py::test_vmap_takes_the_pipeline``)."""
    cos, sin = random_tables(8, R, torch.float32, device)
    q = torch.randn(2, 4, 1, 8 + R, device=device)
    with pytest.raises(NotImplementedError, match=r"batched tensors: under torch\.func\.vmap"):
        torch.func.vmap(lambda x: mlarope.apply_rope_q(x, cos, sin, layout="thd"))(q)
    with pytest.raises(NotImplementedError, match=r"batched tensors: under torch\.func\.vmap"):
        torch.func.jacrev(lambda x: mlarope.apply_rope_q(x, cos, sin, layout="thd"))(q[0])


@pytest.mark.parametrize("interleaved_out", [False, True])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_batched_gradients(inplace_backward, interleaved_out, device, monkeypatch):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (``gradcheck``'s batched check): the
    reference backend gives each gradient's rotation (it crashed the process with
    ``inplace_backward=True``, writing a gradient that has no memory, and raised on
    interleaved pairs, whose ``flatten`` legacy vmap lacks; found by review); the kernels say
    they cannot (``Cannot access data pointer`` before)."""
    cos, sin = random_tables(8, R, torch.float32, device)
    x = torch.randn(4, 2, 8 + R, device=device, requires_grad=True)
    grads = torch.randn(3, 4, 2, 8 + R, device=device)
    kw = dict(layout="thd", inplace_backward=inplace_backward, interleaved_out=interleaved_out)

    def batched():
        out = mlarope.apply_rope_q(x, cos, sin, **kw)
        return torch.autograd.grad(out, x, grads, is_grads_batched=True)[0]

    if device.type == "cpu":
        with monkeypatch.context() as m:
            m.setenv("TRITON_INTERPRET", "0")
            got = batched()
            for i in range(3):
                out = mlarope.apply_rope_q(x, cos, sin, **kw)
                one = torch.autograd.grad(out, x, grads[i].clone())[0]
                assert torch.equal(got[i], one), i
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(NotImplementedError, match="is_grads_batched=True"):
            batched()


def test_vmap_in_place_on_the_reference(monkeypatch):
    """``torch.func.vmap`` over an in-place call on the reference backend rotates each sample
    as the out-of-place call does (writing through ``.data``, which vmap forbids, broke it;
    found by review)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = random_tables(8, R, torch.float32, "cpu")
    y = torch.randn(3, 4, 2, 8 + R)
    got = torch.func.vmap(lambda t: mlarope.apply_rope_q(t, cos, sin, layout="thd", inplace=True))(
        y.clone()
    )
    want = torch.stack([mlarope.apply_rope_q(t, cos, sin, layout="thd") for t in y])
    assert torch.equal(got, want)
