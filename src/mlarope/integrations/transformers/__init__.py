"""Make Hugging Face transformers' MLA attention rotate through mlarope, for every MLA family.

Usage (see ``docs/transformers.md``)::

    from mlarope.integrations import transformers as mt

    mt.apply_mlarope(model)              # the families whose attention the model contains
    mt.apply_mlarope("glm4_moe_lite")    # or a family / model type by name
    mt.apply_mlarope_to_all()            # every family the installed transformers has
    mt.revert_mlarope(model)             # transformers' own functions again (revert_mlarope_all)
    with mt.mlarope_patched(model):      # or only inside a block (mlarope_patched_all)
        ...
    mt.family_report()                   # which families are patched, and why not

The families are found in the installed transformers, not in a list: every modeling module
whose attention reads a latent rank, ``kv_lora_rank`` or ``q_lora_rank`` (Multi-head Latent
Attention; DeepSeek-V4's reads the latter), every config with such a field through the model
class it runs (``sarvam_mla`` runs DeepSeek-V3's code), and every composite config whose
sub-config is one of those by default, through the sub-model its model builds (``kimi_k25``'s
``text_config`` is a DeepSeek-V3 config). In each, the module-level functions that the
attention, or a module it builds (a DSA indexer, a KV compressor), calls with the rotary
embedding (the ``position_embeddings`` it is handed, or its own rotary embedding's output) are
what gets replaced; the attention looks them up by name when it runs, so models built before or
after the call are both covered. Each function
is classified by running it on a float64 probe against every way mlarope's query op can rotate
(pair layout in and out, full or first-half tables, complex ``freqs_cis``): a function that none
reproduces exactly (a partial rotation, another formula) leaves its family unpatched, with the
reason, and never patched approximately. A one-tensor function (DeepSeek-V4's
``apply_rotary_pos_emb(x, cos, sin)`` on the whole head ``[nope | rope]``) is probed the same
way: its trailing channels are rotated by mlarope's query op and the rest copied in the same
launch. A family whose attention calls no rotary function
(``glm5_next``, ``kimi_linear``: MLA without RoPE) has nothing to patch.

The replacement hands the tables transformers already computed (``cos, sin: [Bc, S, R]``) to
:func:`mlarope.apply_rope_q` as ``Bc * S`` rows with ``position_ids[b, s] = b * S + s``, so the
patched model multiplies by the same numbers for any rope type, scaling, offset or KV-cache
step. It computes in fp32 (fp64 for fp64 tensors) and rounds once; the result dtype is the one
the replaced function returns. Anything mlarope cannot take (a rope width other than 32, 64 or
128, tables that require grad such as mistral_large4's learnable ``alpha`` in training, other
shapes, devices or arguments) goes to the replaced function unchanged.

Patching is process-wide, thread-safe and reference-counted per family (one lock): the patch is
in place while ``apply_*`` holds it (applying twice is a no-op; reverting releases that hold) or
while any ``mlarope_patched`` block, in any thread, is open; the original function objects come
back when the last holder lets go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import _attention, _discovery, _measured, _patch, _report_cache
from ._rotation import Mapping

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "FamilyStatus",
    "FunctionStatus",
    "apply_mlarope",
    "apply_mlarope_attention",
    "apply_mlarope_to_all",
    "apply_mlarope_to_deepseek_v2",
    "apply_mlarope_to_deepseek_v3",
    "family_report",
    "is_mlarope_applied",
    "mlarope_patched",
    "mlarope_patched_all",
    "revert_mlarope",
    "revert_mlarope_all",
    "revert_mlarope_attention",
    "revert_mlarope_deepseek_v2",
    "revert_mlarope_deepseek_v3",
]


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionStatus:
    """One module-level rotary function of a family."""

    name: str  # "apply_rotary_pos_emb_interleave"
    callers: tuple[str, ...]  # "DeepseekV32Attention", "DeepseekV32Indexer (unsqueeze_dim=2)"
    exact: bool  # an exact mlarope mapping exists: the patch replaces it
    mapping: str  # the mapping, or why there is none
    short: str  # the mapping in a few words ("interleaved -> half-split, first-half tables")


@dataclass(frozen=True)
class FamilyStatus:
    """Whether mlarope patches one MLA family of the installed transformers, and why not."""

    name: str  # the family: a modeling package ("deepseek_v3") or a config-only model type
    module: str  # the modeling module it runs on
    model_types: tuple[str, ...]  # names that select it (apply_mlarope("..."))
    attention: tuple[str, ...]  # its MLA attention classes
    status: str  # "patched", "not patched" or "nothing to patch"
    reason: str  # why not ("" when patched)
    functions: tuple[FunctionStatus, ...]
    runs_on: str | None  # a config-only or composite model type: the family whose code it runs
    applied: bool  # the patch is in place now
    # Why apply_mlarope_to_all() leaves a patchable family unpatched ("" when it patches it):
    # its measured training step (mlarope.integrations.transformers._measured).
    off_by_default: str = ""
    # A composite model type: the sub-config through which it runs the family's code
    # ("its text_config (deepseek_v3 by default)"); "" otherwise.
    through: str = ""

    def detail(self) -> str:
        """The functions and their mappings (patched), or the reason (not)."""
        if self.status == "patched":
            text = "; ".join(f"{f.name}: {f.short}" for f in self.functions)
        else:
            text = self.reason.split(": ", 1)[1] if ": " in self.reason else self.reason
        if self.runs_on is not None:
            through = f" through {self.through}" if self.through else ""
            text = f"runs on {self.runs_on}'s modeling code{through}; {text}"
        return text

    def summary(self) -> str:
        """One line: ``name: status: detail`` (and why it is off by default)."""
        off = f"; {self.off_by_default}" if self.off_by_default else ""
        return f"{self.name}: {self.status}: {self.detail()}{off}"


def _callers(fam: _patch.Family, name: str) -> tuple[str, ...]:
    out = []
    for call in fam.calls:
        if call.function == name:
            extra = ", ".join(f"{k}={v}" for k, v in call.keywords)
            out.append(f"{call.caller} ({extra})" if extra else call.caller)
    return tuple(dict.fromkeys(out))


def _status(fam: _patch.Family, name: str, runs_on: str | None, through: str = "") -> FamilyStatus:
    functions = tuple(
        FunctionStatus(n, _callers(fam, n), True, m.describe(), m.short())
        if isinstance(m, Mapping)
        else FunctionStatus(n, _callers(fam, n), False, m, "no exact mapping")
        for n, m in fam.mappings.items()
    )
    if fam.patchable:
        status = "patched"
    elif fam.mappings:
        status = "not patched"
    else:
        status = "nothing to patch"
    return FamilyStatus(
        name=name,
        module=fam.module,
        model_types=(name,) if runs_on else fam.model_types,
        attention=fam.attention,
        status=status,
        reason=fam.reason,
        functions=functions,
        runs_on=runs_on,
        applied=_patch.is_applied(fam),
        off_by_default=_measured.off_by_default(fam.name) if fam.patchable else "",
        through=through,
    )


def _build_report() -> list[FamilyStatus]:
    found = _patch.discovery()
    rows = [_status(f, f.name, None) for f in _patch.families()]
    for model_type, package in found.config_only.items():
        rows.append(_status(_patch.family(package), model_type, package))
    for model_type, composite in found.composites.items():
        through = f"its {composite.sub_config} ({composite.sub_model_type} by default)"
        rows.append(
            _status(_patch.family(composite.package), model_type, composite.package, through)
        )
    for model_type, model_class in found.orphans.items():
        rows.append(
            FamilyStatus(
                name=model_type,
                module="",
                model_types=(model_type,),
                attention=(),
                status="not patched",
                reason=(
                    f"not patched: its config has kv_lora_rank, but its model class "
                    f"{model_class} is in no modeling module with an MLA attention"
                ),
                functions=(),
                runs_on=None,
                applied=False,
            )
        )
    return sorted(rows, key=lambda r: r.name)


def _from_dict(row: dict) -> FamilyStatus:
    functions = tuple(
        FunctionStatus(**{**f, "callers": tuple(f["callers"])}) for f in row["functions"]
    )
    fields = {**row, "functions": functions, "applied": False}
    fields["model_types"], fields["attention"] = tuple(row["model_types"]), tuple(row["attention"])
    status = FamilyStatus(**fields)
    applied = _patch.applied_in_place(status.module, [f.name for f in functions if f.exact])
    return dataclasses.replace(status, applied=applied)


def family_report(*, cache: bool = False) -> tuple[FamilyStatus, ...]:
    """Every MLA family of the installed transformers: patched, or not and why.

    Families are found from transformers' code and configs (nothing is hard-coded, no model
    is built): each modeling module with an MLA attention, each config-only model type with the
    module it runs on, each composite model type whose sub-config is MLA by default with the
    module that serves it (``runs_on``, ``through``), and each config with ``kv_lora_rank``
    whose model has no MLA attention in the modeling code (reported as not patched). Sorted by
    name. ``cache=True`` reads and keeps a copy on disk, keyed by the installed files (``mlarope
    info``: no model module imported when it is current). Raises ImportError without
    transformers."""
    if not cache:
        return tuple(_build_report())
    root = _discovery.transformers_root()
    version = _report_cache.installed_version("transformers")
    key = _report_cache.key(root)
    rows = _report_cache.load(version, key)
    if rows is not None:
        try:
            return tuple(_from_dict(r) for r in rows)
        except (TypeError, KeyError, ValueError):
            pass  # another layout: rebuild
    report = _build_report()
    _report_cache.store(version, key, [dataclasses.asdict(r) for r in report])
    return tuple(report)


def __getattr__(name: str):
    if name == "SUPPORTED_MODEL_TYPES":
        # Every name that selects a family mlarope patches (discovered on first access).
        patchable = {f.name: f for f in _patch.families() if f.patchable}
        names = {t for f in patchable.values() for t in f.model_types}
        found = _patch.discovery()
        names |= {t for t, p in found.config_only.items() if p in patchable}
        names |= {t for t, c in found.composites.items() if c.package in patchable}
        return tuple(sorted(names))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# apply / revert / context managers
# ---------------------------------------------------------------------------------------------


def _select(target: object, what: str) -> list[_patch.Family]:
    """A family name or model type -> that family; a model -> the families it contains."""
    if isinstance(target, str):
        return [_patch.family(target)]
    if not isinstance(target, torch.nn.Module):
        raise TypeError(
            f"{what} must be a family name or model type (a str such as 'deepseek_v3'; "
            f"SUPPORTED_MODEL_TYPES lists those mlarope patches) or a torch.nn.Module (a "
            f"transformers model with an MLA attention), got {type(target).__name__}"
        )
    model = _patch.check_model_type(target, what)
    fams = _patch.families_of(model)
    if not fams:
        raise ValueError(
            f"{what} ({type(model).__name__}) has no MLA attention layer of the installed "
            f"transformers' families ({', '.join(sorted(_patch.discovery().modules))})"
        )
    for fam in fams:
        _patch.check_model(fam, model)
    return fams


def _with_model(fam: _patch.Family, model: object) -> list[_patch.Family]:
    if model is not None:
        _patch.check_model(fam, _patch.check_model_type(model, "model"))
    return [fam]


def apply_mlarope(target: torch.nn.Module | str) -> tuple[str, ...]:
    """Make transformers' MLA attention rotate through mlarope.

    Args:
        target: a model (its families: every MLA attention it contains, checked for rope
            widths mlarope rotates) or a family name / model type (``"glm4_moe_lite"``,
            ``"sarvam_mla"``, ``"dots3_note_text"``).

    Every model of those families in the process uses mlarope, existing or future. Idempotent.
    Undo with :func:`revert_mlarope`.

    Returns:
        The families patched.

    Raises:
        TypeError / ValueError: not a model or a name; an unknown name; a model with no MLA
            attention or a rope width mlarope does not rotate; a family with nothing to patch.
        RuntimeError: a family whose rotary function has no exact mlarope mapping (the reason is
            in the message; nothing is patched).
        ImportError: transformers is not installed.
    """
    fams = _select(target, "target")
    _patch.apply(fams)
    return tuple(f.name for f in fams)


def revert_mlarope(target: torch.nn.Module | str) -> None:
    """Release :func:`apply_mlarope`'s hold on ``target``'s families; transformers' own
    functions (the same objects) come back unless a :func:`mlarope_patched` block still holds
    them. Idempotent."""
    _patch.revert(_select(target, "target"))


def apply_mlarope_attention(model: torch.nn.Module) -> dict[str, str]:
    """Fuse the glue around RoPE in ``model``'s DeepSeek-structured MLA attention layers (the
    attention-level path; docs/transformers.md, "The attention-level path"): the query rotated
    in place in its projection's output, the latent's RMSNorm and ``k_pe``'s rotation in one
    op, the key and value written by the key/value op. A layer whose whole forward the fused
    one does not reproduce (a DSA indexer or another submodule it would not run, another
    scale or split) has its ``expand_kv`` alone replaced when that reproduces it: the key and
    value from the key/value op, the rest the layer's own. Only this model's layers change
    (their ``forward`` or ``expand_kv``). The model's rotary functions are patched too, as in a
    :func:`mlarope_patched` block held until :func:`revert_mlarope_attention`, for the calls
    the fused forward hands back to the layer's own (tables that require grad, other
    arguments) and the layers it does not fuse.

    A layer qualifies by its structure (``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``, the query's projections, the MLA widths; no ``forward`` of its
    own) and by what it computes: the fused forward is run against the layer's own on a short
    random input (in eval mode, on a forked RNG), once per class and instance settings, and a
    layer that differs by more than rounding is left as it is. Idempotent. Undo with
    :func:`revert_mlarope_attention`.

    Returns:
        Per attention class with a ``kv_a_proj_with_mqa``: ``"fused"``, ``"key and value
        fused; the whole forward not: why"`` or ``"not fused: why"``.

    Raises:
        TypeError: ``model`` is not a module. ValueError / RuntimeError: as
            :func:`apply_mlarope`, for a model whose layers are fused (nothing is then fused).
    """
    model = _patch.check_model_type(model, "model")
    with _ATTENTION_LOCK:
        fused = _attention.fuse(model)
        if fused and model not in _ATTENTION_HOLDS:
            try:
                fams = _select(model, "model")
                _patch.enter_block(fams)
            except BaseException:
                _attention.unfuse(model)
                raise
            # Released by revert_mlarope_attention, or when the model is freed.
            _ATTENTION_HOLDS[model] = weakref.finalize(model, _patch.exit_block, fams)
    return _attention.outcome(model)


def revert_mlarope_attention(model: torch.nn.Module) -> None:
    """Give ``model``'s fused attention layers their own forward back and release
    :func:`apply_mlarope_attention`'s hold on its rotary functions (other holders keep theirs).
    Idempotent."""
    model = _patch.check_model_type(model, "model")
    with _ATTENTION_LOCK:
        _attention.unfuse(model)
        hold = _ATTENTION_HOLDS.pop(model, None)
        if hold is not None:
            hold()  # exit_block, once


# The models whose fused layers hold their families' patch (one block each, released by a
# finalizer: on revert, or when the model is freed), and its lock.
_ATTENTION_HOLDS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.finalize] = (
    weakref.WeakKeyDictionary()
)
_ATTENTION_LOCK = threading.RLock()


def _worth_it(*, include_off_by_default: bool) -> list[_patch.Family]:
    """The families ``*_all`` patch: every exactly patchable one, less those whose measured
    training step misses the target unless asked (:mod:`._measured`)."""
    return [
        f
        for f in _patch.families()
        if f.patchable and (include_off_by_default or not _measured.off_by_default(f.name))
    ]


def apply_mlarope_to_all(*, include_off_by_default: bool = False) -> tuple[str, ...]:
    """Patch every family of the installed transformers that mlarope patches exactly and that
    is worth it: a family whose measured training step through mlarope misses the target
    (``family_report()``'s ``off_by_default`` says why) is left as it is unless
    ``include_off_by_default=True``; :func:`apply_mlarope` patches it by name or model.

    Families that are not patched (no exact mapping, nothing to patch) are skipped; see
    :func:`family_report`. Returns the families patched. Undo with :func:`revert_mlarope_all`."""
    fams = _worth_it(include_off_by_default=include_off_by_default)
    _patch.apply(fams)
    return tuple(f.name for f in fams)


def revert_mlarope_all() -> None:
    """Release every :func:`apply_mlarope` / ``apply_mlarope_to_*`` hold (families held only by
    an open :func:`mlarope_patched` block stay patched until it exits)."""
    _patch.revert([_patch.family(name) for name in _patch.held_by_apply()])


def is_mlarope_applied(model_type: str = "deepseek_v3") -> bool:
    """True when every rotary function of ``model_type``'s family is mlarope's replacement."""
    return _patch.is_applied(_patch.family(model_type))


@contextmanager
def _block(fams: list[_patch.Family]) -> Iterator[None]:
    _patch.enter_block(fams)
    try:
        yield
    finally:
        _patch.exit_block(fams)


def mlarope_patched(
    model_type: torch.nn.Module | str = "deepseek_v3", *, model: torch.nn.Module | None = None
) -> contextlib.AbstractContextManager[None]:
    """Patch ``model_type``'s family (a name, or a model: its families) for the ``with`` block.

    ``model=`` (with a name) checks that the model has that family's attention. The block holds
    the patch (reference-counted, thread-safe): on exit the original functions come back only if
    no other block, in any thread, is still open and no ``apply_*`` holds it.
    """
    if isinstance(model_type, str):
        fams = _with_model(_patch.family(model_type), model)
    else:
        if model is not None:
            raise TypeError("mlarope_patched: pass the model once (model_type=model, or a name)")
        fams = _select(model_type, "model_type")
    return _block(fams)


def mlarope_patched_all(
    *, include_off_by_default: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Patch, for the ``with`` block, the families :func:`apply_mlarope_to_all` patches (see
    :func:`mlarope_patched`)."""
    return _block(_worth_it(include_off_by_default=include_off_by_default))


# ---------------------------------------------------------------------------------------------
# the DeepSeek entry points (unchanged API)
# ---------------------------------------------------------------------------------------------


def apply_mlarope_to_deepseek_v3(model: torch.nn.Module | None = None) -> None:
    """Make transformers' DeepSeek-V3 attention rotate q_pe / k_pe through mlarope (also
    ``sarvam_mla`` and Kimi K2 checkpoints, which run on that code).

    Replaces ``apply_rotary_pos_emb`` and ``apply_rotary_pos_emb_interleave`` in
    ``transformers.models.deepseek_v3.modeling_deepseek_v3`` (whichever ``config.rope_interleave``
    selects is the one called). Idempotent. Undo with :func:`revert_mlarope_deepseek_v3`.

    Args:
        model: optional; a model containing ``DeepseekV3Attention`` layers, checked up front
            (``ValueError`` when it has none, or a rope width mlarope does not rotate).
    """
    _patch.apply(_with_model(_patch.family("deepseek_v3"), model))


def revert_mlarope_deepseek_v3() -> None:
    """Put transformers' own DeepSeek-V3 rotary functions back (the same objects). Idempotent."""
    _patch.revert([_patch.family("deepseek_v3")])


def apply_mlarope_to_deepseek_v2(model: torch.nn.Module | None = None) -> None:
    """Make transformers' DeepSeek-V2 attention rotate q_pe / k_pe through mlarope: replaces
    ``apply_rotary_emb`` (complex ``freqs_cis``; interleaved pairs in and out). As
    :func:`apply_mlarope_to_deepseek_v3` otherwise."""
    _patch.apply(_with_model(_patch.family("deepseek_v2"), model))


def revert_mlarope_deepseek_v2() -> None:
    """Put transformers' own DeepSeek-V2 rotary function back (the same object). Idempotent."""
    _patch.revert([_patch.family("deepseek_v2")])
