"""Megatron-Core's fused MLA RoPE functions, with the same names, signatures and semantics.

Replace::

    from megatron.core.fusions.fused_mla_yarn_rope_apply import (
        fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_q,
    )

with::

    from mlarope.compat.megatron import fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_q

Mirrored from ``megatron/core/fusions/fused_mla_yarn_rope_apply.py`` of NVIDIA/Megatron-LM
(last changed in e4ba3a30f2d8, "Explicit safe MLA RoPE primitives and consumers (#5944)", read
at d98e8a64ddf3). Facts only; the code here is a thin layer over :func:`mlarope.apply_rope_q`
and :func:`mlarope.apply_rope_kv`.

Notation (Megatron's names): ``nope_dim`` (the legacy query function calls it
``qk_head_dim``, Megatron's config name for the per-head nope width) is ``N``, ``emb_dim`` is
the rope width ``R``, ``k_dim``/``v_dim`` are the per-head key-nope and value widths ``K``/``V``.
Layout is chosen by the sequence-lengths argument, as in Megatron:

- ``cu_seqlens_* is None``: sbhd, ``t: [S, B, H, N + R]``; the position of a token is its
  index ``s``. As in Megatron, the tables are the CP-local ones (Megatron's rotary module
  slices them per context-parallel rank for non-packed batches) and ``cp_rank``/``cp_size`` are
  not used for positions.
- ``cu_seqlens_*`` given: thd, ``t: [T, H, N + R]``. ``cu_seqlens`` are the global
  (CP-padded) cumulative lengths, each a multiple of ``2 * cp_size``; rank ``r`` holds chunks
  ``r`` and ``2 * cp_size - 1 - r`` of every sequence and a token's position is its global one.
  Rows at or past ``cu_seqlens[-1] // cp_size`` are padding.

Rope channels are read as interleaved pairs ``(x[2j], x[2j + 1])`` (DeepSeek's layout) and
rotated with ``c = cos[p]``, ``s = sin[p]``: ``a' = a * c[j] - b * s[j]``,
``b' = b * c[half + j] + a * s[half + j]``. They are written as two halves
(``a'`` then ``b'``), or, with ``remove_interleaving=True``, back into the interleaved pairs
(Megatron's name means "undo the de-interleaving"; its docstring says "non-interleaved", but its
kernel and its reference ``_apply_rotary_pos_emb_bshd`` write pairs, and so does this module).

Where Megatron's tests and models depend on it, this module behaves as Megatron-Core does
(details in ``docs/megatron.md``):

- **In place on a leaf.** A leaf that requires grad (or a view of one), as Megatron's own tests
  pass it, is rotated in place and the returned tensor, on the leaf's storage, carries the
  rotation's backward, so the leaf's ``.grad`` is the rotated-back gradient. The leaf's version
  counter is bumped, so another op that saved the leaf still raises at backward time. (The
  native :func:`mlarope.apply_rope_q` keeps autograd's rule and refuses a leaf. Under
  ``torch.compile`` the returned tensor has its own storage; values and gradient are the same.)
- **The** ``k_pos_emb`` **gradient** is rounded where Megatron-Core's kernel and its unfused
  PyTorch path round it (``rounding="megatron"``, the default of the key/value functions): the
  fp32 head sum to the activation dtype, then each product and the sum of the rotation to it
  when the tables are in that dtype, so the fused and unfused paths of a Megatron model agree.
  ``rounding="exact"`` gives the correctly rounded result (fp32 arithmetic, one rounding).

Differences from Megatron-Core: the rotations are computed in fp32 and rounded once (Megatron
computes them in the activation dtype; the results differ by at most about one ulp of the
products); the kernels are race-free and deterministic; thd padding rows pass through unrotated
instead of being rotated with table row 0; an in-place call on a non-leaf is declared to
autograd (``mark_dirty``), so a tensor another op saved for its backward raises at backward time
instead of silently producing wrong gradients; ``emb_dim`` must be a rope width mlarope's
kernels support (32, 64 or 128; DeepSeek uses 64), where Megatron takes any power of two
``>= 4``; every argument is validated with ``ValueError``/``TypeError`` (Megatron asserts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch

import mlarope
from mlarope import _modes, _plans
from mlarope import autograd as _autograd

__all__ = [
    "ROUNDING_MODES",
    "fused_apply_mla_rope_for_kv",
    "fused_apply_mla_rope_for_q",
    "fused_mla_rope_inplace",
    "fused_mla_rope_kv_split",
    "fused_mla_rope_out_of_place",
]

_INDEX_DTYPES = (torch.int32, torch.int64)

# The key/value functions' ``rounding``: "megatron" (default) rounds the k_pos_emb gradient where
# Megatron-Core does; "exact" rounds it once, as mlarope.apply_rope_kv does.
ROUNDING_MODES = ("megatron", "exact")


# ---------------------------------------------------------------------------------------------
# argument checks (host side only; mlarope checks the rest and the device data)
# ---------------------------------------------------------------------------------------------


def _fail(fn: str, msg: str, exc: type[Exception] = ValueError) -> NoReturn:
    raise exc(f"mlarope.compat.megatron.{fn}: {msg}")


def _check_tensor(fn: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(fn, f"{name} must be a torch.Tensor, got {type(value).__name__}", TypeError)
    return value


def _check_int(fn: str, name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; a flag passed positionally in the wrong slot must not pass.
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(fn, f"{name} must be an int, got {value!r} ({type(value).__name__})", TypeError)
    if value < minimum:
        _fail(fn, f"{name} must be >= {minimum}, got {value}")
    return value


def _check_bool(fn: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        _fail(fn, f"{name} must be a bool, got {value!r} ({type(value).__name__})", TypeError)
    return value


def _check_common(
    fn: str,
    emb_dim: object,
    cos: object,
    sin: object,
    cu_seqlens: object,
    cu_name: str,
    cp_rank: object,
    cp_size: object,
    rotary_interleaved: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checks shared by the query and key/value functions; returns ``cos, sin, cu_seqlens``."""
    # The allowed rope widths are mlarope's to decide (checked there, against cos.shape[-1]).
    emb_dim = _check_int(fn, "emb_dim", emb_dim, 1)
    cos = _check_tensor(fn, "cos", cos)
    sin = _check_tensor(fn, "sin", sin)
    if cos.dim() < 2 or cos.shape[-1] != emb_dim:
        _fail(
            fn,
            f"cos must be [max_seq_len, 1, 1, emb_dim] (or [max_seq_len, emb_dim]) with "
            f"emb_dim={emb_dim}, got shape {tuple(cos.shape)}",
        )
    if sin.shape != cos.shape:
        _fail(fn, f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cu_seqlens is not None:
        cu_seqlens = _check_tensor(fn, cu_name, cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _INDEX_DTYPES:
            _fail(
                fn,
                f"{cu_name} must be a 1-D int32/int64 tensor [num_seqs + 1], got shape "
                f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}",
            )
    cp_size = _check_int(fn, "cp_size", cp_size, 1)
    cp_rank = _check_int(fn, "cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        _fail(fn, f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if _check_bool(fn, "rotary_interleaved", rotary_interleaved):
        _fail(
            fn,
            "rotary_interleaved=True (GPT-J style rotation) is not supported, as in "
            "Megatron-Core; MLA's interleaved rope channels are handled with the default False",
        )
    return cos, sin, cu_seqlens


def _check_tokens(fn: str, name: str, x: torch.Tensor, thd: bool, cu_name: str) -> None:
    want = 3 if thd else 4
    if x.dim() != want:
        shape = "[T, H, D] (thd" if thd else "[S, B, H, D] (sbhd"
        given = "given" if thd else "None"
        _fail(
            fn,
            f"{name} must be {shape}, because {cu_name} is {given}), got shape {tuple(x.shape)}",
        )


@contextmanager
def _from(fn: str, api: str, renames: str) -> Iterator[None]:
    """Re-raise mlarope's argument errors with this function's argument names attached."""
    try:
        yield
    except (ValueError, TypeError) as err:
        msg = f"{err} [raised by mlarope.{api} for mlarope.compat.megatron.{fn}; {renames}]"
        try:
            new = type(err)(msg)
        except Exception:  # an exception type with a custom constructor: keep the original
            raise err from None
        raise new from err


def _q_kwargs(
    fn: str,
    t: object,
    cos: object,
    sin: object,
    nope_dim: object,
    emb_dim: object,
    cu_seqlens_q: object,
    cp_rank: object,
    cp_size: object,
    rotary_interleaved: object,
    inverse: object,
    remove_interleaving: object,
    position_ids: object,
    nope_name: str,
    validate: object,
) -> dict:
    """Validates a query call and maps it onto :func:`mlarope.apply_rope_q`'s arguments."""
    t = _check_tensor(fn, "t", t)
    cos, sin, cu = _check_common(
        fn, emb_dim, cos, sin, cu_seqlens_q, "cu_seqlens_q", cp_rank, cp_size, rotary_interleaved
    )
    nope_dim = _check_int(fn, nope_name, nope_dim, 0)
    emb_dim = _check_int(fn, "emb_dim", emb_dim, 1)
    _check_bool(fn, "inverse", inverse)
    _check_bool(fn, "remove_interleaving", remove_interleaving)
    _check_bool(fn, "validate", validate)
    thd = cu is not None
    _check_tokens(fn, "t", t, thd, "cu_seqlens_q")
    if t.shape[-1] != nope_dim + emb_dim:
        _fail(
            fn,
            f"t's last dim must be {nope_name} + emb_dim = {nope_dim} + {emb_dim}, got "
            f"shape {tuple(t.shape)}",
        )
    kwargs: dict = dict(
        interleaved=True,
        interleaved_out=remove_interleaving,
        inverse=inverse,
        validate=validate,
    )
    if not thd:
        if position_ids is not None:
            _fail(
                fn,
                "position_ids are only supported for thd input (pass cu_seqlens_q), as in "
                "Megatron-Core; sbhd positions are the sequence index",
            )
        # Megatron's sbhd tables are already the CP-local rows: cp_rank/cp_size play no part.
        kwargs.update(layout="sbhd")
    elif position_ids is not None:
        position_ids = _check_tensor(fn, "position_ids", position_ids)
        if position_ids.dtype not in _INDEX_DTYPES or tuple(position_ids.shape) != (t.shape[0],):
            _fail(
                fn,
                f"position_ids must be an int32/int64 tensor of shape [T] = ({t.shape[0]},), got "
                f"shape {tuple(position_ids.shape)} and dtype {position_ids.dtype}",
            )
        # Megatron: explicit positions replace the cu_seqlens/CP row-to-position mapping.
        kwargs.update(layout="thd", position_ids=position_ids)
    else:
        kwargs.update(layout="thd", cu_seqlens=cu, cp_rank=cp_rank, cp_size=cp_size)
    return kwargs


class _LeafAlias(torch.autograd.Function):
    """``t`` -> a new tensor object on ``t``'s storage, sharing its version counter, whose
    gradient flows to ``t`` unchanged.

    Autograd refuses to rotate a leaf that requires grad (or a view of one) in place; Megatron's
    function does it anyway, because it never tells autograd (no ``mark_dirty``). Rotating this
    alias in place instead is allowed and declared: the alias takes the rotation's backward, the
    leaf gets the rotated-back gradient through this node, and the shared version counter makes
    any other op that saved the leaf raise at backward time."""

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        """Nothing to keep (a separate ``setup_context``: torch.func's transforms need it)."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor) -> torch.Tensor:
        return tangent


def _rope_q(
    fn: str, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool, kwargs: dict
) -> torch.Tensor:
    with _from(fn, "apply_rope_q", "its q is t, its cu_seqlens is cu_seqlens_q"):
        if inplace and _modes.autograd_refuses_in_place(t):
            if torch.compiler.is_compiling():
                # Dynamo loses the alias's autograd edge: rotate out of place, write the values
                # back into the leaf outside autograd (its version counter moves), and return
                # the rotated tensor (same values and gradient; its own storage).
                out = mlarope.apply_rope_q(t, cos, sin, inplace=False, **kwargs)
                with torch.no_grad():
                    t.copy_(out)
                return out
            t = _LeafAlias.apply(t)
        # Where the call marks t's base dirty (t reshapes its whole base), a new view of the
        # base differentiates as a view; t itself takes the base's new history as an
        # as_strided view, whose backward copies the gradient twice.
        through_base = (
            inplace and not torch.compiler.is_compiling() and _autograd.rotates_whole_base(t)
        )
        out = mlarope.apply_rope_q(t, cos, sin, inplace=inplace, **kwargs)
        return out._base.view(out.shape) if through_base else out


# ---------------------------------------------------------------------------------------------
# query: in place and out of place
# ---------------------------------------------------------------------------------------------


def fused_mla_rope_inplace(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope_dim: int,
    emb_dim: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    inverse: bool = False,
    remove_interleaving: bool = False,
    position_ids: torch.Tensor | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Rotates the trailing ``emb_dim`` channels of ``t`` in place; the nope channels stay.

    Args:
        t: ``[S, B, H, nope_dim + emb_dim]`` (sbhd, ``cu_seqlens_q is None``) or
            ``[T, H, nope_dim + emb_dim]`` (thd). Its rope channels are interleaved pairs.
        cos, sin: ``[P, 1, 1, emb_dim]`` (Megatron's cached tables, any float dtype) or
            ``[P, emb_dim]``; fp32 tables (``mlarope.YarnConfig.cos_sin``) are exact.
        nope_dim: ``N``, the channels before the rope part (left untouched).
        emb_dim: ``R``, the rope width; must equal ``cos.shape[-1]``.
        cu_seqlens_q: ``[num_seqs + 1]`` global cumulative (padded) lengths for thd.
        cp_rank, cp_size: context-parallel rank and size (thd only; sbhd tables are CP-local).
        rotary_interleaved: must be False (as in Megatron-Core).
        inverse: rotate by the opposite angle (undo a rotation, e.g. on attention outputs).
        remove_interleaving: write the rotated pairs back interleaved instead of as halves.
        position_ids: ``[T]`` integer positions (thd only); they replace the cu_seqlens/CP
            mapping.
        validate: mlarope's extra keyword: check device data (positions against the table,
            ``cu_seqlens`` monotonic), with a device sync.

    Returns:
        ``t`` itself, rotated in place, the mutation declared to autograd (``mark_dirty``). For
        a leaf that requires grad (or a view of one), which autograd does not let anyone
        rotate in place, a new tensor on ``t``'s storage whose backward hands ``t`` the
        rotated-back gradient, as Megatron's function returns. Where ``t`` requires grad and
        reshapes the whole of a non-leaf base (Megatron-Core's query,
        ``linear(x).view(...)``), the base is declared modified and a new view of it, shaped
        and strided as ``t``, is returned: its backward copies nothing, where ``t`` itself,
        still correct, would copy the gradient twice (Megatron's own function returns a new
        view too, for sbhd).
    """
    return _mla_rope(
        "fused_mla_rope_inplace", True, t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank,
        cp_size, rotary_interleaved, inverse, remove_interleaving, position_ids, validate,
    )  # fmt: skip


def _mla_rope(fn: str, inplace: bool, t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank,
              cp_size, rotary_interleaved, inverse, remove_interleaving, position_ids,
              validate) -> torch.Tensor:  # fmt: skip
    """The shared body of ``fused_mla_rope_inplace`` / ``fused_mla_rope_out_of_place``."""
    kwargs = _q_kwargs(
        fn, t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved,
        inverse, remove_interleaving, position_ids, "nope_dim", validate,
    )  # fmt: skip
    return _rope_q(fn, t, cos, sin, inplace, kwargs)


def fused_mla_rope_out_of_place(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope_dim: int,
    emb_dim: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    inverse: bool = False,
    remove_interleaving: bool = False,
    position_ids: torch.Tensor | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """:func:`fused_mla_rope_inplace` into a new tensor; ``t`` is left untouched.

    Args: as :func:`fused_mla_rope_inplace`.

    Returns:
        A new tensor shaped like ``t``: the nope channels copied, the rope channels rotated.
        Megatron clones ``t`` and rotates the clone in place; mlarope reads ``t`` once and
        writes the output once.
    """
    return _mla_rope(
        "fused_mla_rope_out_of_place", False, t, cos, sin, nope_dim, emb_dim, cu_seqlens_q,
        cp_rank, cp_size, rotary_interleaved, inverse, remove_interleaving, position_ids,
        validate,
    )  # fmt: skip


def fused_apply_mla_rope_for_q(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Megatron's legacy query function: :func:`fused_mla_rope_inplace` with the defaults.

    Args:
        t: ``[S, B, H, qk_head_dim + emb_dim]`` or ``[T, H, qk_head_dim + emb_dim]``.
        qk_head_dim: the nope width ``N`` (Megatron's ``config.qk_head_dim``; it is not the
            full head dim).
        Others: as :func:`fused_mla_rope_inplace`.

    Returns:
        ``t`` itself, rotated in place, rope channels as two halves (for a leaf that requires
        grad, a tensor on its storage; for a ``t`` that requires grad and reshapes its whole
        non-leaf base, a new view of that base: as :func:`fused_mla_rope_inplace` returns).
    """
    fn = "fused_apply_mla_rope_for_q"
    kwargs = _q_kwargs(
        fn,
        t,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu_seqlens_q,
        cp_rank,
        cp_size,
        rotary_interleaved,
        False,
        False,
        None,
        "qk_head_dim",
        validate,
    )
    return _rope_q(fn, t, cos, sin, True, kwargs)


# ---------------------------------------------------------------------------------------------
# key/value
# ---------------------------------------------------------------------------------------------


def fused_mla_rope_kv_split(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    remove_interleaving: bool = False,
    *,
    rounding: str = "megatron",
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits ``kv`` into key and value and appends the rotated shared ``k_pos_emb`` to the key.

    Args:
        kv: ``[S, B, H, k_dim + v_dim]`` (sbhd, ``cu_seqlens_kv is None``) or
            ``[T, H, k_dim + v_dim]`` (thd).
        k_pos_emb: ``[S, B, 1, emb_dim]`` or ``[T, 1, emb_dim]`` (``[S, B, emb_dim]`` and
            ``[T, emb_dim]`` too), interleaved pairs, shared by all heads; same dtype as ``kv``.
        cos, sin: ``[P, 1, 1, emb_dim]`` or ``[P, emb_dim]``.
        emb_dim: ``R``; must equal ``cos.shape[-1]``.
        k_dim, v_dim: per-head key-nope and value widths.
        cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved, remove_interleaving, validate:
            as in :func:`fused_mla_rope_inplace`.
        rounding: mlarope's extra keyword, how the ``k_pos_emb`` gradient is rounded.
            ``"megatron"`` (default): where Megatron-Core's kernel and its unfused path round,
            so that a Megatron model's fused and unfused paths agree: the fp32 sum over heads
            rounded to the activation dtype, then (tables in that dtype) each product and the
            sum of the rotation. ``"exact"``: fp32 throughout, rounded once (as
            :func:`mlarope.apply_rope_kv`).

    Returns:
        ``key: [..., H, k_dim + emb_dim]`` (``kv[..., :k_dim]`` then the rotated rope
        channels, the same for every head) and ``value: [..., H, v_dim]``, both new
        tensors. The ``k_pos_emb`` gradient is the sum over heads (fp32, fixed order), rotated
        back as ``rounding`` says.
    """
    fn = "fused_mla_rope_kv_split"
    return _rope_kv(
        fn,
        kv,
        k_pos_emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv,
        cp_rank,
        cp_size,
        rotary_interleaved,
        remove_interleaving,
        rounding,
        validate,
    )


def fused_apply_mla_rope_for_kv(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    *,
    rounding: str = "megatron",
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's legacy key/value function: :func:`fused_mla_rope_kv_split` with the defaults.

    Args and returns: as :func:`fused_mla_rope_kv_split` (rope channels of the key as halves).
    """
    fn = "fused_apply_mla_rope_for_kv"
    return _rope_kv(
        fn,
        kv,
        k_pos_emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv,
        cp_rank,
        cp_size,
        rotary_interleaved,
        False,
        rounding,
        validate,
    )


def _check_rounding(fn: str, rounding: object) -> str:
    if not isinstance(rounding, str):
        _fail(
            fn, f"rounding must be a str, got {rounding!r} ({type(rounding).__name__})", TypeError
        )
    if rounding not in ROUNDING_MODES:
        _fail(fn, f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    return rounding


def _rope_kv(
    fn: str,
    kv: object,
    k_pos_emb: object,
    cos: object,
    sin: object,
    emb_dim: object,
    k_dim: object,
    v_dim: object,
    cu_seqlens_kv: object,
    cp_rank: object,
    cp_size: object,
    rotary_interleaved: object,
    remove_interleaving: object,
    rounding: object,
    validate: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates a key/value call and runs it through :func:`mlarope.apply_rope_kv`, or, when
    its backward will round as Megatron does, through the same checks and autograd function
    with the rounding flag (:func:`_apply_rope_kv_megatron_rounding`)."""
    kv = _check_tensor(fn, "kv", kv)
    k_pos_emb = _check_tensor(fn, "k_pos_emb", k_pos_emb)
    cos, sin, cu = _check_common(
        fn,
        emb_dim,
        cos,
        sin,
        cu_seqlens_kv,
        "cu_seqlens_kv",
        cp_rank,
        cp_size,
        rotary_interleaved,
    )
    k_dim = _check_int(fn, "k_dim", k_dim, 1)
    v_dim = _check_int(fn, "v_dim", v_dim, 1)
    emb_dim = _check_int(fn, "emb_dim", emb_dim, 1)
    _check_bool(fn, "remove_interleaving", remove_interleaving)
    rounding = _check_rounding(fn, rounding)
    _check_bool(fn, "validate", validate)
    thd = cu is not None
    _check_tokens(fn, "kv", kv, thd, "cu_seqlens_kv")
    if kv.shape[-1] != k_dim + v_dim:
        _fail(
            fn,
            f"kv's last dim must be k_dim + v_dim = {k_dim} + {v_dim}, got shape {tuple(kv.shape)}",
        )
    tokens = tuple(kv.shape[:-2])
    pe = tuple(k_pos_emb.shape)
    if pe not in ((*tokens, 1, emb_dim), (*tokens, emb_dim)):
        _fail(
            fn,
            f"k_pos_emb must be [{', '.join(map(str, tokens))}, 1, emb_dim={emb_dim}] (the token "
            f"dims of kv {tuple(kv.shape)}), got shape {pe}",
        )
    if k_pos_emb.dtype != kv.dtype:
        _fail(fn, f"k_pos_emb's dtype {k_pos_emb.dtype} must match kv's {kv.dtype}", TypeError)
    kwargs: dict = dict(
        k_dim=k_dim,
        interleaved=True,
        interleaved_out=remove_interleaving,
        copy_v=True,  # Megatron returns a new, contiguous value tensor
        validate=validate,
    )
    if thd:
        kwargs.update(layout="thd", cu_seqlens=cu, cp_rank=cp_rank, cp_size=cp_size)
    else:
        # Megatron's sbhd tables are already the CP-local rows: cp_rank/cp_size play no part.
        kwargs.update(layout="sbhd")
    with _from(fn, "apply_rope_kv", "its k_pe is k_pos_emb, its cu_seqlens is cu_seqlens_kv"):
        differentiable = torch.is_grad_enabled() and (kv.requires_grad or k_pos_emb.requires_grad)
        if rounding == "megatron" and (differentiable or torch.compiler.is_compiling()):
            return _apply_rope_kv_megatron_rounding(kv, k_pos_emb, cos, sin, **kwargs)
        # Without a backward the rounding mode plays no part: the public call (and its plans).
        return mlarope.apply_rope_kv(kv, k_pos_emb, cos, sin, **kwargs)


def _apply_rope_kv_megatron_rounding(
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    k_dim: int,
    layout: str,
    cu_seqlens: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool,
    interleaved_out: bool,
    copy_v: bool,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlarope.apply_rope_kv`'s autograd path (its checks, then its autograd function)
    with the autograd function's ``megatron_rounding`` flag set: the same forward, a backward
    whose ``k_pe`` gradient rounds where Megatron-Core's does. A repeated eager call replays its
    launches in one node, as the public call's do (``_plans.GradPlan``)."""
    return _plans.apply_kv(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, None, cp_rank, cp_size, interleaved,
        interleaved_out, copy_v, validate, megatron_rounding=True,
    )  # fmt: skip
