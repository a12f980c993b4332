"""Launch plans of the serving ops: a repeated eager call skips straight to its kernel launch.

A decode step calls each op once per layer with tensors of the same metadata; only addresses,
and a number scale, change. The first call with new metadata runs the whole pipeline
(checks -> custom-op implementation -> launcher) while ``kernels._launch.recording()`` notes
its launch; later calls whose key and guard match fill the new tensors and the scale into the
recorded argument list and launch, without checks, views or Triton's binder.

- Key: the op, its str / bool / int arguments, the scale's kind (``rope_inverse_quant_output``:
  the scale dtype), which outputs are allocated, the first tensor's shape, every
  tensor's address modulo 16 (Triton specializes on 16-byte alignment, and ``fp8_656`` checks
  it), the current device (on the CPU, ``TRITON_INTERPRET``), grad mode and inference mode.
- Guard: every tensor's class, dtype, device, dispatch keys, ``requires_grad``, sizes and
  strides against the recorded call (``torch._C._dynamo.guards.TensorGuards``, as
  ``mlarope._plans``), so a call takes a plan only where the pipeline would pass every check
  and make the same launch. A number scale (any real number, numpy's scalars too) is
  range-checked on every call, and a written tensor is checked, from the addresses, to lie
  apart from every other tensor (byte spans apart, or at the offset of the recorded call,
  which the pipeline found to share no element: the memory rule depends on the addresses
  only through that offset): the two
  checks of the pipeline that depend on values, not on metadata. Anything else takes the
  pipeline, and so do the attention output's full tables whose ``sin`` starts a row's width
  after ``cos`` (an engine's ``cos_sin_cache`` halves, which its checks refuse).
- Replay: each kernel argument that was a tensor is the call's tensor at the recorded index.
  The kernels were given integer views (``uint8``, ``int16``, ``int32``) of some of them; a
  compiled kernel sees only the address, so the call's tensor itself is passed, and the view is
  made again only where Triton's own launch path runs (the interpreter, launch hooks).

Nothing is planned under ``torch.compile``, with validation on (argument or
``MLAROPE_VALIDATE``) or forward-mode AD; those calls take the pipeline.

The entries live in the core's one launch cache (``mlarope._launch_cache.LAUNCH_CACHE.plans``,
keys starting ``"serving.append"`` / ``"serving.query"`` / ``"serving.output"``, apart from
the core's ``"q"`` / ``"kv"``), so ``clear_launch_cache()`` forgets them too and the table's
bound covers both. The replay stays here: unlike the core's plans it passes a number
scale, allocates outputs of another dtype than the input's, and checks written tensors against
read ones.
"""

from __future__ import annotations

import numbers

import torch
from torch.autograd import forward_ad as _fwad

from .._launch_cache import LAUNCH_CACHE
from .._launch_plans import MAX_PER_KEY as _MAX_PER_KEY
from .._launch_plans import guard as _guard
from .._memory import byte_span
from .._modes import device_key as _device_key

# Core import point (the plan cache's guard and device key, the one launch cache).
from .._modes import env_validation

MISSING = object()  # no recorded call matches (a recorded call without a plan gives None)
_FP32_MIN_NORMAL = 2.0**-126
_FP32_MAX = 3.4028234663852886e38


class Plan:
    """One recorded launch: ``plan(tensors, scale_value)`` launches it on new tensors.
    ``alloc``: for an op that returns new tensors, ``((shape, dtype), ...)`` of them; they are
    passed at their recorded indices after the call's tensors and returned (one tensor, or a
    tuple of several)."""

    __slots__ = (
        "alloc", "apart", "launch", "scalar_index", "slots", "template", "through", "views",
    )  # fmt: skip

    def __init__(self, launch, template, slots, views, scalar_index, alloc, apart):
        from ..kernels._launch import _through_triton

        self.through = _through_triton  # launch hooks or debug mode: Triton's own launch path
        self.launch = launch
        self.template = template  # the launch arguments, tensors replaced by None
        self.slots = slots  # ((argument index, tensor index), ...)
        self.views = views  # ((argument index, tensor index, dtype), ...) for Triton's path
        self.scalar_index = scalar_index  # argument index of the scale value, or None
        self.alloc = alloc
        self.apart = apart  # ((written index, its span, read index, its span, offset), ...)

    def __call__(self, tensors: tuple, scale_value: float | None, addresses: list[int]):
        if self.apart and _overlap(addresses, self.apart):
            return MISSING
        out = None
        if self.alloc is not None:
            new = tuple(tensors[0].new_empty(shape, dtype=dtype) for shape, dtype in self.alloc)
            tensors = (*tensors, *new)
            out = new[0] if len(new) == 1 else new
        args = self.template.copy()
        launch = self.launch
        kernel = launch.kernel
        if kernel is not None and not self.through(launch.launcher.fn):
            for index, source in self.slots:
                args[index] = tensors[source]
            if self.scalar_index is not None:
                args[self.scalar_index] = scale_value
            g0, g1, g2 = launch.grid
            kernel.launch(g0, g1, g2, launch.device, args)
            return out
        for index, source, dtype in self.views:
            t = tensors[source]
            args[index] = t if t.dtype == dtype else _view(t, dtype)
        if self.scalar_index is not None:
            args[self.scalar_index] = scale_value
        launch(args)
        return out


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s address as ``dtype`` (the kernels read only the address and dtype): a view of
    ``t``, or of its first element where a stride no address depends on is odd (an fp8_584
    cache's single block, or its one entry a block), which a wider dtype cannot view."""
    if t.dim() == 4:  # an fp8_656 or fp8_584 cache [num_blocks, block_size, 1, bytes]
        t = t.squeeze(2)
    try:
        return t.view(dtype)
    except RuntimeError:
        width = max(1, torch.empty((), dtype=dtype).element_size() // t.element_size())
        return t.as_strided((width,), (1,)).view(dtype)


def _overlap(addresses: list[int], apart: tuple) -> bool:
    """Whether the call may break the no-overlap rule: True unless every written tensor's byte
    span is apart from each other tensor's, or lies from it at the very offset the recorded
    call had (``delta``, not None where the recorded spans intersected and the pipeline found
    no element in common: the rule depends on the addresses only through that offset, the
    guard fixes the rest)."""
    for written, w_span, read, r_span, delta in apart:
        w0, r0 = addresses[written], addresses[read]
        if w0 < r0 + r_span and r0 < w0 + w_span and r0 - w0 != delta:
            return True
    return False


# ---------------------------------------------------------------------------------- signatures
def _plain(validate, *flags) -> bool:
    return not (
        torch.compiler.is_compiling()
        or _fwad._current_level >= 0
        or validate is not False
        or any(f is not True and f is not False for f in flags)
        or env_validation()
    )


def _scale_kind(scale):
    """``(kind, value)``: None, a number (range-checked here: an out-of-range one takes the
    pipeline, which raises), or a tensor; ``kind`` False when the call cannot have a plan."""
    cls = scale.__class__
    if scale is None:
        return None, None
    if cls is float or cls is int:
        if _FP32_MIN_NORMAL <= scale <= _FP32_MAX:
            return cls, float(scale)
        return False, None
    if cls is torch.Tensor:
        return torch.Tensor, None
    if cls is not bool and isinstance(scale, numbers.Real):  # numpy's scalars, Fraction
        try:
            value = float(scale)
        except OverflowError:
            return False, None
        if _FP32_MIN_NORMAL <= value <= _FP32_MAX:
            return cls, value
    return False, None


def _addresses(tensors: tuple) -> list[int] | None:
    """Every tensor's address, or None if one is not a plain tensor with storage (a subclass,
    vmap's batched tensors, None where a tensor belongs) or two start at one address (one
    tensor passed for ``positions`` and ``slot_mapping``, say: a launch recorded from it cannot
    say which argument a later call's tensor belongs to): those calls take the pipeline and
    record nothing, so calls with distinct tensors of the same metadata keep their plan."""
    try:
        addresses = [t.data_ptr() for t in tensors]
    except (RuntimeError, AttributeError):
        return None
    for t in tensors:
        if t.__class__ is not torch.Tensor:
            return None
    if len(set(addresses)) != len(addresses):
        return None
    return addresses


def _alignment(addresses: list[int]) -> int:
    """Every address modulo 16, 4 bits each."""
    bits = 0
    for a in addresses:
        bits = bits << 4 | (a & 15)
    return bits


def append_signature(
    kv_c, k_pe, cos, sin, positions, cache, slot_mapping, cache_format, kv_scale, interleaved,
    interleaved_out, pair_tables, validate,
):  # fmt: skip
    """``(key, tensors, scale_value, addresses)`` of a ``rope_append_kv_cache`` call, or None if
    it cannot have a plan. ``tensors``: the inputs, the cache(s), then a tensor scale."""
    if (
        not _plain(validate, interleaved, interleaved_out, pair_tables)
        or cache_format.__class__ is not str
    ):
        return None
    kind, value = _scale_kind(kv_scale)
    if kind is False:
        return None
    if cache_format == "split":
        if cache.__class__ is not tuple or len(cache) != 2:
            return None
        tensors = (kv_c, k_pe, cos, sin, positions, slot_mapping, cache[0], cache[1])
    else:
        tensors = (kv_c, k_pe, cos, sin, positions, slot_mapping, cache)
    if kind is torch.Tensor:
        tensors = (*tensors, kv_scale)
    addresses = _addresses(tensors)
    if addresses is None:
        return None
    key = (
        "serving.append", cache_format, interleaved, interleaved_out, pair_tables, kind,
        len(tensors),
        kv_c.shape, _alignment(addresses), _device_key(kv_c), torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )  # fmt: skip
    return key, tensors, value, addresses


def query_signature(
    q_nope, q_pe, cos, sin, positions, out, out_dtype, q_scale, interleaved, interleaved_out,
    pair_tables, validate,
):  # fmt: skip
    """``(key, tensors, scale_value, addresses)`` of a ``rope_decode_query`` call, or None."""
    if not _plain(validate, interleaved, interleaved_out, pair_tables):
        return None
    kind, value = _scale_kind(q_scale)
    if kind is False or (out_dtype is not None and out_dtype.__class__ is not torch.dtype):
        return None
    tensors = (q_nope, q_pe, cos, sin, positions)
    if kind is torch.Tensor:
        tensors = (*tensors, q_scale)
    if out is not None:
        tensors = (*tensors, out)
    addresses = _addresses(tensors)
    if addresses is None:
        return None
    key = (
        "serving.query", interleaved, interleaved_out, pair_tables, kind, out is None, out_dtype,
        len(tensors),
        q_nope.shape, _alignment(addresses), _device_key(q_nope), torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )  # fmt: skip
    return key, tensors, value, addresses


def output_signature(
    o, cos, sin, positions, groups, out, scale_out, scale_dtype, interleaved, interleaved_out,
    pair_tables, validate,
):  # fmt: skip
    """``(key, tensors, None, addresses)`` of a ``rope_inverse_quant_output`` call, or None.
    ``tensors``: ``o, cos, sin, positions``, then ``out`` and ``scale_out`` where given. Full
    tables whose ``sin`` starts a row's width after ``cos`` have no plan: they may be an
    engine's ``cos_sin_cache`` halves, which the checks refuse without ``pair_tables``."""
    if (
        not _plain(validate, interleaved, interleaved_out, pair_tables)
        or groups.__class__ is not int
    ):
        return None
    if scale_dtype is not None and scale_dtype.__class__ is not torch.dtype:
        return None
    tensors = (o, cos, sin, positions)
    if out is not None:
        tensors = (*tensors, out)
    if scale_out is not None:
        tensors = (*tensors, scale_out)
    addresses = _addresses(tensors)
    if addresses is None or (
        not pair_tables and addresses[2] - addresses[1] == cos.shape[-1] * cos.element_size()
    ):
        return None
    key = (
        "serving.output", groups, interleaved, interleaved_out, pair_tables, scale_dtype,
        out is None,
        scale_out is None, len(tensors), o.shape, _alignment(addresses), _device_key(o),
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
    )  # fmt: skip
    return key, tensors, None, addresses


def find(signature):
    """The plan of a call with this signature: a Plan; None where the call cannot have one or
    was recorded without one; MISSING where it is to be recorded."""
    if signature is None:
        return None
    key, tensors = signature[0], signature[1]
    for guard, plan in LAUNCH_CACHE.plans.get(key, ()):
        if guard(*tensors):
            return plan
    return MISSING


def record(signature, launches: list, written: tuple[int, ...], out=None) -> None:
    """Store the plan of a call from its pipeline's launches (``written``: the indices of the
    tensors it writes; ``out``: the tensor it returned, or the tuple of tensors it allocated,
    for an out-of-place call)."""
    key, tensors, value = signature[0], signature[1], signature[2]
    entries = LAUNCH_CACHE.plan_entries(key)
    if len(entries) >= _MAX_PER_KEY:
        del entries[0]
    entries.append((_guard(tensors), _plan_from(tensors, value, launches, written, out)))


def _plan_from(tensors, value, launches, written, out) -> Plan | None:
    if len(launches) != 1:
        return None
    launch, args = launches[0]
    outs = () if out is None else out if isinstance(out, tuple) else (out,)
    everything = (*tensors, *outs)
    template, slots, views, scalar_index = [], [], [], None
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            source = _source_of(arg, everything)
            if source is None:
                return None
            template.append(None)
            slots.append((index, source))
            views.append((index, source, arg.dtype))
        else:
            template.append(arg)
            if value is not None and arg.__class__ is float and arg == value:
                if scalar_index is not None:
                    return None  # two float arguments equal to the scale: which one is it
                scalar_index = index
    if value is not None and scalar_index is None:
        return None
    alloc = None
    if outs:
        for t in outs:
            if t.stride() != tuple(torch.empty(t.shape, device="meta").stride()):
                return None
        alloc = tuple((tuple(t.shape), t.dtype) for t in outs)
    spans = [byte_span(t) for t in everything]
    starts = [t.data_ptr() for t in everything]
    # Each written tensor against every other tensor of the call (a new output excepted), with
    # their offset where their spans intersect (views of one buffer apart by elements, which
    # the pipeline accepted): a later call with that offset is accepted too, another one takes
    # the pipeline.
    apart = tuple(
        (w, spans[w], r, spans[r], _offset(starts, spans, w, r))
        for w in written
        for r in range(len(tensors))
        if r != w and not (r in written and r < w) and spans[r] and spans[w]
    )
    return Plan(launch, template, tuple(slots), tuple(views), scalar_index, alloc, apart)


def _offset(starts: list[int], spans: list[int], w: int, r: int) -> int | None:
    """``starts[r] - starts[w]`` where the two byte spans intersect, else None."""
    w0, r0 = starts[w], starts[r]
    return r0 - w0 if w0 < r0 + spans[r] and r0 < w0 + spans[w] else None


def _source_of(arg: torch.Tensor, tensors: tuple) -> int | None:
    """The one call tensor whose memory ``arg`` starts at (itself or a view of it); None when
    none, or several, do: one tensor passed for two arguments (``positions`` and
    ``slot_mapping``, ``cos`` and ``sin``) gives no plan, since a later call with two tensors
    would find both launch arguments mapped to one of them."""
    ptr = arg.data_ptr()
    matches = [j for j, t in enumerate(tensors) if t.data_ptr() == ptr]
    return matches[0] if len(matches) == 1 else None
