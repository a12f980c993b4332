"""The key/value op's Triton kernels against the fp64 reference, over the issue's matrix.

Runs on the ``device`` fixture: CPU tensors under Triton's interpreter in the CPU lane, CUDA in
the GPU lane (which adds the ``gpu``-marked tests). The launchers are called directly with
NaN-poisoned outputs, so an element the kernels never write fails; the public API and autograd
are checked against the launchers bit for bit.

What is compared, element by element (the error model (docs/design.md), ``tests/errmodel.py``):

- forward ``k[..., :K]`` and ``v``: exact copies of ``kv``;
- forward ``k[..., K:]``: the rotated ``k_pe``, within the rotation tolerance;
- backward ``dkv``: an exact copy of ``dk[..., :K]`` and ``dv``;
- backward ``dk_pe``: within the head-sum tolerance derived at :func:`dk_pe_tolerance`.

The matrix is a covering selection, not the full product: each test varies one or two
dimensions around a default case, so the whole file stays well under a minute in the CPU lane.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

import mlarope
from mlarope import _checks, reference
from mlarope.kernels.kv import (
    KVLaunchConfig,
    choose_kv_backward_config,
    choose_kv_config,
    rope_kv_backward_launch,
    rope_kv_launch,
)
from mlarope.ops import KVCall, rope_kv_backward
from mlarope.positions import Positions
from tests.errmodel import assert_close_elementwise, join_pairs, poisoned_like, rope_tolerance

# ---------------------------------------------------------------------------------------------
# cases and inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    layout: str = "thd"
    tokens: tuple[int, ...] = (6,)
    heads: int = 3
    k_dim: int = 48
    v_dim: int = 40
    rope: int = 64
    dtype: torch.dtype = torch.bfloat16
    table_dtype: torch.dtype = torch.float32
    interleaved: bool = True
    interleaved_out: bool = False
    copy_v: bool = True
    pe_form: str = "1R"  # "1R": k_pe [..., 1, R]; "R": k_pe [..., R]
    source: str = "seq"  # seq (index along S) | cu (cu_seqlens) | ids (position_ids)
    cu: tuple[int, ...] = ()
    ids_shape: tuple[int, ...] | None = None  # position_ids shape (broadcast); None: tokens
    cp_size: int = 1
    cp_rank: int = 0
    view: str = "contiguous"  # contiguous | fused (misaligned slices) | strided (+ token strides)
    table_rows: int = 48


def case_id(case: Case) -> str:
    """A short test id: only the fields that differ from the default case."""
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, tuple):
                value = "x".join(map(str, value)) or "none"
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


def random_tables(rows: int, rope: int, dtype: torch.dtype, device) -> tuple:
    """General tables (the halves differ, |c|, |s| up to 1.5 like a YaRN attention factor)."""
    theta = torch.rand(rows, rope, dtype=torch.float64) * 6.3
    scale = 1.0 + 0.5 * torch.rand(rows, 1, dtype=torch.float64)
    cos = (theta.cos() * scale).to(dtype).to(device)
    sin = (theta.sin() * scale).to(dtype).to(device)
    return cos, sin


def activation(
    tokens: tuple[int, ...], inner: tuple[int, ...], dtype, device, view: str, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``randn(*tokens, *inner)`` in ``dtype``, laid out as asked -> (tensor, owning buffer).

    ``fused``: a slice ``big[..., offset : offset + inner[-1]]`` of a wider fused projection
    (last dim contiguous, token and head dims strided, misaligned by ``offset`` elements);
    ``strided``: the same, with the token dims transposed in memory (two token dims) or every
    other token (thd).
    """
    if view == "contiguous":
        t = torch.randn(*tokens, *inner).to(dtype).to(device)
        return t, t
    extra = 7 + offset
    wide = (*inner[:-1], inner[-1] + extra)
    if view == "fused":
        big = torch.randn(*tokens, *wide).to(dtype).to(device)
        owner = big
    elif len(tokens) == 2:
        owner = torch.randn(tokens[1], tokens[0], *wide).to(dtype).to(device)
        big = owner.transpose(0, 1)
    else:
        owner = torch.randn(2 * tokens[0], *wide).to(dtype).to(device)
        big = owner[::2]
    t = big[..., offset : offset + inner[-1]]
    assert t.stride(-1) == 1 and not t.is_contiguous()
    return t, owner


@dataclass
class Inputs:
    kv: torch.Tensor  # [tokens..., H, K + V]
    k_pe: torch.Tensor  # [tokens..., 1, R] or [tokens..., R], as the user passes it
    cos: torch.Tensor
    sin: torch.Tensor
    kwargs: dict  # layout and position source, as apply_rope_kv takes them
    owners: list  # every buffer the op must leave untouched


def make_inputs(case: Case, device) -> Inputs:
    kv, kv_owner = activation(
        case.tokens, (case.heads, case.k_dim + case.v_dim), case.dtype, device, case.view, 3
    )
    pe_inner = (1, case.rope) if case.pe_form == "1R" else (case.rope,)
    k_pe, pe_owner = activation(case.tokens, pe_inner, case.dtype, device, case.view, 37)
    cos, sin = random_tables(case.table_rows, case.rope, case.table_dtype, device)
    kwargs = dict(layout=case.layout, cp_rank=case.cp_rank, cp_size=case.cp_size)
    owners = [kv_owner, pe_owner, cos, sin]
    if case.source == "cu":
        kwargs["cu_seqlens"] = torch.tensor(case.cu, dtype=torch.int32, device=device)
    elif case.source == "ids":
        shape = case.ids_shape or case.tokens
        kwargs["position_ids"] = torch.randint(0, case.table_rows, shape).to(device)
    owners += [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
    return Inputs(kv, k_pe, cos, sin, kwargs, owners)


def checked(inp: Inputs, case: Case):
    """The public API's host checks -> (kv, k_pe [..., R], cos2d, sin2d, positions)."""
    kv, k_pe, _, cos2d, sin2d, positions = _checks.check_kv_call(
        inp.kv,
        inp.k_pe,
        inp.cos,
        inp.sin,
        case.k_dim,
        case.layout,
        inp.kwargs.get("cu_seqlens"),
        inp.kwargs.get("position_ids"),
        case.cp_rank,
        case.cp_size,
        case.interleaved,
        case.interleaved_out,
    )
    return kv, k_pe, cos2d, sin2d, positions


def snapshot(tensors) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN == NaN, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def assert_untouched(before: list, after: list, what: str) -> None:
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert bitwise_equal(b, a), f"{what}: input buffer {i} was modified"


# ---------------------------------------------------------------------------------------------
# launches into poisoned (and, for strided views, guarded) outputs
# ---------------------------------------------------------------------------------------------

GUARD = 5  # NaN channels on either side of a guarded output's rows


def guarded(shape: tuple[int, ...], dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned strided view with ``GUARD`` NaN channels before and after every row."""
    buf = torch.full((*shape[:-1], shape[-1] + 2 * GUARD), float("nan"), dtype=dtype, device=device)
    return buf[..., GUARD : GUARD + shape[-1]], buf


def guarded_flat(shape: tuple[int, ...], dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous NaN-poisoned tensor with ``GUARD`` NaN elements before and after it."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype, device=device)
    return buf[GUARD : GUARD + n].view(shape), buf


def assert_guards_nan(buf: torch.Tensor, flat: bool, what: str) -> None:
    guards = (
        torch.cat((buf[:GUARD], buf[-GUARD:]))
        if flat
        else torch.cat((buf[..., :GUARD], buf[..., -GUARD:]), dim=-1)
    )
    assert bool(guards.isnan().all()), f"{what}: the kernel wrote outside its output"


def forward(kv, k_pe, cos2d, sin2d, positions, case: Case, config=None, guard=False):
    """``rope_kv_launch`` into NaN-poisoned ``k`` and ``v`` (``v`` only with ``copy_v``)."""
    k_shape = (*kv.shape[:-1], case.k_dim + case.rope)
    v_shape = (*kv.shape[:-1], case.v_dim)
    if guard:
        (k, k_buf), (v, v_buf) = (
            guarded(k_shape, kv.dtype, kv.device),
            guarded(v_shape, kv.dtype, kv.device),
        )
    else:
        k, v = poisoned_like(kv, k_shape), poisoned_like(kv, v_shape)
    rope_kv_launch(
        kv,
        k_pe,
        k,
        v if case.copy_v else None,
        cos2d,
        sin2d,
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
        config=config,
    )
    if guard:
        assert_guards_nan(k_buf, False, "forward k")
        assert_guards_nan(v_buf, False, "forward v")
    return k, (v if case.copy_v else None)


def backward(dk, dv, cos2d, sin2d, positions, case: Case, config=None, guard=False):
    """``rope_kv_backward_launch`` into NaN-poisoned ``dkv`` and (contiguous) ``dk_pe``."""
    dkv_shape = (*dk.shape[:-1], case.k_dim + case.v_dim)
    pe_shape = (*dk.shape[:-2], case.rope)
    if guard:
        dkv, dkv_buf = guarded(dkv_shape, dk.dtype, dk.device)
        dk_pe, pe_buf = guarded_flat(pe_shape, dk.dtype, dk.device)
    else:
        dkv, dk_pe = poisoned_like(dk, dkv_shape), poisoned_like(dk, pe_shape)
    rope_kv_backward_launch(
        dk,
        dv,
        dkv,
        dk_pe,
        cos2d,
        sin2d,
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
        config=config,
    )
    if guard:
        assert_guards_nan(dkv_buf, False, "backward dkv")
        assert_guards_nan(pe_buf, True, "backward dk_pe")
    return dkv, dk_pe


def make_grads(kv: torch.Tensor, case: Case):
    """Upstream gradients ``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]``, laid out
    like the case's inputs (strided views for the view cases) -> (dk, dv, owners)."""
    tokens = tuple(kv.shape[:-2])
    dk, dk_owner = activation(
        tokens, (case.heads, case.k_dim + case.rope), kv.dtype, kv.device, case.view, 2
    )
    dv, dv_owner = activation(tokens, (case.heads, case.v_dim), kv.dtype, kv.device, case.view, 1)
    return dk, dv, [dk_owner, dv_owner]


# ---------------------------------------------------------------------------------------------
# the fp64 reference and the error model
# ---------------------------------------------------------------------------------------------


def forward_truth(kv, k_pe, cos2d, sin2d, positions, case: Case):
    """fp64 ``k_rope: [tokens..., 1, R]`` (the same for every head) and its tolerance."""
    cos64, sin64 = cos2d.double(), sin2d.double()
    k_ref, _ = reference.rope_kv(
        kv.double(),
        k_pe.double(),
        cos64,
        sin64,
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    truth = k_ref[..., :1, case.k_dim :]
    # One rotation of exact inputs with exact (upcast) table entries, rounded once to the dtype.
    tol = rope_tolerance(
        k_pe.double().unsqueeze(-2),
        cos64,
        sin64,
        positions,
        truth,
        kv.dtype,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    return truth, tol


def dk_pe_tolerance(dk, cos2d, sin2d, positions, truth, case: Case) -> torch.Tensor:
    """Per-element tolerance of ``dk_pe``, from the error model.

    The kernel forms ``G = ((g_0 + g_1) + g_2) + ... + g_{H-1}`` in fp32 (the g_h are exact:
    bf16/fp16/fp32 upcast), then rotates ``G`` by the transpose (``d_a = G_a*c_a + G_b*s_b``,
    ``d_b = G_b*c_b - G_a*s_a``) in fp32 and rounds once to the dtype. Let ``u = 2**-24``.

    1. Recursive summation: ``|G_hat - G| <= (H - 1) * u * sum_h |g_h|`` (each of the ``H - 1``
       additions errs by at most ``u`` times a partial sum, and every partial sum is bounded by
       ``sum_h |g_h|``; the second-order ``O(H^2 u^2)`` term is far below the slack in 3).
    2. That error goes through the rotation: ``|c*dG_a + s*dG_b| <= (|dG_a| + |dG_b|) * m``,
       ``m = max(|c_a|, |c_b|, |s_a|, |s_b|)``, i.e. at most
       ``(H - 1) * u * (sum|g_a| + sum|g_b|) * m``.
    3. The fp32 rotation of ``G_hat`` itself: two products and one add, ``<= 3u * (|G_a c| +
       |G_b s|) <= 3u * (sum|g_a| + sum|g_b|) * m`` (the errmodel's rotation term, with the
       sums of absolute values standing in for ``|G|``).
    4. One rounding to the output dtype: 1 ulp at ``|truth| + arith`` (half an ulp when
       correctly rounded; the interpreter truncates, within one).

    Total: ``(3 + H - 1) * u * (sum|g_a| + sum|g_b|) * m + ulp``, which is
    ``rope_tolerance`` fed ``sum_h |g_h|`` with ``summed_terms = H``. The pairs are read in
    ``k``'s rope layout (``interleaved_out``) and written in ``k_pe``'s (``interleaved``).
    """
    abs_sum = dk[..., case.k_dim :].double().abs().sum(dim=-2, keepdim=True)  # [tokens, 1, R]
    return rope_tolerance(
        abs_sum,
        cos2d.double(),
        sin2d.double(),
        positions,
        truth.unsqueeze(-2),
        dk.dtype,
        interleaved_in=case.interleaved_out,
        interleaved_out=case.interleaved,
        summed_terms=dk.shape[-2],
    ).squeeze(-2)


def check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case: Case) -> None:
    what = f"forward {case_id(case)}"
    assert k.shape == (*kv.shape[:-1], case.k_dim + case.rope), what
    assert bitwise_equal(k[..., : case.k_dim], kv[..., : case.k_dim]), f"{what}: k[..., :K]"
    if v is not None:
        assert bitwise_equal(v, kv[..., case.k_dim :]), f"{what}: v"
    truth, tol = forward_truth(kv, k_pe, cos2d, sin2d, positions, case)
    k_rope = k[..., case.k_dim :]
    assert_close_elementwise(k_rope, truth.expand_as(k_rope), tol.expand_as(k_rope), what)
    # Every head carries the same rounded rotation (one rounding, shared).
    assert bitwise_equal(k_rope, k_rope[..., :1, :].expand_as(k_rope)), f"{what}: heads differ"


def check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case: Case) -> None:
    what = f"backward {case_id(case)}"
    expected_dkv = torch.cat((dk[..., : case.k_dim], dv), dim=-1)
    assert bitwise_equal(dkv, expected_dkv), f"{what}: dkv is not an exact copy"
    dkv_ref, truth = reference.rope_kv_backward(
        dk.double(),
        dv.double(),
        cos2d.double(),
        sin2d.double(),
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    assert torch.equal(dkv.double(), dkv_ref), f"{what}: dkv against the reference"
    tol = dk_pe_tolerance(dk, cos2d, sin2d, positions, truth, case)
    assert_close_elementwise(dk_pe, truth, tol, f"{what}: dk_pe")


def check_case(case: Case, device, inp: Inputs | None = None) -> None:
    """Forward and backward launchers, poisoned outputs, fp64 reference, inputs untouched.
    Strided-view cases write into guarded strided outputs."""
    guard = case.view != "contiguous"
    inp = inp or make_inputs(case, device)
    before = snapshot(inp.owners)
    kv, k_pe, cos2d, sin2d, positions = checked(inp, case)
    k, v = forward(kv, k_pe, cos2d, sin2d, positions, case, guard=guard)
    assert_untouched(before, inp.owners, f"forward {case_id(case)}")
    check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)

    dk, dv, grad_owners = make_grads(kv, case)
    grads_before = snapshot(grad_owners)
    dkv, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case, guard=guard)
    assert_untouched(grads_before, grad_owners, f"backward {case_id(case)} (dk, dv)")
    assert_untouched(before, inp.owners, f"backward {case_id(case)} (tables, positions)")
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)


# ---------------------------------------------------------------------------------------------
# the matrix
# ---------------------------------------------------------------------------------------------

# thd with cu_seqlens: an empty first sequence, 5 tokens, a one-token sequence, another empty
# one, 7 tokens, then 3 padding tokens (the tensor has 16 tokens, cu_seqlens[-1] = 13).
CU_EDGES = (0, 0, 5, 6, 6, 13)

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


# ---------------------------------------------------------------------------------------------
# determinism: every launch configuration, repeated runs
# ---------------------------------------------------------------------------------------------


def launch_configs(device, n_tokens: int, heads: int, widths: tuple[int, int, int]):
    """The heuristics' picks for this shape and for other shapes, and a covering set of tilings.

    On the GPU every combination of ``block_t`` x ``block_h`` x ``block_c`` x ``num_warps``;
    under the interpreter (which ignores ``num_warps``) a pairwise-covering subset.
    """
    k_dim, v_dim, rope = widths
    picks = {
        choose_kv_config(n_tokens, heads, max(k_dim, v_dim, rope)),
        choose_kv_backward_config(n_tokens, heads, max(k_dim, v_dim), rope),
        choose_kv_config(1, 1, 16),
        choose_kv_backward_config(4096, 128, 512, 64),
        choose_kv_config(4096, 128, 512),
    }
    grid = itertools.product((1, 2, 4), (1, 2, 4, 16), (16, 32, 128), (1, 4))
    if device.type != "cuda":
        # Every (block_t, block_h), (block_h, block_c) and (block_t, block_c) pair at least once.
        grid = [
            (1, 1, 16, 1),
            (1, 2, 32, 4),
            (1, 4, 128, 1),
            (1, 16, 16, 4),
            (2, 1, 32, 4),
            (2, 2, 128, 1),
            (2, 4, 16, 4),
            (2, 16, 128, 1),
            (4, 1, 128, 4),
            (4, 2, 16, 1),
            (4, 4, 32, 4),
            (4, 16, 32, 1),
        ]
    return sorted(picks, key=repr) + [KVLaunchConfig(*c) for c in grid]


# Small enough for the interpreter (every config re-launches both kernels, down to one token
# and one head per program); the GPU lane scales them up (see ``scaled_for``).
CU_SMALL = (0, 0, 3, 4, 4, 6)  # empty, 3 tokens, 1 token, empty, 2 tokens; then 2 padding tokens
CU_BIG = (0, 0, 1, 38, 38, 538, 539, 1537, 2000)  # GPU lane: 8 sequences, 10 padding tokens
CONFIG_CASES = [
    Case(layout="thd", tokens=(8,), source="cu", cu=CU_SMALL, heads=3, k_dim=40, v_dim=24),
    # Two head-sum chunks, the second mostly missing heads; head blocks that divide 20 and
    # that leave a partial block; an odd token count.
    Case(layout="thd", tokens=(9,), source="cu", cu=CU_SMALL, heads=20, k_dim=40, v_dim=24),
    # Without copy_v the forward loads its first channel block early and copies the rest
    # (k_dim 40 > block_c 16 or 32) after the rotation.
    Case(
        layout="thd",
        tokens=(8,),
        source="cu",
        cu=CU_SMALL,
        heads=3,
        k_dim=40,
        v_dim=24,
        copy_v=False,
    ),
    Case(
        layout="sbhd",
        tokens=(4, 2),
        heads=3,
        k_dim=16,
        v_dim=40,
        dtype=torch.float16,
        interleaved=False,
        interleaved_out=True,
        cp_size=2,
        cp_rank=1,
        table_rows=16,
    ),
]


def scaled_for(case: Case, device) -> Case:
    """On the GPU, the same case at a realistic size (DeepSeek-V3 widths, many heads), where a
    config-dependent race or reduction order would show; unchanged under the interpreter. thd
    cases keep their head count modulo 16, so a partial head-sum chunk stays partial."""
    if device.type != "cuda":
        return case
    if case.layout == "thd":
        return replace(
            case,
            tokens=(CU_BIG[-1] + 10,),
            cu=CU_BIG,
            heads=128 + case.heads % 16,
            k_dim=128,
            v_dim=128,
            table_rows=2048,
        )
    return replace(case, tokens=(256, 4), heads=16, k_dim=128, v_dim=128, table_rows=512)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=case_id)
def test_identical_for_every_launch_config(case, device):
    case = scaled_for(case, device)
    inp = make_inputs(case, device)
    kv, k_pe, cos2d, sin2d, positions = checked(inp, case)
    dk, dv, _ = make_grads(kv, case)
    n_tokens = kv.shape[0] * (kv.shape[1] if kv.dim() == 4 else 1)
    configs = launch_configs(device, n_tokens, case.heads, (case.k_dim, case.v_dim, case.rope))
    first = None
    for config in configs:
        k, v = forward(kv, k_pe, cos2d, sin2d, positions, case, config=config)
        dkv, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case, config=config)
        if first is None:
            first = (k, v, dkv, dk_pe)
            check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)
            check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)
            continue
        for name, got, want in zip(
            ("k", "v", "dkv", "dk_pe"), (k, v, dkv, dk_pe), first, strict=True
        ):
            if want is None:  # v without copy_v
                assert got is None
                continue
            assert bitwise_equal(got, want), f"{name} differs with {config} vs {configs[0]}"


def test_dk_pe_bitwise_repeatable(device):
    """20 backward runs give the same bits (no atomics: the head sum has a fixed order)."""
    case = Case(layout="thd", tokens=(8,), source="cu", cu=CU_SMALL, heads=16, k_dim=16, v_dim=16)
    case = scaled_for(case, device)
    inp = make_inputs(case, device)
    kv, _, cos2d, sin2d, positions = checked(inp, case)
    dk, dv, _ = make_grads(kv, case)
    dkv0, dk_pe0 = backward(dk, dv, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv0, dk_pe0, cos2d, sin2d, positions, case)
    for run in range(19):
        dkv, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case)
        assert bitwise_equal(dk_pe, dk_pe0), f"dk_pe differs on run {run + 1}"
        assert bitwise_equal(dkv, dkv0), f"dkv differs on run {run + 1}"


# ---------------------------------------------------------------------------------------------
# out-of-range positions and padding
# ---------------------------------------------------------------------------------------------


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
    kv, k_pe, cos2d, sin2d, positions = checked(inp, case)
    k, v = forward(kv, k_pe, cos2d, sin2d, positions, case)
    dk, dv, _ = make_grads(kv, case)
    dkv, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case)

    bad = bad.to(device)
    expected_nan = torch.zeros(k.shape, dtype=torch.bool, device=device)
    expected_nan[..., case.k_dim :] = bad[:, None, None]
    assert torch.equal(k.isnan(), expected_nan), "k: NaN exactly in the bad rows' rope channels"
    assert torch.equal(dk_pe.isnan(), bad[:, None].expand_as(dk_pe)), "dk_pe: NaN in bad rows"
    assert not bool(v.isnan().any()) and not bool(dkv.isnan().any())
    # Everything else (and the NaN pattern itself) against the reference and the error model.
    check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)


def relayout(x: torch.Tensor, il_in: bool, il_out: bool) -> torch.Tensor:
    """Rope channels ``[..., R]`` read as pairs in one layout (``il_in``: interleaved, else
    halves) and written in the other (``il_out``), values untouched."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if il_in else (x[..., :half], x[..., half:])
    return join_pairs(a, b, il_out)


def fixed_order_head_sum(g: torch.Tensor) -> torch.Tensor:
    """``[T, H, R] -> [T, R]`` in fp32, in the order kernels/kv.py documents: chunks of 16
    heads (missing heads are -0.0), each summed as a pairwise tree (``h + (h + 8)``, then
    ``+ 4``, ``+ 2``, ``+ 1``), the chunks added in head order."""
    n_tokens, heads, rope = g.shape
    padded_heads = 16 * max(1, -(-heads // 16))
    padded = torch.full((n_tokens, padded_heads, rope), -0.0, dtype=g.dtype, device=g.device)
    padded[:, :heads] = g
    total = None
    for h0 in range(0, padded_heads, 16):
        chunk = padded[:, h0 : h0 + 16]
        while chunk.shape[1] > 1:
            half = chunk.shape[1] // 2
            chunk = chunk[:, :half] + chunk[:, half:]
        total = chunk[:, 0] if total is None else total + chunk[:, 0]
    return total


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
    kv, k_pe, cos2d, sin2d, positions = checked(inp, case)
    # Tables full of NaN: a padding row that read them would show it.
    cos_nan, sin_nan = torch.full_like(cos2d, float("nan")), torch.full_like(sin2d, float("nan"))
    k, _ = forward(kv, k_pe, cos_nan, sin_nan, positions, case)
    dk, dv, _ = make_grads(kv, case)
    _, dk_pe = backward(dk, dv, cos_nan, sin_nan, positions, case)

    pad = slice(CU_EDGES[-1], None)
    want_k = relayout(k_pe[pad], interleaved, interleaved_out)
    assert bitwise_equal(k[pad, :, case.k_dim :], want_k[:, None, :].expand(-1, case.heads, -1))
    total = fixed_order_head_sum(dk[pad, :, case.k_dim :].float())
    assert bitwise_equal(dk_pe[pad], relayout(total, interleaved_out, interleaved))
    assert bool(k[: CU_EDGES[-1], :, case.k_dim :].isnan().all()), "real rows read the tables"


# Head counts around the head sum's 16-head chunks: below one chunk (1, 3), exactly one (16),
# one chunk and a partial second (17, 20), two chunks and one head (33: a third chunk of one
# head and 15 missing ones).
HEAD_SUM_COUNTS = [1, 3, 16, 17, 20, 33]
# 20 tokens: CU_EDGES covers 13, so rows 13..19 are padding.
PAD_TOKENS = 20


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
    dkv, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)

    pad = slice(CU_EDGES[-1], None)
    g = dk[pad, :, case.k_dim :].float()
    total = fixed_order_head_sum(g).to(case.dtype)
    want = relayout(total, case.interleaved_out, case.interleaved)
    assert bitwise_equal(dk_pe[pad], want), f"{heads} heads: padding rows' dk_pe"
    if heads >= 3:  # the comparison can see the order: plain summation gives other bits
        other = relayout(sequential_head_sum(g), case.interleaved_out, case.interleaved)
        assert not bitwise_equal(other, want), "test inputs too weak to tell summation orders"


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
    kv, _, cos2d, sin2d, positions = checked(inp, case)
    dk, dv, _ = make_grads(kv, case)
    return case, dk, dv, cos2d, sin2d, positions


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
    _, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case)
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
        _, dk_pe = backward(dk, dv, cos2d, sin2d, positions, case)
        assert bool((dk_pe == 0).all()), f"{name}: dk_pe is not all zeros"
        assert not bool(torch.signbit(dk_pe[pad]).any()), f"{name}: padding rows' dk_pe is -0.0"


# ---------------------------------------------------------------------------------------------
# public API: autograd, copy_v views, torch.compile
# ---------------------------------------------------------------------------------------------

API_CASES = [
    Case(layout="sbhd", tokens=(4, 2), copy_v=True, pe_form="1R"),
    Case(layout="sbhd", tokens=(4, 2), copy_v=False, pe_form="R", view="fused"),
    Case(layout="thd", tokens=(16,), source="cu", cu=CU_EDGES, copy_v=False, pe_form="1R"),
    Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        copy_v=True,
        pe_form="R",
        interleaved=False,
        interleaved_out=True,
    ),
    Case(layout="bshd", tokens=(2, 4), source="ids", copy_v=False, dtype=torch.float16),
]


def api_call(inp: Inputs, case: Case, kv, k_pe):
    return mlarope.apply_rope_kv(
        kv,
        k_pe,
        inp.cos,
        inp.sin,
        k_dim=case.k_dim,
        interleaved=case.interleaved,
        interleaved_out=case.interleaved_out,
        copy_v=case.copy_v,
        **inp.kwargs,
    )


@pytest.mark.parametrize("case", API_CASES, ids=case_id)
def test_public_api_and_autograd_match_launchers(case, device):
    """``apply_rope_kv`` (no grad, then with autograd) returns the launchers' bits, and
    ``.backward()`` leaves the backward launcher's ``dkv``/``dk_pe`` in ``kv.grad``/``k_pe.grad``.
    With ``copy_v=False``, ``v`` is the view ``kv[..., K:]`` and gradients still flow."""
    inp = make_inputs(case, device)
    kv_n, pe_n, cos2d, sin2d, positions = checked(inp, case)
    k_ref, v_ref = forward(kv_n, pe_n, cos2d, sin2d, positions, case)
    dk, dv, _ = make_grads(kv_n, case)
    dkv_ref, dpe_ref = backward(dk, dv, cos2d, sin2d, positions, case)
    before = snapshot(inp.owners)

    k, v = api_call(inp, case, inp.kv, inp.k_pe)  # no autograd
    assert bitwise_equal(k, k_ref)
    if case.copy_v:
        assert bitwise_equal(v, v_ref) and v.is_contiguous()
    else:
        assert v.data_ptr() == inp.kv[..., case.k_dim :].data_ptr()
        assert v.shape == (*inp.kv.shape[:-1], case.v_dim) and v.stride() == inp.kv.stride()

    kv = inp.kv.detach().requires_grad_(True)  # a leaf sharing the (maybe strided) storage
    k_pe = inp.k_pe.detach().requires_grad_(True)
    k, v = api_call(inp, case, kv, k_pe)
    assert bitwise_equal(k.detach(), k_ref)
    if case.copy_v:
        assert bitwise_equal(v.detach(), v_ref)
    else:
        assert v.data_ptr() == kv[..., case.k_dim :].data_ptr()
        assert bitwise_equal(v.detach(), kv.detach()[..., case.k_dim :])
    dk_before, dv_before = dk.clone(), dv.clone()
    torch.autograd.backward((k, v), (dk, dv))
    assert_untouched([dk_before, dv_before], [dk, dv], "autograd backward (dk, dv)")
    assert_untouched(before, inp.owners, "public API")
    assert kv.grad.shape == kv.shape and k_pe.grad.shape == inp.k_pe.shape
    assert bitwise_equal(kv.grad, dkv_ref), "kv.grad != backward launcher dkv"
    assert bitwise_equal(k_pe.grad, dpe_ref.view(inp.k_pe.shape)), "k_pe.grad != launcher dk_pe"


@pytest.mark.slow
@pytest.mark.parametrize("copy_v", [True, False])
def test_torch_compile_fullgraph_matches_eager(copy_v, device):
    """``torch.compile(fullgraph=True)`` traces through the custom ops (fake impls, autograd)
    and gives eager's bits, forward and backward."""
    case = Case(
        layout="thd",
        tokens=(16,),
        source="cu",
        cu=CU_EDGES,
        copy_v=copy_v,
        heads=3,
        k_dim=16,
        v_dim=16,
    )
    inp = make_inputs(case, device)
    dk, dv, _ = make_grads(inp.kv, case)
    w = torch.randn(case.v_dim).to(case.dtype).to(device)

    def step(kv, k_pe, cos, sin, cu_seqlens):
        k, v = mlarope.apply_rope_kv(
            kv,
            k_pe,
            cos,
            sin,
            k_dim=case.k_dim,
            layout="thd",
            cu_seqlens=cu_seqlens,
            copy_v=copy_v,
        )
        # An op after the kernel, so the compiled graph has code of its own. bf16 x bf16 is
        # exact in fp32, so eager and inductor round ``v * w`` (and its gradient) identically.
        return k, v, v * w

    def run(fn):
        kv = inp.kv.detach().clone().requires_grad_(True)
        k_pe = inp.k_pe.detach().clone().requires_grad_(True)
        k, v, vw = fn(kv, k_pe, inp.cos, inp.sin, inp.kwargs["cu_seqlens"])
        if not copy_v:
            assert v.data_ptr() == kv[..., case.k_dim :].data_ptr(), "v must be a view of kv"
        torch.autograd.backward((k, vw), (dk, dv))
        return k.detach(), v.detach(), vw.detach(), kv.grad, k_pe.grad

    torch._dynamo.reset()
    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    names = ("k", "v", "v*w", "kv.grad", "k_pe.grad")
    for name, got, want in zip(names, compiled, eager, strict=True):
        assert bitwise_equal(got, want), f"compiled {name} != eager"


# ---------------------------------------------------------------------------------------------
# GPU lane: correct rounding, CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "min_fraction"),
    [(torch.bfloat16, 0.9999), (torch.float16, 0.999)],
    ids=["bf16", "fp16"],
)
def test_gpu_correct_rounding_and_cuda_graph(dtype, min_fraction, device):
    """On CUDA the rotated ``k`` channels are the round-to-nearest of the fp64 value in at least
    99.99% (bf16) / 99.9% (fp16) of elements (docs/design.md), the rest within the error model; and
    forward and backward replay from a captured CUDA graph with the same bits as eager."""
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    n_tokens, heads, k_dim, v_dim = 8192, 2, 16, 16
    cfg = mlarope.YarnConfig.deepseek_v3()
    cos, sin = cfg.cos_sin(n_tokens, device=device)
    rope = cos.shape[-1]
    kv = torch.randn(n_tokens, heads, k_dim + v_dim, device=device).to(dtype)
    k_pe = (torch.randn(n_tokens, 1, rope, device=device) * 4).to(dtype)

    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=k_dim, layout="thd")
    torch.cuda.synchronize()
    case = Case(
        layout="thd",
        tokens=(n_tokens,),
        heads=heads,
        k_dim=k_dim,
        v_dim=v_dim,
        rope=rope,
        dtype=dtype,
    )
    positions = Positions("thd", None, None, 0, 1)
    truth, _ = forward_truth(kv, k_pe.squeeze(-2), cos, sin, positions, case)
    check_forward(kv, k_pe.squeeze(-2), k, v, cos, sin, positions, case)
    got = k[:, 0, k_dim:]
    correctly_rounded = got == truth[:, 0].to(dtype)
    fraction = correctly_rounded.double().mean().item()
    assert fraction >= min_fraction, (
        f"{dtype}: {fraction:.6f} of {got.numel()} rotated elements correctly rounded, "
        f"need {min_fraction}"
    )

    # CUDA graph: capture forward (public API) and backward, replay on new data.
    static_kv, static_pe = kv.clone(), k_pe.clone()
    dk = torch.randn(n_tokens, heads, k_dim + rope, device=device).to(dtype)
    dv = torch.randn(n_tokens, heads, v_dim, device=device).to(dtype)
    static_dk, static_dv = dk.clone(), dv.clone()

    backward_call = KVCall(cos, sin, None, None, None, "thd", 0, 1, k_dim, True, False, True, False)

    def body():
        out_k, out_v = mlarope.apply_rope_kv(
            static_kv, static_pe, cos, sin, k_dim=k_dim, layout="thd"
        )
        dkv, dk_pe = rope_kv_backward(static_dk, static_dv, backward_call)
        return out_k, out_v, dkv, dk_pe

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles the kernels) outside the capture
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()

    new_kv = torch.randn_like(kv, dtype=torch.float32).to(dtype)
    new_pe = torch.randn_like(k_pe, dtype=torch.float32).to(dtype)
    new_dk = torch.randn_like(dk, dtype=torch.float32).to(dtype)
    static_kv.copy_(new_kv)
    static_pe.copy_(new_pe)
    static_dk.copy_(new_dk)
    graph.replay()
    torch.cuda.synchronize()
    eager_k, eager_v = mlarope.apply_rope_kv(new_kv, new_pe, cos, sin, k_dim=k_dim, layout="thd")

    eager_dkv, eager_dpe = rope_kv_backward(new_dk, dv, backward_call)
    for name, got_t, want in zip(
        ("k", "v", "dkv", "dk_pe"), outs, (eager_k, eager_v, eager_dkv, eager_dpe), strict=True
    ):
        assert bitwise_equal(got_t, want), f"CUDA graph replay: {name} != eager"
