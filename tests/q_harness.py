"""The query op's test harness: cases, inputs, launches into NaN-poisoned outputs, and the fp64
truth with the error model's per-element tolerances. ``tests/test_q.py`` and
``tests/test_autograd.py`` build on it.

Shapes (``tokens...`` is ``[S, B]`` for sbhd, ``[B, S]`` for bshd, ``[T]`` for thd):
``q: [tokens..., H, N + R]``, the nope channels ``q[..., :N]`` and the rope channels
``q[..., N:]``; the output has ``q``'s shape. Every rotated element is held to the error model
(docs/design.md, ``tests/errmodel.py``); copied channels must be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlarope import _checks, reference
from mlarope.kernels.q import rope_q_launch
from tests.errmodel import assert_close_elementwise, poisoned_like, rope_tolerance
from tests.harness import random_tables


@dataclass
class Case:
    """One query call: shapes, dtypes, layouts, direction, position source, memory layout."""

    layout: str = "sbhd"
    tokens: tuple = (5, 2)
    heads: int = 3
    nope: int = 16
    rope: int = 64
    dtype: torch.dtype = torch.bfloat16
    table_dtype: torch.dtype = torch.float32
    interleaved: bool = True
    interleaved_out: bool = False
    inverse: bool = False
    source: str = "seq"  # seq | cu | ids
    cp_size: int = 1
    cp_rank: int = 0
    strided: bool = False
    table_rows: int = 64


# Global lengths (multiples of 2*cp_size), with an empty sequence, a short one and, for thd, a
# padded tail: the tensors have more tokens than cu_seqlens[-1] / cp_size.
CU_SEQLENS = {
    1: torch.tensor([0, 3, 3, 4, 13], dtype=torch.int32),
    2: torch.tensor([0, 4, 4, 16], dtype=torch.int64),
    4: torch.tensor([0, 8, 8, 24], dtype=torch.int32),
}
THD_TOKENS = {1: (15,), 2: (9,), 4: (7,)}


def make_inputs(case: Case, device):
    """-> ``(q [tokens..., H, N + R], cos [P, R], sin [P, R], kwargs)``: ``q`` maybe a strided,
    misaligned slice of a fused projection; ``kwargs`` the layout and position source as
    ``apply_rope_q`` takes them (``position_ids`` with one out-of-range row: NaN)."""
    width = case.nope + case.rope
    shape = (*case.tokens, case.heads, width)
    if case.strided:
        # A slice of a wider fused projection, 3 elements off alignment, token dims strided.
        if len(case.tokens) == 2:
            big = torch.randn(case.tokens[1], case.tokens[0], case.heads, width + 7).transpose(0, 1)
        else:
            big = torch.randn(case.tokens[0], case.heads + 1, width + 7)[:, 1:]
        q = big.to(case.dtype).to(device)[..., 3 : 3 + width]
        assert q.stride(-1) == 1 and not q.is_contiguous()
    else:
        q = torch.randn(shape).to(case.dtype).to(device)
    cos, sin = random_tables(case.table_rows, case.rope, case.table_dtype, device)
    kwargs = dict(layout=case.layout, cp_rank=case.cp_rank, cp_size=case.cp_size)
    if case.source == "cu":
        kwargs["cu_seqlens"] = CU_SEQLENS[case.cp_size].to(device)
    elif case.source == "ids":
        n = case.tokens[0] if case.layout == "thd" else case.tokens[0] * case.tokens[1]
        ids = torch.randint(0, case.table_rows, (n,))
        ids[1] = case.table_rows + 3  # out of range: NaN row
        kwargs["position_ids"] = ids.reshape(case.tokens).to(device)
    return q, cos, sin, kwargs


def host_checked(q, cos, sin, case: Case, kwargs):
    """The public API's host checks -> what the launcher takes: ``(q, cos2d [P, R],
    sin2d [P, R], positions)``."""
    return _checks.check_q_call(
        q, cos, sin, case.layout, kwargs.get("cu_seqlens"), kwargs.get("position_ids"),
        case.cp_rank, case.cp_size, case.interleaved, case.interleaved_out, case.inverse,
    )  # fmt: skip


def truth_and_tolerance(x, cos2d, sin2d, positions, case: Case, transpose: bool):
    """fp64 reference of one direction (``transpose``: the backward), and the per-element
    tolerance of its rope channels (0 for the copied nope channels), both ``x``'s shape."""
    il_in, il_out = case.interleaved, case.interleaved_out
    if transpose:
        il_in, il_out = il_out, il_in
    truth = reference.rope_q(
        x.double(), cos2d.double(), sin2d.double(), positions, interleaved_in=il_in,
        interleaved_out=il_out, inverse=case.inverse, transpose=transpose,
    )  # fmt: skip
    tol = torch.zeros_like(truth)
    tol[..., case.nope :] = rope_tolerance(
        x[..., case.nope :].double(), cos2d, sin2d, positions, truth[..., case.nope :], x.dtype,
        interleaved_in=il_in, interleaved_out=il_out,
    )  # fmt: skip
    return truth, tol


def launch(x, cos2d, sin2d, positions, case: Case, *, transpose, inplace=False, config=None):
    """``rope_q_launch`` on ``x`` (forward, or the backward with ``transpose``, whose layouts
    are the forward's swapped) into a NaN-poisoned output, or into ``x`` itself ``inplace``."""
    il_in, il_out = case.interleaved, case.interleaved_out
    if transpose:
        il_in, il_out = il_out, il_in
    out = x if inplace else poisoned_like(x)
    rope_q_launch(
        x, out, cos2d, sin2d, positions, interleaved_in=il_in, interleaved_out=il_out,
        inverse=case.inverse, transpose=transpose, config=config,
    )  # fmt: skip
    return out


def check_case(case: Case, device) -> None:
    """Both directions out of place against fp64 (input untouched), and in place with the same
    bits in the rope channels and the nope channels left alone."""
    q, cos, sin, kwargs = make_inputs(case, device)
    q_before = q.clone()
    q, cos2d, sin2d, positions = host_checked(q, cos, sin, case, kwargs)
    for transpose in (False, True):
        truth, tol = truth_and_tolerance(q, cos2d, sin2d, positions, case, transpose)
        out = launch(q, cos2d, sin2d, positions, case, transpose=transpose)
        assert torch.equal(q, q_before), "out of place must leave its input untouched"
        what = f"{'backward' if transpose else 'forward'} {case}"
        assert_close_elementwise(out, truth, tol, what)
        # In place: the same bits in the rope channels, nope channels untouched.
        x = q.clone()
        launch(x, cos2d, sin2d, positions, case, transpose=transpose, inplace=True)
        assert torch.equal(x[..., : case.nope], q[..., : case.nope])
        assert torch.equal(x.nan_to_num(0.5), out.nan_to_num(0.5)), (
            f"in place != out of place: {what}"
        )
