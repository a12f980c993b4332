"""Launch plans: repeated eager calls skip straight to the kernel launch (the decode path),
and repeated calls that need autograd replay theirs in one autograd node (``GradPlan``).

An eager call (not compiling, no validation) whose arguments have the same
metadata as an earlier call's makes the same launch: the same compiled kernel, grid and integer
arguments; only the tensors' addresses differ. The first such call runs the whole pipeline
(checks -> positions -> launcher -> kernel) while ``kernels._launch.recording()`` notes its
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

The kernels see a tensor argument only through its address and dtype (every stride is an
integer argument). A launch argument that is a view of an input with the same address (``k_pe``
without its head dim, the tables as ``[P, R]``, broadcast ``position_ids``) is filled with that
input; an argument that is an output is filled with the new call's output. A call may make
several launches (``apply_rope_qk``: two), each replayed in turn. A scratch buffer that one
launch writes whole and a later one reads (the ``cu_seqlens`` search's positions, declared by
``kernels._launch.note_scratch``) is allocated anew for each replay, with its recorded shape
and dtype; a call that needs autograd saves it for its backward, as the pipeline's does. The
search reads ``cu_seqlens`` on the device only, and its grid and integer arguments follow from
the tokens and ``cu_seqlens``' length, which the key and the guard hold: so thd calls with
``cu_seqlens`` (Megatron-Core's packed batches) replay too. Anything else (a copy, a launch
that reads an output no declared scratch buffer holds, no launch at all, an input of a tensor
subclass or without storage, a layout that is not a str) gets no plan, and such calls always
take the pipeline.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import is_grad_enabled as _is_grad_enabled
from torch.autograd import forward_ad as _fwad

from ._checks import env_validation
from ._launch_cache import LAUNCH_CACHE
from ._memory import byte_span
from .ops import use_triton

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - present in every torch this package supports
    _TensorGuards = None

_MAX_PER_KEY = 8  # guarded entries per key (same shape of the first tensor, other metadata)
MISSING = object()  # no recorded call matches (a recorded call without a plan gives None)


class Signature(NamedTuple):
    """What a call's plan is found by: ``key`` (flags, integers, the first tensor's shape,
    alignments, device, grad mode) and the ``tensors`` whose metadata each entry's guard
    checks."""

    key: tuple
    tensors: tuple


# ``tuple.__new__(Signature, (key, tensors))`` makes the same object as ``Signature(key,
# tensors)`` without the generated ``__new__``'s Python frame (0.2 µs of a decode call).
_signature = tuple.__new__


class Plan:
    """The recorded launches of one call signature: ``plan(inputs)`` -> the list of outputs, or
    None where the call must take the pipeline (an in-place target that now overlaps an
    input it reads: the guard sees each tensor's metadata, not where the tensors lie)."""

    __slots__ = ("apart", "launches", "outputs", "scratch")

    def __init__(self, launches: tuple, outputs: tuple, apart: tuple = (), scratch: tuple = ()):
        # ((launch, template, slots), ...) in launch order: the template holds the launch
        # arguments with tensors replaced by None, slots (argument index, index into
        # inputs + outputs + scratch).
        self.launches = launches
        self.outputs = outputs  # shapes of the outputs: contiguous, dtype and device of inputs[0]
        # In place: the target's byte span and, per input it reads, (index, byte span).
        self.apart = apart
        self.scratch = scratch  # (shape, dtype) of each scratch buffer, on inputs[0]'s device

    def fits(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Whether these tensors may take the recorded launches: an in-place target must lie
        apart from what the call reads (its metadata matched, its address may not)."""
        if not self.apart:
            return True
        span, reads = self.apart
        start = inputs[0].data_ptr()
        for index, r_span in reads:
            r_start = inputs[index].data_ptr()
            if start < r_start + r_span and r_start < start + span:
                return False
        return True

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        # Few Python objects per call: each one the cyclic GC tracks brings its next
        # collection closer (docs/benchmarks.md, host overhead).
        if self.apart and not self.fits(inputs):
            return None
        return self.run(inputs)

    def run(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Allocate the outputs and make the launches (the caller checked :meth:`fits`)."""
        if self.scratch:
            return self.run_keeping_scratch(inputs)[0]
        first = inputs[0]
        outs = [first.new_empty(shape) for shape in self.outputs]
        n_inputs = len(inputs)
        for launch, template, slots in self.launches:
            args = template.copy()
            for index, source in slots:
                args[index] = inputs[source] if source < n_inputs else outs[source - n_inputs]
            launch(args)
        return outs

    def run_keeping_scratch(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`run`, and the scratch buffers its launches wrote (a backward reads them)."""
        first = inputs[0]
        outs = [first.new_empty(shape) for shape in self.outputs]
        outs += [first.new_empty(shape, dtype=dtype) for shape, dtype in self.scratch]
        n_inputs = len(inputs)
        for launch, template, slots in self.launches:
            args = template.copy()
            for index, source in slots:
                args[index] = inputs[source] if source < n_inputs else outs[source - n_inputs]
            launch(args)
        n_outputs = len(self.outputs)
        return outs[:n_outputs], outs[n_outputs:]


class GradPlan:
    """An eager call that needs autograd, recorded: ``forward`` (a :class:`Plan`) is replayed
    inside one autograd node (``autograd.replay``), whose backward replays the launches the
    first backward of each gradient signature made (``backward``: key -> guarded entries of
    ``(Plan or None, in_place)``; ``in_place``: the result is the incoming gradient, rotated
    in place). ``op`` says what the node returns and differentiates: ``"q"`` (the query op),
    ``"kv"`` (the key/value op), ``"qk"`` (two query-op tensors with one record); ``call`` is
    the checked record without its tensors, which the replayed call's inputs provide."""

    __slots__ = ("backward", "call", "forward", "inplace", "inplace_backward", "n_activations",
                 "op", "searched")  # fmt: skip

    def __init__(self, forward: Plan, replay: Replay):
        self.forward = forward
        # The forward searched ``cu_seqlens`` (its one scratch buffer): the caller's tables
        # are ``cos, sin, cu_seqlens`` and the saved record ``cos, sin, cu_seqlens, searched``.
        self.searched = bool(forward.scratch)
        self.op = replay.op
        self.call = replay.call
        self.inplace = replay.inplace
        self.inplace_backward = replay.inplace_backward
        self.n_activations = 1 if replay.op == "q" else 2
        self.backward: dict[tuple, list] = {}

    def find_backward(self, inputs: tuple[torch.Tensor, ...]):
        """The entry ``(Plan or None, in_place)`` recorded for a backward on ``inputs`` (the
        gradients, then the saved tensors), or ``MISSING``."""
        key = _alignment(inputs)
        for guard, entry in self.backward.get(key, ()):
            if guard(*inputs):
                return entry
        return MISSING

    def record_backward(self, inputs: tuple, results: tuple, launches: list) -> None:
        """Note what a backward on ``inputs`` made: ``results`` (the gradients it returned) from
        ``launches``. A result that is ``inputs[0]`` itself was rotated in place."""
        key = _alignment(inputs)
        if key is None:
            return
        in_place = any(r is inputs[0] for r in results)
        outputs = () if in_place else results
        plan = _plan_from(inputs, outputs, launches) if len(results) == self.n_activations else None
        entries = self.backward.setdefault(key, [])
        if len(entries) >= _MAX_PER_KEY:
            del entries[0]
        entries.append((_guard(inputs), (plan, in_place)))


class Replay(NamedTuple):
    """What a recorded call needing autograd replays besides its launches (:class:`GradPlan`)."""

    op: str
    call: object  # ops.QueryCall or ops.KVCall, its tensors None
    inplace: bool = False
    inplace_backward: bool = False


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
    alignment = _alignment(tensors)
    grad_mode = _is_grad_enabled()
    if alignment is None or (grad_mode and q.requires_grad and _transforms_active()):
        return None
    key = (
        "q", layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, inplace,
        inplace_backward, cu_seqlens is None, len(tensors), q.shape, alignment, _device_key(q),
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
    alignment = _alignment(tensors)
    grad_mode = _is_grad_enabled()
    if alignment is None or (
        grad_mode and (kv.requires_grad or k_pe.requires_grad) and _transforms_active()
    ):
        return None
    key = (
        "kv", layout, k_dim, cp_rank, cp_size, interleaved, interleaved_out, copy_v,
        megatron_rounding, cu_seqlens is None, len(tensors), kv.shape, alignment,
        _device_key(kv), grad_mode,
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
    alignment = _alignment(tensors)
    grad_mode = _is_grad_enabled()
    if alignment is None or (
        grad_mode
        and (q.requires_grad or k.requires_grad)
        and (q.requires_grad is not k.requires_grad or _transforms_active())
    ):
        return None
    key = (
        "qk", layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, len(tensors),
        q.shape, alignment, _device_key(q), grad_mode,
    )  # fmt: skip
    return _signature(Signature, (key, tensors))


_transforms_active = torch._C._are_functorch_transforms_active  # torch.func: its own path


def _positions(position_ids, cu_seqlens) -> tuple:
    """The position tensor a signature holds after the tables: ``position_ids`` or
    ``cu_seqlens`` (the key says which), or none."""
    if position_ids is not None:
        return (position_ids,)
    return () if cu_seqlens is None else (cu_seqlens,)


def _alignment(tensors: tuple) -> int | None:
    """Every tensor's address modulo 16, 4 bits each (Triton specializes on 16-byte alignment),
    or None if one is not a plain ``torch.Tensor`` with storage (a subclass, ``None`` where
    a tensor belongs, vmap's batched tensors, sparse tensors): those calls take the pipeline.
    The caller puts ``len(tensors)`` in the key beside it (with or without ``position_ids``)."""
    bits = 0
    try:
        for t in tensors:
            if t.__class__ is not torch.Tensor:
                return None
            bits = bits << 4 | (t.data_ptr() & 15)
    except RuntimeError:
        return None
    return bits


def _device_key(t: torch.Tensor):
    """Triton launches on the current device, not the tensor's: a plan is per current device.
    On the CPU the backend follows TRITON_INTERPRET (``ops.use_triton``), read on every call."""
    if t.is_cuda:
        return torch._C._cuda_getDevice()
    return ("cpu", os.environ.get("TRITON_INTERPRET"))


def find(signature: Signature | None) -> Plan | None:
    """The plan recorded for a call with this signature, or None: the call cannot have one,
    was recorded without one, or is yet to be recorded (:func:`recorder`)."""
    if signature is None:
        return None
    key, tensors = signature
    for guard, plan in LAUNCH_CACHE.plans.get(key, ()):
        if guard(*tensors):
            return plan
    return None


def _entry(signature: Signature):
    """The recorded entry matching ``signature``: a Plan, None (recorded without a plan), or
    ``MISSING``."""
    key, tensors = signature
    for guard, plan in LAUNCH_CACHE.plans.get(key, ()):
        if guard(*tensors):
            return plan
    return MISSING


def recorder(
    signature: Signature | None, x: torch.Tensor, replay: Replay | None = None
) -> _Recorder:
    """``with recorder(signature, x) as record: ... record(outputs)``: note the launches the
    pipeline makes inside the block, and store the plan they give (or that they give none)
    when the block ends without an exception: a :class:`GradPlan` with ``replay`` (a call that
    needs autograd), else a :class:`Plan`. Nothing is noted for a call that cannot have a
    plan (``signature`` None), one already recorded, or one that will launch no kernel (``x``,
    its first tensor, runs the PyTorch backend: triton stays unimported)."""
    return _Recorder(signature, x, replay)


class _Recorder:
    __slots__ = ("_launches", "_outputs", "_recording", "_replay", "_signature")

    def __init__(self, signature: Signature | None, x: torch.Tensor, replay: Replay | None):
        active = signature is not None and use_triton(x) and _entry(signature) is MISSING
        self._signature = signature if active else None
        self._replay = replay
        self._outputs = None
        self._recording = None

    def __enter__(self):
        if self._signature is not None:
            from .kernels._launch import recording

            self._recording = recording()
            self._launches = self._recording.__enter__()
        return self._record

    def _record(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self._outputs = outputs

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._recording is None:
            return
        self._recording.__exit__(exc_type, exc, tb)
        if exc_type is None and self._outputs is not None:
            key, tensors = self._signature
            entries = LAUNCH_CACHE.plan_entries(key)
            if len(entries) >= _MAX_PER_KEY:
                del entries[0]
            plan = _plan_from(tensors, self._outputs, self._launches)
            if plan is not None and self._replay is not None:
                plan = GradPlan(plan, self._replay)
            entries.append((_guard(tensors), plan))


def _guard(tensors: tuple[torch.Tensor, ...]):
    """``guard(*tensors)``: True for tensors with the metadata of these."""
    if _TensorGuards is not None:
        try:
            return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        except (TypeError, RuntimeError):  # another torch's signature: compare in Python
            pass
    recorded = _metadata(tensors)
    return lambda *now: _metadata(now) == recorded


def guard_kind() -> str:
    """Which guard plans use in this process (``mlarope info``)."""
    guard = _guard((torch.empty(1),))
    return "TensorGuards (C++)" if getattr(guard, "__self__", None) is not None else "Python"


def _metadata(tensors) -> tuple:
    # Inference mode too: TensorGuards sees an inference tensor differently in and out of it,
    # and an in-place call on one is rejected outside it.
    return (
        torch.is_inference_mode_enabled(),
        *((t.__class__, t.dtype, t.device, t.requires_grad, t.is_neg(), t.is_inference(),
           t.shape, t.stride()) for t in tensors),
    )  # fmt: skip


def _plan_from(inputs, outputs, launches) -> Plan | None:
    if not launches:
        return None
    out_specs = []
    for out in outputs:
        # The plan allocates outputs with new_empty: the same strides (the kernel got them as
        # integers) and, from the caching allocator, the same 16-byte alignment.
        if out.stride() != _contiguous_strides(out.shape) or out.dtype != inputs[0].dtype:
            return None
        out_specs.append(tuple(out.shape))
    scratch = getattr(launches, "scratch", ())
    if any(not s.is_contiguous() or s.device != inputs[0].device for s in scratch):
        return None
    recorded = []
    for launch, args in launches:
        template, slots = [], []
        for index, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                template.append(arg)
                continue
            template.append(None)
            source = _source_of(arg, inputs, outputs)
            if source is None:
                # A declared scratch buffer (the first launch given it writes it whole).
                j = next((j for j, s in enumerate(scratch) if arg is s), None)
                if j is None:
                    return None
                source = len(inputs) + len(outputs) + j
            slots.append((index, source))
        recorded.append((launch, template, tuple(slots)))
    apart = ()
    if not outputs:  # in place: inputs[0] is written, the other inputs are read
        reads = tuple((j, byte_span(t)) for j, t in enumerate(inputs) if j and byte_span(t))
        apart = (byte_span(inputs[0]), reads) if byte_span(inputs[0]) and reads else ()
    specs = tuple((tuple(s.shape), s.dtype) for s in scratch)
    return Plan(tuple(recorded), tuple(out_specs), apart, specs)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _source_of(arg: torch.Tensor, inputs, outputs) -> int | None:
    """Where a launch argument comes from: an output (the same tensor), or the one input with
    its address and dtype (a view of it). None if neither, or if several inputs match: with
    ``sin`` passed as ``cos`` too, the cos slot could not be told from the sin slot."""
    for j, out in enumerate(outputs):
        if arg is out:
            return len(inputs) + j
    ptr = arg.data_ptr()
    matches = [j for j, t in enumerate(inputs) if t.data_ptr() == ptr and t.dtype == arg.dtype]
    return matches[0] if len(matches) == 1 else None
