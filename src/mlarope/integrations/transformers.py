"""Make Hugging Face transformers' DeepSeek-V3 / DeepSeek-V2 attention rotate through mlarope.

Usage (see ``docs/transformers.md``)::

    from mlarope.integrations.transformers import apply_mlarope_to_deepseek_v3

    apply_mlarope_to_deepseek_v3()          # or apply_mlarope_to_deepseek_v3(model=model)
    ...                                     # every DeepSeek-V3 model in the process uses mlarope
    revert_mlarope_deepseek_v3()            # transformers' own functions again

    with mlarope_patched("deepseek_v3"):    # or only inside a block
        ...

What is patched: the module-level rotary functions that the attention's ``forward`` looks up
by name when it runs, so models built before or after the call are both covered:

- ``transformers.models.deepseek_v3.modeling_deepseek_v3``: ``apply_rotary_pos_emb``
  (``config.rope_interleave=False``: half-split pairs ``(x[j], x[half + j])`` in and out, pair
  ``j`` rotated by ``cos[..., j]`` and ``cos[..., half + j]``) and
  ``apply_rotary_pos_emb_interleave`` (``rope_interleave=True``, the default: interleaved pairs
  ``(x[2j], x[2j + 1])`` in, half-split out; transformers 5.24 reads only the first half of the
  tables, ``cos[..., :half]``, for both members of a pair, and older releases read both halves:
  the self-check finds out which, below). ``q, k: [B, H, S, R]`` (``unsqueeze_dim=1``) or
  ``[B, S, H, R]`` (``unsqueeze_dim=2``), ``cos, sin: [B or 1, S, R]``.
- ``transformers.models.deepseek_v2.modeling_deepseek_v2``: ``apply_rotary_emb`` (interleaved
  pairs in and out, ``freqs_cis: [B or 1, S, R / 2]`` complex).

Mapping onto mlarope: transformers hands the attention cos/sin already gathered per token
(``[Bc, S, R]``, ``Bc`` = 1 or B, attention factor folded in by its rotary embedding). They are
passed to :func:`mlarope.apply_rope_q` as a table of ``Bc * S`` rows (a free reshape) with
``position_ids[b, s] = b * S + s`` (``b`` = 0 when ``Bc`` = 1): the same numbers transformers
multiplies by, for any rope type, scaling, position offset or KV-cache step, and nothing is
recomputed from the config. DeepSeek-V2's complex ``freqs_cis`` becomes ``cat(re, re)`` and
``cat(im, im)``, and a function that reads only the first half of cos/sin gets
``cat(cos[..., :half], cos[..., :half])`` (one small copy of ``Bc * S * R`` per table): tables
whose halves differ are rotated exactly as the replaced function rotates them. Queries and
keys go in as a ``bshd`` view (``q.transpose(1, 2)``: no copy; the last dim stays contiguous)
and come back as the same view of mlarope's output, so shapes and dtypes are the ones
transformers returns (strides may differ: the result is a transposed view of a contiguous
``[B, S, H, R]`` tensor).
The shared key ``k_pe: [B, 1, S, R]`` goes through the same query op with one head.

Numerics: mlarope computes in fp32 (fp64 for fp64 tensors) and rounds once. transformers'
DeepSeek-V3 functions compute in the promoted dtype of ``q`` and ``cos`` (so for bf16 models in
bf16, three roundings per element); DeepSeek-V2's computes in fp32 even for fp64 tensors. The
result dtype is always transformers' (``promote_types(q.dtype, cos.dtype)`` for V3, ``q.dtype``
for V2).

Anything mlarope cannot take is handed to the function that was replaced, unchanged: a rope
width other than 32, 64 or 128, tables of another shape, tensors on different devices, tables
that require grad or carry a forward-mode tangent (mlarope does not differentiate tables),
other ``unsqueeze_dim`` values or unknown extra arguments, empty tensors. Pass ``model=`` to
have the rope width checked up front.

Each patch checks itself when applied: the replacement and the function it replaces are run on
a tiny fp64 CPU probe whose cos/sin halves differ (so a function that reads one half is told
from one that reads both), and a mismatch (a transformers release that changed the functions'
semantics) raises ``RuntimeError`` and patches nothing.

Patching is process-wide, thread-safe and reference-counted (one lock): the patch is in place
while ``apply_mlarope_to_*`` holds it (applying twice is a no-op; reverting releases that hold
and is a no-op when there is none) or while any ``mlarope_patched`` block, in any thread, is
open. The original function objects come back when the last holder lets go: a block that
another thread's block or an ``apply_mlarope_to_*`` call still needs is not unpatched under it,
and a revert inside an open block takes effect when the block exits.

Read from transformers 5.24.0 (``models/deepseek_v3/modeling_deepseek_v3.py``,
``models/deepseek_v2/modeling_deepseek_v2.py``); facts only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

import mlarope
from mlarope._checks import ROPE_DIMS

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "apply_mlarope_to_deepseek_v2",
    "apply_mlarope_to_deepseek_v3",
    "is_mlarope_applied",
    "mlarope_patched",
    "revert_mlarope_deepseek_v2",
    "revert_mlarope_deepseek_v3",
]

_REAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class _Target:
    """One module-level function to replace and how its rope pairs are laid out."""

    attr: str
    interleaved_in: bool
    interleaved_out: bool
    complex_freqs: bool  # DeepSeek-V2: (xq, xk, freqs_cis) instead of (q, k, cos, sin, ...)
    # Whether the function reads only cos[..., :half] / sin[..., :half] (the pair's angle) and
    # uses it for both members of the pair. A candidate: the self-check picks what the installed
    # function does (``_variants``).
    first_half_tables: bool = False


@dataclass(frozen=True)
class _Family:
    module: str
    attention: str  # the attention class, to check a model passed as ``model=``
    targets: tuple[_Target, ...]


_FAMILIES: dict[str, _Family] = {
    "deepseek_v3": _Family(
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3Attention",
        (
            _Target("apply_rotary_pos_emb", False, False, False),
            _Target("apply_rotary_pos_emb_interleave", True, False, False),
        ),
    ),
    "deepseek_v2": _Family(
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        "DeepseekV2Attention",
        (_Target("apply_rotary_emb", True, True, True),),
    ),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)

# (module name, attribute) -> (the function that was there, our replacement)
_ACTIVE: dict[tuple[str, str], tuple[Callable, Callable]] = {}
# Who holds each model type's patch: apply_mlarope_to_* (at most once) and open
# mlarope_patched blocks (counted). Everything below that reads or changes the patch state
# does so under _LOCK.
_APPLIED: set[str] = set()
_BLOCKS: dict[str, int] = {}
_LOCK = threading.RLock()


# ---------------------------------------------------------------------------------------------
# the rotation: transformers' arguments -> mlarope.apply_rope_q, or None when it cannot take them
# ---------------------------------------------------------------------------------------------


def _token_dims(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, heads_dim: int
) -> tuple[int, int] | None:
    """``(Bc, S)`` when ``q, k`` (4-D, heads at ``heads_dim``) and ``table: [Bc, S, *]`` agree."""
    seq_dim = 2 if heads_dim == 1 else 1
    batch, seq = q.shape[0], q.shape[seq_dim]
    if k.shape[0] != batch or k.shape[seq_dim] != seq or table.shape[1] != seq:
        return None
    if table.shape[0] not in (1, batch) or q.numel() == 0 or k.numel() == 0:
        return None
    return table.shape[0], seq


def _usable(
    q: object, k: object, tables: tuple[object, ...], rope_dim: int, *, complex_ok: bool
) -> bool:
    tensors = (q, k, *tables)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or any(t.dim() != 3 for t in tables):
        return False
    if q.dtype not in _REAL_DTYPES or k.dtype not in _REAL_DTYPES:
        return False
    if not all(t.dtype in _REAL_DTYPES or (complex_ok and t.is_complex()) for t in tables):
        return False
    if rope_dim not in ROPE_DIMS or q.shape[-1] != rope_dim or k.shape[-1] != rope_dim:
        return False
    if any(t.device != q.device for t in tensors):
        return False
    # mlarope does not differentiate the tables: keep transformers' path when they need a
    # gradient or carry a forward-mode tangent.
    if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
        return False
    return not (
        forward_ad._current_level >= 0
        and any(forward_ad.unpack_dual(t).tangent is not None for t in tables)
    )


def _rotate(
    x: torch.Tensor,
    heads_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
    target: _Target,
) -> torch.Tensor:
    """Rotate ``x: [B, H, S, R]`` (``heads_dim=1``) or ``[B, S, H, R]`` (2) -> the same shape."""
    xb = x.transpose(1, 2) if heads_dim == 1 else x  # [B, S, H, R], a view
    if xb.dtype != dtype:
        xb = xb.to(dtype)
    if xb.stride(-1) != 1:
        xb = xb.contiguous()
    out = mlarope.apply_rope_q(
        xb, cos, sin, layout="bshd", position_ids=position_ids,
        interleaved=target.interleaved_in, interleaved_out=target.interleaved_out,
    )  # fmt: skip
    return out.transpose(1, 2) if heads_dim == 1 else out


def _flat_table(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``[Bc, S, R]`` -> ``[Bc * S, R]`` with a contiguous last dim (a view when it can be)."""
    t = t.reshape(rows, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_ids(batch_rows: int, seq: int, device: torch.device) -> torch.Tensor:
    """``position_ids[b, s] = b * S + s``: row ``(b, s)`` of the flattened gathered table."""
    return torch.arange(batch_rows * seq, device=device).view(batch_rows, seq)


def _rotate_cos_sin(
    target: _Target, q: object, k: object, cos: object, sin: object, heads_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3's ``(q, k, cos, sin)`` through mlarope, or None if it cannot take them."""
    rope_dim = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else 0
    if not _usable(q, k, (cos, sin), rope_dim, complex_ok=False):
        return None
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        return None
    dims = _token_dims(q, k, cos, heads_dim)
    if dims is None:
        return None
    batch_rows, seq = dims
    cos2, sin2 = _flat_table(cos, batch_rows * seq), _flat_table(sin, batch_rows * seq)
    if target.first_half_tables:  # each pair's angle is in the first half: both halves get it
        half = rope_dim // 2
        cos2 = torch.cat((cos2[:, :half], cos2[:, :half]), dim=-1)
        sin2 = torch.cat((sin2[:, :half], sin2[:, :half]), dim=-1)
    ids = _row_ids(batch_rows, seq, q.device)
    # transformers computes q * cos + rotate_half(q) * sin: the promoted dtype of q and cos.
    q_dtype = torch.promote_types(q.dtype, cos.dtype)
    k_dtype = torch.promote_types(k.dtype, cos.dtype)
    return (
        _rotate(q, heads_dim, cos2, sin2, ids, q_dtype, target),
        _rotate(k, heads_dim, cos2, sin2, ids, k_dtype, target),
    )


def _rotate_freqs_cis(
    target: _Target, xq: object, xk: object, freqs_cis: object
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V2's ``(xq, xk, freqs_cis)`` through mlarope, or None if it cannot take them."""
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
        return None
    rope_dim = 2 * freqs_cis.shape[-1] if freqs_cis.dim() > 0 else 0
    if not _usable(xq, xk, (freqs_cis,), rope_dim, complex_ok=True):
        return None
    dims = _token_dims(xq, xk, freqs_cis, 1)
    if dims is None:
        return None
    batch_rows, seq = dims
    real, imag = freqs_cis.real, freqs_cis.imag
    cos = torch.cat((real, real), dim=-1).reshape(batch_rows * seq, rope_dim)
    sin = torch.cat((imag, imag), dim=-1).reshape(batch_rows * seq, rope_dim)
    ids = _row_ids(batch_rows, seq, xq.device)
    # transformers returns .type_as(xq) / .type_as(xk)
    return (
        _rotate(xq, 1, cos, sin, ids, xq.dtype, target),
        _rotate(xk, 1, cos, sin, ids, xk.dtype, target),
    )


def _extra_args_reader(original: Callable) -> Callable[[tuple, dict], int | None]:
    """Read ``unsqueeze_dim`` from the arguments after ``(q, k, cos, sin)``, by the original's
    signature (older transformers put ``position_ids`` before it; both versions ignore
    ``position_ids``). Returns the heads dim of ``q`` (1 or 2), or None: hand over the call."""
    try:
        params = list(inspect.signature(original).parameters.values())[4:]
    except (TypeError, ValueError):
        params = []
    by_position = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]

    def heads_dim(args: tuple, kwargs: dict) -> int | None:
        if not args and not kwargs:
            return 1
        if len(args) > len(by_position):
            return None
        given = dict(zip(by_position, args, strict=False))
        if set(given) & set(kwargs):
            return None
        given.update(kwargs)
        if not set(given) <= {"position_ids", "unsqueeze_dim"}:
            return None
        default = next((p.default for p in params if p.name == "unsqueeze_dim"), 1)
        dim = given.get("unsqueeze_dim", default)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -4 <= dim <= 3:
            return None
        dim = dim + 4 if dim < 0 else dim  # cos [Bc, S, R] is unsqueezed into 4-D
        return dim if dim in (1, 2) else None

    return heads_dim


def _make_replacement(original: Callable, target: _Target) -> Callable:
    if target.complex_freqs:

        def rope(xq, xk, freqs_cis, *args, **kwargs):
            out = None if args or kwargs else _rotate_freqs_cis(target, xq, xk, freqs_cis)
            return original(xq, xk, freqs_cis, *args, **kwargs) if out is None else out

    else:
        read_heads_dim = _extra_args_reader(original)

        def rope(q, k, cos, sin, *args, **kwargs):
            heads_dim = read_heads_dim(args, kwargs)
            out = None if heads_dim is None else _rotate_cos_sin(target, q, k, cos, sin, heads_dim)
            return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    functools.update_wrapper(rope, original)
    rope.__doc__ = (
        f"mlarope replacement of transformers' ``{target.attr}`` (see "
        f"mlarope.integrations.transformers); falls back to the original for inputs mlarope "
        f"cannot take.\n\n{original.__doc__ or ''}"
    )
    return rope


# ---------------------------------------------------------------------------------------------
# self-check, patching and undo
# ---------------------------------------------------------------------------------------------


def _variants(target: _Target) -> tuple[_Target, ...]:
    """What the installed function may do with ``target``'s tables: a cos/sin function may read
    both halves (transformers' ``apply_rotary_pos_emb``, and ``..._interleave`` before 5.24) or
    the first half only (``..._interleave`` in 5.24)."""
    if target.complex_freqs:
        return (target,)
    return (target, dataclasses.replace(target, first_half_tables=True))


def _probe(original: Callable, target: _Target) -> _Target:
    """Run the replacement's mlarope path and the original on a tiny fp64 CPU input (mlarope's
    PyTorch reference path, no kernel launch) and return the variant of ``target`` that agrees
    with the original; raise if none does. The tables' halves differ (independent random
    angles and magnitudes), so a replacement that reads the wrong half disagrees."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, heads, seq, rope_dim = 2, 3, 4, 32
    f64 = {"generator": gen, "dtype": torch.float64, "device": "cpu"}
    q = torch.randn(batch, heads, seq, rope_dim, **f64)
    k = torch.randn(batch, 1, seq, rope_dim, **f64)
    if target.complex_freqs:
        angles = 6.0 * torch.rand(batch, seq, rope_dim // 2, **f64)
        inputs = (q, k, torch.polar(1.25 + torch.rand(batch, seq, rope_dim // 2, **f64), angles))
    else:
        angles = 6.0 * torch.rand(batch, seq, rope_dim, **f64)
        scale = 1.25 + torch.rand(batch, seq, rope_dim, **f64)  # attention factor-like
        inputs = (q, k, scale * angles.cos(), scale * angles.sin())
    try:
        with torch.no_grad():
            theirs = tuple(original(*inputs))
    except Exception as e:
        raise RuntimeError(
            f"the self-check could not run transformers' {target.attr} on a small fp64 CPU "
            f"input ({type(e).__name__}: {e}); nothing was patched"
        ) from e
    worst = float("inf")
    for variant in _variants(target):
        with torch.no_grad():
            if variant.complex_freqs:
                ours = _rotate_freqs_cis(variant, *inputs)
            else:
                ours = _rotate_cos_sin(variant, *inputs, 1)
        if ours is None:  # cannot happen for this input; guards the probe itself
            raise RuntimeError(f"mlarope could not take the self-check input for {target.attr}")
        same_shapes = len(theirs) == 2 and all(
            isinstance(b, torch.Tensor) and a.shape == b.shape
            for a, b in zip(ours, theirs, strict=True)
        )
        # transformers' DeepSeek-V2 function rotates in fp32 even for fp64 inputs: allow for
        # that (values here are O(1); a wrong layout, sign or table half is off by O(1)).
        if same_shapes:
            pairs = zip(ours, theirs, strict=True)
            diff = max(float((a - b.double()).abs().max()) for a, b in pairs)
            if diff <= 1e-5:
                return variant
            worst = min(worst, diff)
    raise RuntimeError(
        f"mlarope's replacement of transformers' {target.attr} disagrees with the installed "
        f"function on a self-check input (max abs difference {worst:.3g}); this transformers "
        f"version may have changed its semantics, so nothing was patched"
    )


def _family(model_type: object) -> _Family:
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    return _FAMILIES[model_type]


def _import(model_type: str):
    family = _family(model_type)
    try:
        return importlib.import_module(family.module)
    except ImportError as e:
        raise ImportError(
            f"mlarope.integrations.transformers: cannot import {family.module} ({e}); "
            f"{model_type} needs a transformers release that has it"
        ) from e


def _check_model(model_type: str, module, model: object) -> None:
    family = _FAMILIES[model_type]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (a transformers {model_type} model) or None, got "
            f"{type(model).__name__}"
        )
    attention_cls = getattr(module, family.attention, None)
    layers = [m for m in model.modules() if attention_cls and isinstance(m, attention_cls)]
    if not layers:
        raise ValueError(
            f"model ({type(model).__name__}) has no {family.attention} layer; "
            f"apply_mlarope_to_{model_type} patches transformers' {model_type} attention only"
        )
    for layer in layers:
        rope_dim = getattr(layer, "qk_rope_head_dim", None)
        if rope_dim not in ROPE_DIMS:
            raise ValueError(
                f"model's qk_rope_head_dim is {rope_dim}, but mlarope rotates rope widths "
                f"{ROPE_DIMS} only (DeepSeek-V2/V3 use 64); without model= the patch would hand "
                f"every call back to transformers' own function"
            )


def _present(module, family: _Family) -> list[_Target]:
    return [t for t in family.targets if callable(getattr(module, t.attr, None))]


def _ours(module, attr: str) -> bool:
    active = _ACTIVE.get((module.__name__, attr))
    return active is not None and getattr(module, attr, None) is active[1]


def _patch(model_type: str, model: object) -> None:
    """Put mlarope's replacements in place (those not already there); the caller holds _LOCK."""
    module = _import(model_type)
    family = _FAMILIES[model_type]
    if model is not None:
        _check_model(model_type, module, model)
    targets = _present(module, family)
    if not targets:
        names = ", ".join(t.attr for t in family.targets)
        raise RuntimeError(
            f"{family.module} has none of the functions mlarope patches ({names}); this "
            f"transformers version is not supported"
        )
    new: dict[str, tuple[Callable, Callable]] = {}
    for target in targets:
        if _ours(module, target.attr):
            continue  # already applied
        original = getattr(module, target.attr)
        variant = _probe(original, target)
        new[target.attr] = (original, _make_replacement(original, variant))
    for attr, (original, replacement) in new.items():  # all probes passed: patch them all
        _ACTIVE[(module.__name__, attr)] = (original, replacement)
        setattr(module, attr, replacement)


def _revert_attr(module, attr: str) -> None:
    key = (module.__name__, attr)
    active = _ACTIVE.pop(key, None)
    if active is None:
        return
    original, replacement = active
    if getattr(module, attr, None) is replacement:
        setattr(module, attr, original)
    else:
        warnings.warn(
            f"{module.__name__}.{attr} was replaced by something else after mlarope patched it; "
            f"left as it is",
            RuntimeWarning,
            stacklevel=3,
        )


def _unpatch(model_type: str) -> None:
    """Put the original functions back; the caller holds _LOCK."""
    family = _family(model_type)
    try:
        module = importlib.import_module(family.module)
    except ImportError:
        return  # nothing can have been patched
    for target in family.targets:
        _revert_attr(module, target.attr)


def _apply(model_type: str, model: object) -> None:
    """``apply_mlarope_to_*``: patch, and hold the patch (once, however often it is called)."""
    _family(model_type)
    with _LOCK:
        _patch(model_type, model)
        _APPLIED.add(model_type)


def _revert(model_type: str) -> None:
    """``revert_mlarope_*``: release ``apply_mlarope_to_*``'s hold; unpatch if no open block
    still holds the patch."""
    _family(model_type)
    with _LOCK:
        _APPLIED.discard(model_type)
        if not _BLOCKS.get(model_type):
            _unpatch(model_type)


def is_mlarope_applied(model_type: str = "deepseek_v3") -> bool:
    """True when every rotary function of ``model_type`` that the installed transformers has
    is currently mlarope's replacement."""
    family = _family(model_type)
    try:
        module = importlib.import_module(family.module)
    except ImportError:
        return False
    with _LOCK:
        targets = _present(module, family)
        return bool(targets) and all(_ours(module, t.attr) for t in targets)


def apply_mlarope_to_deepseek_v3(model: torch.nn.Module | None = None) -> None:
    """Make transformers' DeepSeek-V3 attention rotate q_pe / k_pe through mlarope.

    Replaces ``apply_rotary_pos_emb`` and ``apply_rotary_pos_emb_interleave`` in
    ``transformers.models.deepseek_v3.modeling_deepseek_v3`` (whichever ``config.rope_interleave``
    selects is the one called), for every DeepSeek-V3 model in the process, existing or future.
    Idempotent. Undo with :func:`revert_mlarope_deepseek_v3`.

    Args:
        model: optional; a model containing ``DeepseekV3Attention`` layers, checked up front
            (``ValueError`` when it has none, or a rope width mlarope does not rotate).

    Raises:
        ImportError: transformers (or its DeepSeek-V3 model) is not installed.
        RuntimeError: the installed functions failed the self-check (nothing patched).
    """
    _apply("deepseek_v3", model)


def revert_mlarope_deepseek_v3() -> None:
    """Put transformers' own DeepSeek-V3 rotary functions back (the same objects). Idempotent."""
    _revert("deepseek_v3")


def apply_mlarope_to_deepseek_v2(model: torch.nn.Module | None = None) -> None:
    """Make transformers' DeepSeek-V2 attention rotate q_pe / k_pe through mlarope.

    Replaces ``apply_rotary_emb`` in ``transformers.models.deepseek_v2.modeling_deepseek_v2``
    (complex ``freqs_cis``; interleaved pairs in and out) for every DeepSeek-V2 model in the
    process. Idempotent. Undo with :func:`revert_mlarope_deepseek_v2`. ``model`` and the
    exceptions are as in :func:`apply_mlarope_to_deepseek_v3`.
    """
    _apply("deepseek_v2", model)


def revert_mlarope_deepseek_v2() -> None:
    """Put transformers' own DeepSeek-V2 rotary function back (the same object). Idempotent."""
    _revert("deepseek_v2")


@contextmanager
def mlarope_patched(
    model_type: str = "deepseek_v3", *, model: torch.nn.Module | None = None
) -> Iterator[None]:
    """Patch ``model_type`` (``"deepseek_v3"`` or ``"deepseek_v2"``) for the ``with`` block.

    The block holds the patch (reference-counted, thread-safe): on exit the original functions
    come back only if no other block, in any thread, is still open and no
    ``apply_mlarope_to_*`` holds it. So a block inside an ``apply_mlarope_to_*`` call, or
    another such block, leaves the patch in place, and one thread leaving its block never
    unpatches another thread's.
    """
    _family(model_type)
    with _LOCK:
        _patch(model_type, model)
        _BLOCKS[model_type] = _BLOCKS.get(model_type, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _BLOCKS[model_type] -= 1
            if not _BLOCKS[model_type]:
                del _BLOCKS[model_type]
                if model_type not in _APPLIED:
                    _unpatch(model_type)
