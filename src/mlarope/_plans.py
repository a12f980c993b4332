"""Launch plans: repeated eager calls skip straight to the kernel launch (the decode path),
and repeated calls that need autograd replay theirs in one autograd node (``GradPlan``).

An eager call (not compiling, no validation) whose arguments have the same
metadata as an earlier call's makes the same launch: the same compiled kernel, grid and integer
arguments; only the tensors' addresses differ. The first such call runs the whole pipeline
(checks -> positions -> launcher -> kernel) while ``_recording`` notes its
launch; later calls with an equal key allocate the outputs, put the new tensors into the noted
argument slots and launch: a decode call's host time goes from 24-40 µs through the pipeline
to 10-19 µs on the H200 machine (docs/benchmarks.md, host overhead).

A call's plan is found in two steps. A dict key holds the flags and integers with their types
(so ``1`` never stands in for ``True``), the first tensor's shape, every tensor's address
modulo 16 (Triton specializes on 16-byte alignment), the current device (on the CPU: the
backend TRITON_INTERPRET selects) and grad mode (the checks reject a table that requires grad
with grad mode on only). Each entry's guard
then checks every tensor's class, dtype, device, dispatch keys (which tell an inference tensor
in inference mode from one outside it), ``requires_grad``, sizes and strides against the
recorded call, in C++ (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile`` guards
its graphs with; a Python comparison of the same fields and inference mode where that is
missing). So a call can only take a plan if the full pipeline would pass every check and make
the very same launch. Calls under forward-mode AD never take one (a tangent is not metadata).

How a recorded call's launches are filled with a new call's tensors (views, outputs, the
``cu_seqlens`` search's scratch buffer) is :mod:`mlarope._launch_plans`'s part. The search
reads ``cu_seqlens`` on the device only, and its grid and integer arguments follow from the
tokens and ``cu_seqlens``' length, which the key and the guard hold: so thd calls with
``cu_seqlens`` (Megatron-Core's packed batches) replay too. A call whose launches give no plan
(a copy, no launch at all), or whose tensors cannot be keyed (a tensor subclass or one without
storage, a layout that is not a str), always takes the pipeline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import is_grad_enabled as _is_grad_enabled
from torch.autograd import forward_ad as _fwad

from . import _pipeline, autograd
from ._launch_cache import LAUNCH_CACHE
from ._launch_plans import MAX_PER_KEY, MISSING, GradPlan, record
from ._memory import alignment, lies_apart
from ._modes import autograd_refuses_in_place, device_key, env_validation, use_triton
from ._recording import start_recording, stop_recording


class Signature(NamedTuple):
    """What a call's plan is found by: ``key`` (flags, integers, the first tensor's shape,
    alignments, device, grad mode) and the ``tensors`` whose metadata each entry's guard
    checks."""

    key: tuple
    tensors: tuple


# ``tuple.__new__(Signature, (key, tensors))`` makes the same object as ``Signature(key,
# tensors)`` without the generated ``__new__``'s Python frame (0.2 µs of a decode call).
_signature = tuple.__new__


def _plain_call(
    layout, cu_seqlens, position_ids, validate, cp_rank, cp_size, interleaved, interleaved_out
) -> bool:
    """The conditions both ops' plans share: no compile tracing (checked first, so Dynamo
    traces nothing below), no forward-mode AD (a tensor's tangent is not in its metadata: a
    dual tensor would pass the guard), not both ``cu_seqlens`` and ``position_ids`` (an
    error), no validation, a layout that is a str, ints that are ints and flags that are bools
    (so 1 never stands in for True)."""
    return not (
        torch.compiler.is_compiling()
        or _fwad._current_level >= 0
        or layout.__class__ is not str
        or (cu_seqlens is not None and position_ids is not None)
        or validate is not False
        or cp_rank.__class__ is not int
        or cp_size.__class__ is not int
        or (interleaved is not True and interleaved is not False)
        or (interleaved_out is not True and interleaved_out is not False)
        or env_validation()
    )


def query_signature(
    q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, inplace, inplace_backward, validate,
) -> Signature | None:  # fmt: skip
    """The signature of an ``apply_rope_q`` call, or None if it cannot have a plan: only plain
    eager calls get one (no validation, no compile tracing, no forward-mode AD or
    ``torch.func`` transform; plain tensors). A call that needs autograd gets a
    :class:`GradPlan`."""
    if (
        not _plain_call(
            layout,
            cu_seqlens,
            position_ids,
            validate,
            cp_rank,
            cp_size,
            interleaved,
            interleaved_out,
        )
        or (inverse is not True and inverse is not False)
        or (inplace is not True and inplace is not False)
        or (inplace_backward is not True and inplace_backward is not False)
    ):
        return None
    tensors = (q, cos, sin, *_positions(position_ids, cu_seqlens))
    aligned = alignment(tensors)
    grad_mode = _is_grad_enabled()
    if aligned is None or (grad_mode and q.requires_grad and _transforms_active()):
        return None
    key = (
        "q", layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, inplace,
        inplace_backward, cu_seqlens is None, len(tensors), q.shape, aligned, device_key(q),
        grad_mode,
    )  # fmt: skip
    return _signature(Signature, (key, tensors))


def kv_signature(
    kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, copy_v, validate, megatron_rounding=False,
) -> Signature | None:  # fmt: skip
    """The signature of an ``apply_rope_kv`` call, or None if it cannot have a plan
    (``megatron_rounding``: ``mlarope.compat.megatron``'s call, whose backward rounds where
    Megatron-Core's does: a plan of its own)."""
    if (
        not _plain_call(
            layout,
            cu_seqlens,
            position_ids,
            validate,
            cp_rank,
            cp_size,
            interleaved,
            interleaved_out,
        )
        or k_dim.__class__ is not int
        or (copy_v is not True and copy_v is not False)
    ):
        return None
    tensors = (kv, k_pe, cos, sin, *_positions(position_ids, cu_seqlens))
    aligned = alignment(tensors)
    grad_mode = _is_grad_enabled()
    if aligned is None or (
        grad_mode and (kv.requires_grad or k_pe.requires_grad) and _transforms_active()
    ):
        return None
    key = (
        "kv", layout, k_dim, cp_rank, cp_size, interleaved, interleaved_out, copy_v,
        megatron_rounding, cu_seqlens is None, len(tensors), kv.shape, aligned,
        device_key(kv), grad_mode,
    )  # fmt: skip
    return _signature(Signature, (key, tensors))


def pair_signature(
    q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, validate,
) -> Signature | None:  # fmt: skip
    """The signature of an ``apply_rope_qk`` call, or None if it cannot have a plan. A call
    that needs autograd for one of ``q`` and ``k`` only takes the pipeline (its outputs'
    ``requires_grad`` differ; one node would give both the same), and so does one with
    ``cu_seqlens`` (each tensor's pipeline searches for itself)."""
    if (
        cu_seqlens is not None
        or not _plain_call(
            layout, None, position_ids, validate, cp_rank, cp_size, interleaved, interleaved_out
        )
        or (inverse is not True and inverse is not False)
    ):
        return None
    tensors = (q, k, cos, sin) if position_ids is None else (q, k, cos, sin, position_ids)
    aligned = alignment(tensors)
    grad_mode = _is_grad_enabled()
    if aligned is None or (
        grad_mode
        and (q.requires_grad or k.requires_grad)
        and (q.requires_grad is not k.requires_grad or _transforms_active())
    ):
        return None
    key = (
        "qk", layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, len(tensors),
        q.shape, aligned, device_key(q), grad_mode,
    )  # fmt: skip
    return _signature(Signature, (key, tensors))


_transforms_active = torch._C._are_functorch_transforms_active  # torch.func: its own path


def _positions(position_ids, cu_seqlens) -> tuple:
    """The position tensor a signature holds after the tables: ``position_ids`` or
    ``cu_seqlens`` (the key says which), or none."""
    if position_ids is not None:
        return (position_ids,)
    return () if cu_seqlens is None else (cu_seqlens,)


def _entry(signature: Signature):
    """The recorded entry matching ``signature``: a Plan or GradPlan, None (recorded without a
    plan), or ``MISSING``."""
    key, tensors = signature
    for check, plan in LAUNCH_CACHE.plans.get(key, ()):
        if check(*tensors):
            return plan
    return MISSING


def apply_query(
    q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, inplace, inplace_backward, validate,
):  # fmt: skip
    """``apply_rope_q``: a repeated eager call replays the launches its signature's first call
    recorded (``q`` itself in place); a first call runs the pipeline (``_pipeline.query``)
    recording them, and any other call the pipeline alone."""
    args = (
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, inplace, inplace_backward, validate,
    )  # fmt: skip
    signature = query_signature(*args)
    # A leaf in place: the pipeline's checks refuse it (a guard does not tell a leaf).
    if signature is not None and not (
        inplace is True and q.requires_grad and autograd_refuses_in_place(q)
    ):
        plan = _entry(signature)
        tensors = signature[1]
        if plan.__class__ is GradPlan:
            if lies_apart(tensors, plan.forward.apart):
                return autograd.replay(plan, tensors)
        elif plan is MISSING:
            return _recorded(signature, _pipeline.query, args)
        elif plan is not None:
            outputs = plan(tensors)
            if outputs is not None:
                if inplace:
                    torch.autograd.graph.increment_version(q)
                    return q
                return outputs[0]
    return _pipeline.query(*args)[0]


def apply_kv(
    kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, copy_v, validate, megatron_rounding=False,
):  # fmt: skip
    """``apply_rope_kv`` (and, with ``megatron_rounding``, ``mlarope.compat.megatron``'s
    differentiable key/value call), as :func:`apply_query`: ``(k, v)``."""
    args = (
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out, copy_v, validate, megatron_rounding,
    )  # fmt: skip
    signature = kv_signature(*args)
    if signature is not None:
        plan = _entry(signature)
        if plan.__class__ is GradPlan:
            return autograd.replay(plan, signature[1])
        if plan is MISSING:
            return _recorded(signature, _pipeline.key_value, args)
        if plan is not None:
            outputs = plan(signature[1])
            return outputs[0], (outputs[1] if copy_v else kv[..., k_dim:])
    return _pipeline.key_value(*args)[0]


def apply_pair(
    q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, validate,
):  # fmt: skip
    """``apply_rope_qk``, as :func:`apply_query`: ``(q', k')``."""
    args = (
        q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, validate,
    )  # fmt: skip
    signature = pair_signature(*args)
    if signature is not None:
        plan = _entry(signature)
        if plan.__class__ is GradPlan:
            return autograd.replay(plan, signature[1])
        if plan is MISSING:
            return _recorded(signature, _pipeline.pair, args)
        if plan is not None:
            outputs = plan(signature[1])
            return outputs[0], outputs[1]
    return _pipeline.pair(*args)[0]


def _recorded(signature: Signature, pipeline, args: tuple):
    """The first call of ``signature``: ``pipeline(*args)``'s result, its launches recorded and
    the plan they give stored (or that they give none). Nothing is recorded where it launches
    no kernel (its first tensor runs the PyTorch backend: triton stays unimported), and
    nothing is stored when it raises."""
    key, tensors = signature
    if not use_triton(tensors[0]):
        return pipeline(*args)[0]
    launches, previous = start_recording()
    try:
        result, outputs, replay = pipeline(*args)
    finally:
        stop_recording(previous)
    entries = LAUNCH_CACHE.plan_entries(key)
    if len(entries) >= MAX_PER_KEY:
        del entries[0]
    entries.append(record(tensors, outputs, launches, replay))
    return result
