"""Custom ops, autograd and backend dispatch for both ops.

Data flow: public API (``__init__``) -> ``_checks`` -> here -> ``kernels`` (Triton) or
``reference`` (PyTorch). The backend follows the tensor: CUDA tensors run the Triton kernels;
CPU tensors run the reference, or the same Triton kernels under Triton's interpreter when
``TRITON_INTERPRET=1``; float64 always runs the reference.

Each op is a ``torch.library.custom_op`` with a fake implementation, so
``torch.compile(fullgraph=True)`` traces through it. In eager mode the autograd functions call
the implementations directly, skipping the dispatcher's per-call overhead. No op syncs with
the device, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwad

from . import reference
from .positions import Positions


def use_triton(t: Tensor) -> bool:
    """Triton kernels for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1``."""
    if t.dtype == torch.float64:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _same_table_strides(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels index both tables with one row stride."""
    if cos.stride() != sin.stride():
        return cos.contiguous(), sin.contiguous()
    return cos, sin


def _check_not_batched(*tensors: Tensor) -> None:
    """The kernels read memory; ``torch.func.vmap``'s batched tensors have none (the reference
    backend runs them as PyTorch ops do)."""
    if any(_functorch.is_batchedtensor(t) for t in tensors):
        raise NotImplementedError(
            "mlarope's Triton kernels cannot run under torch.func.vmap (nor jacrev, jacfwd or "
            "hessian, which vmap): call the op once per sample, or use the PyTorch reference "
            "backend (mlarope.reference)"
        )


# ----------------------------------------------------------------------------- query op impl
def rope_q_impl(
    q: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int,
    interleaved_in: bool, interleaved_out: bool, inverse: bool, transpose: bool,
    searched: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Out of place: ``q: [tokens..., H, N + R]`` -> a new contiguous tensor of the same shape.
    ``searched``: the ``[T]`` positions of an earlier search in these ``cu_seqlens``, or None."""
    positions = Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size, searched)
    if not use_triton(q):
        return reference.rope_q(
            q, cos, sin, positions, interleaved_in=interleaved_in,
            interleaved_out=interleaved_out, inverse=inverse, transpose=transpose,
        )  # fmt: skip
    _check_not_batched(q)
    from .kernels.q import rope_q_launch

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos, sin = _same_table_strides(cos, sin)
    rope_q_launch(
        q, out, cos, sin, positions, interleaved_in=interleaved_in,
        interleaved_out=interleaved_out, inverse=inverse, transpose=transpose,
    )  # fmt: skip
    return out


def rope_q_inplace_impl(
    q: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int,
    interleaved_in: bool, interleaved_out: bool, inverse: bool, transpose: bool,
    searched: Tensor | None = None,
) -> None:  # fmt: skip
    """In place: rotates the rope channels of ``q: [tokens..., H, N + R]``; nope untouched."""
    positions = Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size, searched)
    if not use_triton(q):
        rope_dim = cos.shape[-1]
        rotated = reference.rope_q(
            q, cos, sin, positions, interleaved_in=interleaved_in,
            interleaved_out=interleaved_out, inverse=inverse, transpose=transpose,
        )  # fmt: skip
        with torch.no_grad():
            q[..., q.shape[-1] - rope_dim :].copy_(rotated[..., q.shape[-1] - rope_dim :])
        return
    _check_not_batched(q)
    from .kernels.q import rope_q_launch

    cos, sin = _same_table_strides(cos, sin)
    rope_q_launch(
        q, q, cos, sin, positions, interleaved_in=interleaved_in,
        interleaved_out=interleaved_out, inverse=inverse, transpose=transpose,
    )  # fmt: skip


# -------------------------------------------------------------------------- key/value op impl
def rope_kv_impl(
    kv: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int, k_dim: int,
    interleaved_in: bool, interleaved_out: bool, copy_v: bool, searched: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``kv: [tokens..., H, K + V]``, ``k_pe: [tokens..., R]`` -> ``k: [tokens..., H, K + R]`` and
    ``v: [tokens..., H, V]`` (``copy_v``) or an empty placeholder (the caller takes a view)."""
    positions = Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size, searched)
    if not use_triton(kv):
        k, v = reference.rope_kv(
            kv, k_pe, cos, sin, positions, k_dim=k_dim, interleaved_in=interleaved_in,
            interleaved_out=interleaved_out,
        )  # fmt: skip
        return k, (v.clone(memory_format=torch.contiguous_format) if copy_v else kv.new_empty(0))
    _check_not_batched(kv, k_pe)
    from .kernels.kv import rope_kv_launch

    rope_dim = cos.shape[-1]
    k = torch.empty((*kv.shape[:-1], k_dim + rope_dim), dtype=kv.dtype, device=kv.device)
    v = (
        torch.empty((*kv.shape[:-1], kv.shape[-1] - k_dim), dtype=kv.dtype, device=kv.device)
        if copy_v
        else None
    )
    cos, sin = _same_table_strides(cos, sin)
    rope_kv_launch(
        kv, k_pe, k, v, cos, sin, positions, k_dim=k_dim, interleaved_in=interleaved_in,
        interleaved_out=interleaved_out,
    )  # fmt: skip
    return k, (v if v is not None else kv.new_empty(0))


def rope_kv_backward_impl(
    dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int, k_dim: int,
    interleaved_in: bool, interleaved_out: bool, searched: Tensor | None = None,
    megatron_rounding: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]`` -> ``dkv: [tokens..., H, K + V]``,
    ``dk_pe: [tokens..., R]`` (one launch on the Triton backend, given ``searched``).
    ``megatron_rounding``: ``dk_pe`` rounded as Megatron-Core rounds it (compat only;
    ``reference.rope_kv_backward``)."""
    positions = Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size, searched)
    if not use_triton(dk):
        return reference.rope_kv_backward(
            dk, dv, cos, sin, positions, k_dim=k_dim, interleaved_in=interleaved_in,
            interleaved_out=interleaved_out, megatron_rounding=megatron_rounding,
        )  # fmt: skip
    _check_not_batched(dk, dv)
    from .kernels.kv import rope_kv_backward_launch

    rope_dim = cos.shape[-1]
    dkv = torch.empty((*dk.shape[:-1], k_dim + dv.shape[-1]), dtype=dk.dtype, device=dk.device)
    dk_pe = torch.empty((*dk.shape[:-2], rope_dim), dtype=dk.dtype, device=dk.device)
    cos, sin = _same_table_strides(cos, sin)
    rope_kv_backward_launch(
        dk, dv, dkv, dk_pe, cos, sin, positions, k_dim=k_dim, interleaved_in=interleaved_in,
        interleaved_out=interleaved_out, megatron_rounding=megatron_rounding,
    )  # fmt: skip
    return dkv, dk_pe


# ------------------------------------------------------------------------------- custom ops
rope_q_op = torch.library.custom_op("mlarope::rope_q", rope_q_impl, mutates_args=())
rope_q_inplace_op = torch.library.custom_op(
    "mlarope::rope_q_", rope_q_inplace_impl, mutates_args=("q",)
)
rope_kv_op = torch.library.custom_op("mlarope::rope_kv", rope_kv_impl, mutates_args=())
rope_kv_backward_op = torch.library.custom_op(
    "mlarope::rope_kv_backward", rope_kv_backward_impl, mutates_args=()
)


@rope_q_op.register_fake
def _rope_q_fake(q, *args):
    return q.new_empty(q.shape)


@rope_q_inplace_op.register_fake
def _rope_q_inplace_fake(q, *args):
    return None


@rope_kv_op.register_fake
def _rope_kv_fake(kv, k_pe, cos, sin, cu, ids, layout, cp_rank, cp_size, k_dim, interleaved_in,
                  interleaved_out, copy_v, searched=None):  # fmt: skip
    k = kv.new_empty((*kv.shape[:-1], k_dim + cos.shape[-1]))
    v = kv.new_empty((*kv.shape[:-1], kv.shape[-1] - k_dim)) if copy_v else kv.new_empty(0)
    return k, v


@rope_kv_backward_op.register_fake
def _rope_kv_backward_fake(dk, dv, cos, sin, cu, ids, layout, cp_rank, cp_size, k_dim, *flags):
    dkv = dk.new_empty((*dk.shape[:-1], k_dim + dv.shape[-1]))
    return dkv, dk.new_empty((*dk.shape[:-2], cos.shape[-1]))


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _q(*args) -> Tensor:
    return rope_q_op(*args) if _compiling() else rope_q_impl(*args)


def _q_inplace(q: Tensor, *args) -> None:
    if _compiling():
        rope_q_inplace_op(q, *args)
    else:
        rope_q_inplace_impl(q, *args)
        # The kernel wrote through a raw pointer; tell autograd's version counter, so a tensor
        # saved by another op for its backward raises instead of being silently wrong.
        torch.autograd.graph.increment_version(q)


def _kv(*args) -> tuple[Tensor, Tensor]:
    return rope_kv_op(*args) if _compiling() else rope_kv_impl(*args)


def _kv_backward(*args) -> tuple[Tensor, Tensor]:
    return rope_kv_backward_op(*args) if _compiling() else rope_kv_backward_impl(*args)


def search_for_backward(
    x: Tensor, cu_seqlens: Tensor | None, cp_rank: int, cp_size: int
) -> Tensor | None:
    """An eager forward's ``cu_seqlens`` search, run once so that its backward reuses it:
    ``[T]`` int64 positions of the thd input ``x: [T, H, D]``, or None where the kernels look
    positions up without a search (no ``cu_seqlens``, no tokens), where they do not run (the
    PyTorch backend), when compiling (Inductor's graph calls the custom ops, which search) and
    inside ``torch.func`` transforms (each direction then searches for itself).
    Saves one launch per backward (5-9 µs on the H200 at 16,384 tokens) for 8 bytes a token
    kept until the backward."""
    if cu_seqlens is None or x.shape[0] == 0 or _compiling() or not use_triton(x):
        return None
    if _functorch.maybe_current_level() is not None:
        return None  # inside a torch.func transform a new tensor is a wrapper: unreadable
    from .kernels.lookup import search_cu_seqlens

    return search_cu_seqlens(cu_seqlens, x.shape[0], cp_rank, cp_size)


# ------------------------------------------------------------------------------- autograd
# Both ops are linear in their activations (the tables are constants), so every derivative is
# again one of the ops:
#
# - query op ``R``: its backward is ``R^T``, the same op with ``transpose`` flipped and the
#   input and output layouts swapped, and the backward of ``R^T`` is ``R`` again; its tangent
#   (forward-mode AD) is ``R`` applied to the tangent;
# - key/value op ``F: (kv, k_pe) -> (k, v)``: its backward is ``B: (dk, dv) -> (dkv, dk_pe)``,
#   and the backward of ``B`` is ``F`` applied to ``(g_dkv, g_dk_pe)``; tangents go through ``F``
#   and ``B`` themselves.
#
# A backward or tangent that itself needs differentiating (``create_graph=True``, forward AD,
# torch.func) therefore calls the op through its autograd function (``_apply_q``,
# ``_apply_kv``, ``_apply_kv_backward``), which records it again, to any order. Otherwise it
# calls the implementation directly, as before: no autograd overhead on a plain backward.
#
# Each op has three autograd functions with the same forward, backward and jvp
# (``_Functions``): eager (``forward(ctx, ...)``), for torch.func transforms (which need the
# ``setup_context`` form; PyTorch binds every call of that form to its signature with
# ``inspect``, tens of microseconds, so eager calls do not use it), and compiled (no ``jvp``,
# which Dynamo cannot trace). While compiling, calls that need no gradient go to the custom ops
# directly: Dynamo cannot trace ``mark_dirty`` either.


def needs_autograd(*tensors: Tensor) -> bool:
    """Whether an application to ``tensors`` must go through the autograd functions: grad mode
    is on and one of them requires grad, forward-mode AD is on, or one of them is a
    ``torch.func`` gradient wrapper (which only the autograd functions unwrap for the kernels).
    """
    if _fwad._current_level >= 0:
        return True
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return _functorch.maybe_current_level() is not None and any(
        _functorch.is_gradtrackingtensor(t) for t in tensors
    )


def _ready(t: Tensor) -> Tensor:
    """A gradient or tangent as the kernels read it: no lazy negation (neg bit), a contiguous
    last dim, and not the wrapper of a ``torch.func`` transform that has returned (a backward
    run after ``torch.func.vjp`` returned gets those)."""
    if not _compiling() and _functorch.is_functorch_wrapped_tensor(t):  # Dynamo skips these
        t = _functorch.unwrap_if_dead(t)
    t = t.resolve_neg()
    return t if t.stride(-1) == 1 else t.contiguous()


def _constants(tensors) -> tuple:
    """The tables and positions (never differentiated: ``_checks.check_tables_constant``) as
    plain tensors, to be saved for the backward or ``jvp``. Inside a ``torch.func`` transform
    they may be its wrappers, which outlive the transform (a backward run after
    ``torch.func.vjp`` returned) and which the kernels cannot read."""
    if _compiling() or _functorch.maybe_current_level() is None:
        return tuple(tensors)
    plain = []
    for t in tensors:
        while t is not None and _functorch.is_functorch_wrapped_tensor(t):
            t = _functorch.get_unwrapped(t)
        plain.append(t)
    return tuple(plain)


@dataclass(frozen=True)
class _Functions:
    """One op's autograd functions: the same forward, backward and jvp in three forms."""

    eager: type[torch.autograd.Function]
    func: type[torch.autograd.Function]  # setup_context form, for torch.func transforms
    compiled: type[torch.autograd.Function]  # no jvp, for Dynamo

    def pick(self) -> type[torch.autograd.Function]:
        if _compiling():
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
def _q_forward(q, cos, sin, cu_seqlens, position_ids, searched, layout, cp_rank, cp_size,
               interleaved, interleaved_out, inverse, transpose, inplace,
               inplace_backward):  # fmt: skip
    args = (
        cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, transpose, searched,
    )  # fmt: skip
    if inplace:
        _q_inplace(q, *args)
        return q
    return _q(q, *args)


def _q_setup_context(ctx, inputs, output):
    q, *constants = inputs[:6]
    if inputs[-2]:  # inplace
        ctx.mark_dirty(q)
    constants = _constants(constants)
    ctx.save_for_backward(*constants)
    if _fwad._current_level >= 0:
        ctx.save_for_forward(*constants)
    ctx.flags = tuple(inputs[6:])


def _q_backward(ctx, grad):
    tensors = ctx.saved_tensors
    layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, transpose = ctx.flags[:7]
    grad = _ready(grad)
    # The transpose: read in the output layout, write in the input layout.
    flags = (layout, cp_rank, cp_size, interleaved_out, interleaved, inverse, not transpose)
    if ctx.flags[8] and _grad_rotatable_in_place(grad):  # inplace_backward
        _q_inplace(grad, *_q_args(tensors, flags))
        return (grad,) + (None,) * 14
    return (_apply_q(grad, tensors, flags, False),) + (None,) * 14


def _q_jvp(ctx, tangent, *_):
    if tangent is None:  # only the tables could carry one, and the API rejects that
        return None
    flags = ctx.flags[:7]
    if ctx.flags[7]:  # in place: the tangent is rotated in place, as PyTorch requires
        return _apply_q(tangent, ctx.saved_tensors, flags, True)
    return _apply_q(_ready(tangent), ctx.saved_tensors, flags, False)


_Q = _functions(
    "RopeQFunction",
    """The query op ``R`` (``transpose=False``) or its transpose ``R^T`` (``transpose=True``,
    read in ``interleaved_out`` and written in ``interleaved``, as the backward calls it).
    Inputs: ``q, cos, sin, cu_seqlens, position_ids, searched, layout, cp_rank, cp_size,
    interleaved, interleaved_out, inverse, transpose, inplace, inplace_backward``, where
    ``searched`` is ``search_for_backward``'s result (or None).

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
RopeQFunction = _Q.eager


def _q_args(tensors: tuple, flags: tuple) -> tuple:
    """``(cos, sin, cu_seqlens, position_ids, searched)`` and ``(layout, cp_rank, cp_size,
    interleaved_in, interleaved_out, inverse, transpose)`` -> the implementations' arguments
    after the input."""
    cos, sin, cu_seqlens, position_ids, searched = tensors
    return (cos, sin, cu_seqlens, position_ids, *flags, searched)


def _apply_q(x: Tensor, tensors: tuple, flags: tuple, inplace: bool) -> Tensor:
    """The query op on ``x`` (a gradient or a tangent), recorded by autograd when it needs to
    be (double backward, forward AD, torch.func), else the implementation itself."""
    if needs_autograd(x):
        return _Q.pick().apply(x, *tensors, *flags, inplace, False)
    if inplace:
        _q_inplace(x, *_q_args(tensors, flags))
        return x
    return _q(x, *_q_args(tensors, flags))


def rope_q_differentiable(
    q: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int, interleaved: bool,
    interleaved_out: bool, inverse: bool, inplace: bool, inplace_backward: bool,
) -> Tensor:  # fmt: skip
    """The query op on checked arguments where autograd, forward AD or ``torch.compile`` is
    involved (``needs_autograd(q)`` or compiling); the public API runs everything else itself.

    Compiled, a call that needs no gradient is the custom op itself (Dynamo cannot trace the
    autograd function's ``mark_dirty``), and an in-place call that needs one is the out-of-place
    op copied back into ``q``: torch 2.11's compiled backward of an autograd function that marks
    its in-place custom op's input dirty passed the gradient through unrotated
    (docs/semantics.md). The same values and gradients, bit for bit; it moves whole rows twice
    (about ``4 (N + R)`` elements per row instead of ``2 R``) unless Inductor fuses the copy."""
    tensors = (cos, sin, cu_seqlens, position_ids)
    flags = (layout, cp_rank, cp_size, interleaved, interleaved_out, inverse, False)
    if _compiling():
        if not (torch.is_grad_enabled() and q.requires_grad):
            if inplace:
                rope_q_inplace_op(q, *tensors, *flags, None)
                return q
            return rope_q_op(q, *tensors, *flags, None)
        if inplace:
            return q.copy_(_Q.compiled.apply(q, *tensors, None, *flags, False, False))
        return _Q.compiled.apply(q, *tensors, None, *flags, False, inplace_backward)
    searched = search_for_backward(q, cu_seqlens, cp_rank, cp_size)
    return _Q.pick().apply(q, *tensors, searched, *flags, inplace, inplace_backward)


def _grad_rotatable_in_place(grad: Tensor) -> bool:
    """Whether the backward may rotate ``grad`` in place (given ``inplace_backward``): in eager
    mode (compiled, the custom op would be functionalized into a copy anyway), not a tensor of
    a double-backward graph or of forward AD, not an inference tensor (PyTorch forbids writing
    one outside inference mode), and every element its own memory, dense and non-overlapping (a
    broadcast gradient, such as ``out.sum()``'s, is not). The caller made the last dim
    contiguous and resolved a lazy negation (a new tensor, then)."""
    if _compiling() or needs_autograd(grad) or grad.is_inference():
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
def _kv_forward(kv, k_pe, cos, sin, cu_seqlens, position_ids, searched, layout, cp_rank,
                cp_size, k_dim, interleaved, interleaved_out, copy_v,
                megatron_rounding):  # fmt: skip
    k, v = _kv(
        kv, k_pe, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size, k_dim,
        interleaved, interleaved_out, copy_v, searched,
    )  # fmt: skip
    return k, (v if copy_v else kv[..., k_dim:])


def _kv_setup_context(ctx, inputs, output):
    """For ``F`` and ``B`` alike: two activations, five constants, then the flags."""
    constants = _constants(inputs[2:7])
    ctx.save_for_backward(*constants)
    if _fwad._current_level >= 0:
        ctx.save_for_forward(*constants)
        ctx.like = _zeros_spec(*inputs[:2])
    # F: layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out, copy_v,
    # megatron_rounding; B: the same without copy_v
    ctx.flags = tuple(inputs[7:])


def _kv_backward_of_forward(ctx, dk, dv):
    flags = (*ctx.flags[:6], ctx.flags[7])  # B's: without copy_v
    dkv, dk_pe = _apply_kv_backward(_ready(dk), _ready(dv), ctx.saved_tensors, flags)
    return (dkv, dk_pe) + (None,) * 13


def _kv_jvp(ctx, t_kv, t_k_pe, *_):
    t_kv, t_k_pe = _tangents((t_kv, t_k_pe), ctx.like)
    return _apply_kv(t_kv, t_k_pe, ctx.saved_tensors, ctx.flags)


_KV = _functions(
    "RopeKVFunction",
    """The key/value op ``F``. Inputs: ``kv, k_pe [tokens..., R], cos, sin, cu_seqlens,
    position_ids, searched, layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out,
    copy_v, megatron_rounding``. Its backward ``B`` (``_KV_BACKWARD``) produces ``dkv`` and
    ``dk_pe`` in one launch; ``megatron_rounding`` (``mlarope.compat.megatron`` only; the public
    API is always exact) rounds ``dk_pe`` where Megatron-Core does.""",
    _kv_forward,
    _kv_setup_context,
    _kv_backward_of_forward,
    _kv_jvp,
)
RopeKVFunction = _KV.eager


def _b_forward(dk, dv, cos, sin, cu_seqlens, position_ids, searched, layout, cp_rank, cp_size,
               k_dim, interleaved, interleaved_out, megatron_rounding):  # fmt: skip
    return _kv_backward(
        dk, dv, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size, k_dim,
        interleaved, interleaved_out, searched, megatron_rounding,
    )  # fmt: skip


def _b_backward(ctx, g_dkv, g_dk_pe):
    flags = (*ctx.flags[:6], False, ctx.flags[6])  # F's: copy_v False
    g_dk, g_dv = _apply_kv(_ready(g_dkv), _ready(g_dk_pe), ctx.saved_tensors, flags)
    return (g_dk, g_dv) + (None,) * 12


def _b_jvp(ctx, t_dk, t_dv, *_):
    t_dk, t_dv = _tangents((t_dk, t_dv), ctx.like)
    return _apply_kv_backward(t_dk, t_dv, ctx.saved_tensors, ctx.flags)


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


def _kv_args(tensors: tuple, flags: tuple) -> tuple:
    """``B``'s implementation's arguments after the two activations (``flags``: B's, that is
    layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out, megatron_rounding)."""
    cos, sin, cu_seqlens, position_ids, searched = tensors
    return (cos, sin, cu_seqlens, position_ids, *flags[:6], searched, flags[6])


def _apply_kv(kv: Tensor, k_pe: Tensor, tensors: tuple, flags: tuple) -> tuple[Tensor, Tensor]:
    """``F`` on ``(kv, k_pe)``, recorded by autograd when it needs to be (``_apply_q``).
    ``flags``: layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out, copy_v,
    megatron_rounding (which only its backward reads)."""
    copy_v = flags[6]
    if needs_autograd(kv, k_pe):
        function = _KV.pick()
        if copy_v or _fwad._current_level < 0:
            return function.apply(kv, k_pe, *tensors, *flags)
        # A view of kv under forward AD: taken here, so that PyTorch derives its tangent from
        # kv's. Returned by the function, its tangent would be set on kv itself (a zero one
        # where kv had none), and torch.func would not see kv's at all. Costs a copy of v.
        k, _ = function.apply(kv, k_pe, *tensors, *flags[:6], True, flags[7])
        return k, kv[..., flags[3] :]
    cos, sin, cu_seqlens, position_ids, searched = tensors
    k, v = _kv(kv, k_pe, cos, sin, cu_seqlens, position_ids, *flags[:7], searched)
    return k, (v if copy_v else kv[..., flags[3] :])


def _apply_kv_backward(
    dk: Tensor, dv: Tensor, tensors: tuple, flags: tuple
) -> tuple[Tensor, Tensor]:
    """``B`` on ``(dk, dv)``, recorded by autograd when it needs to be (``_apply_q``).
    ``flags``: layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out,
    megatron_rounding."""
    if needs_autograd(dk, dv):
        return _KV_BACKWARD.pick().apply(dk, dv, *tensors, *flags)
    return _kv_backward(dk, dv, *_kv_args(tensors, flags))


def rope_kv_differentiable(
    kv: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor | None,
    position_ids: Tensor | None, layout: str, cp_rank: int, cp_size: int, k_dim: int,
    interleaved: bool, interleaved_out: bool, copy_v: bool, megatron_rounding: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The key/value op on checked arguments (``k_pe: [tokens..., R]``) where autograd, forward
    AD or ``torch.compile`` is involved; compiled without a gradient, the custom op itself.
    ``megatron_rounding``: the backward rounds ``dk_pe`` as Megatron-Core does
    (``mlarope.compat.megatron`` only)."""
    flags = (layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out, copy_v)
    if _compiling():
        if not (torch.is_grad_enabled() and (kv.requires_grad or k_pe.requires_grad)):
            k, v = rope_kv_op(kv, k_pe, cos, sin, cu_seqlens, position_ids, *flags, None)
            return k, (v if copy_v else kv[..., k_dim:])
        return _KV.compiled.apply(
            kv, k_pe, cos, sin, cu_seqlens, position_ids, None, *flags, megatron_rounding
        )
    searched = search_for_backward(kv, cu_seqlens, cp_rank, cp_size)
    tensors = (cos, sin, cu_seqlens, position_ids, searched)
    return _apply_kv(kv, k_pe, tensors, (*flags, megatron_rounding))
