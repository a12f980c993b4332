"""Launch plans for thd calls with ``cu_seqlens`` (Megatron-Core's packed batches).

Such a call makes two launches: the ``cu_seqlens`` search, which writes every token's position
into a scratch buffer, then the rotation, which reads it. Its plan replays both, with a new
scratch buffer each time, and a call that needs autograd saves that buffer for its backward as
the pipeline does. ``cu_seqlens``' values are read on the device only, so every test changes
them between calls: a plan that kept the first call's positions would rotate by the wrong
angles. These run on both lanes (the interpreter replays through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from mlarope import _pipeline, _plans, reference
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.compat import megatron as compat

T, H, N, R, P = 8, 2, 16, 32, 64
K, V = 16, 8
REPLAYED = "_ReplayedBackward"
# The same shape ([3] int32), other boundaries, the last one with padding tokens past 7.
CU_SEQLENS = ([0, 3, 8], [0, 5, 8], [0, 1, 7])


@pytest.fixture(autouse=True)
def _fresh_plans():
    clear_launch_cache()
    yield
    clear_launch_cache()


def plans() -> list:
    return [plan for entries in LAUNCH_CACHE.plans.values() for _, plan in entries]


def tables(device):
    return mlarope.YarnConfig(dim=R).cos_sin(P, device=device)


def cu_of(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def q_truth(q, cos, sin, cu):
    return reference.apply_rope_q(q.double(), cos.double(), sin.double(), layout="thd",
                                  cu_seqlens=cu)  # fmt: skip


def close(a, b):
    # fp32 inputs and tables: one fp32 rounding of a two-term sum (the error model).
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
def test_q_plan_searches_the_new_cu_seqlens(inplace, device, monkeypatch):
    cos, sin = tables(device)
    pipeline = []
    for name in ("rope_q", "rope_q_"):  # the pipeline's implementations, which a plan skips
        real = getattr(_pipeline, name)
        monkeypatch.setattr(_pipeline, name, lambda *a, _real=real: pipeline.append(1) or _real(*a))
    for values in CU_SEQLENS * 2:
        cu = cu_of(values, device)
        q = torch.randn(T, H, N + R, device=device)
        truth = q_truth(q, cos, sin, cu)
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", cu_seqlens=cu, inplace=inplace)
        assert (out is q) == inplace
        close(out, truth)
    assert len(pipeline) == 1, "every call after the first takes the plan"
    (plan,) = plans()
    assert len(plan.launches) == 2 and plan.scratch == (((T,), torch.int64),)


def test_kv_plan_searches_the_new_cu_seqlens(device):
    cos, sin = tables(device)
    for values in CU_SEQLENS * 2:
        cu = cu_of(values, device)
        kv, k_pe = torch.randn(T, H, K + V, device=device), torch.randn(T, 1, R, device=device)
        k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, layout="thd", cu_seqlens=cu)
        tk, tv = reference.apply_rope_kv(kv.double(), k_pe.double(), cos.double(), sin.double(),
                                         k_dim=K, layout="thd", cu_seqlens=cu)  # fmt: skip
        close(k, tk)
        close(v, tv)
    (plan,) = plans()
    assert len(plan.launches) == 2 and plan.scratch


def test_the_key_tells_cu_seqlens_from_position_ids(device):
    """Same tensors' count and alignment, another position source: another entry."""
    cos, sin = tables(device)
    cu = cu_of(CU_SEQLENS[0], device)
    ids = torch.arange(3, dtype=torch.int32, device=device)  # the shape and dtype of cu
    q = torch.randn(3, H, N + R, device=device)
    for _ in range(2):
        a = mlarope.apply_rope_q(q, cos, sin, layout="thd", cu_seqlens=cu[:2].clone())
        b = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
        close(a, q_truth(q, cos, sin, cu[:2]))
        close(b, reference.apply_rope_q(q.double(), cos.double(), sin.double(), layout="thd",
                                        position_ids=ids))  # fmt: skip
    assert len(plans()) == 2


def q_grad_truth(q, g, cos, sin, cu):
    x = q.double().requires_grad_(True)
    out = reference.apply_rope_q(x, cos.double(), sin.double(), layout="thd", cu_seqlens=cu)
    return torch.autograd.grad(out, x, g.double())[0]


@pytest.mark.parametrize(
    "inplace, inplace_backward, through_base",
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True),
     (True, True, True)],
)  # fmt: skip
def test_q_grad_plan_replays_search_forward_and_backward(
    device, inplace, inplace_backward, through_base
):
    """From the second call on, the replayed node (or, in place on a view that is its whole
    base, Megatron-Core's query, the base's node) with each call's own search; values and
    gradients bitwise the pipeline's for the same ``cu_seqlens``."""
    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    g0 = torch.randn(T, H, N + R, device=device)
    first, later = {}, []
    for i, values in enumerate(CU_SEQLENS * 2):
        cu = cu_of(values, device)
        leaf = q0.flatten().clone().requires_grad_(True)
        if through_base:
            x = (leaf * 1).view(T, H, N + R)  # a view that is its whole base
        elif inplace:
            x = leaf.view(T, H, N + R) * 1  # a tensor of its own
        else:
            x = leaf.view(T, H, N + R)
        out = mlarope.apply_rope_q(x, cos, sin, layout="thd", cu_seqlens=cu, inplace=inplace,
                                   inplace_backward=inplace_backward)  # fmt: skip
        (dq,) = torch.autograd.grad(out, leaf, g0.clone())
        result = (out.detach().clone(), dq.view(T, H, N + R).clone())
        close(result[0], q_truth(q0, cos, sin, cu))
        close(result[1], q_grad_truth(q0, g0, cos, sin, cu))
        if i < len(CU_SEQLENS):
            first[tuple(values)] = result
        else:
            later.append((tuple(values), result))
    for values, (out, dq) in later:
        assert torch.equal(out, first[values][0]) and torch.equal(dq, first[values][1])
    (plan,) = [p for p in plans() if p is not None]
    assert plan.__class__ is _plans.GradPlan and plan.searched


def test_q_grad_plan_is_one_replayed_node(device):
    cos, sin = tables(device)
    nodes = []
    for values in CU_SEQLENS:
        leaf = torch.randn(T, H, N + R, device=device, requires_grad=True)
        out = mlarope.apply_rope_q(leaf, cos, sin, layout="thd", cu_seqlens=cu_of(values, device))
        nodes.append(type(out.grad_fn).__name__)
        out.sum().backward()
    assert nodes[0] != REPLAYED and nodes[1:] == [REPLAYED, REPLAYED]


@pytest.mark.parametrize("rounding", ["exact", "megatron"])
def test_kv_grad_plan_replays_search_forward_and_backward(device, rounding):
    """The key/value op through the public call and through Megatron's compat function with
    its rounding (a plan of its own), each call its own ``cu_seqlens``."""
    cos, sin = tables(device)
    kv0, k0 = torch.randn(T, H, K + V, device=device), torch.randn(T, 1, R, device=device)
    gk, gv = torch.randn(T, H, K + R, device=device), torch.randn(T, H, V, device=device)
    first, nodes = {}, []
    for i, values in enumerate(CU_SEQLENS * 2):
        cu = cu_of(values, device)
        kv, k_pe = kv0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        if rounding == "exact":
            k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, layout="thd",
                                         cu_seqlens=cu)  # fmt: skip
        else:
            k, v = compat.fused_apply_mla_rope_for_kv(
                kv, k_pe, cos.view(P, 1, 1, R), sin.view(P, 1, 1, R), R, K, V, cu
            )
        nodes.append(type(k.grad_fn).__name__)
        grads = torch.autograd.grad((k, v), (kv, k_pe), (gk, gv))
        tk, tv = reference.apply_rope_kv(kv0.double(), k0.double(), cos.double(), sin.double(),
                                         k_dim=K, layout="thd", cu_seqlens=cu)  # fmt: skip
        close(k, tk)
        close(v, tv)
        result = (k.detach(), v.detach(), *grads)
        if i < len(CU_SEQLENS):
            first[tuple(values)] = result
        else:
            for a, b in zip(result, first[tuple(values)], strict=True):
                assert torch.equal(a, b)
    assert nodes[0] != REPLAYED and set(nodes[1:]) == {REPLAYED}


def recorded_first_call(device):
    """``(inputs, output, launches)`` of the pipeline of a thd call with ``cu_seqlens``, as a
    first call runs it (two launches: the search, the rotation)."""
    from mlarope.kernels._launch import recording

    cos, sin = tables(device)
    cu = cu_of(CU_SEQLENS[0], device)
    q = torch.randn(T, H, N + R, device=device)
    with recording() as launches:
        out = _pipeline.query(q, cos, sin, "thd", cu, None, 0, 1, True, False, False, False,
                              False, False)[0]  # fmt: skip
    return (q, cos, sin, cu), out, launches


def test_a_launch_the_recording_could_not_keep_gives_no_plan(device):
    """A launch a Triton cache hook took over is noted without a kernel (``kernels._launch``):
    the plan of the others would replay the rotation on a search nobody ran."""
    from mlarope._launch_plans import plan_from

    inputs, out, launches = recorded_first_call(device)
    assert plan_from(inputs, (out,), launches) is not None
    search_args = launches[0][1]
    launches[0] = (None, search_args)
    assert plan_from(inputs, (out,), launches) is None


def test_a_grad_plan_saves_only_the_search(device):
    """A call that needs autograd gets a GradPlan only where its one scratch buffer is the
    ``cu_seqlens`` search its record says it made (the replayed node saves it as such)."""
    from mlarope._launch_plans import Replay, record

    inputs, out, launches = recorded_first_call(device)
    bare = mlarope.ops.QueryCall(*(None,) * 5, "thd", 0, 1, True, False, False, False)
    assert record(inputs, (out,), launches, Replay("q", bare, searched=True))[1].searched
    assert record(inputs, (out,), launches, Replay("q", bare, searched=False))[1] is None


def test_double_backward_and_forward_ad_through_a_replayed_thd_node(device):
    """Second order through the replayed node (its backward is the op's own, recorded by
    autograd, with the saved search) and forward-mode AD (never a plan: a tangent is not
    metadata), each call its own ``cu_seqlens``: bit for bit the pipeline's."""
    from torch.autograd import forward_ad as fwAD

    cos, sin = tables(device)
    q0, g0, w = (torch.randn(T, H, N + R, device=device) for _ in range(3))
    first, nodes = {}, []
    for i, values in enumerate(CU_SEQLENS * 2):
        cu = cu_of(values, device)
        leaf, g = q0.clone().requires_grad_(True), g0.clone().requires_grad_(True)
        out = mlarope.apply_rope_q(leaf, cos, sin, layout="thd", cu_seqlens=cu)
        nodes.append(type(out.grad_fn).__name__)
        (dq,) = torch.autograd.grad(out, leaf, g, create_graph=True)
        (dg,) = torch.autograd.grad((dq * w).sum(), g)
        with fwAD.dual_level():
            dual = mlarope.apply_rope_q(fwAD.make_dual(q0, w), cos, sin, layout="thd",
                                        cu_seqlens=cu)  # fmt: skip
            tangent = fwAD.unpack_dual(dual).tangent.clone()
        close(tangent, q_truth(w, cos, sin, cu))  # the op is linear: its tangent is R w
        result = (out.detach(), dq.detach(), dg, tangent)
        if i < len(CU_SEQLENS):
            first[tuple(values)] = result
        else:
            for a, b in zip(result, first[tuple(values)], strict=True):
                assert torch.equal(a, b)
    assert nodes[0] != REPLAYED and set(nodes[1:]) == {REPLAYED}


@pytest.mark.parametrize("op", ["q", "kv"])
def test_activation_checkpointing_of_a_thd_call(device, op):
    """Non-reentrant checkpointing compares what the recomputation saves with what the forward
    saved: the pipeline's node and the replayed one save the same tensors (the search among
    them), whichever ran first."""
    from torch.utils.checkpoint import checkpoint

    cos, sin = tables(device)
    cu = cu_of(CU_SEQLENS[2], device)
    x0 = torch.randn(T, H, K + R, device=device)
    k0 = torch.randn(T, 1, R, device=device)

    def layer(x, k):
        if op == "q":
            outs = (mlarope.apply_rope_q(x * 1, cos, sin, layout="thd", cu_seqlens=cu,
                                         inplace=True),)  # fmt: skip
        else:
            outs = mlarope.apply_rope_kv(x * 1, k * 1, cos, sin, k_dim=K, layout="thd",
                                         cu_seqlens=cu)  # fmt: skip
        return sum((o * o).sum() for o in outs)

    grads = []
    for i in range(4):
        x, k = x0.clone().requires_grad_(), k0.clone().requires_grad_()
        checkpoint(layer, x, k, use_reentrant=False).backward()
        grads.append((x.grad, k.grad))
        if i == 1:
            clear_launch_cache()
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0])
        assert (g[1] is None) == (grads[0][1] is None)
        if g[1] is not None:
            assert torch.equal(g[1], grads[0][1])
