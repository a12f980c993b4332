"""The op records: what each op needs besides its activations, one frozen dataclass per op.

:class:`QueryCall` and :class:`KVCall` are data: the checks build them, the autograd functions
save their tensors, the custom ops' schemas are generated from their fields and the backends
read them (``ops``). A leaf: it imports nothing of the package but ``positions``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from .positions import Positions


@dataclass(frozen=True, slots=True)
class _RotationCall:
    """What both ops share: ``cos, sin: [P, R]`` and the position source (``cu_seqlens``,
    ``position_ids``, ``searched``, ``layout``, ``cp_rank``, ``cp_size``: see
    :class:`mlarope.positions.Positions`)."""

    cos: Tensor
    sin: Tensor
    cu_seqlens: Tensor | None
    position_ids: Tensor | None
    searched: Tensor | None
    layout: str
    cp_rank: int
    cp_size: int

    def positions(self) -> Positions:
        return Positions(
            self.layout, self.cu_seqlens, self.position_ids, self.cp_rank, self.cp_size,
            self.searched,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class QueryCall(_RotationCall):
    """What the query op needs besides the tensor it rotates, ``x: [tokens..., H, N + R]``:
    the tables and positions (:class:`_RotationCall`); the pair layout read
    (``interleaved_in``) and written (``interleaved_out``); ``inverse`` (the opposite angle);
    ``transpose`` (``R^T``, the backward: see :meth:`transposed`).
    """

    interleaved_in: bool
    interleaved_out: bool
    inverse: bool
    transpose: bool

    def transposed(self) -> QueryCall:
        """``R^T`` of this call's ``R`` (and back): read in the output layout, write in the input
        layout, ``transpose`` flipped."""
        return dataclasses.replace(
            self, interleaved_in=self.interleaved_out, interleaved_out=self.interleaved_in,
            transpose=not self.transpose,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class KVCall(_RotationCall):
    """What the key/value op ``F: (kv, k_pe) -> (k, v)`` and its backward
    ``B: (dk, dv) -> (dkv, dk_pe)`` need besides those tensors: the tables and positions
    (:class:`_RotationCall`); ``k_dim``: ``K``; ``interleaved_in``: ``k_pe``'s pair layout;
    ``interleaved_out``: the layout of ``k``'s rope channels; ``copy_v`` (``F`` only): write
    ``v`` (else the caller takes the view ``kv[..., K:]``); ``megatron_rounding`` (``B`` only;
    ``mlarope.compat.megatron`` alone sets it): ``dk_pe`` rounded where Megatron-Core rounds it.
    """

    k_dim: int
    interleaved_in: bool
    interleaved_out: bool
    copy_v: bool
    megatron_rounding: bool


def call_args(call: QueryCall | KVCall) -> tuple:
    """The record's fields in order: the custom ops' and autograd functions' arguments after
    the activations (``type(call)(*call_args(call))`` is ``call``)."""
    return tuple(getattr(call, f.name) for f in dataclasses.fields(call))


def call_tensors(call: QueryCall | KVCall) -> tuple:
    """``(cos, sin, cu_seqlens, position_ids, searched)``: what a backward saves."""
    return (call.cos, call.sin, call.cu_seqlens, call.position_ids, call.searched)


def with_tensors(call, tensors: tuple):
    """``call`` with :func:`call_tensors` replaced (by the saved ones, in a backward)."""
    cos, sin, cu_seqlens, position_ids, searched = tensors
    return dataclasses.replace(
        call, cos=cos, sin=sin, cu_seqlens=cu_seqlens, position_ids=position_ids,
        searched=searched,
    )  # fmt: skip
