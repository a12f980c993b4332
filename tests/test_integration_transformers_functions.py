"""The DeepSeek-V3 / V2 rotary functions through mlarope against the functions they replace,
element by element (the bound in ``tests/deepseek_harness.py``): values and gradients, every
layout and table shape, dtypes, extra arguments, ``torch.compile``, and the fallback to
transformers where mlarope cannot take a call.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mlarope.integrations import transformers as mt
from tests import deepseek_harness
from tests.deepseek_harness import (
    BATCH,
    SEQ,
    U32,
    UNIT_ROUNDOFF,
    V2_ORIGINAL,
    V3_NAMES,
    V3_ORIGINAL,
    assert_rotation_close,
    hf_tables,
    hf_v2,
    hf_v3,
    leaf_view,
    needs_v2,
    pair_magnitude,
    rope_inputs,
    unequal_halves,
)

# The harness's fixtures, found by pytest under these names: transformers' own functions in
# place around every test, and the tensors that reach mlarope.
unpatched = deepseek_harness.unpatched
rope_calls = deepseek_harness.rope_calls


V3_CASES = [
    pytest.param(name, heads_dim, rows, layout, id=f"{name}-h{heads_dim}-bc{rows}-{layout}")
    for name in V3_NAMES
    for heads_dim, rows, layout in (
        (1, 1, "fused"), (1, BATCH, "fused"), (1, BATCH, "copy_last"), (2, BATCH, "fused"),
        (2, 1, "copy_last"),
    )
]  # fmt: skip


@pytest.mark.parametrize("name, heads_dim, batch_rows, layout", V3_CASES)
def test_v3_function_matches_transformers(device, rope_calls, name, heads_dim, batch_rows, layout):
    interleaved_in = name == "apply_rotary_pos_emb_interleave"
    q_leaf, k_leaf, q, k = rope_inputs(device, heads_dim, layout)
    cos, sin, _, _ = hf_tables(batch_rows, q.shape[-1], device)
    kwargs = {} if heads_dim == 1 else {"unsqueeze_dim": 2}
    theirs = V3_ORIGINAL[name](q, k, cos, sin, **kwargs)
    mt.apply_mlarope_to_deepseek_v3()
    rope_calls.clear()  # the self-check's calls
    ours = getattr(hf_v3, name)(q, k, cos, sin, **kwargs)
    assert len(rope_calls) == 2, "the call fell back to transformers"

    # per-pair tables (both halves are equal), broadcast like transformers' unsqueeze
    half = cos.shape[-1] // 2
    c = cos[..., :half].double().unsqueeze(heads_dim)
    s = sin[..., :half].double().unsqueeze(heads_dim)
    grads = [torch.randn_like(t) for t in theirs]
    want = torch.autograd.grad(theirs, (q_leaf, k_leaf), grads)
    got = torch.autograd.grad(ours, (q_leaf, k_leaf), grads)
    for what, x, g, o, t, leaf_got, leaf_want in zip(
        ("q", "k"), (q, k), grads, ours, theirs, got, want, strict=True
    ):
        bound = 6 * U32 * pair_magnitude(x, c, s, interleaved_in, False)
        assert_rotation_close(o, t, bound, f"{name} {what}")
        # d/dx is the transpose rotation of g (output layout in, input layout out); the rest of
        # the leaf (nope channels, skipped columns) gets an exact zero from both
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = leaf_view(leaf_bound, what, layout, heads_dim)
        view.copy_(6 * U32 * pair_magnitude(g, c, s, False, interleaved_in))
        assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"{name} d{what}")


@pytest.mark.parametrize("name", V3_NAMES)
def test_v3_function_matches_transformers_on_tables_with_unequal_halves(device, rope_calls, name):
    """``apply_rotary_pos_emb_interleave`` (transformers 5.24) rotates each pair by the first half
    of cos/sin only; ``apply_rotary_pos_emb`` by ``cos[j]`` and ``cos[half + j]``. The
    replacements do the same for any tables, values and gradients. (Before: the interleave
    replacement read both halves, off by up to 6.)"""
    interleaved_in = name == "apply_rotary_pos_emb_interleave"
    q_leaf, k_leaf, q, k = rope_inputs(device, 1, "fused")
    cos, sin = unequal_halves(BATCH, q.shape[-1], device)
    theirs = V3_ORIGINAL[name](q, k, cos, sin)
    mt.apply_mlarope_to_deepseek_v3()
    rope_calls.clear()  # the self-check's calls
    ours = getattr(hf_v3, name)(q, k, cos, sin)
    assert len(rope_calls) == 2, "the call fell back to transformers"

    half = cos.shape[-1] // 2
    c_a, c_b = cos[..., :half].double().abs(), cos[..., half:].double().abs()
    s_a, s_b = sin[..., :half].double().abs(), sin[..., half:].double().abs()
    # Each member of a pair is bounded with the larger table entry it can meet.
    c = (c_a if interleaved_in else torch.maximum(c_a, c_b)).unsqueeze(1)
    s = (s_a if interleaved_in else torch.maximum(s_a, s_b)).unsqueeze(1)
    grads = [torch.randn_like(t) for t in theirs]
    want = torch.autograd.grad(theirs, (q_leaf, k_leaf), grads)
    got = torch.autograd.grad(ours, (q_leaf, k_leaf), grads)
    for what, x, g, o, t, leaf_got, leaf_want in zip(
        ("q", "k"), (q, k), grads, ours, theirs, got, want, strict=True
    ):
        bound = 6 * U32 * pair_magnitude(x, c, s, interleaved_in, False)
        assert_rotation_close(o, t, bound, f"{name} {what}")
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = leaf_view(leaf_bound, what, "fused", 1)
        view.copy_(6 * U32 * pair_magnitude(g, c, s, False, interleaved_in))
        assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"{name} d{what}")


@needs_v2
@pytest.mark.parametrize("batch_rows, layout", [(1, "fused"), (BATCH, "fused"), (1, "copy_last")])
def test_v2_function_matches_transformers(device, rope_calls, batch_rows, layout):
    q_leaf, k_leaf, q, k = rope_inputs(device, 1, layout, heads=4)
    _, _, angles, scale = hf_tables(batch_rows, q.shape[-1], device)
    freqs_cis = torch.polar(torch.full_like(angles, scale), angles).to(torch.complex64).to(device)
    # transformers' V2 function needs a contiguous last dim (view_as_complex); mlarope does not
    theirs = V2_ORIGINAL["apply_rotary_emb"](q.contiguous(), k.contiguous(), freqs_cis)
    mt.apply_mlarope_to_deepseek_v2()
    rope_calls.clear()  # the self-check's calls
    ours = hf_v2.apply_rotary_emb(q, k, freqs_cis)
    assert len(rope_calls) == 2, "the call fell back to transformers"

    c = freqs_cis.real.double().unsqueeze(1)
    s = freqs_cis.imag.double().unsqueeze(1)
    grads = [torch.randn_like(t) for t in theirs]
    want = torch.autograd.grad(theirs, (q_leaf, k_leaf), grads)
    got = torch.autograd.grad(ours, (q_leaf, k_leaf), grads)
    for what, x, g, o, t, leaf_got, leaf_want in zip(
        ("q", "k"), (q, k), grads, ours, theirs, got, want, strict=True
    ):
        assert_rotation_close(o, t, 6 * U32 * pair_magnitude(x, c, s, True, True), f"V2 {what}")
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = leaf_view(leaf_bound, what, layout, 1)
        view.copy_(6 * U32 * pair_magnitude(g, c, s, True, True))
        assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"V2 d{what}")


@pytest.mark.parametrize(
    "q_dtype, table_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
def test_v3_function_dtypes_follow_transformers(device, rope_calls, q_dtype, table_dtype):
    """The result dtype is transformers' (``promote_types(q, cos)``); the values are within the
    bound of that dtype (transformers rounds three times in it, mlarope once)."""
    name = "apply_rotary_pos_emb_interleave"
    _, _, q, k = rope_inputs(device, 1, "fused")
    q, k = q.detach().to(q_dtype), k.detach().to(q_dtype)
    cos, sin, angles, _ = hf_tables(BATCH, q.shape[-1], device, table_dtype)
    theirs = V3_ORIGINAL[name](q, k, cos, sin)
    mt.apply_mlarope_to_deepseek_v3()
    rope_calls.clear()  # the self-check's calls
    ours = getattr(hf_v3, name)(q, k, cos, sin)
    assert len(rope_calls) == 2
    out_dtype = torch.promote_types(q_dtype, table_dtype)
    # the tables as both sides see them (bf16 tables are rounded before anyone multiplies)
    c = cos[..., : angles.shape[-1]].double().unsqueeze(1)
    s = sin[..., : angles.shape[-1]].double().unsqueeze(1)
    for what, x, o, t in zip(("q", "k"), (q, k), ours, theirs, strict=True):
        assert o.dtype == t.dtype == out_dtype
        bound = 6 * UNIT_ROUNDOFF[out_dtype] * pair_magnitude(x, c, s, True, False)
        assert_rotation_close(o, t, bound, f"{what} {q_dtype}/{table_dtype}")


def test_v3_extra_arguments(device, rope_calls):
    """``position_ids`` (unused by transformers too) and ``unsqueeze_dim`` by keyword or position,
    as the original's signature places them."""
    _, _, q, k = rope_inputs(device, 1, "fused")
    cos, sin, _, _ = hf_tables(1, q.shape[-1], device)
    mt.apply_mlarope_to_deepseek_v3()
    rope_calls.clear()  # the self-check's calls
    base = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    for args, kwargs in (
        ((None,), {}),
        ((None, 1), {}),
        ((), {"position_ids": None, "unsqueeze_dim": -3}),
    ):
        out = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin, *args, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(out, base, strict=True))
    out = hf_v3.apply_rotary_pos_emb(q, k, cos, sin, 1)
    assert len(rope_calls) == 2 * 5
    assert out[0].shape == q.shape and out[1].shape == k.shape
    # an argument the original does not know is handed over, so transformers' own error shows
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        hf_v3.apply_rotary_pos_emb(q, k, cos, sin, bogus=1)
    assert len(rope_calls) == 2 * 5


def test_v3_function_compiles_fullgraph(device, rope_calls):
    """The replacement traces without graph breaks (dynamo's aot_eager: no C++ compiler needed)."""
    name = "apply_rotary_pos_emb_interleave"
    q_leaf, _, q, k = rope_inputs(device, 1, "fused")
    cos, sin, _, _ = hf_tables(1, q.shape[-1], device)
    mt.apply_mlarope_to_deepseek_v3()
    rope = getattr(hf_v3, name)

    def step(q_leaf, k, cos, sin):
        q_out, k_out = rope(q_leaf[..., 16:].transpose(1, 2), k, cos, sin)
        return q_out.square().sum() + k_out.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    (got,) = torch.autograd.grad(compiled(q_leaf, k.detach(), cos, sin), q_leaf)
    (want,) = torch.autograd.grad(step(q_leaf, k.detach(), cos, sin), q_leaf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_v3_falls_back_where_mlarope_cannot(device, rope_calls):
    """Inputs mlarope does not take are handed to transformers' function: same result, same
    autograd (here: a rope width of 16, tables that require grad, tables with a tangent)."""
    name = "apply_rotary_pos_emb"
    mt.apply_mlarope_to_deepseek_v3()
    rope_calls.clear()  # the self-check's calls
    q = torch.randn(BATCH, 3, SEQ, 16, device=device)
    k = torch.randn(BATCH, 1, SEQ, 16, device=device)
    cos, sin = torch.randn(2, 1, SEQ, 16, device=device).unbind(0)
    ours, theirs = getattr(hf_v3, name)(q, k, cos, sin), V3_ORIGINAL[name](q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))

    _, _, q, k = rope_inputs(device, 1, "fused")
    cos, sin, _, _ = hf_tables(1, q.shape[-1], device)
    cos.requires_grad_()
    out = getattr(hf_v3, name)(q, k, cos, sin)
    (out[0].sum() + out[1].sum()).backward()
    assert cos.grad is not None
    assert rope_calls == []

    # Tables with a forward-mode tangent: transformers' function differentiates them (mlarope
    # would raise; before, this raised inside the model).
    from torch.autograd import forward_ad as fwAD

    q, k, cos = q.detach(), k.detach(), cos.detach()
    with fwAD.dual_level():
        dual = fwAD.make_dual(cos, torch.ones_like(cos))
        ours = [fwAD.unpack_dual(t) for t in getattr(hf_v3, name)(q, k, dual, sin)]
        theirs = [fwAD.unpack_dual(t) for t in V3_ORIGINAL[name](q, k, dual, sin)]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.primal, b.primal) and torch.equal(a.tangent, b.tangent)
    assert rope_calls == []
