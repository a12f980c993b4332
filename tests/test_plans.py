"""Launch plans for repeated eager calls (``mlarope._plans``).

A plan must never change what a call does: same outputs as the full pipeline, the same errors
for bad arguments, new tensors (not the recorded ones) in every launch. These run in both lanes
(under the interpreter the recorded launch is replayed through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from mlarope import _launch_plans, _pipeline, reference
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache

T, H, N, R, P = 6, 3, 16, 32, 64
K, V = 16, 8


@pytest.fixture(autouse=True, params=["TensorGuards", "python"])
def _fresh_plans(request, monkeypatch):
    """Every test runs with the C++ metadata guard and with the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(_launch_plans, "_TensorGuards", None)
    clear_launch_cache()
    yield
    clear_launch_cache()


def recorded_plans() -> list:
    return [plan for entries in LAUNCH_CACHE.plans.values() for _, plan in entries]


def tables(device, rows=P):
    cos, sin = mlarope.YarnConfig(dim=R).cos_sin(rows, device=device)
    return cos, sin


def q_truth(q, cos, sin, **kw):
    return reference.apply_rope_q(q.double(), cos.double(), sin.double(), **kw)


def assert_rotated(out, truth):
    # fp32 inputs and tables: one fp32 rounding of a two-term sum (the error model, docs/design.md).
    torch.testing.assert_close(out.double(), truth, rtol=1e-6, atol=1e-6)


class PipelineCalls:
    """Counts eager calls that run the pipeline's implementations rather than a plan."""

    def __init__(self, monkeypatch):
        self.q = self.kv = 0
        for name, op in (("rope_q", "q"), ("rope_q_", "q"), ("rope_kv", "kv")):
            real = getattr(_pipeline, name)

            def counted(*a, _real=real, _op=op, **k):
                setattr(self, _op, getattr(self, _op) + 1)
                return _real(*a, **k)

            monkeypatch.setattr(_pipeline, name, counted)


@pytest.mark.parametrize("inplace", [False, True])
def test_q_plan_uses_the_new_tensors(inplace, device, monkeypatch):
    calls = PipelineCalls(monkeypatch)
    cos, sin = tables(device)
    ids = torch.randint(0, P, (T,), device=device)
    outs = []
    for i in range(3):
        q = torch.randn(T, H, N + R, device=device)
        truth = q_truth(q, cos, sin, layout="thd", position_ids=ids)
        version = q._version
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids, inplace=inplace)
        assert (out is q) == inplace
        if inplace:
            assert q._version > version, f"call {i}: in place must bump the version counter"
        assert_rotated(out, truth)
        outs.append(out)
    assert calls.q == 1, "the second and third calls must take the plan"
    assert [type(p).__name__ for p in recorded_plans()] == ["Plan"]
    assert outs[1].data_ptr() != outs[2].data_ptr()


@pytest.mark.parametrize("copy_v", [True, False])
def test_kv_plan_uses_the_new_tensors(copy_v, device, monkeypatch):
    """k_pe as ``[T, 1, R]`` (the pipeline squeezes it) and tables as ``[P, 1, R]`` views: the
    plan fills those launch slots with the new call's tensors."""
    calls = PipelineCalls(monkeypatch)
    for i in range(3):
        cos, sin = (t.view(P, 1, R) for t in tables(device))
        cos, sin = cos * (1 + i), sin * (1 + i)  # new tables, other values, every call
        kv = torch.randn(T, H, K + V, device=device)
        k_pe = torch.randn(T, 1, R, device=device)
        ids = torch.randint(0, P, (T,), device=device)
        k, v = mlarope.apply_rope_kv(
            kv, k_pe, cos, sin, k_dim=K, layout="thd", position_ids=ids, copy_v=copy_v
        )
        k_ref, v_ref = reference.apply_rope_kv(
            kv.double(), k_pe.double(), cos.double(), sin.double(), k_dim=K, layout="thd",
            position_ids=ids,
        )  # fmt: skip
        assert_rotated(k, k_ref)
        assert torch.equal(v.double(), v_ref)
        assert v.is_contiguous() == copy_v
        if not copy_v:
            assert v.data_ptr() == kv[..., K:].data_ptr()
    assert calls.kv == 1


def test_plan_never_skips_a_check(device):
    """After a plan exists, arguments the checks reject still raise: the key holds each flag's
    and integer's type, and every tensor's metadata."""
    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    ids = torch.randint(0, P, (T,), device=device)
    kw = dict(layout="thd", position_ids=ids)
    mlarope.apply_rope_q(q, cos, sin, **kw)
    mlarope.apply_rope_q(q, cos, sin, **kw)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        mlarope.apply_rope_q(q, cos, sin, interleaved=1, **kw)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        mlarope.apply_rope_q(q, cos, sin, inplace=0, **kw)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        mlarope.apply_rope_q(q, cos, sin, inplace_backward=1, **kw)
    with pytest.raises(TypeError, match="cp_rank must be an int"):
        mlarope.apply_rope_q(q, cos, sin, cp_rank=False, **kw)
    with pytest.raises(TypeError, match="validate must be a bool"):
        mlarope.apply_rope_q(q, cos, sin, validate=0, **kw)
    with pytest.raises(ValueError, match="rope dim"):
        mlarope.apply_rope_q(q, cos[:, :16], sin[:, :16], **kw)
    with pytest.raises(ValueError, match="position_ids must match"):
        mlarope.apply_rope_q(q[:4], cos, sin, **kw)
    k_pe = torch.randn(T, 1, R, device=device)
    kv = torch.randn(T, H, K + V, device=device)
    mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, **kw)
    mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, **kw)
    with pytest.raises(TypeError, match="k_dim must be an int"):
        mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=float(K), **kw)
    with pytest.raises(TypeError, match="copy_v must be a bool"):
        mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, copy_v=1, **kw)
    with pytest.raises(TypeError, match="k_pe and kv must share a dtype"):
        mlarope.apply_rope_kv(kv, k_pe.half(), cos, sin, k_dim=K, **kw)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_validation_takes_the_pipeline(how, device, monkeypatch):
    """Validation needs the device data: with it on, a call never takes a plan."""
    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    good = torch.randint(0, P, (T,), device=device)
    mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=good)
    mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=good)
    bad = good.clone()
    bad[2] = P
    kw = dict(layout="thd", position_ids=bad)
    if how == "environment":
        monkeypatch.setenv("MLAROPE_VALIDATE", "1")
    else:
        kw["validate"] = True
    with pytest.raises(ValueError, match="outside the table"):
        mlarope.apply_rope_q(q, cos, sin, **kw)


def test_aliased_tables(device):
    """Recorded with ``cos`` and ``sin`` distinct, called with one tensor for both: the launch
    gets what the pipeline would give it. Recorded with one tensor for both, the slots cannot
    be told apart, so that call signature gets no plan."""
    cos, sin = tables(device)
    ids = torch.randint(0, P, (T,), device=device)
    kw = dict(layout="thd", position_ids=ids)
    for first, second in (((cos, sin), (cos, cos)), ((sin, sin), (cos, sin))):
        clear_launch_cache()
        q = torch.randn(T, H, N + R, device=device)
        mlarope.apply_rope_q(q, *first, **kw)
        assert_rotated(mlarope.apply_rope_q(q, *second, **kw), q_truth(q, *second, **kw))
        assert_rotated(mlarope.apply_rope_q(q, *second, **kw), q_truth(q, *second, **kw))
        has_plan = recorded_plans() != [None]
        assert has_plan == (first[0] is not first[1])


def test_misaligned_views_get_their_own_plan(device):
    """The address modulo 16 is in the key (Triton specializes on 16-byte alignment)."""
    cos, sin = tables(device)
    ids = torch.randint(0, P, (T,), device=device)
    buf = torch.randn(T * H * (N + R) + 1, device=device)
    for offset in (0, 1, 0, 1):
        q = buf[offset : offset + T * H * (N + R)].view(T, H, N + R)
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
        assert_rotated(out, q_truth(q, cos, sin, layout="thd", position_ids=ids))
    assert len(recorded_plans()) == 2


def test_no_plan_where_the_pipeline_does_more(device, monkeypatch):
    """float64 (no launch), tensor subclasses. (Calls that need autograd have plans of their
    own: tests/test_grad_plans.py; thd calls with cu_seqlens: tests/test_thd_plans.py.)"""
    calls = PipelineCalls(monkeypatch)
    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    for _ in range(2):
        mlarope.apply_rope_q(q.double(), cos, sin, layout="thd")
        mlarope.apply_rope_q(q, torch.nn.Parameter(cos, requires_grad=False), sin, layout="thd")
    assert calls.q == 4, "every eager call runs the pipeline"
    assert recorded_plans() == [], "float64 (the only eligible call) launches nothing: no plan"


def test_guard_tells_metadata_apart(device, monkeypatch):
    """Calls with the same dict key (first tensor's shape, alignment, flags) but other table
    dtypes or strides: the guard sends them down the pipeline, which records their own plans."""
    calls = PipelineCalls(monkeypatch)
    cos, sin = tables(device)
    wide_cos, wide_sin = (torch.cat([t, t], dim=1) for t in tables(device))
    ids = torch.randint(0, P, (T,), device=device)
    kw = dict(layout="thd", position_ids=ids)
    variants = [
        (cos, sin),
        (cos.half(), sin.half()),
        (wide_cos[:, :R], wide_sin[:, :R]),  # [P, R] with row stride 2R
        (cos, sin),
    ]
    for c, s in variants + variants:
        q = torch.randn(T, H, N + R, device=device)
        assert_rotated(mlarope.apply_rope_q(q, c, s, **kw), q_truth(q, c, s, **kw))
    assert calls.q == 3, "three distinct metadata, each through the pipeline once"
    assert len(LAUNCH_CACHE.plans) == 1 and len(recorded_plans()) == 3


# ----------------------------------------------------- found by review: calls a plan must not take
@pytest.mark.parametrize("ids_first", [False, True])
def test_with_and_without_position_ids(ids_first, device):
    """The position source is part of the key even when the ids' address adds no bits."""
    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    ids = torch.arange(T, device=device)
    assert ids.data_ptr() % 16 == 0
    calls = [dict(layout="thd"), dict(layout="thd", position_ids=ids.flip(0).contiguous())]
    for kw in (calls[::-1] if ids_first else calls) * 2:
        assert_rotated(mlarope.apply_rope_q(q, cos, sin, **kw), q_truth(q, cos, sin, **kw))


def test_arguments_without_a_key_still_get_the_checks_errors(device):
    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    mlarope.apply_rope_q(q, cos, sin, layout="thd")
    with pytest.raises(TypeError, match="layout must be a str"):
        mlarope.apply_rope_q(q, cos, sin, layout=["thd"])
    with pytest.raises(TypeError, match="q is a sparse_coo tensor; mlarope supports dense"):
        mlarope.apply_rope_q(q.cpu().to_sparse(), cos.cpu(), sin.cpu(), layout="thd")
    with pytest.raises(ValueError, match="negated view"):
        mlarope.apply_rope_q(torch._neg_view(q), cos, sin, layout="thd")


def test_vmap_takes_the_pipeline(monkeypatch):
    """vmap's batched tensors have no storage: no plan, and the reference path runs as before."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU reference backend
    cos, sin = tables("cpu")
    batch = torch.randn(4, T, H, N + R)
    for _ in range(2):
        out = torch.func.vmap(lambda x: mlarope.apply_rope_q(x, cos, sin, layout="thd"))(batch)
        for i in range(4):
            assert torch.equal(out[i], mlarope.apply_rope_q(batch[i], cos, sin, layout="thd"))


@pytest.mark.cpu
def test_cpu_backend_switch_is_in_the_key(monkeypatch):
    """On the CPU the backend follows TRITON_INTERPRET at each call; a plan recorded for one
    backend is not taken for the other."""
    calls = PipelineCalls(monkeypatch)
    cos, sin = tables("cpu")
    q = torch.randn(T, H, N + R)
    counts = []
    for value in ("1", "0", "1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        mlarope.apply_rope_q(q, cos, sin, layout="thd")
        counts.append(calls.q)
    # The reference backend launches nothing, so its calls are never recorded; the
    # interpreter's second call takes its plan.
    assert counts == [1, 2, 2, 3]


def test_guard_kind_names_the_guard():
    """``mlarope info`` says which guard runs (the fixture runs each test with both)."""
    expected = "Python" if _launch_plans._TensorGuards is None else "TensorGuards (C++)"
    assert _launch_plans.guard_kind() == expected


@pytest.mark.parametrize("op", ["q", "kv"])
def test_a_table_that_requires_grad_recorded_without_grad_mode(op, device):
    """Under ``no_grad`` a table that requires grad is fine (no gradient is asked for) and the
    call gets a plan; with grad mode on the same call raises, plan or not: grad mode is in the
    key. (Before, the recorded plan ran and the table silently got no gradient.)"""
    cos, sin = tables(device)
    cos = cos.clone().requires_grad_(True)
    q = torch.randn(T, H, N + R, device=device)
    kv, k_pe = torch.randn(T, H, K + V, device=device), torch.randn(T, 1, R, device=device)

    def run():
        if op == "q":
            return mlarope.apply_rope_q(q, cos, sin, layout="thd")
        return mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, layout="thd")

    with torch.no_grad():
        run()
        run()
    for _ in range(2):
        with pytest.raises(ValueError, match="cos requires grad"):
            run()


def test_inference_tensor_recorded_in_inference_mode(device):
    """An in-place call on an inference tensor gets a plan inside inference mode; outside it the
    same call raises before anything is written, plan or not (the guard tells the two apart)."""
    cos, sin = tables(device)
    with torch.inference_mode():
        q = torch.randn(T, H, N + R, device=device)
        for _ in range(3):
            mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    before = q.clone()
    for _ in range(2):
        with pytest.raises(ValueError, match="q is an inference tensor"):
            mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    assert torch.equal(q, before), "nothing was written"


@pytest.mark.parametrize("inplace", [False, True])
def test_forward_ad_never_takes_a_plan(inplace, device):
    """A dual tensor has a plain tensor's metadata, so a plan would drop its tangent: calls
    under forward-mode AD always take the pipeline."""
    from torch.autograd import forward_ad as fwAD

    cos, sin = tables(device)
    q = torch.randn(T, H, N + R, device=device)
    for _ in range(2):  # record a plan
        mlarope.apply_rope_q(q.clone(), cos, sin, layout="thd", inplace=inplace)
    tangent = torch.randn_like(q)
    with fwAD.dual_level():
        out = mlarope.apply_rope_q(fwAD.make_dual(q.clone(), tangent.clone()), cos, sin,
                                   layout="thd", inplace=inplace)  # fmt: skip
        got = fwAD.unpack_dual(out).tangent
    assert got is not None, "the tangent was dropped"
    assert torch.equal(got, mlarope.apply_rope_q(tangent, cos, sin, layout="thd"))
