"""The recorded launches of a call and their replay: :class:`Plan` (a call's launches, the
tensors they read and write) and :class:`GradPlan` (with autograd: the forward's launches and,
per gradient signature, its backward's), how they are built from a recording
(``_recording``) and the guard that tells whether new tensors have a recorded
call's metadata.

They sit below the autograd functions (whose replayed node and backward run them) and above
the launcher: :mod:`mlarope._plans` finds them for a call (docs/architecture.md).

The kernels see a tensor argument only through its address and dtype (every stride is an
integer argument). A launch argument that is a view of an input with the same address (``k_pe``
without its head dim, the tables as ``[P, R]``, broadcast ``position_ids``) is filled with that
input; an argument that is an output is filled with the new call's output. A call may make
several launches (``apply_rope_qk``: two), each replayed in turn. A scratch buffer that one
launch writes whole and a later one reads (the ``cu_seqlens`` search's positions, declared by
``_recording.note_scratch``) is allocated anew for each replay, with its recorded shape
and dtype; a call that needs autograd saves it for its backward, as the pipeline's does.
Anything else (a copy, a launch that reads an output no declared scratch buffer holds, no
launch at all) gives no plan.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._memory import alignment, byte_span, lies_apart

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - present in every torch this package supports
    _TensorGuards = None

MAX_PER_KEY = 8  # guarded entries per key (same shape of the first tensor, other metadata)
MISSING = object()  # no recorded call matches (a recorded call without a plan gives None)


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
        return lies_apart(inputs, self.apart)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        # Few Python objects per call: each one the cyclic GC tracks brings its next
        # collection closer (docs/benchmarks.md, host overhead).
        if self.apart and not self.fits(inputs):
            return None
        return self.run(inputs)

    def run(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Allocate the outputs and make the launches (the caller checked :meth:`fits`)."""
        first = inputs[0]
        outs = [first.new_empty(shape) for shape in self.outputs]
        if self.scratch:
            outs += [first.new_empty(shape, dtype=dtype) for shape, dtype in self.scratch]
        n_inputs = len(inputs)
        for launch, template, slots in self.launches:
            args = template.copy()
            for index, source in slots:
                args[index] = inputs[source] if source < n_inputs else outs[source - n_inputs]
            launch(args)
        return outs  # the outputs, then the scratch buffers

    def run_keeping_scratch(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`run`, its outputs apart from the scratch buffers (a backward reads them)."""
        outs = self.run(inputs)
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
        self.searched = replay.searched
        self.op = replay.op
        self.call = replay.call
        self.inplace = replay.inplace
        self.inplace_backward = replay.inplace_backward
        self.n_activations = 1 if replay.op == "q" else 2
        self.backward: dict[tuple, list] = {}

    def replay_backward(self, inputs: tuple[torch.Tensor, ...]):
        """The gradients of a backward on ``inputs`` (the gradients, then the saved tensors)
        from the launches the first backward with their metadata made: a tuple; ``MISSING``
        where none was recorded yet (run the backward and :meth:`record_backward` it); None
        where one was, without launches these inputs can take (run the backward)."""
        key = alignment(inputs)
        for check, (plan, in_place) in self.backward.get(key, ()):
            if check(*inputs):
                if plan is None or not plan.fits(inputs):
                    return None
                outs = plan.run(inputs)
                if in_place:
                    torch.autograd.graph.increment_version(inputs[0])
                    return (inputs[0],)
                return tuple(outs[: len(plan.outputs)])
        return MISSING

    def record_backward(self, inputs: tuple, results: tuple, launches: list) -> None:
        """Note what a backward on ``inputs`` made: ``results`` (the gradients it returned) from
        ``launches``. A result that is ``inputs[0]`` itself was rotated in place."""
        key = alignment(inputs)
        if key is None:
            return
        in_place = any(r is inputs[0] for r in results)
        outputs = () if in_place else results
        plan = plan_from(inputs, outputs, launches) if len(results) == self.n_activations else None
        entries = self.backward.setdefault(key, [])
        if len(entries) >= MAX_PER_KEY:
            del entries[0]
        entries.append((guard(inputs), (plan, in_place)))


class Replay(NamedTuple):
    """What a recorded call needing autograd replays besides its launches (:class:`GradPlan`)."""

    op: str
    call: object  # _records.QueryCall or KVCall, its tensors None
    inplace: bool = False
    inplace_backward: bool = False
    searched: bool = False  # the call searched cu_seqlens (its forward's one scratch buffer)


def record(inputs: tuple, outputs: tuple, launches, replay: Replay | None = None) -> tuple:
    """The cache entry ``(guard, plan)`` of a call the pipeline ran: its ``inputs`` (the
    signature's tensors), the ``outputs`` it returned (``()`` in place) and the ``launches`` it
    made; with ``replay`` (a call that needs autograd) the plan is a :class:`GradPlan`. The
    plan is None where the launches give none."""
    plan = plan_from(inputs, outputs, launches)
    if plan is not None and replay is not None:
        # A searched call's one scratch buffer is the search's positions, which the replayed
        # node saves for its backward; any other scratch there has no place in the record.
        plan = GradPlan(plan, replay) if len(plan.scratch) == int(replay.searched) else None
    return guard(inputs), plan


def guard(tensors: tuple[torch.Tensor, ...]):
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
    recorded = guard((torch.empty(1),))
    return "TensorGuards (C++)" if getattr(recorded, "__self__", None) is not None else "Python"


def _metadata(tensors) -> tuple:
    # Inference mode too: TensorGuards sees an inference tensor differently in and out of it,
    # and an in-place call on one is rejected outside it.
    return (
        torch.is_inference_mode_enabled(),
        *((t.__class__, t.dtype, t.device, t.requires_grad, t.is_neg(), t.is_inference(),
           t.shape, t.stride()) for t in tensors),
    )  # fmt: skip


def plan_from(inputs, outputs, launches) -> Plan | None:
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
        if launch is None:  # a launch the recording could not keep (kernels._launch)
            return None
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
