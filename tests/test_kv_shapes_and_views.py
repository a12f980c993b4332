"""The key/value op over widths, head counts, dtypes, rope layouts, ``copy_v`` and memory
layouts, against the fp64 reference (``tests/kv_harness.py``).

A covering selection, not the full product: each test varies one or two dimensions around
the default case. Each case runs the forward and backward launchers into poisoned outputs
(guarded strided ones for the view cases) and checks that no input buffer changes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mlarope
from tests.harness import random_tables
from tests.kv_harness import CU_EDGES, Case, case_id, check_case, make_inputs


@pytest.mark.parametrize("v_dim", [16, 40, 512])
@pytest.mark.parametrize("k_dim", [16, 48, 128, 512])
def test_widths(k_dim, v_dim, device):
    # Small token and head counts for the big widths, so the interpreter stays fast.
    big = max(k_dim, v_dim) >= 512
    tokens = (3,) if big else (6,)
    check_case(Case(k_dim=k_dim, v_dim=v_dim, tokens=tokens, heads=2 if big else 3), device)


@pytest.mark.parametrize("interleaved_out", [False, True], ids=["out-halves", "out-pairs"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["in-pairs", "in-halves"])
@pytest.mark.parametrize("rope", [32, 64, 128])
def test_rope_dim_and_interleaving(rope, interleaved, interleaved_out, device):
    case = Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        rope=rope,
        interleaved=interleaved,
        interleaved_out=interleaved_out,
        k_dim=16,
        v_dim=16,
    )
    check_case(case, device)


@pytest.mark.parametrize("heads", [1, 3, 5, 16])
def test_heads(heads, device):
    check_case(Case(layout="sbhd", tokens=(3, 2), heads=heads, k_dim=16, v_dim=40), device)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("table_dtype", DTYPES, ids=lambda d: f"table-{d}".replace("torch.", ""))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtypes(dtype, table_dtype, device):
    check_case(Case(dtype=dtype, table_dtype=table_dtype), device)


@pytest.mark.parametrize("pe_form", ["1R", "R"])
@pytest.mark.parametrize("copy_v", [True, False])
def test_copy_v_and_k_pe_form(copy_v, pe_form, device):
    check_case(Case(layout="bshd", tokens=(2, 4), copy_v=copy_v, pe_form=pe_form), device)


VIEW_CASES = [
    Case(layout="sbhd", tokens=(4, 3), view="fused"),
    Case(layout="sbhd", tokens=(4, 3), view="strided", pe_form="R"),  # token dims transposed
    Case(layout="bshd", tokens=(3, 4), view="strided", interleaved=False, copy_v=False),
    Case(layout="thd", tokens=(16,), source="cu", cu=CU_EDGES, view="fused", pe_form="R"),
    Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        view="strided",
        dtype=torch.float16,
        interleaved_out=True,
    ),
    Case(
        layout="thd",
        tokens=(9,),
        source="ids",
        view="strided",
        dtype=torch.float32,
        k_dim=128,
        v_dim=16,
        heads=5,
    ),
]


@pytest.mark.parametrize("case", VIEW_CASES, ids=case_id)
def test_strided_and_misaligned_views(case, device):
    """Inputs and upstream gradients are slices of wider buffers (misaligned, token dims
    strided or transposed); outputs are strided views into NaN buffers whose guard channels
    must stay NaN; no input buffer changes."""
    check_case(case, device)


@pytest.mark.parametrize("variant", ["strided-ids", "strided-cu-int64", "wide-tables-P11R"])
def test_strided_position_sources_and_tables(variant, device):
    """Non-contiguous ``position_ids`` / ``cu_seqlens`` and ``[P, 1, 1, R]`` tables sliced from
    a wider buffer (row stride > R)."""
    case = Case(layout="thd", tokens=(16,), source="cu", cu=CU_EDGES)
    inp = make_inputs(case, device)
    if variant == "strided-ids":
        ids = torch.randint(0, case.table_rows, (32,), dtype=torch.int32)[::2]
        inp.kwargs = dict(layout="thd", position_ids=ids.to(device))
        case = replace(case, source="ids")
    elif variant == "strided-cu-int64":
        cu = torch.tensor(CU_EDGES, dtype=torch.int64).repeat_interleave(2)[::2]
        inp.kwargs["cu_seqlens"] = cu.to(device)
    else:
        wide = torch.randn(case.table_rows, 1, 1, 2 * case.rope + 8, dtype=torch.float64)
        wide = (wide / 2).to(torch.float32).to(device)
        inp.cos, inp.sin = wide[..., : case.rope], wide[..., case.rope + 8 :]
    inp.owners += [t for t in inp.kwargs.values() if isinstance(t, torch.Tensor)]
    inp.owners += [inp.cos, inp.sin]
    check_case(case, device, inp)


def test_no_tokens(device):
    """Zero tokens: empty outputs and gradients, nothing launched, no error."""
    kv = torch.randn(0, 3, 48 + 40).to(torch.bfloat16).to(device).requires_grad_(True)
    k_pe = torch.randn(0, 1, 64).to(torch.bfloat16).to(device).requires_grad_(True)
    cos, sin = random_tables(8, 64, torch.float32, device)
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=48, layout="thd")
    assert k.shape == (0, 3, 48 + 64) and v.shape == (0, 3, 40)
    torch.autograd.backward((k, v), (torch.ones_like(k), torch.ones_like(v)))
    assert kv.grad.shape == kv.shape and k_pe.grad.shape == k_pe.shape
