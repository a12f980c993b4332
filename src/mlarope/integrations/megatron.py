"""Make Megatron-Core's Multi-Latent Attention rotate through mlarope.

Usage (see ``docs/megatron.md``)::

    from mlarope.integrations.megatron import apply_mlarope_to_megatron, revert_mlarope_megatron

    apply_mlarope_to_megatron()        # MLA layers with apply_rope_fusion=True now use mlarope
    ...
    revert_mlarope_megatron()          # Megatron-Core's own fused functions again

    with mlarope_patched():            # or only inside a block
        ...

What is patched: the fused MLA RoPE functions as bound by name in the modules that call them
when ``config.apply_rope_fusion`` is set (``from megatron.core.fusions.fused_mla_yarn_rope_apply
import ...``, looked up as module globals each time the attention runs, so layers built before
or after the call are both covered):

- ``megatron.core.transformer.multi_latent_attention`` (``MLASelfAttention``);
- ``megatron.core.transformer.experimental_attention_variant.absorbed_mla``, where present.

In each, every one of ``fused_apply_mla_rope_for_q``, ``fused_apply_mla_rope_for_kv``,
``fused_mla_rope_inplace``, ``fused_mla_rope_out_of_place`` and ``fused_mla_rope_kv_split``
that the module binds is replaced by its twin in :mod:`mlarope.compat.megatron` (same name,
signature and semantics; the key/value functions with the chosen ``rounding``). A name bound
to ``None`` (Megatron's fused module failed to import, e.g. without Triton) is replaced too, so
the fused path works. The fused module itself (``megatron.core.fusions.fused_mla_yarn_rope_apply``)
is left alone, so Megatron's own tests of it still test Megatron's kernels.

Each patch checks itself first: the original functions' positional parameters must be the
ones mlarope mirrors (a Megatron release that changed them is refused), and the replacements
must agree with Megatron-Core's unfused rotation (``rope_utils._apply_rotary_pos_emb_bshd``
with MLA interleaving, the reference Megatron's own tests compare the fused functions with) on
a small fp64 CPU probe. On any mismatch ``RuntimeError`` is raised and nothing is patched.

Applying is reference-counted under a lock: every :func:`apply_mlarope_to_megatron` needs a
:func:`revert_mlarope_megatron`, and Megatron's functions come back with the last one; a
revert with nothing applied is a no-op. All calls while patched must ask for the same
``rounding``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from mlarope.compat import megatron as compat

__all__ = [
    "PATCHED_MODULES",
    "apply_mlarope_to_megatron",
    "is_mlarope_applied_to_megatron",
    "mlarope_patched",
    "revert_mlarope_megatron",
]

# (module, required): the consumers of Megatron's fused MLA RoPE functions.
_MODULES: tuple[tuple[str, bool], ...] = (
    ("megatron.core.transformer.multi_latent_attention", True),
    ("megatron.core.transformer.experimental_attention_variant.absorbed_mla", False),
)
PATCHED_MODULES: tuple[str, ...] = tuple(name for name, _ in _MODULES)

_KV_NAMES = ("fused_apply_mla_rope_for_kv", "fused_mla_rope_kv_split")
_NAMES = (
    "fused_apply_mla_rope_for_q",
    "fused_mla_rope_inplace",
    "fused_mla_rope_out_of_place",
    *_KV_NAMES,
)

_LOCK = threading.Lock()


class _State:
    """What is patched: ``(module name, attr) -> (module, original, replacement)``, how many
    applies are outstanding, and the rounding they asked for."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, str], tuple[ModuleType, object, Callable]] = {}
        self.count = 0
        self.rounding: str | None = None


_STATE = _State()


# ---------------------------------------------------------------------------------------------
# replacements and their self-check
# ---------------------------------------------------------------------------------------------


def _replacement(name: str, rounding: str) -> Callable:
    ours = getattr(compat, name)
    if name in _KV_NAMES:
        fn = functools.partial(ours, rounding=rounding)
        functools.update_wrapper(fn, ours)
        return fn
    return ours


def _positional_names(fn: Callable) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _check_signature(module: str, name: str, original: object) -> None:
    """Megatron's callers pass these arguments positionally: the names and order must match."""
    if original is None:
        return
    try:
        theirs = _positional_names(original)
    except (TypeError, ValueError):  # not introspectable: nothing to compare
        return
    ours = _positional_names(getattr(compat, name))
    if theirs != ours:
        raise RuntimeError(
            f"{module}.{name} takes ({', '.join(theirs)}), but mlarope.compat.megatron.{name} "
            f"mirrors ({', '.join(ours)}); this Megatron-Core version is not supported, so "
            f"nothing was patched"
        )


# The unfused rotation's MLA interleaving flag: Megatron-LM's main branch, then the name the
# megatron-core releases (0.16 on PyPI) still use.
_MLA_FLAGS = ("mla_rotary_interleaved", "multi_latent_attention")


def _mla_flag(reference: Callable) -> str:
    try:
        params = inspect.signature(reference).parameters
    except (TypeError, ValueError):  # not introspectable: the current name
        return _MLA_FLAGS[0]
    for flag in _MLA_FLAGS:
        if flag in params:
            return flag
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _MLA_FLAGS[0]  # a wrapper that forwards keywords: the current name
    raise RuntimeError(
        f"Megatron-Core's _apply_rotary_pos_emb_bshd takes neither {' nor '.join(_MLA_FLAGS)} "
        f"(its parameters: {', '.join(params)}); the self-check cannot run it with MLA "
        f"interleaving, so nothing was patched"
    )


def _probe(rounding: str) -> None:
    """The replacements against Megatron-Core's unfused MLA rotation on a small fp64 CPU probe
    (sbhd; mlarope's PyTorch backend, no kernel launch); raise RuntimeError if they disagree."""
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except ImportError as e:
        raise RuntimeError(
            f"the self-check needs megatron.core.models.common.embeddings.rope_utils ({e}); "
            f"nothing was patched"
        ) from e
    gen = torch.Generator(device="cpu").manual_seed(0)
    seq, batch, heads, nope, rope, k_dim, v_dim = 5, 2, 3, 4, 32, 6, 5
    f64 = {"generator": gen, "dtype": torch.float64}
    freqs = 6.0 * torch.rand(seq, 1, 1, rope, **f64)  # the two halves differ on purpose
    mscale = 1.25
    cos, sin = mscale * freqs.cos(), mscale * freqs.sin()
    q = torch.randn(seq, batch, heads, nope + rope, **f64)
    kv = torch.randn(seq, batch, heads, k_dim + v_dim, **f64)
    k_pe = torch.randn(seq, batch, 1, rope, **f64)

    reference = rope_utils._apply_rotary_pos_emb_bshd
    flag = _mla_flag(reference)

    def unfused(x: torch.Tensor) -> torch.Tensor:
        return reference(x, freqs, **{flag: True}, mscale=mscale)

    with torch.no_grad():
        try:
            want_q = torch.cat((q[..., :nope], unfused(q[..., nope:])), dim=-1)
            want_k = torch.cat((kv[..., :k_dim], unfused(k_pe).expand(-1, -1, heads, -1)), -1)
        except Exception as e:
            raise RuntimeError(
                f"the self-check could not run Megatron-Core's _apply_rotary_pos_emb_bshd on a "
                f"small fp64 CPU input ({type(e).__name__}: {e}); nothing was patched"
            ) from e
        got_q = _replacement("fused_apply_mla_rope_for_q", rounding)(
            q.clone(), cos, sin, nope, rope, None, 0, 1
        )
        got_k, got_v = _replacement("fused_apply_mla_rope_for_kv", rounding)(
            kv, k_pe, cos, sin, rope, k_dim, v_dim, None, 0, 1
        )
    pairs = ((got_q, want_q), (got_k, want_k), (got_v, kv[..., k_dim:]))
    worst = max(float((a - b).abs().max()) for a, b in pairs)
    if worst > 1e-12:  # fp64 both ways; a wrong layout, sign or table half is off by O(1)
        raise RuntimeError(
            f"mlarope.compat.megatron disagrees with Megatron-Core's unfused MLA rotation on a "
            f"self-check input (max abs difference {worst:.3g}); this Megatron-Core version "
            f"may have changed its semantics, so nothing was patched"
        )


# ---------------------------------------------------------------------------------------------
# patching and undo
# ---------------------------------------------------------------------------------------------


def _check_rounding(rounding: object) -> str:
    if not isinstance(rounding, str):
        raise TypeError(f"rounding must be a str, got {rounding!r} ({type(rounding).__name__})")
    if rounding not in compat.ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {compat.ROUNDING_MODES}, got {rounding!r}")
    return rounding


def _import_modules() -> list[ModuleType]:
    modules = []
    for name, required in _MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:
            if required:
                raise ImportError(
                    f"mlarope.integrations.megatron: cannot import {name} ({e}); it needs "
                    f"Megatron-Core with Multi-Latent Attention (megatron-core, or a Megatron-LM "
                    f"checkout on sys.path)"
                ) from e
    return modules


def _patch(rounding: str) -> None:
    modules = _import_modules()
    targets = [(m, n) for m in modules for n in _NAMES if hasattr(m, n)]
    if not any(m.__name__ == _MODULES[0][0] for m, _ in targets):
        raise RuntimeError(
            f"{_MODULES[0][0]} binds none of {_NAMES}; this Megatron-Core version is not "
            f"supported, so nothing was patched"
        )
    for module, name in targets:
        _check_signature(module.__name__, name, getattr(module, name))
    _probe(rounding)
    for module, name in targets:  # every check passed: patch them all
        replacement = _replacement(name, rounding)
        _STATE.active[(module.__name__, name)] = (module, getattr(module, name), replacement)
        setattr(module, name, replacement)


def _unpatch() -> None:
    for (module_name, name), (module, original, replacement) in _STATE.active.items():
        if getattr(module, name, None) is replacement:
            setattr(module, name, original)
        else:
            warnings.warn(
                f"{module_name}.{name} was replaced by something else after mlarope patched it; "
                f"left as it is",
                RuntimeWarning,
                stacklevel=3,
            )
    _STATE.active.clear()


def apply_mlarope_to_megatron(*, rounding: str = "megatron") -> None:
    """Make Megatron-Core's MLA attention (``apply_rope_fusion=True``) rotate through mlarope.

    Replaces the fused MLA RoPE functions bound in ``multi_latent_attention`` (and the absorbed
    MLA variant, where present) with :mod:`mlarope.compat.megatron`'s, for every layer in the
    process, existing or future. Reference-counted: each call needs one
    :func:`revert_mlarope_megatron`.

    Args:
        rounding: the key/value functions' ``k_pos_emb`` gradient rounding: ``"megatron"``
            (default; rounded where Megatron-Core rounds, so the fused and unfused paths of a
            model agree) or ``"exact"`` (correctly rounded). See
            :func:`mlarope.compat.megatron.fused_mla_rope_kv_split`.

    Raises:
        ImportError: Megatron-Core (with ``multi_latent_attention``) cannot be imported.
        RuntimeError: the installed Megatron-Core failed the self-check (nothing patched).
        ValueError: ``rounding`` is not one of ``("megatron", "exact")``, or differs from the
            one the patch in place was applied with.
    """
    rounding = _check_rounding(rounding)
    with _LOCK:
        if _STATE.count and rounding != _STATE.rounding:
            raise ValueError(
                f"mlarope is already applied to Megatron-Core with rounding={_STATE.rounding!r}; "
                f"revert it before applying rounding={rounding!r}"
            )
        if _STATE.count == 0:
            _patch(rounding)
            _STATE.rounding = rounding
        _STATE.count += 1


def revert_mlarope_megatron() -> None:
    """Undo one :func:`apply_mlarope_to_megatron`; the last one puts Megatron-Core's own
    functions back (the same objects). A no-op when nothing is applied."""
    with _LOCK:
        if _STATE.count == 0:
            return
        _STATE.count -= 1
        if _STATE.count == 0:
            _unpatch()
            _STATE.rounding = None


def is_mlarope_applied_to_megatron() -> bool:
    """True while every function the patch replaced is still mlarope's."""
    with _LOCK:
        if not _STATE.count:
            return False
        return all(
            getattr(module, name, None) is replacement
            for (_, name), (module, _, replacement) in _STATE.active.items()
        )


@contextmanager
def mlarope_patched(*, rounding: str = "megatron") -> Iterator[None]:
    """:func:`apply_mlarope_to_megatron` for the ``with`` block (one reference, released on
    exit)."""
    apply_mlarope_to_megatron(rounding=rounding)
    try:
        yield
    finally:
        revert_mlarope_megatron()
