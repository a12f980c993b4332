"""mlarope.integrations.transformers: transformers' DeepSeek-V3 / V2 attention through mlarope.

Oracles are transformers itself: the functions the patch replaces, called on the same inputs,
and tiny randomly initialised models run with and without the patch (plus an fp64 copy of the
same model, which measures how much fp32 rounding moves each output). Tolerances:

- one rotation (function level): ``y = a*c - b*s`` (or ``b*c + a*s``) evaluated in the result
  dtype by transformers (two products and an add: within ``3u * (|a*c| + |b*s|)`` of the exact
  value, ``u`` the dtype's unit roundoff) and in fp32 with one final rounding by mlarope (within
  the same bound), so the two differ by at most ``6u * (|a||c| + |b||s|)``, element by element.
  The gradient is the transpose rotation of the upstream gradient: the same bound with ``g``.
- a whole model: see :func:`_assert_within_rounding_noise`.

On the CPU lane the kernels run in Triton's interpreter; fp64 tensors always take mlarope's
PyTorch reference path. Models are tiny (batch 2, seq 8, 2 layers) to keep the file fast.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

import mlarope
from mlarope.integrations import transformers as mt
from tests.errmodel import join_pairs, split_pairs

try:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
except ImportError:  # older transformers: DeepSeek-V2 arrived after DeepSeek-V3
    hf_v2 = None

needs_v2 = pytest.mark.skipif(
    hf_v2 is None, reason="the installed transformers has no DeepSeek-V2 model"
)

V3_NAMES = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
V3_ORIGINAL = {name: getattr(hf_v3, name) for name in V3_NAMES}
V2_ORIGINAL = {"apply_rotary_emb": hf_v2.apply_rotary_emb} if hf_v2 is not None else {}

# DeepSeek-V3's YaRN shape, scaled down. mscale != mscale_all_dim makes the attention factor
# that transformers folds into cos/sin differ from 1 (about 1.065), so it is exercised too.
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 0.5,
}  # fmt: skip
BATCH, SEQ = 2, 8
U32 = 2.0**-24
U64 = 2.0**-53
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float64: U64}


@pytest.fixture(autouse=True)
def _unpatched():
    """Every test starts and ends with transformers' own functions in place."""
    mt.revert_mlarope_deepseek_v3()
    mt.revert_mlarope_deepseek_v2()
    yield
    mt.revert_mlarope_deepseek_v3()
    mt.revert_mlarope_deepseek_v2()
    for name, fn in V3_ORIGINAL.items():
        assert getattr(hf_v3, name) is fn
    for name, fn in V2_ORIGINAL.items():
        assert getattr(hf_v2, name) is fn


@pytest.fixture
def rope_calls(monkeypatch):
    """The shapes of the tensors that reach mlarope (so a silent fallback to transformers is
    visible): ``apply_rope_q`` rotates one, ``apply_rope_qk`` two."""
    calls = []
    for name, tensors in (("apply_rope_q", 1), ("apply_rope_qk", 2)):
        real = getattr(mlarope, name)

        def counting(*args, _real=real, _tensors=tensors, **kwargs):
            calls.extend(tuple(t.shape) for t in args[:_tensors])
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlarope, name, counting)
    return calls


# ---------------------------------------------------------------------------------------------
# function level: the replacement against the function it replaces, element by element
# ---------------------------------------------------------------------------------------------


def _tables(batch_rows, rope_dim, device, dtype=torch.float32):
    """transformers' form: ``cos = scale * cos(cat(f, f))``, ``[Bc, S, R]``; and the per-pair
    halves ``[Bc, S, R / 2]`` (fp64) for the error bound."""
    angles = 40.0 * torch.rand(batch_rows, SEQ, rope_dim // 2, dtype=torch.float64)
    scale = 1.0648
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = (scale * emb.cos()).to(dtype), (scale * emb.sin()).to(dtype)
    return cos.to(device), sin.to(device), angles, scale


def _pair_magnitude(x, c, s, interleaved_in, interleaved_out):
    """``|x_a||c| + |x_b||s|`` and ``|x_b||c| + |x_a||s|`` per pair, in the output layout (fp64).

    ``x: [..., R]``; ``c, s: [..., R / 2]`` broadcastable to ``x``'s pairs."""
    a, b = split_pairs(x.detach().double().abs(), interleaved_in)
    c, s = c.abs(), s.abs()
    return join_pairs(a * c + b * s, b * c + a * s, interleaved_out)


def _assert_rotation_close(ours, theirs, bound, what):
    assert ours.shape == theirs.shape, what
    assert ours.dtype == theirs.dtype, what
    err = (ours.double() - theirs.double()).abs()
    excess = err - bound
    if bool((excess > 0).any()):
        i = tuple(int(j) for j in (excess == excess.max()).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {err.numel()} elements outside the bound; "
            f"worst at {list(i)}: mlarope {ours[i].item()!r}, transformers {theirs[i].item()!r}, "
            f"error {err[i].item():.3e} > bound {bound[i].item():.3e}"
        )


def _inputs(device, heads_dim, layout, heads=3):
    """q, k as transformers makes them: ``q`` a slice of the fused projection (a transposed view
    when ``heads_dim == 1``), ``k`` the positional slice of the compressed kv, ``[B, 1, S, R]``
    (``[B, S, 1, R]``). ``layout="copy_last"`` gives both a non-contiguous last dim instead."""
    nope, rope, latent = 16, 32, 24
    if layout == "copy_last":
        q_leaf = torch.randn(BATCH, SEQ, heads, 2 * rope, device=device, requires_grad=True)
        k_leaf = torch.randn(BATCH, SEQ, 1, 2 * rope, device=device, requires_grad=True)
        q, k = q_leaf[..., ::2], k_leaf[..., ::2]
    else:
        q_leaf = torch.randn(BATCH, SEQ, heads, nope + rope, device=device, requires_grad=True)
        k_leaf = torch.randn(BATCH, SEQ, latent + rope, device=device, requires_grad=True)
        q, k = q_leaf[..., nope:], k_leaf[..., latent:].unsqueeze(2)
    if heads_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q_leaf, k_leaf, q, k


def _leaf_view(full, what, layout, heads_dim):
    """The part of a leaf gradient that the rope input ``q``/``k`` occupies, as ``x``'s shape."""
    nope, latent = 16, 24
    if layout == "copy_last":
        view = full[..., ::2]
    elif what == "q":
        view = full[..., nope:]
    else:
        view = full[..., latent:].unsqueeze(2)
    return view.transpose(1, 2) if heads_dim == 1 else view


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
    q_leaf, k_leaf, q, k = _inputs(device, heads_dim, layout)
    cos, sin, _, _ = _tables(batch_rows, q.shape[-1], device)
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
        bound = 6 * U32 * _pair_magnitude(x, c, s, interleaved_in, False)
        _assert_rotation_close(o, t, bound, f"{name} {what}")
        # d/dx is the transpose rotation of g (output layout in, input layout out); the rest of
        # the leaf (nope channels, skipped columns) gets an exact zero from both
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = _leaf_view(leaf_bound, what, layout, heads_dim)
        view.copy_(6 * U32 * _pair_magnitude(g, c, s, False, interleaved_in))
        _assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"{name} d{what}")


def _unequal_halves(batch_rows, rope_dim, device):
    """Tables whose halves differ (independent angles and magnitudes), which transformers' rotary
    embedding never makes but its functions can be handed: ``[Bc, S, R]``."""
    angles = 6.3 * torch.rand(batch_rows, SEQ, rope_dim, dtype=torch.float64)
    scale = 1.0 + 0.5 * torch.rand(batch_rows, SEQ, rope_dim, dtype=torch.float64)
    cos, sin = (scale * angles.cos()).float(), (scale * angles.sin()).float()
    return cos.to(device), sin.to(device)


@pytest.mark.parametrize("name", V3_NAMES)
def test_v3_function_matches_transformers_on_tables_with_unequal_halves(device, rope_calls, name):
    """``apply_rotary_pos_emb_interleave`` (transformers 5.24) rotates each pair by the first half
    of cos/sin only; ``apply_rotary_pos_emb`` by ``cos[j]`` and ``cos[half + j]``. The
    replacements do the same for any tables, values and gradients. (Before: the interleave
    replacement read both halves, off by up to 6.)"""
    interleaved_in = name == "apply_rotary_pos_emb_interleave"
    q_leaf, k_leaf, q, k = _inputs(device, 1, "fused")
    cos, sin = _unequal_halves(BATCH, q.shape[-1], device)
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
        bound = 6 * U32 * _pair_magnitude(x, c, s, interleaved_in, False)
        _assert_rotation_close(o, t, bound, f"{name} {what}")
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = _leaf_view(leaf_bound, what, "fused", 1)
        view.copy_(6 * U32 * _pair_magnitude(g, c, s, False, interleaved_in))
        _assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"{name} d{what}")


@needs_v2
@pytest.mark.parametrize("batch_rows, layout", [(1, "fused"), (BATCH, "fused"), (1, "copy_last")])
def test_v2_function_matches_transformers(device, rope_calls, batch_rows, layout):
    q_leaf, k_leaf, q, k = _inputs(device, 1, layout, heads=4)
    _, _, angles, scale = _tables(batch_rows, q.shape[-1], device)
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
        _assert_rotation_close(o, t, 6 * U32 * _pair_magnitude(x, c, s, True, True), f"V2 {what}")
        leaf_bound = torch.zeros_like(leaf_want, dtype=torch.float64)
        view = _leaf_view(leaf_bound, what, layout, 1)
        view.copy_(6 * U32 * _pair_magnitude(g, c, s, True, True))
        _assert_rotation_close(leaf_got, leaf_want, leaf_bound, f"V2 d{what}")


@pytest.mark.parametrize(
    "q_dtype, table_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
def test_v3_function_dtypes_follow_transformers(device, rope_calls, q_dtype, table_dtype):
    """The result dtype is transformers' (``promote_types(q, cos)``); the values are within the
    bound of that dtype (transformers rounds three times in it, mlarope once)."""
    name = "apply_rotary_pos_emb_interleave"
    _, _, q, k = _inputs(device, 1, "fused")
    q, k = q.detach().to(q_dtype), k.detach().to(q_dtype)
    cos, sin, angles, _ = _tables(BATCH, q.shape[-1], device, table_dtype)
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
        bound = 6 * UNIT_ROUNDOFF[out_dtype] * _pair_magnitude(x, c, s, True, False)
        _assert_rotation_close(o, t, bound, f"{what} {q_dtype}/{table_dtype}")


def test_v3_extra_arguments(device, rope_calls):
    """``position_ids`` (unused by transformers too) and ``unsqueeze_dim`` by keyword or position,
    as the original's signature places them."""
    _, _, q, k = _inputs(device, 1, "fused")
    cos, sin, _, _ = _tables(1, q.shape[-1], device)
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
    q_leaf, _, q, k = _inputs(device, 1, "fused")
    cos, sin, _, _ = _tables(1, q.shape[-1], device)
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

    _, _, q, k = _inputs(device, 1, "fused")
    cos, sin, _, _ = _tables(1, q.shape[-1], device)
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


# ---------------------------------------------------------------------------------------------
# model level: logits and gradients with and without the patch
# ---------------------------------------------------------------------------------------------


def _v3_model(device, *, rope_interleave, heads=3, q_lora_rank=32, rope_dim=32):
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256, rope_parameters=dict(YARN),
        rope_interleave=rope_interleave, attn_implementation="eager",
        experts_implementation="eager",  # grouped_mm has no fp64 kernel
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).to(device)


def _v2_model(device):
    config = DeepseekV2Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=256, rope_parameters=dict(YARN), attn_implementation="eager",
        experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(config).to(device)


def _run(model, ids, position_ids):
    """Logits and the gradient of the LM loss w.r.t. every parameter, by name."""
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    result = {"logits": out.logits.detach()}
    result.update({n: g for n, g in zip(names, grads, strict=True) if g is not None})
    return result


def _noise_bounds(orig32, truth64, unit=U32):
    """Per tensor: ``2 * max|orig32 - truth64| * (unit / 2**-24) + unit * max|truth64|``.

    ``orig32`` and the patched run are two fp32 evaluations of the same network that differ
    only in how the rope step is rounded (same tables, same formula; mlarope rounds once where
    transformers may round three times, or fuses a multiply-add). Each is therefore within the
    network's own fp32 rounding error of the exact value; ``max|orig32 - truth64|`` measures
    that error on this very input (the rope step's rounding and every other one: projections,
    norms, softmax, routing weights, the loss), so two such evaluations differ by at most
    about twice as much. ``unit`` rescales that measured fp32 noise to another dtype's unit
    roundoff (2**-53 for fp64 runs); ``unit * max|truth|`` is a floor of one rounding at the
    tensor's scale, for a tensor that ``orig32`` happens to get exact. A wrong rotation (pair
    layout, sign, position) moves the outputs by O(1) relative, orders of magnitude above this:
    ``test_v3_model_matches_transformers`` checks that the bound does catch one. (The one way a
    rounding difference could move a model by more is a near-tie in the MoE router's top-k;
    the models and inputs here are seeded, so such a tie would fail every run, not sometimes.)
    """
    bounds = {}
    for name, truth in truth64.items():
        noise = float((orig32[name].double() - truth).abs().max())
        bounds[name] = 2 * noise * (unit / U32) + unit * float(truth.abs().max())
    return bounds


def _assert_within_rounding_noise(got, want, bounds, what):
    assert got.keys() == want.keys(), what
    for name, bound in bounds.items():
        err = float((got[name].double() - want[name].double()).abs().max())
        assert err <= bound, (
            f"{what}: {name} differs by {err:.3e} > rounding-noise bound {bound:.3e}"
        )


def _positions(kind, device):
    if kind == "default":
        return None  # transformers' arange: cos/sin are [1, S, R]
    offsets = torch.tensor([[3], [40]], device=device)  # one row per sequence: [B, S, R]
    return torch.arange(SEQ, device=device)[None] + offsets


@pytest.mark.parametrize(
    "rope_interleave, heads, q_lora_rank, positions",
    [(True, 3, 32, "default"), (False, 4, None, "offsets")],
    ids=["interleave-default_positions", "half_split-offset_positions"],
)  # fmt: skip
def test_v3_model_matches_transformers(device, rope_calls, rope_interleave, heads, q_lora_rank,
                                       positions):  # fmt: skip
    model = _v3_model(device, rope_interleave=rope_interleave, heads=heads, q_lora_rank=q_lora_rank)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    pos = _positions(positions, device)

    orig32, orig64 = _run(model, ids, pos), _run(model64, ids, pos)
    bounds32 = _noise_bounds(orig32, orig64)
    # negative control: the other pair layout (transformers' own function) breaks the bound
    model.config.rope_interleave = not rope_interleave
    with torch.no_grad():
        wrong = model(input_ids=ids, position_ids=pos).logits
    model.config.rope_interleave = rope_interleave
    assert float((wrong - orig32["logits"]).abs().max()) > 100 * bounds32["logits"]

    with mt.mlarope_patched("deepseek_v3", model=model):
        rope_calls.clear()  # the self-check's calls
        patched32, patched64 = _run(model, ids, pos), _run(model64, ids, pos)
    # two runs x two layers x (q_pe, k_pe): every rotation went through mlarope
    assert len(rope_calls) == 2 * 2 * 2, "the model did not rotate through mlarope"
    _assert_within_rounding_noise(patched32, orig32, bounds32, "fp32")
    # fp64: the same argument at fp64's unit roundoff (transformers rotates V3 in fp64)
    _assert_within_rounding_noise(patched64, orig64, _noise_bounds(orig32, orig64, U64), "fp64")


def test_v3_model_kv_cache_decode(device, rope_calls):
    """Prefill then decode one token at a time (cos/sin of one position, offset by the cache)."""
    model = _v3_model(device, rope_interleave=True).eval()
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)

    # the cache argument is `cache` in recent transformers, `past_key_values` before
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def decode(m):
        cache = DynamicCache(config=m.config)
        logits = [m(input_ids=ids[:, :5], use_cache=True, **{cache_arg: cache}).logits]
        for t in range(5, SEQ):
            step = ids[:, t : t + 1]
            logits.append(m(input_ids=step, use_cache=True, **{cache_arg: cache}).logits)
        return {"logits": torch.cat(logits, dim=1)}

    orig32, orig64 = decode(model), decode(model64)
    with mt.mlarope_patched("deepseek_v3"):
        rope_calls.clear()  # the self-check's calls
        patched32 = decode(model)
    assert len(rope_calls) == 2 * 2 * (1 + SEQ - 5)
    _assert_within_rounding_noise(patched32, orig32, _noise_bounds(orig32, orig64), "decode")


@needs_v2
def test_v2_model_matches_transformers(device, rope_calls):
    model = _v2_model(device)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    pos = _positions("offsets", device)
    orig32, orig64 = _run(model, ids, pos), _run(model64, ids, pos)
    bounds32 = _noise_bounds(orig32, orig64)
    with mt.mlarope_patched("deepseek_v2", model=model):
        rope_calls.clear()  # the self-check's calls
        patched32, patched64 = _run(model, ids, pos), _run(model64, ids, pos)
    assert len(rope_calls) == 2 * 2 * 2
    _assert_within_rounding_noise(patched32, orig32, bounds32, "fp32")
    # transformers' V2 rotates in fp32 even in an fp64 model (xq.float()), mlarope in fp64: the
    # difference is fp32 rope rounding, inside the fp32 bound.
    _assert_within_rounding_noise(patched64, orig64, bounds32, "fp64")


# ---------------------------------------------------------------------------------------------
# apply / revert / context manager
# ---------------------------------------------------------------------------------------------


def test_apply_and_revert_are_idempotent():
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v3()  # nothing patched: a no-op
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())

    mt.apply_mlarope_to_deepseek_v3()
    first = {n: getattr(hf_v3, n) for n in V3_NAMES}
    assert all(first[n] is not V3_ORIGINAL[n] for n in V3_NAMES)
    assert all(first[n].__wrapped__ is V3_ORIGINAL[n] for n in V3_NAMES)
    assert first["apply_rotary_pos_emb"].__name__ == "apply_rotary_pos_emb"
    mt.apply_mlarope_to_deepseek_v3()
    assert all(getattr(hf_v3, n) is first[n] for n in V3_NAMES)
    assert mt.is_mlarope_applied("deepseek_v3")

    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)


def test_context_manager_restores_what_was_there():
    with mt.mlarope_patched():
        assert mt.is_mlarope_applied("deepseek_v3")
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)

    with pytest.raises(KeyError), mt.mlarope_patched("deepseek_v3"):
        raise KeyError("inside the block")
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)

    mt.apply_mlarope_to_deepseek_v3()
    patched = {n: getattr(hf_v3, n) for n in V3_NAMES}
    with mt.mlarope_patched("deepseek_v3"):
        pass
    assert all(getattr(hf_v3, n) is patched[n] for n in V3_NAMES)  # still applied


def test_revert_leaves_a_later_foreign_patch():
    mt.apply_mlarope_to_deepseek_v3()

    def foreign(*args, **kwargs):
        return V3_ORIGINAL["apply_rotary_pos_emb"](*args, **kwargs)

    hf_v3.apply_rotary_pos_emb = foreign  # someone patches on top of mlarope
    try:
        with pytest.warns(RuntimeWarning, match="replaced by something else"):
            mt.revert_mlarope_deepseek_v3()
        assert hf_v3.apply_rotary_pos_emb is foreign
        interleave = "apply_rotary_pos_emb_interleave"
        assert getattr(hf_v3, interleave) is V3_ORIGINAL[interleave]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mt.revert_mlarope_deepseek_v3()  # nothing of ours left: a silent no-op
    finally:
        hf_v3.apply_rotary_pos_emb = V3_ORIGINAL["apply_rotary_pos_emb"]


def test_self_check_refuses_changed_semantics(device, monkeypatch, rope_calls):
    """A transformers whose function changed is probed again: one that is now another exact
    rotation (interleaved output, handling unsqueeze_dim) is patched as what it now is; one that
    is no rotation mlarope has (the opposite angle), or one that cannot run on the probe, is
    refused and nothing is patched."""

    def interleaved_out(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        args = (q, k, cos, sin, position_ids, unsqueeze_dim)
        q_embed, k_embed = V3_ORIGINAL["apply_rotary_pos_emb_interleave"](*args)
        half = q.shape[-1] // 2
        relayout = lambda x: torch.stack((x[..., :half], x[..., half:]), -1).flatten(-2)
        return relayout(q_embed), relayout(k_embed)

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", interleaved_out)
    mt.apply_mlarope_to_deepseek_v3()
    _, _, q, k = _inputs(device, 1, "fused")
    q, k = q.detach(), k.detach()
    cos, sin = _unequal_halves(BATCH, q.shape[-1], device)
    rope_calls.clear()
    ours = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    assert len(rope_calls) == 2
    for o, t in zip(ours, interleaved_out(q, k, cos, sin), strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)  # O(1) values, fp32 roundings
    mt.revert_mlarope_deepseek_v3()

    def opposite_angle(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return V3_ORIGINAL["apply_rotary_pos_emb"](q, k, cos, -sin, unsqueeze_dim=unsqueeze_dim)

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", opposite_angle)
    with pytest.raises(
        RuntimeError, match="apply_rotary_pos_emb_interleave: no exact mlarope mapping"
    ):
        mt.apply_mlarope_to_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is V3_ORIGINAL["apply_rotary_pos_emb"]  # nothing patched
    assert hf_v3.apply_rotary_pos_emb_interleave is opposite_angle
    assert not mt.is_mlarope_applied("deepseek_v3")

    def cuda_only(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise RuntimeError("this kernel needs a CUDA tensor")

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", cuda_only)
    with pytest.raises(RuntimeError, match="it raised on the probe input"):
        mt.apply_mlarope_to_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is V3_ORIGINAL["apply_rotary_pos_emb"]


def _interleave_reading(half_of_tables):
    """An ``apply_rotary_pos_emb_interleave`` that reads ``half_of_tables`` of cos/sin: "both"
    (de-interleave, then transformers' rotate_half formula, as releases before 5.24 did) or
    "second" (a wrong half)."""

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        half = cos.shape[-1] // 2
        if half_of_tables == "second":
            cos = torch.cat((cos[..., half:], cos[..., half:]), dim=-1)
            sin = torch.cat((sin[..., half:], sin[..., half:]), dim=-1)
        deinterleave = lambda x: torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        original = V3_ORIGINAL["apply_rotary_pos_emb"]
        return original(deinterleave(q), deinterleave(k), cos, sin, unsqueeze_dim)

    return rope


def test_self_check_probes_with_unequal_halves(device, monkeypatch, rope_calls):
    """The self-check's tables have unequal halves, so it tells which half the installed
    interleave function reads: one that reads the second half is refused (before, with equal
    halves, it passed), one that reads both halves (transformers before 5.24) gets a
    replacement that reads both halves too, equal to it on any tables."""
    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", _interleave_reading("second"))
    with pytest.raises(RuntimeError, match="no exact mlarope mapping"):
        mt.apply_mlarope_to_deepseek_v3()
    assert not mt.is_mlarope_applied("deepseek_v3")

    older = _interleave_reading("both")
    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", older)
    mt.apply_mlarope_to_deepseek_v3()
    _, _, q, k = _inputs(device, 1, "fused")
    q, k = q.detach(), k.detach()
    cos, sin = _unequal_halves(BATCH, q.shape[-1], device)
    rope_calls.clear()
    ours = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    theirs = older(q, k, cos, sin)
    assert len(rope_calls) == 2
    for o, t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)  # O(1) values, fp32 roundings
    mt.revert_mlarope_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb_interleave is older


def test_patched_block_is_reference_counted_across_threads():
    """Thread A enters, thread B enters, A exits: B is still patched until it exits. (Before,
    A's exit restored transformers' functions under B.)"""
    import threading

    a_in, b_in, a_out, b_checked = (threading.Event() for _ in range(4))
    seen = {}

    def thread_a():
        with mt.mlarope_patched("deepseek_v3"):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with mt.mlarope_patched("deepseek_v3"):
            b_in.set()
            a_out.wait(10)
            seen["after A exited"] = mt.is_mlarope_applied("deepseek_v3")
        b_checked.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert b_checked.is_set(), "the threads did not finish"
    assert seen["after A exited"], "A's exit unpatched B's block"
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items()), "the last exit restores"


def test_patch_holders_many_threads():
    """Many threads entering and leaving blocks at once, with apply/revert interleaved: inside a
    block the patch is always in place; after everyone is done, only apply's hold remains."""
    import threading

    errors = []
    start = threading.Barrier(8)

    def worker(i):
        start.wait(10)
        for j in range(20):
            with mt.mlarope_patched("deepseek_v3"):
                if not mt.is_mlarope_applied("deepseek_v3"):
                    errors.append((i, j))
            if i == 0 and j == 10:
                mt.apply_mlarope_to_deepseek_v3()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, f"unpatched inside a block: {errors[:5]}"
    assert mt.is_mlarope_applied("deepseek_v3"), "apply's hold outlives the blocks"
    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())


def test_revert_inside_a_block_waits_for_the_block():
    """``revert_mlarope_*`` releases apply's hold; a block still open keeps the patch until it
    exits."""
    mt.apply_mlarope_to_deepseek_v3()
    with mt.mlarope_patched("deepseek_v3"):
        mt.revert_mlarope_deepseek_v3()
        assert mt.is_mlarope_applied("deepseek_v3")
    assert not mt.is_mlarope_applied("deepseek_v3")
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())


def test_model_argument_is_checked(device):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        mt.apply_mlarope_to_deepseek_v3(model="deepseek")
    with pytest.raises(ValueError, match="has no DeepseekV3Attention layer"):
        mt.apply_mlarope_to_deepseek_v3(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="qk_rope_head_dim is 16"):
        mt.apply_mlarope_to_deepseek_v3(model=_v3_model(device, rope_interleave=True, rope_dim=16))
    assert not mt.is_mlarope_applied("deepseek_v3")  # a refused call patches nothing
    with pytest.raises(ValueError, match="model_type must name an MLA family"):
        mt.mlarope_patched("llama").__enter__()
    mt.apply_mlarope_to_deepseek_v3(model=_v3_model(device, rope_interleave=False))
    assert mt.is_mlarope_applied("deepseek_v3")


@needs_v2
def test_v2_apply_and_revert(device):
    with pytest.raises(ValueError, match="has no DeepseekV2Attention layer"):
        mt.apply_mlarope_to_deepseek_v2(model=_v3_model(device, rope_interleave=True))
    mt.apply_mlarope_to_deepseek_v2()
    mt.apply_mlarope_to_deepseek_v2()
    assert mt.is_mlarope_applied("deepseek_v2")
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v2()
    mt.revert_mlarope_deepseek_v2()
    assert hf_v2.apply_rotary_emb is V2_ORIGINAL["apply_rotary_emb"]


# ---------------------------------------------------------------------------------------------
# worth it: families whose measured training step misses the target are off by default
# ---------------------------------------------------------------------------------------------


def measured_steps(unpatched_4096, ours_4096, unpatched_128, ours_128):
    from mlarope.integrations.transformers import _measured

    return _measured.Measured(
        step_4096=(unpatched_4096, ours_4096), step_128=(unpatched_128, ours_128),
        rotary_4096=(0.30, 0.10),
    )  # fmt: skip


def test_a_family_measured_short_of_the_target_is_off_by_default(monkeypatch):
    """minicpm3 measured at 0.99x at sequence 4096 (target 0.98x): apply_mlarope_to_all and
    mlarope_patched_all leave it, family_report says why with the figures, and a request by
    name (or include_off_by_default) still patches it. deepseek_v3 measured within both targets
    stays on."""
    from mlarope.integrations.transformers import _measured

    monkeypatch.setattr(_measured, "MEASURED", {
        "minicpm3": measured_steps(10.0, 9.9, 4.0, 3.9),
        "deepseek_v3": measured_steps(10.0, 9.5, 4.0, 3.9),
    })  # fmt: skip
    rows = {r.name: r for r in mt.family_report()}
    off = rows["minicpm3"].off_by_default
    assert "0.990x at sequence 4096 (target <= 0.98x)" in off and "2.0%" in off
    assert rows["minicpm3"].status == "patched" and "off by default" in rows["minicpm3"].summary()
    assert rows["deepseek_v3"].off_by_default == ""
    assert rows["glm4_moe_lite"].off_by_default == "", "a family not measured is on"
    patched = mt.apply_mlarope_to_all()
    try:
        assert "minicpm3" not in patched and "deepseek_v3" in patched
        assert not mt.is_mlarope_applied("minicpm3")
        with mt.mlarope_patched_all():
            assert not mt.is_mlarope_applied("minicpm3")
        with mt.mlarope_patched_all(include_off_by_default=True):
            assert mt.is_mlarope_applied("minicpm3")
        assert mt.apply_mlarope("minicpm3") == ("minicpm3",)
        assert mt.is_mlarope_applied("minicpm3")
    finally:
        mt.revert_mlarope_all()
    assert "minicpm3" in mt.apply_mlarope_to_all(include_off_by_default=True)
    mt.revert_mlarope_all()


def test_the_recorded_measurements_name_known_families():
    """Every family of the recorded run is one the integration patches (transformers 5.24,
    the run's version), and each off family's reason carries its figures."""
    from mlarope.integrations.transformers import _measured

    report = {r.name: r for r in mt.family_report()}
    if transformers.__version__ not in _measured.RUN:
        pytest.skip(f"the run measured another transformers ({_measured.RUN})")
    for name, figures in _measured.MEASURED.items():
        assert report[name].status == "patched", name
        assert bool(figures.misses()) == bool(report[name].off_by_default), name


def test_patched_model_runs_under_inference_mode(device):
    """Inference tensors have no version counter: the tables kept per cos/sin object are not
    kept for them (found by review: the patched model raised under torch.inference_mode)."""
    model = _v3_model(device, rope_interleave=True).eval()
    ids = torch.randint(3, 60, (1, 6), device=device)
    with torch.no_grad():
        want = model(ids).logits
    with mt.mlarope_patched("deepseek_v3"), torch.inference_mode():
        got = model(ids).logits
        again = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)


def test_the_off_by_default_reason_names_the_run_that_measured_the_family(monkeypatch):
    """DeepSeek-V4 was measured in run G5, the other families in G4: a family's reason names its
    own run (it named G4 for every family; found by review)."""
    from mlarope.integrations.transformers import _measured

    slower = _measured.Measured(
        step_4096=(10.0, 10.5), step_128=(4.0, 4.2), rotary_4096=(1.0, 0.9), run="G5"
    )
    monkeypatch.setitem(_measured.MEASURED, "deepseek_v4", slower)
    assert "in run G5;" in _measured.off_by_default("deepseek_v4")
