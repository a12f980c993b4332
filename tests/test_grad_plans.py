"""Launch plans for calls that need autograd (``mlarope._plans.GradPlan``) and the pair op
``mlarope.apply_rope_qk``.

A repeated eager call that needs a gradient replays its recorded forward launches inside one
autograd node (``autograd._Replayed``), and its backward replays what the first backward with
the same gradient metadata launched. It must never change what a call does: the same bits,
gradients, version counters and errors as the pipeline (the first call), to any order. These
run on both lanes (the interpreter replays through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from mlarope import _launch_plans, _plans, reference
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache

T, H, N, R, P = 6, 3, 16, 32, 64
K, V = 16, 8
REPLAYED = "_ReplayedBackward"


@pytest.fixture(autouse=True, params=["TensorGuards", "python"])
def _fresh_plans(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(_launch_plans, "_TensorGuards", None)
    clear_launch_cache()
    yield
    clear_launch_cache()


def grad_plans() -> list:
    return [p for entries in LAUNCH_CACHE.plans.values() for _, p in entries if p is not None]


def tables(device):
    return mlarope.YarnConfig(dim=R).cos_sin(P, device=device)


def node(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


def q_call(x, cos, sin, **kw):
    return mlarope.apply_rope_q(x, cos, sin, layout="thd", **kw)


@pytest.mark.parametrize(
    "inplace, inplace_backward", [(False, False), (True, False), (True, True), (False, True)]
)
def test_q_replays_forward_and_backward(device, inplace, inplace_backward):
    """From the second call on, one replayed node; outputs and gradients bitwise the
    pipeline's (the first call's), the backward's own launch replayed from the third."""
    cos, sin = tables(device)
    ids = torch.randint(0, P, (T,), device=device)
    q0 = torch.randn(T, H, N + R, device=device)
    g0 = torch.randn(T, H, N + R, device=device)
    results = []
    for _ in range(4):
        leaf = q0.clone().requires_grad_(True)
        x = leaf * 1 if inplace else leaf
        version = x._version
        out = q_call(x, cos, sin, position_ids=ids, inplace=inplace,
                     inplace_backward=inplace_backward)  # fmt: skip
        assert (out is x) == inplace
        if inplace:
            assert x._version > version, "in place bumps the version counter"
        g = g0.clone()
        (dq,) = torch.autograd.grad(out, leaf, g)
        if inplace_backward and not inplace:
            assert dq.data_ptr() == g.data_ptr(), "the gradient itself, rotated in place"
        results.append((node(out), out.detach().clone(), dq.clone()))
    assert [r[0] for r in results[1:]] == [REPLAYED] * 3
    assert results[0][0] != REPLAYED
    for _, out, dq in results[1:]:
        assert torch.equal(out, results[0][1]) and torch.equal(dq, results[0][2])
    truth = reference.apply_rope_q(q0.double(), cos.double(), sin.double(), layout="thd",
                                   position_ids=ids)  # fmt: skip
    torch.testing.assert_close(results[-1][1].double(), truth, rtol=1e-6, atol=1e-6)
    (plan,) = grad_plans()
    assert plan.__class__ is _plans.GradPlan
    assert sum(len(e) for e in plan.backward.values()) == 1, "one gradient signature"


@pytest.mark.parametrize("copy_v", [True, False])
@pytest.mark.parametrize("k_pe_shape", ["T1R", "TR"])
def test_kv_replays_forward_and_backward(device, copy_v, k_pe_shape):
    cos, sin = (t.view(P, 1, R) for t in tables(device))
    ids = torch.randint(0, P, (T,), device=device)
    kv0 = torch.randn(T, H, K + V, device=device)
    k_pe0 = torch.randn(T, 1, R, device=device) if k_pe_shape == "T1R" else torch.randn(T, R)
    k_pe0 = k_pe0.to(device)
    gk, gv = torch.randn(T, H, K + R, device=device), torch.randn(T, H, V, device=device)
    results = []
    for _ in range(3):
        kv, k_pe = kv0.clone().requires_grad_(True), k_pe0.clone().requires_grad_(True)
        k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, layout="thd", position_ids=ids,
                                     copy_v=copy_v)  # fmt: skip
        assert v.is_contiguous() == copy_v
        dkv, dk_pe = torch.autograd.grad((k, v), (kv, k_pe), (gk, gv))
        assert dk_pe.shape == k_pe.shape
        results.append((node(k), k.detach().clone(), v.detach().clone(), dkv, dk_pe))
    assert [r[0] for r in results[1:]] == [REPLAYED] * 2
    for r in results[1:]:
        for a, b in zip(r[1:], results[0][1:], strict=True):
            assert torch.equal(a, b)


def test_backward_recorded_per_gradient_signature(device):
    """A gradient with other strides (a slice of ``torch.cat``'s gradient, as transformers'
    layers hand out) gets a backward entry of its own; both give the pipeline's bits."""
    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    wide = torch.randn(T, H, 2 * (N + R), device=device)
    for g in (wide[..., : N + R], wide[..., : N + R].contiguous()) * 2:
        leaf = q0.clone().requires_grad_(True)
        out = q_call(leaf, cos, sin)
        (dq,) = torch.autograd.grad(out, leaf, g)
        expected = reference.apply_rope_q(g.double(), cos.double(), sin.double(), layout="thd",
                                          interleaved=False, interleaved_out=True,
                                          inverse=True)  # fmt: skip
        torch.testing.assert_close(dq.double(), expected, rtol=1e-6, atol=1e-6)
    (plan,) = grad_plans()
    assert sum(len(e) for e in plan.backward.values()) == 2


def test_double_backward_through_a_replayed_node(device):
    """``create_graph=True``: the replayed node's backward is the op's own, recorded by
    autograd, so second derivatives match the pipeline's, bit for bit."""
    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    g0 = torch.randn(T, H, N + R, device=device)
    w = torch.randn(T, H, N + R, device=device)
    second = []
    for _ in range(3):
        leaf = q0.clone().requires_grad_(True)
        g = g0.clone().requires_grad_(True)
        out = q_call(leaf, cos, sin)
        (dq,) = torch.autograd.grad(out, leaf, g, create_graph=True)
        (dg,) = torch.autograd.grad((dq * w).sum(), g)
        second.append((node(out), dq.detach(), dg))
    assert second[1][0] == REPLAYED
    for _, dq, dg in second[1:]:
        assert torch.equal(dq, second[0][1]) and torch.equal(dg, second[0][2])


def test_replayed_call_keeps_autograd_errors(device):
    """The tables are saved: writing one between the forward and the backward raises, as in
    the pipeline. In place on a leaf that requires grad raises. An in-place target that now
    overlaps the tables it reads takes the pipeline, which refuses it."""
    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    for _ in range(2):
        leaf = q0.clone().requires_grad_(True)
        out = q_call(leaf, cos.clone(), sin)
        out.sum().backward()
    table = cos.clone()
    out = q_call(q0.clone().requires_grad_(True), table, sin)
    assert node(out) == REPLAYED
    table.mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            q_call(q0.clone().requires_grad_(True), cos, sin, inplace=True)

    # in place, recorded apart from the tables, then called on memory that holds them
    def target(buf):
        return buf[: T * H * (N + R)].view(T, H, N + R)

    for _ in range(2):
        buf = torch.randn(P * R, device=device, requires_grad=True) * 1
        q_call(target(buf), cos, sin, inplace=True)
    buf = torch.randn(P * R, device=device, requires_grad=True) * 1
    with pytest.raises(ValueError, match="shares memory with cos"):
        q_call(target(buf), buf.detach().view(P, R), sin, inplace=True)


def test_grad_and_no_grad_calls_keep_their_own_plans(device):
    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    for _ in range(2):
        with torch.no_grad():
            q_call(q0.clone().requires_grad_(True), cos, sin)
        q_call(q0.clone().requires_grad_(True), cos, sin).sum().backward()
        q_call(q0.clone(), cos, sin)
    kinds = sorted(type(p).__name__ for p in grad_plans())
    assert kinds == ["GradPlan", "Plan", "Plan"]


# ---------------------------------------------------------------------------------------------
# apply_rope_qk: two apply_rope_q calls, in one node
# ---------------------------------------------------------------------------------------------


def _pair_inputs(device, dtype=torch.float32):
    q = torch.randn(2, 5, H, N + R, device=device, dtype=dtype)
    k = torch.randn(2, 5, 1, R, device=device, dtype=dtype)
    ids = torch.randint(0, P, (2, 5), device=device)
    return q, k, ids


@pytest.mark.parametrize("grad", [False, True])
def test_pair_is_two_query_calls(device, grad):
    cos, sin = tables(device)
    q0, k0, ids = _pair_inputs(device)
    gq, gk = torch.randn_like(q0), torch.randn_like(k0)
    kw = dict(layout="bshd", position_ids=ids, interleaved=False, inverse=True)
    for i in range(3):
        q, k = q0.clone().requires_grad_(grad), k0.clone().requires_grad_(grad)
        a, b = mlarope.apply_rope_qk(q, k, cos, sin, **kw)
        q2, k2 = q0.clone().requires_grad_(grad), k0.clone().requires_grad_(grad)
        x, y = mlarope.apply_rope_q(q2, cos, sin, **kw), mlarope.apply_rope_q(k2, cos, sin, **kw)
        assert torch.equal(a, x) and torch.equal(b, y)
        if grad:
            assert (node(a) == REPLAYED) == (i > 0) and node(b) == node(a)
            torch.autograd.backward((a, b), (gq, gk))
            torch.autograd.backward((x, y), (gq, gk))
            assert torch.equal(q.grad, q2.grad) and torch.equal(k.grad, k2.grad)
    (plan,) = [p for p in grad_plans() if len(p.launches if hasattr(p, "launches") else
                                              p.forward.launches) == 2]  # fmt: skip
    assert (plan.__class__ is _plans.GradPlan) == grad


def test_pair_with_one_tensor_needing_grad(device):
    """Only ``q`` requires grad: two nodes (the pipeline), ``k``'s output needs none."""
    cos, sin = tables(device)
    q0, k0, ids = _pair_inputs(device)
    for _ in range(2):
        a, b = mlarope.apply_rope_qk(q0.clone().requires_grad_(True), k0, cos, sin,
                                     layout="bshd", position_ids=ids)  # fmt: skip
        assert a.requires_grad and not b.requires_grad and node(a) != REPLAYED


def test_pair_in_every_mode(device):
    """forward AD, torch.func and torch.compile take the pipeline: two query-op applications,
    the same values as two calls."""
    cos, sin = tables(device)
    q0, k0, ids = _pair_inputs(device)
    kw = dict(layout="bshd", position_ids=ids)

    def pair(q, k):
        return mlarope.apply_rope_qk(q, k, cos, sin, **kw)

    def two(q, k):
        return mlarope.apply_rope_q(q, cos, sin, **kw), mlarope.apply_rope_q(k, cos, sin, **kw)

    from torch.autograd import forward_ad as fwAD

    tq, tk = torch.randn_like(q0), torch.randn_like(k0)
    tangents = []
    for fn in (pair, two):
        with fwAD.dual_level():
            outs = fn(fwAD.make_dual(q0, tq), fwAD.make_dual(k0, tk))
            tangents.append([fwAD.unpack_dual(o).tangent for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(*tangents, strict=True))

    def loss(fn):
        return lambda q, k: sum((o * o).sum() for o in fn(q, k))

    grads = [torch.func.grad(loss(fn), argnums=(0, 1))(q0, k0) for fn in (pair, two)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    compiled = torch.compile(pair, fullgraph=True, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(compiled(q0, k0), two(q0, k0), strict=True))


def test_pair_checks(device):
    cos, sin = tables(device)
    q, k, _ = _pair_inputs(device)
    with pytest.raises(ValueError, match=r"k must have q's token dims \(2, 5\)"):
        mlarope.apply_rope_qk(q, k[:, :4], cos, sin, layout="bshd")
    with pytest.raises(ValueError, match=r"k\.shape"):
        mlarope.apply_rope_qk(q, k[..., :16], cos, sin, layout="bshd")
    with pytest.raises(TypeError, match=r"k must be a torch\.Tensor"):
        mlarope.apply_rope_qk(q, None, cos, sin, layout="bshd")
    a, b = mlarope.apply_rope_qk(q, k.double(), cos, sin, layout="bshd")  # dtypes of their own
    assert a.dtype == torch.float32 and b.dtype == torch.float64


def test_megatron_compat_key_value_call_replays(device):
    """``mlarope.compat.megatron``'s key/value call (its backward rounds where Megatron-Core's
    does) replays in one node from its second call, with the first call's bits, and never takes
    the public call's plan (whose backward rounds once)."""
    from mlarope.compat import megatron as compat

    cos, sin = (t.view(P, 1, 1, R) for t in tables(device))
    kv0 = torch.randn(4, 2, H, K + V, device=device).to(torch.bfloat16)
    k0 = torch.randn(4, 2, 1, R, device=device).to(torch.bfloat16)
    gk = torch.randn(4, 2, H, K + R, device=device).to(torch.bfloat16)
    gv = torch.randn(4, 2, H, V, device=device).to(torch.bfloat16)
    results = []
    for rounding in ("megatron", "megatron", "megatron", "exact", "exact"):
        kv, k_pe = kv0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        k, v = compat.fused_apply_mla_rope_for_kv(kv, k_pe, cos, sin, R, K, V, rounding=rounding)
        dkv, dk_pe = torch.autograd.grad((k, v), (kv, k_pe), (gk, gv))
        results.append((rounding, node(k), k.detach(), dkv, dk_pe))
    assert [r[1] == REPLAYED for r in results] == [False, True, True, False, True]
    for r in results[1:3]:
        assert all(torch.equal(a, b) for a, b in zip(r[2:], results[0][2:], strict=True))
    assert torch.equal(results[4][4], results[3][4])
    assert not torch.equal(results[3][4], results[0][4]), "the two roundings differ here"


# ---------------------------------------------------------------------------------------------
# found by review: what the replayed node saves, unused outputs, compiled autograd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["q", "kv", "qk"])
def test_activation_checkpointing_sees_the_same_saved_tensors(device, op):
    """Non-reentrant checkpointing compares what the recomputation saves with what the forward
    saved. The first call of a signature runs the pipeline and its recomputation replays (and,
    after the cache is cleared, the other way round): the replayed node must save the
    pipeline's tensors, as many, in the same shapes (tables as ``[P, R]``, positions broadcast;
    ``apply_rope_qk``'s pipeline is two nodes). Tables ``[P, 1, R]`` and broadcast positions."""
    from torch.utils.checkpoint import checkpoint

    cos, sin = (t.view(P, 1, R) for t in tables(device))
    ids = torch.randint(0, P, (5,), device=device)
    x0 = torch.randn(2, 5, H, K + R, device=device)
    k0 = torch.randn(2, 5, 1, R, device=device)
    kw = dict(layout="bshd", position_ids=ids)

    def layer(x, k):
        if op == "q":
            outs = (mlarope.apply_rope_q(x * 1, cos, sin, **kw),)
        elif op == "kv":
            outs = mlarope.apply_rope_kv(x * 1, k * 1, cos, sin, k_dim=K, **kw)
        else:
            outs = mlarope.apply_rope_qk(x * 1, k * 1, cos, sin, **kw)
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


def test_pair_output_unused_gets_no_gradient(device):
    """Only ``q``'s output reaches the loss: ``k`` gets no gradient (None), as with two calls,
    and ``torch.autograd.grad`` for ``k`` raises as it does there."""
    cos, sin = tables(device)
    q0, k0, ids = _pair_inputs(device)
    for _ in range(3):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        a, _ = mlarope.apply_rope_qk(q, k, cos, sin, layout="bshd", position_ids=ids)
        a.sum().backward()
        assert k.grad is None and q.grad is not None
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        a, _ = mlarope.apply_rope_qk(q, k, cos, sin, layout="bshd", position_ids=ids)
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(a.sum(), (q, k))
    assert node(a) == REPLAYED


def test_compiled_autograd_traces_a_replayed_backward(device):
    """Under torch's compiled autograd the backward is traced: a replayed node runs the op's
    own backward there (a recorded launch cannot take traced tensors)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    cos, sin = tables(device)
    q0 = torch.randn(T, H, N + R, device=device)
    g0 = torch.randn(T, H, N + R, device=device)
    grads = []
    for _ in range(3):
        leaf = q0.clone().requires_grad_()
        out = q_call(leaf, cos, sin)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            out.backward(g0)
        grads.append(leaf.grad)
    assert node(out) == REPLAYED
    assert all(torch.equal(g, grads[0]) for g in grads[1:])
