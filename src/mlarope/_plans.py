"""Launch plans: repeated eager calls skip straight to the kernel launch (the decode path).

An eager call (no autograd, not compiling, no validation) whose arguments have the same
metadata as an earlier call's makes the same launch: the same compiled kernel, grid and integer
arguments; only the tensors' addresses differ. The first such call runs the whole pipeline
(checks -> positions -> launcher -> kernel) while ``kernels._launch.recording()`` notes its
launch; later calls with an equal key allocate the outputs, put the new tensors into the noted
argument slots and launch. That is about a third of the host time of the whole pipeline
(docs/benchmarks.md, host overhead).

The key holds everything the checks and the launcher read from a call: each tensor's shape,
strides, dtype, device and address modulo 16 (Triton specializes on 16-byte alignment), every
flag and integer with its type (so ``1`` never stands in for ``True``), and the current device.
So a call can only hit a plan if the full pipeline would pass every check and make the very
same launch.

The kernels see a tensor argument only through its address and dtype (every stride is an
integer argument). A launch argument that is a view of an input with the same address (``k_pe``
without its head dim, the tables as ``[P, R]``, broadcast ``position_ids``) is filled with that
input; an argument that is an output is filled with the new call's output. Anything else (a
copy, several launches such as the ``cu_seqlens`` search, no launch at all, an input of a
tensor subclass) gets no plan, and such calls always take the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import env_validation

if TYPE_CHECKING:  # kernels import triton, which stays unimported until a kernel is needed
    from .kernels._launch import Launch

MISSING = object()  # no entry for this key yet (the cache holds None for "no plan")
_MAX_PLANS = 1024  # distinct keys kept before the cache starts over

plans: dict[tuple, Plan | None] = {}


class Plan:
    """The recorded launch of one call signature: ``plan(inputs)`` -> the outputs."""

    __slots__ = ("launch", "outputs", "slots", "template")

    def __init__(self, launch: Launch, template: list, slots: tuple, outputs: tuple):
        self.launch = launch
        self.template = template  # the launch arguments, tensors replaced by None
        self.slots = slots  # (argument index, index into inputs + outputs)
        self.outputs = outputs  # shapes of the outputs: contiguous, dtype and device of inputs[0]

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        first = inputs[0]
        outs = tuple([first.new_empty(shape) for shape in self.outputs])
        sources = inputs + outs
        args = self.template.copy()
        for index, source in self.slots:
            args[index] = sources[source]
        self.launch(args)
        return outs


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def query_key(
    q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, inplace, validate,
) -> tuple | None:  # fmt: skip
    """The plan key of an ``apply_rope_q`` call, or None if it cannot have a plan: only plain
    eager calls get one (no validation, no autograd, no compile tracing; plain tensors; flags
    that are bools and integers that are ints, so 1 never stands in for True)."""
    tensor = torch.Tensor
    if (
        cu_seqlens is not None
        or torch.compiler.is_compiling()  # first: nothing below is traced by Dynamo
        or q.__class__ is not tensor
        or cos.__class__ is not tensor
        or sin.__class__ is not tensor
        or not (position_ids is None or position_ids.__class__ is tensor)
        or validate is not False
        or cp_rank.__class__ is not int
        or cp_size.__class__ is not int
        or (interleaved is not True and interleaved is not False)
        or (interleaved_out is not True and interleaved_out is not False)
        or (inverse is not True and inverse is not False)
        or (inplace is not True and inplace is not False)
        or (q.requires_grad and torch.is_grad_enabled())
        or env_validation()
    ):
        return None
    ids = position_ids
    return (
        "q", layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, inplace,
        q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
        cos.shape, cos.stride(), cos.dtype, cos.device, cos.data_ptr() & 15,
        sin.shape, sin.stride(), sin.dtype, sin.device, sin.data_ptr() & 15,
        None if ids is None else _meta(ids),
        torch._C._cuda_getDevice() if q.is_cuda else -1,
    )  # fmt: skip


def kv_key(
    kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, copy_v, validate,
) -> tuple | None:  # fmt: skip
    """The plan key of an ``apply_rope_kv`` call, or None if it cannot have a plan."""
    tensor = torch.Tensor
    if (
        cu_seqlens is not None
        or torch.compiler.is_compiling()
        or kv.__class__ is not tensor
        or k_pe.__class__ is not tensor
        or cos.__class__ is not tensor
        or sin.__class__ is not tensor
        or not (position_ids is None or position_ids.__class__ is tensor)
        or validate is not False
        or k_dim.__class__ is not int
        or cp_rank.__class__ is not int
        or cp_size.__class__ is not int
        or (interleaved is not True and interleaved is not False)
        or (interleaved_out is not True and interleaved_out is not False)
        or (copy_v is not True and copy_v is not False)
        or ((kv.requires_grad or k_pe.requires_grad) and torch.is_grad_enabled())
        or env_validation()
    ):
        return None
    ids = position_ids
    return (
        "kv", layout, k_dim, cp_rank, cp_size, interleaved, interleaved_out, copy_v,
        kv.shape, kv.stride(), kv.dtype, kv.device, kv.data_ptr() & 15,
        k_pe.shape, k_pe.stride(), k_pe.dtype, k_pe.device, k_pe.data_ptr() & 15,
        cos.shape, cos.stride(), cos.dtype, cos.device, cos.data_ptr() & 15,
        sin.shape, sin.stride(), sin.dtype, sin.device, sin.data_ptr() & 15,
        None if ids is None else _meta(ids),
        torch._C._cuda_getDevice() if kv.is_cuda else -1,
    )  # fmt: skip


def record(
    key: tuple,
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    launches: list[tuple[Launch, tuple]],
) -> None:
    """Store the plan of ``key`` from the pipeline's launches, or None where it has none."""
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = _plan_from(inputs, outputs, launches)


def _plan_from(inputs, outputs, launches) -> Plan | None:
    if len(launches) != 1:
        return None
    launch, args = launches[0]
    out_specs = []
    for out in outputs:
        # The plan allocates outputs with new_empty: the same strides (the kernel got them as
        # integers) and, from the caching allocator, the same 16-byte alignment.
        if out.stride() != _contiguous_strides(out.shape) or out.dtype != inputs[0].dtype:
            return None
        out_specs.append(tuple(out.shape))
    template, slots = [], []
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            template.append(arg)
            continue
        template.append(None)
        source = _source_of(arg, inputs, outputs)
        if source is None:
            return None
        slots.append((index, source))
    return Plan(launch, template, tuple(slots), tuple(out_specs))


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
