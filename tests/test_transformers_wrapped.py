"""Forward compatibility: transformers' rotary functions under every wrapper a release may put
around them are recognised by what they compute, not by how they are wrapped.

transformers 5.25 (with the ``kernels`` package) turns ``apply_rotary_pos_emb`` into an
``nn.Module`` whose call is ``(*args, **kwargs)``; a later release may use a plain decorator, a
module of its own, or a wrapper that says nothing of its arguments. Each is put, in turn, in
place of DeepSeek-V3's rotary functions in transformers' real modeling module (discovery reads
that module's source; the wrappers are this file's), and the family is then either patched
exactly (every call reaches mlarope and matches the wrapped function; revert puts the wrapper
back) or refused with a reason that names the wrapper, with nothing patched: never half
patched.

Tolerance: the values are O(1) and both sides compute in fp32 (transformers' function through
the wrapper, mlarope's kernel with one rounding), so they differ by a few fp32 roundings of
``|a*c| + |b*s|`` (about 3), far inside ``1e-5``; a wrong layout, sign or table half is O(1).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _callables, _probe

NAMES = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
INSTALLED = {name: getattr(hf_v3, name) for name in NAMES}
BATCH, SEQ, HEADS, NOPE, ROPE = 2, 8, 3, 16, 32


def rotate_half_rope(q, k, cos, sin, unsqueeze_dim=1):
    """The rotation DeepSeek-V3's ``apply_rotary_pos_emb`` computes: half-split pairs in and
    out, ``x * cos + rotate_half(x) * sin``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def interleave_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The rotation of ``apply_rotary_pos_emb_interleave`` (5.24 on): interleaved pairs in,
    half-split out, each pair by the first half of the tables."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(unsqueeze_dim), sin[..., :half].unsqueeze(unsqueeze_dim)

    def rotate(x):
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    return rotate(q), rotate(k)


PLAIN = {
    "apply_rotary_pos_emb": rotate_half_rope,
    "apply_rotary_pos_emb_interleave": interleave_rope,
}


# The wrappers, each as a release could write it.
def hub_layer_like(fn, *, keep_signature=True):
    """What ``kernels.use_kernel_forward_from_hub`` does to a function: an ``nn.Module``
    instance whose ``forward(*args, **kwargs)`` runs it, the function's signature (``self``
    first) on the forward, or none at all (``keep_signature=False``)."""

    class Layer(torch.nn.Module):
        kernel_layer_name = "rotary_pos_emb"

        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    if keep_signature:
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        params += inspect.signature(fn).parameters.values()
        Layer.forward.__signature__ = inspect.Signature(params)
    return Layer()


def kernels_hub_layer(fn):
    """The real ``kernels`` decorator, where the package is installed (transformers 5.25
    requires it, so both CI lanes have it)."""
    kernels = pytest.importorskip("kernels")
    return kernels.use_kernel_forward_from_hub("rotary_pos_emb")(fn)


def wraps_decorator(fn):
    """A decorator that keeps ``__wrapped__`` (``functools.wraps``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def module_instance(fn):
    """An ``nn.Module`` of transformers' own with the function's arguments on its forward."""

    class Rotary(torch.nn.Module):
        def forward(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            return fn(q, k, cos, sin, position_ids, unsqueeze_dim)

    return Rotary()


def bare_wrapper(fn):
    """A wrapper that says nothing of its arguments: no ``__wrapped__``, ``(*args, **kwargs)``."""

    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _both_forms(name):
    """One forward signature for the module instance: ``position_ids`` before
    ``unsqueeze_dim``, which ``apply_rotary_pos_emb`` does not take."""
    plain = PLAIN[name]
    if name == "apply_rotary_pos_emb":
        return lambda q, k, cos, sin, position_ids=None, unsqueeze_dim=1: plain(
            q, k, cos, sin, unsqueeze_dim=unsqueeze_dim
        )
    return plain


WRAPPERS = {
    "hub_layer_like": hub_layer_like,
    "hub_layer_without_signature": functools.partial(hub_layer_like, keep_signature=False),
    "kernels_hub_layer": kernels_hub_layer,
    "wraps_decorator": wraps_decorator,
    "module_instance": lambda fn: module_instance(fn),
    "bare_wrapper": bare_wrapper,
}


@pytest.fixture
def rope_calls(monkeypatch):
    """Tensors that reach mlarope's query op (a call that fell back to transformers adds none)."""
    calls = []
    for name, count in (("apply_rope_q", 1), ("apply_rope_qk", 2)):
        real = getattr(mlarope, name)

        def counting(*args, _real=real, _count=count, **kwargs):
            calls.extend(tuple(t.shape) for t in args[:_count])
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlarope, name, counting)
    return calls


@pytest.fixture(autouse=True)
def _restore():
    yield
    mt.revert_mlarope_all()
    for name, fn in INSTALLED.items():
        setattr(hf_v3, name, fn)


def _inputs(device):
    """``q: [B, H, S, R]`` (a transposed slice of the fused projection), ``k: [B, 1, S, R]``,
    tables ``[B, S, R]`` with unequal halves (so a function reading one half is told apart)."""
    q_full = torch.randn(BATCH, SEQ, HEADS, NOPE + ROPE, device=device)
    q = q_full[..., NOPE:].transpose(1, 2)
    k = torch.randn(BATCH, 1, SEQ, ROPE, device=device)
    angles = 6.3 * torch.rand(BATCH, SEQ, ROPE, dtype=torch.float64)
    scale = 1.0 + 0.5 * torch.rand(BATCH, SEQ, ROPE, dtype=torch.float64)
    cos, sin = (scale * angles.cos()).float(), (scale * angles.sin()).float()
    return q, k, cos.to(device), sin.to(device)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", NAMES)
def test_a_wrapped_rotary_function_is_patched_exactly(device, rope_calls, wrapper, name):
    fn = _both_forms(name) if wrapper == "module_instance" else PLAIN[name]
    wrapped = WRAPPERS[wrapper](fn)
    setattr(hf_v3, name, wrapped)
    q, k, cos, sin = _inputs(device)
    theirs = wrapped(q, k, cos, sin)

    mt.apply_mlarope_to_deepseek_v3()
    patched = getattr(hf_v3, name)
    assert patched is not wrapped and inspect.isfunction(patched)
    rope_calls.clear()  # the probe's calls
    ours = patched(q, k, cos, sin)
    assert len(rope_calls) == 2, f"{wrapper}: the call fell back to transformers"
    for o, t in zip(ours, theirs, strict=True):
        assert o.shape == t.shape and o.dtype == t.dtype
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)

    mt.revert_mlarope_deepseek_v3()
    assert getattr(hf_v3, name) is wrapped  # the wrapper itself comes back


@pytest.mark.parametrize("wrapper", ["hub_layer_like", "wraps_decorator", "bare_wrapper"])
def test_a_wrapper_that_computes_otherwise_is_refused_and_nothing_is_patched(wrapper):
    """A wrapped function of the opposite angle: no exact mapping. The family is refused with
    the reason (naming how the function is wrapped when its signature says nothing), and its
    other function is left as it was: never half patched."""
    plain = rotate_half_rope

    def opposite_angle(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return plain(q, k, cos, -sin, unsqueeze_dim=unsqueeze_dim)

    wrapped = WRAPPERS[wrapper](opposite_angle)
    hf_v3.apply_rotary_pos_emb_interleave = wrapped
    with pytest.raises(RuntimeError, match=r"apply_rotary_pos_emb_interleave: .*no exact") as e:
        mt.apply_mlarope_to_deepseek_v3()
    if wrapper == "bare_wrapper":
        assert "its signature does not say its arguments" in str(e.value)
    # the refusal names the versions it depends on and what the user can do (issue 35)
    assert f"transformers {transformers.__version__}, kernels " in str(e.value)
    assert "keeps transformers' own functions" in str(e.value)
    assert hf_v3.apply_rotary_pos_emb is INSTALLED["apply_rotary_pos_emb"]
    assert hf_v3.apply_rotary_pos_emb_interleave is wrapped
    assert not mt.is_mlarope_applied("deepseek_v3")


def test_a_module_of_another_signature_is_refused_with_its_wrapper_named():
    """An ``nn.Module`` whose forward takes two tensors: no mapping, and the reason says that
    the function is a module (the cause a user must see), not only ``(*args, **kwargs)``."""

    class TwoArguments(torch.nn.Module):
        kernel_layer_name = "rotary_pos_emb"

        def forward(self, q, k):
            return q, k

    reason = _probe.classify(TwoArguments())
    assert isinstance(reason, str)
    assert "(q, k)" in reason and "hub-kernel layer 'rotary_pos_emb'" in reason


def test_call_signature_reads_what_a_call_runs():
    plain = rotate_half_rope
    want = inspect.signature(plain)
    assert _callables.call_signature(plain) == want
    assert _callables.call_signature(wraps_decorator(plain)) == want
    assert _callables.call_signature(hub_layer_like(plain)) == want
    assert _callables.call_signature(bare_wrapper(plain)) is None
    assert _callables.call_signature(hub_layer_like(plain, keep_signature=False)) is None
    assert _callables.required_positional(hub_layer_like(plain)) == 4


def test_the_installed_functions_are_patched_as_transformers_wraps_them(device, rope_calls):
    """Whatever the installed transformers holds (5.25 with kernels: an ``nn.Module`` for
    ``apply_rotary_pos_emb``), DeepSeek-V3 is patched, and every call reaches mlarope."""
    mt.apply_mlarope_to_deepseek_v3()
    q, k, cos, sin = _inputs(device)
    for name in NAMES:
        rope_calls.clear()
        ours = getattr(hf_v3, name)(q, k, cos, sin)
        theirs = INSTALLED[name](q, k, cos, sin)
        assert len(rope_calls) == 2, name
        for o, t in zip(ours, theirs, strict=True):
            torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


def test_a_plain_wrapper_over_our_patch_is_left_in_place_with_a_warning():
    """Issue 36, item 4: a wrapper without ``functools.wraps`` put over mlarope's replacement,
    then ``apply_mlarope`` again: a ``RuntimeWarning`` and the wrapper left in place, as
    docs/transformers.md says (before: a ``RuntimeError``, the wrapper classified instead of
    transformers' function)."""
    mt.apply_mlarope_to_deepseek_v3()
    ours = hf_v3.apply_rotary_pos_emb

    def foreign(*args, **kwargs):  # a plain wrapper, not functools.wraps
        return ours(*args, **kwargs)

    hf_v3.apply_rotary_pos_emb = foreign
    with pytest.warns(RuntimeWarning, match="replaced by something else"):
        mt.apply_mlarope_to_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is foreign
    with pytest.warns(RuntimeWarning, match="replaced by something else"):
        mt.revert_mlarope_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is foreign
    assert hf_v3.apply_rotary_pos_emb_interleave is INSTALLED["apply_rotary_pos_emb_interleave"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mt.revert_mlarope_deepseek_v3()  # nothing of ours left


_WITHOUT_KERNELS = """
import importlib.util, json, sys
real_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    return None if name == "kernels" else real_find_spec(name, package)
importlib.util.find_spec = find_spec  # transformers asks find_spec whether kernels is there
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from mlarope.integrations import transformers as mt
rows = {r.name: [r.status, [f.short for f in r.functions]] for r in mt.family_report()}
module = isinstance(hf_v3.apply_rotary_pos_emb, torch.nn.Module)
print(json.dumps({"rows": rows, "module": module, "kernels": "kernels" in sys.modules}))
"""


def test_every_family_is_patched_alike_with_and_without_kernels():
    """transformers with the ``kernels`` package wraps some rotary functions as modules; without
    it (hidden from transformers in a subprocess), they are plain functions. Every family's
    status and every function's mapping are the same either way."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_KERNELS], capture_output=True, text=True, env=env,
        timeout=300, check=True,
    ).stdout  # fmt: skip
    without = json.loads(out.strip().splitlines()[-1])
    assert not without["module"] and not without["kernels"]
    here = {r.name: [r.status, [f.short for f in r.functions]] for r in mt.family_report()}
    assert without["rows"] == here
    assert all(status == "patched" or not fns for status, fns in here.values()), here


def test_the_report_cache_key_follows_kernels(monkeypatch):
    """Issue 36: installing ``kernels`` changes what transformers' rotary functions are, so the
    cached family report (``mlarope info``) must not outlive it. (Before: the key held Python,
    torch and transformers only, and showed deepseek_v3 "patched" while apply_mlarope raised.)"""
    from mlarope.integrations.transformers import _discovery, _report_cache

    root = _discovery.transformers_root()
    real = _report_cache.installed_version
    keys = set()
    for kernels in ("?", "0.18.3", "0.19.1"):
        monkeypatch.setattr(
            _report_cache,
            "installed_version",
            lambda dist, _k=kernels: _k if dist == "kernels" else real(dist),
        )
        keys.add(_report_cache.key(root))
    assert len(keys) == 3
