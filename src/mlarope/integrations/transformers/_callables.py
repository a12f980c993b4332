"""What a call of a transformers rotary function runs, however transformers wraps it.

transformers' modeling modules hold their rotary functions as plain functions, as functions
under a decorator, or (5.25 and later, with the ``kernels`` package installed) as an
``nn.Module`` instance: ``@use_kernel_forward_from_hub("rotary_pos_emb")`` turns the function
into a module whose ``forward(*args, **kwargs)`` runs it (or a hub kernel, for a model that
``kernels.kernelize`` routed there). Such a module's own call signature is ``(*args,
**kwargs)``, which says nothing. What the call runs is recognised here from the object's
protocol, never from the names of transformers' or ``kernels``' classes:

- an ``nn.Module`` runs its ``forward``: its signature is the forward's (``kernels`` gives the
  forward the wrapped function's signature);
- a decorated function whose decorator kept ``__wrapped__`` (``functools.wraps``): the wrapped
  function's signature, as :func:`inspect.signature` follows it;
- a callable that says neither (a plain ``*args, **kwargs`` wrapper): no signature. The probe
  then recognises it by what it computes on each argument count it could take.

The probe calls the object itself, so what is classified is always what the attention runs.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable

import torch

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _runs(fn: Callable) -> Callable:
    """The callable a call of ``fn`` runs: an ``nn.Module``'s forward, else ``fn``."""
    if isinstance(fn, torch.nn.Module):
        return fn.forward
    return fn


def call_signature(fn: Callable) -> inspect.Signature | None:
    """The signature a call of ``fn`` is bound by, or None when nothing tells it (only ``*args,
    **kwargs``, or no signature at all)."""
    try:
        sig = inspect.signature(_runs(fn))
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None
    return sig


def required_positional(fn: Callable) -> int | None:
    """How many positional arguments a call of ``fn`` needs, or None when nothing tells it."""
    sig = call_signature(fn)
    if sig is None:
        return None
    params = sig.parameters.values()
    return sum(1 for p in params if p.kind in _POSITIONAL and p.default is inspect.Parameter.empty)


def wrapper_kind(fn: Callable) -> str:
    """How ``fn`` wraps the code it runs, in words for a report (``""`` for a plain function)."""
    if isinstance(fn, torch.nn.Module):
        layer = getattr(type(fn), "kernel_layer_name", None)
        what = f"an nn.Module ({type(fn).__name__})"
        if layer is not None:
            what = (
                f"a hub-kernel layer {layer!r} of the `kernels` package "
                f"({_version('kernels')}): transformers' use_kernel_forward_from_hub made the "
                f"function an nn.Module"
            )
        return what
    if inspect.isfunction(fn) and not hasattr(fn, "__wrapped__"):
        return ""
    if hasattr(fn, "__wrapped__"):
        return "a decorated function (its __wrapped__ is followed)"
    return f"a {type(fn).__name__} callable"


def _version(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package}, version unknown"
