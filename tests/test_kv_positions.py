"""The key/value op's position sources, against the fp64 reference (``tests/kv_harness.py``).

Every source of positions: the index along ``S`` (sbhd, bshd), thd as one sequence, thd with
``cu_seqlens`` (empty sequences, padding tokens), explicit ``position_ids`` (broadcast too) and
context parallel's load-balanced split; then the rows without a valid position: a position
outside the table gives NaN in that row's rope channels only, and thd padding rows pass
through unrotated. Each case runs the forward and backward launchers into poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import bitwise_equal
from tests.kv_harness import (
    CU_EDGES,
    Case,
    case_id,
    check_backward,
    check_case,
    check_forward,
    fixed_order_head_sum,
    host_checked,
    launch_backward,
    launch_forward,
    make_inputs,
    make_upstream_grads,
    relayout,
)

LAYOUT_CASES = [
    Case(layout="sbhd", tokens=(5, 2)),
    Case(layout="bshd", tokens=(2, 5)),
    Case(layout="thd", tokens=(7,)),  # no cu_seqlens: one sequence
    Case(layout="thd", tokens=(16,), source="cu", cu=CU_EDGES),
    Case(layout="thd", tokens=(9,), source="cu", cu=(0, 4, 9)),  # no padding
    Case(layout="thd", tokens=(3,), source="cu", cu=(0,)),  # no sequence: all padding
    Case(layout="thd", tokens=(9,), source="ids"),
    Case(layout="sbhd", tokens=(4, 3), source="ids"),
    Case(layout="bshd", tokens=(2, 5), source="ids", ids_shape=(5,)),  # broadcast over B
    Case(layout="sbhd", tokens=(4, 3), source="ids", ids_shape=(4, 1)),  # broadcast over B
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=case_id)
def test_layouts_and_position_sources(case, device):
    check_case(case, device)


# Global cu_seqlens for context parallel: every length (8, 0, 16) a multiple of 2 * cp_size
# for cp_size <= 4, and 2 local padding tokens after cu_seqlens[-1] / cp_size.
CP_CU = (0, 8, 8, 24)
CP_RANKS = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]


def cp_case(layout: str, cp_size: int, cp_rank: int) -> Case:
    """Rank ``cp_rank`` of ``cp_size``: thd with ``CP_CU``, or a local ``S`` of 4."""
    if layout == "thd":
        return Case(
            layout="thd",
            tokens=(CP_CU[-1] // cp_size + 2,),
            source="cu",
            cu=CP_CU,
            cp_size=cp_size,
            cp_rank=cp_rank,
        )
    tokens = (4, 2) if layout == "sbhd" else (2, 4)  # local length 4: two chunks of 2
    return Case(layout=layout, tokens=tokens, cp_size=cp_size, cp_rank=cp_rank, table_rows=16)


@pytest.mark.parametrize("cp", CP_RANKS, ids=lambda cp: f"cp{cp[0]}-rank{cp[1]}")
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_context_parallel(layout, cp, device):
    check_case(cp_case(layout, *cp), device)


@pytest.mark.parametrize("source", ["ids", "cu"])
def test_out_of_range_positions_are_nan_in_that_row_only(source, device):
    """A row whose position is outside the table gets NaN rope channels in ``k`` (every head)
    and in ``dk_pe``; every other element of that row, and every other row, is as usual.
    Padding rows (thd past ``cu_seqlens[-1]``) pass through."""
    rows = 8
    if source == "ids":
        case = Case(layout="thd", tokens=(7,), source="ids", table_rows=rows)
        ids = torch.tensor([0, -1, 7, 8, 3, 1000, 2**31 - 1], dtype=torch.int32)
        bad = torch.tensor([False, True, False, True, False, True, True])
    else:
        # Sequence 1 is 10 long: its positions 8 and 9 (tokens 12, 13) are past the table;
        # tokens 14, 15 are padding.
        case = Case(layout="thd", tokens=(16,), source="cu", cu=(0, 4, 14), table_rows=rows)
        bad = torch.zeros(16, dtype=torch.bool)
        bad[12:14] = True
    inp = make_inputs(case, device)
    if source == "ids":
        inp.kwargs["position_ids"] = ids.to(device)
    kv, k_pe, cos2d, sin2d, positions = host_checked(inp, case)
    k, v = launch_forward(kv, k_pe, cos2d, sin2d, positions, case)
    dk, dv, _ = make_upstream_grads(kv, case)
    dkv, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case)

    bad = bad.to(device)
    expected_nan = torch.zeros(k.shape, dtype=torch.bool, device=device)
    expected_nan[..., case.k_dim :] = bad[:, None, None]
    assert torch.equal(k.isnan(), expected_nan), "k: NaN exactly in the bad rows' rope channels"
    assert torch.equal(dk_pe.isnan(), bad[:, None].expand_as(dk_pe)), "dk_pe: NaN in bad rows"
    assert not bool(v.isnan().any()) and not bool(dkv.isnan().any())
    # Everything else (and the NaN pattern itself) against the reference and the error model.
    check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)


@pytest.mark.parametrize("interleaved_out", [False, True], ids=["out-halves", "out-pairs"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["in-pairs", "in-halves"])
def test_padding_rows_pass_through(interleaved, interleaved_out, device):
    """thd tokens at or past ``cu_seqlens[-1]``: ``k``'s rope channels are ``k_pe`` re-laid out
    (bit for bit, no table read), ``dk_pe`` the fp32 head sum re-laid out, rounded once."""
    case = Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        dtype=torch.float32,
        interleaved=interleaved,
        interleaved_out=interleaved_out,
    )
    inp = make_inputs(case, device)
    kv, k_pe, cos2d, sin2d, positions = host_checked(inp, case)
    # Tables full of NaN: a padding row that read them would show it.
    cos_nan, sin_nan = torch.full_like(cos2d, float("nan")), torch.full_like(sin2d, float("nan"))
    k, _ = launch_forward(kv, k_pe, cos_nan, sin_nan, positions, case)
    dk, dv, _ = make_upstream_grads(kv, case)
    _, dk_pe = launch_backward(dk, dv, cos_nan, sin_nan, positions, case)

    pad = slice(CU_EDGES[-1], None)
    want_k = relayout(k_pe[pad], interleaved, interleaved_out)
    assert bitwise_equal(k[pad, :, case.k_dim :], want_k[:, None, :].expand(-1, case.heads, -1))
    total = fixed_order_head_sum(dk[pad, :, case.k_dim :].float())
    assert bitwise_equal(dk_pe[pad], relayout(total, interleaved_out, interleaved))
    assert bool(k[: CU_EDGES[-1], :, case.k_dim :].isnan().all()), "real rows read the tables"
