"""``mlarope.apply_rope_kv``, eager and compiled, gives the launchers' bits
(``tests/kv_harness.py``): without autograd, with autograd (``kv.grad`` and ``k_pe.grad`` are
the backward launcher's ``dkv`` and ``dk_pe``), with ``copy_v=False`` (``v`` a view of ``kv``)
and under ``torch.compile(fullgraph=True)``. Every derivative and compile mode is in
``tests/test_autograd.py``.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from tests.harness import bitwise_equal
from tests.kv_harness import (
    CU_EDGES,
    Case,
    Inputs,
    assert_untouched,
    case_id,
    host_checked,
    launch_backward,
    launch_forward,
    make_inputs,
    make_upstream_grads,
    snapshot,
)

API_CASES = [
    Case(layout="sbhd", tokens=(4, 2), copy_v=True, pe_form="1R"),
    Case(layout="sbhd", tokens=(4, 2), copy_v=False, pe_form="R", view="fused"),
    Case(layout="thd", tokens=(16,), source="cu", cu=CU_EDGES, copy_v=False, pe_form="1R"),
    Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        copy_v=True,
        pe_form="R",
        interleaved=False,
        interleaved_out=True,
    ),
    Case(layout="bshd", tokens=(2, 4), source="ids", copy_v=False, dtype=torch.float16),
]


def api_call(inp: Inputs, case: Case, kv, k_pe):
    """``apply_rope_kv`` on ``kv``, ``k_pe`` with the case's flags and ``inp``'s tables and
    position source -> (k, v)."""
    return mlarope.apply_rope_kv(
        kv,
        k_pe,
        inp.cos,
        inp.sin,
        k_dim=case.k_dim,
        interleaved=case.interleaved,
        interleaved_out=case.interleaved_out,
        copy_v=case.copy_v,
        **inp.kwargs,
    )


@pytest.mark.parametrize("case", API_CASES, ids=case_id)
def test_public_api_and_autograd_match_launchers(case, device):
    """``apply_rope_kv`` (no grad, then with autograd) returns the launchers' bits, and
    ``.backward()`` leaves the backward launcher's ``dkv``/``dk_pe`` in ``kv.grad``/``k_pe.grad``.
    With ``copy_v=False``, ``v`` is the view ``kv[..., K:]`` and gradients still flow."""
    inp = make_inputs(case, device)
    kv_n, pe_n, cos2d, sin2d, positions = host_checked(inp, case)
    k_ref, v_ref = launch_forward(kv_n, pe_n, cos2d, sin2d, positions, case)
    dk, dv, _ = make_upstream_grads(kv_n, case)
    dkv_ref, dpe_ref = launch_backward(dk, dv, cos2d, sin2d, positions, case)
    before = snapshot(inp.owners)

    k, v = api_call(inp, case, inp.kv, inp.k_pe)  # no autograd
    assert bitwise_equal(k, k_ref)
    if case.copy_v:
        assert bitwise_equal(v, v_ref) and v.is_contiguous()
    else:
        assert v.data_ptr() == inp.kv[..., case.k_dim :].data_ptr()
        assert v.shape == (*inp.kv.shape[:-1], case.v_dim) and v.stride() == inp.kv.stride()

    kv = inp.kv.detach().requires_grad_(True)  # a leaf sharing the (maybe strided) storage
    k_pe = inp.k_pe.detach().requires_grad_(True)
    k, v = api_call(inp, case, kv, k_pe)
    assert bitwise_equal(k.detach(), k_ref)
    if case.copy_v:
        assert bitwise_equal(v.detach(), v_ref)
    else:
        assert v.data_ptr() == kv[..., case.k_dim :].data_ptr()
        assert bitwise_equal(v.detach(), kv.detach()[..., case.k_dim :])
    dk_before, dv_before = dk.clone(), dv.clone()
    torch.autograd.backward((k, v), (dk, dv))
    assert_untouched([dk_before, dv_before], [dk, dv], "autograd backward (dk, dv)")
    assert_untouched(before, inp.owners, "public API")
    assert kv.grad.shape == kv.shape and k_pe.grad.shape == inp.k_pe.shape
    assert bitwise_equal(kv.grad, dkv_ref), "kv.grad != backward launcher dkv"
    assert bitwise_equal(k_pe.grad, dpe_ref.view(inp.k_pe.shape)), "k_pe.grad != launcher dk_pe"


@pytest.mark.slow
@pytest.mark.parametrize("copy_v", [True, False])
def test_torch_compile_fullgraph_matches_eager(copy_v, device):
    """``torch.compile(fullgraph=True)`` traces through the custom ops (fake impls, autograd)
    and gives eager's bits, forward and backward."""
    case = Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        copy_v=copy_v,
        heads=3,
        k_dim=16,
        v_dim=16,
    )
    inp = make_inputs(case, device)
    dk, dv, _ = make_upstream_grads(inp.kv, case)
    w = torch.randn(case.v_dim).to(case.dtype).to(device)

    def step(kv, k_pe, cos, sin, cu_seqlens):
        k, v = mlarope.apply_rope_kv(
            kv,
            k_pe,
            cos,
            sin,
            k_dim=case.k_dim,
            layout="thd",
            cu_seqlens=cu_seqlens,
            copy_v=copy_v,
        )
        # An op after the kernel, so the compiled graph has code of its own. bf16 x bf16 is
        # exact in fp32, so eager and inductor round ``v * w`` (and its gradient) identically.
        return k, v, v * w

    def run(fn):
        kv = inp.kv.detach().clone().requires_grad_(True)
        k_pe = inp.k_pe.detach().clone().requires_grad_(True)
        k, v, vw = fn(kv, k_pe, inp.cos, inp.sin, inp.kwargs["cu_seqlens"])
        if not copy_v:
            assert v.data_ptr() == kv[..., case.k_dim :].data_ptr(), "v must be a view of kv"
        torch.autograd.backward((k, vw), (dk, dv))
        return k.detach(), v.detach(), vw.detach(), kv.grad, k_pe.grad

    torch._dynamo.reset()
    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    names = ("k", "v", "v*w", "kv.grad", "k_pe.grad")
    for name, got, want in zip(names, compiled, eager, strict=True):
        assert bitwise_equal(got, want), f"compiled {name} != eager"
