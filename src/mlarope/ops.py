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

import torch
from torch import Tensor

from . import reference
from ._checks import Positions


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
    PyTorch backend) and when compiling (Inductor's graph calls the custom ops, which search).
    Saves one launch per backward (5-9 µs on the H200 at 16,384 tokens) for 8 bytes a token
    kept until the backward."""
    if cu_seqlens is None or x.shape[0] == 0 or _compiling() or not use_triton(x):
        return None
    from .kernels._lookup import searched_positions

    return searched_positions(cu_seqlens, x.shape[0], cp_rank, cp_size)


# ------------------------------------------------------------------------------- autograd
class RopeQFunction(torch.autograd.Function):
    """Query op with autograd. The backward is the same kernel with ``transpose=True`` and the
    input and output layouts swapped. By default it is out of place, for the in-place op too:
    the incoming gradient may be shared (``a + b`` hands one tensor to both branches;
    ``z.backward(g)`` hands the caller's ``g``), so rotating it in place, as Megatron-Core does,
    can corrupt another branch's gradient. That costs the nope channels' bytes.

    With ``inplace_backward`` the caller vouches that nothing else holds the gradient (``q``
    feeds one attention kernel), and an eager backward rotates the gradient's rope channels in
    place and returns it: ``2 R`` instead of ``2 (N + R)`` elements a row. It falls back to out
    of place where that is not possible (``_grad_rotatable_in_place``) and when compiling.
    See docs/semantics.md."""

    @staticmethod
    def forward(ctx, q, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size,
                interleaved, interleaved_out, inverse, inplace, inplace_backward):  # fmt: skip
        args = (cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size)
        searched = search_for_backward(q, cu_seqlens, cp_rank, cp_size)
        if inplace:
            _q_inplace(q, *args, interleaved, interleaved_out, inverse, False, searched)
            ctx.mark_dirty(q)
            out = q
        else:
            out = _q(q, *args, interleaved, interleaved_out, inverse, False, searched)
        ctx.save_for_backward(cos, sin, cu_seqlens, position_ids, searched)
        ctx.flags = (layout, cp_rank, cp_size, interleaved, interleaved_out, inverse)
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cu_seqlens, position_ids, searched = ctx.saved_tensors
        layout, cp_rank, cp_size, interleaved, interleaved_out, inverse = ctx.flags
        args = (cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size)
        # The kernels read memory: a contiguous last dim, and no lazy negation (neg bit).
        grad = grad.resolve_neg()
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        if ctx.inplace_backward and _grad_rotatable_in_place(grad):
            _q_inplace(grad, *args, interleaved_out, interleaved, inverse, True, searched)
            return (grad,) + (None,) * 12
        dq = _q(grad, *args, interleaved_out, interleaved, inverse, True, searched)
        return (dq,) + (None,) * 12


def _grad_rotatable_in_place(grad: Tensor) -> bool:
    """Whether the backward may rotate ``grad`` in place (given ``inplace_backward``): in eager
    mode (compiled, the custom op would be functionalized into a copy anyway), not a tensor of
    a double-backward graph, not an inference tensor (PyTorch forbids writing one outside
    inference mode), and every element its own memory, dense and non-overlapping (a broadcast
    gradient, such as ``out.sum()``'s, is not). The caller made the last dim
    contiguous and resolved a lazy negation (a new tensor, then)."""
    if _compiling() or grad.requires_grad or grad.is_inference():
        return False
    expected = 1
    for size, stride in sorted(zip(grad.shape, grad.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class RopeKVFunction(torch.autograd.Function):
    """Key/value op with autograd; the backward produces ``dkv`` and ``dk_pe`` in one launch.
    The trailing ``megatron_rounding`` (``mlarope.compat.megatron`` only; the public API is
    always exact) rounds ``dk_pe`` where Megatron-Core does."""

    @staticmethod
    def forward(ctx, kv, k_pe, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size,
                k_dim, interleaved, interleaved_out, copy_v, megatron_rounding=False):  # fmt: skip
        searched = search_for_backward(kv, cu_seqlens, cp_rank, cp_size)
        k, v = _kv(
            kv, k_pe, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size, k_dim,
            interleaved, interleaved_out, copy_v, searched,
        )  # fmt: skip
        if not copy_v:
            v = kv[..., k_dim:]
        ctx.save_for_backward(cos, sin, cu_seqlens, position_ids, searched)
        ctx.flags = (layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out)
        ctx.k_pe_shape = k_pe.shape
        ctx.megatron_rounding = megatron_rounding
        return k, v

    @staticmethod
    def backward(ctx, dk, dv):
        cos, sin, cu_seqlens, position_ids, searched = ctx.saved_tensors
        layout, cp_rank, cp_size, k_dim, interleaved, interleaved_out = ctx.flags
        dk, dv = dk.resolve_neg(), dv.resolve_neg()
        if dk.stride(-1) != 1:
            dk = dk.contiguous()
        if dv.stride(-1) != 1:
            dv = dv.contiguous()
        dkv, dk_pe = _kv_backward(
            dk, dv, cos, sin, cu_seqlens, position_ids, layout, cp_rank, cp_size, k_dim,
            interleaved, interleaved_out, searched, ctx.megatron_rounding,
        )  # fmt: skip
        return (dkv, dk_pe.view(ctx.k_pe_shape)) + (None,) * 12
