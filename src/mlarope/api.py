"""The public calls: :func:`apply_rope_q`, :func:`apply_rope_kv` and :func:`apply_rope_qk`.

Each call reads top to bottom, one layer each, none calling back up (docs/architecture.md):

1. ``_plans``: a repeated eager call replays the launches an earlier call with the same
   metadata recorded, and returns; a first call runs the pipeline recording its launches and
   stores the plan they give; any other call runs the pipeline;
2. ``_pipeline``: ``_checks`` (every check -> the checked tensors and the op's record,
   ``_records``), then ``autograd`` when a gradient, forward-mode AD or ``torch.compile`` is
   involved, else ``ops`` directly;
3. ``ops``: the launcher and kernel (``kernels``) or the PyTorch reference.
"""

from __future__ import annotations

import torch

from . import _plans

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
    return _plans.apply_query(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, inplace, inplace_backward, validate,
    )  # fmt: skip


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
    return _plans.apply_kv(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out, copy_v, validate,
    )  # fmt: skip


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
    return _plans.apply_pair(
        q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, validate,
    )  # fmt: skip
