"""The attention-level path: a DeepSeek-structured MLA attention's glue around RoPE, fused.

transformers' DeepSeek-V3 attention (and every family built like it) computes, around its two
rotations, a concatenation of the query (``cat(q_pass, q_rot)``), a key assembled in a new
tensor (``new_empty`` and two ``copy_``, ``k_rot`` expanded over the heads) and an RMSNorm of
the latent read from a strided split of ``kv_a_proj_with_mqa``'s output; their backwards
assemble the query gradient and sum ``k_rot``'s over the heads. The fused forward keeps every
GEMM and the attention call and replaces the rest with three mlarope ops:

- the query: ``q_b_proj``'s (or ``q_proj``'s) output viewed ``[B, S, H, N + R]`` and rotated in
  place (:func:`mlarope.apply_rope_q`, ``inplace=True``): no concatenation, and the backward
  rotates the gradient without assembling it;
- the latent: :func:`mlarope.rmsnorm_rope_latent` reads ``kv_a_proj_with_mqa``'s output
  ``[B, S, L + R]`` once and writes the RMSNorm'd latent and the rotated ``k_pe`` (its backward
  writes the input's gradient in one buffer, and the norm weight's);
- the key and value: :func:`mlarope.apply_rope_kv` reads ``kv_b_proj``'s output and the rotated
  ``k_pe`` once and writes ``k: [B, S, H, N + R]`` and ``v``; its backward sums ``k_pe``'s
  gradient over the heads in the kernel. ``k_pe`` is already rotated, so the op rotates by the
  identity (a one-row table ``cos = 1, sin = 0`` at position 0): ``a * 1 - b * 0`` is ``a``
  exactly for every finite value.

Which attentions qualify is found from the instances, never from class names: the submodules
and widths of the structure (``kv_a_proj_with_mqa``, ``kv_a_layernorm`` with a weight of the
latent's width, ``kv_b_proj``, ``o_proj``, and ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
``q_b_proj``; ``num_heads``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``kv_lora_rank``, ``scaling``), and then by what it computes: the fused forward is run once per
class against the instance's own forward on a short random input, and a class whose outputs
differ by more than rounding is left as it is. The probe also finds the form in which the
class takes its position embeddings: ``(cos, sin)`` tables, or DeepSeek-V2's complex
``freqs_cis`` (adjacent pairs multiplied as complex numbers in fp32 and written back adjacent:
mlarope rotates them interleaved in and out, by the tables ``(re, re)`` and ``(im, im)``). The
families order their forward's parameters differently, so a call is bound by the names of the
layer's own forward. A KV cache keeps what transformers' attention
keeps (the latent and the rotated ``k_pe``); calls the fused path does not take (tables that
require grad, other shapes, arguments that do not bind to the layer's own forward) run that
forward. The probe runs once per class and instance settings (every plain attribute, the layer
index among them: a family may compute otherwise by layer).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable

import torch

import mlarope

from ._rotation import ROPE_DIMS, _row_ids, _tables

_ORIGINAL = "_mlarope_unfused_forward"  # the forward a fused attention had (bound)
_REFUSED = "_mlarope_not_fused"  # why a layer was not fused
# A layer whose expand_kv alone is fused: why its whole forward is not.
_KEY_VALUE_ONLY = "_mlarope_key_value_only"
# Per attention class and instance settings (_settings): the form of position embeddings with
# which the fused forward reproduces the layer's own (``(form,)``), or why it does not.
_VERDICTS: dict[tuple, tuple[str] | str] = {}
# How transformers hands position embeddings to the attention: (cos, sin) tables, or
# DeepSeek-V2's complex freqs_cis.
FORMS = ("cos_sin", "complex")
_LOCK = threading.RLock()
_IDENTITY: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _structure(module: torch.nn.Module) -> str:
    """Why ``module`` is not a DeepSeek-structured MLA attention ("" when it is)."""
    needed = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    missing = [n for n in needed if not isinstance(getattr(module, n, None), torch.nn.Module)]
    if missing:
        return f"no {', '.join(missing)}"
    widths = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    if not all(isinstance(getattr(module, n, None), int) for n in widths):
        return "widths not all known (" + ", ".join(widths) + ")"
    if not isinstance(getattr(module, "scaling", None), float):
        return "no softmax scaling"
    if module.qk_rope_head_dim not in ROPE_DIMS:
        return f"rope width {module.qk_rope_head_dim} (mlarope rotates {ROPE_DIMS})"
    if getattr(module, "q_proj", None) is None and not all(
        isinstance(getattr(module, n, None), torch.nn.Module)
        for n in ("q_a_proj", "q_a_layernorm", "q_b_proj")
    ):
        return "no q_proj nor q_a_proj / q_a_layernorm / q_b_proj"
    weight = getattr(module.kv_a_layernorm, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (module.kv_lora_rank,):
        return "kv_a_layernorm has no weight of the latent's width"
    if _eps(module) is None:
        return "kv_a_layernorm has no epsilon (variance_epsilon or eps)"
    if _modeling(module) is None:
        return "no modeling module with transformers' attention functions"
    return ""


# The submodules the fused forward runs; a layer with another that holds parameters (a DSA
# indexer, whose top-k mask a short probe cannot see) has its expand_kv alone fused.
_RUN_BY_THE_FUSED_FORWARD = frozenset(
    ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
     "kv_b_proj", "o_proj")
)  # fmt: skip


def _unrun_submodules(module: torch.nn.Module) -> list[str]:
    """The submodules with parameters that the fused forward would not run."""
    return [
        name
        for name, child in module.named_children()
        if name not in _RUN_BY_THE_FUSED_FORWARD and any(True for _ in child.parameters())
    ]


def _modeling(module: torch.nn.Module) -> types.ModuleType | None:
    """The modeling module whose attention functions the layer's class calls: the first class
    of its MRO whose module has transformers' attention registry and eager attention."""
    for cls in type(module).__mro__:
        found = sys.modules.get(cls.__module__)
        if hasattr(found, "ALL_ATTENTION_FUNCTIONS") and hasattr(found, "eager_attention_forward"):
            return found
    return None


def _eps(module: torch.nn.Module) -> float | None:
    norm = module.kv_a_layernorm
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float) and value > 0:
            return value
    return None


def _interleaved(module: torch.nn.Module) -> bool:
    return bool(getattr(getattr(module, "config", None), "rope_interleave", False))


def _identity(device: torch.device, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos = 1, sin = 0``: a one-row table, for rotating by nothing."""
    key = (device, rope_dim)
    found = _IDENTITY.get(key)
    if found is None:
        # Never inference tensors (made under torch.inference_mode, a later training step could
        # not save them for its backward).
        with torch.inference_mode(False):
            found = (
                torch.ones(1, rope_dim, device=device),
                torch.zeros(1, rope_dim, device=device),
            )
        _IDENTITY[key] = found
    return found


def _takes(module, form, hidden_states, position_embeddings) -> bool:
    """The fused forward can take this call: ``position_embeddings`` in the ``form`` the class's
    probe verified (``(cos, sin): [Bc, S, R]`` or complex ``freqs_cis: [Bc, S, R / 2]``)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        return False
    if form == "complex":
        complex_table = isinstance(position_embeddings, torch.Tensor)
        if not complex_table or not position_embeddings.is_complex():
            return False
        tables, width = (position_embeddings,), module.qk_rope_head_dim // 2
    else:
        if not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
            return False
        tables, width = tuple(position_embeddings), module.qk_rope_head_dim
        if not all(isinstance(t, torch.Tensor) and not t.is_complex() for t in tables):
            return False
        if tables[0].shape != tables[1].shape:
            return False
    batch, seq = hidden_states.shape[:2]
    shape = tables[0].shape
    if len(shape) != 3 or shape[1:] != (seq, width) or shape[0] not in (1, batch) or seq == 0:
        return False
    if any(t.device != hidden_states.device for t in tables):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
        return False
    return not (
        torch.autograd.forward_ad._current_level >= 0
        and any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tables)
    )


def _positional_names(forward: Callable) -> tuple[str, ...]:
    """The names a (bound) forward takes its positional arguments by, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in kinds)


def _named(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict | None:
    """``args`` and ``kwargs`` by name (``names``: the forward's positional parameters), or
    None when they do not bind (more positional arguments, or one given twice)."""
    if len(args) > len(names):
        return None
    given = dict(zip(names, args, strict=False))
    if given.keys() & kwargs.keys():
        return None
    given.update(kwargs)
    return given


def fused_forward(module, original, form, names, *args, **kwargs):
    """The attention's forward with the glue fused (the module docstring); a call it cannot
    take goes to ``original``, the attention's own forward. ``form``: how the class takes its
    position embeddings (``"cos_sin"`` or ``"complex"``); ``names``: ``original``'s positional
    parameters (the families order them differently)."""
    call = _named(names, args, kwargs)
    if call is None or not _takes(
        module, form, call.get("hidden_states"), call.get("position_embeddings")
    ):
        return original(*args, **kwargs)
    hidden_states = call.pop("hidden_states")
    position_embeddings = call.pop("position_embeddings")
    attention_mask = call.pop("attention_mask", None)
    cache = call.pop("cache", None)
    legacy = call.pop("past_key_values", None)  # the name before transformers 5.25
    cache = legacy if cache is None else cache
    kwargs = call  # the rest goes to the attention function, as transformers' forward passes it
    batch, seq = hidden_states.shape[:2]
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    latent_dim = module.kv_lora_rank

    if form == "complex":
        # DeepSeek-V2: freqs_cis multiplies adjacent pairs as complex numbers, in fp32, and
        # writes them back adjacent: interleaved in and out, tables (re, re) and (im, im).
        rows = position_embeddings.shape[0]
        cos2, sin2 = _tables((position_embeddings,), rows * seq, "complex")
        interleaved = interleaved_out = True
    else:
        interleaved, interleaved_out = _interleaved(module), False
        rows = position_embeddings[0].shape[0]
        cos2, sin2 = _tables(
            tuple(position_embeddings), rows * seq, "first_half" if interleaved else "full"
        )
    ids = None if rows == 1 else _row_ids(rows, seq, hidden_states.device)
    where = dict(
        layout="bshd", position_ids=ids, interleaved=interleaved, interleaved_out=interleaved_out
    )

    if getattr(module, "q_proj", None) is not None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    # In place through the projection's output (the view reshapes all of it, so the op marks
    # that tensor dirty); the query is a plain view of it taken afterwards, whose gradient is a
    # free reshape, where the op's returned view would cost a zero-fill and a copy backward.
    mlarope.apply_rope_q(q.view(batch, seq, heads, nope + rope), cos2, sin2, inplace=True,
                         **where)  # fmt: skip
    q = q.view(batch, seq, heads, nope + rope)

    ckv = module.kv_a_proj_with_mqa(hidden_states)
    latent, k_pe = mlarope.rmsnorm_rope_latent(
        ckv, module.kv_a_layernorm.weight, cos2, sin2, kv_lora_rank=latent_dim,
        eps=_eps(module), **where,
    )  # fmt: skip
    if cache is not None:
        # The cache keeps the latent and the rotated k_pe, as transformers' attention gives
        # them ([B, 1, S, *]), and returns every token's so far ([B, 1, T, *]).
        latent, k_pe = cache.update(
            latent.view(batch, 1, seq, latent_dim), k_pe.view(batch, 1, seq, rope),
            module.layer_idx, kwargs=kwargs,
        )  # fmt: skip
    k, v = _key_value(module, latent, k_pe)

    modeling = _modeling(module)
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, modeling.eager_attention_forward
    )
    out, weights = interface(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling, **kwargs,
    )  # fmt: skip
    out = out.reshape(batch, seq, -1).contiguous()
    return module.o_proj(out), weights


def _key_value(
    module: torch.nn.Module, latent: torch.Tensor, k_pe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k: [B, T, H, N + R]`` and ``v: [B, T, H, V]`` from the latent ``[B, (1,) T, L]`` and
    the rotated ``k_pe: [B, (1,) T, R]``: ``kv_b_proj``'s output and ``k_pe`` read once by the
    key/value op, rotating by the identity; its backward sums ``k_pe``'s gradient over the heads
    in the kernel."""
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    batch, keys = latent.shape[0], latent.shape[-2]
    kv = module.kv_b_proj(latent.reshape(batch, keys, module.kv_lora_rank))
    kv = kv.view(batch, keys, heads, nope + module.v_head_dim)
    one, zero = _identity(kv.device, rope)
    at_zero = torch.zeros(batch, keys, dtype=torch.int32, device=kv.device)
    # In the key's dtype, as transformers' copy_ into the key casts it (under autocast kv_b_proj
    # gives bf16 while k_pe, rotated by fp32 tables, is fp32); a no-op where they agree.
    k_pe = k_pe.to(device=kv.device, dtype=kv.dtype)
    return mlarope.apply_rope_kv(
        kv, k_pe.reshape(batch, keys, 1, rope), one, zero, k_dim=nope, layout="bshd",
        position_ids=at_zero, interleaved=False,
    )  # fmt: skip


def fused_expand_kv(module, original, kv_nope, k_rot):
    """The attention's ``expand_kv(kv_nope: [B, 1, T, L], k_rot: [B, 1, T, R])`` -> key
    ``[B, H, T, N + R]`` and value ``[B, H, T, V]`` through the key/value op, for a layer whose
    whole forward is not fused (the key/value-only path): no key assembled in a new tensor and
    no head sum of ``k_rot``'s gradient in PyTorch. Arguments of other shapes go to
    ``original``, the layer's own ``expand_kv``."""
    latent_dim, rope = module.kv_lora_rank, module.qk_rope_head_dim
    if not (
        isinstance(kv_nope, torch.Tensor)
        and isinstance(k_rot, torch.Tensor)
        and kv_nope.dim() == 4
        and k_rot.dim() == 4
        and kv_nope.shape[1] == 1
        and kv_nope.shape[-1] == latent_dim
        and k_rot.shape == (*kv_nope.shape[:-1], rope)
        and kv_nope.shape[2] > 0
        and k_rot.device == kv_nope.device
    ):
        return original(kv_nope, k_rot)
    k, v = _key_value(module, kv_nope, k_rot)
    return k.transpose(1, 2), v.transpose(1, 2)


def _probe_input(
    module: torch.nn.Module, form: str, masked: bool
) -> tuple[torch.Tensor, object, torch.Tensor | None]:
    """A short random input, its position embeddings in ``form`` as transformers' rotary
    embedding hands them over (``(cos, sin)`` in the layer's dtype, or DeepSeek-V2's complex64
    ``freqs_cis``: its rotary embedding computes them in fp32 whatever the model's dtype), and
    a causal additive mask ``[1, 1, S, S]`` when ``masked`` (DSA layers read one) or None."""
    param = next(module.parameters())
    dtype, device = param.dtype, param.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    seq, rope = 5, module.qk_rope_head_dim
    hidden = getattr(module, "hidden_size", None) or module.o_proj.out_features
    x = torch.randn(1, seq, hidden, generator=gen).to(device, dtype)
    angles = 6.3 * torch.rand(1, seq, rope // 2, generator=gen, dtype=torch.float64)
    mask = None
    if masked:
        above = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
        mask = torch.zeros(1, 1, seq, seq, dtype=dtype, device=device)
        mask = mask.masked_fill(above, torch.finfo(dtype).min)
    if form == "complex":
        return x, torch.polar(torch.ones_like(angles), angles).to(device, torch.complex64), mask
    angles = torch.cat((angles, angles), dim=-1)
    return x, tuple(t.to(device, dtype) for t in (angles.cos(), angles.sin())), mask


def _probe(
    module: torch.nn.Module, original: Callable, ours: Callable[[str, dict], torch.Tensor]
) -> str | tuple[str]:
    """Run ``ours(form, call)`` against ``original(**call)`` (``module``'s own forward) on a
    short random input (no gradient), with position embeddings in each form transformers hands
    them over (:data:`FORMS`) and no mask, then a causal one: the first call the layer's own
    forward takes decides. Returns ``(form,)`` when the two agree within rounding, else why
    not."""
    refused = []
    for form, masked in ((f, m) for m in (False, True) for f in FORMS):
        x, embeddings, mask = _probe_input(module, form, masked)
        call = dict(hidden_states=x, position_embeddings=embeddings, attention_mask=mask)
        # In eval mode (no dropout: both sides must draw nothing at random) and on a forked
        # RNG (the user's random stream is left as it was).
        training = module.training
        try:
            module.eval()
            with (
                torch.no_grad(),
                torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []),
            ):
                try:
                    theirs = original(**call)[0]
                except Exception as e:  # not this form: try the next
                    refused.append(f"{form}{', masked' if masked else ''}: {type(e).__name__}: {e}")
                    continue
                got = ours(form, call)
        except Exception as e:  # ours refused an input the layer's own forward takes
            return f"the probe raised {type(e).__name__}: {e}"
        finally:
            module.train(training)
        return _compare(got, theirs, x.dtype) or (form,)
    return "the probe raised: the layer's own forward refused every probe call (" + (
        "; ".join(refused) + ")"
    )


def _probe_whole(module: torch.nn.Module, original: Callable) -> str | tuple[str]:
    """:func:`_probe` of the fused forward."""
    names = _positional_names(original)
    return _probe(
        module, original, lambda form, call: fused_forward(module, original, form, names, **call)[0]
    )


def _probe_key_value(module: torch.nn.Module, original: Callable) -> str | tuple[str]:
    """:func:`_probe` of the layer's own forward with :func:`fused_expand_kv` as its
    ``expand_kv``."""

    def ours(form: str, call: dict) -> torch.Tensor:
        module.__dict__["expand_kv"] = functools.partial(fused_expand_kv, module, module.expand_kv)
        try:
            return original(**call)[0]
        finally:
            del module.__dict__["expand_kv"]

    return _probe(module, original, ours)


def _compare(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> str:
    """Why the fused forward's output is not the layer's own ("" when they agree)."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return (
            f"the fused forward gave {tuple(ours.shape)} {ours.dtype}, the attention's own "
            f"{tuple(theirs.shape)} {theirs.dtype}"
        )
    # Rounding moves the outputs by a few units of the dtype's precision (relative, by norm);
    # a different structure (another scale, a missing norm, another pair layout) by O(1).
    tolerance = 2.0**-12 if dtype in (torch.float32, torch.float64) else 2.0**-5
    diff = float((ours.double() - theirs.double()).norm() / theirs.double().norm().clamp_min(1e-30))
    if not diff <= tolerance:
        return f"the fused forward differs from the attention's own by {diff:.3g} (relative)"
    return ""


def _settings(module: torch.nn.Module) -> tuple:
    """What the class's forward may read besides the weights: the instance's plain attributes
    (widths, scales, flags), which of its submodules are None, and the rope layout. Instances
    that agree on these share the probe's verdict."""
    plain = (int, float, bool, str, type(None))
    attrs = tuple(
        sorted(
            (k, v)
            for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, plain)
        )
    )
    absent = tuple(sorted(k for k, v in module._modules.items() if v is None))
    return (type(module), attrs, absent, _interleaved(module))


def _verdict(key: tuple, probe: Callable[[], str | tuple[str]]) -> str | tuple[str]:
    """The probe's verdict for the settings ``key``, run once (an exception may be the input's:
    not kept)."""
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = probe()
        if isinstance(verdict, tuple) or not verdict.startswith("the probe raised"):
            _VERDICTS[key] = verdict
    return verdict


def fuse(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Fuse every DeepSeek-structured MLA attention of ``model``: its whole forward, or where
    that does not reproduce the layer (a DSA indexer, another output) its ``expand_kv`` alone.
    Returns the layers it fused now; :func:`outcome` says, per class, what happened."""
    fused: list[torch.nn.Module] = []
    with _LOCK:
        for module in model.modules():
            if not hasattr(module, "kv_a_proj_with_mqa") or _ORIGINAL in module.__dict__:
                continue
            if _KEY_VALUE_ONLY in module.__dict__:
                continue
            why = _structure(module)
            if not why and "forward" in module.__dict__:
                # Somebody's wrapper: the class's verdict does not say what it computes.
                why = "the layer has a forward of its own (an instance attribute)"
            if why:
                module.__dict__[_REFUSED] = why
                continue
            key = _settings(module)
            unrun = _unrun_submodules(module)
            if unrun:
                whole = f"the fused forward would not run {', '.join(unrun)}"
            else:
                whole = _verdict(key, lambda m=module: _probe_whole(m, m.forward))
            if isinstance(whole, tuple):
                module.__dict__[_ORIGINAL] = original = module.forward
                module.forward = functools.partial(
                    fused_forward, module, original, whole[0], _positional_names(original)
                )
                module.__dict__.pop(_REFUSED, None)
                fused.append(module)
                continue
            if not callable(getattr(type(module), "expand_kv", None)):
                kv = "no expand_kv method"
            elif "expand_kv" in module.__dict__:
                # Somebody's wrapper, as for forward above: not the class's, not replaced.
                kv = "the layer has an expand_kv of its own (an instance attribute)"
            else:
                kv = _verdict((*key, "expand_kv"), lambda m=module: _probe_key_value(m, m.forward))
            if isinstance(kv, tuple):
                module.__dict__["expand_kv"] = functools.partial(
                    fused_expand_kv, module, module.expand_kv
                )
                module.__dict__[_KEY_VALUE_ONLY] = whole
                module.__dict__.pop(_REFUSED, None)
                fused.append(module)
            else:
                module.__dict__[_REFUSED] = f"{whole}; key and value alone: {kv}"
    return fused


def outcome(model: torch.nn.Module) -> dict[str, str]:
    """Per attention class of ``model`` (one with a ``kv_a_proj_with_mqa``): ``"fused"``,
    ``"key and value fused; the whole forward not: why"`` or ``"not fused: why"``; where the
    layers of one class ended differently, each outcome with its count of layers
    (``"2 layers: fused | 1 layer: not fused: why"``)."""
    per_class: dict[str, dict[str, int]] = {}
    for module in model.modules():
        if not hasattr(module, "kv_a_proj_with_mqa"):
            continue
        if _ORIGINAL in module.__dict__:
            this = "fused"
        elif _KEY_VALUE_ONLY in module.__dict__:
            this = f"key and value fused; the whole forward not: {module.__dict__[_KEY_VALUE_ONLY]}"
        else:
            this = f"not fused: {module.__dict__.get(_REFUSED, 'not asked')}"
        counts = per_class.setdefault(type(module).__name__, {})
        counts[this] = counts.get(this, 0) + 1
    return {
        name: next(iter(counts))
        if len(counts) == 1
        else " | ".join(f"{n} layer{'s' * (n > 1)}: {text}" for text, n in counts.items())
        for name, counts in per_class.items()
    }


def unfuse(model: torch.nn.Module) -> int:
    """Give every fused attention of ``model`` its own forward (or ``expand_kv``) back; returns
    how many."""
    count = 0
    with _LOCK:
        for module in model.modules():
            module.__dict__.pop(_REFUSED, None)
            if module.__dict__.pop(_KEY_VALUE_ONLY, None) is not None:
                installed = module.__dict__.get("expand_kv")
                if getattr(installed, "func", None) is fused_expand_kv:
                    del module.__dict__["expand_kv"]
                count += 1
            if module.__dict__.pop(_ORIGINAL, None) is None:
                continue
            module.__dict__.pop("forward", None)  # only a layer whose class forward ran is fused
            count += 1
    return count
