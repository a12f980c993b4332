"""The two ops as torch custom ops, over one record per op, and the backend each call runs on.

Data flow: ``api`` -> ``_checks`` -> (``autograd``) -> here -> ``kernels`` (Triton) or
``reference`` (PyTorch). The backend follows the tensor: CUDA tensors run the Triton kernels;
CPU tensors run the reference, or the same Triton kernels under Triton's interpreter when
``TRITON_INTERPRET=1``; float64 always runs the reference.

Each op's arguments besides its activations are one record (:class:`QueryCall`,
:class:`KVCall`). The custom ops' schemas are generated from the records' fields, and their
implementations, fakes, the autograd functions and the backwards all read the same fields in
the same order, so they cannot drift apart. Compiled graphs (``torch.compile(fullgraph=True)``)
call the custom ops; eager calls run the backend functions directly, skipping the dispatcher's
per-call overhead. No op syncs with the device, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch._C import _functorch

from . import reference
from ._memory import refuse_overlap
from ._modes import compiling, use_triton
from ._records import KVCall, QueryCall, call_args, call_tensors, with_tensors

__all__ = [  # the records are ops' too: their custom ops' schemas and backends
    "KVCall", "QueryCall", "call_args", "call_tensors", "compiling", "use_triton", "with_tensors",
]  # fmt: skip


_SCHEMA_TYPES = {
    "Tensor": "Tensor",
    "Tensor | None": "Tensor?",
    "str": "str",
    "int": "int",
    "bool": "bool",
}


def _schema(record: type, activations: str, returns: str) -> str:
    """A custom op's schema: the ``activations`` (schema text), then the record's fields."""
    fields = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(record))
    return f"({activations}, {fields}) -> {returns}"


# --------------------------------------------------------------------------------- backends
def _same_table_strides(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels index both tables with one row stride."""
    if cos.stride() != sin.stride():
        return cos.contiguous(), sin.contiguous()
    return cos, sin


def has_memory(t: Tensor) -> bool:
    """Whether ``t`` has memory of its own to read or write: batched tensors (``torch.func.vmap``,
    and autograd's ``is_grads_batched`` gradients) have none."""
    try:
        t.data_ptr()
    except RuntimeError:
        return False
    return True


def _check_not_batched(*tensors: Tensor) -> None:
    """The kernels read memory; batched tensors have none (the reference backend runs them as
    PyTorch ops do)."""
    if any(_functorch.is_batchedtensor(t) or not has_memory(t) for t in tensors):
        raise NotImplementedError(
            "mlarope's Triton kernels cannot run on batched tensors: under torch.func.vmap (nor "
            "jacrev, jacfwd or hessian, which vmap), or for gradients batched by "
            "torch.autograd.grad(..., is_grads_batched=True): call the op once per sample, or "
            "use the PyTorch reference backend (mlarope.reference)"
        )


def rope_q(q: Tensor, call: QueryCall) -> Tensor:
    """Out of place: ``q: [tokens..., H, N + R]`` -> a new contiguous tensor of the same shape."""
    if not use_triton(q):
        return reference.rope_q(
            q, call.cos, call.sin, call.positions(), interleaved_in=call.interleaved_in,
            interleaved_out=call.interleaved_out, inverse=call.inverse, transpose=call.transpose,
        )  # fmt: skip
    _check_not_batched(q)
    from .kernels.q import rope_q_launch

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos, sin = _same_table_strides(call.cos, call.sin)
    rope_q_launch(
        q, out, cos, sin, call.positions(), interleaved_in=call.interleaved_in,
        interleaved_out=call.interleaved_out, inverse=call.inverse, transpose=call.transpose,
    )  # fmt: skip
    return out


def rope_q_(q: Tensor, call: QueryCall) -> None:
    """In place: rotates the rope channels of ``q: [tokens..., H, N + R]``; nope untouched.
    Autograd's version counter is the caller's to bump (the kernels write through a pointer).
    ``q`` must share no memory within itself or with what the call reads: checked here too,
    since a compiled graph reaches this op with real tensors only when it runs."""
    refuse_overlap(
        "q", q, (("cos", call.cos), ("sin", call.sin), ("position_ids", call.position_ids),
                 ("cu_seqlens", call.cu_seqlens)),
    )  # fmt: skip
    if not use_triton(q):
        rope_dim = call.cos.shape[-1]
        rotated = rope_q(q, call)
        # Through .data, which bumps no version counter: as for the kernels, the caller bumps
        # it once (a copy_ on q bumped it a second time on this backend only). A functorch
        # tensor (vmap, torch.func) has no .data to take: written as PyTorch writes it.
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor(q)
        with torch.no_grad():
            (q if wrapped else q.data)[..., q.shape[-1] - rope_dim :].copy_(
                rotated[..., q.shape[-1] - rope_dim :]
            )
        return
    _check_not_batched(q)
    from .kernels.q import rope_q_launch

    cos, sin = _same_table_strides(call.cos, call.sin)
    rope_q_launch(
        q, q, cos, sin, call.positions(), interleaved_in=call.interleaved_in,
        interleaved_out=call.interleaved_out, inverse=call.inverse, transpose=call.transpose,
    )  # fmt: skip


def rope_kv(kv: Tensor, k_pe: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    """``F``: ``kv: [tokens..., H, K + V]``, ``k_pe: [tokens..., R]`` ->
    ``k: [tokens..., H, K + R]`` and ``v: [tokens..., H, V]`` (``copy_v``) or an empty placeholder
    (the caller takes the view)."""
    k_dim = call.k_dim
    if not use_triton(kv):
        k, v = reference.rope_kv(
            kv, k_pe, call.cos, call.sin, call.positions(), k_dim=k_dim,
            interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
        )  # fmt: skip
        if not call.copy_v:
            return k, kv.new_empty(0)
        return k, v.clone(memory_format=torch.contiguous_format)
    _check_not_batched(kv, k_pe)
    from .kernels.kv import rope_kv_launch

    rope_dim = call.cos.shape[-1]
    k = torch.empty((*kv.shape[:-1], k_dim + rope_dim), dtype=kv.dtype, device=kv.device)
    v = None
    if call.copy_v:
        v = torch.empty((*kv.shape[:-1], kv.shape[-1] - k_dim), dtype=kv.dtype, device=kv.device)
    cos, sin = _same_table_strides(call.cos, call.sin)
    rope_kv_launch(
        kv, k_pe, k, v, cos, sin, call.positions(), k_dim=k_dim,
        interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
    )  # fmt: skip
    return k, (v if v is not None else kv.new_empty(0))


def rope_kv_backward(dk: Tensor, dv: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    """``B``: ``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]`` ->
    ``dkv: [tokens..., H, K + V]``, ``dk_pe: [tokens..., R]`` (one launch on the Triton backend,
    given ``searched``)."""
    k_dim = call.k_dim
    if not use_triton(dk):
        return reference.rope_kv_backward(
            dk, dv, call.cos, call.sin, call.positions(), k_dim=k_dim,
            interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
            megatron_rounding=call.megatron_rounding,
        )  # fmt: skip
    _check_not_batched(dk, dv)
    from .kernels.kv import rope_kv_backward_launch

    rope_dim = call.cos.shape[-1]
    dkv = torch.empty((*dk.shape[:-1], k_dim + dv.shape[-1]), dtype=dk.dtype, device=dk.device)
    dk_pe = torch.empty((*dk.shape[:-2], rope_dim), dtype=dk.dtype, device=dk.device)
    cos, sin = _same_table_strides(call.cos, call.sin)
    rope_kv_backward_launch(
        dk, dv, dkv, dk_pe, cos, sin, call.positions(), k_dim=k_dim,
        interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
        megatron_rounding=call.megatron_rounding,
    )  # fmt: skip
    return dkv, dk_pe


# ------------------------------------------------------------------------------- custom ops
rope_q_op = torch.library.custom_op(
    "mlarope::rope_q",
    lambda q, *args: rope_q(q, QueryCall(*args)),
    mutates_args=(),
    schema=_schema(QueryCall, "Tensor q", "Tensor"),
)
rope_q_inplace_op = torch.library.custom_op(
    "mlarope::rope_q_",
    lambda q, *args: rope_q_(q, QueryCall(*args)),
    mutates_args=("q",),
    schema=_schema(QueryCall, "Tensor(a!) q", "()"),
)
rope_kv_op = torch.library.custom_op(
    "mlarope::rope_kv",
    lambda kv, k_pe, *args: rope_kv(kv, k_pe, KVCall(*args)),
    mutates_args=(),
    schema=_schema(KVCall, "Tensor kv, Tensor k_pe", "(Tensor, Tensor)"),
)
rope_kv_backward_op = torch.library.custom_op(
    "mlarope::rope_kv_backward",
    lambda dk, dv, *args: rope_kv_backward(dk, dv, KVCall(*args)),
    mutates_args=(),
    schema=_schema(KVCall, "Tensor dk, Tensor dv", "(Tensor, Tensor)"),
)


@rope_q_op.register_fake
def _rope_q_fake(q, *args):
    return q.new_empty(q.shape)


@rope_q_inplace_op.register_fake
def _rope_q_inplace_fake(q, *args):
    return None


@rope_kv_op.register_fake
def _rope_kv_fake(kv, k_pe, *args):
    call = KVCall(*args)
    k = kv.new_empty((*kv.shape[:-1], call.k_dim + call.cos.shape[-1]))
    if not call.copy_v:
        return k, kv.new_empty(0)
    return k, kv.new_empty((*kv.shape[:-1], kv.shape[-1] - call.k_dim))


@rope_kv_backward_op.register_fake
def _rope_kv_backward_fake(dk, dv, *args):
    call = KVCall(*args)
    dkv = dk.new_empty((*dk.shape[:-1], call.k_dim + dv.shape[-1]))
    return dkv, dk.new_empty((*dk.shape[:-2], call.cos.shape[-1]))


# ----------------------------------------------------------- eager: the backend; compiled: op
def run_q(x: Tensor, call: QueryCall) -> Tensor:
    return rope_q_op(x, *call_args(call)) if compiling() else rope_q(x, call)


def run_q_(x: Tensor, call: QueryCall) -> None:
    """In place, telling autograd's version counter in eager mode (the custom op declares its
    mutation to the compiler): a tensor another op saved for its backward then raises instead
    of being silently wrong."""
    if compiling():
        rope_q_inplace_op(x, *call_args(call))
        return
    rope_q_(x, call)
    torch.autograd.graph.increment_version(x)


def run_kv(kv: Tensor, k_pe: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    return rope_kv_op(kv, k_pe, *call_args(call)) if compiling() else rope_kv(kv, k_pe, call)


def run_kv_backward(dk: Tensor, dv: Tensor, call: KVCall) -> tuple[Tensor, Tensor]:
    if compiling():
        return rope_kv_backward_op(dk, dv, *call_args(call))
    return rope_kv_backward(dk, dv, call)


def search_for_backward(x: Tensor, call: QueryCall | KVCall) -> QueryCall | KVCall:
    """``call`` with ``searched`` set to an eager forward's ``cu_seqlens`` search, run once so
    that its backward reuses it (``[T]`` int64 positions of the thd input ``x: [T, H, D]``); the
    call unchanged where the kernels look positions up without a search (no ``cu_seqlens``, no
    tokens), where they do not run (the PyTorch backend), when compiling (Inductor's graph calls
    the custom ops, which search) and inside ``torch.func`` transforms (each direction then
    searches for itself: a new tensor there is a wrapper the kernels cannot read). Saves one
    launch per backward (5-9 µs on the H200 at 16,384 tokens) for 8 bytes a token kept until
    the backward."""
    cu_seqlens = call.cu_seqlens
    if cu_seqlens is None or x.shape[0] == 0 or compiling() or not use_triton(x):
        return call
    if _functorch.maybe_current_level() is not None:
        return call
    from .kernels.lookup import search_cu_seqlens

    searched = search_cu_seqlens(cu_seqlens, x.shape[0], call.cp_rank, call.cp_size)
    return dataclasses.replace(call, searched=searched)
