"""Classify a transformers rotary function by running it: which :class:`Mapping`, if any, is exact.

Names do not tell (``hy_v4_vl``'s ``apply_rotary_pos_emb`` is interleaved in and out, the other
families' function of that name half-split), so each function is run on a small float64 CPU
input and compared with mlarope's replacement under every candidate mapping:

- pairs interleaved or half-split, in and out (4 layouts), reading the tables as given or only
  their first half (the probe's ``cos``/``sin`` halves differ, independent random angles and
  magnitudes, so a function that reads one half is told from one that reads both);
- for a function of three arguments ``(q, k, freqs_cis)``: complex tables, the 4 layouts;
- for a function of three arguments ``(x, cos, sin)`` (one tensor, DeepSeek-V4's): a whole head
  ``x: [..., N + R]`` wider than its rotation, the 4 layouts with full, first-half or
  half-width tables (one entry per pair, so ``R = 2 * cos.shape[-1]``), its trailing ``R``
  channels rotated and the ``N`` before them passed through; checked again with ``N = 0``.
  Three arguments could be either form: the complex one is tried first, then this one, and the
  numbers decide (a function that neither reproduces is reported with both reasons).

A candidate matches when every element agrees within ``2**-20`` of the probe's scale (``max|x| *
max|table|``, about 1): room for a function that computes in fp32 even for fp64 inputs
(DeepSeek-V2's, hy_v4_vl's: their error is a few ``2**-24``), while a wrong layout, sign or
table half is off by O(1). The matching mapping is then checked on the ``[B, S, H, R]`` layout
(``unsqueeze_dim=2``, DSA indexers) when the function takes it, and probed for ``k=None`` and
for its result dtype (bf16 ``q``, ``k`` with fp32 tables: fp32 = promoted, bf16 = the input's; a
one-tensor function also with fp32 ``x`` and bf16 tables, fp32 under either rule). The inverse
rotation (DeepSeek-V4's call with ``-sin``) needs no mapping of its own: it is the same
function, and the replacement rotates by whatever table it is given. The replacement's mlarope
path on fp64 CPU tensors is mlarope's PyTorch reference: no kernel is launched and nothing
touches a GPU.

A function that no candidate reproduces (a partial rotation, another formula, another signature)
gets a reason instead, and its family is not patched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from ._callables import call_signature, required_positional, wrapper_kind
from ._rotation import Mapping, extra_args_reader, rotate_cos_sin, rotate_freqs_cis, rotate_one

_TOLERANCE = 2.0**-20
_BATCH, _HEADS, _SEQ, _ROPE = 2, 3, 4, 32
# x's width in the one-tensor probe: [nope | rope] with a nope part for either rotated width
# its tables of _ROPE entries can mean (R = 32, or 64 with one entry per pair).
_HEAD = 96

_cache: weakref.WeakKeyDictionary[Callable, Mapping | str] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _probe_inputs(complex_freqs: bool, heads_dim: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    f64 = {"generator": gen, "dtype": torch.float64, "device": "cpu"}
    shape_q = (_BATCH, _HEADS, _SEQ, _ROPE) if heads_dim == 1 else (_BATCH, _SEQ, _HEADS, _ROPE)
    shape_k = (_BATCH, 1, _SEQ, _ROPE) if heads_dim == 1 else (_BATCH, _SEQ, 1, _ROPE)
    q, k = torch.randn(shape_q, **f64), torch.randn(shape_k, **f64)
    if complex_freqs:
        half = _ROPE // 2
        angles = 6.3 * torch.rand(_BATCH, _SEQ, half, **f64)
        return q, k, torch.polar(0.75 + 0.5 * torch.rand(_BATCH, _SEQ, half, **f64), angles)
    angles = 6.3 * torch.rand(_BATCH, _SEQ, _ROPE, **f64)
    scale = 0.75 + 0.5 * torch.rand(_BATCH, _SEQ, _ROPE, **f64)  # an attention factor, per entry
    return q, k, scale * angles.cos(), scale * angles.sin()


def _one_tensor_inputs(heads_dim: int = 1, width: int = _HEAD) -> tuple[torch.Tensor, ...]:
    """``x: [B, H, S, width]`` (``[B, S, H, width]``), ``cos, sin: [B, S, _ROPE]``, fp64."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    f64 = {"generator": gen, "dtype": torch.float64, "device": "cpu"}
    shape = (_BATCH, _HEADS, _SEQ, width) if heads_dim == 1 else (_BATCH, _SEQ, _HEADS, width)
    angles = 6.3 * torch.rand(_BATCH, _SEQ, _ROPE, **f64)
    scale = 0.75 + 0.5 * torch.rand(_BATCH, _SEQ, _ROPE, **f64)
    return torch.randn(shape, **f64), scale * angles.cos(), scale * angles.sin()


def _candidates(complex_freqs: bool) -> list[Mapping]:
    layouts = list(itertools.product((True, False), repeat=2))
    if complex_freqs:
        return [Mapping(i, o, complex_freqs=True) for i, o in layouts]
    return [Mapping(i, o, first_half_tables=h) for h in (False, True) for i, o in layouts]


def _one_tensor_candidates() -> list[Mapping]:
    layouts = list(itertools.product((True, False), repeat=2))
    tables = ({}, {"first_half_tables": True}, {"half_width_tables": True})
    return [Mapping(i, o, one_tensor=True, **t) for t in tables for i, o in layouts]


def _ours(mapping: Mapping, inputs: tuple, heads_dim: int = 1):
    if mapping.complex_freqs:
        return rotate_freqs_cis(mapping, *inputs)
    return rotate_cos_sin(mapping, *inputs, heads_dim)


def _difference(theirs: object, ours: tuple, inputs: tuple, rotated: int = 2) -> float | None:
    """Max elementwise difference relative to the probe's scale, or None if the shapes differ.

    ``inputs``: the ``rotated`` tensors (``q, k``, or a one-tensor function's ``x``), then the
    tables; ``ours`` a tuple (one tensor: ``(x_out,)``, compared with a tensor ``theirs``)."""
    if isinstance(theirs, torch.Tensor) and rotated == 1:
        theirs = (theirs,)
    if not isinstance(theirs, (tuple, list)) or len(theirs) != len(ours):
        return None
    scale = max(float(t.abs().max()) for t in inputs[:rotated] if t is not None)
    scale *= max(float(t.abs().max()) for t in inputs[rotated:])
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if a is None or b is None:
            if a is not b:
                return None
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return None
        worst = max(worst, float((a.double() - b.double()).abs().max()) / scale)
    return worst


def _run(fn: Callable, *args, **kwargs) -> tuple[object, str | None]:
    try:
        with torch.no_grad():
            return fn(*args, **kwargs), None
    except Exception as e:  # the function's own error is the reason it is not patched
        return None, f"{type(e).__name__}: {e}"


def _classify(fn: Callable) -> Mapping | str:
    arity = required_positional(fn)
    if arity is None:
        # Nothing tells the arguments (a plain ``*args, **kwargs`` wrapper): what it computes
        # does, on each argument count a rotary function can take.
        attempts = {n: _classify_arity(fn, n) for n in (4, 3)}
        for result in attempts.values():
            if isinstance(result, Mapping):
                return result
        how = wrapper_kind(fn)
        return (
            f"its signature does not say its arguments ({how or 'a callable'} taking *args, "
            f"**kwargs), and what it computes matched no mapping: as (q, k, cos, sin): "
            f"{attempts[4]}; with three arguments: {attempts[3]}"
        )
    if arity not in (3, 4):
        sig = call_signature(fn)
        how = wrapper_kind(fn)
        return (
            f"its signature {sig} is neither (q, k, cos, sin, ...) nor (q, k, freqs_cis) nor "
            f"(x, cos, sin, ...): no mlarope mapping" + (f" (it is {how})" if how else "")
        )
    return _classify_arity(fn, arity)


def _classify_arity(fn: Callable, arity: int) -> Mapping | str:
    if arity == 4:
        return _classify_pair(fn, complex_freqs=False)
    as_pair = _classify_pair(fn, complex_freqs=True)
    if isinstance(as_pair, Mapping):
        return as_pair
    as_one = _classify_one_tensor(fn)
    if isinstance(as_one, Mapping):
        return as_one
    return f"as (q, k, freqs_cis): {as_pair}; as one tensor (x, cos, sin): {as_one}"


def _closest(best_diff: float, what: str) -> str:
    closest = "no candidate gave outputs of its shapes"
    if best_diff < float("inf"):
        closest = f"the closest candidate is off by {best_diff:.3g} of the probe's scale"
    return (
        f"no exact mlarope mapping: no pair layout (interleaved or half-split, in and out) "
        f"with {what} reproduces it ({closest}); a partial rotation or another formula is never "
        f"patched approximately"
    )


def _classify_pair(fn: Callable, *, complex_freqs: bool) -> Mapping | str:
    """A function of ``(q, k, cos, sin, ...)`` or ``(q, k, freqs_cis)``."""
    inputs = _probe_inputs(complex_freqs)
    theirs, error = _run(fn, *inputs)
    if error is not None:
        return f"it raised on the probe input ({error}); no mlarope mapping checked"

    best, best_diff = None, float("inf")
    for candidate in _candidates(complex_freqs):
        with torch.no_grad():
            ours = _ours(candidate, inputs)
        diff = None if ours is None else _difference(theirs, ours, inputs)
        if diff is not None and diff <= _TOLERANCE:
            best = candidate
            break
        if diff is not None and diff < best_diff:
            best_diff = diff
    if best is None:
        return _closest(best_diff, "full, first-half or complex tables")

    if not complex_freqs and extra_args_reader(fn)((), {"unsqueeze_dim": 2}) == 2:
        inputs2 = _probe_inputs(False, heads_dim=2)
        theirs2, error = _run(fn, *inputs2, unsqueeze_dim=2)
        ours2 = _ours(best, inputs2, heads_dim=2)
        diff = None if error or ours2 is None else _difference(theirs2, ours2, inputs2)
        if diff is None or diff > _TOLERANCE:
            return (
                f"it matches ({best.describe()}) on [B, H, S, R] but not with unsqueeze_dim=2 "
                f"([B, S, H, R]: {error or diff})"
            )

    no_k = (inputs[0], None, *inputs[2:])
    theirs_no_k, error = _run(fn, *no_k)
    k_optional = False
    if error is None:
        ours_no_k = _ours(dataclasses.replace(best, k_optional=True), no_k)
        diff = None if ours_no_k is None else _difference(theirs_no_k, ours_no_k, no_k)
        k_optional = diff is not None and diff <= _TOLERANCE

    mixed = [inputs[0].bfloat16(), inputs[1].bfloat16()]
    mixed += [t.to(torch.complex64 if t.is_complex() else torch.float32) for t in inputs[2:]]
    out, error = _run(fn, *mixed)
    dtypes = {t.dtype for t in out} if error is None and isinstance(out, (tuple, list)) else None
    if dtypes == {torch.bfloat16}:
        result_dtype = "input"
    elif dtypes == {torch.float32}:
        result_dtype = "promoted"
    else:
        return (
            f"it matches ({best.describe()}) in float64, but its result dtype for bf16 q, k with "
            f"fp32 tables is neither bf16 nor fp32 ({error or dtypes})"
        )
    # q and k of different dtypes (a bf16 query beside an fp32 key, as under autocast): the
    # rule above must give each result's dtype, or such calls stay transformers'.
    mixed_dtypes = True
    for q_dtype, k_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        pair = [inputs[0].to(q_dtype), inputs[1].to(k_dtype), *mixed[2:]]
        out, error = _run(fn, *pair)
        got = None
        if error is None and isinstance(out, (tuple, list)):
            got = tuple(t.dtype for t in out)
        promoted = (torch.float32, torch.float32)
        want = (q_dtype, k_dtype) if result_dtype == "input" else promoted
        mixed_dtypes = mixed_dtypes and got == want
    return Mapping(
        best.interleaved_in,
        best.interleaved_out,
        first_half_tables=best.first_half_tables,
        complex_freqs=best.complex_freqs,
        k_optional=k_optional,
        result_dtype=result_dtype,
        mixed_dtypes=mixed_dtypes,
    )


def _one_tensor_difference(
    mapping: Mapping, theirs: object, inputs: tuple, heads_dim: int = 1
) -> float | None:
    """:func:`_difference` of a one-tensor function's result and mlarope's under ``mapping``."""
    with torch.no_grad():
        ours = rotate_one(mapping, *inputs, heads_dim)
    return None if ours is None else _difference(theirs, (ours,), inputs, rotated=1)


def _classify_one_tensor(fn: Callable) -> Mapping | str:
    """A one-tensor function ``f(x, cos, sin, ...)`` that rotates the trailing channels of
    ``x: [..., N + R]`` and passes the others through."""
    inputs = _one_tensor_inputs()
    theirs, error = _run(fn, *inputs)
    if error is not None:
        return f"it raised on the probe input ({error}); no mlarope mapping checked"

    best, best_diff = None, float("inf")
    for candidate in _one_tensor_candidates():
        diff = _one_tensor_difference(candidate, theirs, inputs)
        if diff is not None and diff <= _TOLERANCE:
            best = candidate
            break
        if diff is not None and diff < best_diff:
            best_diff = diff
    if best is None:
        return _closest(best_diff, "full, first-half or half-width tables on x's trailing channels")

    # The same mapping on a head of rope channels only (N = 0), and with unsqueeze_dim=2.
    rope_dim = best.rope_width(_ROPE)
    checks = [("a head of its rope channels only", _one_tensor_inputs(width=rope_dim), 1, {})]
    if extra_args_reader(fn, leading=3)((), {"unsqueeze_dim": 2}) == 2:
        checks.append(
            ("unsqueeze_dim=2 ([B, S, H, D])", _one_tensor_inputs(2), 2, {"unsqueeze_dim": 2})
        )
    for what, check_inputs, heads_dim, kwargs in checks:
        theirs, error = _run(fn, *check_inputs, **kwargs)
        diff = None if error else _one_tensor_difference(best, theirs, check_inputs, heads_dim)
        if diff is None or diff > _TOLERANCE:
            return f"it matches ({best.describe()}) but not on {what}: {error or diff}"

    x, cos, sin = inputs
    out, error = _run(fn, x.bfloat16(), cos.float(), sin.float())
    dtype = out.dtype if error is None and isinstance(out, torch.Tensor) else None
    if dtype not in (torch.bfloat16, torch.float32):
        return (
            f"it matches ({best.describe()}) in float64, but its result dtype for a bf16 x with "
            f"fp32 tables is neither bf16 nor fp32 ({error or dtype})"
        )
    # fp32 x with bf16 tables: fp32 under either rule (x's dtype, or the promoted one).
    out, error = _run(fn, x.float(), cos.bfloat16(), sin.bfloat16())
    other = out.dtype if error is None and isinstance(out, torch.Tensor) else None
    if other != torch.float32:
        return (
            f"it matches ({best.describe()}) in float64, but its result dtype for an fp32 x "
            f"with bf16 tables is not fp32 ({error or other})"
        )
    result_dtype = "input" if dtype == torch.bfloat16 else "promoted"
    return dataclasses.replace(best, result_dtype=result_dtype)


def classify(fn: Callable) -> Mapping | str:
    """The exact :class:`Mapping` of transformers' rotary function ``fn``, or why there is none.

    Cached per function object (a few ms each)."""
    with _cache_lock:
        try:
            hit = _cache.get(fn)
        except TypeError:  # not weak-referenceable: classify every time
            hit = None
        if hit is not None:
            return hit
        result = _classify(fn)
        with contextlib.suppress(TypeError):
            _cache[fn] = result
        return result
