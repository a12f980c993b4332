"""The key/value backward's head sum: ``dk_pe`` sums ``dk[..., K:]`` over heads in a fixed
order (chunks of 16 heads, a pairwise tree in each, missing heads -0.0), restated by
``kv_harness.fixed_order_head_sum`` and compared bit for bit on thd padding rows, where nothing
is rotated; and the signs of zero sums (-0.0 is the sum's identity).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import bitwise_equal
from tests.kv_harness import (
    CU_EDGES,
    Case,
    check_backward,
    fixed_order_head_sum,
    host_checked,
    launch_backward,
    make_inputs,
    make_upstream_grads,
    relayout,
)

# Head counts around the head sum's 16-head chunks: below one chunk (1, 3), exactly one (16),
# one chunk and a partial second (17, 20), two chunks and one head (33: a third chunk of one
# head and 15 missing ones).
HEAD_SUM_COUNTS = [1, 3, 16, 17, 20, 33]
# 20 tokens: CU_EDGES covers 13, so rows 13..19 are padding.
PAD_TOKENS = 20


def padded_case(heads: int, dtype, device):
    """A padded thd batch (rows 13..19 are padding) -> (case, dk, dv, cos2d, sin2d, positions)."""
    case = Case(
        layout="thd",
        tokens=(PAD_TOKENS,),
        source="cu",
        cu=CU_EDGES,
        heads=heads,
        k_dim=16,
        v_dim=16,
        dtype=dtype,
    )
    inp = make_inputs(case, device)
    kv, _, cos2d, sin2d, positions = host_checked(inp, case)
    dk, dv, _ = make_upstream_grads(kv, case)
    return case, dk, dv, cos2d, sin2d, positions


def sequential_head_sum(g: torch.Tensor) -> torch.Tensor:
    """``[T, H, R] -> [T, R]`` fp32, heads added one after the other (an order the kernel does
    not use: the tests check that it gives other bits, so they can tell the orders apart)."""
    total = g[:, 0]
    for h in range(1, g.shape[1]):
        total = total + g[:, h]
    return total


@pytest.mark.parametrize("heads", HEAD_SUM_COUNTS)
def test_head_sum_order_on_padding_rows(heads, device):
    """``dk_pe`` on thd padding rows (no rotation) is bit for bit ``fixed_order_head_sum`` of
    ``dk[..., K:]`` re-laid out, rounded once (fp32: exact), for head counts that exercise the
    16-head chunks, the -0.0 padding of missing heads and the chunk loop (a dropped, doubled or
    reordered chunk, or another tree, changes bits); real rows are held to the error model."""
    case, dk, dv, cos2d, sin2d, positions = padded_case(heads, torch.float32, device)
    dkv, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)

    pad = slice(CU_EDGES[-1], None)
    g = dk[pad, :, case.k_dim :].float()
    total = fixed_order_head_sum(g).to(case.dtype)
    want = relayout(total, case.interleaved_out, case.interleaved)
    assert bitwise_equal(dk_pe[pad], want), f"{heads} heads: padding rows' dk_pe"
    if heads >= 3:  # the comparison can see the order: plain summation gives other bits
        other = relayout(sequential_head_sum(g), case.interleaved_out, case.interleaved)
        assert not bitwise_equal(other, want), "test inputs too weak to tell summation orders"


ZERO_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]
)


@ZERO_DTYPES
@pytest.mark.parametrize("heads", [3, 16, 20])
def test_head_sum_of_negative_zeros_is_negative_zero(heads, dtype, device):
    """-0.0 is the head sum's identity (kernels/kv.py): an all -0.0 ``dk[..., K:]`` gives
    -0.0 ``dk_pe`` (sign bit set) on padding rows, where nothing is rotated. Fails if missing
    heads load as +0.0 or the sum starts from +0.0; every element of ``dk_pe`` is a zero."""
    case, dk, dv, cos2d, sin2d, positions = padded_case(heads, dtype, device)
    dk[..., case.k_dim :] = torch.tensor(-0.0, dtype=dtype, device=device)
    assert bool(torch.signbit(dk[..., case.k_dim :]).all())
    _, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case)
    assert bool((dk_pe == 0).all()), "dk_pe is not all zeros"
    pad = slice(CU_EDGES[-1], None)
    assert bool(torch.signbit(dk_pe[pad]).all()), "padding rows' dk_pe lost the sign of -0.0"


@ZERO_DTYPES
@pytest.mark.parametrize("heads", [3, 20])
def test_head_sum_of_positive_zeros_is_positive_zero(heads, dtype, device):
    """An all +0.0 ``dk[..., K:]``, and one that is -0.0 but for a single +0.0 head, give +0.0
    ``dk_pe`` on padding rows (IEEE round-to-nearest: -0.0 + +0.0 = +0.0): no head is dropped
    from the sum and no sign is invented. Every element of ``dk_pe`` is a zero."""
    case, dk, dv, cos2d, sin2d, positions = padded_case(heads, dtype, device)
    pad = slice(CU_EDGES[-1], None)
    mixed = torch.full((heads, 1), -0.0, dtype=dtype)
    mixed[heads // 2] = 0.0
    for name, zeros in (("all +0.0", torch.tensor(0.0, dtype=dtype)), ("one +0.0 head", mixed)):
        dk[..., case.k_dim :] = zeros.to(device)
        _, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case)
        assert bool((dk_pe == 0).all()), f"{name}: dk_pe is not all zeros"
        assert not bool(torch.signbit(dk_pe[pad]).any()), f"{name}: padding rows' dk_pe is -0.0"
