"""Autograd for both ops: backward, double backward, forward-mode AD, ``torch.func``, compile.

Both ops are linear in their activations (the tables are constants), so every derivative is
again one of the ops:

- query op ``R``: its backward is ``R^T`` (:meth:`QueryCall.transposed`: the same op with
  ``transpose`` flipped and the input and output layouts swapped), and the backward of ``R^T``
  is ``R`` again; its tangent (forward-mode AD) is ``R`` applied to the tangent;
- key/value op ``F: (kv, k_pe) -> (k, v)``: its backward is ``B: (dk, dv) -> (dkv, dk_pe)``,
  and the backward of ``B`` is ``F`` applied to ``(g_dkv, g_dk_pe)``; tangents go through ``F``
  and ``B`` themselves.

A backward or tangent that itself needs differentiating (``create_graph=True``, forward AD,
``torch.func``) therefore applies the op through its autograd function (``_apply_q``,
``_apply_kv``, ``_apply_kv_backward``), which records it again, to any order. Otherwise it
runs the op directly: no autograd overhead on a plain backward.

Each op has three autograd functions with the same forward, backward and jvp
(:class:`_Functions`): eager (``forward(ctx, ...)``), for ``torch.func`` transforms (which need
the ``setup_context`` form; PyTorch binds every call of that form to its signature with
``inspect``, tens of microseconds, so eager calls do not use it), and compiled (no ``jvp``,
which Dynamo cannot trace). While compiling, calls that need no gradient go to the custom ops
directly: Dynamo cannot trace ``mark_dirty`` either.

The functions' inputs are the activations, then the op's record (``_records.call_args``), then (the
query op) ``inplace`` and ``inplace_backward``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwad

from . import _launch_plans
from ._modes import compiling, needs_autograd
from ._recording import recording
from ._records import KVCall, QueryCall, call_args, call_tensors, with_tensors
from .ops import (
    has_memory,
    rope_kv_op,
    rope_q_inplace_op,
    rope_q_op,
    run_kv,
    run_kv_backward,
    run_q,
    run_q_,
    search_for_backward,
)

_N_QUERY = len(dataclasses.fields(QueryCall))
_N_KV = len(dataclasses.fields(KVCall))
_NO_TENSORS = (None,) * 5  # _records.call_tensors, while they are saved apart


def _ready(t: Tensor) -> Tensor:
    """A gradient or tangent as the kernels read it: no lazy negation (neg bit), a contiguous
    last dim, and not the wrapper of a ``torch.func`` transform that has returned (a backward
    run after ``torch.func.vjp`` returned gets those)."""
    if not compiling() and _functorch.is_functorch_wrapped_tensor(t):  # Dynamo skips these
        t = _functorch.unwrap_if_dead(t)
    t = t.resolve_neg()
    return t if t.stride(-1) == 1 else t.contiguous()


def _save(ctx, call):
    """Save the record's tensors (never differentiated: ``_checks.check_tables_constant``) for
    the backward and ``jvp``, as plain tensors: inside a ``torch.func`` transform they may be
    its wrappers, which outlive the transform (a backward run after ``torch.func.vjp``
    returned) and which the kernels cannot read. The rest of the record is kept on ``ctx``."""
    tensors = call_tensors(call)
    if not compiling() and _functorch.maybe_current_level() is not None:
        plain = []
        for t in tensors:
            while t is not None and _functorch.is_functorch_wrapped_tensor(t):
                t = _functorch.get_unwrapped(t)
            plain.append(t)
        tensors = tuple(plain)
    ctx.save_for_backward(*tensors)
    if _fwad._current_level >= 0:
        ctx.save_for_forward(*tensors)
    ctx.call = with_tensors(call, _NO_TENSORS)


def _saved(ctx):
    """The record :func:`_save` kept, its tensors back in place."""
    return with_tensors(ctx.call, ctx.saved_tensors)


@dataclass(frozen=True)
class _Functions:
    """One op's autograd functions: the same forward, backward and jvp in three forms."""

    eager: type[torch.autograd.Function]
    func: type[torch.autograd.Function]  # setup_context form, for torch.func transforms
    compiled: type[torch.autograd.Function]  # no jvp, for Dynamo

    def pick(self) -> type[torch.autograd.Function]:
        if compiling():
            return self.compiled
        if torch._C._are_functorch_transforms_active():
            return self.func
        return self.eager


def _functions(name: str, doc: str, forward, setup_context, backward, jvp) -> _Functions:
    """Build ``_Functions`` from ``forward(*inputs)``, ``setup_context(ctx, inputs, output)``,
    ``backward(ctx, *grads)`` and ``jvp(ctx, *tangents)``."""

    def forward_with_ctx(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def make(suffix: str, members: dict) -> type[torch.autograd.Function]:
        members = {"__doc__": doc, "backward": staticmethod(backward), **members}
        return type(name + suffix, (torch.autograd.Function,), members)

    return _Functions(
        eager=make("", {"forward": staticmethod(forward_with_ctx), "jvp": staticmethod(jvp)}),
        func=make(
            "ForTorchFunc",
            {
                "forward": staticmethod(forward),
                "setup_context": staticmethod(setup_context),
                "jvp": staticmethod(jvp),
            },
        ),
        compiled=make("Compiled", {"forward": staticmethod(forward_with_ctx)}),
    )


# ------------------------------------------------------------------- query op: R and R^T
def _q_forward(x, *inputs):
    call = QueryCall(*inputs[:_N_QUERY])
    if inputs[_N_QUERY]:  # inplace
        run_q_(x, call)
        return x
    return run_q(x, call)


def _q_setup_context(ctx, inputs, output):
    inplace, inplace_backward = inputs[1 + _N_QUERY :]
    if inplace:
        ctx.mark_dirty(inputs[0])
    _save(ctx, QueryCall(*inputs[1 : 1 + _N_QUERY]))
    ctx.inplace = inplace
    ctx.inplace_backward = inplace_backward


_Q_NO_GRADS = (None,) * (_N_QUERY + 2)


def _q_backward(ctx, grad):
    return (_q_gradient(_ready(grad), _saved(ctx), ctx.inplace_backward), *_Q_NO_GRADS)


def _q_gradient(grad: Tensor, call: QueryCall, inplace_backward: bool) -> Tensor:
    """``R^T grad`` (``grad`` ready for the kernels): in place given ``inplace_backward`` where
    the gradient allows it, else a new tensor."""
    transposed = call.transposed()
    if inplace_backward and _grad_rotatable_in_place(grad):
        run_q_(grad, transposed)
        return grad
    return _apply_q(grad, transposed, False)


def _q_jvp(ctx, tangent, *_):
    if tangent is None:  # only the tables could carry one, and the API rejects that
        return None
    if ctx.inplace:  # the tangent is rotated in place, as PyTorch requires
        return _apply_q(tangent, _saved(ctx), True)
    return _apply_q(_ready(tangent), _saved(ctx), False)


_Q = _functions(
    "RopeQFunction",
    """The query op ``R`` (``transpose=False``) or its transpose ``R^T``. Inputs: ``x``, the
    :class:`QueryCall` fields, ``inplace``, ``inplace_backward``.

    The backward is out of place by default, for the in-place op too: the incoming gradient may
    be shared (``a + b`` hands one tensor to both branches; ``z.backward(g)`` hands the caller's
    ``g``), so rotating it in place, as Megatron-Core does, can corrupt another branch's
    gradient. That costs the nope channels' bytes. With ``inplace_backward`` the caller vouches
    that nothing else holds the gradient (``q`` feeds one attention kernel), and an eager
    backward rotates the gradient's rope channels in place and returns it: ``2 R`` instead of
    ``2 (N + R)`` elements a row. It falls back to out of place where that is not possible
    (``_grad_rotatable_in_place``), for double backward and forward AD, and when compiling.
    See docs/semantics.md.""",
    _q_forward,
    _q_setup_context,
    _q_backward,
    _q_jvp,
)


def _apply_q(x: Tensor, call: QueryCall, inplace: bool) -> Tensor:
    """The query op on ``x`` (a gradient or a tangent), recorded by autograd when it needs to
    be (double backward, forward AD, torch.func), else run directly."""
    if needs_autograd(x):
        return _Q.pick().apply(x, *call_args(call), inplace, False)
    if inplace:
        run_q_(x, call)
        return x
    return run_q(x, call)


def rope_q_differentiable(
    q: Tensor, call: QueryCall, inplace: bool, inplace_backward: bool
) -> Tensor:
    """The query op on checked arguments where autograd, forward AD or ``torch.compile`` is
    involved (``needs_autograd(q)`` or compiling); ``api`` runs everything else itself.

    Compiled, a call that needs no gradient is the custom op itself (Dynamo cannot trace the
    autograd function's ``mark_dirty``), and an in-place call that needs one is the out-of-place
    op copied back into ``q``: torch 2.11's compiled backward of an autograd function that marks
    its in-place custom op's input dirty passed the gradient through unrotated
    (docs/semantics.md). The same values and gradients, bit for bit; it moves whole rows twice
    (about ``4 (N + R)`` elements per row instead of ``2 R``) unless Inductor fuses the copy."""
    if compiling():
        if not (torch.is_grad_enabled() and q.requires_grad):
            if inplace:
                rope_q_inplace_op(q, *call_args(call))
                return q
            return rope_q_op(q, *call_args(call))
        if inplace:
            return q.copy_(_Q.compiled.apply(q, *call_args(call), False, False))
        return _Q.compiled.apply(q, *call_args(call), False, inplace_backward)
    if call.cu_seqlens is not None:  # the search the backward reuses (nothing to search else)
        call = search_for_backward(q, call)
    if inplace and rotates_whole_base(q):
        return _rotate_through_base(q, lambda x: run_q_(x, call), call, None)
    return _Q.pick().apply(q, *call_args(call), inplace, inplace_backward)


# ------------------------------------------------- in place on a view that reshapes its base
def rotates_whole_base(q: Tensor) -> bool:
    """Whether an in-place call that needs autograd should mark ``q``'s base dirty, not ``q``:
    ``q`` a view (not of a leaf) that is its whole contiguous base reshaped, as
    ``linear(x).view(S, B, H, D)`` is (Megatron-Core's query), in plain eager autograd.

    Marking a view dirty makes autograd rebase it (a ``CopySlices`` node, whose backward
    allocates the base's gradient anew and copies it three times) and regenerate the view's
    history as an ``as_strided`` view (a zero fill and a copy): on the H200 those device copies
    took 0.43 ms of a 14.6 ms Megatron-Core layer step at sbhd 4,096, which made the patch 2 %
    slower than Megatron's fused kernels (docs/perf_log.md v15). Marking the base dirty is the same
    declaration: every view of it, ``q`` too, takes its new history the next time autograd
    sees it, and any op that saved the base or a view of it raises at backward time."""
    base = q._base
    return (
        base is not None
        and not base.is_leaf
        and _created_plainly(q)
        and _fwad._current_level < 0
        and not torch._C._are_functorch_transforms_active()
        and not _functorch.is_functorch_wrapped_tensor(q)
        and torch.is_grad_enabled()
        and q.requires_grad
        and base.dtype == q.dtype
        and q.numel() == base.numel()
        and q.storage_offset() == base.storage_offset()
        and q.is_contiguous()
        and base.is_contiguous()
    )


def _created_plainly(q: Tensor) -> bool:
    """``q`` a view made by a view op in plain autograd: not inside a custom autograd function
    (whose backward a new view of the base would skip; a module's full backward hook wraps its
    inputs so) and not one of several outputs (``split``, ``unbind``), which PyTorch forbids
    writing in place. Unknown (a torch without the query): no."""
    meta = getattr(torch._C._autograd, "_get_creation_meta", None)
    return meta is not None and meta(q) == torch._C._autograd.CreationMeta.DEFAULT


class _ThroughBase(torch.autograd.Function):
    """``rotate(q)`` in place (the kernels, no autograd), declared on ``base``, which ``q``
    reshapes whole (:func:`rotates_whole_base`); the backward is ``R^T`` of the base's gradient
    reshaped as ``q``, out of place: the base's gradient may be another branch's too (``base +
    y`` hands one tensor to both), which ``inplace_backward`` does not vouch for. Inputs:
    ``base``, ``q``'s shape, ``rotate``, then either the pipeline's record and None, or None
    and the launch plan of a replayed call, whose ``rotate`` returns the record's tensors its
    backward reads (``cos, sin[, ids]`` or ``cos, sin, cu_seqlens, searched``; the backward
    replays the plan's recorded launches). The record's tensors are saved as the other nodes
    save them, so that an in-place change to a table before the backward raises."""

    @staticmethod
    def forward(ctx, base, shape, rotate, call, plan):
        # which bumps the version counter once, as the other paths; a replayed call's rotate
        # returns what its backward reads (the tables, and the search it made)
        saved = rotate(base.view(shape))
        ctx.mark_dirty(base)
        if plan is None:
            _save(ctx, call)
        else:
            ctx.save_for_backward(*saved)
        ctx.shape, ctx.plan = shape, plan
        return base

    @staticmethod
    def backward(ctx, grad):
        g, plan = _ready(grad.reshape(ctx.shape)), ctx.plan
        if plan is None:
            g = _q_gradient(g, _saved(ctx), False)
        elif plan.inplace_backward:  # its recorded backward may rotate in place
            g = _q_gradient(g, _call_of(plan, ctx.saved_tensors, g), False)
        else:
            g = _replayed_gradients(plan, (g,), ctx.saved_tensors)[0]
        return (g.reshape(grad.shape), None, None, None, None)


def _rotate_through_base(q: Tensor, rotate, call, plan) -> Tensor:
    """``q`` rotated in place by ``rotate``, declared on its base (:class:`_ThroughBase`)."""
    _apply_through_base(q._base, q.shape, rotate, call, plan)
    q.grad_fn  # noqa: B018 (rebuilds q's history now: a hook on a stale view crashes torch)
    return q


def _grad_rotatable_in_place(grad: Tensor) -> bool:
    """Whether the backward may rotate ``grad`` in place (given ``inplace_backward``): in eager
    mode (compiled, the custom op would be functionalized into a copy anyway), not a tensor of
    a double-backward graph or of forward AD, not an inference tensor (PyTorch forbids writing
    one outside inference mode), not a batched gradient (no memory: writing it crashed), and
    every element its own memory, dense and non-overlapping (a broadcast gradient, such as
    ``out.sum()``'s, is not). The caller made the last dim contiguous and resolved a lazy
    negation (a new tensor, then)."""
    if compiling() or needs_autograd(grad) or grad.is_inference() or not has_memory(grad):
        return False
    expected = 1
    for size, stride in sorted(zip(grad.shape, grad.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


# ------------------------------------------------------------------- key/value op: F and B
_KV_NO_GRADS = (None,) * _N_KV


def _kv_forward(kv, k_pe, *args):
    call = KVCall(*args)
    k, v = run_kv(kv, k_pe, call)
    return k, (v if call.copy_v else kv[..., call.k_dim :])


def _kv_setup_context(ctx, inputs, output):
    """For ``F`` and ``B`` alike: two activations, then the record."""
    _save(ctx, KVCall(*inputs[2:]))
    if _fwad._current_level >= 0:
        ctx.like = _zeros_spec(*inputs[:2])


def _kv_backward_of_forward(ctx, dk, dv):
    dkv, dk_pe = _apply_kv_backward(_ready(dk), _ready(dv), _saved(ctx))
    return (dkv, dk_pe, *_KV_NO_GRADS)


def _kv_jvp(ctx, t_kv, t_k_pe, *_):
    t_kv, t_k_pe = _tangents((t_kv, t_k_pe), ctx.like)
    return _apply_kv(t_kv, t_k_pe, _saved(ctx))


_KV = _functions(
    "RopeKVFunction",
    """The key/value op ``F``. Inputs: ``kv``, ``k_pe [tokens..., R]``, the :class:`KVCall`
    fields. Its backward ``B`` (``_KV_BACKWARD``) produces ``dkv`` and ``dk_pe`` in one launch.""",
    _kv_forward,
    _kv_setup_context,
    _kv_backward_of_forward,
    _kv_jvp,
)


def _b_forward(dk, dv, *args):
    return run_kv_backward(dk, dv, KVCall(*args))


def _b_backward(ctx, g_dkv, g_dk_pe):
    call = dataclasses.replace(_saved(ctx), copy_v=False)
    g_dk, g_dv = _apply_kv(_ready(g_dkv), _ready(g_dk_pe), call)
    return (g_dk, g_dv, *_KV_NO_GRADS)


def _b_jvp(ctx, t_dk, t_dv, *_):
    t_dk, t_dv = _tangents((t_dk, t_dv), ctx.like)
    return _apply_kv_backward(t_dk, t_dv, _saved(ctx))


_KV_BACKWARD = _functions(
    "RopeKVBackwardFunction",
    """``B: (dk, dv) -> (dkv, dk_pe)``, the key/value op's backward, as a function of its own so
    that it can be differentiated: ``B``'s backward is ``F`` on ``(g_dkv, g_dk_pe)``.""",
    _b_forward,
    _kv_setup_context,
    _b_backward,
    _b_jvp,
)


def _zeros_spec(*tensors: Tensor) -> tuple:
    """What ``_tangents`` needs to stand in a zero tangent for each of ``tensors`` (not the
    tensors themselves, which would be kept alive with the graph)."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def _tangents(tangents: tuple, spec: tuple) -> tuple:
    """The key/value ops' tangents, zeros where an input has none (the other one has)."""
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device) if t is None else _ready(t)
        for t, (shape, dtype, device) in zip(tangents, spec, strict=True)
    )


def _apply_kv(kv: Tensor, k_pe: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    """``F`` on ``(kv, k_pe)``, recorded by autograd when it needs to be (``_apply_q``)."""
    k_dim = call.k_dim
    if needs_autograd(kv, k_pe):
        function = _KV.pick()
        if call.copy_v or _fwad._current_level < 0:
            return function.apply(kv, k_pe, *call_args(call))
        # A view of kv under forward AD: taken here, so that PyTorch derives its tangent from
        # kv's. Returned by the function, its tangent would be set on kv itself (a zero one
        # where kv had none), and torch.func would not see kv's at all. Costs a copy of v.
        k, _ = function.apply(kv, k_pe, *call_args(dataclasses.replace(call, copy_v=True)))
        return k, kv[..., k_dim:]
    k, v = run_kv(kv, k_pe, call)
    return k, (v if call.copy_v else kv[..., k_dim:])


def _apply_kv_backward(dk: Tensor, dv: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    """``B`` on ``(dk, dv)``, recorded by autograd when it needs to be (``_apply_q``)."""
    if needs_autograd(dk, dv):
        return _KV_BACKWARD.pick().apply(dk, dv, *call_args(call))
    return run_kv_backward(dk, dv, call)


def rope_kv_differentiable(kv: Tensor, k_pe: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    """The key/value op on checked arguments (``k_pe: [tokens..., R]``) where autograd, forward
    AD or ``torch.compile`` is involved; compiled without a gradient, the custom op itself."""
    if compiling():
        if not (torch.is_grad_enabled() and (kv.requires_grad or k_pe.requires_grad)):
            k, v = rope_kv_op(kv, k_pe, *call_args(call))
            return k, (v if call.copy_v else kv[..., call.k_dim :])
        return _KV.compiled.apply(kv, k_pe, *call_args(call))
    if call.cu_seqlens is not None:  # the search the backward reuses (nothing to search else)
        call = search_for_backward(kv, call)
    return _apply_kv(kv, k_pe, call)


# ----------------------------------------------------- replayed calls (_launch_plans.GradPlan)
class _Replayed(torch.autograd.Function):
    """A recorded eager call that needs autograd (:class:`_launch_plans.GradPlan`), replayed in one
    node: the forward makes the recorded launches on the new tensors; the backward makes the
    launches its first backward with the same gradient metadata made, or runs the op's own
    backward (recording it) where there are none. Inputs: the plan, the activations, then the
    tensors the record reads (``cos, sin[, position_ids or cu_seqlens]``, as the caller passed
    them).

    It saves exactly what the pipeline's nodes save (``_records.call_tensors`` of the record: the
    tables as ``[P, R]``, the positions broadcast to the token dims; twice for ``"qk"``, whose
    pipeline is two nodes), so activation checkpointing, which compares what a recomputation
    saves with what the forward saved, sees the same tensors whichever path each one took."""

    @staticmethod
    def forward(ctx, plan, *inputs):
        outs, scratch = plan.forward.run_keeping_scratch(inputs)
        n = plan.n_activations
        ctx.plan = plan
        ctx.n_tables = len(inputs) - n
        record = _record_tensors(inputs[0], inputs[n:], plan.searched, scratch)
        ctx.save_for_backward(*(record * 2 if plan.op == "qk" else record))
        op = plan.op
        if op == "q":
            if plan.inplace:
                x = inputs[0]
                torch.autograd.graph.increment_version(x)  # the kernel wrote through a pointer
                ctx.mark_dirty(x)
                return x
            return outs[0]
        if op == "kv":
            ctx.k_pe_shape = inputs[1].shape
            if plan.call.copy_v:
                return outs[0], outs[1]
            return outs[0], inputs[0][..., plan.call.k_dim :]
        # "qk": a gradient for an unused output stays None (two nodes would not see one)
        ctx.set_materialize_grads(False)
        return outs[0], outs[1]

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        saved = _saved_tables(ctx.saved_tensors[:5])
        if any(g is None for g in grads):  # "qk" only: one output unused
            results = tuple(
                None if g is None else _q_gradient(_ready(g), _call_of(plan, saved, g), False)
                for g in grads
            )
            return (None, *results, *(None,) * ctx.n_tables)
        results = _replayed_gradients(plan, tuple(_ready(g) for g in grads), saved)
        if plan.op == "kv":
            results = (results[0], results[1].view(ctx.k_pe_shape))
        return (None, *results, *(None,) * ctx.n_tables)


def _replayed_gradients(plan, grads: tuple, saved: tuple) -> tuple:
    """The gradients of a replayed call (``grads`` ready for the kernels, ``saved`` the record's
    ``cos, sin[, ids]``): the launches its first backward with the same gradient metadata
    made, or the op's own backward, recorded for the next time."""
    inputs = (*grads, *saved)
    # A double backward (gradients that require grad) and compiled autograd (traced tensors)
    # run the op's own backward: autograd records it, or the compiler traces it.
    plain = not needs_autograd(*grads) and not _in_compiled_autograd()
    if plain:
        replayed = plan.replay_backward(inputs)
        if replayed is None:  # recorded already, without a plan these gradients can take
            return _replayed_backward(plan, grads, saved)
        if replayed is not _launch_plans.MISSING:
            return replayed
        with recording() as launches:
            results = _replayed_backward(plan, grads, saved)
        plan.record_backward(inputs, results, launches)
        return results
    return _replayed_backward(plan, grads, saved)


def _record_tensors(x: Tensor, tables: tuple, searched: bool = False, scratch=()) -> tuple:
    """``_records.call_tensors`` of the pipeline's record for a replayed call on ``x`` with the
    caller's ``(cos, sin[, position_ids or cu_seqlens])``: ``(cos [P, R], sin [P, R],
    cu_seqlens or None, position_ids broadcast to x's token dims or None, the forward's search
    or None)``, as ``_checks`` and ``ops.search_for_backward`` make them (``searched``: the
    third table is ``cu_seqlens``, and ``scratch`` holds the replayed search's output)."""
    cos, sin = tables[0], tables[1]
    if cos.dim() != 2:
        rows, rope_dim = cos.shape[0], cos.shape[-1]
        cos, sin = cos.reshape(rows, rope_dim), sin.reshape(rows, rope_dim)
    if searched:
        return (cos, sin, tables[2], None, scratch[0])
    position_ids = tables[2] if len(tables) > 2 else None
    if position_ids is not None:
        tokens = x.shape[: x.dim() - 2]
        if position_ids.shape != tokens:
            position_ids = position_ids.expand(tokens)
    return (cos, sin, None, position_ids, None)


def _saved_tables(record: tuple) -> tuple:
    """What a replayed call's backward reads of its saved record (:func:`_record_tensors`):
    ``cos, sin``, then ``position_ids`` or ``cu_seqlens, searched`` where it has them."""
    cos, sin, cu_seqlens, position_ids, searched = record
    if cu_seqlens is not None:
        return (cos, sin, cu_seqlens, searched)
    return (cos, sin) if position_ids is None else (cos, sin, position_ids)


def _call_of(plan, saved: tuple, x: Tensor):
    """The record of a replayed call, its tensors the saved ones (:func:`_saved_tables`:
    already the pipeline's ``[P, R]`` tables, broadcast positions and search)."""
    if plan.searched:
        return with_tensors(plan.call, (saved[0], saved[1], saved[2], None, saved[3]))
    position_ids = saved[2] if len(saved) > 2 else None
    return with_tensors(plan.call, (saved[0], saved[1], None, position_ids, None))


def _replayed_backward(plan, grads: tuple, saved: tuple) -> tuple:
    """The op's own backward for a replayed call (its record with the saved tensors)."""
    call = _call_of(plan, saved, grads[0])
    if plan.op == "kv":
        return _apply_kv_backward(grads[0], grads[1], call)
    return tuple(_q_gradient(g, call, plan.inplace_backward) for g in grads)


def _in_compiled_autograd() -> bool:
    """Inside torch's compiled autograd (its backward is traced, not run)."""
    compiled = getattr(getattr(torch, "_dynamo", None), "compiled_autograd", None)
    return compiling() or bool(getattr(compiled, "in_compiled_autograd_region", False))


_apply_replayed = _Replayed.apply
_function_base_apply = vars(torch._C._FunctionBase).get("apply")
if _function_base_apply is not None and hasattr(_function_base_apply, "__get__"):
    # torch.autograd.Function.apply without its Python prologue: it checks for torch.func
    # transforms and unwraps their dead wrappers, neither of which a replayed call can meet
    # (the signature refuses an active transform and any tensor that is not plain).
    _apply_replayed = _function_base_apply.__get__(None, _Replayed)
_apply_through_base = _ThroughBase.apply
if _function_base_apply is not None and hasattr(_function_base_apply, "__get__"):
    # The same for calls through a base: rotates_whole_base refuses torch.func transforms.
    _apply_through_base = _function_base_apply.__get__(None, _ThroughBase)


def replay(plan: _launch_plans.GradPlan, inputs: tuple):
    """The result of a replayed call: what the pipeline's call returned (``q``'s rotation, or
    ``q`` itself in place; ``(k, v)``; ``(q', k')``), through one autograd node (an in-place
    ``q`` that reshapes its whole base: :func:`rotates_whole_base`)."""
    q = inputs[0]
    if plan.op == "q" and plan.inplace and rotates_whole_base(q):
        tables = inputs[1:]

        def rotate(x: Tensor) -> tuple:
            _, scratch = plan.forward.run_keeping_scratch((x, *tables))
            torch.autograd.graph.increment_version(x)  # the kernel wrote through a pointer
            return _saved_tables(_record_tensors(x, tables, plan.searched, scratch))

        return _rotate_through_base(q, rotate, None, plan)
    return _apply_replayed(plan, *inputs)
