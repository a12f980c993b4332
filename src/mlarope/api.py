"""The public calls: :func:`apply_rope_q`, :func:`apply_rope_kv` and :func:`apply_rope_qk`.

Each call reads top to bottom, one layer each, none calling back up (docs/architecture.md):

1. ``_plans``: a repeated eager call replays the launches an earlier call with the same
   metadata recorded, and returns; a first call gets the recording of its launches;
2. ``_checks``: every check -> the checked tensors and the op's record (``_records``);
3. ``autograd`` when a gradient, forward-mode AD or ``torch.compile`` is involved, else ``ops``
   directly -> the launcher and kernel (``kernels``) or the PyTorch reference;
4. the recording, if any, stores the call's plan (``_plans.Pending.finish``).
"""

from __future__ import annotations

import torch

from . import _checks, _plans
from ._modes import compiling, needs_autograd
from .autograd import rope_kv_differentiable, rope_q_differentiable
from .ops import rope_kv, rope_q, rope_q_

__all__ = ["apply_rope_kv", "apply_rope_q", "apply_rope_qk"]


def apply_rope_q(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str = "sbhd",
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
    inverse: bool = False,
    inplace: bool = False,
    inplace_backward: bool = False,
    validate: bool = False,
) -> torch.Tensor:
    """Rotate the rope channels of the queries (MLA query op).

    Args:
        q: ``[S, B, H, N + R]`` (sbhd), ``[B, S, H, N + R]`` (bshd) or ``[T, H, N + R]`` (thd);
            last dim contiguous, any strides elsewhere. The rope channels are ``q[..., N:]``.
        cos, sin: ``[P, R]`` tables (singleton dims such as ``[P, 1, 1, R]`` accepted), fp32
            preferred; ``R`` in (32, 64, 128).
        layout: ``"sbhd"``, ``"bshd"`` or ``"thd"``.
        cu_seqlens: ``[n + 1]`` int32/int64 (thd only): token ``t`` of sequence ``i`` has position
            ``t - cu_seqlens[i]``; tokens at or past ``cu_seqlens[-1]`` are padding (unrotated).
            Under context parallelism these are the global lengths.
        position_ids: int tensor of the token dims (or broadcastable to them).
        cp_rank, cp_size: context parallel rank and size (load-balanced split: rank ``r`` holds
            chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence).
        interleaved: input pairs are ``(x[2j], x[2j+1])`` (True) or ``(x[j], x[half+j])``.
        interleaved_out: write the pairs interleaved (True) or half-split (False, default).
        inverse: rotate by the opposite angle.
        inplace: overwrite the rope channels of ``q`` and return ``q`` (declared to autograd).
        inplace_backward: the backward rotates the rope channels of the incoming gradient in
            place and returns that tensor as ``q``'s gradient, as Megatron-Core does: it moves
            ``2 R`` instead of ``2 (N + R)`` elements per row. Only safe when no other op holds
            that gradient (``q`` feeds one attention kernel); wrong when the output also feeds,
            say, an addition, whose backward hands the same tensor to both branches, when a
            hook keeps the gradient, or when you pass your own ``gradient`` (or a tensor it is
            a slice of, as ``torch.cat``'s backward hands out) and use it afterwards. Falls back
            to out of place for a broadcast, overlapping or inference-mode gradient, for double
            backward and when compiling.
            Default False: the backward writes a new tensor (docs/semantics.md).
        validate: check device data (positions against the table, ``cu_seqlens`` well formed),
            raising ``ValueError``; costs a device sync. Also on with ``MLAROPE_VALIDATE=1``.
            Without it an out-of-range row comes out as NaN.

    Differentiable to any order in ``q`` (backward, double backward, forward-mode AD,
    ``torch.func``), in place or not. The tables are constants: a ``cos`` or ``sin`` that
    requires grad raises ``ValueError`` (pass ``cos.detach()``).

    Returns:
        ``[..., H, N + R]``: a new tensor, or ``q`` itself when ``inplace``.
    """
    found = _plans.replay_query(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, inplace, inplace_backward, validate,
    )  # fmt: skip
    if found is not None and found.__class__ is not _plans.Pending:
        return found  # a repeated eager call
    outputs = op = call = None
    try:
        q, call = _checks.check_query_call(
            q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
            interleaved_out, inverse, inplace, inplace_backward, validate,
        )  # fmt: skip
        if compiling() or needs_autograd(q):
            out, op = rope_q_differentiable(q, call, inplace, inplace_backward), "q"
        elif inplace:
            rope_q_(q, call)
            torch.autograd.graph.increment_version(q)
            out = q
        else:
            out = rope_q(q, call)
        outputs = () if inplace else (out,)
    finally:
        if found is not None:
            found.finish(outputs, op, call, inplace, inplace_backward)
    return out


def apply_rope_kv(
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    k_dim: int,
    layout: str = "sbhd",
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
    copy_v: bool = True,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv`` and attach the rotated shared positional key to every head (MLA kv op).

    Args:
        kv: ``[..., H, K + V]`` in the layout's token dims (see :func:`apply_rope_q`).
        k_pe: ``[..., 1, R]`` or ``[..., R]``, the positional key shared by all heads; same
            dtype, device and token dims as ``kv``.
        cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
            interleaved_out, validate: as in :func:`apply_rope_q` (interleaving refers to
            ``k_pe``).
        k_dim: ``K``, the non-positional key channels at the front of ``kv``.
        copy_v: return ``v`` as a new contiguous tensor (True) or as the strided view
            ``kv[..., K:]`` (False), which saves writing ``V`` channels per head.

    Differentiable to any order in ``kv`` and ``k_pe``, as :func:`apply_rope_q` in ``q``.

    Returns:
        ``k: [..., H, K + R]`` (``kv[..., :K]`` then the rotated ``k_pe``) and ``v: [..., H, V]``.
    """
    found = _plans.replay_kv(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out, copy_v, validate,
    )  # fmt: skip
    if found is not None and found.__class__ is not _plans.Pending:
        return found  # a repeated eager call
    outputs = op = call = None
    try:
        kv, k_pe, call = _checks.check_key_value_call(
            kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
            interleaved, interleaved_out, copy_v, validate,
        )  # fmt: skip
        if compiling() or needs_autograd(kv, k_pe):
            (k, v), op = rope_kv_differentiable(kv, k_pe, call), "kv"
        else:
            k, v = rope_kv(kv, k_pe, call)
            v = v if copy_v else kv[..., call.k_dim :]
        outputs = (k, v) if copy_v else (k,)
    finally:
        if found is not None:
            found.finish(outputs, op, call)
    return k, v


def apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str = "sbhd",
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
    inverse: bool = False,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate two tensors of the same tokens with the same tables and positions: the queries
    and keys of one attention call (a transformers rotary function's ``q, k``).

    The same as ``(apply_rope_q(q, cos, sin, **kwargs), apply_rope_q(k, cos, sin, **kwargs))``,
    bit for bit and in every autograd and compile mode, out of place; a repeated eager call is
    one autograd node (not two) whose forward and backward each make the two launches the
    first such call recorded.

    Args:
        q: ``[S, B, Hq, Nq + R]`` (sbhd), ``[B, S, Hq, Nq + R]`` (bshd) or ``[T, Hq, Nq + R]``.
        k: the same token dims as ``q``, any head count and nope width: ``[..., Hk, Nk + R]``.
        cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
            interleaved_out, inverse, validate: as in :func:`apply_rope_q`, for both.

    Returns:
        ``(q', k')``: new tensors of ``q``'s and ``k``'s shapes.
    """
    found = _plans.replay_pair(
        q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, validate,
    )  # fmt: skip
    if found is not None and found.__class__ is not _plans.Pending:
        return found  # a repeated eager call
    outputs = op = call = None
    try:
        q, k, call = _checks.check_pair_call(
            q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
            interleaved_out, inverse, validate,
        )  # fmt: skip
        if compiling() or needs_autograd(q) or needs_autograd(k):
            pair = (
                rope_q_differentiable(q, call, False, False),
                rope_q_differentiable(k, call, False, False),
            )
            op = "qk"
        else:
            pair = (rope_q(q, call), rope_q(k, call))
        outputs = pair
    finally:
        if found is not None:
            found.finish(outputs, op, call)
    return pair
