"""The probe: exact mappings only (each rotary function classified by what it computes, one
that is not an exact mlarope rotation refused), the dtypes of mixed query and key, and a
function that changes, or that another library wraps, after the patch.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch, _rotation
from tests import families_harness
from tests.families_harness import PATCHED

# The harness's fixtures, found by pytest under these names: one intra-op thread for the tiny
# models, and every family unpatched after each test.
one_thread = families_harness.one_thread
unpatched_after = families_harness.unpatched_after


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _half_split(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _partial(q, k, cos, sin, unsqueeze_dim=1):
    """Rotates the first half of the channels only (another model's partial rotary)."""
    h = q.shape[-1] // 2
    c, s = cos[..., : h // 2].repeat(1, 1, 2), sin[..., : h // 2].repeat(1, 1, 2)
    (qr, kr), rest = (
        _half_split(q[..., :h], k[..., :h], c, s, unsqueeze_dim),
        (q[..., h:], k[..., h:]),
    )
    return torch.cat((qr, rest[0]), -1), torch.cat((kr, rest[1]), -1)


def _inverse(q, k, cos, sin, unsqueeze_dim=1):
    """The opposite angle: another formula."""
    return _half_split(q, k, cos, -sin, unsqueeze_dim)


def _fp32_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """Interleaved in and out, first half of the tables, in fp32, returning q.dtype (Ernie's)."""
    h = cos.shape[-1] // 2
    c = cos[..., :h].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim).float()
    s = sin[..., :h].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim).float()

    def rot(x):
        pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return (x.float() * c + pairs.float() * s).to(x.dtype)

    return rot(q), None if k is None else rot(k)


def _interleaved_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


def _v4_style(x, cos, sin, unsqueeze_dim=1):
    """DeepSeek-V4's: the trailing 2 * cos.shape[-1] channels, interleaved in and out,
    half-width tables, fp32 math, result x.dtype; the leading channels passed through."""
    cos = cos.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = (rope.float() * cos + _interleaved_pairs(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _one_half_split(x, cos, sin, unsqueeze_dim=1):
    """One tensor, half-split pairs, full-width tables: its trailing cos.shape[-1] channels."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    return torch.cat([x[..., :-r], x[..., -r:] * cos + _rotate_half(x[..., -r:]) * sin], dim=-1)


def _one_leading(x, cos, sin, unsqueeze_dim=1):
    """Rotates the leading channels and passes the trailing ones: not a trailing slice."""
    cos = cos.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    rope, rest = x[..., :r], x[..., r:]
    return torch.cat([rope * cos + _interleaved_pairs(rope) * sin, rest], dim=-1)


def _one_inverse(x, cos, sin, unsqueeze_dim=1):
    """The opposite angle, in the function itself: another formula (a caller's ``-sin`` is just
    another table)."""
    return _v4_style(x, cos, -sin, unsqueeze_dim)


def _one_needs_nope(x, cos, sin, unsqueeze_dim=1):
    """Right on [nope | rope], but it refuses a head of rope channels only."""
    if x.shape[-1] == 2 * cos.shape[-1]:
        raise ValueError("no nope channels")
    return _v4_style(x, cos, sin, unsqueeze_dim)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (_half_split, "half-split -> half-split"),
        (_fp32_interleaved,
         "interleaved -> interleaved, first-half tables, result q.dtype, k may be None"),
        (_partial, "no exact mlarope mapping"),
        (_inverse, "no exact mlarope mapping"),
        (lambda q, k, cos, sin, extra: (q, k),
         "neither (q, k, cos, sin, ...) nor (q, k, freqs_cis)"),
        (lambda q, k, cos, sin: 1 / 0, "it raised on the probe input (ZeroDivisionError"),
        (lambda q, k, cos, sin, unsqueeze_dim=1: _half_split(q, k, cos, sin),
         "not with unsqueeze_dim=2"),
        (_v4_style, "interleaved -> interleaved, half-width tables, result x.dtype, one tensor"),
        (_one_half_split, "half-split -> half-split, one tensor: its trailing rope channels"),
        (_one_leading, "as one tensor (x, cos, sin): no exact mlarope mapping"),
        (_one_inverse, "as one tensor (x, cos, sin): no exact mlarope mapping"),
        (_one_needs_nope, "but not on a head of its rope channels only: ValueError"),
        (lambda x, cos, sin, unsqueeze_dim=1: _v4_style(x, cos, sin),
         "but not on unsqueeze_dim=2"),
    ],
    ids=["half_split", "fp32_interleaved", "partial", "inverse", "signature", "raises", "dim2",
         "one_tensor_v4", "one_tensor_half_split", "one_tensor_leading", "one_tensor_inverse",
         "one_tensor_needs_nope", "one_tensor_dim2"],
)  # fmt: skip
def test_probe_maps_exact_functions_only(fn, expected):
    from mlarope.integrations.transformers import _probe

    result = _probe.classify(fn)
    text = result.short() if isinstance(result, _rotation.Mapping) else result
    assert text.startswith(expected) or expected in text, text


def _query_dtype_for_both(q, k, cos, sin, unsqueeze_dim=1):
    """hy_v4_vl's rule: fp32 math, both results in q's dtype."""
    out_q, out_k = _fp32_interleaved(q, k.to(q.dtype), cos, sin, unsqueeze_dim)
    return out_q, out_k


def test_probe_finds_the_dtype_rule_for_mixed_query_and_key():
    """A function that returns both results in q's dtype agrees with the per-input rule when q
    and k share a dtype only: calls with two dtypes stay the original's."""
    from mlarope.integrations.transformers import _probe

    same = _probe.classify(_fp32_interleaved)
    both_q = _probe.classify(_query_dtype_for_both)
    assert same.mixed_dtypes and not both_q.mixed_dtypes, (same, both_q)
    assert "q and k of one dtype" in both_q.describe()


@pytest.mark.parametrize("family", PATCHED)
def test_mixed_query_and_key_dtypes(family, device):
    """A bf16 query beside an fp32 key, or the reverse (autocast around an indexer): each
    patched function returns transformers' dtypes and its values within one rounding of the
    result dtype (hy_v4_vl returns both in q's dtype, where a per-input rule kept k's). A
    one-tensor function: a bf16 ``x`` with fp32 tables and the reverse."""
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    gen = torch.Generator().manual_seed(7)
    for name, mapping in fam.mappings.items():
        original = getattr(module, name)
        rope = 64
        if mapping.one_tensor:
            _one_tensor_dtypes(module, name, mapping, family, gen, device)
            continue
        for q_dtype, k_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
            q = torch.randn(2, 3, 5, rope, generator=gen).to(q_dtype).to(device)
            k = torch.randn(2, 1, 5, rope, generator=gen).to(k_dtype).to(device)
            if mapping.complex_freqs:
                angles = torch.rand(2, 5, rope // 2, generator=gen, dtype=torch.float64) * 6
                tables = (torch.polar(torch.ones_like(angles), angles).to(torch.complex64),)
            else:
                angles = torch.rand(2, 5, rope, generator=gen, dtype=torch.float64) * 6
                tables = (angles.cos().float(), angles.sin().float())
            tables = tuple(t.to(device) for t in tables)
            want = original(q, k, *tables)
            with mt.mlarope_patched(family):
                got = getattr(module, name)(q, k, *tables)
            for g, w, what in zip(got, want, ("q", "k"), strict=True):
                assert g.dtype == w.dtype, (name, q_dtype, k_dtype, what, g.dtype, w.dtype)
                ulp = torch.finfo(w.dtype).eps * float(w.double().abs().max())
                err = float((g.double() - w.double()).abs().max())
                assert err <= 2 * ulp, (name, q_dtype, k_dtype, what, err, ulp)


def _one_tensor_dtypes(module, name, mapping, family, gen, device):
    original = getattr(module, name)
    rope, nope = 64, 16
    width = rope // 2 if mapping.half_width_tables else rope
    for x_dtype, table_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        x = torch.randn(2, 3, 5, nope + rope, generator=gen).to(x_dtype).to(device)
        angles = torch.rand(2, 5, width, generator=gen, dtype=torch.float64) * 6
        cos, sin = (t.to(table_dtype).to(device) for t in (angles.cos(), angles.sin()))
        want = original(x, cos, sin)
        with mt.mlarope_patched(family):
            got = getattr(module, name)(x, cos, sin)
        assert got.dtype == want.dtype, (name, x_dtype, table_dtype, got.dtype, want.dtype)
        ulp = torch.finfo(want.dtype).eps * float(want.double().abs().max())
        err = float((got.double() - want.double()).abs().max())
        assert err <= 2 * ulp, (name, x_dtype, table_dtype, err, ulp)
        assert torch.equal(got[..., :nope], want[..., :nope]), "the nope channels are copied"


def test_apply_over_another_librarys_wrapper_keeps_transformers_function():
    """mlarope applied, then another library wraps the function: applying again leaves the
    wrapper alone with a warning instead of wrapping it (which lost transformers' function:
    revert then put the wrapper back and nothing could restore the original)."""
    fam = _patch.family("minicpm3")
    module = importlib.import_module(fam.module)
    name = next(iter(fam.mappings))
    transformers_fn = getattr(module, name)
    mt.apply_mlarope("minicpm3")
    ours = getattr(module, name)

    def wrapper(q, k, cos, sin, *args, **kwargs):
        return ours(q, k, cos, sin, *args, **kwargs)

    setattr(module, name, wrapper)
    try:
        with pytest.warns(RuntimeWarning, match="replaced by something else"):
            mt.apply_mlarope("minicpm3")
        assert getattr(module, name) is wrapper
        with pytest.warns(RuntimeWarning, match="replaced by something else"):
            mt.revert_mlarope("minicpm3")
        assert getattr(module, name) is wrapper
        assert not [k for k in _patch._ACTIVE if k[0] == fam.module]
    finally:
        setattr(module, name, transformers_fn)
    mt.apply_mlarope("minicpm3")  # a clean state patches and reverts as before
    mt.revert_mlarope("minicpm3")
    assert getattr(module, name) is transformers_fn


def test_a_changed_function_unpatches_its_family(device, monkeypatch):
    """A transformers release whose function is a partial rotation: the family is reported
    not patched with the reason, applying it raises and patches nothing, and patching every
    family leaves it out. (A function that changed to another exact layout is followed: the
    probe classifies what is installed.)"""
    module = importlib.import_module(_patch.family("deepseek_v3").module)
    original = module.apply_rotary_pos_emb
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _partial)
    row = {r.name: r for r in mt.family_report()}["deepseek_v3"]
    assert row.status == "not patched"
    assert row.reason.startswith("not patched: apply_rotary_pos_emb: no exact mlarope mapping")
    with pytest.raises(RuntimeError, match=r"no exact mlarope mapping.*nothing was patched"):
        mt.apply_mlarope("deepseek_v3")
    assert module.apply_rotary_pos_emb is _partial
    assert not mt.is_mlarope_applied("deepseek_v3")
    patched = mt.apply_mlarope_to_all(include_off_by_default=True)
    assert "deepseek_v3" not in patched and "deepseek_v32" in patched
    assert module.apply_rotary_pos_emb is _partial
    mt.revert_mlarope_all()

    monkeypatch.setattr(module, "apply_rotary_pos_emb", _fp32_interleaved)
    mt.apply_mlarope("deepseek_v3")
    q, k = torch.randn(2, 3, 8, 32, device=device), torch.randn(2, 1, 8, 32, device=device)
    cos, sin = torch.randn(2, 2, 8, 32, device=device).unbind(1)
    ours, theirs = module.apply_rotary_pos_emb(q, k, cos, sin), _fp32_interleaved(q, k, cos, sin)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # O(1) values, fp32 roundings
    assert module.apply_rotary_pos_emb.__wrapped__ is _fp32_interleaved
    mt.revert_mlarope("deepseek_v3")
    assert module.apply_rotary_pos_emb is _fp32_interleaved
    monkeypatch.setattr(module, "apply_rotary_pos_emb", original)
