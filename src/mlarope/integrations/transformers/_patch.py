"""The families of the installed transformers, and putting their replacements in place and back.

A family is one modeling module with an MLA attention (``deepseek_v3``, ``glm4_moe_lite``, ...).
The names that select it are its package name and the model types that run on its code
(``sarvam_mla``, ``kimi_k25`` and ``deepseek_v3`` all select ``deepseek_v3``;
``dots3_note_text`` selects ``dots3_note``). Patching a family replaces, in its module, each
rotary function its attention calls (``_discovery``) by mlarope's replacement under the mapping
the probe found (``_probe``); a family with a function of no exact mapping is not patched at
all.

Patching is process-wide, so it is reference-counted under one lock, per family: the patch is
in place while ``apply_*`` holds it (at most once) or any ``mlarope_patched`` block, in any
thread, is open; the original function objects come back when the last holder lets go.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from . import _discovery, _probe
from ._rotation import ROPE_DIMS, Mapping, make_replacement

# (module name, attribute) -> (the function that was there, our replacement)
_ACTIVE: dict[tuple[str, str], tuple[Callable, Callable]] = {}
# Who holds each family's patch: apply_* (at most once) and open mlarope_patched blocks
# (counted). Everything below that reads or changes the patch state does so under _LOCK.
_APPLIED: set[str] = set()
_BLOCKS: dict[str, int] = {}
_LOCK = threading.RLock()
_DISCOVERY: _discovery.Discovery | None = None


@dataclass(frozen=True)
class Family:
    """One MLA modeling module of the installed transformers and what the patch does with it."""

    name: str  # the package: "deepseek_v3"
    module: str  # "transformers.models.deepseek_v3.modeling_deepseek_v3"
    model_types: tuple[str, ...]  # the model types that run on it (names that select it)
    attention: tuple[str, ...]  # its MLA attention classes
    calls: tuple[_discovery.RotaryCall, ...]
    mappings: dict[str, Mapping | str]  # rotary function -> its mapping, or why it has none

    @property
    def patchable(self) -> bool:
        return bool(self.mappings) and all(isinstance(m, Mapping) for m in self.mappings.values())

    @property
    def reason(self) -> str:
        """Why the family is not patched ("" when it is)."""
        if not self.mappings:
            return (
                "nothing to patch: its MLA attention calls no rotary function (no rotary "
                "position embedding)"
            )
        bad = [f"{name}: {m}" for name, m in self.mappings.items() if isinstance(m, str)]
        return "not patched: " + "; ".join(bad) if bad else ""


def discovery() -> _discovery.Discovery:
    """The installed transformers' MLA modules (scanned once per process)."""
    global _DISCOVERY
    with _LOCK:
        if _DISCOVERY is None:
            _DISCOVERY = _discovery.discover()
        return _DISCOVERY


def import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"mlarope.integrations.transformers: cannot import {name} ({e})") from e


def _unpatched(module: ModuleType, attr: str) -> Callable | None:
    """The function transformers put there: the original while mlarope's patch is recorded,
    also when something else has since been put over mlarope's replacement (a wrapper that
    may call it; :func:`patch` leaves that in place with a warning)."""
    active = _ACTIVE.get((module.__name__, attr))
    if active is not None:
        return active[0]
    current = getattr(module, attr, None)
    return current if callable(current) else None


def family(name: str) -> Family:
    """The family ``name`` selects (a package name or a model type running on it)."""
    found = discovery()
    package = found.model_types.get(name, name) if isinstance(name, str) else None
    if package not in found.modules:
        raise ValueError(
            f"model_type must name an MLA family of the installed transformers "
            f"({found.version}): one of {sorted(names())}, got {name!r}"
        )
    entry = found.modules[package]
    with _LOCK:
        module = import_module(entry.module)
        mappings: dict[str, Mapping | str] = {}
        for fn_name in entry.functions:
            fn = _unpatched(module, fn_name)
            mappings[fn_name] = (
                f"the module has no function {fn_name}" if fn is None else _probe.classify(fn)
            )
    aliases = [package] + [
        t
        for t, p in found.model_types.items()
        if p == package and (t in found.config_classes or t in found.composites)
    ]
    return Family(
        name=package,
        module=entry.module,
        model_types=tuple(dict.fromkeys(aliases)),
        attention=entry.attention,
        calls=entry.calls,
        mappings=mappings,
    )


def names() -> set[str]:
    """Every name :func:`family` takes."""
    found = discovery()
    return (
        set(found.modules)
        | {t for t in found.model_types if t in found.config_classes}
        | set(found.composites)
    )


def families() -> list[Family]:
    return [family(p) for p in sorted(discovery().modules)]


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def _attention_layers(fam: Family, model: torch.nn.Module) -> list[torch.nn.Module]:
    module = import_module(fam.module)
    classes = tuple(c for c in (getattr(module, n, None) for n in fam.attention) if c is not None)
    return [m for m in model.modules() if classes and isinstance(m, classes)]


def check_model_type(model: object, what: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{what} must be a torch.nn.Module (a transformers model with an MLA attention), got "
            f"{type(model).__name__}"
        )
    return model


def families_of(model: torch.nn.Module) -> list[Family]:
    """The families whose attention layers ``model`` contains (only the modeling modules the
    model's own classes come from are imported)."""
    used = {type(m).__module__ for m in model.modules()}
    found = discovery()
    candidates = [p for p, entry in sorted(found.modules.items()) if entry.module in used]
    return [f for f in map(family, candidates) if _attention_layers(f, model)]


def check_model(fam: Family, model: torch.nn.Module) -> None:
    """``model`` has ``fam``'s attention, with rope widths mlarope rotates."""
    layers = _attention_layers(fam, model)
    if not layers:
        raise ValueError(
            f"model ({type(model).__name__}) has no {' / '.join(fam.attention)} layer; the "
            f"{fam.name} patch covers transformers' {fam.name} attention only"
        )
    for layer in layers:
        # The layer's own width, else its config's (DeepSeek-V4's attention keeps none)
        rope_dim = getattr(layer, "qk_rope_head_dim", None)
        if rope_dim is None:
            rope_dim = getattr(getattr(layer, "config", None), "qk_rope_head_dim", None)
        if rope_dim is None or rope_dim == 0:  # a layer without rotary embedding (NoPE)
            continue
        if rope_dim not in ROPE_DIMS:
            raise ValueError(
                f"model's qk_rope_head_dim is {rope_dim}, but mlarope rotates rope widths "
                f"{ROPE_DIMS} only; the patch would hand every call back to transformers' own "
                f"function"
            )


# ---------------------------------------------------------------------------------------------
# patching and undo (the caller holds _LOCK)
# ---------------------------------------------------------------------------------------------


def _ours(module: ModuleType, attr: str) -> bool:
    active = _ACTIVE.get((module.__name__, attr))
    return active is not None and getattr(module, attr, None) is active[1]


def require_patchable(fam: Family) -> None:
    if fam.patchable:
        return
    if not fam.mappings:
        raise ValueError(f"{fam.name}: {fam.reason}")
    raise RuntimeError(
        f"{fam.name}: {fam.reason}; nothing was patched ({_versions()}). The family keeps "
        f"transformers' own functions and runs as before; `mlarope info` lists every family and "
        f"why. Where a transformers release changed the function, a transformers release this "
        f"mlarope lists as tested (docs/transformers.md) patches it"
    )


def _versions() -> str:
    """``transformers 5.25.0, kernels 0.19.1`` (the packages a refusal depends on)."""
    from ._report_cache import installed_version

    return ", ".join(f"{d} {installed_version(d)}" for d in ("transformers", "kernels"))


def patch(fam: Family) -> None:
    """Put mlarope's replacements in place (those not already there)."""
    require_patchable(fam)
    module = import_module(fam.module)
    new: dict[str, tuple[Callable, Callable]] = {}
    for name, mapping in fam.mappings.items():
        if _ours(module, name):
            continue
        if (module.__name__, name) in _ACTIVE:
            # Ours was replaced by something else since (another library's wrapper, which may
            # call ours): wrapping that again would lose transformers' function for revert.
            warnings.warn(
                f"{module.__name__}.{name} was replaced by something else after mlarope "
                f"patched it; left as it is",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        original = getattr(module, name)
        new[name] = (original, make_replacement(original, mapping, name))
    for name, (original, replacement) in new.items():  # every one was classified: patch all
        _ACTIVE[(module.__name__, name)] = (original, replacement)
        setattr(module, name, replacement)


def _revert_attr(module: ModuleType, attr: str) -> None:
    active = _ACTIVE.pop((module.__name__, attr), None)
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
            stacklevel=4,
        )


def unpatch(fam: Family) -> None:
    """Put the original functions back."""
    module = import_module(fam.module)
    for name in fam.mappings:
        _revert_attr(module, name)


def applied_in_place(module_name: str, names: list[str]) -> bool:
    """Every one of ``names`` in ``module_name`` is mlarope's replacement (no import: a module
    that is not loaded has nothing patched)."""
    module = sys.modules.get(module_name)
    with _LOCK:
        return module is not None and bool(names) and all(_ours(module, n) for n in names)


def is_applied(fam: Family) -> bool:
    """Every rotary function of ``fam`` is currently mlarope's replacement."""
    module = import_module(fam.module)
    with _LOCK:
        return bool(fam.mappings) and all(_ours(module, n) for n in fam.mappings)


def held_by_apply() -> list[str]:
    """The families an ``apply_*`` call holds."""
    with _LOCK:
        return sorted(_APPLIED)


def apply(fams: list[Family]) -> None:
    """``apply_*``: patch, and hold the patch (once, however often it is called)."""
    with _LOCK:
        for fam in fams:
            require_patchable(fam)
        for fam in fams:
            patch(fam)
            _APPLIED.add(fam.name)


def revert(fams: list[Family]) -> None:
    """``revert_*``: release apply's hold; unpatch where no open block still holds the patch."""
    with _LOCK:
        for fam in fams:
            _APPLIED.discard(fam.name)
            if not _BLOCKS.get(fam.name):
                unpatch(fam)


def enter_block(fams: list[Family]) -> None:
    with _LOCK:
        for fam in fams:
            require_patchable(fam)
        for fam in fams:
            patch(fam)
            _BLOCKS[fam.name] = _BLOCKS.get(fam.name, 0) + 1


def exit_block(fams: list[Family]) -> None:
    with _LOCK:
        for fam in fams:
            _BLOCKS[fam.name] -= 1
            if not _BLOCKS[fam.name]:
                del _BLOCKS[fam.name]
                if fam.name not in _APPLIED:
                    unpatch(fam)
